"""Small runtime helpers: one ``set_seed``, automatic device choice, mixed-precision policy."""
from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import torch

from .errors import bad_value

DEVICES = ("auto", "cuda", "mps", "cpu")
# Defaults that keep every logging integration off and nothing waiting for a login (W&B, MLflow, Comet, the hub's
# telemetry) unless the user set the variable: transformers switches these integrations on by itself when it
# finds their packages installed (as on Colab), and W&B then asks for an API key on the first Trainer run.
QUIET_ENV = {"WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "DISABLE_MLFLOW_INTEGRATION": "TRUE",
             "COMET_MODE": "DISABLED", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def quiet_integrations() -> dict[str, str]:
    """Set :data:`QUIET_ENV` defaults in ``os.environ`` (a value the user set is kept); return what is in force."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in QUIET_ENV}


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))


def get_device(device: str = "auto") -> torch.device:
    """Resolve ``"auto"`` to cuda, then mps, then cpu; check an explicit choice is available."""
    if device not in DEVICES and not device.startswith("cuda:"):
        raise bad_value("device", device, DEVICES, "use 'auto' to pick cuda > mps > cpu automatically.")
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise bad_value("device", device, "'auto' or 'cpu' on this machine", "no CUDA device is visible; use --device auto.")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise bad_value("device", device, "'auto' or 'cpu' on this machine", "MPS is not available; use --device auto.")
    return torch.device(device)


AMP_DEVICES = ("cuda", "cpu")  # where an explicit --amp bf16/fp16 is honoured


def amp_dtype(device: torch.device, amp: str = "auto") -> torch.dtype | None:
    """The autocast dtype to train with, or None for full precision (float32).

    ``auto`` uses mixed precision on CUDA only: bf16 where the GPU supports it,
    else fp16 (which then needs a GradScaler, see :func:`grad_scaler`); on CPU
    and MPS ``auto`` stays float32, because CPU autocast is rarely faster and is
    not what the results in the README were measured with. An explicit ``bf16``
    or ``fp16`` is honoured on CUDA and on CPU (``torch.autocast("cpu")``, so
    the mixed-precision path can be tested without a GPU); MPS trains in float32.
    """
    from .config import AMP

    if amp not in AMP:
        raise bad_value("amp", amp, AMP, "use 'auto' (mixed precision on CUDA only), or bf16 / fp16 to force it "
                        "(CUDA or CPU).")
    if amp == "off" or device.type not in AMP_DEVICES or (amp == "auto" and device.type != "cuda"):
        return None
    if amp == "fp16":
        return torch.float16
    if amp == "bf16" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> "torch.amp.GradScaler | None":
    """A ``torch.amp.GradScaler`` for fp16 autocast on ``device`` (CUDA or CPU); None for bf16 and float32.

    fp16 gradients underflow without loss scaling; bf16 has float32's exponent range and needs none.
    """
    if dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """An autocast context for ``dtype``, or a no-op context when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
