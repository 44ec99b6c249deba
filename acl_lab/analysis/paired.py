"""Paired statistics that decide a comparison: over seeds and over examples, with one mechanical verdict.

Two objectives trained with the same seed see the same initial head and the same data
order, so their difference *per seed* removes the seed-to-seed noise both share:

* :func:`seed_paired` -- the per-seed differences ``a - b``, their mean and Student's
  95% t-interval (:func:`acl_lab.analysis.stats.t_interval`, ``scipy.stats.t``);
* :func:`example_paired` -- the two models' per-example correctness on the same dev or
  test examples: the exact McNemar test (``scipy.stats.binomtest`` on the discordant
  pairs) and a paired bootstrap over examples (``scipy.stats.bootstrap(paired=True)``)
  giving a 95% interval of the accuracy difference;
* :func:`verdict` -- an interval that contains 0 is "no difference at this scale"; one
  above 0 is "higher", one below 0 "lower" (the claim is reproduced or refuted in that
  direction);
* :func:`difference_text` -- the table cell, e.g. ``"ACL − CE: +0.4 points, 95% CI [−0.2, +1.0]"``.

With several seeds, the example-paired test works on each example's correctness
averaged over the seeds (each model's seed-mean accuracy is the mean of those), so it
measures the sampling error of the evaluation set for the seed-averaged models.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from ..errors import AclLabError
from .stats import CONFIDENCE, finite, t_interval

if TYPE_CHECKING:
    import pandas as pd

    from ..result import TrainResult

NO_DIFFERENCE = "no difference at this scale"
HIGHER, LOWER = "higher", "lower"
TOO_FEW = "too few seeds"
MINUS = "\u2212"  # typographic minus, as in the tables


def verdict(low: float, high: float) -> str:
    """The mechanical verdict of an interval of ``a - b``: "higher", "lower", or "no difference at this scale"."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return TOO_FEW
    if low > 0:
        return HIGHER
    if high < 0:
        return LOWER
    return NO_DIFFERENCE


def seed_paired(a: Mapping[int, float], b: Mapping[int, float], confidence: float = CONFIDENCE) -> dict:
    """Paired difference over the seeds both ``a`` and ``b`` have (``{seed: score}``): per-seed ``a - b``,
    ``n``, ``mean``, t-interval ``ci_low``/``ci_high`` and the :func:`verdict`."""
    seeds = sorted(set(a) & set(b))
    diffs = {s: float(a[s]) - float(b[s]) for s in seeds}
    values = finite(diffs.values())
    low, high = t_interval(values, confidence)
    return {"seeds": seeds, "diffs": diffs, "n": int(len(values)),
            "mean": float(values.mean()) if len(values) else math.nan,
            "ci_low": low, "ci_high": high, "verdict": verdict(low, high)}


def mcnemar_exact(correct_a: Iterable, correct_b: Iterable) -> dict:
    """Exact McNemar test of two models' per-example correctness (booleans, same examples in the same order).

    Only the discordant examples count: ``a_only`` (a right, b wrong) and ``b_only``. Under
    "no difference" each discordant example is a fair coin, so the p-value is the two-sided
    binomial test of ``a_only`` out of ``a_only + b_only`` at 1/2 (``scipy.stats.binomtest``);
    1.0 when there is no discordant example.
    """
    from scipy import stats

    ca, cb = _bools(correct_a), _bools(correct_b)
    _same_length(ca, cb)
    a_only, b_only = int(np.sum(ca & ~cb)), int(np.sum(~ca & cb))
    n = a_only + b_only
    p = float(stats.binomtest(a_only, n, 0.5).pvalue) if n else 1.0
    return {"a_only": a_only, "b_only": b_only, "pvalue": p}


def paired_bootstrap(values_a: Iterable, values_b: Iterable, confidence: float = CONFIDENCE,
                     n_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``mean(a) - mean(b)`` resampling examples in pairs (``scipy.stats.bootstrap``,
    ``paired=True``). ``values`` are per-example scores, e.g. correctness (0/1) or its mean over seeds."""
    from scipy import stats

    a, b = np.asarray(list(values_a), dtype=float), np.asarray(list(values_b), dtype=float)
    _same_length(a, b)
    if len(a) < 2:
        return math.nan, math.nan
    d = a - b
    if np.all(d == d[0]):  # every resample gives the same difference: the interval is that point
        return float(d[0]), float(d[0])
    res = stats.bootstrap((a, b), lambda x, y, axis=-1: np.mean(x, axis=axis) - np.mean(y, axis=axis), paired=True,
                          vectorized=True, confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                          random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def example_paired(pred_a: Mapping[int, np.ndarray], pred_b: Mapping[int, np.ndarray],
                   labels: np.ndarray, confidence: float = CONFIDENCE, n_resamples: int = 2000) -> dict:
    """Example-paired comparison of two objectives' predictions ``{seed: class ids}`` on the same ``labels``.

    Returns the accuracy difference (seed-averaged), its paired-bootstrap interval and
    verdict, and the exact McNemar p-value of every seed both have (``mcnemar``: {seed: p}).
    """
    labels = np.asarray(labels)
    seeds = sorted(set(pred_a) & set(pred_b))
    if not seeds:
        raise AclLabError("No seed has predictions from both models. Fix: train both objectives with the same seeds.")
    ca = np.stack([np.asarray(pred_a[s]) == labels for s in seeds]).astype(float)
    cb = np.stack([np.asarray(pred_b[s]) == labels for s in seeds]).astype(float)
    low, high = paired_bootstrap(ca.mean(0), cb.mean(0), confidence, n_resamples)
    mcnemar = {s: mcnemar_exact(ca[i] > 0, cb[i] > 0)["pvalue"] for i, s in enumerate(seeds)}
    return {"seeds": seeds, "examples": int(len(labels)), "mean": float(ca.mean() - cb.mean()),
            "ci_low": low, "ci_high": high, "verdict": verdict(low, high), "mcnemar": mcnemar}


def signed(value: float, digits: int = 1) -> str:
    """``+0.4`` / ``−0.2`` with a typographic minus (``nan`` as "nan")."""
    if not math.isfinite(value):
        return "nan"
    text = f"{value:+.{digits}f}"
    return text.replace("-", MINUS)


def difference_text(name_a: str, name_b: str, mean: float, low: float, high: float, scale: float = 100.0,
                    unit: str = "points", digits: int = 1) -> str:
    """``"ACL − CE: +0.4 points, 95% CI [−0.2, +1.0]"`` (accuracies times ``scale`` = 100: points); without an
    interval (one seed) ``"ACL − CE: +0.4 points, no interval from one value"``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{name_a} {MINUS} {name_b}: {signed(mean * scale, digits)} {unit}, no interval from one value"
    return (f"{name_a} {MINUS} {name_b}: {signed(mean * scale, digits)} {unit}, "
            f"{round(CONFIDENCE * 100)}% CI [{signed(low * scale, digits)}, {signed(high * scale, digits)}]")


def _bools(values: Iterable) -> np.ndarray:
    return np.asarray(list(values)).astype(bool)


def _same_length(a: np.ndarray, b: np.ndarray) -> None:
    if len(a) != len(b):
        raise AclLabError(f"Paired data of different lengths ({len(a)} and {len(b)}). Fix: compare predictions on "
                          "the same examples, in the same order (the same split of the same task).")


# ---------------------------------------------------------------------------
# tables over runs
# ---------------------------------------------------------------------------

def paired_frame(groups: Mapping[str, Mapping[int, "TrainResult"]], pairs: Iterable[tuple[str, str]],
                 splits: Iterable[str] = ("dev", "test"), metric: str = "accuracy",
                 n_resamples: int = 2000) -> "pd.DataFrame":
    """One row per (pair, split): the seed-paired difference of the final exit's ``metric`` and, where both runs
    saved ``predictions.npz`` and ``metric`` is accuracy, the example-paired one.

    ``groups`` maps a name (e.g. "acl") to ``{seed: TrainResult}``; ``pairs`` lists ``(a, b)`` read "a - b".
    Numeric columns: ``seed_mean``/``seed_low``/``seed_high``/``seed_verdict`` and
    ``example_mean``/``example_low``/``example_high``/``example_verdict``/``mcnemar`` (p per seed).
    """
    import pandas as pd

    from ..result import load_predictions

    rows = []
    for a, b in pairs:
        ga, gb = groups[a], groups[b]
        for split in splits:
            sa = {s: r.metrics[split][metric] for s, r in ga.items() if metric in r.metrics.get(split, {})}
            sb = {s: r.metrics[split][metric] for s, r in gb.items() if metric in r.metrics.get(split, {})}
            if not sa or not sb:
                continue
            sp = seed_paired(sa, sb)
            row = {"a": a, "b": b, "split": split, "seeds": sp["n"], "seed_mean": sp["mean"], "seed_low": sp["ci_low"],
                   "seed_high": sp["ci_high"], "seed_verdict": sp["verdict"], "examples": math.nan,
                   "example_mean": math.nan, "example_low": math.nan, "example_high": math.nan,
                   "example_verdict": "-", "mcnemar": {}}
            seeds = sp["seeds"]
            if metric == "accuracy" and all(ga[s].paths["predictions"].is_file() and gb[s].paths["predictions"].is_file()
                                            for s in seeds):
                pa = {s: load_predictions(ga[s].output_dir)[split] for s in seeds}
                pb = {s: load_predictions(gb[s].output_dir)[split] for s in seeds}
                labels = pa[seeds[0]]["labels"]
                if all(np.array_equal(p["labels"], labels) for p in [*pa.values(), *pb.values()]):
                    ex = example_paired({s: p["predictions"][-1] for s, p in pa.items()},
                                        {s: p["predictions"][-1] for s, p in pb.items()}, labels,
                                        n_resamples=n_resamples)
                    row.update(examples=ex["examples"], example_mean=ex["mean"], example_low=ex["ci_low"],
                               example_high=ex["ci_high"], example_verdict=ex["verdict"], mcnemar=ex["mcnemar"])
            rows.append(row)
    return pd.DataFrame(rows)


def format_paired(frame: "pd.DataFrame", scale: float = 100.0, unit: str = "points") -> "pd.DataFrame":
    """:func:`paired_frame` as table text: "a − b: +0.4 points, 95% CI [−0.2, +1.0]" and the verdicts."""
    import pandas as pd

    rows = []
    for r in frame.itertuples():
        ex = (difference_text(r.a, r.b, r.example_mean, r.example_low, r.example_high, scale, unit)
              if math.isfinite(r.example_mean) else "-")
        rows.append({"split": r.split, "seeds": r.seeds,
                     "paired over seeds": difference_text(r.a, r.b, r.seed_mean, r.seed_low, r.seed_high, scale, unit),
                     "verdict (seeds)": r.seed_verdict,
                     "paired over examples (bootstrap)": ex, "verdict (examples)": r.example_verdict,
                     "McNemar p per seed": ", ".join(f"{p:.2g}" for p in r.mcnemar.values()) or "-"})
    return pd.DataFrame(rows)
