"""The evidence pipeline on the tiny model: every part writes its CSV, the report is rebuilt from files alone."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from acl_lab.errors import AclLabError
from acl_lab.lab.evidence import FILES, PARTS, EvidencePlan, build_report, run_evidence


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    plan = EvidencePlan(tasks=["rt-polarity"], seeds=[0, 1], preset="smoke", lambdas=[0.1, 1.0],
                        exit_settings={"entropy": [0.5, 0.9]})
    run_evidence(plan, root / "home", root / "results", progress=False)
    return plan, root


def test_every_part_writes_its_table(evidence):
    plan, root = evidence
    res = root / "results"
    pilot = pd.read_csv(res / FILES["pilot"])
    assert set(pilot["probe"]) == {"CE vs SCL", "CE vs ACL-Embed"} and set(pilot["seed"]) == {0, 1}
    assert pilot["angle"].between(0, 180).all()
    single = pd.read_csv(res / FILES["single"])
    assert sorted(single["objective"].unique()) == sorted(["ce", "ce+scl", "acl-embed", "acl"])
    assert len(single) == 4 * 2 and set(single["task"]) == {"rt-polarity"}
    assert single.loc[single["objective"] == "acl", "drop_rate"].notna().all()
    multi = pd.read_csv(res / FILES["multi"])
    assert set(multi["split"]) == {"dev", "test"} and set(multi["objective"]) == {"me-ce", "me-acl", "me-acl-cl"}
    assert len(multi) == 3 * 2 * 2 * multi["layer"].nunique()
    early = pd.read_csv(res / FILES["early"])
    assert set(early["objective"]) == {"me-ce", "me-acl-cl"} and set(early["criterion"]) == {"entropy"}
    sens = pd.read_csv(res / FILES["sensitivity"])
    assert sorted(sens["lam"].unique()) == [0.1, 1.0] and len(sens) == 2 * 2 * 2


def test_tables_match_the_saved_run_metrics_and_runs_are_shared(evidence):
    plan, root = evidence
    res = root / "results"
    single = pd.read_csv(res / FILES["single"])
    for row in single.itertuples():
        saved = [json.loads(p.read_text()) for p in (res / "run_metrics" / "rt-polarity").glob(f"{row.objective}-s{row.seed}-*.json")]
        assert any(m["dev"]["accuracy"] == row.dev_accuracy and m["config"]["lam"] == 0.1 for m in saved)
    # lambda 0.1 of the sensitivity part is the single-exit run itself (same config, same folder): same numbers
    sens = pd.read_csv(res / FILES["sensitivity"])
    a = sens[sens["lam"] == 0.1].set_index(["objective", "seed"])["dev_accuracy"].sort_index()
    b = single[single["objective"].isin(["ce+scl", "acl"])].set_index(["objective", "seed"])["dev_accuracy"].sort_index()
    assert a.equals(b)
    folders = list((root / "home" / "runs").iterdir())
    assert len(folders) == 2 + 8 + 6 + 4  # pilot, single, multi (early reuses them), sensitivity at lambda 1 only


def test_report_is_rebuilt_from_files_alone(evidence):
    plan, root = evidence
    res = root / "results"
    first = build_report(res).read_text()
    for part in ("Pilot study", "Single-exit", "Multi-exit", "Early exit", "Sensitivity"):
        assert f"## {part}" in first
    for name in ("pilot_rt-polarity", "multi_exit_rt-polarity", "early_exit_rt-polarity", "sensitivity_rt-polarity"):
        assert (res / "figures" / f"{name}.png").stat().st_size > 5000
    # without the training runs (checkpoints) the report is the same
    import shutil
    shutil.rmtree(root / "home")
    shutil.rmtree(res / "figures")
    assert build_report(res).read_text() == first
    assert (res / "figures" / "pilot_rt-polarity.png").exists()


def test_single_table_is_mean_and_sd_over_seeds(evidence):
    from acl_lab.lab.evidence import single_table

    df = pd.DataFrame({"task": "t", "objective": "ce", "seed": [0, 1, 2], "dev_accuracy": [0.5, 0.7, 0.9],
                       "test_accuracy": [0.6, 0.6, 0.6], "drop_rate": [None] * 3})
    row = single_table(df).iloc[0]
    assert row["dev accuracy"] == "0.700 ± 0.200" and row["test accuracy"] == "0.600 ± 0.000"
    assert row["ACL-Grad drop rate"] == "-" and row["seeds"] == 3


def test_bad_part_and_empty_folder_are_clear_errors(tmp_path):
    with pytest.raises(AclLabError, match="Unknown evidence part"):
        run_evidence(EvidencePlan(), tmp_path / "h", tmp_path / "r", parts=["pilot", "speed"])
    with pytest.raises(AclLabError, match="python -m acl_lab evidence"):
        build_report(tmp_path)
    assert PARTS[0] == "pilot"
