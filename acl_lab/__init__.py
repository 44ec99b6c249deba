"""acl_lab: a notebook-based analysis and teaching kit for Aligned Contrastive Learning (ACL).

The method is defined in the paper "ACL: Aligned Contrastive Learning Improves BERT
and Multi-exit BERT Fine-tuning" (arXiv 2602.03563); this package's reading of it
is in the README. Heavy modules are imported lazily so ``import acl_lab`` is quick.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import TrainConfig
from .errors import AclLabError
from .utils import get_device, quiet_integrations, set_seed

quiet_integrations()  # logging integrations off, nothing waits for a login (see utils.QUIET_ENV)

__version__ = "0.1.0"
__all__ = ["TrainConfig", "AclLabError", "get_device", "set_seed", "train", "Trainer", "load_result", "__version__"]

if TYPE_CHECKING:
    from .trainer import Trainer, load_result, train


def __getattr__(name: str) -> Any:
    if name in ("train", "Trainer", "load_result", "TrainResult"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'acl_lab' has no attribute {name!r}")
