"""Gradient accumulation: for a loss that is a mean over samples it equals the big batch; the gate's bookkeeping."""
from __future__ import annotations


from acl_lab.checkpoint import load_trained
from acl_lab.trainer import train


def test_ce_accumulated_equals_the_big_batch(tiny_config, tmp_path):
    """CE is a mean over samples, so 2 x 8 accumulated = 16 at once: same losses, same weights, same metrics."""
    base = tiny_config.replace(objective="ce", max_steps=3, eval_every=3)
    big = train(base.replace(batch_size=16, output_dir=str(tmp_path / "big")), progress=False)
    acc = train(base.replace(batch_size=8, grad_accum=2, output_dir=str(tmp_path / "acc")), progress=False)
    assert len(acc.history) == len(big.history) == 3
    for a, b in zip(acc.history, big.history):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, (a, b)
    assert abs(acc.metrics["dev"]["accuracy"] - big.metrics["dev"]["accuracy"]) < 1e-9
    m_acc, _, _ = load_trained(acc.paths["best"], device="cpu")
    m_big, _, _ = load_trained(big.paths["best"], device="cpu")
    worst = max((pa - pb).abs().max().item() for pa, pb in zip(m_acc.parameters(), m_big.parameters()))
    assert worst < 1e-4, worst


def test_contrastive_accumulated_differs_from_the_big_batch(tiny_config, tmp_path):
    """The contrastive term is a loss over the micro-batch's set of items, so accumulation changes it (documented)."""
    base = tiny_config.replace(objective="acl-embed", max_steps=2)
    big = train(base.replace(batch_size=16, output_dir=str(tmp_path / "big")), progress=False)
    acc = train(base.replace(batch_size=8, grad_accum=2, output_dir=str(tmp_path / "acc")), progress=False)
    assert abs(acc.history[0]["ce"] - big.history[0]["ce"]) < 1e-5  # the CE part is the same first step
    assert abs(acc.history[0]["acl_embed"] - big.history[0]["acl_embed"]) > 1e-6


def test_gate_under_accumulation_logs_the_kept_share_and_the_drop_rate_agrees(tiny_config, tmp_path):
    """One decision per micro-batch: ``kept`` is the share kept in the step, and metrics' drop rate is 1 - its mean."""
    cfg = tiny_config.replace(objective="acl", batch_size=8, grad_accum=2, max_steps=4, threshold=80.0,
                              output_dir=str(tmp_path / "gated"))
    res = train(cfg, progress=False)
    kept = [r["kept"] for r in res.history]
    assert all(k in (0.0, 0.5, 1.0) for k in kept), kept
    assert abs(res.metrics["gate"]["drop_rate"] - (1.0 - sum(kept) / len(kept))) < 1e-12
    assert res.metrics["gate"]["steps"] == len(kept)
