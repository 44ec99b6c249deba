"""Train many configs into one run cache: what the notebooks and the evidence pipeline call to run comparisons.

Each run goes to ``<root>/runs/<objective>-s<seed>-<hash>`` (:func:`acl_lab.analysis.runs.run_name`), so
re-running a notebook reuses finished runs, resumes interrupted ones, and never mixes two configs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ..analysis.runs import run_name
from ..config import TrainConfig
from ..result import TrainResult
from ..trainer import train


def run_many(configs: Iterable[TrainConfig], root: str | Path, progress: bool = True) -> list[TrainResult]:
    """Train each config under ``root/runs`` (finished runs are read back, interrupted ones resumed)."""
    results = []
    for cfg in configs:
        cfg = cfg.replace(output_dir=str(Path(root) / "runs" / run_name(cfg)))
        results.append(train(cfg, resume=True, progress=progress))
    return results
