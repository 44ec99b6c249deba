"""The pilot study's gradient angles and ACL-Grad's decisions, from saved per-step histories.

Notebook 01 trains with ``probe_angles=True``: every probed step logs the angle between
grad(CE) and grad(SCL) / grad(ACL-Embed) over all parameters. Here those angles become a
long table (:func:`angle_long_frame`), summaries per seed and per third of training
(:func:`conflict_summary`, :func:`phase_summary`), and, for gated runs, the gate's
decisions per phase (:func:`gate_phase_table`). A *conflict* is an angle over
:data:`acl_lab.config.CONFLICT_DEGREES` (90 degrees: the two gradients point apart).
Spreads follow :mod:`acl_lab.analysis.stats`.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from ..config import CONFLICT_DEGREES
from ..errors import AclLabError
from .stats import group_summary, pm_text

#: history columns written with ``probe_angles=True`` and their readable names
PROBES = {"angle_scl": "CE vs SCL", "angle_acl_embed": "CE vs ACL-Embed"}
#: readable probe name -> the short key notebooks use in their headline metrics ("CE vs SCL" -> "scl")
PROBES_KEYS = {name: column.removeprefix("angle_") for column, name in PROBES.items()}
PHASES = ("early", "middle", "late")


# ---------------------------------------------------------------------------
# gradient conflict (pilot study)
# ---------------------------------------------------------------------------

def phase_of(step: int, total: int) -> str:
    """``early`` (first third of the steps, rounded up), ``late`` (last third) or ``middle``."""
    k = max(1, math.ceil(total / 3))
    if step <= k:
        return "early"
    if step > total - k:
        return "late"
    return "middle"


def angle_long_frame(history: pd.DataFrame, probes: dict[str, str] | None = None) -> pd.DataFrame:
    """Per-step probe angles in long form: objective, seed, step, probe, angle, cos, phase.

    ``history`` is :func:`acl_lab.analysis.runs.history_frame` of runs trained with
    ``probe_angles=True``; ``probes`` maps history columns to readable names
    (default: :data:`PROBES`). Rows whose angle is missing or not finite are left out.
    """
    probes = PROBES if probes is None else probes
    missing = [c for c in probes if c not in history.columns]
    if missing:
        raise AclLabError(f"The history has no column(s) {missing}. Fix: train with probe_angles=True "
                          "(notebook 01 does) to log the pilot-study angles.")
    frames = []
    for column, name in probes.items():
        cos_col = column.replace("angle_", "cos_", 1)
        part = history[["objective", "seed", "step", column]].rename(columns={column: "angle"})
        part["cos"] = history[cos_col] if cos_col in history.columns else np.nan
        part["probe"] = name
        frames.append(part)
    long = pd.concat(frames, ignore_index=True)
    long = long[np.isfinite(long["angle"].astype(float))].copy()
    totals = long.groupby(["objective", "seed"])["step"].transform("max")
    long["phase"] = [phase_of(int(s), int(t)) for s, t in zip(long["step"], totals)]
    return long[["objective", "seed", "step", "probe", "angle", "cos", "phase"]].reset_index(drop=True)


def per_seed_conflict(long: pd.DataFrame, by: Sequence[str] = ("objective", "probe"),
                      conflict: float = CONFLICT_DEGREES) -> pd.DataFrame:
    """One row per group and seed: batches, fraction of batches over ``conflict`` degrees, median and mean angle."""
    keys = [*by, "seed"]
    g = long.groupby(keys, sort=False)["angle"]
    out = pd.DataFrame({"batches": g.size(), "frac_over_90": g.apply(lambda a: float((a > conflict).mean())),
                        "median_angle": g.median(), "mean_angle": g.mean()})
    return out.reset_index()


def conflict_summary(long: pd.DataFrame, by: Sequence[str] = ("objective", "probe"),
                     conflict: float = CONFLICT_DEGREES) -> pd.DataFrame:
    """Mean and sd over seeds (:mod:`.stats`) of the per-seed fraction over ``conflict`` degrees and of the
    median and mean angle; with the number of seeds and of batches."""
    per_seed = per_seed_conflict(long, by, conflict)
    by = list(by)
    out = per_seed.groupby(by, sort=False).agg(seeds=("seed", "size"), batches=("batches", "sum")).reset_index()
    for col in ("frac_over_90", "median_angle", "mean_angle"):
        s = group_summary(per_seed, by, col)
        out[f"{col}_mean"] = s["mean"].to_numpy()
        out[f"{col}_sd"] = s["sd"].to_numpy()
    return out


def format_conflict_table(summary: pd.DataFrame, by: Sequence[str] = ("objective", "probe")) -> pd.DataFrame:
    """:func:`conflict_summary` as a readable ``mean ± sd`` table."""
    table = summary.set_index(list(by))
    seeds = table["seeds"].to_numpy()

    def column(name: str, digits: int) -> list[str]:
        return [pm_text(m, s, digits, n=int(n)) for m, s, n in zip(table[f"{name}_mean"], table[f"{name}_sd"], seeds)]

    return pd.DataFrame({
        f"fraction of batches > {CONFLICT_DEGREES:g}°": column("frac_over_90", 2),
        "median angle (°)": column("median_angle", 1),
        "seeds": seeds, "batches": table["batches"].to_numpy(),
    }, index=table.index)


def phase_summary(long: pd.DataFrame, by: Sequence[str] = ("objective", "probe")) -> pd.DataFrame:
    """:func:`conflict_summary` per phase of training (early / middle / late third of the steps)."""
    summary = conflict_summary(long, [*by, "phase"])
    keys = []
    for i, col in enumerate(by):  # keep each group in order of first appearance, phases in time order
        first_seen = {v: j for j, v in enumerate(dict.fromkeys(long[col]))}
        summary[f"_k{i}"] = summary[col].map(first_seen)
        keys.append(f"_k{i}")
    summary["_phase"] = summary["phase"].map({p: i for i, p in enumerate(PHASES)})
    order = [*keys, "_phase"]
    return summary.sort_values(order, kind="stable").drop(columns=order).reset_index(drop=True)


def dropped_share(kept: pd.Series) -> pd.Series:
    """Per step, the share of micro-batches whose auxiliary term the gate dropped: ``1 - kept``."""
    return 1.0 - kept.astype(float)


def gate_phase_table(history: pd.DataFrame) -> pd.DataFrame:
    """ACL-Grad decisions per run and phase of training: steps, drop rate and median gate angle.

    ``history`` is :func:`acl_lab.analysis.runs.history_frame`; only rows with a gate
    decision (``kept``) count. Empty when no run was gated. ``kept`` is the share of a
    step's micro-batches whose term was kept (1 or 0 without gradient accumulation), so the
    drop rate is the mean of ``1 - kept``, the same number as the trainer's ``metrics.json``.
    """
    cols = ["objective", "seed", "phase", "steps", "drop_rate", "median_angle"]
    if "kept" not in history.columns:
        return pd.DataFrame(columns=cols)
    gated = history[history["kept"].notna()].copy()
    if gated.empty:
        return pd.DataFrame(columns=cols)
    totals = gated.groupby(["objective", "seed"])["step"].transform("max")
    gated["phase"] = [phase_of(int(s), int(t)) for s, t in zip(gated["step"], totals)]
    gated["dropped"] = dropped_share(gated["kept"])
    g = gated.groupby(["objective", "seed", "phase"], sort=False)
    out = pd.DataFrame({"steps": g.size(), "drop_rate": g["dropped"].mean(), "median_angle": g["angle"].median()})
    out = out.reset_index()
    out["_order"] = out["phase"].map({p: i for i, p in enumerate(PHASES)})
    return out.sort_values(["objective", "seed", "_order"]).drop(columns="_order").reset_index(drop=True)[cols]
