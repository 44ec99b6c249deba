"""compute_losses against a hand computation: multi-exit weighting (uniform, ascending, descending) and the mu term."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from acl_lab.config import TrainConfig
from acl_lab.losses import acl_cross_layer_loss, acl_embed_loss
from acl_lab.model import ExitOutputs
from acl_lab.objectives import compute_losses, exit_weights

K, N, D, C = 3, 8, 5, 2


class _Exits:
    """The two things compute_losses asks of a model: whether it is multi-exit, and each exit's classifier rows."""

    multi_exit = True

    def __init__(self, embeddings: list[torch.Tensor]) -> None:
        self.embeddings = embeddings

    def label_embeddings(self, i: int) -> torch.Tensor:
        return self.embeddings[i]


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    reps = [torch.randn(N, D, generator=g) for _ in range(K)]
    emb = [torch.randn(C, D, generator=g) for _ in range(K)]
    logits = [torch.randn(N, C, generator=g) for _ in range(K)]
    labels = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])
    out = ExitOutputs(logits=logits, reps=reps, layers=list(range(1, K + 1)))
    return _Exits(emb), out, labels


@pytest.mark.parametrize("kind,weights", [("uniform", [1, 1, 1]), ("ascending", [1, 2, 3]), ("descending", [3, 2, 1])])
def test_exit_weights(kind, weights):
    assert exit_weights(kind, K) == [float(w) for w in weights]


@pytest.mark.parametrize("kind,weights", [("uniform", [1, 1, 1]), ("ascending", [1, 2, 3]), ("descending", [3, 2, 1])])
@pytest.mark.parametrize("objective", ["me-ce", "me-acl", "me-acl-cl"])
def test_multi_exit_losses_by_hand(kind, weights, objective):
    model, out, labels = _batch()
    lam, mu, tau = 0.3, 0.7, 0.2
    cfg = TrainConfig(objective=objective, exit_weights=kind, lam=lam, mu=mu, temperature=tau)
    lp = compute_losses(model, out, labels, cfg)

    ce_k = [F.cross_entropy(out.logits[k], labels) for k in range(K)]
    ce = (weights[0] * ce_k[0] + weights[1] * ce_k[1] + weights[2] * ce_k[2]) / sum(weights)
    assert torch.allclose(lp.ce, ce, atol=1e-6)
    if objective == "me-ce":
        assert lp.aux is None and torch.allclose(lp.total, ce)
        return
    embed_k = [acl_embed_loss(out.reps[k], labels, model.embeddings[k], temperature=tau) for k in range(K)]
    aux = lam * (weights[0] * embed_k[0] + weights[1] * embed_k[1] + weights[2] * embed_k[2]) / sum(weights)
    if objective == "me-acl-cl":
        teacher, teacher_emb = out.reps[K - 1], model.embeddings[K - 1]
        cl = [acl_cross_layer_loss(out.reps[k], teacher, labels, teacher_emb, model.embeddings[k], temperature=tau)
              for k in range(K - 1)]
        aux = aux + mu * (cl[0] + cl[1]) / 2  # the mean over the K - 1 students, unweighted
        assert lp.parts["acl_cl"] == pytest.approx(((cl[0] + cl[1]) / 2).item(), rel=1e-6)
    assert torch.allclose(lp.aux, aux, atol=1e-6)
    assert torch.allclose(lp.total, ce + aux, atol=1e-6)
    # the weighting really matters: the three kinds give three different CE values on this batch
    assert len({round(float(v), 6) for v in ce_k}) == K


def test_mu_zero_removes_the_cross_layer_term_and_lam_zero_the_embed_term():
    model, out, labels = _batch(1)
    base = TrainConfig(objective="me-acl-cl", lam=0.5, mu=0.0)
    with_mu = compute_losses(model, out, labels, base.replace(mu=1.0))
    without = compute_losses(model, out, labels, base)
    embed_only = compute_losses(model, out, labels, base.replace(objective="me-acl"))
    assert torch.allclose(without.aux, embed_only.aux)
    assert not torch.allclose(with_mu.aux, without.aux)
    assert torch.allclose(with_mu.aux - without.aux, torch.tensor(with_mu.parts["acl_cl"]), atol=1e-5)
    lam0 = compute_losses(model, out, labels, base.replace(lam=0.0, mu=1.0))
    assert torch.allclose(lam0.aux, torch.tensor(with_mu.parts["acl_cl"]), atol=1e-5)
