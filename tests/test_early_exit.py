"""Batched early exit: the extremes of each criterion and equality with one-at-a-time prediction."""
from __future__ import annotations

import pytest
import torch

from acl_lab.early_exit import early_exit_predict, full_predict, normalised_entropy
from acl_lab.errors import AclLabError
from acl_lab.model import build_model

TEXTS = ["a fine movie", "the worst plot ever written by anyone", "meh", "great acting but a dull and long script",
         "I laughed", "not good, not bad, just there", "an utter waste of two hours of my life", "superb"]


@pytest.fixture(scope="module")
def model_and_batch():
    model, tok = build_model("tiny", num_labels=3, multi_exit=True, seed=1)
    with torch.no_grad():  # spread the heads so exits differ between samples
        for i, h in enumerate(model.heads):
            h.weight.mul_(40.0 * (i + 1))
    model.eval()
    return model, tok, tok(TEXTS, padding=True, return_tensors="pt")


def test_threshold_that_never_fires_uses_all_layers(model_and_batch):
    model, _, b = model_and_batch
    for crit, thr in (("entropy", 0.0), ("maxprob", 1.0), ("patience", 99)):
        dec = early_exit_predict(model, **b, criterion=crit, threshold=thr)
        assert dec.exit_layers.tolist() == [4] * len(TEXTS)
        assert torch.equal(dec.predictions, full_predict(model, **b))


def test_threshold_that_always_fires_uses_layer_one(model_and_batch):
    model, _, b = model_and_batch
    for crit, thr in (("entropy", 1.0), ("maxprob", 0.0), ("patience", 0)):
        dec = early_exit_predict(model, **b, criterion=crit, threshold=thr)
        assert dec.exit_layers.tolist() == [1] * len(TEXTS)
        with torch.no_grad():
            first = model(**b).logits[0].argmax(-1)
        assert torch.equal(dec.predictions, first)


@pytest.mark.parametrize("crit, thr", [("entropy", 0.5), ("maxprob", 0.8), ("patience", 1)])
def test_batched_equals_one_at_a_time(model_and_batch, crit, thr):
    model, tok, b = model_and_batch
    batched = early_exit_predict(model, **b, criterion=crit, threshold=thr)
    single = [early_exit_predict(model, **tok([t], return_tensors="pt"), criterion=crit, threshold=thr) for t in TEXTS]
    assert batched.predictions.tolist() == [s.predictions.item() for s in single]
    assert batched.exit_layers.tolist() == [s.exit_layers.item() for s in single]
    if crit == "entropy":
        assert len(set(batched.exit_layers.tolist())) > 1, "the fixture should make samples leave at different layers"


def test_exited_samples_stop_costing_compute(model_and_batch):
    """Count the rows each layer processes: after layer 1 only the samples still active go on."""
    model, _, b = model_and_batch
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0])) for layer in model.encoder.encoder.layer]
    try:
        dec = early_exit_predict(model, **b, criterion="entropy", threshold=0.5)
    finally:
        for h in hooks:
            h.remove()
    expected = [int((dec.exit_layers >= k).sum()) for k in range(1, 5) if int((dec.exit_layers >= k).sum())]
    assert seen == expected and seen[-1] < len(TEXTS)


def test_normalised_entropy_bounds():
    assert normalised_entropy(torch.zeros(1, 4)).item() == pytest.approx(1.0)
    assert normalised_entropy(torch.tensor([[100.0, 0.0, 0.0]])).item() < 1e-6


def test_single_exit_model_and_bad_threshold_are_refused(model_and_batch):
    _, tok, b = model_and_batch
    single, _ = build_model("tiny", num_labels=3, multi_exit=False)
    with pytest.raises(AclLabError, match="multi-exit objective"):
        early_exit_predict(single, **b)
    model = model_and_batch[0]
    with pytest.raises(AclLabError, match="threshold"):
        early_exit_predict(model, **b, criterion="entropy", threshold=1.5)
    with pytest.raises(AclLabError, match="criterion"):
        early_exit_predict(model, **b, criterion="confidence")
