"""Multi-exit results as tables and figures: layer-score curves, early-exit trade-offs, lambda sensitivity.

Everything here reads results (``TrainResult`` lists, the long per-exit table of
:func:`acl_lab.experiments.per_exit_frame`, the rows of
:func:`acl_lab.early_exit.sweep`, a batch runner's DataFrame) and never reaches
into training; the one exception to "tables only" is :func:`sweep_run`, which loads
a finished run's best checkpoint to time early exit on it. Figures are returned,
not shown, so a notebook can save them with :func:`acl_lab.notebook.save_figure`
and then ``plt.show()``.

Conventions: a metric is a fraction in [0, 1] (accuracy, F1, MCC...), so "one point"
is 0.01; every spread is the sample standard deviation over seeds (0 with one seed).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .errors import AclLabError

OBJECTIVE_LABELS = {"ce": "CE", "ce+scl": "CE+SCL", "acl-embed": "ACL-Embed", "acl": "ACL",
                    "me-ce": "multi-exit CE", "me-acl": "multi-exit ACL-Embed", "me-acl-cl": "multi-exit ACL-CL"}
CRITERION_STYLES = {"entropy": "-", "maxprob": "--", "patience": ":"}
# the same colours as acl_lab.plots, so an objective looks the same in every notebook
OBJECTIVE_COLORS = {"ce": "#4c72b0", "ce+scl": "#dd8452", "acl-embed": "#55a868", "acl": "#c44e52",
                    "me-ce": "#4c72b0", "me-acl": "#55a868", "me-acl-cl": "#c44e52"}


def color(objective: str, i: int = 0) -> str:
    """The objective's colour (the i-th default colour for an unknown name)."""
    return OBJECTIVE_COLORS.get(objective, f"C{i % 10}")


def label(objective: str) -> str:
    """A readable name for an objective ("me-acl-cl" -> "multi-exit ACL-CL")."""
    return OBJECTIVE_LABELS.get(objective, objective)


def _sd(values: pd.Series) -> float:
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def _need_columns(df: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if df.empty or missing:
        raise AclLabError(f"{what} needs a non-empty table with columns {sorted(columns)}; "
                          f"got {len(df)} rows, missing {missing}. Fix: pass the table the docstring names.")


# ---------------------------------------------------------------------------
# layer scores of multi-exit runs
# ---------------------------------------------------------------------------

def layer_scores(per_exit: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Mean, sd and number of seeds of ``metric`` per (objective, layer), from ``per_exit_frame``."""
    _need_columns(per_exit, ("objective", "layer", metric), "layer_scores")
    g = per_exit.groupby(["objective", "layer"], sort=False)[metric]
    out = pd.DataFrame({"mean": g.mean(), "sd": g.apply(_sd), "seeds": g.size()}).reset_index()
    order = {o: i for i, o in enumerate(dict.fromkeys(per_exit["objective"]))}
    return out.sort_values(["objective", "layer"], key=lambda s: s.map(order) if s.name == "objective" else s,
                           ignore_index=True)


def per_exit_table(per_exit: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Wide table for display: one row per objective, one column per exit layer, cells ``mean ± sd``."""
    s = layer_scores(per_exit, metric)
    cells = s.assign(cell=[f"{m:.4f} ± {d:.4f}" for m, d in zip(s["mean"], s["sd"])])
    table = cells.pivot(index="objective", columns="layer", values="cell")
    table = table.loc[list(dict.fromkeys(s["objective"]))]
    table.columns = [f"layer {k}" for k in table.columns]
    table["seeds"] = s.groupby("objective", sort=False)["seeds"].max()
    return table


def shallow_and_final(per_exit: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Per objective: ``metric`` averaged over the shallow half of the exits, and at the final exit.

    The shallow half is the exits at layers ``<= K / 2`` (K the deepest exit); each
    seed's shallow mean is taken first, then mean and sd over seeds.
    """
    _need_columns(per_exit, ("objective", "seed", "layer", metric), "shallow_and_final")
    rows = []
    for objective, df in per_exit.groupby("objective", sort=False):
        deepest = df["layer"].max()
        shallow = df[df["layer"] <= deepest / 2].groupby("seed")[metric].mean()
        final = df[df["layer"] == deepest].groupby("seed")[metric].mean()
        layers = sorted(df.loc[df["layer"] <= deepest / 2, "layer"].unique().tolist())
        rows.append({"objective": objective, "shallow_layers": layers,
                     "shallow_mean": float(shallow.mean()), "shallow_sd": _sd(shallow),
                     "final": float(final.mean()), "final_sd": _sd(final), "seeds": int(final.size)})
    return pd.DataFrame(rows).set_index("objective")


def plot_layer_scores(per_exit: pd.DataFrame, metric: str = "accuracy", title: str | None = None,
                      ax=None, references: dict[str, float] | None = None):
    """Dev ``metric`` per exit layer, one line per objective, shaded band mean ± sd over seeds.

    ``references`` draws labelled horizontal lines, e.g. ``{"majority class": 0.61}``:
    an exit on that line predicts one class for every input.
    """
    s = layer_scores(per_exit, metric)
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6.5, 4))
    for i, (objective, df) in enumerate(s.groupby("objective", sort=False)):
        seeds = int(df["seeds"].max())
        line, = ax.plot(df["layer"], df["mean"], marker="o", color=color(objective, i),
                        label=f"{label(objective)} (n={seeds})")
        ax.fill_between(df["layer"], df["mean"] - df["sd"], df["mean"] + df["sd"], color=line.get_color(), alpha=0.2)
    for i, (name, value) in enumerate((references or {}).items()):
        ax.axhline(value, color="grey", ls=("--", ":", "-.")[i % 3], lw=1, label=name)
    ax.set_xticks(sorted(s["layer"].unique()))
    ax.set_xlabel("exit layer")
    ax.set_ylabel(f"dev {metric}")
    ax.set_title(title or f"Dev {metric} at each exit (mean ± sd over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------------
# finding runs and sweeping early exit
# ---------------------------------------------------------------------------

MATCH_FIELDS = ("task", "model", "pooling", "max_steps", "max_train_samples", "max_eval_samples", "max_length", "batch_size")


def majority_rate(labels: Iterable) -> float:
    """The share of the most frequent label: the accuracy of always predicting it."""
    counts = pd.Series(list(labels)).value_counts()
    return float(counts.iloc[0] / counts.sum()) if len(counts) else math.nan


def pick_run(results: Sequence, objective: str, like=None, seed: int | None = None):
    """The run of ``objective`` among ``results`` (TrainResults): lowest seed unless ``seed`` is given.

    With ``like`` (a TrainConfig), only runs with the same task, model and data/step
    sizes count. Among equal candidates the most recently finished one wins.
    Returns ``None`` when there is no such run.
    """
    cands = [r for r in results if r.config.objective == objective]
    if like is not None:
        cands = [r for r in cands if all(getattr(r.config, f) == getattr(like, f) for f in MATCH_FIELDS)]
    if seed is not None:
        cands = [r for r in cands if r.config.seed == seed]
    if not cands:
        return None
    first = min(r.config.seed for r in cands)
    cands = [r for r in cands if r.config.seed == first]
    return max(cands, key=lambda r: (Path(r.output_dir) / "metrics.json").stat().st_mtime)


def sweep_run(run_dir: str | Path, settings: dict[str, list[float]], split: str = "dev", batch_size: int = 64,
              repeats: int = 2, device: str = "auto") -> pd.DataFrame:
    """Early-exit sweep of a finished multi-exit run's best checkpoint on ``split``.

    ``settings`` maps a criterion to its thresholds, e.g. ``{"entropy": [0.1, 0.3],
    "patience": [1, 2]}``. Returns the rows of :func:`acl_lab.early_exit.sweep` for
    every criterion, with ``objective``, ``seed`` and ``run`` columns.
    """
    from .checkpoint import load_trained
    from .data import load_task, make_loader, tokenize
    from .early_exit import sweep
    from .tasks import get_task
    from .utils import get_device

    run_dir = Path(run_dir)
    model, tokenizer, cfg = load_trained(run_dir / "checkpoints" / "best", device=device)
    task = get_task(cfg.task)
    data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, max_eval_samples=cfg.max_eval_samples,
                     seed=cfg.seed)
    if split not in data:
        raise AclLabError(f"Split {split!r} is not in task {cfg.task!r}; available: {', '.join(data)}.")
    enc = tokenize(type(data)({split: data[split]}), tokenizer, cfg.max_length)
    loader = make_loader(enc[split], tokenizer, batch_size, shuffle=False)
    # one discarded pass over one batch first, so one-off costs (allocations, kernel selection) miss the timings
    sweep(model, [next(iter(loader))], task, "patience", [0], get_device(device), repeats=1)
    rows = []
    for criterion, thresholds in settings.items():
        rows += sweep(model, loader, task, criterion, list(thresholds), get_device(device), repeats=repeats)
    df = pd.DataFrame(rows)
    df.insert(0, "objective", cfg.objective)
    df.insert(1, "seed", cfg.seed)
    df["run"] = str(run_dir)
    return df


def best_speedup(sweep_df: pd.DataFrame, metric: str = "accuracy", max_drop: float = 0.01,
                 speed: str = "wall_speedup", by: str = "objective") -> pd.DataFrame:
    """Per model, the setting with the largest ``speed`` that loses at most ``max_drop`` of ``metric``.

    The loss is against the full model measured in the same sweep (``quality_drop``);
    ``max_drop=0.01`` is "at most one point". A setting where no sample left early
    (layer speed-up 1) computes what the full model computes, so its measured ratio is
    timing noise and it does not count. The full model itself always qualifies (no
    loss, speed-up 1.0), so a model where no setting beats it gets ``criterion``
    "full model" and speed-up 1.0.
    """
    _need_columns(sweep_df, (by, "criterion", "threshold", "quality_drop", speed, metric), "best_speedup")
    rows = []
    for key, df in sweep_df.groupby(by, sort=False):
        ok = df[(df["quality_drop"] <= max_drop + 1e-12) & (df["layer_speedup"] > 1.0 + 1e-9)]
        full = float(df[f"full_{metric}"].iloc[0]) if f"full_{metric}" in df else math.nan
        if ok.empty or ok[speed].max() <= 1.0:
            rows.append({by: key, "criterion": "full model", "threshold": math.nan, speed: 1.0,
                         "layer_speedup": 1.0, metric: full, "quality_drop": 0.0, f"full_{metric}": full})
            continue
        best = ok.loc[ok[speed].idxmax()]
        rows.append({by: key, "criterion": best["criterion"], "threshold": best["threshold"], speed: float(best[speed]),
                     "layer_speedup": float(best["layer_speedup"]), metric: float(best[metric]),
                     "quality_drop": float(best["quality_drop"]), f"full_{metric}": full})
    return pd.DataFrame(rows).set_index(by)


def plot_early_exit(sweep_df: pd.DataFrame, metric: str = "accuracy", by: str = "objective", title: str | None = None):
    """Two panels: ``metric`` against measured wall-clock speed-up, and against layer speed-up.

    One colour per model (``by``), one line style per criterion; each model's full
    model (all layers, final exit) is drawn as a star at speed-up 1.
    """
    _need_columns(sweep_df, (by, "criterion", metric, "wall_speedup", "layer_speedup"), "plot_early_exit")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (key, df) in enumerate(sweep_df.groupby(by, sort=False)):
        colour = color(str(key), i)
        for criterion, d in df.groupby("criterion", sort=False):
            for ax, speed in zip(axes, ("wall_speedup", "layer_speedup")):
                d2 = d.sort_values(speed)
                ax.plot(d2[speed], d2[metric], CRITERION_STYLES.get(criterion, "-"), marker="o", ms=4, color=colour,
                        label=f"{label(key)}, {criterion}")
        if f"full_{metric}" in df:
            for ax in axes:
                ax.plot([1.0], [df[f"full_{metric}"].iloc[0]], marker="*", ms=14, color=colour, ls="none",
                        markeredgecolor="k", label=f"{label(key)}, full model")
    for ax, name in zip(axes, ("measured wall-clock speed-up (x)", "layer speed-up K / mean exit layer (x)")):
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"dev {metric}")
    axes[0].set_title("Quality against measured time")
    axes[1].set_title("Quality against layers computed")
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle(title or "Early exit: quality against speed-up (star: full model)")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------
# sensitivity to lambda
# ---------------------------------------------------------------------------

def metric_column(columns: Iterable[str], objective: str, metric: str = "accuracy", split: str = "dev") -> str:
    """The column of a batch results table holding ``objective``'s ``split`` metric (``"acl.dev_accuracy"``).

    The exact ``<objective>.<split>_<metric>`` wins; otherwise the shortest column that
    starts with ``<objective>.`` and ends with ``<split>_<metric>``.
    """
    columns = list(columns)
    exact = f"{objective}.{split}_{metric}"
    if exact in columns:
        return exact
    near = sorted((c for c in columns if c.startswith(f"{objective}.") and c.endswith(f"{split}_{metric}")), key=len)
    if not near:
        shown = [c for c in columns if "." in c][:12]
        raise AclLabError(f"No column {exact!r} in the batch results (metric columns: {shown}). Fix: check that the "
                          "notebook records '<objective>.dev_<metric>' and that its runs completed.")
    return near[0]


def sensitivity_frame(runs: pd.DataFrame, objectives: Sequence[str], metric: str = "accuracy", x: str = "LAMBDA",
                      temperature: str = "TEMPERATURE", seeds: str = "SEEDS") -> pd.DataFrame:
    """Long table from a batch runner's results (one row per run): objective, lam, temperature, seed, value.

    Only completed (or skipped, i.e. completed earlier) runs count. ``seeds`` is the
    grid column of the run's seed list (comma-joined text); its first seed is kept.
    """
    done = runs[runs["status"].isin(["completed", "skipped"])] if "status" in runs else runs
    rows = []
    for objective in objectives:
        if done.empty:
            break
        col = metric_column(done.columns, objective, metric)
        for _, r in done.iterrows():
            if pd.isna(r[col]):
                continue
            seed = str(r[seeds]).split(",")[0] if seeds in done.columns else "0"
            rows.append({"objective": objective, "lam": float(r[x]),
                         "temperature": float(r[temperature]) if temperature in done.columns else math.nan,
                         "seed": int(seed) if seed.lstrip("-").isdigit() else seed, "value": float(r[col]),
                         "run": r.get("name", "")})
    return pd.DataFrame(rows, columns=["objective", "lam", "temperature", "seed", "value", "run"])


def sensitivity_summary(df: pd.DataFrame, value: str = "value", x: str = "lam", by: str = "objective",
                        extra: Sequence[str] = ()) -> pd.DataFrame:
    """Mean, sd and count of ``value`` per (``by``, ``x``, *extra*), from one row per run and seed."""
    keys = [by, *extra, x]
    _need_columns(df, (*keys, value), "sensitivity_summary")
    g = df.groupby(keys, sort=True)[value]
    return pd.DataFrame({"mean": g.mean(), "sd": g.apply(_sd), "n": g.size()}).reset_index()


def sensitivity_spread(summary: pd.DataFrame, x: str = "lam", by: str = "objective") -> pd.DataFrame:
    """Per objective: the range (max - min) of the mean metric over the lambdas, and the mean sd over seeds.

    A smaller range means the objective is less sensitive to the choice of lambda.
    """
    g = summary.groupby(by, sort=False)
    return pd.DataFrame({"range_over_lambda": g["mean"].max() - g["mean"].min(), "best": g["mean"].max(),
                         "worst": g["mean"].min(), "mean_sd_over_seeds": g["sd"].mean(), "lambdas": g[x].nunique()})


def plot_sensitivity(df: pd.DataFrame, value: str = "value", x: str = "lam", by: str = "objective",
                     metric: str = "accuracy", panel: str | None = None, title: str | None = None):
    """Dev ``metric`` against lambda, one line per objective, error bars = sd over seeds.

    ``df`` holds one row per run and seed with columns ``by``, ``x`` and ``value``;
    with ``panel`` (e.g. ``"temperature"``) there is one panel per value of that column.
    Lambda is drawn on a log axis when all lambdas are positive and span a factor > 4.
    """
    panels = sorted(df[panel].unique()) if panel else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, p in zip(axes[0], panels):
        sub = df if p is None else df[df[panel] == p]
        s = sensitivity_summary(sub, value=value, x=x, by=by)
        xs = np.asarray(sorted(s[x].unique()), dtype=float)
        log = bool(len(xs) and xs.min() > 0 and xs.max() / xs.min() > 4)
        order = list(dict.fromkeys(df[by]))
        for i, objective in enumerate(order):
            d = s[s[by] == objective]
            # nudge the objectives apart a little so equal points and their error bars stay visible
            shift = (i - (len(order) - 1) / 2) * 0.025
            xd = d[x] * (1 + shift) if log else d[x] + shift * (np.ptp(xs) if len(xs) > 1 else 1.0)
            ax.errorbar(xd, d["mean"], yerr=d["sd"], marker="o", capsize=4, color=color(objective, i),
                        label=label(objective))
        if log:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{v:g}" for v in xs])
        ax.set_xlabel("lambda (weight of the contrastive term)")
        ax.set_title(f"{panel} = {p:g}" if p is not None else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"dev {metric} (mean ± sd over seeds)")
    fig.suptitle(title or f"Sensitivity to lambda: dev {metric}, CE+SCL against ACL")
    fig.tight_layout()
    return fig
