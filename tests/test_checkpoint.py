"""Checkpoints: safetensors + JSON round trip, refusal of corrupt files and of other models' checkpoints."""
from __future__ import annotations

import torch
import pytest

from acl_lab.checkpoint import load_model_weights, load_trained, save_checkpoint
from acl_lab.config import TrainConfig
from acl_lab.errors import AclLabError
from acl_lab.model import build_model


def test_round_trip_gives_same_predictions(tmp_path):
    cfg = TrainConfig(model="tiny", task="rt-polarity", objective="me-ce")
    model, tok = build_model("tiny", 2, multi_exit=True, seed=5)
    with torch.no_grad():
        model.heads[2].weight.add_(1.0)
    save_checkpoint(tmp_path / "ck", model, cfg)
    assert not list(tmp_path.glob("*.tmp")), "no temporary folder left behind"
    loaded, tok2, cfg2 = load_trained(tmp_path / "ck", device="cpu")
    assert cfg2 == cfg
    b = tok(["a fine film", "dreadful"], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        for x, y in zip(model(**b).logits, loaded(**b).logits):
            assert torch.equal(x, y)


def test_checkpoint_from_a_different_model_is_refused(tmp_path):
    cfg = TrainConfig(model="tiny", objective="ce")
    three, _ = build_model("tiny", 3)
    save_checkpoint(tmp_path / "ck", three, cfg)
    two, _ = build_model("tiny", 2)
    with pytest.raises(AclLabError, match="different model.*num_labels"):
        load_model_weights(tmp_path / "ck", two)


def test_corrupt_checkpoint_is_refused(tmp_path):
    cfg = TrainConfig(model="tiny")
    model, _ = build_model("tiny", 2)
    save_checkpoint(tmp_path / "ck", model, cfg)
    f = tmp_path / "ck" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(AclLabError, match="corrupt or truncated"):
        load_model_weights(tmp_path / "ck", model)


def test_missing_weights_folder(tmp_path):
    with pytest.raises(AclLabError, match="not a checkpoint folder"):
        load_trained(tmp_path)
