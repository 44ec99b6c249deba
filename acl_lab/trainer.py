"""One trainer for every objective: CE, CE+SCL, ACL-Embed, ACL, and their multi-exit forms.

:class:`Trainer` composes the pieces: data (:mod:`acl_lab.data`), model
(:mod:`acl_lab.model`), losses (:mod:`acl_lab.objectives`) and the ACL-Grad gate
(:mod:`acl_lab.grad`), and exposes them with ``step()``, ``evaluate()``, ``save()``,
``fit()`` and ``on_step``/``on_eval`` hooks; ``train(config)`` is ``Trainer(config).fit()``.
It logs every optimizer step to ``history.jsonl``, keeps the
best checkpoint by the dev metric of the final exit, writes ``metrics.json``, and
can resume: a run interrupted (Ctrl-C, SIGTERM) saves a resumable checkpoint at
the next step boundary, and ``train(config, resume=True)`` continues it with the
same data order and random state, so on CPU it ends with the same metrics as an
uninterrupted run.

Under ``torchrun`` (or ``accelerate launch``) every process runs the same code: the
global batch ``batch_size`` is split evenly over the processes, the contrastive terms
see the global batch, ACL-Grad decides on global gradients, and only rank 0 writes
files and shows progress (README, "Several processes").

Output directory layout::

    config.json  history.jsonl  metrics.json  predictions.npz  representations.safetensors
    checkpoints/best/  checkpoints/last/
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import inspect
import json
import math
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import distributed as dist
from .atomic import append_line, read_jsonl, restore_folder, write_json, write_text
from .checkpoint import load_model_weights, load_training_state, rng_state, save_checkpoint, set_rng_state
from .analysis.stats import median
from .config import CONFLICT_DEGREES, RUNTIME_FIELDS, TrainConfig
from .data import load_task, make_loader, tokenize
from .errors import AclLabError, bad_value
from .evaluate import (REPS_SAMPLES, collect_outputs, evaluate_with_predictions, save_predictions,
                       save_representations, scores_of)
from .grad import ACLGrad, Reduce, angle_degrees, gradient_cosines, reduce_grads
from .locks import one_writer, train_output_dir
from .model import MultiExitClassifier, build_model
from .objectives import compute_losses, probe_losses
from .result import RUN_FILES, TrainResult, load_result
from .tasks import TaskSpec, get_task
from .utils import amp_dtype, autocast, get_device, grad_scaler, set_seed

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
    if overwrite:
        for name in RUN_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        return out
    for old in _stored_configs(out):
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


def _stored_configs(out: Path) -> list[dict]:
    """The configs a run folder records: config.json, and the one inside metrics.json once finished.

    Both must match a run that resumes, so a config.json edited by hand cannot pass off a
    finished run's metrics as those of another config. A damaged file is refused.
    """
    found = []
    for path in (out / "config.json", out / "metrics.json"):
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            data = None
        if isinstance(data, dict) and path.name == "metrics.json":
            data = data.get("config")
        if not isinstance(data, dict):
            raise AclLabError(f"{str(path)!r} is damaged (not the JSON object acl_lab wrote). Fix: restore it, or "
                              "delete it and run again with --resume (the checkpoints are kept), or pass --overwrite "
                              "(overwrite=True) to start that run again.")
        found.append(data)
    return found


# ---------------------------------------------------------------------------
# pieces of the loop
# ---------------------------------------------------------------------------

def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on the weight matrices only (not on biases and LayerNorm)."""
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


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    """Linear warm-up over ``warmup_ratio * total_steps`` steps, then linear decay to 0."""
    warmup = int(round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_gate(model: MultiExitClassifier, cfg: TrainConfig, reduce: Reduce | None = None) -> ACLGrad:
    """The ACL-Grad gate of ``cfg.angle_scope`` over the model's trainable parameters.

    ``lam=1.0``: :func:`acl_lab.objectives.compute_losses` folds lambda (and mu) into the
    auxiliary loss, so the gate's multiplier is 1 or 0 and the trainer logs
    ``lam_t = cfg.lam * multiplier``. ``reduce`` (several processes) makes the decision global.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.angle_scope in ("all", "repr", "screened"):
        return ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope=cfg.angle_scope, reduce=reduce)
    scope_params = model.head_parameters() if cfg.angle_scope == "head" else model.top_layer_parameters()
    return ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="params", scope_params=scope_params,
                   reduce=reduce)


class _History:
    """Append-only JSONL log of steps and evaluations, mirrored in memory (written by rank 0 only)."""

    def __init__(self, path: Path, keep_until: int | None) -> None:
        self.path = path
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        if keep_until is not None and path.exists():
            for row in read_jsonl(path):  # a torn last line (a kill mid-append) is dropped
                if isinstance(row.get("step"), int) and row["step"] <= keep_until:
                    (self.evals if row.get("event") == "eval" else self.steps).append(row)
        rows = sorted(self.steps + self.evals, key=lambda r: (r["step"], r.get("event") == "eval"))
        if dist.is_main():
            write_text(path, "".join(json.dumps(r) + "\n" for r in rows))

    def add(self, row: dict) -> None:
        (self.evals if row.get("event") == "eval" else self.steps).append(row)
        if dist.is_main():
            append_line(self.path, json.dumps(row))


def _summary(history: list[dict], gated: bool) -> dict[str, Any]:
    """Gate drop rate and angle statistics of a run's step rows.

    ``drop_rate`` is one convention for every ``grad_accum``: a row's ``kept`` is the fraction of
    its micro-batches whose auxiliary term was kept (True/False with one micro-batch), and the
    drop rate is 1 - the mean of ``kept`` over steps = the fraction of micro-batches dropped.
    """
    summary: dict[str, Any] = {}
    angles = [r["angle"] for r in history if r.get("angle") is not None and math.isfinite(r["angle"])]
    if gated:
        kept = [float(r["kept"]) for r in history if "kept" in r]
        summary["gate"] = {"steps": len(kept), "drop_rate": 1.0 - sum(kept) / max(1, len(kept))}
    if angles:  # the kit's one median (acl_lab.analysis.stats), so metrics.json and every table agree
        summary["angle"] = {"median": median(angles),
                            "frac_over_90": sum(a > CONFLICT_DEGREES for a in angles) / len(angles)}
    return summary


def _micro_batches_per_epoch(n: int, batch_size: int, world: int) -> int:
    """Usable global batches per epoch: the last, partial one only when it splits evenly over the processes."""
    full, rest = divmod(n, batch_size)
    return full + (1 if rest and rest % world == 0 else 0)


@dataclass
class TrainState:
    """Where a run is: optimizer steps done, epoch, global batches consumed in it, best dev score, time."""

    step: int = 0
    epoch: int = 0
    micro_in_epoch: int = 0
    best_score: float | None = None
    best_step: int | None = None
    train_seconds: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainState":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


Hook = Callable[["Trainer", dict[str, Any]], None]


# ---------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------

class Trainer:
    """One fine-tuning run, as pieces you can drive: ``step()``, ``evaluate()``, ``save()``, ``fit()``.

    Built from a :class:`TrainConfig`: the output directory is checked (see
    :func:`prepare_output_dir`), the process group of a launcher joined
    (torchrun: see README "Several processes"), then the model, data, optimizer,
    scheduler, ACL-Grad gate (``gate``, None when off) and :class:`TrainState`
    (``state``, restored with ``resume=True``) are built. ``fit()`` runs the loop
    and writes the run's files; :func:`train` is ``Trainer(...).fit()``.

    Hooks: ``on_step`` and ``on_eval`` are lists of ``fn(trainer, row)``, called
    after every optimizer step (with the step row that goes to ``history.jsonl``)
    and after every dev evaluation (rank 0 only). Attributes are public, so a
    benchmark may, e.g., replace ``gate`` before ``fit()``.

    Several processes: ``model`` is the plain module, ``net`` the
    DistributedDataParallel wrapper that forwards run through (``net is model`` in
    one process). Gated steps and probe steps bypass DDP's reducer (``no_sync``)
    and all-reduce the two gradient sets themselves (:mod:`acl_lab.grad`, ``reduce``).
    """

    def __init__(self, config: TrainConfig | dict, resume: bool = False, overwrite: bool = False,
                 progress: bool = True) -> None:
        cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
        cfg.validate()
        self.task: TaskSpec = get_task(cfg.task)
        if self.task.is_regression and cfg.contrastive:
            raise AclLabError(f"Objective {cfg.objective!r} needs class labels, but task {cfg.task!r} is a regression "
                              "task. Fix: use --objective ce or me-ce for STS-B.")
        self.device = dist.init_from_env(get_device(cfg.device), cfg.dist_backend)
        cfg = cfg.replace(world_size=dist.world_size())
        dist.local_batch_size(cfg.batch_size)  # a clear error before anything is built
        self.cfg = cfg
        self.progress = progress and dist.is_main()
        self.on_step: list[Hook] = []
        self.on_eval: list[Hook] = []
        self._best_dev: dict | None = None  # dev outputs of the best weights saved by this process (_run_eval)
        self.output_dir = _on_main(prepare_output_dir, cfg, resume, overwrite)
        if dist.is_main():
            for folder in ("last", "best"):
                restore_folder(self.output_dir / "checkpoints" / folder)  # undo a checkpoint swap cut short by a kill
        self.finished: TrainResult | None = None
        if resume and (self.output_dir / "metrics.json").exists():
            self.finished = load_result(self.output_dir)  # already finished: fit() returns it, nothing is built
            return
        self._build(resume)

    # ---- construction ------------------------------------------------------
    def _build(self, resume: bool) -> None:
        cfg, task = self.cfg, self.task
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        set_seed(cfg.seed)
        self.dtype = amp_dtype(self.device, cfg.amp)
        self.model, self.tokenizer = build_model(cfg.model, task.num_labels, multi_exit=cfg.multi_exit,
                                                 dropout=cfg.dropout, seed=cfg.seed, pooling=cfg.pooling)
        self.model.to(self.device)
        if dist.rank() > 0:
            torch.manual_seed(cfg.seed + dist.rank())  # own dropout masks; rank 0 keeps the one-process stream
        data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, max_train_samples=cfg.max_train_samples,
                         max_eval_samples=cfg.max_eval_samples, seed=cfg.seed)
        self.encoded = tokenize(data, self.tokenizer, cfg.max_length)
        self.eval_loaders = {s: make_loader(self.encoded[s], self.tokenizer, EVAL_BATCH_SIZE, shuffle=False)
                             for s in self.encoded if s != "train"}
        n_micro = _micro_batches_per_epoch(len(self.encoded["train"]), cfg.batch_size, dist.world_size())
        if n_micro == 0:
            raise AclLabError(f"The training split has {len(self.encoded['train'])} samples, fewer than one batch "
                              f"({cfg.batch_size}) that splits over {dist.world_size()} processes. "
                              "Fix: lower --batch-size or use more training samples.")
        self.steps_per_epoch = math.ceil(n_micro / cfg.grad_accum)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.optimizer = make_optimizer(self.model, cfg)
        self.scheduler = make_scheduler(self.optimizer, self.total_steps, cfg.warmup_ratio)
        self.scaler = grad_scaler(self.device, self.dtype)
        reduce = dist.all_reduce_mean if dist.is_distributed() else None
        self.gate: ACLGrad | None = make_gate(self.model, cfg, reduce) if cfg.use_acl_grad else None
        self.state = TrainState()
        last = self.output_dir / "checkpoints" / "last"
        if resume and last.exists():
            raw = load_training_state(last, self.model, self.optimizer)
            self.scheduler.load_state_dict(raw["scheduler"])
            self.state = TrainState.from_dict(raw)
            if dist.rank() > 0 and raw.get("rank_rng"):
                rng = raw["rank_rng"][dist.rank() - 1]
                set_rng_state({"torch_rng": torch.tensor(rng["torch"], dtype=torch.uint8)}, rng)
        self.net = self.model
        if dist.is_distributed():
            from torch.nn.parallel import DistributedDataParallel

            # no buffer broadcast before every forward: the encoder's buffers (position ids) are constants
            params = inspect.signature(DistributedDataParallel).parameters
            no_sync_buffers = {"forward_sync_buffers": False} if "forward_sync_buffers" in params \
                else {"broadcast_buffers": False}
            self.net = DistributedDataParallel(self.model, device_ids=[self.device] if self.device.type == "cuda"
                                               else None, **no_sync_buffers)

    # ---- one optimizer step ------------------------------------------------
    def step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step over this process's micro-batches (gradient accumulation); return the step row.

        The row holds the losses (means over the micro-batches, global over the
        processes), ``lam_t`` (the lambda actually applied: ``cfg.lam`` when the
        auxiliary term was kept, 0 when the gate dropped it or there is no
        auxiliary term; for ``me-acl-cl`` the same decision also applies mu), the
        gate's ``cos``/``angle``/``kept`` (``kept``: fraction of micro-batches
        kept), the pilot probe's angles on probe steps, ``grad_norm``, and
        ``step``/``epoch``/``lr``. Advances the scheduler and ``state.step``; calls ``on_step``.
        """
        cfg = self.cfg
        self.model.train()
        probe = cfg.probe_angles and self.state.step % cfg.probe_every == 0  # steps 1, 1+k, ...
        ddp = self.net is not self.model
        # DDP's reducer averages plain backward passes; gated and probe steps average their own gradients
        explicit = ddp and (self.gate is not None or probe)
        scale = 1.0 / len(batches)
        rows, local_grads = [], False
        for i, batch in enumerate(batches):
            sync = ddp and not explicit and i == len(batches) - 1
            with (self.net.no_sync() if ddp and not sync else contextlib.nullcontext()):
                row, local = self._micro_step(batch, scale, probe)
            rows.append(row)
            local_grads |= local
        params = [p for p in self.model.parameters() if p.grad is not None]
        if explicit and local_grads:
            for p, g in zip(params, reduce_grads(dist.all_reduce_mean, [p.grad for p in params])[0]):
                p.grad = g
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step += 1
        merged = _mean_rows(rows)
        merged["grad_norm"] = float(grad_norm)
        row = {"step": self.state.step, "epoch": self.state.epoch, "lr": self.scheduler.get_last_lr()[0], **merged}
        for hook in self.on_step:
            hook(self, row)
        return row

    def _micro_step(self, batch: dict, scale: float, probe: bool) -> tuple[dict[str, Any], bool]:
        """Forward, losses and backward of one micro-batch; returns its row and whether its gradient is local."""
        cfg, model = self.cfg, self.model
        batch = {k: v.to(self.device) for k, v in batch.items()}
        labels = batch["labels"]
        with autocast(self.device, self.dtype):
            out = self.net(**batch)
        lp = compute_losses(model, out, labels, cfg, regression=self.task.is_regression)
        row = _global_mean({"loss": lp.total.item(), **lp.parts}, self.device)
        if not math.isfinite(row["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            self.save("last")
            raise AclLabError(
                f"Non-finite loss ({row['loss']}) in training; stopped before updating the weights. The last good "
                f"state is saved in {self.output_dir / 'checkpoints' / 'last'}. Fix: lower --lr, raise "
                "--temperature, or check the data for empty texts; then resume or start again."
            )
        scaler = self.scaler
        scale_fn = (lambda t: scaler.scale(t) * scale) if scaler is not None else (lambda t: t * scale)
        reduce = dist.all_reduce_mean if dist.is_distributed() else None
        params = [p for p in model.parameters() if p.requires_grad]
        probes = probe_losses(model, out, labels, cfg) if probe else None
        if probes is not None and lp.aux is None:
            # objective ce / me-ce: g_CE is the whole update, so it is computed once and serves the probe too
            g_ce = torch.autograd.grad(scale_fn(lp.ce), params, retain_graph=True, allow_unused=True)
            (g_ce,) = reduce_grads(reduce, g_ce)
            row.update(_probe_row(probes, gradient_cosines(g_ce, list(probes.values()), params, reduce)))
            for p, g in zip(params, g_ce):
                if g is not None:
                    p.grad = g.clone() if p.grad is None else p.grad.add_(g)
            row["lam_t"] = 0.0
            return row, False
        if probes is not None:  # the update's gradients are a different sum: g_CE is taken once more for the probe
            row.update(_probe_row(probes, gradient_cosines(lp.ce, list(probes.values()), params, reduce)))
        if self.gate is not None and lp.aux is not None:
            rec = self.gate.backward(lp.ce, lp.aux, scale=scale_fn, scope_tensors=out.reps)
            row.update(rec.log_fields(), lam_t=cfg.lam * rec.lam_t)
            return row, self.gate.reduce is None
        scale_fn(lp.total).backward()
        row["lam_t"] = 0.0 if lp.aux is None else cfg.lam
        return row, True

    # ---- evaluation and checkpoints -----------------------------------------
    def evaluate(self, split: str = "dev") -> list[dict[str, float]]:
        """Metrics of every exit on ``split`` (the plain module; no collective, so rank 0 may call it alone)."""
        if split not in self.eval_loaders:
            raise AclLabError(f"Split {split!r} is not in task {self.cfg.task!r}; available: "
                              f"{', '.join(self.eval_loaders)}.")
        return evaluate_with_predictions(self.model, self.eval_loaders[split], self.task, self.device)[0]

    def save(self, which: str = "last") -> Path | None:
        """Write ``checkpoints/last`` (resumable: optimizer, scheduler, state, RNG) or ``checkpoints/best`` (weights).

        ``last`` is written only with ``save_checkpoints`` and is collective under several
        processes (every rank's RNG state goes into it; call it on every rank); ``best`` is
        written by the calling process. Only rank 0 writes. Returns the folder, or None.
        """
        folder = self.output_dir / "checkpoints" / which
        if which == "best":
            return save_checkpoint(folder, self.model, self.cfg) if dist.is_main() else None
        if which != "last":
            raise bad_value("which", which, ("last", "best"), "save('last') or save('best').")
        if not self.cfg.save_checkpoints:
            return None
        extra: dict[str, Any] = {}
        if dist.is_distributed():
            tensors, meta = rng_state()
            ranks = dist.gather_objects({"torch": tensors["torch_rng"].tolist(), **meta})
            extra["rank_rng"] = ranks[1:]
        if dist.is_main():
            save_checkpoint(folder, self.model, self.cfg, self.optimizer,
                            {**dataclasses.asdict(self.state), "scheduler": self.scheduler.state_dict(),
                             "total_steps": self.total_steps, **extra})
        return folder

    def _run_eval(self, history: "_History") -> None:
        """Score dev; a new best is saved as ``checkpoints/best``, and its dev outputs (with the reps of the
        representation dump) are kept, so that ``_finish`` needs no dev pass of its own on those weights."""
        outputs = collect_outputs(self.model, self.eval_loaders["dev"], self.device, with_reps=True,
                                  reps_samples=REPS_SAMPLES)
        per_exit = scores_of(outputs, self.task)[0]
        score = per_exit[-1][self.task.main_metric]
        row = {"event": "eval", "step": self.state.step, "split": "dev", "score": score, "per_exit": per_exit}
        history.add(row)
        if self.state.best_score is None or score > self.state.best_score:
            self.state.best_score, self.state.best_step = score, self.state.step
            self.save("best")
            self._best_dev = outputs
        for hook in self.on_eval:
            hook(self, row)

    # ---- the loop ------------------------------------------------------------
    def batches(self):
        """This process's shards of the global training batches from ``state`` on, as groups of ``grad_accum``.

        Yields ``(group, consumed)``: the group for one optimizer step and how many global batches
        it used. Every process iterates the same batches (seeded by ``seed`` and the epoch) and keeps
        its slice (:func:`acl_lab.distributed.shard`); a last batch that does not split evenly is skipped.
        """
        cfg, state = self.cfg, self.state
        while True:
            loader = make_loader(self.encoded["train"], self.tokenizer, cfg.batch_size, shuffle=True,
                                 seed=cfg.seed * 1000 + state.epoch, group_by_length=cfg.group_by_length)
            it = iter(loader)
            for _ in range(state.micro_in_epoch):
                next(it)
            while True:
                taken = [b for _, b in zip(range(cfg.grad_accum), it)]
                group = [s for s in map(dist.shard, taken) if s is not None]
                if not group:
                    break
                yield group, len(taken)
            state.epoch += 1
            state.micro_in_epoch = 0

    def fit(self) -> TrainResult:
        """Train to ``total_steps`` (from ``state``), evaluating and checkpointing; write the run's files."""
        if self.finished is not None:
            return self.finished
        cfg, state, out = self.cfg, self.state, self.output_dir
        last_dir = out / "checkpoints" / "last"
        if dist.is_main():
            cfg.to_json(out / "config.json")
        history = _History(out / "history.jsonl", keep_until=state.step)
        if self.gate is not None:
            self.gate.restore(history.steps)  # a resumed screened gate rebuilds its calibration from the log
        eval_every = cfg.eval_every or self.steps_per_epoch
        bar = _progress(self.total_steps, state.step, enabled=self.progress, desc=f"{cfg.objective} {cfg.task}")
        t_start = time.perf_counter() - state.train_seconds
        try:
            with _StopFlag() as stop:
                groups = self.batches()
                while state.step < self.total_steps:
                    group, consumed = next(groups)
                    row = self.step(group)
                    state.micro_in_epoch += consumed
                    state.train_seconds = time.perf_counter() - t_start
                    history.add(row)
                    _update_bar(bar, row)
                    if state.step % eval_every == 0 or state.step == self.total_steps:
                        if dist.is_main():
                            self._run_eval(history)
                        self.save("last")
                    if dist.any_rank(stop.requested):
                        raise _Interrupted
        except _Interrupted:
            self.save("last")
            bar.close()
            _say(f"[acl_lab] interrupted at step {state.step}/{self.total_steps}; resumable checkpoint in {last_dir}. "
                 "Resume with resume=True (--resume).")
            raise KeyboardInterrupt from None
        except KeyboardInterrupt:
            bar.close()
            _say(f"[acl_lab] stopped at once (second interrupt); the last checkpoint in {last_dir} is kept. "
                 "Resume with resume=True (--resume).")
            raise
        bar.close()
        if dist.is_main():
            self._finish(history)
        dist.barrier()
        return load_result(out) if not dist.is_main() else self._result

    def _finish(self, history: "_History") -> None:
        """Best checkpoint on every split, representation dump, metrics.json (rank 0)."""
        cfg, state, out, task = self.cfg, self.state, self.output_dir, self.task
        best_dir = out / "checkpoints" / "best"
        if best_dir.exists():
            load_model_weights(best_dir, self.model)
        metrics: dict[str, Any] = {"task": cfg.task, "objective": cfg.objective, "seed": cfg.seed, "model": cfg.model,
                                   "steps": state.step, "best_step": state.best_step,
                                   "train_seconds": round(state.train_seconds, 2), "device": str(self.device),
                                   "world_size": dist.world_size()}
        predictions, outputs = {}, {}
        for split, loader in self.eval_loaders.items():  # metrics and per-example predictions from one pass
            # dev: the outputs kept when these best weights were saved in this process (a resumed run past its
            # best step has none, and passes again); the reps ride along for the dump
            outputs[split] = (self._best_dev if split == "dev" and self._best_dev is not None else
                              collect_outputs(self.model, loader, self.device, with_reps=split == "dev",
                                              reps_samples=REPS_SAMPLES))
            per_exit, predictions[split] = scores_of(outputs[split], task)
            metrics[split] = per_exit[-1]
            metrics[f"{split}_per_exit"] = per_exit
        save_predictions(out / "predictions.npz", predictions, list(self.model.exit_layers))
        metrics["exit_layers"] = list(self.model.exit_layers)
        metrics.update(_summary(history.steps, self.gate is not None))
        metrics["config"] = cfg.to_dict()
        if not task.is_regression:
            save_representations(self.model, outputs["dev"], out / "representations.safetensors",
                                 list(task.label_names))
        write_json(out / "metrics.json", metrics, indent=2)
        self._result = TrainResult(cfg, metrics, history.steps, history.evals, out)


# ---------------------------------------------------------------------------
# the one-call entry point
# ---------------------------------------------------------------------------

@one_writer("train", train_output_dir)  # one writer per output folder (acl_lab.locks)
def train(config: TrainConfig | dict, resume: bool = False, overwrite: bool = False,
          progress: bool = True) -> TrainResult:
    """Fine-tune a model as ``config`` says; return metrics, history and paths (see module docstring).

    ``Trainer(config, resume, overwrite, progress).fit()``. Under torchrun every process calls it
    and gets the same result; only rank 0 writes files and shows progress.
    """
    return Trainer(config, resume=resume, overwrite=overwrite, progress=progress).fit()


def _on_main(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on rank 0 only, its result (or its AclLabError) shared with every rank."""
    result, error = None, None
    if dist.is_main():
        try:
            result = fn(*args)
        except AclLabError as exc:
            error = str(exc)
    error = dist.broadcast_object(error)
    if error is not None:
        raise AclLabError(error)
    return dist.broadcast_object(result)


def _global_mean(row: dict[str, float], device: torch.device) -> dict[str, float]:
    """The row's values averaged over processes (one small all-reduce): CE parts are shard means."""
    if not dist.is_distributed():
        return row
    keys = list(row)
    values = dist.all_reduce_mean(torch.tensor([row[k] for k in keys], dtype=torch.float64, device=device))
    return dict(zip(keys, values.tolist()))


def _probe_row(probes: dict[str, torch.Tensor], cosines: list[float]) -> dict[str, float]:
    row = {}
    for name, cos in zip(probes, cosines):
        row[f"cos_{name}"] = cos
        row[f"angle_{name}"] = angle_degrees(cos)
    return row


def _say(text: str) -> None:
    if dist.is_main():
        print(text)


def _mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a step: the mean over its micro-batches (``kept`` becomes the fraction kept)."""
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
