"""Per-exit evaluation and the representation dump the UMAP notebook reads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .atomic import target
from .errors import AclLabError
from .model import MultiExitClassifier
from .tasks import TaskSpec, compute_metrics

REPS_SAMPLES = 1000  # dev samples of a run's representation dump (representations.safetensors)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def collect_outputs(model: MultiExitClassifier, loader, device: torch.device, with_reps: bool = False,
                    max_samples: int | None = None, reps_samples: int | None = None
                    ) -> dict[str, np.ndarray | list[np.ndarray]]:
    """Run ``loader`` through the model; return per-exit logits (and reps) and the labels, as NumPy arrays.

    ``max_samples`` stops after that many samples; ``reps_samples`` keeps the reps of only the first
    that many (the logits of all), so one pass can give a split's metrics and a bounded representation dump.
    """
    model.eval()
    logits: list[list[torch.Tensor]] = [[] for _ in model.exit_layers]
    reps: list[list[torch.Tensor]] = [[] for _ in model.exit_layers]
    labels = []
    seen = 0
    for batch in loader:
        batch = _to_device(batch, device)
        out = model(**batch)
        for i in range(len(model.exit_layers)):
            logits[i].append(out.logits[i].float().cpu())
            if with_reps and (reps_samples is None or seen < reps_samples):
                reps[i].append(out.reps[i].float().cpu())
        labels.append(batch["labels"].cpu())
        seen += len(batch["labels"])
        if max_samples is not None and seen >= max_samples:
            break
    if not labels:
        raise AclLabError("The evaluation split is empty. Fix: check the data source and --max-eval-samples.")
    n = seen if max_samples is None else min(seen, max_samples)
    result: dict = {"logits": [torch.cat(x)[:n].numpy() for x in logits], "labels": torch.cat(labels)[:n].numpy()}
    if with_reps:
        kept = n if reps_samples is None else min(n, reps_samples)
        result["reps"] = [torch.cat(x)[:kept].numpy() for x in reps]
    return result


def predictions(logits: np.ndarray, task: TaskSpec) -> np.ndarray:
    """Class ids (argmax) or, for a regression task, the single output."""
    return logits[:, 0] if task.is_regression else logits.argmax(-1)


def evaluate(model: MultiExitClassifier, loader, task: TaskSpec, device: torch.device) -> list[dict[str, float]]:
    """Metrics of every exit, in layer order."""
    return evaluate_with_predictions(model, loader, task, device)[0]


def evaluate_with_predictions(model: MultiExitClassifier, loader, task: TaskSpec, device: torch.device
                              ) -> tuple[list[dict[str, float]], dict[str, np.ndarray]]:
    """Metrics of every exit and the predictions they come from, from ONE pass over ``loader``.

    Returns ``(per_exit_metrics, {"labels": [N], "predictions": [exits, N]})``; the
    predictions are what the paired tests over examples (:mod:`acl_lab.analysis.paired`) compare.
    """
    return scores_of(collect_outputs(model, loader, device), task)


def scores_of(outputs: dict, task: TaskSpec) -> tuple[list[dict[str, float]], dict[str, np.ndarray]]:
    """Per-exit metrics and predictions of outputs already collected (:func:`collect_outputs`), as
    :func:`evaluate_with_predictions` returns them."""
    preds = np.stack([predictions(lg, task) for lg in outputs["logits"]])
    return ([compute_metrics(task, p, outputs["labels"]) for p in preds],
            {"labels": outputs["labels"], "predictions": preds})


def _small(values: np.ndarray) -> np.ndarray:
    """Class ids as the smallest integer type that holds them (int8 for up to 127 classes); floats as float32."""
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.integer):
        return values.astype(np.float32)
    for kind in (np.int8, np.int16, np.int32):
        if values.size == 0 or (values.min() >= np.iinfo(kind).min and values.max() <= np.iinfo(kind).max):
            return values.astype(kind)
    return values.astype(np.int64)


def save_predictions(path: str | Path, by_split: dict[str, dict[str, np.ndarray]], exit_layers: list[int]) -> Path:
    """Write ``predictions.npz``: for each split ``<split>.labels`` [N] and ``<split>.predictions`` [exits, N]
    (small integer arrays, in the split's order), and ``exit_layers``. Read it with
    :func:`acl_lab.result.load_predictions`."""
    arrays = {"exit_layers": np.asarray(exit_layers, dtype=np.int8)}
    for split, d in by_split.items():
        arrays[f"{split}.labels"] = _small(d["labels"])
        arrays[f"{split}.predictions"] = _small(d["predictions"])
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)
    return path


def dump_representations(model: MultiExitClassifier, loader, device: torch.device, path: str | Path,
                         label_names: list[str], max_samples: int = REPS_SAMPLES) -> Path:
    """Save the [CLS] representations of every exit, the labels and the label embeddings (safetensors).

    Keys: ``reps.<layer>`` [N, d], ``label_embeddings.<layer>`` [C, d], ``labels`` [N],
    ``logits.<layer>`` [N, C]; metadata holds the label names and the exit layers.
    """
    out = collect_outputs(model, loader, device, with_reps=True, max_samples=max_samples)
    return save_representations(model, out, path, label_names)


def save_representations(model: MultiExitClassifier, outputs: dict, path: str | Path, label_names: list[str]) -> Path:
    """Write the dump of :func:`dump_representations` from outputs already collected with reps (the first
    ``len(reps)`` samples; so a run's last evaluation pass can serve it without a pass of its own)."""
    n = len(outputs["reps"][0])
    tensors = {"labels": torch.from_numpy(np.ascontiguousarray(outputs["labels"][:n]))}
    for i, layer in enumerate(model.exit_layers):
        tensors[f"reps.{layer}"] = torch.from_numpy(outputs["reps"][i]).contiguous()
        tensors[f"logits.{layer}"] = torch.from_numpy(np.ascontiguousarray(outputs["logits"][i][:n]))
        tensors[f"label_embeddings.{layer}"] = model.label_embeddings(i).detach().float().cpu().contiguous()
    meta = {"label_names": ",".join(label_names), "layers": ",".join(map(str, model.exit_layers))}
    path = Path(path)
    with target(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


def shrink_representations(src: str | Path, dest: str | Path, max_samples: int = 400) -> Path:
    """A small copy of a representation dump for the results pack: the first ``max_samples`` dev samples, float16.

    Same keys and metadata as :func:`dump_representations`, so :func:`load_representations`
    (which returns float32) reads either.
    """
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        meta = f.metadata() or {}
    tensors = load_file(str(src))
    small = {}
    for key, t in tensors.items():
        if not key.startswith("label_embeddings."):
            t = t[:max_samples]
        small[key] = (t.half() if t.is_floating_point() else t).contiguous()
    dest = Path(dest)
    save_file(small, str(dest), metadata=meta)
    return dest


def load_representations(path: str | Path) -> dict:
    """Read a dump written by :func:`dump_representations` into NumPy arrays keyed by layer."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise AclLabError(f"No representation dump at {str(path)!r}. Fix: train a run first "
                          "(notebook 02 or `python -m acl_lab train`); it writes representations.safetensors.")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    t = load_file(str(path))
    layers = [int(x) for x in meta.get("layers", "").split(",") if x]
    return {
        "layers": layers,
        "label_names": meta.get("label_names", "").split(","),
        "labels": t["labels"].numpy(),
        "reps": {k: t[f"reps.{k}"].float().numpy() for k in layers},
        "logits": {k: t[f"logits.{k}"].float().numpy() for k in layers},
        "label_embeddings": {k: t[f"label_embeddings.{k}"].float().numpy() for k in layers},
    }
