"""Early exit at inference, batched: samples that have left stop costing compute.

At each layer the still-active samples go through the layer; their exit's
classifier decides who leaves (docs/METHOD.md, "Early exit"):

- ``entropy``: normalised entropy of the softmax below ``threshold`` (DeeBERT);
- ``maxprob``: maximum probability at or above ``threshold``;
- ``patience``: the same prediction at ``patience + 1`` consecutive exits, i.e. the
  prediction stayed unchanged ``patience`` times (PABEE); ``patience=0`` leaves at layer 1.

Those who leave are dropped from the hidden-state tensor, so later layers run on a
smaller batch; every sample leaves at the last layer at the latest. This is why it
works at any batch size, not only at batch size 1.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import AclLabError, bad_value
from .model import MultiExitClassifier
from .tasks import TaskSpec, compute_metrics

if TYPE_CHECKING:
    import pandas as pd

CRITERIA = ("entropy", "maxprob", "patience")


@dataclass
class ExitDecisions:
    """Per-sample predictions, the 1-based layer each sample left at, and its logits there."""

    predictions: torch.Tensor
    exit_layers: torch.Tensor
    logits: torch.Tensor


def normalised_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) divided by log C, in [0, 1]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return ent / math.log(logits.shape[-1])


def _check(model: MultiExitClassifier, criterion: str, threshold: float) -> None:
    if not model.multi_exit:
        raise AclLabError("Early exit needs a classifier on every layer, but this model has one exit. "
                          "Fix: train it with a multi-exit objective (me-ce, me-acl or me-acl-cl).")
    if criterion not in CRITERIA:
        raise bad_value("criterion", criterion, CRITERIA, "use 'entropy' (DeeBERT) or 'patience' (PABEE).")
    if criterion == "patience" and (threshold < 0 or threshold != int(threshold)):
        raise bad_value("patience", threshold, "an integer >= 0", "use e.g. 2.")
    if criterion != "patience" and not 0.0 <= threshold <= 1.0:
        raise bad_value("threshold", threshold, "a number in [0, 1]", "use e.g. 0.3 for entropy, 0.9 for maxprob.")


@torch.no_grad()
def early_exit_predict(model: MultiExitClassifier, input_ids, attention_mask, token_type_ids=None,
                       criterion: str = "entropy", threshold: float = 0.3, **_ignored) -> ExitDecisions:
    """Predict a batch with early exit; see the module docstring for the criteria."""
    _check(model, criterion, threshold)
    model.eval()
    n = input_ids.shape[0]
    device = input_ids.device
    preds = torch.empty(n, dtype=torch.long, device=device)
    exits = torch.empty(n, dtype=torch.long, device=device)
    out_logits = torch.empty(n, model.num_labels, device=device)
    hidden, mask = model.embed(input_ids, attention_mask, token_type_ids)
    active = torch.arange(n, device=device)
    last_pred = torch.full((n,), -1, dtype=torch.long, device=device)
    streak = torch.zeros(n, dtype=torch.long, device=device)
    for i, k in enumerate(model.exit_layers):
        hidden = model.layer(k, hidden, mask)
        logits = model.head_logits(i, model.pool(hidden, mask)).float()
        pred = logits.argmax(-1)
        if criterion == "entropy":
            leave = normalised_entropy(logits) < threshold
        elif criterion == "maxprob":
            leave = torch.softmax(logits, -1).max(-1).values >= threshold
        else:
            streak = torch.where(pred == last_pred, streak + 1, torch.zeros_like(streak))
            last_pred = pred
            leave = streak >= int(threshold)
        if k == model.exit_layers[-1]:
            leave = torch.ones_like(leave)
        idx = active[leave]
        preds[idx], exits[idx], out_logits[idx] = pred[leave], k, logits[leave]
        stay = ~leave
        if not stay.any():
            break
        active, hidden, mask = active[stay], hidden[stay], mask[stay]
        last_pred, streak = last_pred[stay], streak[stay]
    return ExitDecisions(preds, exits, out_logits)


@torch.no_grad()
def full_predict(model: MultiExitClassifier, input_ids, attention_mask, token_type_ids=None, **_ignored) -> torch.Tensor:
    """The full model's prediction: all layers, final exit only (the baseline for speed-up)."""
    model.eval()
    hidden, mask = model.embed(input_ids, attention_mask, token_type_ids)
    for k in range(1, model.num_layers + 1):
        hidden = model.layer(k, hidden, mask)
    return model.head_logits(len(model.exit_layers) - 1, model.pool(hidden, mask)).float().argmax(-1)


def _paired_times(early, full, batches: list[dict], repeats: int) -> tuple[float, float, list]:
    """Best-of-``repeats`` total seconds of ``early`` and ``full``, timed back to back on each batch.

    Timing the two on the same batch one right after the other keeps a busy machine's
    load changes from landing on one side only.
    """
    best_e, best_f, outs = float("inf"), float("inf"), []
    for _ in range(repeats):
        t_e = t_f = 0.0
        outs = []
        for b in batches:
            t0 = time.perf_counter()
            full(**b)
            t1 = time.perf_counter()
            outs.append(early(**b))
            t2 = time.perf_counter()
            t_f += t1 - t0
            t_e += t2 - t1
        best_e, best_f = min(best_e, t_e), min(best_f, t_f)
    return best_e, best_f, outs


def sweep(model: MultiExitClassifier, loader, task: TaskSpec, criterion: str, thresholds: list[float],
          device: torch.device, repeats: int = 2) -> list[dict]:
    """Quality, mean exit layer, layer speed-up and measured wall-clock speed-up for each threshold.

    For each threshold the early-exit model and the full model are timed back to back
    on every batch (best of ``repeats`` passes), so the ratio is fair on a busy machine.
    """
    batches = [{k: v.to(device) for k, v in b.items() if k != "labels"} for b in loader]
    labels = np.concatenate([b["labels"].numpy() for b in loader])
    full_preds = torch.cat([full_predict(model, **b) for b in batches]).cpu().numpy()
    full_metrics = compute_metrics(task, full_preds, labels)
    rows = []
    for thr in thresholds:
        t, full_time, outs = _paired_times(
            lambda **b: early_exit_predict(model, criterion=criterion, threshold=thr, **b),
            lambda **b: full_predict(model, **b), batches, repeats)
        preds = torch.cat([o.predictions for o in outs]).cpu().numpy()
        layers = torch.cat([o.exit_layers for o in outs]).float().cpu().numpy()
        metrics = compute_metrics(task, preds, labels)
        mean_layers = float(layers.mean())
        rows.append({
            "criterion": criterion, "threshold": thr, **metrics,
            "full_" + task.main_metric: full_metrics[task.main_metric],
            "quality_drop": full_metrics[task.main_metric] - metrics[task.main_metric],
            "mean_exit_layer": mean_layers, "layer_speedup": model.num_layers / mean_layers,
            "wall_speedup": full_time / t, "seconds": t, "full_seconds": full_time,
        })
    return rows


def sweep_run(run_dir: str | Path, settings: dict[str, list[float]], split: str = "dev", batch_size: int = 64,
              repeats: int = 2, device: str = "auto", max_samples: int | None = None) -> pd.DataFrame:
    """Early-exit sweep of a finished multi-exit run's best checkpoint on ``split``.

    ``settings`` maps a criterion to its thresholds, e.g. ``{"entropy": [0.1, 0.3],
    "patience": [1, 2]}``. Returns the rows of :func:`acl_lab.early_exit.sweep` for
    every criterion, with ``objective``, ``seed``, ``batch_size`` and ``run`` columns. ``max_samples`` keeps the
    split's first samples only (e.g. for a batch-size-1 latency sweep, which costs a pass per sample).
    """
    import pandas as pd

    from .checkpoint import load_trained
    from .data import load_task, make_loader, tokenize
    from .tasks import get_task
    from .utils import get_device

    run_dir = Path(run_dir)
    model, tokenizer, cfg = load_trained(run_dir / "checkpoints" / "best", device=device)
    task = get_task(cfg.task)
    data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, max_eval_samples=cfg.max_eval_samples,
                     seed=cfg.seed)
    if split not in data:
        raise AclLabError(f"Split {split!r} is not in task {cfg.task!r}; available: {', '.join(data)}.")
    part = data[split] if max_samples is None else data[split].select(range(min(max_samples, len(data[split]))))
    enc = tokenize(type(data)({split: part}), tokenizer, cfg.max_length)
    loader = make_loader(enc[split], tokenizer, batch_size, shuffle=False)
    # one discarded pass over one batch first, so one-off costs (allocations, kernel selection) miss the timings
    sweep(model, [next(iter(loader))], task, "patience", [0], get_device(device), repeats=1)
    rows = []
    for criterion, thresholds in settings.items():
        rows += sweep(model, loader, task, criterion, list(thresholds), get_device(device), repeats=repeats)
    df = pd.DataFrame(rows)
    df.insert(0, "objective", cfg.objective)
    df.insert(1, "seed", cfg.seed)
    df.insert(2, "batch_size", batch_size)
    df["run"] = str(run_dir)
    return df
