"""Run many configs and gather their results into tables: what the notebooks call to compare objectives.

Each run goes to ``<root>/runs/<objective>-s<seed>-<hash>``, where the hash is taken
over every field that changes what the run computes (and differs from its default). So re-running a notebook
reuses finished runs, resumes interrupted ones, and never mixes two configs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import pandas as pd

from .config import RUNTIME_FIELDS, TrainConfig
from .trainer import TrainResult, load_result, train


def run_name(cfg: TrainConfig) -> str:
    """A readable, unique folder name for ``cfg`` (objective, seed, and a hash of the rest).

    Only fields that differ from :class:`TrainConfig`'s defaults enter the hash, so adding a
    new field (with a default that keeps the old behaviour) leaves existing run names valid.
    """
    defaults = TrainConfig().to_dict()
    fields = {k: v for k, v in cfg.to_dict().items() if k not in RUNTIME_FIELDS and v != defaults.get(k, object())}
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
    return f"{cfg.objective}-s{cfg.seed}-{digest}"


def run_many(configs: Iterable[TrainConfig], root: str | Path, progress: bool = True) -> list[TrainResult]:
    """Train each config under ``root/runs`` (finished runs are read back, interrupted ones resumed)."""
    results = []
    for cfg in configs:
        cfg = cfg.replace(output_dir=str(Path(root) / "runs" / run_name(cfg)))
        results.append(train(cfg, resume=True, progress=progress))
    return results


def load_runs(root: str | Path) -> list[TrainResult]:
    """Every finished run under ``root/runs``."""
    folder = Path(root) / "runs"
    return [load_result(p) for p in sorted(folder.glob("*")) if (p / "metrics.json").exists()]


def results_frame(results: Iterable[TrainResult]) -> pd.DataFrame:
    """One row per run: identifying fields, dev/test metrics of the final exit, gate and angle summaries."""
    rows = []
    for r in results:
        m, c = r.metrics, r.config
        row = {"task": c.task, "objective": c.objective, "seed": c.seed, "lam": c.lam, "mu": c.mu,
               "temperature": c.temperature, "acl_grad": c.use_acl_grad, "steps": m["steps"],
               "train_seconds": m["train_seconds"], "run": str(r.output_dir)}
        for split in ("dev", "test"):
            for name, value in m.get(split, {}).items():
                row[f"{split}_{name}"] = value
        row["drop_rate"] = m.get("gate", {}).get("drop_rate")
        row["median_angle"] = m.get("angle", {}).get("median")
        rows.append(row)
    return pd.DataFrame(rows)


def summary_table(df: pd.DataFrame, metrics: list[str], by: str | list[str] = "objective") -> pd.DataFrame:
    """``mean ± sd`` over seeds of each metric, one row per group (sd is 0 with one seed)."""
    grouped = df.groupby(by, sort=False)[metrics]
    mean, sd = grouped.mean(), grouped.std(ddof=1).fillna(0.0)
    table = pd.DataFrame({m: [f"{a:.4f} ± {b:.4f}" for a, b in zip(mean[m], sd[m])] for m in metrics}, index=mean.index)
    table["seeds"] = grouped.size()
    return table


def history_frame(results: Iterable[TrainResult]) -> pd.DataFrame:
    """All per-step log rows of the runs, with objective, seed and lambda columns, for plotting curves."""
    frames = []
    for r in results:
        h = pd.DataFrame(r.history)
        if h.empty:
            continue
        h["objective"], h["seed"], h["lam"] = r.config.objective, r.config.seed, r.config.lam
        frames.append(h)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def evals_frame(results: Iterable[TrainResult]) -> pd.DataFrame:
    """One row per periodic dev evaluation of each run: objective, seed, lam, step, score (final exit's main metric)."""
    rows = [{"objective": r.config.objective, "seed": r.config.seed, "lam": r.config.lam, "step": e["step"],
             "score": e["score"]} for r in results for e in r.evals]
    return pd.DataFrame(rows, columns=["objective", "seed", "lam", "step", "score"])


def per_exit_frame(results: Iterable[TrainResult], split: str = "dev") -> pd.DataFrame:
    """Long table of per-exit metrics: objective, seed, layer, and each metric of that exit."""
    rows = []
    for r in results:
        layers = r.metrics.get("exit_layers") or list(range(1, len(r.metrics[f"{split}_per_exit"]) + 1))
        for layer, metrics in zip(layers, r.metrics[f"{split}_per_exit"]):
            rows.append({"objective": r.config.objective, "seed": r.config.seed, "layer": layer, **metrics})
    return pd.DataFrame(rows)
