"""The trainer on the tiny model: every objective learns a toy task, runs are reproducible and resumable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from acl_lab import objectives
from acl_lab.config import OBJECTIVES
from acl_lab.errors import AclLabError
from acl_lab.trainer import load_result, train


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_objective_runs_and_loss_falls(tiny_config, objective):
    cfg = tiny_config.replace(objective=objective, max_steps=40, eval_every=20)
    result = train(cfg, progress=False)
    hist = result.history
    assert len(hist) == 40 and [r["step"] for r in hist] == list(range(1, 41))
    assert _mean(hist[-4:], "ce") < 0.7 * _mean(hist[:4], "ce")
    m = json.loads(result.paths["metrics"].read_text())
    assert m["task"] == "sst2" and m["objective"] == objective and m["seed"] == 0 and m["config"]["objective"] == objective
    assert set(m["dev"]) == {"accuracy"}
    assert len(m["dev_per_exit"]) == (4 if objective.startswith("me-") else 1)
    assert m["dev_per_exit"][-1] == m["dev"]
    assert m["dev"]["accuracy"] >= 0.8  # the toy task gives its label away
    if objective == "acl":
        assert all(0 <= r["angle"] <= 180 and isinstance(r["kept"], bool) for r in hist)
        assert 0.0 <= m["gate"]["drop_rate"] <= 1.0
    if objective == "me-acl-cl":
        assert all(r["acl_cl"] > 0 for r in hist)
    assert result.paths["best"].joinpath("model.safetensors").exists()
    assert result.paths["representations"].exists()


@pytest.mark.parametrize("scope", ["all", "top-layer", "head", "repr", "screened"])
def test_acl_grad_on_multi_exit_with_every_scope(tiny_config, scope):
    cfg = tiny_config.replace(objective="me-acl-cl", acl_grad=True, angle_scope=scope, max_steps=3, threshold=60.0)
    result = train(cfg, progress=False)
    assert all("angle" in r and r["kept"] == (r["angle"] <= 60.0) for r in result.history)


def test_same_seed_same_metrics_and_angles(tiny_config, tmp_path):
    cfg = tiny_config.replace(objective="acl")
    a = train(cfg.replace(output_dir=str(tmp_path / "a")), progress=False)
    b = train(cfg.replace(output_dir=str(tmp_path / "b")), progress=False)
    assert a.metrics["dev"] == b.metrics["dev"]
    keys = ("loss", "ce", "acl_embed", "cos", "angle", "kept", "lr")
    assert [[r[k] for k in keys] for r in a.history] == [[r[k] for k in keys] for r in b.history]


def test_grad_accumulation_matches_big_batch_when_gating_is_off(tiny_config, tmp_path):
    big = train(tiny_config.replace(objective="acl-embed", batch_size=16, max_steps=2, output_dir=str(tmp_path / "big")),
                progress=False)
    acc = train(tiny_config.replace(objective="acl-embed", batch_size=8, grad_accum=2, max_steps=2,
                                    output_dir=str(tmp_path / "acc")), progress=False)
    # not identical (the contrastive loss sees 8 samples instead of 16) but both run and log one row per step
    assert len(acc.history) == len(big.history) == 2


def test_output_dir_policy(tiny_config):
    first = train(tiny_config, progress=False)
    with pytest.raises(AclLabError, match="different config.*lr"):
        train(tiny_config.replace(lr=1e-4), progress=False)
    with pytest.raises(AclLabError, match="already holds a run"):
        train(tiny_config, progress=False)
    again = train(tiny_config, resume=True, progress=False)  # finished: read back, no training
    assert again.metrics == first.metrics == load_result(tiny_config.output_dir).metrics
    redo = train(tiny_config.replace(lr=1e-4), overwrite=True, progress=False)
    assert redo.config.lr == 1e-4


def test_unwritable_output_dir(tiny_config, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(AclLabError, match="not writable"):
        train(tiny_config.replace(output_dir=str(blocker / "run")), progress=False)


def test_non_finite_loss_stops_with_checkpoint(tiny_config, monkeypatch):
    real = objectives.compute_losses
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        parts = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:
            parts.ce = parts.ce * float("nan")
        return parts

    monkeypatch.setattr("acl_lab.trainer.compute_losses", poisoned)
    with pytest.raises(AclLabError, match="Non-finite loss.*last good state"):
        train(tiny_config, progress=False)
    state = json.loads((tiny_config_path := __import__("pathlib").Path(tiny_config.output_dir))
                       .joinpath("checkpoints/last/trainer_state.json").read_text())
    assert state["step"] == 4
    assert tiny_config_path.joinpath("checkpoints/last/model.safetensors").exists()


def _cli(cfg, *extra):
    return [sys.executable, "-m", "acl_lab", "train", "--task", cfg.task, "--source", "local", "--data-dir",
            cfg.data_dir, "--model", "tiny", "--objective", "acl", "--batch-size", "8", "--max-length", "16",
            "--max-steps", "40", "--eval-every", "10", "--lr", "0.002", "--num-threads", "1", "--no-progress",
            "--output-dir", *extra]


def test_interrupted_then_resumed_equals_uninterrupted(tiny_config, tmp_path):
    """A real SIGINT to a training subprocess, then --resume: same metrics and step log as a run never stopped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = tmp_path / "full"
    subprocess.run(_cli(tiny_config, str(full)), check=True, env=env, capture_output=True)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(_cli(tiny_config, str(cut)), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    hist = cut / "history.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not hist.exists() or len(hist.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    state = json.loads((cut / "checkpoints/last/trainer_state.json").read_text())
    assert 0 < state["step"] < 40, "the run should have been stopped part-way"
    assert not (cut / "metrics.json").exists()
    subprocess.run(_cli(tiny_config, str(cut), "--resume"), check=True, env=env, capture_output=True)
    a = json.loads((full / "metrics.json").read_text())
    b = json.loads((cut / "metrics.json").read_text())
    assert a["dev"] == b["dev"] and a["dev_per_exit"] == b["dev_per_exit"] and a["steps"] == b["steps"] == 40
    rows = lambda p: [(r["step"], r["loss"], r["angle"]) for r in map(json.loads, p.read_text().splitlines())
                      if r.get("event") != "eval"]
    assert rows(full / "history.jsonl") == rows(cut / "history.jsonl")


def test_probe_every_k_probes_steps_1_plus_multiples_of_k_and_leaves_training_alone(tiny_config, tmp_path):
    cfg = tiny_config.replace(objective="ce", max_steps=7)
    plain = train(cfg.replace(output_dir=str(tmp_path / "plain")), progress=False)
    every = train(cfg.replace(output_dir=str(tmp_path / "every"), probe_angles=True), progress=False)
    third = train(cfg.replace(output_dir=str(tmp_path / "third"), probe_angles=True, probe_every=3), progress=False)
    assert [r["step"] for r in every.history if "angle_scl" in r] == list(range(1, 8))
    assert [r["step"] for r in third.history if "angle_scl" in r] == [1, 4, 7]
    assert all("angle_acl_embed" in r for r in third.history if "angle_scl" in r)
    assert not any("angle_scl" in r for r in plain.history)
    # probing reads gradients but must not change the training trajectory
    assert [r["loss"] for r in plain.history] == [r["loss"] for r in every.history] == [r["loss"] for r in third.history]
    assert [r["angle_scl"] for r in every.history if r["step"] in (1, 4, 7)] == \
        [r["angle_scl"] for r in third.history if "angle_scl" in r]


def test_probe_every_must_be_positive(tiny_config):
    with pytest.raises(AclLabError, match="probe_every"):
        tiny_config.replace(probe_every=0).validate()


# ---------------------------------------------------------------------------
# the public seam: Trainer.step / evaluate / save / fit and hooks
# ---------------------------------------------------------------------------

def test_trainer_seam_step_hooks_and_fit_equal_train(tiny_config, tmp_path):
    from acl_lab.trainer import EVAL_BATCH_SIZE, Trainer

    cfg = tiny_config.replace(objective="acl", max_steps=4, eval_every=2)
    seen_steps, seen_evals = [], []
    trainer = Trainer(cfg.replace(output_dir=str(tmp_path / "seam")), progress=False)
    trainer.on_step.append(lambda t, row: seen_steps.append((t.state.step, row["step"], row["lam_t"])))
    trainer.on_eval.append(lambda t, row: seen_evals.append(row["step"]))
    result = trainer.fit()
    plain = train(cfg.replace(output_dir=str(tmp_path / "plain")), progress=False)
    assert [(s, r) for s, r, _ in seen_steps] == [(1, 1), (2, 2), (3, 3), (4, 4)] and seen_evals == [2, 4]
    assert [r["loss"] for r in result.history] == [r["loss"] for r in plain.history]
    assert result.metrics["dev"] == plain.metrics["dev"]
    # lam_t is the lambda actually applied: lam when the gate kept the term, 0 when it dropped it
    assert [lam_t for _, _, lam_t in seen_steps] == [cfg.lam if r["kept"] else 0.0 for r in result.history]


def test_trainer_step_on_own_batches_and_lam_t_without_gate(tiny_config, tmp_path):
    from acl_lab.data import make_loader
    from acl_lab.trainer import EVAL_BATCH_SIZE, Trainer

    for objective, lam_t in (("ce", 0.0), ("acl-embed", 0.1)):
        t = Trainer(tiny_config.replace(objective=objective, output_dir=str(tmp_path / objective)), progress=False)
        batch = next(iter(make_loader(t.encoded["train"], t.tokenizer, 8, shuffle=False)))
        before = [p.detach().clone() for p in t.model.parameters()]
        row = t.step([batch])
        assert row["step"] == t.state.step == 1 and row["lam_t"] == lam_t and "kept" not in row
        assert any(not torch.equal(a, p) for a, p in zip(before, t.model.parameters()))  # the weights moved
        assert set(t.evaluate("dev")[-1]) == {"accuracy"}
        assert t.save("last") == t.output_dir / "checkpoints" / "last"
        assert json.loads((t.output_dir / "checkpoints" / "last" / "trainer_state.json").read_text())["step"] == 1


def test_grad_accum_kept_is_the_fraction_of_micro_batches_kept(tiny_config):
    # threshold 85 on this fixture: some steps keep the term on only part of their 3 micro-batches
    cfg = tiny_config.replace(objective="acl", batch_size=8, grad_accum=3, max_steps=4, threshold=85.0)
    result = train(cfg, progress=False)
    kept = [r["kept"] for r in result.history]
    assert all(abs(3 * k - round(3 * k)) < 1e-12 and 0.0 <= k <= 1.0 for k in kept)
    assert any(0.0 < k < 1.0 for k in kept), kept  # a fraction, not a bool, under accumulation
    assert all(abs(r["lam_t"] - cfg.lam * r["kept"]) < 1e-12 for r in result.history)
    assert abs(result.metrics["gate"]["drop_rate"] - (1.0 - sum(kept) / len(kept))) < 1e-12


def test_save_checkpoints_false_keeps_best_and_skips_last(tiny_config, tmp_path):
    """The documented decision: without save_checkpoints there is no resumable `last`, but `best` (the trained
    model that test metrics, representations and early exit use) is always written."""
    res = train(tiny_config.replace(save_checkpoints=False, output_dir=str(tmp_path / "nockpt")), progress=False)
    assert res.paths["best"].is_dir() and not res.paths["last"].exists()


def _screened_trainer(cfg, resume=False):
    """A Trainer whose screened gate has a 2-pair warm-up, so a short tiny run takes both paths."""
    from acl_lab.grad import ACLGrad, ScreenRule
    from acl_lab.trainer import EVAL_BATCH_SIZE, Trainer

    t = Trainer(cfg, resume=resume, progress=False)
    params = [p for p in t.model.parameters() if p.requires_grad]
    t.gate = ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="screened",
                     screen=ScreenRule(warmup=2, quantile=0.5, slack=0.0, floor=0.5))
    return t


def _interrupt_at(trainer, step):
    """A Ctrl-C during ``step``: the trainer stops at that step's boundary (through the public on_step hook)."""
    trainer.on_step.append(lambda t, row: signal.raise_signal(signal.SIGINT) if t.state.step == step else None)
    return trainer


def test_screened_gate_logs_both_paths_and_resumes_its_calibration(tiny_config, tmp_path):
    """history.jsonl holds path and angles of every screened decision; a resumed run rebuilds the margin from it."""
    cfg = tiny_config.replace(objective="acl", angle_scope="screened", max_steps=12, eval_every=4, threshold=60.0)
    full = _screened_trainer(cfg.replace(output_dir=str(tmp_path / "full"))).fit()
    rows = full.history
    paths = [bool(r["exact_path"]) for r in rows]
    assert paths[:2] == [True, True] and not all(paths), paths  # warm-up exact, then some cheap decisions
    for r in rows:
        assert r["kept"] == (r["angle"] <= 60.0) and 0 <= r["cheap_angle"] <= 180
        assert (r["exact_angle"] == r["angle"]) if r["exact_path"] else (r["exact_angle"] != r["exact_angle"])
    assert rows[0]["margin"] == float("inf") and all(r["margin"] >= 0.5 for r in rows[2:])

    cut = cfg.replace(output_dir=str(tmp_path / "cut"))
    with pytest.raises(KeyboardInterrupt):
        _interrupt_at(_screened_trainer(cut), 5).fit()
    resumed = _screened_trainer(cut, resume=True).fit()
    keys = ("loss", "angle", "kept", "exact_path", "cheap_angle", "margin")
    assert [[r[k] for k in keys] for r in resumed.history] == [[r[k] for k in keys] for r in rows]
    assert resumed.metrics["dev"] == full.metrics["dev"]


def test_length_grouped_run_resumes_to_the_same_steps(tiny_config, tmp_path):
    """group_by_length: the batch order is a function of the seed, so a run interrupted mid-epoch resumes exactly."""
    from acl_lab.trainer import EVAL_BATCH_SIZE, Trainer

    cfg = tiny_config.replace(group_by_length=True, max_steps=10, eval_every=5)
    full = train(cfg.replace(output_dir=str(tmp_path / "full")), progress=False)
    plain = train(cfg.replace(group_by_length=False, output_dir=str(tmp_path / "plain")), progress=False)
    assert [r["loss"] for r in full.history] != [r["loss"] for r in plain.history]  # the option changes the order
    cut = cfg.replace(output_dir=str(tmp_path / "cut"))
    with pytest.raises(KeyboardInterrupt):
        _interrupt_at(Trainer(cut, progress=False), 3).fit()
    resumed = train(cut, resume=True, progress=False)
    assert [(r["step"], r["loss"]) for r in resumed.history] == [(r["step"], r["loss"]) for r in full.history]
    assert resumed.metrics["dev"] == full.metrics["dev"]


def test_ce_probe_reusing_the_update_g_ce_measures_the_recomputed_angles(tiny_config):
    """Objective ce: the probe takes g_CE from the update; its cosines equal a from-scratch gradient_cosines."""
    import copy

    from acl_lab.grad import gradient_cosines
    from acl_lab.objectives import classification_loss, probe_losses
    from acl_lab.trainer import EVAL_BATCH_SIZE, Trainer

    t = Trainer(tiny_config.replace(objective="ce", probe_angles=True), progress=False)
    group, _ = next(t.batches())
    ref = copy.deepcopy(t.model).train()
    out = ref(**group[0])
    ce = classification_loss(out.logits[-1], group[0]["labels"], regression=False)
    probes = probe_losses(ref, out, group[0]["labels"], t.cfg)
    expected = gradient_cosines(ce, list(probes.values()), [p for p in ref.parameters() if p.requires_grad])
    row = t.step(group)
    assert abs(row["cos_scl"] - expected[0]) < 1e-6 and abs(row["cos_acl_embed"] - expected[1]) < 1e-6
    assert row["lam_t"] == 0.0


@pytest.mark.parametrize("dev_outputs", ["kept from the best eval", "passed again"])
@pytest.mark.parametrize("objective", ["ce", "me-acl-cl"])
def test_final_files_equal_a_fresh_pass_over_the_best_checkpoint(tiny_config, tmp_path, objective, dev_outputs):
    """metrics.json, predictions.npz and representations.safetensors are what a fresh, separate evaluation of
    checkpoints/best gives, whether the dev outputs come from the eval that saved the best weights (no second
    dev pass) or from a pass of their own (as after a resume past the best step)."""
    import numpy as np

    from acl_lab.checkpoint import load_trained
    from acl_lab.data import load_task, make_loader, tokenize
    from acl_lab.evaluate import dump_representations, evaluate_with_predictions, load_representations
    from acl_lab.result import load_predictions
    from acl_lab.tasks import get_task
    from acl_lab.trainer import EVAL_BATCH_SIZE, Trainer

    cfg = tiny_config.replace(objective=objective, max_steps=9, eval_every=3, dropout=0.1,
                              output_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, progress=False)
    if dev_outputs == "passed again":
        trainer.on_eval.append(lambda t, row: setattr(t, "_best_dev", None))
    result = trainer.fit()

    model, tokenizer, _ = load_trained(result.output_dir / "checkpoints" / "best", device="cpu")
    task = get_task(cfg.task)
    data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, seed=cfg.seed)
    enc = tokenize(data, tokenizer, cfg.max_length)
    saved = load_predictions(result.output_dir)
    splits = [s for s in enc if s != "train"]
    assert splits and set(splits) <= set(saved)
    for split in splits:
        per_exit, preds = evaluate_with_predictions(model, make_loader(enc[split], tokenizer, EVAL_BATCH_SIZE, shuffle=False),
                                                    task, torch.device("cpu"))
        assert result.metrics[f"{split}_per_exit"] == per_exit
        np.testing.assert_array_equal(saved[split]["predictions"], preds["predictions"])
        np.testing.assert_array_equal(saved[split]["labels"], preds["labels"])
    fresh = load_representations(dump_representations(model, make_loader(enc["dev"], tokenizer, EVAL_BATCH_SIZE, shuffle=False),
                                                      torch.device("cpu"), tmp_path / "fresh.safetensors",
                                                      list(task.label_names)))
    kept = load_representations(result.paths["representations"])
    assert kept["layers"] == fresh["layers"] and kept["label_names"] == fresh["label_names"]
    np.testing.assert_array_equal(kept["labels"], fresh["labels"])
    for layer in fresh["layers"]:
        for key in ("reps", "logits", "label_embeddings"):
            np.testing.assert_allclose(kept[key][layer], fresh[key][layer], rtol=0, atol=1e-6)
