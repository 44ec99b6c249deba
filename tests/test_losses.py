"""Losses against slow, item-by-item reference loops of the formula of docs/METHOD.md (float64)."""
from __future__ import annotations

import math

import pytest
import torch

from acl_lab.errors import AclLabError
from acl_lab.losses import acl_cross_layer_loss, acl_embed_loss, masked_supcon, supcon_loss

TAUS = (0.1, 0.5)
LABEL_PATTERNS = {
    "pairs": [0, 0, 1, 1, 2, 2],
    "mixed": [2, 0, 1, 0, 2, 2, 1],
    "singleton": [0, 0, 0, 1, 2, 2],  # class 1 has one sample
    "one_class": [1, 1, 1, 1],
    "distinct": [0, 1, 2, 3],
}
N_CLASSES = 4


# ---------------------------------------------------------------- reference
def _normalise(row: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in row))
    return [x / max(norm, 1e-12) for x in row]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def ref_loss(vectors: list[list[float]], labels: list[int], anchors: list[int], tau: float) -> float:
    """docs/METHOD.md: mean over anchors with P(i) != {} of -1/|P(i)| sum_p log(exp(s_ip) / sum_{a != i} exp(s_ia))."""
    z = [_normalise(v) for v in vectors]
    m = len(z)
    total, count = 0.0, 0
    for i in anchors:
        positives = [p for p in range(m) if p != i and labels[p] == labels[i]]
        if not positives:
            continue
        denominator = 0.0
        for a in range(m):
            if a != i:
                denominator += math.exp(_dot(z[i], z[a]) / tau)
        inner = 0.0
        for p in positives:
            inner += math.log(math.exp(_dot(z[i], z[p]) / tau) / denominator)
        total += -inner / len(positives)
        count += 1
    return total / count if count else 0.0


def ref_embed(features: torch.Tensor, labels: list[int], emb: torch.Tensor, tau: float, anchors: str) -> float:
    n, c = len(labels), emb.shape[0]
    items = features.tolist() + emb.tolist()
    item_labels = labels + list(range(c))
    anchor_ids = list(range(n + c)) if anchors == "all" else list(range(n))
    return ref_loss(items, item_labels, anchor_ids, tau)


def ref_cross(student: torch.Tensor, teacher: torch.Tensor, labels: list[int], t_emb: torch.Tensor,
              s_emb: torch.Tensor | None, tau: float) -> float:
    c = t_emb.shape[0]
    items = student.tolist() + teacher.tolist() + t_emb.tolist()
    item_labels = labels + labels + list(range(c))
    if s_emb is not None:
        items += s_emb.tolist()
        item_labels += list(range(c))
    return ref_loss(items, item_labels, list(range(len(labels))), tau)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _labels(pattern: str) -> torch.Tensor:
    return torch.tensor(LABEL_PATTERNS[pattern], dtype=torch.int64)


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("pattern", LABEL_PATTERNS)
@pytest.mark.parametrize("tau", TAUS)
def test_supcon_matches_reference(pattern: str, tau: float) -> None:
    y = _labels(pattern)
    x = _rand(len(y), 5, seed=1)
    got = supcon_loss(x, y, tau)
    assert got.item() == pytest.approx(ref_loss(x.tolist(), y.tolist(), list(range(len(y))), tau), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("pattern", LABEL_PATTERNS)
@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("anchors", ["all", "samples"])
def test_acl_embed_matches_reference(pattern: str, tau: float, anchors: str) -> None:
    y = _labels(pattern)
    x, emb = _rand(len(y), 5, seed=2), _rand(N_CLASSES, 5, seed=3)
    got = acl_embed_loss(x, y, emb, tau, anchors=anchors)
    assert got.item() == pytest.approx(ref_embed(x, y.tolist(), emb, tau, anchors), rel=1e-10)


@pytest.mark.parametrize("pattern", LABEL_PATTERNS)
@pytest.mark.parametrize("with_student_emb", [False, True])
def test_cross_layer_matches_reference(pattern: str, with_student_emb: bool) -> None:
    y = _labels(pattern)
    s, t = _rand(len(y), 5, seed=4), _rand(len(y), 5, seed=5)
    t_emb, s_emb = _rand(N_CLASSES, 5, seed=6), _rand(N_CLASSES, 5, seed=7)
    s_emb = s_emb if with_student_emb else None
    got = acl_cross_layer_loss(s, t, y, t_emb, s_emb, temperature=0.2)
    assert got.item() == pytest.approx(ref_cross(s, t, y.tolist(), t_emb, s_emb, 0.2), rel=1e-10)


def test_masked_supcon_respects_anchor_mask() -> None:
    y = _labels("mixed")
    x = _rand(len(y), 4, seed=8)
    mask = torch.tensor([True, False, True, False, False, True, True])
    anchors = [i for i, keep in enumerate(mask.tolist()) if keep]
    assert masked_supcon(x, y, mask, 0.3).item() == pytest.approx(ref_loss(x.tolist(), y.tolist(), anchors, 0.3))


# ---------------------------------------------------------------- gradients
def test_supcon_gradcheck() -> None:
    y = _labels("mixed")
    x = _rand(len(y), 4, seed=9).requires_grad_()
    assert torch.autograd.gradcheck(lambda v: supcon_loss(v, y, 0.5), (x,))


@pytest.mark.parametrize("anchors", ["all", "samples"])
def test_acl_embed_gradcheck(anchors: str) -> None:
    y = _labels("singleton")
    x = _rand(len(y), 4, seed=10).requires_grad_()
    emb = _rand(N_CLASSES, 4, seed=11).requires_grad_()
    assert torch.autograd.gradcheck(lambda v, e: acl_embed_loss(v, y, e, 0.5, anchors=anchors), (x, emb))


def test_cross_layer_gradcheck() -> None:
    y = _labels("pairs")
    s = _rand(len(y), 4, seed=12).requires_grad_()
    s_emb = _rand(N_CLASSES, 4, seed=13).requires_grad_()
    t, t_emb = _rand(len(y), 4, seed=14), _rand(N_CLASSES, 4, seed=15)
    assert torch.autograd.gradcheck(lambda a, b: acl_cross_layer_loss(a, t, y, t_emb, b, 0.5), (s, s_emb))


def test_cross_layer_teacher_gets_no_gradient() -> None:
    y = _labels("mixed")
    s = _rand(len(y), 4, seed=16).requires_grad_()
    s_emb = _rand(N_CLASSES, 4, seed=17).requires_grad_()
    t = _rand(len(y), 4, seed=18).requires_grad_()
    t_emb = _rand(N_CLASSES, 4, seed=19).requires_grad_()
    acl_cross_layer_loss(s, t, y, t_emb, s_emb).backward()
    assert t.grad is None and t_emb.grad is None
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert s_emb.grad is not None and s_emb.grad.abs().sum() > 0


# ---------------------------------------------------------------- edge cases
def _finite_with_finite_grad(fn, *inputs: torch.Tensor) -> torch.Tensor:
    leaves = [t.clone().requires_grad_() for t in inputs]
    loss = fn(*leaves)
    loss.backward()
    assert torch.isfinite(loss)
    for leaf in leaves:
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    return loss


@pytest.mark.parametrize("labels", [[0, 1, 2, 3], [3], []], ids=["distinct", "batch_of_one", "empty"])
def test_supcon_without_positives_is_connected_zero(labels: list[int]) -> None:
    y = torch.tensor(labels, dtype=torch.int64)
    x = _rand(len(labels), 3, seed=20)
    loss = _finite_with_finite_grad(lambda v: supcon_loss(v, y), x)
    assert loss.item() == 0.0


@pytest.mark.parametrize("labels", [[0, 0, 0], [1, 0, 0, 2], [0]], ids=["one_class", "singleton", "batch_of_one"])
def test_losses_finite_on_edge_batches(labels: list[int]) -> None:
    y = torch.tensor(labels, dtype=torch.int64)
    x, emb, t = _rand(len(y), 3, seed=21), _rand(3, 3, seed=22), _rand(len(y), 3, seed=23)
    _finite_with_finite_grad(lambda v: supcon_loss(v, y), x)
    _finite_with_finite_grad(lambda v, e: acl_embed_loss(v, y, e), x, emb)
    _finite_with_finite_grad(lambda v, e: acl_cross_layer_loss(v, t, y, e, e), x, emb)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_identical_and_zero_vectors_are_finite(dtype: torch.dtype) -> None:
    y = torch.tensor([0, 0, 1, 1])
    same = torch.ones(4, 3, dtype=dtype)
    zeros = torch.zeros(4, 3, dtype=dtype)
    for x in (same, zeros):
        _finite_with_finite_grad(lambda v: supcon_loss(v, y, 0.05), x)
        _finite_with_finite_grad(lambda v, e: acl_embed_loss(v, y, e, 0.05), x, x[:2])
    # identical vectors: every similarity is 1, so each term is log(M - 1)
    assert supcon_loss(same, y).item() == pytest.approx(math.log(3), rel=1e-5)


def test_acl_embed_every_sample_has_a_positive() -> None:
    y = torch.tensor([0, 1, 2])  # all distinct: SCL has no positive at all
    x, emb = _rand(3, 4, seed=24), _rand(3, 4, seed=25)
    assert supcon_loss(x, y).item() == 0.0
    loss = acl_embed_loss(x, y, emb, anchors="samples")
    assert loss.item() > 0
    expected = ref_embed(x, y.tolist(), emb, 0.1, "samples")
    assert loss.item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_float32(dtype: torch.dtype) -> None:
    y = _labels("mixed")
    x = _rand(len(y), 8, seed=26).to(dtype)
    loss = supcon_loss(x, y, 0.05)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(supcon_loss(x.float(), y, 0.05).item(), rel=1e-6)


def test_autocast_embed_mixed_dtypes() -> None:
    y = _labels("pairs")
    x = _rand(len(y), 8, seed=27).to(torch.bfloat16)
    emb = _rand(3, 8, seed=28).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = acl_embed_loss(x, y, emb)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(acl_embed_loss(x.float(), y, emb).item(), rel=1e-6)


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("tau", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_temperature_raises(tau: float) -> None:
    y = _labels("pairs")
    with pytest.raises(AclLabError, match="temperature"):
        supcon_loss(_rand(len(y), 3), y, tau)


def test_bad_anchors_raises() -> None:
    y = _labels("pairs")
    with pytest.raises(AclLabError, match="anchors"):
        acl_embed_loss(_rand(len(y), 3), y, _rand(3, 3), anchors="labels")


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(AclLabError):
        supcon_loss(_rand(4, 3), torch.tensor([0, 1, 0]))
    with pytest.raises(AclLabError):
        acl_cross_layer_loss(_rand(4, 3), _rand(3, 3), torch.tensor([0, 1, 0, 1]), _rand(2, 3))
    with pytest.raises(AclLabError):
        acl_cross_layer_loss(_rand(4, 3), _rand(4, 3), torch.tensor([0, 1, 0, 1]), _rand(2, 3), _rand(3, 3))
