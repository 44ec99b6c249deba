"""Contrastive losses of the kit: SCL, ACL-Embed and ACL-CL (cross-layer ACL).

All three are the masked supervised-contrastive loss of docs/METHOD.md applied to
different item sets (see :func:`masked_supcon`):

    L(v, y; A) = mean_{i in A, P(i) != {}}  -1/|P(i)| * sum_{p in P(i)}
                 log( exp(v_i.v_p / tau) / sum_{a != i} exp(v_i.v_a / tau) )

with v the L2-normalised item vectors, P(i) = {p != i : y_p = y_i} and A the
anchors. This module knows only tensors; it never imports a model library.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from acl_lab.errors import AclLabError, bad_value

ANCHORS = ("all", "samples")
NORM_EPS = 1e-12
# Logit given to an anchor's own column: exp() of it is exactly 0, yet it is
# finite, so no inf - inf = NaN can appear in the forward or the backward pass.
_SELF_LOGIT = -1e9


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise bad_value("temperature", temperature, "a finite number > 0", "use e.g. temperature=0.1")


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """Common dtype of ``tensors``; float16/bfloat16 (e.g. from autocast) are upcast to float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point or torch.finfo(dtype).bits < 32:
        dtype = torch.float32
    return dtype


def _cat(tensors: list[Tensor]) -> Tensor:
    """Concatenate item vectors along dim 0 in their common compute dtype."""
    dtype = _compute_dtype(*tensors)
    return torch.cat([t.to(dtype) for t in tensors], dim=0)


def _check_items(vectors: Tensor, labels: Tensor, anchor_mask: Tensor) -> None:
    if vectors.dim() != 2:
        raise AclLabError(f"vectors must be a 2-D [items, dim] tensor; got shape {tuple(vectors.shape)}.")
    n = vectors.shape[0]
    if labels.shape != (n,):
        raise AclLabError(f"labels must have shape ({n},) to match the vectors; got {tuple(labels.shape)}.")
    if anchor_mask.shape != (n,) or anchor_mask.dtype != torch.bool:
        raise AclLabError(f"anchor_mask must be a bool tensor of shape ({n},); got {anchor_mask.dtype} {tuple(anchor_mask.shape)}.")


def masked_supcon(vectors: Tensor, labels: Tensor, anchor_mask: Tensor, temperature: float = 0.1) -> Tensor:
    """Supervised contrastive loss over an item set, restricted to the anchors in ``anchor_mask``.

    With z_i = v_i / max(||v_i||, eps) and P(i) = {p != i : y_p = y_i}::

        L = mean_{i : anchor_mask[i], |P(i)| > 0}  -1/|P(i)| * sum_{p in P(i)}
            [ z_i.z_p / tau - log sum_{a != i} exp(z_i.z_a / tau) ]

    Anchors with no positive are skipped. If no anchor has a positive the
    result is a zero that is still connected to the graph (backward works and
    gives zero gradients). Self-similarity is removed from the denominator with
    a large finite negative logit, so the result is never NaN or inf.

    Args:
        vectors: un-normalised item vectors [M, d]. float16/bfloat16 inputs are
            computed in float32 (autocast is disabled inside), so the returned
            loss is float32 for them; other dtypes are kept.
        labels: int64 class of each item [M].
        anchor_mask: bool [M], True for items used as anchors.
        temperature: tau > 0.

    Returns:
        A scalar tensor.
    """
    _check_temperature(temperature)
    _check_items(vectors, labels, anchor_mask)
    dtype = _compute_dtype(vectors)
    with torch.autocast(device_type=vectors.device.type, enabled=False):
        z = F.normalize(vectors.to(dtype), dim=1, eps=NORM_EPS)
        positives = labels.unsqueeze(0) == labels.unsqueeze(1)  # [M, M]
        positives.fill_diagonal_(False)
        n_pos = positives.sum(dim=1)
        valid = anchor_mask & (n_pos > 0)  # anchors with at least one positive
        is_self = torch.eye(z.shape[0], dtype=torch.bool, device=z.device)
        logits = (z @ z.T / temperature).masked_fill(is_self, _SELF_LOGIT)
        log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        pos_log_prob = torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
        per_anchor = -pos_log_prob / n_pos.clamp(min=1).to(dtype)
        # Masked mean without a host sync; 0 (still on the graph) when no anchor is valid.
        per_anchor = torch.where(valid, per_anchor, torch.zeros_like(per_anchor))
        return per_anchor.sum() / valid.sum().clamp(min=1).to(dtype)


def supcon_loss(features: Tensor, labels: Tensor, temperature: float = 0.1) -> Tensor:
    """SCL (Khosla et al. 2020; Gunel et al. 2021): ``L(z, y; all samples)``.

    Items are the N samples (features [N, d], labels [N]); every sample is an
    anchor, its positives are the other samples of its class. Returns 0 (with
    a graph) when no sample shares its class with another.
    """
    anchors = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)
    return masked_supcon(features, labels, anchors, temperature)


def acl_embed_loss(
    features: Tensor,
    labels: Tensor,
    label_embeddings: Tensor,
    temperature: float = 0.1,
    anchors: str = "all",
) -> Tensor:
    """ACL-Embed: SupCon over the N samples plus the C label embeddings.

    Items are z_1..z_N (labels y_1..y_N) and u_0..u_{C-1} (label c for row c of
    ``label_embeddings`` [C, d], i.e. the classifier weight rows)::

        L = L([z; u], [y; 0..C-1]; A)

    ``anchors="all"`` uses all N + C items as anchors (label embeddings are
    pulled toward their samples and pushed from other classes); ``"samples"``
    uses only the N samples. Every sample has at least one positive, its own
    label embedding, provided its label is in [0, C) (not checked, to avoid a
    device sync).
    """
    if anchors not in ANCHORS:
        raise bad_value("anchors", anchors, ANCHORS, "use 'all' (paper default) or 'samples'")
    n, c = features.shape[0], label_embeddings.shape[0]
    vectors = _cat([features, label_embeddings])
    item_labels = torch.cat([labels, torch.arange(c, device=labels.device, dtype=labels.dtype)])
    anchor_mask = torch.ones(n + c, dtype=torch.bool, device=features.device)
    if anchors == "samples":
        anchor_mask[n:] = False
    return masked_supcon(vectors, item_labels, anchor_mask, temperature)


def acl_cross_layer_loss(
    student_features: Tensor,
    teacher_features: Tensor,
    labels: Tensor,
    teacher_label_embeddings: Tensor,
    student_label_embeddings: Tensor | None = None,
    temperature: float = 0.1,
) -> Tensor:
    """ACL-CL for one student exit k against the teacher (deepest) exit K.

    Items: the student's samples z_i^k (label y_i), the teacher's samples
    sg(z_j^K) (label y_j), the teacher's label embeddings sg(u_c^K) (label c)
    and, when given, the student's own label embeddings u_c^k (label c, not
    detached). sg = stop-gradient (``detach``): the teacher is not pulled
    toward the student. Anchors are the student's samples only; positives are
    all items of the anchor's class except the anchor itself (so the teacher's
    copy of the same sample is always a positive)::

        L = L([z^k; sg(z^K); sg(u^K); u^k], [y; y; 0..C-1; 0..C-1]; student samples)

    ``teacher_features`` must be the same batch as ``student_features`` (it
    shares ``labels``).
    """
    n, c = student_features.shape[0], teacher_label_embeddings.shape[0]
    if teacher_features.shape[0] != n:
        raise AclLabError(
            f"teacher_features has {teacher_features.shape[0]} rows but student_features has {n}; "
            "both must be the same batch."
        )
    class_ids = torch.arange(c, device=labels.device, dtype=labels.dtype)
    parts = [student_features, teacher_features.detach(), teacher_label_embeddings.detach()]
    part_labels = [labels, labels, class_ids]
    if student_label_embeddings is not None:
        if student_label_embeddings.shape[0] != c:
            raise AclLabError(
                f"student_label_embeddings has {student_label_embeddings.shape[0]} classes but "
                f"teacher_label_embeddings has {c}; both exits must have the same classes."
            )
        parts.append(student_label_embeddings)
        part_labels.append(class_ids)
    vectors = _cat(parts)
    item_labels = torch.cat(part_labels)
    anchor_mask = torch.zeros(vectors.shape[0], dtype=torch.bool, device=vectors.device)
    anchor_mask[:n] = True
    return masked_supcon(vectors, item_labels, anchor_mask, temperature)
