"""Paired statistics against scipy on constructed data with a known answer, and the mechanical verdict."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from acl_lab.analysis.paired import (HIGHER, LOWER, NO_DIFFERENCE, TOO_FEW, difference_text, example_paired,
                                     mcnemar_exact, paired_bootstrap, seed_paired, verdict)
from acl_lab.errors import AclLabError


def test_seed_paired_is_the_t_interval_of_the_per_seed_differences():
    a = {0: 0.80, 1: 0.82, 2: 0.79, 3: 0.83, 4: 0.81}
    b = {0: 0.78, 1: 0.81, 2: 0.79, 3: 0.80, 4: 0.80, 9: 0.1}  # seed 9 has no partner: left out
    res = seed_paired(a, b)
    d = np.array([0.02, 0.01, 0.0, 0.03, 0.01])
    assert res["seeds"] == [0, 1, 2, 3, 4] and res["n"] == 5
    assert math.isclose(res["mean"], d.mean(), abs_tol=1e-12)
    low, high = stats.t.interval(0.95, 4, loc=d.mean(), scale=stats.sem(d))
    assert math.isclose(res["ci_low"], low, abs_tol=1e-12) and math.isclose(res["ci_high"], high, abs_tol=1e-12)
    # the same as scipy's paired t-test: the interval excludes 0 exactly when p < 0.05
    p = stats.ttest_rel([a[s] for s in range(5)], [b[s] for s in range(5)]).pvalue
    assert p > 0.05 and res["ci_low"] < 0 < res["ci_high"]  # t = 2.75 < t(0.975, 4) = 2.78: just crosses 0
    assert res["verdict"] == NO_DIFFERENCE
    # one more seed with the same spread: now it excludes 0, and scipy's paired t-test agrees (p < 0.05)
    a[5], b[5] = 0.84, 0.82
    res = seed_paired(a, b)
    p = stats.ttest_rel([a[s] for s in range(6)], [b[s] for s in range(6)]).pvalue
    assert p < 0.05 and res["ci_low"] > 0 and res["verdict"] == HIGHER
    # and swapped, the same interval mirrored: lower
    back = seed_paired(b, a)
    assert math.isclose(back["ci_high"], -res["ci_low"], abs_tol=1e-12) and back["verdict"] == LOWER


def test_seed_paired_needs_two_seeds():
    res = seed_paired({0: 0.8}, {0: 0.7})
    assert res["n"] == 1 and math.isnan(res["ci_low"]) and res["verdict"] == TOO_FEW


def test_verdict_rule():
    assert verdict(-0.2, 1.0) == NO_DIFFERENCE and verdict(0.0, 0.3) == NO_DIFFERENCE
    assert verdict(0.1, 0.3) == HIGHER and verdict(-0.3, -0.01) == LOWER
    assert verdict(math.nan, math.nan) == TOO_FEW


def test_mcnemar_counts_discordant_pairs_and_matches_binomtest():
    # 30 examples: 10 right by both, 12 only by a, 3 only by b, 5 wrong by both
    ca = [1] * 10 + [1] * 12 + [0] * 3 + [0] * 5
    cb = [1] * 10 + [0] * 12 + [1] * 3 + [0] * 5
    res = mcnemar_exact(ca, cb)
    assert (res["a_only"], res["b_only"]) == (12, 3)
    # the exact two-sided p of 3 (or fewer) out of 15 at 1/2: 2 * P(X <= 3) = 2 * (1 + 15 + 105 + 455) / 2**15
    assert math.isclose(res["pvalue"], 2 * (1 + 15 + 105 + 455) / 2 ** 15, rel_tol=1e-12)
    assert math.isclose(res["pvalue"], stats.binomtest(12, 15, 0.5).pvalue, rel_tol=1e-12)
    assert mcnemar_exact([1, 0, 1], [1, 0, 1])["pvalue"] == 1.0  # no discordant pair: no evidence at all


def test_paired_bootstrap_interval():
    rng = np.random.default_rng(0)
    n = 2000
    b = (rng.random(n) < 0.7).astype(float)
    # a = b with 100 of b's errors fixed: the accuracy difference is exactly +0.05 and tightly known
    a = b.copy()
    a[np.flatnonzero(b == 0)[:100]] = 1.0
    low, high = paired_bootstrap(a, b)
    assert low > 0 and low < 0.05 < high and high - low < 0.03
    assert verdict(low, high) == HIGHER
    ref = stats.bootstrap((a, b), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis), paired=True, vectorized=True,
                          n_resamples=2000, method="percentile", random_state=np.random.default_rng(0))
    assert (low, high) == (ref.confidence_interval.low, ref.confidence_interval.high)
    # the pairing matters: the same two accuracy vectors, unpaired, give a much wider interval
    unpaired = stats.bootstrap((a, b), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis), paired=False,
                               vectorized=True, n_resamples=2000, method="percentile",
                               random_state=np.random.default_rng(0)).confidence_interval
    assert unpaired.high - unpaired.low > 2 * (high - low)
    assert paired_bootstrap([1, 1, 0], [1, 1, 0]) == (0.0, 0.0)
    with pytest.raises(AclLabError, match="same examples"):
        paired_bootstrap([1, 0], [1, 0, 1])


def test_example_paired_averages_seeds_and_tests_each():
    labels = np.array([0, 1] * 200)
    rng = np.random.default_rng(1)
    base = {s: np.where(rng.random(400) < 0.8, labels, 1 - labels) for s in (0, 1)}
    same = example_paired(base, {s: p.copy() for s, p in base.items()}, labels)
    assert same["mean"] == 0.0 and same["verdict"] == NO_DIFFERENCE and same["mcnemar"] == {0: 1.0, 1: 1.0}
    worse = {s: np.where(np.arange(400) < 60, 1 - labels, p) for s, p in base.items()}  # 60 forced errors
    res = example_paired(base, worse, labels)
    acc = lambda p: float(np.mean(p == labels))  # noqa: E731
    assert math.isclose(res["mean"], np.mean([acc(base[s]) - acc(worse[s]) for s in (0, 1)]), abs_tol=1e-12)
    assert res["verdict"] == HIGHER and all(p < 1e-6 for p in res["mcnemar"].values())
    with pytest.raises(AclLabError, match="same seeds"):
        example_paired({0: labels}, {1: labels}, labels)


def test_difference_text():
    assert difference_text("ACL", "CE", 0.004, -0.002, 0.010) == "ACL − CE: +0.4 points, 95% CI [−0.2, +1.0]"
    nan = float("nan")
    assert difference_text("ACL", "CE", 0.004, nan, nan) == "ACL − CE: +0.4 points, no interval from one value"


def test_every_run_saves_its_per_example_predictions(tiny_config):
    """predictions.npz holds what the metrics were computed from: accuracy per exit recomputed from it is equal."""
    from acl_lab.result import load_predictions
    from acl_lab.trainer import train

    res = train(tiny_config.replace(objective="me-ce", max_steps=2, eval_every=2), progress=False)
    pred = load_predictions(res.output_dir)
    assert pred["exit_layers"] == res.metrics["exit_layers"]
    for split in ("dev",):
        labels, preds = pred[split]["labels"], pred[split]["predictions"]
        assert preds.shape == (len(res.metrics["exit_layers"]), len(labels)) and len(labels) == 32
        for row, metrics in zip(preds, res.metrics[f"{split}_per_exit"]):
            assert float(np.mean(row == labels)) == metrics["accuracy"]
    import zipfile
    with zipfile.ZipFile(res.paths["predictions"]) as z:  # small integer arrays, not int64
        assert "dev.predictions.npy" in z.namelist()
    with np.load(res.paths["predictions"]) as z:
        assert z["dev.predictions"].dtype == np.int8 and z["dev.labels"].dtype == np.int8


def test_missing_predictions_say_how_to_make_them(tmp_path):
    from acl_lab.result import load_predictions

    with pytest.raises(AclLabError, match="predictions.npz"):
        load_predictions(tmp_path)
