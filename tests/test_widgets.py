"""Classroom widgets: the pure functions behind them, and that moving a control changes what they show."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest

from acl_lab.analysis import runs as R
from acl_lab.lab import live as L
from acl_lab.viz import widgets as W
from acl_lab.errors import AclLabError


@pytest.fixture
def history() -> pd.DataFrame:
    """Two runs' angle traces: run a mostly below 90 degrees, run b mostly above."""
    return pd.DataFrame({
        "step": list(range(1, 9)) * 2,
        "objective": ["acl"] * 8 + ["ce+scl"] * 8,
        "angle": [40, 60, 80, 85, 88, 92, 95, 100] + [None] * 8,
        "angle_scl": [None] * 8 + [70, 91, 93, 95, 97, 99, 120, 130],
    })


@pytest.fixture
def results() -> pd.DataFrame:
    """A results_frame-like table: CE+SCL and ACL at two lambdas and two seeds, one CE run."""
    rows = []
    for obj, lam, seed, acc in [("ce+scl", 0.1, 0, 0.80), ("ce+scl", 0.1, 1, 0.82), ("ce+scl", 1.0, 0, 0.70),
                                ("ce+scl", 1.0, 1, 0.72), ("acl", 0.1, 0, 0.81), ("acl", 0.1, 1, 0.83),
                                ("acl", 1.0, 0, 0.80), ("acl", 1.0, 1, 0.80), ("ce", 0.1, 0, 0.79)]:
        rows.append({"objective": obj, "lam": lam, "temperature": 0.1, "seed": seed, "dev_accuracy": acc})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------
# gate explorer
# ---------------------------------------------------------------------------

def test_drop_fraction_counts_angles_strictly_above_the_threshold():
    angles = [10.0, 80.0, 90.0, 95.0, 100.0, float("nan"), None]
    assert W.drop_fraction(angles, 90) == pytest.approx(2 / 5)
    assert W.drop_fraction(angles, 0) == 1.0
    assert W.drop_fraction(angles, 180) == 0.0
    assert math.isnan(W.drop_fraction([], 90))
    assert math.isnan(W.drop_fraction([None, float("nan")], 90))


def test_drop_fraction_never_rises_with_the_threshold():
    rng = np.random.default_rng(0)
    angles = rng.uniform(0, 180, 200)
    fractions = [W.drop_fraction(angles, t) for t in range(0, 181, 5)]
    assert all(a >= b for a, b in zip(fractions, fractions[1:]))


def test_gate_summary_and_text():
    s = W.gate_summary([40, 60, 95, 100], 90)
    assert (s["batches"], s["dropped"], s["kept"]) == (4, 2, 2)
    assert s["drop_fraction"] == 0.5 and s["median_angle"] == pytest.approx(77.5)
    assert "50.0%" in W.gate_text(s) and "90°" in W.gate_text(s)
    assert "no angles" in W.gate_text(W.gate_summary([], 90))


def test_angle_columns_lists_only_filled_columns(history):
    assert W.angle_columns(history) == ["angle", "angle_scl"]
    assert W.angle_columns(history.drop(columns=["angle"])) == ["angle_scl"]


def test_gate_explorer_text_follows_the_slider(history):
    box = W.gate_explorer(history, threshold=90, by="objective")
    assert "acl-result" in box.result._dom_classes
    before = box.result.value
    assert "37.5%" in before and "(3 of 8)" in before  # 92, 95, 100 of run a's 8 angles
    png = box.image.value
    assert png[:4] == b"\x89PNG"
    box.slider.value = 50
    assert box.result.value != before
    assert "87.5%" in box.result.value  # all but 40
    assert box.image.value != png
    box.slider.value = 180
    assert "0.0%" in box.result.value


def test_gate_explorer_column_and_group_controls(history):
    box = W.gate_explorer(history, column="angle_scl", threshold=90)
    assert box.column.value == "angle_scl"
    assert "(7 of 8)" in box.result.value
    box.column.value = "angle"
    assert "(3 of 8)" in box.result.value
    box.group.value = "ce+scl"  # run b has no 'angle' values
    assert "no angles" in box.result.value


def test_gate_explorer_refuses_a_table_without_angles():
    with pytest.raises(AclLabError, match="angle column"):
        W.gate_explorer(pd.DataFrame({"step": [1, 2], "loss": [0.5, 0.4]}))


# ---------------------------------------------------------------------------
# sensitivity explorer
# ---------------------------------------------------------------------------

def test_sensitivity_at_mean_sd_and_count(results):
    t = W.sensitivity_at(results, 1.0, 0.1, "dev_accuracy")
    assert list(t.index) == ["ce+scl", "acl"]
    assert t.loc["ce+scl", "mean"] == pytest.approx(0.71)
    assert t.loc["ce+scl", "sd"] == pytest.approx(np.std([0.70, 0.72], ddof=1))
    assert t.loc["acl", "n"] == 2 and t.loc["acl", "sd"] == 0.0
    missing = W.sensitivity_at(results, 0.5, 0.1, "dev_accuracy")
    assert (missing["n"] == 0).all() and missing["mean"].isna().all()


def test_sensitivity_explorer_text_follows_the_lambda(results):
    box = W.sensitivity_explorer(results)
    assert "acl-result" in box.result._dom_classes
    first = box.result.value
    assert "λ = <b>0.1</b>" in first and "0.8100" in first and "0.8200" in first
    box.lam.value = 1.0
    assert box.result.value != first
    assert "0.7100" in box.result.value and "+0.0900" in box.result.value
    assert box.image.value[:4] == b"\x89PNG"


def test_sensitivity_explorer_needs_the_objectives(results):
    with pytest.raises(AclLabError, match="no runs"):
        W.sensitivity_explorer(results[results["objective"] == "ce"])


# ---------------------------------------------------------------------------
# live run
# ---------------------------------------------------------------------------

def test_live_config_rounds_like_the_sliders(tiny_config):
    cfg = L.live_config(tiny_config, 0.1 + 1e-12, 0.1000001, 89.99, max_steps=3)
    assert (cfg.objective, cfg.lam, cfg.temperature, cfg.threshold, cfg.max_steps) == ("acl", 0.1, 0.1, 90.0, 3)
    assert cfg.task == tiny_config.task and cfg.model == tiny_config.model
    with pytest.raises(AclLabError):
        L.live_config(tiny_config, 0.1, 0.1, 200)


def test_train_live_and_run_summary(tiny_config, tmp_path):
    res = L.train_live(tiny_config, tmp_path / "live", 0.5, 0.2, 90, max_steps=3)
    s = W.run_summary(res)
    assert (s["objective"], s["lam"], s["temperature"], s["steps"]) == ("acl", 0.5, 0.2, 3)
    assert 0.0 <= s["dev"] <= 1.0 and 0.0 <= s["drop_rate"] <= 1.0 and 0.0 <= s["median_angle"] <= 180.0
    assert math.isnan(s["test"])  # the toy task has no test split
    assert "dropped" in W.summary_text(s)
    again = L.train_live(tiny_config, tmp_path / "live", 0.5, 0.2, 90, max_steps=3)  # read back, not retrained
    assert again.output_dir == res.output_dir and again.metrics == res.metrics


def test_live_run_button_trains_and_shows_the_result(tiny_config, tmp_path):
    box = L.live_run(tiny_config, tmp_path / "live", max_steps=3)
    assert "acl-result" in box.result._dom_classes and box.last is None
    before = box.result.value
    box.lam.value, box.tau.value, box.threshold.value = 0.3, 0.25, 120
    box.button.click()
    assert box.result.value != before and "dev accuracy" in box.result.value
    assert box.last["threshold"] == 120 and box.last["steps"] == 3 and 0 <= box.last["dev"] <= 1
    assert box.image.value[:4] == b"\x89PNG"
    assert not box.button.disabled
    first = box.result.value
    box.threshold.value = 0  # every batch is dropped: a new run
    box.button.click()
    assert box.result.value != first and box.last["drop_rate"] == 1.0


def test_live_run_shows_an_error_instead_of_raising(tiny_config, tmp_path):
    box = L.live_run(tiny_config.replace(task="no-such-task"), tmp_path / "live", max_steps=2)
    box.button.click()
    assert "error" in box.result.value and not box.button.disabled


def test_saved_runs_counts_a_run_made_twice_once(tiny_config, tmp_path):
    res = L.train_live(tiny_config, tmp_path / "a", 0.1, 0.1, 90, max_steps=2)
    copy = tmp_path / "a" / "batch" / "artifacts" / "x" / "runs" / res.output_dir.name
    shutil.copytree(res.output_dir, copy)
    runs = R.saved_runs(tmp_path / "a")
    assert len(runs) == 1 and runs[0].output_dir == res.output_dir
    assert R.saved_runs(tmp_path / "nothing-here") == []
