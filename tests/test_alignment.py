"""alignment_score against hand computations; project_2d shapes and determinism; the gradient-conflict tables."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from acl_lab.analysis.gradients import angle_long_frame, conflict_summary, format_conflict_table, phase_of, phase_summary
from acl_lab.analysis.representations import alignment_score, project_2d
from acl_lab.analysis.runs import pick_run
from acl_lab.config import CONFLICT_DEGREES
from acl_lab.errors import AclLabError


def test_alignment_score_hand_computed_two_classes():
    # label embeddings along the axes (their length must not matter), three samples
    emb = np.array([[2.0, 0.0], [0.0, 5.0]])
    reps = np.array([[3.0, 0.0],    # class 0, on its own axis: own 1, other 0
                     [1.0, 1.0],    # class 1, on the diagonal: own 1/sqrt2, other 1/sqrt2 (tie -> class 0 nearest)
                     [0.0, -1.0]])  # class 0, pointing away from class 1: own 0, other -1
    labels = np.array([0, 1, 0])
    s = alignment_score(reps, labels, emb)
    r = 1 / math.sqrt(2)
    own = (1 + r + 0) / 3
    other = (0 + r + -1) / 3
    assert s["own_cos"] == pytest.approx(own)
    assert s["other_cos"] == pytest.approx(other)
    assert s["gap"] == pytest.approx(own - other)
    # nearest label embedding: sample 0 -> class 0 (own), sample 1 -> tie, argmax picks 0 (not own),
    # sample 2 -> cos 0 vs -1 -> class 0 (own)
    assert s["nearest_own"] == pytest.approx(2 / 3)


def test_alignment_score_three_classes_averages_the_other_classes():
    emb = np.eye(3)
    reps = np.array([[1.0, 1.0, 0.0]])  # class 2: own 0, others 1/sqrt2 and 1/sqrt2
    s = alignment_score(reps, np.array([2]), emb)
    assert s["own_cos"] == pytest.approx(0.0)
    assert s["other_cos"] == pytest.approx(1 / math.sqrt(2))
    assert s["gap"] == pytest.approx(-1 / math.sqrt(2))
    assert s["nearest_own"] == 0.0


def test_alignment_score_perfect_alignment():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(4, 8))
    labels = rng.integers(0, 4, size=50)
    reps = emb[labels] * rng.uniform(0.5, 3.0, size=(50, 1))  # each sample a positive multiple of its own row
    s = alignment_score(reps, labels, emb)
    assert s["own_cos"] == pytest.approx(1.0)
    assert s["nearest_own"] == 1.0
    assert s["gap"] > 0


@pytest.mark.parametrize("reps, labels, emb", [
    (np.zeros((3, 2)), np.array([0, 1]), np.eye(2)),            # length mismatch
    (np.zeros((2, 3)), np.array([0, 1]), np.eye(2)),            # width mismatch
    (np.zeros((2, 2)), np.array([0, 2]), np.eye(2)),            # label out of range
    (np.zeros((2, 2)), np.array([0, 0]), np.ones((1, 2))),      # a single class
])
def test_alignment_score_rejects_bad_input(reps, labels, emb):
    with pytest.raises(AclLabError):
        alignment_score(reps, labels, emb)


@pytest.mark.parametrize("method", ["pca", pytest.param("umap", marks=pytest.mark.slow)])
def test_project_2d_shapes_and_determinism(method):
    rng = np.random.default_rng(1)
    reps = np.concatenate([rng.normal(3, 1, size=(20, 6)), rng.normal(-3, 1, size=(20, 6))])
    emb = np.stack([np.full(6, 3.0), np.full(6, -3.0)])
    xy, lxy = project_2d(reps, emb, method=method, seed=0)
    assert xy.shape == (40, 2) and lxy.shape == (2, 2)
    assert np.isfinite(xy).all() and np.isfinite(lxy).all()
    xy2, lxy2 = project_2d(reps, emb, method=method, seed=0)
    np.testing.assert_allclose(xy, xy2, atol=1e-6)
    np.testing.assert_allclose(lxy, lxy2, atol=1e-6)


def test_project_2d_rejects_unknown_method():
    with pytest.raises(AclLabError, match="method"):
        project_2d(np.zeros((5, 2)), np.eye(2), method="tsne")


def test_phase_of_splits_steps_in_thirds():
    assert [phase_of(s, 60) for s in (1, 20, 21, 40, 41, 60)] == ["early", "early", "middle", "middle", "late", "late"]
    assert [phase_of(s, 4) for s in (1, 2, 3, 4)] == ["early", "early", "late", "late"]


def _history():
    rows = []
    for seed in (0, 1):
        for step in range(1, 7):
            # SCL: over 90 in the first third only; ACL-Embed: always 60
            rows.append({"objective": "ce", "seed": seed, "step": step, "angle_scl": 100.0 if step <= 2 else 80.0,
                         "cos_scl": 0.0, "angle_acl_embed": 60.0, "cos_acl_embed": 0.5, "loss": 1.0})
    rows[-1].update(angle_scl=float("nan"), cos_scl=float("nan"))  # seed 1, step 6: no SCL angle
    return pd.DataFrame(rows)


def test_conflict_tables():
    long = angle_long_frame(_history())
    assert set(long["probe"]) == {"CE vs SCL", "CE vs ACL-Embed"}
    assert long["angle"].notna().all() and len(long) == 12 + 11  # the NaN angle is left out
    summary = conflict_summary(long).set_index("probe")
    assert summary.loc["CE vs SCL", "frac_over_90_mean"] == pytest.approx((2 / 6 + 2 / 5) / 2)
    assert summary.loc["CE vs ACL-Embed", "frac_over_90_mean"] == 0.0
    assert summary.loc["CE vs ACL-Embed", "median_angle_mean"] == 60.0
    assert summary.loc["CE vs SCL", "seeds"] == 2
    phases = phase_summary(long)
    scl = phases[phases["probe"] == "CE vs SCL"].set_index("phase")
    assert scl.loc["early", "frac_over_90_mean"] == 1.0 and scl.loc["late", "frac_over_90_mean"] == 0.0


def test_conflict_table_text_says_when_one_seed_has_no_spread():
    two = format_conflict_table(conflict_summary(angle_long_frame(_history())))
    fraction = f"fraction of batches > {CONFLICT_DEGREES:g}°"
    sd_scl = np.std([2 / 6, 2 / 5], ddof=1)
    assert two.loc[("ce", "CE vs SCL"), fraction] == f"{(2 / 6 + 2 / 5) / 2:.2f} ± {sd_scl:.2f}"
    one = format_conflict_table(conflict_summary(angle_long_frame(_history().query("seed == 0"))))
    assert one.loc[("ce", "CE vs SCL"), fraction] == f"{2 / 6:.2f} (n=1)"  # not "0.33 ± 0.00"
    assert one.loc[("ce", "CE vs ACL-Embed"), "median angle (°)"] == "60.0 (n=1)"


def test_angle_long_frame_needs_probe_columns():
    with pytest.raises(AclLabError, match="probe_angles"):
        angle_long_frame(pd.DataFrame({"objective": ["ce"], "seed": [0], "step": [1], "loss": [1.0]}))


def test_pick_run_prefers_matching_config(tmp_path):
    from acl_lab.config import TrainConfig
    from acl_lab.result import TrainResult

    base = TrainConfig(task="rt-polarity", model="tiny", max_steps=4)
    runs = [TrainResult(base.replace(objective="acl", lam=0.5), {}, output_dir=tmp_path / "a"),
            TrainResult(base.replace(objective="acl", lam=0.1), {}, output_dir=tmp_path / "b"),
            TrainResult(base.replace(objective="acl", lam=0.1, probe_angles=True), {}, output_dir=tmp_path / "c"),
            TrainResult(base.replace(objective="acl", lam=0.1, max_steps=8), {}, output_dir=tmp_path / "d")]
    assert pick_run(runs, "acl", seed=0, like=base, prefer={"lam": 0.1}).output_dir.name == "b"
    assert pick_run(runs, "acl", seed=0, like=base, prefer={"lam": 0.5}).output_dir.name == "a"
    assert pick_run(runs, "acl", seed=1, like=base) is None
    # without a preference, the run closest to `like` wins (here: same lambda as base, 0.1)
    assert pick_run(runs, "acl", like=base).output_dir.name == "b"
    pooled = runs + [TrainResult(base.replace(objective="acl", lam=0.1, pooling="mean"), {}, output_dir=tmp_path / "0")]
    assert pick_run(pooled, "acl", like=base, prefer={"lam": 0.1}).output_dir.name == "b"
    # require: only runs that have the file (a pack keeps representations for one seed per objective)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "representations.safetensors").write_bytes(b"")
    assert pick_run(runs, "acl", like=base, prefer={"lam": 0.1}, require="representations").output_dir.name == "a"
    assert pick_run(runs, "acl", seed=0, like=base.replace(max_steps=8), require="representations") is None
    assert pick_run(runs, "ce", like=base) is None
