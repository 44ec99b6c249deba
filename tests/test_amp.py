"""Mixed precision on the CPU: ``--amp bf16`` / ``--amp fp16`` (with a GradScaler) train every objective, the exact
ACL-Grad gate decides under bf16 as in float32 except near the threshold, an fp16 overflow is skipped by the scaler
without corrupting anything, and ``--amp auto`` stays float32 on the CPU. All on the tiny random BERT."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from acl_lab.config import OBJECTIVES, TrainConfig
from acl_lab.data import load_task, make_loader, tokenize
from acl_lab.grad import ACLGrad
from acl_lab.model import build_model
from acl_lab.objectives import compute_losses
from acl_lab.trainer import train
from acl_lab.utils import amp_dtype, autocast, grad_scaler
from conftest import write_toy_sst2

CPU = torch.device("cpu")
# Largest |angle(bf16) - angle(fp32)| we accept, in degrees, for the exact ("all") scope on the tiny model, with
# dropout off. Measured: at most 0.10 degrees over the 16 batches of test_bf16_gate_matches_fp32 (angles 62-107
# degrees); a decision may differ only for batches whose fp32 angle lies within this tolerance of the threshold.
# With dropout on, the two passes see different masks and differ by up to ~10 degrees: that is dropout, not bf16.
BF16_ANGLE_TOL = 0.5


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_amp_policy_on_cpu():
    assert amp_dtype(CPU, "auto") is None and amp_dtype(CPU, "off") is None
    assert amp_dtype(CPU, "bf16") is torch.bfloat16 and amp_dtype(CPU, "fp16") is torch.float16
    assert grad_scaler(CPU, None) is None and grad_scaler(CPU, torch.bfloat16) is None
    scaler = grad_scaler(CPU, torch.float16)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast(CPU, amp_dtype(CPU, "auto")):
        assert lin(x).dtype == torch.float32
    with autocast(CPU, amp_dtype(CPU, "bf16")):
        assert lin(x).dtype == torch.bfloat16
    with autocast(CPU, amp_dtype(CPU, "fp16")):
        assert lin(x).dtype == torch.float16


def test_auto_is_fp32_on_cpu_and_bf16_really_casts(tiny_config, tmp_path):
    """The trainer's loss under --amp auto equals --amp off bit for bit on the CPU; under bf16 it does not."""
    base = tiny_config.to_dict() | {"max_steps": 2, "eval_every": 2, "save_checkpoints": False}
    losses = {}
    for amp in ("off", "auto", "bf16"):
        res = train(TrainConfig(**base | {"amp": amp, "output_dir": str(tmp_path / amp)}), overwrite=True,
                    progress=False)
        losses[amp] = [row["loss"] for row in res.history]
        assert res.metrics["device"] == "cpu"
    assert losses["auto"] == losses["off"]
    assert losses["bf16"] != losses["off"]
    assert all(abs(a - b) < 0.05 for a, b in zip(losses["bf16"], losses["off"]))


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_every_objective_trains_under_amp(tiny_config, tmp_path, amp):
    runs = [(obj, None) for obj in OBJECTIVES] + [("me-acl-cl", True)]  # the gate on the multi-exit objective too
    for objective, acl_grad in runs:
        cfg = TrainConfig(**tiny_config.to_dict() | {"objective": objective, "acl_grad": acl_grad, "amp": amp,
                                                    "max_steps": 3, "eval_every": 3, "save_checkpoints": False,
                                                    "output_dir": str(tmp_path / f"{objective}-{acl_grad}")})
        res = train(cfg, overwrite=True, progress=False)
        assert [row["step"] for row in res.history] == [1, 2, 3], objective
        assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in res.history), objective
        assert 0.0 <= res.metrics["dev"]["accuracy"] <= 1.0
        if cfg.use_acl_grad:
            assert all(0.0 <= row["angle"] <= 180.0 for row in res.history), (objective, res.history)


# ---------------------------------------------------------------------------------------------------------------
# the gate under autocast, driven as the trainer drives it
# ---------------------------------------------------------------------------------------------------------------
def _setup(tmp_path, n_train: int = 256, seed: int = 0):
    glue = write_toy_sst2(tmp_path / "glue", n_train=n_train, seed=seed)
    cfg = TrainConfig(task="sst2", source="local", data_dir=str(glue), model="tiny", objective="acl", dropout=0.0,
                      batch_size=16, max_length=16, lr=2e-3, output_dir=str(tmp_path / "unused"))
    model, tok = build_model("tiny", 2, dropout=0.0, seed=seed)
    enc = tokenize(load_task("sst2", source="local", data_dir=str(glue)), tok, cfg.max_length)
    batches = list(make_loader(enc["train"], tok, cfg.batch_size, shuffle=True, seed=seed))
    return cfg, model, batches


def _gate_backward(model, batch, cfg, gate: ACLGrad, dtype, scale=1.0):
    with autocast(CPU, dtype):
        out = model(**batch)
    lp = compute_losses(model, out, batch["labels"], cfg)
    return gate.backward(lp.ce, lp.aux, scale=scale)


def test_bf16_gate_matches_fp32(tmp_path):
    """Along one fp32 training trajectory, per batch: the exact-scope angle under bf16 autocast and in fp32,
    on the same weights and batch. Decisions agree wherever the fp32 angle is farther than BF16_ANGLE_TOL
    from the threshold; thresholds at 90 and at the median angle (so both decisions occur)."""
    cfg, model, batches = _setup(tmp_path)
    model.eval()  # no dropout anywhere (the encoder's own dropout too): both passes see the same network
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    params = list(model.parameters())
    angles32, angles16 = [], []
    for batch in batches:
        gate = ACLGrad(params, lam=1.0, threshold=90.0)
        rec16 = _gate_backward(model, batch, cfg, gate, torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        rec32 = _gate_backward(model, batch, cfg, gate, None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        angles32.append(rec32.angle)
        angles16.append(rec16.angle)
    assert len(angles32) == 16 and all(math.isfinite(a) for a in angles32 + angles16)
    diffs = [abs(a - b) for a, b in zip(angles16, angles32)]
    assert max(diffs) <= BF16_ANGLE_TOL, diffs
    assert max(diffs) > 0.0  # bf16 really changed the arithmetic
    checked = 0
    for threshold in (90.0, statistics.median(angles32)):
        for a32, a16 in zip(angles32, angles16):
            if abs(a32 - threshold) > BF16_ANGLE_TOL:
                assert (a16 <= threshold) == (a32 <= threshold), (threshold, a32, a16)
                checked += 1
    kept_at_median = sum(a <= statistics.median(angles32) for a in angles32)
    assert 0 < kept_at_median < len(angles32)  # both decisions were compared
    assert checked >= len(angles32)  # most batches were decided away from the threshold


def test_fp16_injected_inf_is_skipped_by_the_scaler(tmp_path):
    """An inf in one gradient under fp16 autocast: the gate records NaN, the scaler skips the step (weights and
    optimizer state untouched) and lowers its scale; the next step is a normal one."""
    cfg, model, batches = _setup(tmp_path, n_train=32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = grad_scaler(CPU, torch.float16)
    gate = ACLGrad(list(model.parameters()), lam=1.0, threshold=90.0)

    def step(batch):
        rec = _gate_backward(model, batch, cfg, gate, torch.float16, scale=scaler.scale)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return rec

    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale0 = scaler.get_scale()
    target = model.heads[-1].weight
    handle = target.register_hook(lambda g: torch.full_like(g, float("inf")))
    rec = step(batches[0])
    handle.remove()
    assert math.isnan(rec.cos) and math.isnan(rec.angle)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a skipped step changed weights"
    assert not opt.state, "the optimizer state was touched by a skipped step"
    assert scaler.get_scale() == scale0 * 0.5

    rec = step(batches[1])
    assert math.isfinite(rec.angle) and 0.0 <= rec.angle <= 180.0
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step after the skip did not update"
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert scaler.get_scale() == scale0 * 0.5  # one good step does not grow the scale back yet


def test_trainer_survives_an_fp16_overflow(tiny_config, tmp_path, monkeypatch):
    """Through train(): an inf injected into one gradient on the first step is recorded as a NaN angle, the run
    goes on, and the trained weights stay finite."""
    import acl_lab.trainer as trainer

    real_build = trainer.build_model

    def build_with_one_inf(*args, **kwargs):
        model, tok = real_build(*args, **kwargs)
        weight = next(p for p in model.parameters() if p.requires_grad)
        fired = []

        def once(g):
            if not fired:
                fired.append(True)
                return torch.full_like(g, float("inf"))
            return g

        weight.register_hook(once)
        return model, tok

    monkeypatch.setattr(trainer, "build_model", build_with_one_inf)
    cfg = TrainConfig(**tiny_config.to_dict() | {"objective": "acl", "amp": "fp16", "max_steps": 3, "eval_every": 3})
    res = train(cfg, overwrite=True, progress=False)
    angles = [row["angle"] for row in res.history]
    assert math.isnan(angles[0]) and all(math.isfinite(a) for a in angles[1:]), angles
    assert all(math.isfinite(row["loss"]) for row in res.history)
    from safetensors.torch import load_file

    weights = load_file(str(res.paths["best"] / "model.safetensors"))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
