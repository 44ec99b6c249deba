"""TrainConfig: JSON round trip and clear errors for bad fields."""
from __future__ import annotations

import pytest

from acl_lab.config import TrainConfig
from acl_lab.errors import AclLabError


def test_json_round_trip(tmp_path):
    cfg = TrainConfig(objective="me-acl-cl", lam=0.3, max_steps=7, acl_grad=True, data_dir=None)
    path = tmp_path / "c.json"
    cfg.to_json(path)
    assert TrainConfig.from_json(path) == cfg
    assert TrainConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("changes, words", [
    ({"lam": -0.1}, ["lam", "-0.1", ">= 0"]),
    ({"temperature": 0.0}, ["temperature", "> 0"]),
    ({"threshold": 181.0}, ["threshold", "[0, 180]"]),
    ({"threshold": -1.0}, ["threshold", "[0, 180]"]),
    ({"exit_weights": "random"}, ["exit_weights", "'uniform'", "'ascending'"]),
    ({"objective": "supcon"}, ["objective", "'acl'", "'me-acl-cl'"]),
    ({"angle_scope": "layer"}, ["angle_scope", "'all'", "'repr'"]),
    ({"pooling": "max"}, ["pooling", "'cls'", "'mean'"]),
    ({"max_length": 0}, ["max_length", ">= 1"]),
    ({"batch_size": 0}, ["batch_size", ">= 1"]),
    ({"lam": "0.1"}, ["lam", "str", "float"]),
    ({"batch_size": 1.5}, ["batch_size", "float", "int"]),
    ({"acl_grad": True, "objective": "ce"}, ["acl_grad", "contrastive"]),
])
def test_bad_fields_are_named_with_allowed_values(changes, words):
    with pytest.raises(AclLabError) as err:
        TrainConfig(**changes).validate()
    for w in words:
        assert w in str(err.value)
    assert "Fix" in str(err.value)


def test_unknown_field_in_json(tmp_path):
    with pytest.raises(AclLabError, match="lambda_"):
        TrainConfig.from_dict({"lambda_": 0.1})


def test_acl_grad_defaults():
    assert TrainConfig(objective="acl").use_acl_grad
    assert not TrainConfig(objective="acl-embed").use_acl_grad
    assert TrainConfig(objective="me-acl-cl", acl_grad=True).use_acl_grad
    assert not TrainConfig(objective="ce").use_acl_grad
