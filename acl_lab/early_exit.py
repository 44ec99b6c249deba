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

A threshold that (almost) never fires gives speed-up 1 and still pays for every
exit head (DeeBERT issue #22): :func:`sweep` warns about it (``last_layer_share``).
:func:`calibrate` picks, on dev, the threshold with the largest layer speed-up whose
quality drop against the full model stays within a budget; it simulates every
candidate from one stored pass (:func:`exit_logits`, :func:`simulate_exits`).
"""
from __future__ import annotations

import math
import time
import warnings
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
NEVER_FIRES_SHARE = 0.95  # sweep warns when at least this share of samples leaves at the last layer
DROP_TOLERANCE = 1e-12  # float slack on "quality_drop <= max_drop" (used by acl_lab.analysis.exits.best_speedup too)
SPEEDUP_TOLERANCE = 1e-9  # a layer speed-up counts as above 1 (some sample left early) only beyond this slack
LOOSER = {"entropy": "a higher entropy threshold", "maxprob": "a lower maxprob threshold",
          "patience": "a smaller patience"}  # the looser setting of each criterion (exits more samples early)


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
    _check_setting(criterion, threshold)


def _check_setting(criterion: str, threshold: float) -> None:
    if criterion not in CRITERIA:
        raise bad_value("criterion", criterion, CRITERIA, "use 'entropy' (DeeBERT) or 'patience' (PABEE).")
    if criterion == "patience" and (not math.isfinite(threshold) or threshold < 0 or threshold != int(threshold)):
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
        metrics, stats = _exit_stats(task, torch.cat([o.predictions for o in outs]).cpu().numpy(), labels,
                                     torch.cat([o.exit_layers for o in outs]).cpu().numpy(),
                                     full_metrics[task.main_metric], model.num_layers, model.exit_layers[-1])
        share = stats.pop("last_layer_share")  # the table's last column, after the timings
        rows.append({"criterion": criterion, "threshold": thr, **metrics, **stats,
                     "wall_speedup": full_time / t, "seconds": t, "full_seconds": full_time,
                     "last_layer_share": share})
        if share >= NEVER_FIRES_SHARE and len(model.exit_layers) > 1:
            warnings.warn(never_fires_message(criterion, thr, share, model.exit_layers[-1]), UserWarning, stacklevel=2)
    return rows


def _exit_stats(task: TaskSpec, preds: np.ndarray, labels: np.ndarray, layers: np.ndarray, full_value: float,
                num_layers: int, last_layer: int) -> tuple[dict[str, float], dict[str, float]]:
    """The quality and cost of one early-exit setting: the numbers of a row of :func:`sweep` and of :func:`calibrate`.

    ``preds`` and ``layers`` are each sample's prediction and 1-based exit layer, ``full_value`` the full model's
    ``task.main_metric`` on the same samples. Returns ``(metrics, stats)``: :func:`compute_metrics` of ``preds``,
    and ``full_<metric>``, ``quality_drop`` (full minus early exit), ``mean_exit_layer`` (a float32 mean),
    ``layer_speedup`` (``num_layers`` over it) and ``last_layer_share`` (the share that left at ``last_layer``).
    """
    metrics = compute_metrics(task, preds, labels)
    layers = np.asarray(layers, dtype=np.float32)
    mean_layers = float(layers.mean())
    return metrics, {"full_" + task.main_metric: full_value,
                     "quality_drop": full_value - metrics[task.main_metric],
                     "mean_exit_layer": mean_layers, "layer_speedup": num_layers / mean_layers,
                     "last_layer_share": float((layers == last_layer).mean())}


def within_budget(table: pd.DataFrame, max_drop: float) -> pd.Series:
    """Which rows of an early-exit table (:func:`sweep`'s, :func:`calibrate`'s) may be chosen as "the fastest setting
    losing at most ``max_drop``": a ``quality_drop`` within ``max_drop`` (up to :data:`DROP_TOLERANCE`) and a
    ``layer_speedup`` above 1 (:data:`SPEEDUP_TOLERANCE`; at 1 no sample left early, so it is the full model)."""
    return (table["quality_drop"] <= max_drop + DROP_TOLERANCE) & (table["layer_speedup"] > 1.0 + SPEEDUP_TOLERANCE)


def never_fires_message(criterion: str, threshold: float, share: float, last_layer: int) -> str:
    """The warning :func:`sweep` gives when ``share`` (>= :data:`NEVER_FIRES_SHARE`) of samples used every layer."""
    return (f"early exit: the {criterion} threshold {threshold:g} almost never fires: {share:.1%} of the samples "
            f"left at the last layer ({last_layer}), so the speed-up is about 1 while every layer still pays for "
            f"its exit head (as in DeeBERT issue #22). Fix: use a looser threshold: {LOOSER[criterion]} than "
            f"{threshold:g} (in general a higher entropy threshold, a lower maxprob, a smaller patience), or let "
            "`python -m acl_lab early-exit --run RUN --calibrate 0.01` pick one on dev.")


# ---------------------------------------------------------------------------
# calibration: pick a threshold on dev for a target quality drop
# ---------------------------------------------------------------------------
@torch.no_grad()
def exit_logits(model: MultiExitClassifier, loader, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, np.ndarray]:
    """Every exit's logits for every sample of ``loader`` in one full pass, and the labels.

    Returns ``(logits, labels)``: float logits of shape ``[n_exits, N, C]`` on the CPU, in
    ``model.exit_layers`` order, computed with the same ``embed``/``layer``/``pool``/``head_logits``
    steps as :func:`early_exit_predict` (so :func:`simulate_exits` on them makes its decisions), and
    the labels as a numpy array. The last exit's logits are the full model's (:func:`full_predict`).
    ``device`` is where the batches go (default: the model's device).
    """
    if not model.multi_exit:
        _check(model, "entropy", 0.0)
    model.eval()
    device = next(model.parameters()).device if device is None else torch.device(device)
    chunks, labels = [], []
    for batch in loader:
        if "labels" not in batch:
            raise AclLabError("exit_logits needs labelled batches (a 'labels' entry). "
                              "Fix: build the loader with acl_lab.data.make_loader on a tokenized split.")
        b = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        hidden, mask = model.embed(b["input_ids"], b["attention_mask"], b.get("token_type_ids"))
        per_exit = []
        for i, k in enumerate(model.exit_layers):
            hidden = model.layer(k, hidden, mask)
            per_exit.append(model.head_logits(i, model.pool(hidden, mask)).float().cpu())
        chunks.append(torch.stack(per_exit))
        labels.append(np.asarray(batch["labels"].cpu().numpy() if hasattr(batch["labels"], "cpu")
                                 else batch["labels"]))
    if not chunks:
        raise AclLabError("The loader gave no batches, so there is nothing to calibrate or evaluate on. "
                          "Fix: pass a loader over a non-empty split (check max_eval_samples and the split name).")
    return torch.cat(chunks, dim=1), np.concatenate(labels)


def simulate_exits(all_logits: torch.Tensor, criterion: str, threshold: float,
                   exit_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decisions :func:`early_exit_predict` makes, computed from stored logits.

    ``all_logits`` is ``[n_exits, N, C]`` (see :func:`exit_logits`). A sample leaves at the first
    exit where the criterion fires (normalised entropy below ``threshold``; max probability at or
    above it; the same prediction ``threshold`` times in a row for patience), and at the last exit
    at the latest. Returns ``(predictions, exit_layer)``: long tensors of shape ``[N]``, the
    prediction at the exit taken and its 1-based layer.
    """
    _check_setting(criterion, threshold)
    if all_logits.ndim != 3 or all_logits.shape[0] != len(exit_layers):
        raise AclLabError(f"all_logits must be [n_exits, N, C] with n_exits = len(exit_layers) = "
                          f"{len(exit_layers)}; got shape {tuple(all_logits.shape)}. Fix: pass exit_logits(...)[0] "
                          "and model.exit_layers.")
    logits = all_logits.float()
    preds = logits.argmax(-1)  # [E, N]
    if criterion == "entropy":
        leave = normalised_entropy(logits) < threshold
    elif criterion == "maxprob":
        leave = torch.softmax(logits, -1).max(-1).values >= threshold
    else:
        streak = torch.zeros_like(preds)
        for e in range(1, preds.shape[0]):
            streak[e] = torch.where(preds[e] == preds[e - 1], streak[e - 1] + 1, torch.zeros_like(streak[e]))
        leave = streak >= int(threshold)
    leave[-1] = True
    first = leave.to(torch.uint8).argmax(0)  # the first exit where the sample leaves
    n = torch.arange(preds.shape[1])
    layers = torch.as_tensor(exit_layers, dtype=torch.long)
    return preds[first, n], layers[first]


def default_thresholds(criterion: str, n_exits: int) -> list[float]:
    """The candidate grid of :func:`calibrate`: entropy 0..1 and maxprob 0.5..1 in 0.01 steps,
    patience 0..n_exits-1 (each grid holds the setting that never exits early)."""
    if criterion == "entropy":
        return [round(0.01 * i, 2) for i in range(101)]
    if criterion == "maxprob":
        return [round(0.5 + 0.01 * i, 2) for i in range(51)]
    if criterion == "patience":
        return [float(p) for p in range(n_exits)]
    raise bad_value("criterion", criterion, CRITERIA, "use 'entropy' (DeeBERT) or 'patience' (PABEE).")


def never_early_threshold(criterion: str, n_exits: int) -> float:
    """The threshold meant to never let a sample leave before the last exit: entropy 0 (an entropy is never
    below 0), maxprob 1.0 (the largest valid value; a float32 softmax can still round to exactly 1, which
    :func:`calibrate` checks), patience ``n_exits - 1``."""
    return {"entropy": 0.0, "maxprob": 1.0, "patience": float(n_exits - 1)}[criterion]


def calibrate(model: MultiExitClassifier, dev_loader, task: TaskSpec, criterion: str = "entropy",
              max_drop: float = 0.01, thresholds: list[float] | None = None,
              device: torch.device | str | None = None) -> dict:
    """Pick, on dev, the ``criterion`` threshold with the largest layer speed-up whose quality drop is <= ``max_drop``.

    The drop is the full model's (final exit, as :func:`full_predict`) ``task.main_metric`` on dev minus
    early exit's, as a fraction (``max_drop=0.01`` is one point), computed with
    :func:`acl_lab.tasks.compute_metrics` as :func:`sweep` does. One pass stores every exit's logits
    (:func:`exit_logits`); each candidate is then simulated (:func:`simulate_exits`). ``thresholds``
    default to :func:`default_thresholds`. Ties in speed-up go to the smaller drop, then to the stricter
    threshold. If no candidate beats speed-up 1 within ``max_drop``, the threshold that never exits early
    (:func:`never_early_threshold`) is returned, with a warning. ``device``: default the model's.

    Returns a dict: ``criterion``, ``threshold``, ``metric`` (the name), ``dev_<metric>``,
    ``full_dev_<metric>``, ``quality_drop``, ``mean_exit_layer``, ``layer_speedup``, ``last_layer_share``,
    ``max_drop``, ``n_samples``, ``fallback`` (True when nothing beat the full model) and ``table``
    (a pandas DataFrame, one row per candidate, with a ``chosen`` column).
    """
    import pandas as pd

    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not math.isfinite(max_drop) \
            or max_drop < 0:
        raise bad_value("max_drop", max_drop, "a finite number >= 0 (a fraction of the metric: 0.01 is one point)",
                        "use e.g. 0.01 to lose at most one point of dev quality.")
    _check(model, criterion, 0.0)
    n_exits = len(model.exit_layers)
    grid = default_thresholds(criterion, n_exits) if thresholds is None else [float(t) for t in thresholds]
    if not grid:
        raise AclLabError("calibrate got an empty list of thresholds. Fix: pass thresholds=None for the default "
                          "grid, or at least one threshold.")
    for thr in grid:
        _check_setting(criterion, thr)
    never = never_early_threshold(criterion, n_exits)
    if never not in grid:
        grid.append(never)
    all_logits, labels = exit_logits(model, dev_loader, device)
    metric = task.main_metric
    full = compute_metrics(task, all_logits[-1].argmax(-1).numpy(), labels)[metric]
    rows = []
    for thr in grid:
        preds, layers = simulate_exits(all_logits, criterion, thr, model.exit_layers)
        metrics, stats = _exit_stats(task, preds.numpy(), labels, layers.numpy(), full, model.num_layers,
                                     model.exit_layers[-1])
        rows.append({"criterion": criterion, "threshold": thr, metric: metrics[metric], **stats})
    table = pd.DataFrame(rows)
    ok = table[within_budget(table, max_drop)]
    fallback = ok.empty
    if fallback:
        best = table[table["threshold"] == never].iloc[0]
    else:
        # largest speed-up; then smallest drop; then the stricter threshold (lower entropy, higher maxprob/patience)
        strict = ok["threshold"] if criterion == "entropy" else -ok["threshold"]
        order = ok.assign(_neg_speed=-ok["layer_speedup"], _strict=strict).sort_values(
            ["_neg_speed", "quality_drop", "_strict"], kind="mergesort")
        best = table.loc[order.index[0]]
    table["chosen"] = table.index == best.name
    result = {"criterion": criterion, "threshold": float(best["threshold"]), "metric": metric,
              "dev_" + metric: float(best[metric]), "full_dev_" + metric: float(full),
              "quality_drop": float(best["quality_drop"]), "mean_exit_layer": float(best["mean_exit_layer"]),
              "layer_speedup": float(best["layer_speedup"]), "last_layer_share": float(best["last_layer_share"]),
              "max_drop": float(max_drop), "n_samples": int(labels.shape[0]), "fallback": fallback, "table": table}
    if fallback:
        msg = (f"calibrate: no {criterion} threshold among the {len(grid)} candidates gives a layer speed-up above 1 "
               f"with a dev {metric} drop <= {max_drop:g}; returning {criterion} threshold {never:g}, the setting that "
               "never exits early")
        if best["layer_speedup"] <= 1.0 + SPEEDUP_TOLERANCE:
            msg += " (the full model's quality, layer speed-up 1.0)."
        else:
            msg += (f". Note: maxprob 1.0 still let {1 - best['last_layer_share']:.1%} of dev samples leave early "
                    f"(their softmax rounds to exactly 1) with a drop of {best['quality_drop']:.4f}; use "
                    "criterion 'entropy' with threshold 0 to be sure nobody leaves early.")
        msg += (" Fix: allow a larger drop (max_drop / --calibrate), try another criterion, or train the exits "
                "longer (a multi-exit objective such as me-acl).")
        warnings.warn(msg, UserWarning, stacklevel=2)
    return result


def load_for_exit(checkpoint: str | Path, device: str = "auto"):
    """A trained multi-exit checkpoint and the data it is judged on: ``(model, tokenizer, cfg, task, data)``.

    ``data`` is the run's task loaded as it was trained (its source, data folder, ``max_eval_samples`` and seed),
    untokenized, so each caller tokenizes only the splits it times (:func:`sweep_run`, ``python -m acl_lab
    early-exit``, ``bench/bench_early_exit.py``).
    """
    from .checkpoint import load_trained
    from .data import load_task
    from .tasks import get_task

    model, tokenizer, cfg = load_trained(checkpoint, device=device)
    data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, max_eval_samples=cfg.max_eval_samples,
                     seed=cfg.seed)
    return model, tokenizer, cfg, get_task(cfg.task), data


def sweep_run(run_dir: str | Path, settings: dict[str, list[float]], split: str = "dev", batch_size: int = 64,
              repeats: int = 2, device: str = "auto", max_samples: int | None = None) -> pd.DataFrame:
    """Early-exit sweep of a finished multi-exit run's best checkpoint on ``split``.

    ``settings`` maps a criterion to its thresholds, e.g. ``{"entropy": [0.1, 0.3],
    "patience": [1, 2]}``. Returns the rows of :func:`acl_lab.early_exit.sweep` for
    every criterion, with ``objective``, ``seed``, ``batch_size`` and ``run`` columns. ``max_samples`` keeps the
    split's first samples only (e.g. for a batch-size-1 latency sweep, which costs a pass per sample).
    """
    import pandas as pd

    from .data import make_loader, tokenize
    from .utils import get_device

    run_dir = Path(run_dir)
    model, tokenizer, cfg, task, data = load_for_exit(run_dir / "checkpoints" / "best", device=device)
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
