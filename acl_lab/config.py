"""The one run configuration: a dataclass that validates itself and round-trips through JSON.

A copy is saved beside every checkpoint (``config.json``), so a run can always be
told apart from, and resumed against, another.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AclLabError, bad_value
from .losses import ANCHORS  # the anchor sets the contrastive loss knows

SINGLE_EXIT_OBJECTIVES = ("ce", "ce+scl", "acl-embed", "acl")
MULTI_EXIT_OBJECTIVES = ("me-ce", "me-acl", "me-acl-cl")
OBJECTIVES = SINGLE_EXIT_OBJECTIVES + MULTI_EXIT_OBJECTIVES
CONTRASTIVE_OBJECTIVES = ("ce+scl", "acl-embed", "acl", "me-acl", "me-acl-cl")
EXIT_WEIGHTS = ("uniform", "ascending", "descending")
ANGLE_SCOPES = ("all", "top-layer", "head", "repr", "screened")
AMP = ("auto", "off", "bf16", "fp16")
DIST_BACKENDS = ("auto", "gloo", "nccl")  # torch.distributed backends under torchrun ("auto": gloo on CPU, nccl on CUDA)
POOLINGS = ("cls", "mean")  # exit representation: first token (the paper) or the mean over real tokens
#: the pilot study's conflict line and the default ACL-Grad threshold: above 90 degrees two gradients point apart
CONFLICT_DEGREES = 90.0


@dataclass
class TrainConfig:
    """Everything that defines a fine-tuning run.

    ``objective`` picks the loss (see docs/METHOD.md): single exit ``ce``, ``ce+scl``,
    ``acl-embed``, ``acl`` (= ACL-Embed + ACL-Grad); multi-exit ``me-ce``,
    ``me-acl`` (ACL-Embed at every exit), ``me-acl-cl`` (plus the cross-layer term).
    ``acl_grad`` switches the gradient gate on or off for any contrastive objective;
    ``None`` means "on for ``acl``, off otherwise". ``angle_scope`` is ``all`` (exact,
    the paper's definition) or a cheaper approximation: ``top-layer`` (last encoder
    layer plus classifier heads), ``head`` (classifier heads only) or ``repr`` (the
    gradient with respect to the exits' [CLS] representations). ``screened`` is exact
    where it matters: it decides from the ``repr`` angle when that is far from the
    threshold (outside a margin calibrated online, :class:`acl_lab.grad.ScreenRule`) and
    computes the exact angle otherwise.
    """

    task: str = "rt-polarity"
    model: str = "minilm-l6"
    objective: str = "ce"
    seed: int = 0
    output_dir: str = "runs/default"
    # data
    source: str = "auto"
    data_dir: str | None = None
    max_length: int = 64
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    group_by_length: bool = False  # batches of similar length (HF's LengthGroupedSampler): less padding per step
    # optimisation
    batch_size: int = 32
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    epochs: float = 1.0
    max_steps: int | None = None
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    dropout: float = 0.1
    pooling: str = "cls"  # exit representation: "cls" (the paper, docs/METHOD.md) or "mean" over tokens (this kit's option)
    # objective
    lam: float = 0.1
    mu: float = 0.1
    temperature: float = 0.1
    anchors: str = "all"
    acl_grad: bool | None = None
    threshold: float = CONFLICT_DEGREES
    angle_scope: str = "all"
    exit_weights: str = "uniform"
    probe_angles: bool = False  # pilot study: log angles of grad(CE) vs grad(SCL) and grad(ACL-Embed) every step
    probe_every: int = 1  # with probe_angles: probe steps 1, 1+k, 1+2k, ... (a probe costs about two steps)
    # evaluation and checkpoints
    eval_every: int | None = None
    # False skips only the resumable checkpoints/last (optimizer state: about 3x the weights); checkpoints/best
    # is the run's trained model (test metrics, representations and early exit are computed on it): always written
    save_checkpoints: bool = True
    # runtime
    device: str = "auto"
    amp: str = "auto"
    num_threads: int | None = None
    dist_backend: str = "auto"  # under torchrun: "auto" (gloo on CPU, nccl on CUDA), "gloo" or "nccl"
    world_size: int | None = None  # set by the trainer: how many processes trained the run (not a choice)

    # ---- derived ---------------------------------------------------------
    @property
    def multi_exit(self) -> bool:
        return self.objective in MULTI_EXIT_OBJECTIVES

    @property
    def contrastive(self) -> bool:
        return self.objective in CONTRASTIVE_OBJECTIVES

    @property
    def use_acl_grad(self) -> bool:
        """Whether the ACL-Grad gate runs: explicit ``acl_grad`` wins, else on for ``acl`` only."""
        if not self.contrastive:
            return False
        return self.objective == "acl" if self.acl_grad is None else bool(self.acl_grad)

    # ---- validation --------------------------------------------------------
    def validate(self) -> "TrainConfig":
        """Check every field; raise :class:`AclLabError` naming the field, the allowed values and the fix."""
        _check_types(self)
        if self.objective not in OBJECTIVES:
            raise bad_value("objective", self.objective, OBJECTIVES, "pick one of the listed objectives.")
        if self.exit_weights not in EXIT_WEIGHTS:
            raise bad_value("exit_weights", self.exit_weights, EXIT_WEIGHTS, "use 'uniform' unless you study exit weighting.")
        if self.angle_scope not in ANGLE_SCOPES:
            raise bad_value("angle_scope", self.angle_scope, ANGLE_SCOPES, "use 'all' for the paper's exact definition.")
        if self.pooling not in POOLINGS:
            raise bad_value("pooling", self.pooling, POOLINGS, "use 'cls' (the paper's [CLS] exits) or 'mean'.")
        if self.anchors not in ANCHORS:
            raise bad_value("anchors", self.anchors, ANCHORS, "use 'all' (the default reading of the paper, docs/METHOD.md).")
        if self.dist_backend not in DIST_BACKENDS:
            raise bad_value("dist_backend", self.dist_backend, DIST_BACKENDS, "use 'auto' (gloo on CPU, nccl on CUDA).")
        if self.amp not in AMP:
            raise bad_value("amp", self.amp, AMP, "use 'auto' (mixed precision on CUDA only), or bf16 / fp16 "
                            "to force it (CUDA or CPU).")
        if not 0 <= self.seed < 2**32:
            raise bad_value("seed", self.seed, "a whole number in [0, 2**32)", "use a small seed such as 0, 1, 2.")
        _at_least(self, "weight_decay", 0.0, "weight_decay must be >= 0 (0.01 is usual).")
        _at_least(self, "lam", 0.0, "lambda must be >= 0; use 0 to switch the contrastive term off.")
        _at_least(self, "mu", 0.0, "mu must be >= 0; use 0 to switch the cross-layer term off.")
        if not self.temperature > 0:
            raise bad_value("temperature", self.temperature, "a number > 0 (typically 0.05 to 0.5)", "set --temperature 0.1.")
        if not 0.0 <= self.threshold <= 180.0:
            raise bad_value("threshold", self.threshold, "degrees in [0, 180]", "set --threshold 90 (the paper's default).")
        for name in ("max_length", "batch_size", "grad_accum", "probe_every"):
            _at_least(self, name, 1, f"{name} must be a positive integer.")
        for name in ("max_train_samples", "max_eval_samples", "max_steps", "eval_every", "num_threads", "world_size"):
            if getattr(self, name) is not None:
                _at_least(self, name, 1, f"{name} must be a positive integer, or omitted for no limit.")
        if not self.lr > 0:
            raise bad_value("lr", self.lr, "a number > 0", "set --lr 5e-5.")
        if not self.epochs > 0:
            raise bad_value("epochs", self.epochs, "a number > 0", "set --epochs 1 or use --max-steps.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise bad_value("warmup_ratio", self.warmup_ratio, "a number in [0, 1)", "set --warmup-ratio 0.1.")
        if not 0.0 <= self.dropout < 1.0:
            raise bad_value("dropout", self.dropout, "a number in [0, 1)", "set dropout 0.1.")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise bad_value("max_grad_norm", self.max_grad_norm, "a number > 0, or None for no clipping", "set 1.0.")
        if self.acl_grad and not self.contrastive:
            raise bad_value("acl_grad", self.acl_grad, f"True only with a contrastive objective {CONTRASTIVE_OBJECTIVES}",
                            f"drop --acl-grad or pick a contrastive objective instead of {self.objective!r}.")
        return self

    # ---- JSON ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            from .atomic import write_text

            write_text(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        if not isinstance(data, dict):
            raise AclLabError(f"A config must be a mapping of field names to values, not {type(data).__name__}. "
                              "Fix: write it as a JSON object, e.g. {\"task\": \"rt-polarity\", \"lam\": 0.1}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AclLabError(
                f"Unknown config field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(known))}. "
                "Fix: remove or rename them."
            )
        return cls(**data)

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "TrainConfig":
        p = Path(path_or_text) if not str(path_or_text).lstrip().startswith("{") else None
        if p is not None:
            if not p.is_file():
                raise AclLabError(f"Config file {str(p)!r} does not exist. Fix: check the path.")
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise AclLabError(f"Config file {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}). "
                                  "Fix: repair or delete it.") from None
        else:
            text = str(path_or_text)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AclLabError(f"Config {str(path_or_text)[:80]!r} is not valid JSON ({exc}). Fix: repair or delete it.") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


# Fields that do not change what a run computes: a run may be resumed with these changed.
RUNTIME_FIELDS = ("output_dir", "device", "num_threads", "eval_every", "save_checkpoints", "dist_backend",
                  "world_size")



def _at_least(cfg: TrainConfig, name: str, low: float, fix: str) -> None:
    value = getattr(cfg, name)
    if value < low:
        raise bad_value(name, value, f">= {low}", fix)


def _check_types(cfg: TrainConfig) -> None:
    """Reject a field of the wrong type (``"0.1"`` for lambda, ``1.5`` for batch_size) by name."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        allowed = _allowed_types(hints[f.name])
        if isinstance(value, bool) and bool not in allowed:
            ok = False
        elif isinstance(value, int) and int not in allowed and float in allowed:
            ok = True  # an int is fine where a float is expected
        else:
            ok = isinstance(value, allowed)
        if ok and isinstance(value, float) and not math.isfinite(value):
            raise AclLabError(f"Config field {f.name!r} is {value!r}; it must be a finite number. "
                              f"Fix: give {f.name} a real value (see the defaults in TrainConfig).")
        if not ok:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise AclLabError(
                f"Config field {f.name!r} has value {value!r} of type {type(value).__name__}; expected {names}. "
                f"Fix: write {f.name} as a {names} literal (no quotes around numbers)."
            )


def _allowed_types(hint: Any) -> tuple[type, ...]:
    args = typing.get_args(hint)
    return tuple(args) if args else (hint,)
