"""What a finished run leaves on disk, and how to read it back: :class:`TrainResult` and :func:`load_result`.

The trainer writes a run folder; everything that reads results (the analysis layer,
the plots, the notebooks) reads it through this module, so nothing that only reads
needs to import the trainer. A run folder holds::

    config.json  history.jsonl  metrics.json  predictions.npz  representations.safetensors
    checkpoints/best/  checkpoints/last/

``predictions.npz`` holds each evaluation split's labels and every exit's predictions
(:func:`load_predictions`), for the paired tests over examples.

A run is *finished* when ``metrics.json`` exists (it is written last, whole).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import read_jsonl
from .config import TrainConfig
from .errors import AclLabError

RUN_FILES = ("config.json", "history.jsonl", "metrics.json", "representations.safetensors", "predictions.npz",
             "checkpoints")


@dataclass
class TrainResult:
    """What a run produced: final metrics, the per-step history and where things were written."""

    config: TrainConfig
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    output_dir: Path = Path(".")

    @property
    def paths(self) -> dict[str, Path]:
        out = self.output_dir
        return {"metrics": out / "metrics.json", "history": out / "history.jsonl", "best": out / "checkpoints" / "best",
                "last": out / "checkpoints" / "last", "representations": out / "representations.safetensors",
                "predictions": out / "predictions.npz"}


def is_finished(output_dir: str | Path) -> bool:
    """The one run-folder check: a run is finished when its ``metrics.json`` exists."""
    return (Path(output_dir) / "metrics.json").is_file()


def read_history_text(output_dir: str | Path) -> str:
    """The text of a run's ``history.jsonl``, or of ``history.jsonl.gz`` (how a results pack stores it: JSON lines
    compress about 5x); ``""`` when there is neither."""
    out = Path(output_dir)
    if (out / "history.jsonl").exists():
        return (out / "history.jsonl").read_text()
    if (out / "history.jsonl.gz").exists():
        import gzip

        return gzip.decompress((out / "history.jsonl.gz").read_bytes()).decode()
    return ""


def load_result(output_dir: str | Path) -> TrainResult:
    """Read a finished run back from its output directory (metrics, history, config)."""
    out = Path(output_dir)
    if not is_finished(out):
        raise AclLabError(f"{str(out)!r} holds no finished run (no metrics.json). Fix: train it first, or resume it "
                          "with resume=True (--resume).")
    try:
        metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
        config = TrainConfig.from_dict(metrics["config"])
    except AclLabError:
        raise  # e.g. a field this version does not know: that message names it
    except (ValueError, KeyError, TypeError):
        raise AclLabError(f"{str(out / 'metrics.json')!r} is damaged (not the metrics acl_lab wrote). Fix: delete it "
                          "and train again with --resume (the checkpoints are kept), or restore it.") from None
    steps, evals = [], []
    if (out / "history.jsonl").exists():
        rows = read_jsonl(out / "history.jsonl")  # a torn last line (a kill mid-append) is dropped
    else:  # a results pack stores it gzipped
        rows = [json.loads(line) for line in read_history_text(out).splitlines() if line.strip()]
    for row in rows:
        (evals if row.get("event") == "eval" else steps).append(row)
    return TrainResult(config, metrics, steps, evals, out)


def load_predictions(output_dir: str | Path) -> dict[str, Any]:
    """A run's ``predictions.npz``: ``{"exit_layers": [...], split: {"labels": [N], "predictions": [exits, N]}}``.

    The predictions are int64 class ids (float for a regression task), in the split's order.
    """
    import numpy as np

    path = Path(output_dir) / "predictions.npz"
    if not path.is_file():
        raise AclLabError(f"No per-example predictions at {str(path)!r}. Fix: the run predates predictions.npz; "
                          "train it again (delete its folder, then rerun the notebook or `python -m acl_lab evidence`).")
    with np.load(path) as z:
        out: dict[str, Any] = {"exit_layers": [int(k) for k in z["exit_layers"]]}
        for key in z.files:
            if key.endswith(".labels"):
                split = key.removesuffix(".labels")
                preds = z[f"{split}.predictions"]
                cast = np.int64 if np.issubdtype(preds.dtype, np.integer) else np.float64
                out[split] = {"labels": z[key].astype(cast), "predictions": preds.astype(cast)}
    return out
