"""The notebooks' figures: each function takes result tables or arrays, draws, and returns the figure.

Every function accepts an optional matplotlib ``ax`` (or ``axes``) to draw into and
returns the :class:`~matplotlib.figure.Figure`, so a notebook can save it with
:func:`acl_lab.lab.notebook.save_figure`. Inputs are what runs leave behind: the tables
of :mod:`acl_lab.analysis.runs` (``results_frame``, ``history_frame``, ``evals_frame``,
``per_exit_frame``), the long angle table of :func:`acl_lab.analysis.gradients.angle_long_frame`,
the rows of :func:`acl_lab.early_exit.sweep`, and 2-D projections of representation dumps.
Colours, names and reference lines come from :mod:`acl_lab.viz.style`; bands are mean ± sd
over seeds as :mod:`acl_lab.analysis.stats` defines them. Nothing here touches a model or a
training loop.
"""
from __future__ import annotations

from typing import Any, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..analysis.exits import layer_scores, need_columns
from ..analysis.gradients import PHASES, dropped_share, phase_of
from ..analysis.sensitivity import sensitivity_summary
from ..analysis.stats import group_summary, sd
from ..config import CONFLICT_DEGREES
from .style import CRITERION_STYLES, PHASE_LABELS, color, conflict_line, label, threshold_line, thresholds_of


def _axes(ax=None, figsize=(6.5, 4.0)):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    return ax.figure, ax


def _mean_band(frame: pd.DataFrame, x: str, y: str, window: int = 1) -> pd.DataFrame:
    """Mean and sd over seeds of ``y`` per ``x`` (each seed's curve first smoothed by a centred rolling mean)."""
    parts = []
    for _, g in frame.sort_values(x).groupby("seed"):
        g = g[[x, y]].copy()
        if window > 1:
            g[y] = g[y].rolling(window, center=True, min_periods=1).mean()
        parts.append(g)
    return group_summary(pd.concat(parts), x, y, sort=True)


def _plot_band(ax, stats: pd.DataFrame, x: str, label: str, color: str, marker: str | None = None) -> None:
    ax.plot(stats[x], stats["mean"], color=color, label=label, marker=marker, lw=1.6)
    if (stats["n"] > 1).any():
        ax.fill_between(stats[x], stats["mean"] - stats["sd"], stats["mean"] + stats["sd"], color=color, alpha=0.2,
                        lw=0)


# ---------------------------------------------------------------------------
# gradient angles (notebook 01)
# ---------------------------------------------------------------------------

def angle_histogram(long: pd.DataFrame, ax=None, bins: int = 36, title: str | None = None):
    """Overlaid histograms of the per-batch angles of each probe (CE vs SCL, CE vs ACL-Embed), 90° marked."""
    fig, ax = _axes(ax)
    edges = np.linspace(0, 180, bins + 1)
    lo = max(0.0, float(long["angle"].min()) - 10) if len(long) else 0.0
    hi = min(180.0, float(long["angle"].max()) + 10) if len(long) else 180.0
    for i, (probe, g) in enumerate(long.groupby("probe", sort=False)):
        over = float((g["angle"] > CONFLICT_DEGREES).mean())
        ax.hist(g["angle"], bins=edges, alpha=0.5, color=color(probe, i), edgecolor="white",
                label=f"{probe} ({over:.0%} of batches > {CONFLICT_DEGREES:g}°)")
    conflict_line(ax, horizontal=False)
    ax.set_xlim(min(lo, 80), max(hi, 100))
    ax.set_xlabel("angle between gradients (degrees)")
    ax.set_ylabel("number of batches (all seeds)")
    ax.set_title(title or "Per-batch angle between grad(CE) and the contrastive gradient")
    ax.legend(fontsize=8)
    return fig


def angle_curves(long: pd.DataFrame, ax=None, window: int = 1, title: str | None = None, phases: bool = True):
    """Angle against training step per probe: mean over seeds with a ±1 sd band (optionally smoothed)."""
    fig, ax = _axes(ax, figsize=(7.5, 4.0))
    for i, (probe, g) in enumerate(long.groupby("probe", sort=False)):
        _plot_band(ax, _mean_band(g, "step", "angle", window), "step", probe, color(probe, i))
    conflict_line(ax)
    if phases and len(long):
        total = int(long["step"].max())
        bounds = sorted({s for s in range(1, total) if phase_of(s, total) != phase_of(s + 1, total)})
        for b in bounds:
            ax.axvline(b + 0.5, color="grey", ls=":", lw=1)
    n_seeds = long["seed"].nunique() if len(long) else 0
    smooth = f", rolling mean over {window} steps" if window > 1 else ""
    ax.set_xlabel("training step (batch)")
    ax.set_ylabel("angle (degrees)")
    ax.set_title(title or f"Gradient angle during fine-tuning (mean ± sd over {n_seeds} seed(s){smooth})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def angle_phase_plot(long: pd.DataFrame, ax=None, title: str | None = None):
    """Box plots of the angles in the first, middle and last third of training, per probe."""
    fig, ax = _axes(ax)
    probes = list(dict.fromkeys(long["probe"]))
    phases = [p for p in PHASES if p in set(long["phase"])]
    width = 0.8 / max(1, len(probes))
    handles = []
    for i, probe in enumerate(probes):
        data = [long[(long["probe"] == probe) & (long["phase"] == ph)]["angle"].to_numpy() for ph in phases]
        pos = [j + (i - (len(probes) - 1) / 2) * width for j in range(len(phases))]
        keep = [(d, p) for d, p in zip(data, pos) if len(d)]
        if not keep:
            continue
        bp = ax.boxplot([d for d, _ in keep], positions=[p for _, p in keep], widths=width * 0.9, patch_artist=True,
                        showfliers=True, flierprops={"markersize": 3},
                        medianprops={"color": "k"})
        for box in bp["boxes"]:
            box.set_facecolor(color(probe, i))
            box.set_alpha(0.6)
        handles.append(plt.Rectangle((0, 0), 1, 1, color=color(probe, i), alpha=0.6, label=probe))
    line = conflict_line(ax)
    ax.set_xticks(range(len(phases)), [PHASE_LABELS[p] for p in phases])
    ax.set_xlabel("phase of training (thirds of the steps)")
    ax.set_ylabel("angle (degrees)")
    ax.set_title(title or "Gradient angles early vs late in fine-tuning")
    ax.legend(handles=handles + [line], fontsize=8)
    return fig


# ---------------------------------------------------------------------------
# comparing objectives (notebook 02)
# ---------------------------------------------------------------------------

def training_curves(history: pd.DataFrame, evals: pd.DataFrame | None = None, metric: str = "accuracy",
                    loss_column: str = "ce", window: int = 5, axes: Sequence[Any] | None = None):
    """Left: a training loss (default the CE part, shared by all objectives) against step, per objective;
    right: the dev metric at each evaluation against step. Mean over seeds with a ±1 sd band."""
    with_evals = evals is not None and len(evals)
    if axes is None:
        fig, axes = plt.subplots(1, 2 if with_evals else 1, figsize=(12 if with_evals else 6.5, 4.0), squeeze=False)
        axes = axes[0]
    fig = axes[0].figure
    for i, (objective, g) in enumerate(history.groupby("objective", sort=False)):
        _plot_band(axes[0], _mean_band(g, "step", loss_column, window), "step", objective, color(objective, i))
    smooth = f", rolling mean over {window} steps" if window > 1 else ""
    axes[0].set_xlabel("training step")
    axes[0].set_ylabel(f"training loss: {loss_column}")
    axes[0].set_title(f"Training {loss_column} per objective (mean ± sd over seeds{smooth})")
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    if with_evals:
        for i, (objective, g) in enumerate(evals.groupby("objective", sort=False)):
            _plot_band(axes[1], _mean_band(g, "step", "score"), "step", objective, color(objective, i), marker="o")
        axes[1].set_xlabel("training step")
        axes[1].set_ylabel(f"dev {metric}")
        axes[1].set_title(f"Dev {metric} during training (mean ± sd over seeds)")
        axes[1].legend(fontsize=8)
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    return fig


def comparison_plot(df: pd.DataFrame, metrics: Sequence[str], by: str = "objective", axes: Sequence[Any] | None = None,
                    title: str | None = None):
    """One panel per metric: mean ± sd over seeds per group (error bars) with each seed's value as a dot."""
    metrics = list(metrics)
    if axes is None:
        fig, axes = plt.subplots(1, len(metrics), figsize=(4.8 * len(metrics), 4.0), squeeze=False)
        axes = axes[0]
    fig = axes[0].figure
    groups = list(dict.fromkeys(df[by]))
    rng = np.random.default_rng(0)
    for ax, metric in zip(axes, metrics):
        for i, group in enumerate(groups):
            values = df.loc[df[by] == group, metric].astype(float).dropna().to_numpy()
            if not len(values):
                continue
            ax.errorbar(i, values.mean(), yerr=sd(values), fmt="o", ms=9, capsize=6, color=color(str(group), i), lw=2)
            ax.scatter(i + rng.uniform(-0.12, 0.12, len(values)), values, s=18, color="k", alpha=0.6, zorder=3)
        ax.set_xticks(range(len(groups)), [str(g) for g in groups])
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_xlabel(by)
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_title(f"{metric.replace('_', ' ')}: mean ± sd, dots = seeds")
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def gate_plot(history: pd.DataFrame, ax=None, title: str | None = None):
    """ACL-Grad's decisions: the gate angle against step for every gated run; steps where the term was dropped
    (for some micro-batch) marked with x; the runs' own thresholds as dashed lines."""
    fig, ax = _axes(ax, figsize=(7.5, 4.0))
    gated = history[history["kept"].notna()] if "kept" in history.columns else history.iloc[0:0]
    for i, ((objective, seed), g) in enumerate(gated.groupby(["objective", "seed"], sort=False)):
        g = g.sort_values("step")
        colour = f"C{i % 10}"
        ax.plot(g["step"], g["angle"], color=colour, lw=1.2, label=f"{objective} seed {seed}")
        dropped = g[dropped_share(g["kept"]) > 0]
        ax.scatter(dropped["step"], dropped["angle"], marker="x", color=colour, s=40, zorder=3)
    for value in thresholds_of(gated if len(gated) else history):
        threshold_line(ax, value)
    rate = float(dropped_share(gated["kept"]).mean()) if len(gated) else float("nan")
    ax.set_xlabel("training step")
    ax.set_ylabel("angle grad(CE) vs grad(ACL term) (degrees)")
    ax.set_title(title or f"ACL-Grad gate: x = term dropped (overall drop rate {rate:.0%})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------------
# representations and exits (notebook 03)
# ---------------------------------------------------------------------------

def _class_handles(label_names: Sequence[str]) -> list:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", ms=6, alpha=0.7, color=f"C{c}", label=f"{name} (samples)")
               for c, name in enumerate(label_names)]
    handles += [Line2D([], [], ls="", marker="*", ms=16, color=f"C{c}", markeredgecolor="k",
                       label=f"{name} (label embedding)") for c, name in enumerate(label_names)]
    return handles


def scores_text(scores: dict[str, float]) -> str:
    """The alignment numbers of :func:`acl_lab.analysis.representations.alignment_score` on one line."""
    return (f"own cos {scores['own_cos']:+.2f} | other cos {scores['other_cos']:+.2f} | gap {scores['gap']:+.2f} | "
            f"nearest own {scores['nearest_own']:.0%}")


def representation_scatter(xy: np.ndarray, labels: np.ndarray, label_xy: np.ndarray, label_names: Sequence[str],
                           ax=None, title: str | None = None, scores: dict[str, float] | None = None,
                           method: str = "umap", legend: bool = True):
    """Samples coloured by class, label embeddings as large stars of their class's colour; the alignment
    numbers (``scores``) are printed under the picture."""
    fig, ax = _axes(ax, figsize=(5.0, 4.8))
    labels = np.asarray(labels).astype(int)
    for c, name in enumerate(label_names):
        mask = labels == c
        ax.scatter(xy[mask, 0], xy[mask, 1], s=10, alpha=0.55, color=f"C{c}", label=f"{name} (samples)")
    for c, name in enumerate(label_names):
        if c < len(label_xy):
            ax.scatter(label_xy[c, 0], label_xy[c, 1], marker="*", s=520, color=f"C{c}", edgecolor="k", linewidth=1.3,
                       zorder=5, label=f"{name} (label embedding)")
    ax.margins(0.12)
    name = method.upper()
    ax.set_xlabel(f"{name} 1")
    ax.set_ylabel(f"{name} 2")
    if scores:
        ax.set_xlabel(f"{name} 1\n{scores_text(scores)}")
    ax.set_title(title or f"{name} of [CLS] representations and label embeddings")
    if legend:
        ax.legend(handles=_class_handles(label_names), fontsize=7, loc="best")
    return fig


def representation_grid(rows: Sequence[Sequence[dict]], label_names: Sequence[str], method: str = "umap",
                        title: str | None = None, panel_size: float = 3.6):
    """A grid of :func:`representation_scatter` panels: ``rows[i][j]`` is a dict with ``xy``, ``labels``,
    ``label_xy`` and optional ``title`` and ``scores`` (e.g. one row per objective, one column per exit)."""
    nrows, ncols = len(rows), max(len(r) for r in rows)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size * ncols * 1.1, panel_size * nrows), squeeze=False)
    for i, row in enumerate(rows):
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(row):
                ax.axis("off")
                continue
            p = row[j]
            representation_scatter(p["xy"], p["labels"], p["label_xy"], label_names, ax=ax, title=p.get("title"),
                                   scores=p.get("scores"), method=method, legend=False)
            ax.tick_params(labelsize=7)
            ax.xaxis.label.set_fontsize(8)
    handles = _class_handles(label_names)
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def per_exit_plot(frame: pd.DataFrame, value: str, ax=None, by: str = "objective", ylabel: str | None = None,
                  title: str | None = None):
    """A value (a per-exit metric, or an alignment number) against the exit layer, one line per group.

    ``frame`` is long: columns ``layer``, ``by`` and ``value`` (and ``seed`` for a ±1 sd band), e.g.
    :func:`acl_lab.analysis.runs.per_exit_frame`.
    """
    fig, ax = _axes(ax)
    frame = frame if "seed" in frame.columns else frame.assign(seed=0)
    for i, (group, g) in enumerate(frame.groupby(by, sort=False)):
        _plot_band(ax, _mean_band(g, "layer", value), "layer", str(group), color(str(group), i), marker="o")
    layers = sorted(frame["layer"].unique())
    ax.set_xticks(layers)
    ax.set_xlabel("exit (encoder layer)")
    ax.set_ylabel(ylabel or value.replace("_", " "))
    ax.set_title(title or f"{value.replace('_', ' ')} per exit")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------------
# multi-exit, early exit and sensitivity (notebooks 04, 05, 06)
# ---------------------------------------------------------------------------

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


def plot_early_exit(sweep_df: pd.DataFrame, metric: str = "accuracy", by: str = "objective", title: str | None = None):
    """Two panels: ``metric`` against measured wall-clock speed-up, and against layer speed-up.

    One colour per model (``by``), one line style per criterion; each model's full
    model (all layers, final exit) is drawn as a star at speed-up 1.
    """
    need_columns(sweep_df, (by, "criterion", metric, "wall_speedup", "layer_speedup"), "plot_early_exit")
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


def plot_sensitivity(df: pd.DataFrame, value: str = "value", x: str = "lam", by: str = "objective",
                     metric: str = "accuracy", panel: str | None = None, title: str | None = None):
    """Dev ``metric`` against lambda, one line per objective, error bars = sd over seeds
    (none at a point from one seed, which is labelled ``n=1``).

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
            # one seed has no spread to show: no error bar there, and the point says n=1
            one_seed = d["n"] == 1
            ax.errorbar(xd, d["mean"], yerr=d["sd"].mask(one_seed), marker="o", capsize=4,
                        color=color(objective, i), label=label(objective))
            for xv, yv in zip(xd[one_seed], d["mean"][one_seed]):
                ax.annotate("n=1", (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=color(objective, i))
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
