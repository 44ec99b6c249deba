"""The evidence pipeline on the tiny model: every part writes its CSV, the report is rebuilt from files alone."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from acl_lab.errors import AclLabError
from acl_lab.lab.evidence import FILES, PARTS, EvidencePlan, build_report, run_evidence


@pytest.fixture(scope="module")
def evidence(smoke_pack):
    return smoke_pack  # conftest: every part on rt-polarity, 2 seeds, smoke preset; the pack in root / "pack"


def test_every_part_writes_its_table(evidence):
    plan, root = evidence
    res = root / "pack"
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
    assert set(early["objective"]) == {"me-ce", "me-acl-cl"} and set(early["criterion"]) == {"entropy", "patience"}
    assert set(early["batch_size"]) == {64, 1}
    assert (early["batch_size"] == 1).sum() == (early["batch_size"] == 64).sum()  # same settings, both batch sizes
    gate = pd.read_csv(res / FILES["gate"])
    assert sorted(gate["threshold"].unique()) == [60.0, 90.0] and len(gate) == 2 * 2 + 2  # acl at 60/90, ce+scl gated
    assert gate["acl_grad"].all() and gate["drop_rate"].notna().all()
    assert set(pilot["objective"]) == {"ce", "ce+scl"}
    sens = pd.read_csv(res / FILES["sensitivity"])
    assert sorted(sens["lam"].unique()) == [0.1, 1.0] and len(sens) == 2 * 2 * 2


def test_tables_match_the_saved_run_metrics_and_runs_are_shared(evidence):
    plan, root = evidence
    res = root / "pack"
    single = pd.read_csv(res / FILES["single"])
    for row in single.itertuples():
        saved = [json.loads(p.read_text()) for p in (res / "runs").glob(f"{row.objective}-s{row.seed}-*/metrics.json")]
        assert any(m["dev"]["accuracy"] == row.dev_accuracy and m["config"]["lam"] == 0.1 for m in saved)
    # lambda 0.1 of the sensitivity part is the single-exit run itself (same config, same folder): same numbers
    sens = pd.read_csv(res / FILES["sensitivity"])
    a = sens[sens["lam"] == 0.1].set_index(["objective", "seed"])["dev_accuracy"].sort_index()
    b = single[single["objective"].isin(["ce+scl", "acl"])].set_index(["objective", "seed"])["dev_accuracy"].sort_index()
    assert a.equals(b)
    folders = sorted(p.name for p in (root / "home" / "runs").iterdir())
    # pilot (ce, ce+scl), single, gate (acl at 60; acl at 90 is single's; gated ce+scl), multi (early reuses
    # them), sensitivity at lambda 1 only
    assert len(folders) == 4 + 8 + 4 + 6 + 4
    # the pack holds the same runs, without checkpoints; representations for the lowest seed of single/multi only
    assert sorted(p.name for p in (res / "runs").iterdir()) == folders
    assert not list((res / "runs").rglob("checkpoints"))
    reps = sorted((c["objective"], c["seed"], c["probe_angles"]) for c in
                  (json.loads((p.parent / "config.json").read_text()) for p in (res / "runs").rglob("representations.*")))
    assert reps == sorted((o, 0, False) for o in ("ce", "ce+scl", "acl-embed", "acl", "me-ce", "me-acl", "me-acl-cl"))
    from acl_lab.evaluate import load_representations
    dump = load_representations(next((res / "runs").rglob("representations.safetensors")))
    assert all(v.dtype.name == "float32" and len(v) <= 400 for v in dump["reps"].values())


def test_report_is_rebuilt_from_files_alone(evidence):
    plan, root = evidence
    res = root / "pack"
    first = build_report(res).read_text()
    for part in ("Pilot study", "Single-exit", "ACL-Grad where it acts", "Multi-exit", "Early exit", "Sensitivity"):
        assert f"## {part}" in first
    assert "### Single exit: paired differences and verdicts" in first and "acl \u2212 ce+scl:" in first
    figures = sorted(p.name for p in (res / "figures").glob("*.png"))
    import hashlib
    digests = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in (res / "figures").glob("*.png")}
    for name in ("pilot_rt-polarity", "multi_exit_rt-polarity", "early_exit_rt-polarity", "sensitivity_rt-polarity"):
        assert (res / "figures" / f"{name}.png").stat().st_size > 5000
    # without the training runs (checkpoints) the report is the same
    import shutil
    shutil.rmtree(root / "home")
    shutil.rmtree(res / "figures")
    assert build_report(res).read_text() == first
    assert sorted(p.name for p in (res / "figures").glob("*.png")) == figures
    assert {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in (res / "figures").glob("*.png")} == digests


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


def test_sensitivity_table_marks_cells_with_fewer_seeds():
    """A lambda still being run shows how many seeds it has; one seed is not shown as "± 0.000"."""
    from acl_lab.lab.evidence import sensitivity_table

    df = pd.DataFrame({"task": "t", "objective": "acl", "lam": [0.1, 0.1, 0.1, 1.0, 1.0, 3.0],
                       "seed": [0, 1, 2, 0, 1, 0], "dev_accuracy": [0.5, 0.7, 0.9, 0.6, 0.8, 0.4]})
    row = sensitivity_table(df).iloc[0]
    assert row["λ=0.1"] == "0.700 ± 0.200"
    assert row["λ=1"] == "0.700 ± 0.141 (n=2)"
    assert row["λ=3"] == "0.400 (n=1)"
    assert row["seeds"] == 3 and row["range over λ"] == 0.3
