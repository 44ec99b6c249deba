"""Multi-exit results as tables: per-exit scores over seeds and early-exit trade-offs.

Everything here reads results (the long per-exit table of
:func:`acl_lab.analysis.runs.per_exit_frame`, the rows of :func:`acl_lab.early_exit.sweep`)
and never reaches into training. A metric is a fraction in [0, 1] (accuracy, F1, MCC...),
so "one point" is 0.01; spreads follow :mod:`acl_lab.analysis.stats`.
"""
from __future__ import annotations

import math
from typing import Iterable

import pandas as pd

from ..errors import AclLabError
from .stats import group_summary, pm_text, sd


def need_columns(df: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    """Raise a clear error when ``df`` is empty or lacks one of ``columns`` (``what`` names the caller)."""
    missing = [c for c in columns if c not in df.columns]
    if df.empty or missing:
        raise AclLabError(f"{what} needs a non-empty table with columns {sorted(columns)}; "
                          f"got {len(df)} rows, missing {missing}. Fix: pass the table the docstring names.")


def layer_scores(per_exit: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Mean, sd and number of seeds of ``metric`` per (objective, layer), from ``per_exit_frame``."""
    need_columns(per_exit, ("objective", "layer", metric), "layer_scores")
    s = group_summary(per_exit, ["objective", "layer"], metric).rename(columns={"n": "seeds"})
    order = {o: i for i, o in enumerate(dict.fromkeys(per_exit["objective"]))}
    return s[["objective", "layer", "mean", "sd", "seeds"]].sort_values(
        ["objective", "layer"], key=lambda c: c.map(order) if c.name == "objective" else c, ignore_index=True)


def per_exit_table(per_exit: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Wide table for display: one row per objective, one column per exit layer, cells ``mean ± sd``."""
    s = layer_scores(per_exit, metric)
    cells = s.assign(cell=[pm_text(m, d) for m, d in zip(s["mean"], s["sd"])])
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
    need_columns(per_exit, ("objective", "seed", "layer", metric), "shallow_and_final")
    rows = []
    for objective, df in per_exit.groupby("objective", sort=False):
        deepest = df["layer"].max()
        shallow = df[df["layer"] <= deepest / 2].groupby("seed")[metric].mean()
        final = df[df["layer"] == deepest].groupby("seed")[metric].mean()
        layers = sorted(df.loc[df["layer"] <= deepest / 2, "layer"].unique().tolist())
        rows.append({"objective": objective, "shallow_layers": layers,
                     "shallow_mean": float(shallow.mean()), "shallow_sd": sd(shallow),
                     "final": float(final.mean()), "final_sd": sd(final), "seeds": int(final.size)})
    return pd.DataFrame(rows).set_index("objective")


def majority_rate(labels: Iterable) -> float:
    """The share of the most frequent label: the accuracy of always predicting it."""
    counts = pd.Series(list(labels)).value_counts()
    return float(counts.iloc[0] / counts.sum()) if len(counts) else math.nan


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
    from ..early_exit import within_budget  # lazily: it loads the model code, which the other tables never need

    need_columns(sweep_df, (by, "criterion", "threshold", "quality_drop", speed, metric), "best_speedup")
    rows = []
    for key, df in sweep_df.groupby(by, sort=False):
        ok = df[within_budget(df, max_drop)]
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
