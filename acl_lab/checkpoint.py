"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint folder holds ``model.safetensors``, ``config.json`` (the run's
:class:`~acl_lab.config.TrainConfig`) and ``model_info.json`` (what the model is,
to refuse a checkpoint from a different model). A resumable ("last") checkpoint
adds ``optimizer.safetensors`` and ``trainer_state.json`` (step, epoch, batch, RNG
states, best score). Folders are written whole under a temporary name and swapped in
(:func:`acl_lab.atomic.replace_folder`), so a checkpoint folder is complete or absent, even
when the process is killed mid-save or the disk fills up.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .atomic import replace_folder, restore_folder
from .config import TrainConfig
from .errors import AclLabError
from .model import MultiExitClassifier, describe


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{key}"] = val
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for name, val in list(tensors.items()) + list(meta["scalars"].items()):
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = val
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Torch (tensor) and Python/NumPy (JSON) random states."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    tensors = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_rng.{i}"] = s
    meta = {"numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "python": [py_state[0], list(py_state[1]), py_state[2]]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_rng"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda_rng."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def save_checkpoint(folder: str | Path, model: MultiExitClassifier, config: TrainConfig,
                    optimizer: torch.optim.Optimizer | None = None, state: dict | None = None) -> Path:
    """Write a checkpoint folder (model only, or resumable with optimizer and trainer state)."""
    folder = Path(folder)

    def writer(tmp: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        config.to_json(tmp / "config.json")
        (tmp / "model_info.json").write_text(json.dumps(describe(model), indent=2, sort_keys=True) + "\n")
        if optimizer is not None:
            opt_t, opt_meta = _optimizer_tensors(optimizer)
            rng_t, rng_meta = rng_state()
            save_file({**{f"opt.{k}": v for k, v in opt_t.items()}, **{f"rng.{k}": v for k, v in rng_t.items()}},
                      str(tmp / "optimizer.safetensors"))
            (tmp / "trainer_state.json").write_text(
                json.dumps({**(state or {}), "optimizer": opt_meta, "rng": rng_meta}, indent=1) + "\n")

    return replace_folder(folder, writer)


def load_model_weights(folder: str | Path, model: MultiExitClassifier) -> None:
    """Load ``model.safetensors`` into ``model``, refusing a checkpoint of a different model or a corrupt file."""
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise AclLabError(f"Checkpoint {str(folder)!r} has no model.safetensors. Fix: point at a checkpoint folder "
                          "written by acl_lab (e.g. <run>/checkpoints/best), or retrain.")
    info_file = folder / "model_info.json"
    if info_file.is_file():
        try:
            info = json.loads(info_file.read_text())
        except (ValueError, OSError):
            info = None
        if not isinstance(info, dict):
            raise AclLabError(f"Checkpoint {str(folder)!r} has a corrupt model_info.json. Fix: restore it, resume from "
                              "another checkpoint, or retrain.")
        mine = describe(model)
        diff = {k: (info.get(k), v) for k, v in mine.items() if info.get(k) != v}
        if diff:
            detail = "; ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in diff.items())
            raise AclLabError(f"Checkpoint {str(folder)!r} is from a different model ({detail}). "
                              "Fix: load it with the model, task and objective it was trained with (see its config.json).")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AclLabError(f"Checkpoint file {str(weights)!r} is corrupt or truncated ({exc}). "
                          "Fix: delete it and resume from another checkpoint or retrain.") from None
    missing = set(model.state_dict()) - set(tensors)
    unexpected = set(tensors) - set(model.state_dict())
    shapes = [k for k in set(tensors) & set(model.state_dict()) if tensors[k].shape != model.state_dict()[k].shape]
    if missing or unexpected or shapes:
        raise AclLabError(
            f"Checkpoint {str(folder)!r} does not fit this model (missing {len(missing)}, unexpected {len(unexpected)}, "
            f"shape mismatches {sorted(shapes)[:3]}). Fix: load it with the model it was trained with (see its config.json)."
        )
    model.load_state_dict(tensors)


def load_training_state(folder: str | Path, model: MultiExitClassifier, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer and RNG states from a resumable checkpoint; return the trainer state dict."""
    folder = Path(folder)
    load_model_weights(folder, model)
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
        tensors = load_file(str(folder / "optimizer.safetensors"))
        opt_t = {k[4:]: v for k, v in tensors.items() if k.startswith("opt.")}
        rng_t = {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}
        optimizer.load_state_dict(_optimizer_state(opt_t, state["optimizer"]))
        set_rng_state(rng_t, state["rng"])
        missing = [k for k in ("step", "epoch", "micro_in_epoch", "scheduler") if k not in state]
        if missing:
            raise KeyError(", ".join(missing))
    except (OSError, ValueError, TypeError, KeyError, IndexError, RuntimeError, SafetensorError) as exc:
        raise AclLabError(f"Checkpoint {str(folder)!r} cannot be resumed: its optimizer state is missing or corrupt "
                          f"({type(exc).__name__}: {str(exc)[:200]}). Fix: start again with overwrite=True "
                          "(--overwrite).") from None
    return state


def load_trained(folder: str | Path, device: str = "auto"):
    """Rebuild a trained model from a checkpoint folder: returns ``(model, tokenizer, config)``."""
    from .model import build_model
    from .tasks import get_task
    from .utils import get_device

    folder = Path(folder)
    restore_folder(folder)  # a kill between the two renames of a checkpoint swap
    if not (folder / "config.json").is_file():
        raise AclLabError(f"{str(folder)!r} is not a checkpoint folder (no config.json). "
                          "Fix: point at <run>/checkpoints/best or <run>/checkpoints/last.")
    cfg = TrainConfig.from_json(folder / "config.json")
    task = get_task(cfg.task)
    model, tokenizer = build_model(cfg.model, task.num_labels, multi_exit=cfg.multi_exit, dropout=cfg.dropout,
                                   seed=cfg.seed, pooling=cfg.pooling)
    load_model_weights(folder, model)
    model.to(get_device(device)).eval()
    return model, tokenizer, cfg
