"""One trainer for every objective: CE, CE+SCL, ACL-Embed, ACL, and their multi-exit forms.

``train(config)`` composes the pieces: data (:mod:`acl_lab.data`), model
(:mod:`acl_lab.model`), losses (:mod:`acl_lab.objectives`) and the ACL-Grad gate
(:mod:`acl_lab.grad`). It logs every optimizer step to ``history.jsonl``, keeps the
best checkpoint by the dev metric of the final exit, writes ``metrics.json``, and
can resume: a run interrupted (Ctrl-C, SIGTERM) saves a resumable checkpoint at
the next step boundary, and ``train(config, resume=True)`` continues it with the
same data order and random state, so on CPU it ends with the same metrics as an
uninterrupted run.

Output directory layout::

    config.json  history.jsonl  metrics.json  predictions.npz  representations.safetensors
    checkpoints/best/  checkpoints/last/
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_model_weights, load_training_state, save_checkpoint
from .config import RUNTIME_FIELDS, TrainConfig
from .data import load_task, make_loader, tokenize
from .errors import AclLabError
from .evaluate import dump_representations, evaluate, evaluate_with_predictions, save_predictions
from .grad import ACLGrad, angle_degrees, gradient_cosines
from .losses import acl_embed_loss, supcon_loss
from .model import MultiExitClassifier, build_model
from .objectives import compute_losses
from .result import RUN_FILES, TrainResult, load_result
from .tasks import TaskSpec, get_task
from .utils import amp_dtype, autocast, get_device, set_seed

EVAL_BATCH_SIZE = 64


class _Interrupted(KeyboardInterrupt):
    """Raised at a step boundary after SIGINT/SIGTERM, when the state is consistent and can be saved."""


class _StopFlag:
    """Turns SIGINT/SIGTERM into a request to stop at the next step boundary (a second Ctrl-C stops at once)."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# ---------------------------------------------------------------------------
# output directory policy
# ---------------------------------------------------------------------------

def _comparable(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in RUNTIME_FIELDS}


def prepare_output_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> Path:
    """Create/check the output directory; refuse to mix a run with a different config into it."""
    out = Path(cfg.output_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise AclLabError(f"Output directory {str(out)!r} is not writable ({exc.strerror or exc}). "
                          "Fix: choose another --output-dir (or OUTPUT_DIR) that you can write to.") from None
    old_cfg = out / "config.json"
    if overwrite:
        for name in RUN_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        return out
    if old_cfg.exists():
        try:
            old = json.loads(old_cfg.read_text())
        except json.JSONDecodeError:
            old = {}
        if _comparable(old) != _comparable(cfg.to_dict()):
            diff = sorted(k for k in set(old) | set(cfg.to_dict()) if k not in RUNTIME_FIELDS
                          and old.get(k) != cfg.to_dict().get(k))
            raise AclLabError(
                f"Output directory {str(out)!r} holds a run with a different config (differs in: {', '.join(diff)}). "
                "Fix: pick another --output-dir, or pass --overwrite (overwrite=True) to replace that run."
            )
        if not resume:
            raise AclLabError(
                f"Output directory {str(out)!r} already holds a run with this config. "
                "Fix: pass --resume (resume=True) to continue or reuse it, or --overwrite (overwrite=True) to start again."
            )
    return out


# ---------------------------------------------------------------------------
# pieces of the loop
# ---------------------------------------------------------------------------

def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # the fused kernel updates all parameters in one pass (several times faster than the per-tensor loop on a
    # CPU); it exists for float parameters on CPU and CUDA, so other devices (mps) keep the default
    device = next(model.parameters()).device.type
    fused = device in ("cpu", "cuda") and all(p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=fused or None)


def _scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    warmup = int(round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _make_gate(model: MultiExitClassifier, cfg: TrainConfig) -> ACLGrad:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.angle_scope == "all":
        return ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="all")
    if cfg.angle_scope == "repr":
        return ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="repr")
    scope_params = model.head_parameters() if cfg.angle_scope == "head" else model.top_layer_parameters()
    return ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="params", scope_params=scope_params)


def _probe_angles(model: MultiExitClassifier, out, labels: torch.Tensor, ce: torch.Tensor,
                  cfg: TrainConfig) -> dict[str, float]:
    """Pilot study: angles between grad(CE) and grad(SCL) / grad(ACL-Embed) over all parameters (no update)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rep = out.reps[-1].float()
    probes = {"scl": supcon_loss(rep, labels, temperature=cfg.temperature),
              "acl_embed": acl_embed_loss(rep, labels, model.label_embeddings(-1).float(),
                                          temperature=cfg.temperature, anchors=cfg.anchors)}
    row = {}
    for name, cos in zip(probes, gradient_cosines(ce, list(probes.values()), params)):
        row[f"cos_{name}"] = cos
        row[f"angle_{name}"] = angle_degrees(cos)
    return row


class _History:
    """Append-only JSONL log of steps and evaluations, mirrored in memory."""

    def __init__(self, path: Path, keep_until: int | None) -> None:
        self.path = path
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        if keep_until is not None and path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row["step"] <= keep_until:
                    (self.evals if row.get("event") == "eval" else self.steps).append(row)
        rows = sorted(self.steps + self.evals, key=lambda r: (r["step"], r.get("event") == "eval"))
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def add(self, row: dict) -> None:
        (self.evals if row.get("event") == "eval" else self.steps).append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _summary(history: list[dict], gated: bool) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    angles = [r["angle"] for r in history if r.get("angle") is not None and math.isfinite(r["angle"])]
    if gated:
        kept = [r["kept"] for r in history if "kept" in r]
        summary["gate"] = {"steps": len(kept), "drop_rate": 1.0 - sum(kept) / max(1, len(kept))}
    if angles:
        s = sorted(angles)
        summary["angle"] = {"median": s[len(s) // 2], "frac_over_90": sum(a > 90 for a in s) / len(s)}
    return summary


# ---------------------------------------------------------------------------
# the public entry point
# ---------------------------------------------------------------------------

def train(config: TrainConfig | dict, resume: bool = False, overwrite: bool = False,
          progress: bool = True) -> TrainResult:
    """Fine-tune a model as ``config`` says; return metrics, history and paths (see module docstring)."""
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    cfg.validate()
    task = get_task(cfg.task)
    if task.is_regression and cfg.contrastive:
        raise AclLabError(f"Objective {cfg.objective!r} needs class labels, but task {cfg.task!r} is a regression task. "
                          "Fix: use --objective ce or me-ce for STS-B.")
    out = prepare_output_dir(cfg, resume, overwrite)
    last_dir, best_dir = out / "checkpoints" / "last", out / "checkpoints" / "best"
    if resume and (out / "metrics.json").exists():
        return load_result(out)  # already finished: nothing to do
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    set_seed(cfg.seed)
    device = get_device(cfg.device)
    dtype = amp_dtype(device, cfg.amp)

    model, tokenizer = build_model(cfg.model, task.num_labels, multi_exit=cfg.multi_exit, dropout=cfg.dropout,
                                   seed=cfg.seed, pooling=cfg.pooling)
    model.to(device)
    data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, max_train_samples=cfg.max_train_samples,
                     max_eval_samples=cfg.max_eval_samples, seed=cfg.seed)
    enc = tokenize(data, tokenizer, cfg.max_length)
    eval_loaders = {s: make_loader(enc[s], tokenizer, EVAL_BATCH_SIZE, shuffle=False) for s in enc if s != "train"}
    n_micro = math.ceil(len(enc["train"]) / cfg.batch_size)
    steps_per_epoch = math.ceil(n_micro / cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    optimizer = _optimizer(model, cfg)
    scheduler = _scheduler(optimizer, total_steps, cfg.warmup_ratio)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    gate = _make_gate(model, cfg) if cfg.use_acl_grad else None
    state: dict[str, Any] = {"step": 0, "epoch": 0, "micro_in_epoch": 0, "best_score": None, "best_step": None,
                             "train_seconds": 0.0}
    if resume and last_dir.exists():
        state = load_training_state(last_dir, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
    cfg.to_json(out / "config.json")
    history = _History(out / "history.jsonl", keep_until=state["step"])

    def checkpoint_last() -> None:
        if cfg.save_checkpoints:
            save_checkpoint(last_dir, model, cfg, optimizer, {**state, "scheduler": scheduler.state_dict(),
                                                              "total_steps": total_steps})

    def run_eval() -> None:
        per_exit = evaluate(model, eval_loaders["dev"], task, device)
        score = per_exit[-1][task.main_metric]
        row = {"event": "eval", "step": state["step"], "split": "dev", "score": score, "per_exit": per_exit}
        history.add(row)
        if state["best_score"] is None or score > state["best_score"]:
            state["best_score"], state["best_step"] = score, state["step"]
            save_checkpoint(best_dir, model, cfg)

    eval_every = cfg.eval_every or steps_per_epoch
    bar = _progress(total_steps, state["step"], enabled=progress, desc=f"{cfg.objective} {cfg.task}")
    t_start = time.perf_counter() - state["train_seconds"]
    try:
        with _StopFlag() as stop:
            while state["step"] < total_steps:
                loader = make_loader(enc["train"], tokenizer, cfg.batch_size, shuffle=True,
                                     seed=cfg.seed * 1000 + state["epoch"])
                batches = iter(loader)
                for _ in range(state["micro_in_epoch"]):
                    next(batches)
                while state["step"] < total_steps:
                    group = [b for _, b in zip(range(cfg.grad_accum), batches)]
                    if not group:
                        break
                    probe = cfg.probe_angles and state["step"] % cfg.probe_every == 0  # steps 1, 1+k, ...
                    row = _train_step(model, group, cfg, task, device, dtype, optimizer, scaler, gate,
                                      checkpoint_last, probe)
                    scheduler.step()
                    state["step"] += 1
                    state["micro_in_epoch"] += len(group)
                    state["train_seconds"] = time.perf_counter() - t_start
                    history.add({"step": state["step"], "epoch": state["epoch"], "lr": scheduler.get_last_lr()[0], **row})
                    _update_bar(bar, row)
                    if state["step"] % eval_every == 0 or state["step"] == total_steps:
                        run_eval()
                        checkpoint_last()
                    if stop.requested:
                        raise _Interrupted
                if state["step"] < total_steps:
                    state["epoch"] += 1
                    state["micro_in_epoch"] = 0
    except _Interrupted:
        checkpoint_last()
        bar.close()
        print(f"[acl_lab] interrupted at step {state['step']}/{total_steps}; resumable checkpoint in {last_dir}. "
              "Resume with resume=True (--resume).")
        raise KeyboardInterrupt from None
    except KeyboardInterrupt:
        bar.close()
        print(f"[acl_lab] stopped at once (second interrupt); the last checkpoint in {last_dir} is kept. "
              "Resume with resume=True (--resume).")
        raise
    bar.close()

    # final: best checkpoint on dev and test, representation dump
    if best_dir.exists():
        load_model_weights(best_dir, model)
    metrics: dict[str, Any] = {"task": cfg.task, "objective": cfg.objective, "seed": cfg.seed, "model": cfg.model,
                               "steps": state["step"], "best_step": state["best_step"],
                               "train_seconds": round(state["train_seconds"], 2), "device": str(device)}
    predictions = {}
    for split, loader in eval_loaders.items():
        per_exit, predictions[split] = evaluate_with_predictions(model, loader, task, device)
        metrics[split] = per_exit[-1]
        metrics[f"{split}_per_exit"] = per_exit
    save_predictions(out / "predictions.npz", predictions, list(model.exit_layers))
    metrics["exit_layers"] = list(model.exit_layers)
    metrics.update(_summary(history.steps, gate is not None))
    metrics["config"] = cfg.to_dict()
    if not task.is_regression:
        dump_representations(model, eval_loaders["dev"], device, out / "representations.safetensors",
                             list(task.label_names))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return TrainResult(cfg, metrics, history.steps, history.evals, out)


def _train_step(model, group, cfg: TrainConfig, task: TaskSpec, device, dtype, optimizer, scaler,
                gate: ACLGrad | None, on_bad, probe: bool = False) -> dict[str, Any]:
    """One optimizer step over a group of micro-batches (gradient accumulation); returns the log row."""
    model.train()
    scale = 1.0 / len(group)
    rows: list[dict[str, Any]] = []
    for batch in group:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["labels"]
        with autocast(device, dtype):
            out = model(**batch)
        lp = compute_losses(model, out, labels, cfg, regression=task.is_regression)
        total = lp.total
        if not torch.isfinite(total.detach()):
            optimizer.zero_grad(set_to_none=True)
            on_bad()
            raise AclLabError(
                f"Non-finite loss ({total.item()}) in training; stopped before updating the weights. The last good "
                f"state is saved in {Path(cfg.output_dir) / 'checkpoints' / 'last'}. Fix: lower --lr, raise "
                "--temperature, or check the data for empty texts; then resume or start again."
            )
        row = {"loss": total.item(), **lp.parts}
        if probe:
            row.update(_probe_angles(model, out, labels, lp.ce, cfg))
        scale_fn = (lambda t: scaler.scale(t) * scale) if scaler is not None else scale
        if gate is not None and lp.aux is not None:
            rec = gate.backward(lp.ce, lp.aux, scale=scale_fn, scope_tensors=out.reps)
            row.update(cos=rec.cos, angle=rec.angle, kept=bool(rec.kept))
        else:
            (scale_fn(total) if callable(scale_fn) else total * scale_fn).backward()
        rows.append(row)
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    merged = _mean_rows(rows)
    merged["grad_norm"] = float(grad_norm)
    return merged


def _mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if len(rows) == 1:
        return rows[0]
    merged: dict[str, Any] = {}
    for key in rows[0]:
        vals = [r[key] for r in rows if key in r]
        merged[key] = sum(float(v) for v in vals) / len(vals)
    return merged


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step", dynamic_ncols=True)


def _update_bar(bar, row: dict) -> None:
    post = {"loss": f"{row['loss']:.3f}"}
    if row.get("angle") is not None:
        post["angle"] = f"{row['angle']:.0f}"
    bar.set_postfix(post, refresh=False)
    bar.update(1)
