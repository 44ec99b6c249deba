"""Finished runs: their folder names, finding the one a notebook needs, and tabulating many.

Runs live under ``<root>/runs/<objective>-s<seed>-<hash>`` (:func:`run_name`). Every
function here reads run folders through :mod:`acl_lab.result`; none trains.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd

from ..config import RUNTIME_FIELDS, TrainConfig
from ..result import TrainResult, is_finished, load_result

#: fields that make two runs answer different questions: a run is only ever picked for a config equal on these
SHAPE_FIELDS = ("task", "model", "pooling", "max_train_samples", "max_eval_samples", "max_steps", "epochs",
                "batch_size", "max_length")


def run_name(cfg: TrainConfig) -> str:
    """A readable, unique folder name for ``cfg`` (objective, seed, and a hash of the rest).

    Only fields that differ from :class:`TrainConfig`'s defaults enter the hash, so adding a
    new field (with a default that keeps the old behaviour) leaves existing run names valid.
    """
    defaults = TrainConfig().to_dict()
    fields = {k: v for k, v in cfg.to_dict().items() if k not in RUNTIME_FIELDS and v != defaults.get(k, object())}
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
    return f"{cfg.objective}-s{cfg.seed}-{digest}"


def load_runs(root: str | Path) -> list[TrainResult]:
    """Every finished run under ``root/runs`` (none when the folder does not exist)."""
    folder = Path(root) / "runs"
    return [load_result(p) for p in sorted(folder.glob("*")) if is_finished(p)]


def saved_runs(root: str | Path) -> list[TrainResult]:
    """Every finished run in any ``runs`` folder under ``root`` (``root/runs`` and e.g. a batch's artifacts).

    A run folder's name is its objective, seed and a hash of its config (:func:`run_name`),
    so two folders of the same name hold the same run made twice (e.g. by notebook 02 and by
    a batch of it); it is counted once, the shallower folder winning.
    """
    root = Path(root)
    folders = sorted((p.parent for p in root.rglob("runs/*/metrics.json") if p.parent.parent.name == "runs"),
                     key=lambda f: (len(f.parts), str(f)))
    unique: dict[str, Path] = {}
    for folder in folders:
        unique.setdefault(folder.name, folder)
    return [load_result(f) for f in unique.values()]


def pick_run(results: Iterable[TrainResult], objective: str, seed: int | None = None, like: TrainConfig | None = None,
             prefer: dict[str, Any] | None = None, probed: bool = False,
             require: str | None = None) -> TrainResult | None:
    """The finished run of ``objective`` a notebook should read, or ``None``. The kit's one matching rule:

    1. candidates have that objective, ``seed`` (if given), pilot-study probing only when
       ``probed`` (probe runs are CE runs with extra logging), and -- with ``like`` -- the same
       :data:`SHAPE_FIELDS` as ``like`` (task, model, pooling, data size, length, steps); with
       ``require`` (a key of :attr:`TrainResult.paths`, e.g. ``"representations"``), only runs that
       have that file (a results pack keeps representations for one seed per objective only);
    2. among them, runs whose config matches more of ``prefer`` (e.g. ``{"lam": 0.1}``) come first,
    3. then those differing from ``like`` in fewer other fields (objective, seed and runtime fields aside),
    4. then lower seeds, then the run folder name (so the choice is deterministic).
    """
    candidates = []
    for r in results:
        c = r.config
        if c.objective != objective or bool(c.probe_angles) != probed or (seed is not None and c.seed != seed):
            continue
        if like is not None and any(getattr(c, f) != getattr(like, f) for f in SHAPE_FIELDS):
            continue
        if require is not None and not Path(r.paths[require]).is_file():
            continue
        candidates.append(r)
    if not candidates:
        return None
    prefer = prefer or {}
    skip = set(RUNTIME_FIELDS) | {"objective", "seed"}
    reference = like.to_dict() if like is not None else {}

    def rank(r: TrainResult):
        mine = r.config.to_dict()
        misses = sum(mine.get(k) != v for k, v in prefer.items())
        others = sum(mine.get(k) != v for k, v in reference.items() if k not in skip)
        return misses, others, r.config.seed, str(r.output_dir)

    return min(candidates, key=rank)


# ---------------------------------------------------------------------------
# tables over many runs
# ---------------------------------------------------------------------------

def results_frame(results: Iterable[TrainResult]) -> pd.DataFrame:
    """One row per run: identifying fields, dev/test metrics of the final exit, gate and angle summaries."""
    rows = []
    for r in results:
        m, c = r.metrics, r.config
        row = {"task": c.task, "objective": c.objective, "seed": c.seed, "lam": c.lam, "mu": c.mu,
               "temperature": c.temperature, "acl_grad": c.use_acl_grad, "threshold": c.threshold,
               "steps": m["steps"], "train_seconds": m["train_seconds"], "run": str(r.output_dir)}
        for split in ("dev", "dev_mismatched", "test"):
            for name, value in m.get(split, {}).items():
                row[f"{split}_{name}"] = value
        row["drop_rate"] = m.get("gate", {}).get("drop_rate")
        row["median_angle"] = m.get("angle", {}).get("median")
        rows.append(row)
    return pd.DataFrame(rows)


def history_frame(results: Iterable[TrainResult]) -> pd.DataFrame:
    """All per-step log rows of the runs, with objective, seed, lambda and gate threshold columns, for curves."""
    frames = []
    for r in results:
        h = pd.DataFrame(r.history)
        if h.empty:
            continue
        h["objective"], h["seed"], h["lam"], h["threshold"] = (r.config.objective, r.config.seed, r.config.lam,
                                                               r.config.threshold)
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


def select(results: Sequence[TrainResult], **fields: Any) -> list[TrainResult]:
    """The runs whose config equals every given field, e.g. ``select(runs, task="rt-polarity", lam=0.1)``."""
    return [r for r in results if all(getattr(r.config, k) == v for k, v in fields.items())]


def find_runs(configs: Iterable[TrainConfig], root: str | Path) -> list[TrainResult]:
    """The finished runs of ``configs`` under ``root/runs``, found by folder name (:func:`run_name`); unfinished
    or missing ones are left out, so ``len(result) < len(configs)`` says some still need training."""
    folders = [Path(root) / "runs" / run_name(c) for c in configs]
    return [load_result(f) for f in folders if is_finished(f)]
