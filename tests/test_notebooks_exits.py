"""Notebooks 04-07 (multi-exit, early exit, sensitivity, widgets) in the smoke preset, and the helpers they call.

The notebook tests read back what each executed notebook recorded with
``record_metrics`` (the session-wide ``executed_suite`` runs every notebook once, in
order, into one OUTPUT_DIR) and check the figures it saved.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from acl_lab.analysis import exits as X
from acl_lab.analysis import runs as R
from acl_lab.analysis import sensitivity as S
from acl_lab.viz import plots as P
from acl_lab.errors import AclLabError
from acl_lab.lab import plans
from acl_lab.viz import widgets as W

from conftest import notebook_result

MULTI_EXIT = ("me-ce", "me-acl", "me-acl-cl")


def _out(rec: dict) -> Path:
    return Path(rec["output_dir"]) / "smoke"


def _png(rec: dict, name: str) -> Path:
    path = _out(rec) / "figures" / f"{name}.png"
    assert path.is_file() and path.stat().st_size > 1000, f"missing or empty figure {path}"
    assert path.read_bytes()[:4] == b"\x89PNG"
    return path


# ---------------------------------------------------------------------------
# the notebooks executed (smoke preset)
# ---------------------------------------------------------------------------

def test_04_multi_exit_records_per_exit_scores(executed_suite):
    rec = notebook_result(executed_suite, "04_multi_exit_acl_cl")
    m = rec["metrics"]
    metric, k = m["metric"], m["num_exits"]
    assert m["model"] == "tiny" and k == 4 and m["objectives"] == list(MULTI_EXIT)
    for objective in MULTI_EXIT:
        exits = [m[f"{objective}.exit{layer}_{metric}"] for layer in range(1, k + 1)]
        assert all(0.0 <= v <= 1.0 for v in exits)
        assert m[f"{objective}.final_{metric}"] == pytest.approx(exits[-1])
        assert m[f"{objective}.shallow_mean_{metric}"] == pytest.approx(sum(exits[: k // 2]) / (k // 2))
        assert 0 <= m[f"{objective}.exits_like_constant"] <= k
    assert 0.5 <= m["majority_rate"] <= 1.0
    _png(rec, "04_layer_scores")
    # the recorded exit scores are the library's layer_scores on the runs the notebook trained
    runs = R.find_runs(plans.multi("smoke", m["task"], seeds=m["seeds"]), _out(rec))
    assert len(runs) == len(MULTI_EXIT) * len(m["seeds"])
    scores = X.layer_scores(R.per_exit_frame(runs, "dev"), metric)
    for row in scores.itertuples():
        assert m[f"{row.objective}.exit{row.layer}_{metric}"] == row.mean


def test_05_early_exit_records_speedups(executed_suite):
    rec = notebook_result(executed_suite, "05_early_exit")
    m = rec["metrics"]
    metric = m["metric"]
    assert m["settings"] > 0
    for objective in ("me-ce", "me-acl-cl"):
        assert 0.0 <= m[f"{objective}.full_{metric}"] <= 1.0
        assert 0.0 <= m[f"{objective}.min_{metric}"] <= 1.0
        assert m[f"{objective}.min_wall_speedup"] > 0
        assert m[f"{objective}.best_wall_speedup"] >= 1.0  # the full model (1.0) always qualifies
        assert m[f"{objective}.best_layer_speedup"] >= 1.0
        assert 1.0 <= m[f"{objective}.max_layer_speedup"] <= 4.0  # tiny model: 4 layers
        assert m[f"{objective}.best_{metric}"] >= m[f"{objective}.full_{metric}"] - m["max_drop"] - 1e-9
    _png(rec, "05_early_exit")


def test_06_sensitivity_has_both_objectives_at_every_lambda(executed_suite):
    rec = notebook_result(executed_suite, "06_sensitivity")
    m = rec["metrics"]
    assert len(m["lambdas"]) == 2 and m["failed"] == 0 and m["runs"] == 2
    for objective in ("ce+scl", "acl"):
        assert m[f"{objective}.points"] == 2
        values = [v for key, v in m.items() if key.startswith(f"{objective}.tau") and key.endswith("dev_accuracy")]
        assert len(values) == 2 and all(0.0 <= v <= 1.0 for v in values)
        assert 0.0 <= m[f"{objective}.range_over_lambda"] <= 1.0
    grid = plans.sensitivity("smoke", "rt-polarity", seeds=m["seeds"], lambdas=m["lambdas"],
                             temperatures=m["temperatures"])
    runs = R.find_runs(grid, _out(rec))
    assert len(runs) == len(grid) == 4  # 2 lambdas x 2 objectives x 1 seed, found by config in the shared cache
    summary = S.sensitivity_summary(S.sensitivity_frame(R.results_frame(runs), ["ce+scl", "acl"]),
                                    extra=("temperature",))
    for row in summary.itertuples():
        assert m[f"{row.objective}.tau{row.temperature:g}.lam{row.lam:g}.dev_accuracy"] == row.mean
    results = pd.read_csv(_out(rec) / "sensitivity" / "results.csv")
    assert len(results) == 2 and set(results["status"]) <= {"completed", "skipped"}
    _png(rec, "06_sensitivity_lambda")


def test_07_widgets_record_gate_and_live_numbers(executed_suite):
    rec = notebook_result(executed_suite, "07_classroom_widgets")
    m = rec["metrics"]
    assert m["gate.batches"] > 0 and 0.0 <= m["gate.drop_fraction"] <= 1.0
    assert 0.0 <= m["gate.median_angle"] <= 180.0
    assert m["live.trained"] is True and 0.0 <= m["live.dev_accuracy"] <= 1.0 and m["live.steps"] == 4
    assert 0.0 <= m["live.drop_rate"] <= 1.0
    assert m["sensitivity.runs"] > 0  # CE+SCL / ACL runs of notebooks 02 and 06 were found
    # the explorer's number is drop_fraction over the same saved trace (the pilot runs of notebook 01)
    pilot = [r for r in R.load_runs(_out(rec)) if r.config.probe_angles]
    history = R.history_frame(pilot)
    assert m["gate.source"].startswith("pilot study") and m["gate.batches"] == int(history[m["gate.column"]].notna().sum())
    assert m["gate.drop_fraction"] == W.drop_fraction(history[m["gate.column"]], m["gate.threshold"])
    _png(rec, "07_gate_drop_curve")
    _png(rec, "07_live_trace")


# ---------------------------------------------------------------------------
# helpers of acl_lab.analysis and acl_lab.viz (no notebook needed)
# ---------------------------------------------------------------------------

@pytest.fixture
def per_exit() -> pd.DataFrame:
    rows = []
    for objective, base in (("me-ce", 0.6), ("me-acl-cl", 0.7)):
        for seed in (0, 1):
            for layer in (1, 2, 3, 4):
                rows.append({"objective": objective, "seed": seed, "layer": layer,
                             "accuracy": base + 0.05 * layer + 0.01 * seed})
    return pd.DataFrame(rows)


def test_majority_rate():
    assert X.majority_rate([0, 1, 1, 1]) == 0.75
    assert math.isnan(X.majority_rate([]))


def test_shallow_and_final(per_exit):
    h = X.shallow_and_final(per_exit)
    assert list(h.index) == ["me-ce", "me-acl-cl"]
    assert h.loc["me-ce", "shallow_layers"] == [1, 2]
    assert h.loc["me-ce", "shallow_mean"] == pytest.approx(0.6 + 0.075 + 0.005)
    assert h.loc["me-acl-cl", "final"] == pytest.approx(0.9 + 0.005)
    assert h.loc["me-ce", "final_sd"] == pytest.approx(0.01 / math.sqrt(2))
    assert h.loc["me-ce", "seeds"] == 2


def test_layer_table_and_plot(per_exit):
    t = X.per_exit_table(per_exit)
    assert list(t.columns) == ["layer 1", "layer 2", "layer 3", "layer 4", "seeds"]
    assert t.loc["me-ce", "layer 1"].startswith("0.655")
    fig = P.plot_layer_scores(per_exit)
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title() and len(ax.lines) == 2
    with pytest.raises(AclLabError, match="needs"):
        X.layer_scores(per_exit.iloc[0:0])


def _sweep_rows() -> pd.DataFrame:
    rows = []
    for objective, full in (("me-ce", 0.80), ("me-acl-cl", 0.82)):
        for thr, acc, layer_sp, wall in ((0.1, full, 1.0, 1.3), (0.3, full - 0.005, 1.5, 1.2),
                                         (0.5, full - 0.02, 2.0, 1.6)):
            rows.append({"objective": objective, "criterion": "entropy", "threshold": thr, "accuracy": acc,
                         "full_accuracy": full, "quality_drop": full - acc, "layer_speedup": layer_sp,
                         "wall_speedup": wall})
    return pd.DataFrame(rows)


def test_best_speedup_within_one_point():
    best = X.best_speedup(_sweep_rows(), max_drop=0.01)
    # 0.1 keeps every sample to the last layer (its 1.3x is noise), 0.5 loses 2 points: 0.3 wins
    assert best.loc["me-ce", "threshold"] == 0.3 and best.loc["me-ce", "wall_speedup"] == 1.2
    assert best.loc["me-ce", "layer_speedup"] == 1.5
    none = X.best_speedup(_sweep_rows(), max_drop=0.001)
    assert (none["criterion"] == "full model").all() and (none["wall_speedup"] == 1.0).all()
    slower = _sweep_rows().assign(wall_speedup=0.9)  # early exit that is slower than the full model never wins
    assert (X.best_speedup(slower)["criterion"] == "full model").all()


def test_plot_early_exit_has_both_panels():
    fig = P.plot_early_exit(_sweep_rows())
    a, b = fig.axes
    assert "wall-clock" in a.get_xlabel() and "layer" in b.get_xlabel() and a.get_ylabel()
    assert a.get_title() and b.get_title()


def test_sensitivity_frame_from_saved_runs():
    runs = pd.DataFrame({"objective": ["acl", "ce+scl", "acl", "ce+scl", "ce"], "lam": [0.1, 0.1, 1.0, 1.0, 0.1],
                         "temperature": [0.1] * 5, "seed": [0, 0, 1, 1, 0],
                         "dev_accuracy": [0.8, 0.75, 0.7, 0.6, 0.9], "run": list("abcde")})
    long = S.sensitivity_frame(runs, ["ce+scl", "acl"])
    assert len(long) == 4 and set(long["lam"]) == {0.1, 1.0} and set(long["seed"]) == {0, 1}
    assert long.set_index(["objective", "lam"]).loc[("acl", 1.0), "value"] == 0.7
    assert list(dict.fromkeys(long["objective"])) == ["ce+scl", "acl"]  # in the order asked for
    s = S.sensitivity_summary(long)
    spread = S.sensitivity_spread(s)
    assert abs(spread.loc["ce+scl", "range_over_lambda"] - 0.15) < 1e-12
    fig = P.plot_sensitivity(long)
    assert fig.axes[0].get_xlabel().startswith("lambda") and fig.axes[0].get_ylabel()
    with pytest.raises(AclLabError, match="dev_f1"):
        S.sensitivity_frame(runs, ["acl"], metric="f1")


def test_sensitivity_one_seed_cells_show_no_spread():
    # acl at lambda 0.1 has two seeds (sd 0.014); every other cell has one seed, whose spread is unknown
    long = pd.DataFrame({"objective": ["acl", "acl", "acl", "ce+scl", "ce+scl"], "lam": [0.1, 0.1, 1.0, 0.1, 1.0],
                         "seed": [0, 1, 0, 0, 0], "value": [0.80, 0.78, 0.70, 0.75, 0.60]})
    spread = S.sensitivity_spread(S.sensitivity_summary(long))
    assert abs(spread.loc["acl", "mean_sd_over_seeds"] - np.std([0.80, 0.78], ddof=1)) < 1e-12  # not halved by a 0
    assert np.isnan(spread.loc["ce+scl", "mean_sd_over_seeds"])
    ax = P.plot_sensitivity(long).axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("n=1") == 3
    bars = [seg for coll in ax.collections for seg in coll.get_segments()
            if len(seg) == 2 and np.isfinite(seg).all() and abs(seg[1][1] - seg[0][1]) > 0]
    assert len(bars) == 1 and abs(abs(bars[0][1][1] - bars[0][0][1]) - 2 * np.std([0.80, 0.78], ddof=1)) < 1e-9
