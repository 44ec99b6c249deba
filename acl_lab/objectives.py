"""Turn a forward pass into the losses of each objective (docs/METHOD.md).

The loss of every objective splits into a cross-entropy part and an auxiliary
(contrastive) part, ``total = ce + aux``; ACL-Grad gates ``aux`` against ``ce``.
The weights lambda and mu are folded into ``aux`` here, so the gate compares
directions and the update is ``g_ce + lambda_t * g_aux`` with ``lambda_t`` in {0, 1}.

Multi-exit (``me-*``): ``ce = sum_k w_k CE_k / sum_k w_k``;
``aux = lambda * sum_k w_k ACLEmbed_k / sum_k w_k + mu * mean_{k<K} ACLCL_k``.
The gate, when on, treats all auxiliary terms together (one decision per batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import EXIT_WEIGHTS, TrainConfig
from .errors import bad_value
from .losses import acl_cross_layer_loss, acl_embed_loss, supcon_loss
from .model import ExitOutputs, MultiExitClassifier


@dataclass
class LossParts:
    """The two halves of an objective plus named scalar parts for the log."""

    ce: torch.Tensor
    aux: torch.Tensor | None
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> torch.Tensor:
        return self.ce if self.aux is None else self.ce + self.aux


def exit_weights(kind: str, num_exits: int) -> list[float]:
    """Weights w_k of the exits: uniform, ascending (w_k = k, as in PABEE) or descending."""
    if kind == "uniform":
        return [1.0] * num_exits
    if kind == "ascending":
        return [float(k) for k in range(1, num_exits + 1)]
    if kind == "descending":
        return [float(k) for k in range(num_exits, 0, -1)]
    raise bad_value("exit_weights", kind, EXIT_WEIGHTS, "use 'uniform'.")


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, regression: bool) -> torch.Tensor:
    """Cross-entropy for classification, mean squared error for a regression task (STS-B)."""
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.float(), labels)


def compute_losses(model: MultiExitClassifier, out: ExitOutputs, labels: torch.Tensor, cfg: TrainConfig,
                   regression: bool = False) -> LossParts:
    """CE and auxiliary losses of ``cfg.objective`` for one batch."""
    obj = cfg.objective
    tau = cfg.temperature
    if cfg.multi_exit != model.multi_exit:
        raise bad_value("objective", obj, "a multi-exit objective (me-*) with a multi-exit model, a single-exit one "
                        "otherwise", f"build the model with multi_exit={cfg.multi_exit} or pick a matching objective.")
    if not cfg.multi_exit:
        ce = classification_loss(out.logits[-1], labels, regression)
        parts = {"ce": ce.item()}
        if obj == "ce":
            return LossParts(ce, None, parts)
        rep = out.reps[-1].float()
        if obj == "ce+scl":
            term = supcon_loss(rep, labels, temperature=tau)
            parts["scl"] = term.item()
        else:  # acl-embed, acl
            term = acl_embed_loss(rep, labels, model.label_embeddings(-1).float(), temperature=tau, anchors=cfg.anchors)
            parts["acl_embed"] = term.item()
        return LossParts(ce, cfg.lam * term, parts)

    w = exit_weights(cfg.exit_weights, len(out.logits))
    wsum = sum(w)
    ce_k = [classification_loss(lg, labels, regression) for lg in out.logits]
    ce = sum(wk * c for wk, c in zip(w, ce_k)) / wsum
    parts = {"ce": ce.item(), **{f"ce_{layer}": c.item() for layer, c in zip(out.layers, ce_k)}}
    if obj == "me-ce":
        return LossParts(ce, None, parts)
    emb_k = [acl_embed_loss(r.float(), labels, model.label_embeddings(i).float(), temperature=tau, anchors=cfg.anchors)
             for i, r in enumerate(out.reps)]
    embed = sum(wk * e for wk, e in zip(w, emb_k)) / wsum
    parts["acl_embed"] = embed.item()
    aux = cfg.lam * embed
    if obj == "me-acl-cl" and len(out.reps) > 1:
        teacher, teacher_emb = out.reps[-1].float(), model.label_embeddings(-1).float()
        cl_k = [acl_cross_layer_loss(r.float(), teacher, labels, teacher_emb, model.label_embeddings(i).float(),
                                     temperature=tau)
                for i, r in enumerate(out.reps[:-1])]
        cl = sum(cl_k) / len(cl_k)
        parts["acl_cl"] = cl.item()
        aux = aux + cfg.mu * cl
    return LossParts(ce, aux, parts)
