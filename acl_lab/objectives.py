"""Turn a forward pass into the losses of each objective (docs/METHOD.md).

The loss of every objective splits into a cross-entropy part and an auxiliary
(contrastive) part, ``total = ce + aux``; ACL-Grad gates ``aux`` against ``ce``.
The weights lambda and mu are folded into ``aux`` here, so the gate compares
directions and the update is ``g_ce + lambda_t * g_aux`` with ``lambda_t`` in {0, 1}
(the gate's own multiplier; the trainer logs ``lam_t = lambda * lambda_t``, the lambda
actually applied).

Multi-exit (``me-*``): ``ce = sum_k w_k CE_k / sum_k w_k``;
``aux = lambda * sum_k w_k ACLEmbed_k / sum_k w_k + mu * mean_{k<K} ACLCL_k``.
The gate, when on, treats all auxiliary terms together (one decision per batch).

Several processes (torchrun): the cross-entropy terms are means over this
process's shard (DDP averages their gradients into the global mean), while
the contrastive terms are computed over the global batch: the exit
representations and labels of every process are gathered with gradient
(:func:`acl_lab.distributed.gather_with_grad`, one collective per batch), so
SCL, ACL-Embed and ACL-CL are the single-process losses of the global batch.
In one process the gather is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import EXIT_WEIGHTS, TrainConfig
from .distributed import gather_with_grad
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


def global_exits(out: ExitOutputs, labels: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The exit representations (float32 or wider) and labels of the global batch, in rank order.

    One differentiable all-gather for all exits together (identity in one process).
    """
    stacked = torch.stack([r.float() for r in out.reps], dim=1)  # [n, exits, d]
    return list(gather_with_grad(stacked).unbind(1)), gather_with_grad(labels)


def probe_losses(model: MultiExitClassifier, out: ExitOutputs, labels: torch.Tensor,
                 cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The pilot study's auxiliary losses at the last exit, unweighted: ``scl`` and ``acl_embed``.

    These are the terms whose gradient angle to CE the pilot probe measures
    (``probe_angles``), whatever the run's objective; the one definition used by
    the trainer, notebook 00 and the benchmarks. Over the global batch (see the module docstring).
    """
    reps, labels_g = global_exits(out, labels)
    rep = reps[-1]
    return {"scl": supcon_loss(rep, labels_g, temperature=cfg.temperature),
            "acl_embed": acl_embed_loss(rep, labels_g, model.label_embeddings(-1).float(),
                                        temperature=cfg.temperature, anchors=cfg.anchors)}


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
        reps, labels_g = global_exits(out, labels)
        rep = reps[-1]
        if obj == "ce+scl":
            term = supcon_loss(rep, labels_g, temperature=tau)
            parts["scl"] = term.item()
        else:  # acl-embed, acl
            term = acl_embed_loss(rep, labels_g, model.label_embeddings(-1).float(), temperature=tau,
                                  anchors=cfg.anchors)
            parts["acl_embed"] = term.item()
        return LossParts(ce, cfg.lam * term, parts)

    w = exit_weights(cfg.exit_weights, len(out.logits))
    wsum = sum(w)
    ce_k = [classification_loss(lg, labels, regression) for lg in out.logits]
    ce = sum(wk * c for wk, c in zip(w, ce_k)) / wsum
    parts = {"ce": ce.item(), **{f"ce_{layer}": c.item() for layer, c in zip(out.layers, ce_k)}}
    if obj == "me-ce":
        return LossParts(ce, None, parts)
    reps, labels_g = global_exits(out, labels)
    emb_k = [acl_embed_loss(r, labels_g, model.label_embeddings(i).float(), temperature=tau, anchors=cfg.anchors)
             for i, r in enumerate(reps)]
    embed = sum(wk * e for wk, e in zip(w, emb_k)) / wsum
    parts["acl_embed"] = embed.item()
    aux = cfg.lam * embed
    if obj == "me-acl-cl" and len(reps) > 1:
        teacher, teacher_emb = reps[-1], model.label_embeddings(-1).float()
        cl_k = [acl_cross_layer_loss(r, teacher, labels_g, teacher_emb, model.label_embeddings(i).float(),
                                     temperature=tau)
                for i, r in enumerate(reps[:-1])]
        cl = sum(cl_k) / len(cl_k)
        parts["acl_cl"] = cl.item()
        aux = aux + cfg.mu * cl
    return LossParts(ce, aux, parts)
