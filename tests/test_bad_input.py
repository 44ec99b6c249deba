"""Bad input that the other test files do not already cover: each gets one clear AclLabError with a fix."""
from __future__ import annotations

import json

import pytest
import torch

from acl_lab.assets import fetch
from acl_lab.config import TrainConfig
from acl_lab.errors import AclLabError
from acl_lab.model import build_model
from acl_lab.objectives import compute_losses
from acl_lab.presets import preset_config
from acl_lab.trainer import load_result, train


def test_unknown_preset():
    with pytest.raises(AclLabError, match=r"PRESET 'fast'.*'smoke', 'quick', 'standard', 'full'.*Fix"):
        preset_config("fast")


def test_notebook_parameter_of_wrong_type_is_named():
    with pytest.raises(AclLabError, match="lam.*str.*float"):
        preset_config("smoke", lam="0.5")


def test_multi_exit_objective_on_single_exit_model():
    model, tok = build_model("tiny", 2, multi_exit=False)
    b = tok(["good", "bad"], padding=True, return_tensors="pt")
    out = model(**b)
    with pytest.raises(AclLabError, match="multi-exit"):
        compute_losses(model, out, torch.tensor([0, 1]), TrainConfig(objective="me-acl-cl"))


def test_contrastive_objective_on_regression_task(tmp_path):
    with pytest.raises(AclLabError, match="regression.*Fix"):
        train(TrainConfig(task="stsb", objective="acl", model="tiny", output_dir=str(tmp_path)), progress=False)


def test_unknown_asset():
    with pytest.raises(AclLabError, match="minilm-l6"):
        fetch("glove")


def test_config_file_that_is_not_json(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{lam: 0.1")
    with pytest.raises(AclLabError, match="not valid JSON"):
        TrainConfig.from_json(bad)
    with pytest.raises(AclLabError, match="does not exist"):
        TrainConfig.from_json(tmp_path / "missing.json")


def test_result_of_a_run_that_never_finished(tmp_path):
    with pytest.raises(AclLabError, match="no finished run.*resume"):
        load_result(tmp_path)


def test_resume_with_corrupt_optimizer_state_keeps_the_run(tiny_config):
    """A broken resumable checkpoint is refused with a fix, and the files already there are left untouched."""
    cfg = tiny_config.replace(max_steps=3, eval_every=3)
    train(cfg, progress=False)
    out = __import__("pathlib").Path(cfg.output_dir)
    (out / "metrics.json").unlink()  # pretend the run stopped after its last checkpoint
    state = out / "checkpoints" / "last" / "trainer_state.json"
    state.write_text("{not json")
    history_before = (out / "history.jsonl").read_text()
    with pytest.raises(AclLabError, match="cannot be resumed.*overwrite"):
        train(cfg, resume=True, progress=False)
    assert (out / "history.jsonl").read_text() == history_before
    assert (out / "checkpoints" / "best" / "model.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["max_steps"] == 3
