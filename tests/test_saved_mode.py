"""The classroom mode: every notebook with SOURCE=<a pack> draws its figures from the pack alone, trains nothing,
and shows the numbers the library computes from the same pack runs."""
from __future__ import annotations

import json
import math

import nbformat
import pandas as pd
import pytest

from acl_lab.analysis.runs import find_runs, history_frame, per_exit_frame, results_frame
from acl_lab.analysis.stats import summarize
from acl_lab.errors import AclLabError
from acl_lab.lab import plans
from acl_lab.lab.source import open_source

from conftest import NOTEBOOK_TIMEOUT, SMOKE_PACK_COMMAND, kernel_name

pytestmark = pytest.mark.notebooks  # executes every notebook with papermill (saved mode: no training)

CAPTION = f"saved: smoke preset, 2 seeds, command {SMOKE_PACK_COMMAND}"


@pytest.fixture(scope="module")
def saved_suite(smoke_pack, tmp_path_factory):
    """Every notebook with SOURCE=<the fixture pack>, through the suite runner; {stem: (row, metrics)}."""
    import time

    from acl_lab.lab.batch import run_suite

    plan, root = smoke_pack
    out = tmp_path_factory.mktemp("saved_suite")
    t0 = time.perf_counter()
    table = run_suite("smoke", output_dir=out, kernel_name=kernel_name(), resume=False, progress=False,
                      timeout=NOTEBOOK_TIMEOUT, parameters={"SOURCE": str(root / "pack")})
    seconds = time.perf_counter() - t0
    print(f"saved suite: {len(table)} notebooks in {seconds:.1f} s")
    metrics = {}
    for row in table.itertuples():
        path = out / "artifacts" / "smoke" / "metrics" / f"{row.name}.json"
        metrics[row.name] = json.loads(path.read_text()) if path.exists() else None
    return table, metrics, out, root / "pack"


def _text(nb_path) -> str:
    nb = nbformat.read(nb_path, 4)
    return "\n".join(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_every_notebook_runs_saved_without_training(saved_suite):
    table, metrics, out, pack = saved_suite
    failed = table[table["status"] != "completed"]
    assert failed.empty, failed[["name", "error"]].to_string()
    assert len(table) == 8
    assert not (out / "artifacts" / "smoke" / "runs").exists()  # nothing trained into OUTPUT_DIR
    for row in table.itertuples():
        assert CAPTION in _text(out / f"{row.name}.ipynb"), row.name  # every notebook says what its figures show
    assert len(list((out / "figures").glob("*.png"))) >= 12


def test_saved_numbers_are_the_packs(saved_suite, smoke_pack):
    table, metrics, out, pack = saved_suite
    plan, _ = smoke_pack
    # 01: the pilot study's conflict fraction, from the pack's CE runs
    from acl_lab.analysis.gradients import angle_long_frame, conflict_summary
    pilot = find_runs(plans.pilot("smoke", "rt-polarity", seeds=[0, 1]), pack)
    assert len(pilot) == 2
    s = conflict_summary(angle_long_frame(history_frame(pilot))).set_index("probe")
    assert metrics["01_gradient_conflict"]["ce.scl.frac_over_90"] == s.loc["CE vs SCL", "frac_over_90_mean"]
    assert metrics["01_gradient_conflict"]["seeds"] == [0, 1]
    # 02: each objective's mean dev accuracy over the pack's two seeds
    single = results_frame(find_runs(plans.single("smoke", "rt-polarity", seeds=[0, 1]), pack))
    for objective, g in single.groupby("objective"):
        assert metrics["02_acl_finetuning"][f"{objective}.dev_accuracy"] == summarize(g["dev_accuracy"])["mean"]
    # 02: the paired table, as the library computes it from the same pack runs
    from acl_lab.analysis.paired import paired_frame
    runs = find_runs(plans.single("smoke", "rt-polarity", seeds=[0, 1]), pack)
    groups = {o: {r.config.seed: r for r in runs if r.config.objective == o} for o in ("ce", "ce+scl", "acl-embed", "acl")}
    paired = paired_frame(groups, plans.paired_pairs("single", list(groups)), splits=["dev", "test"])
    assert len(paired) == 4 * 2
    for r in paired.itertuples():
        key = f"paired.{r.a}-{r.b}.{r.split}"
        m = metrics["02_acl_finetuning"]
        assert m[f"{key}.seed_verdict"] == r.seed_verdict and m[f"{key}.example_verdict"] == r.example_verdict
        for col in ("seed_mean", "seed_low", "seed_high", "example_mean", "example_low", "example_high"):
            assert m[f"{key}.{col}"] == getattr(r, col) or (math.isnan(m[f"{key}.{col}"]) and math.isnan(getattr(r, col)))
    # 03: the alignment scores of the pack's seed-0 ACL representations
    from acl_lab.analysis.representations import exit_panels
    from acl_lab.evaluate import load_representations
    acl = [r for r in find_runs(plans.single("smoke", "rt-polarity", seeds=[0], objectives=["acl"]), pack)][0]
    scores = exit_panels(load_representations(acl.paths["representations"]), method="pca", seed=0)[-1]["scores"]
    assert math.isclose(metrics["03_label_embedding_umap"]["acl.gap"], scores["gap"], abs_tol=1e-9)
    # 04: the final exit's accuracy per objective
    from acl_lab.analysis.exits import layer_scores
    multi = per_exit_frame(find_runs(plans.multi("smoke", "rt-polarity", seeds=[0, 1]), pack), "dev")
    scores = layer_scores(multi).pivot(index="objective", columns="layer", values="mean")
    for objective in ("me-ce", "me-acl", "me-acl-cl"):
        assert metrics["04_multi_exit_acl_cl"][f"{objective}.final_accuracy"] == float(scores.loc[objective].iloc[-1])
    # 05: the pack's measured early-exit sweep of seed 0 (batch 64), not a new measurement
    early = pd.read_csv(pack / "early_exit.csv")
    e = early[(early["seed"] == 0) & (early["batch_size"] == 64)]
    for objective in ("me-ce", "me-acl-cl"):
        d = e[e["objective"] == objective]
        m = metrics["05_early_exit"]
        assert m[f"{objective}.max_wall_speedup"] == float(d["wall_speedup"].max())
        assert m[f"{objective}.full_accuracy"] == float(d["full_accuracy"].iloc[0])
    # 06: the lambda grid of the pack, no grid run
    sens = pd.read_csv(pack / "sensitivity.csv")
    m = metrics["06_sensitivity"]
    assert m["lambdas"] == [0.1, 1.0] and m["runs"] == 0
    for (objective, lam), g in sens.groupby(["objective", "lam"]):
        assert m[f"{objective}.tau0.1.lam{lam:g}.dev_accuracy"] == pytest.approx(g["dev_accuracy"].mean(), abs=1e-12)
    # 07: the gate explorer reads the pack's pilot runs; the sensitivity explorer the pack's ce+scl/acl runs
    m = metrics["07_classroom_widgets"]
    assert m["gate.source"] == "pilot study (notebook 01)" and m["live.trained"] is False
    from acl_lab.analysis.runs import saved_runs
    every = results_frame(saved_runs(pack))
    assert m["sensitivity.runs"] == int(every["objective"].isin(["ce+scl", "acl"]).sum()) > 0
    assert metrics["00_tour"]["train_size"] == 64


def test_missing_runs_name_the_runs_and_the_command(smoke_pack):
    plan, root = smoke_pack
    src = open_source(str(root / "pack"), "quick", root / "out")
    assert src.preset == "smoke" and src.seeds(None, "single") == [0, 1] and src.lambdas == [0.1, 1.0]
    configs = plans.single("smoke", "rt-3way", seeds=[0], objectives=["ce"])
    from acl_lab.analysis.runs import run_name
    with pytest.raises(AclLabError) as err:
        src.runs(configs, "single")
    assert run_name(configs[0]) in str(err.value) and "python -m acl_lab evidence" in str(err.value)
    assert "--tasks rt-3way --parts single" in str(err.value)
    # a partial pack: the runs that are in, and a warning naming the missing one
    present = plans.single("smoke", "rt-polarity", seeds=[0], objectives=["ce"])
    with pytest.warns(UserWarning, match="A partial pack.*holds 1 of the 2 runs.*" + run_name(configs[0])):
        got = src.runs(present + configs, "single")
    assert [run_name(r.config) for r in got] == [run_name(present[0])]
    with pytest.warns(UserWarning, match="A partial pack.*holds 1 of the 2 runs"):  # find reads a partial pack too
        assert [run_name(r.config) for r in src.find(present + configs, "single")] == [run_name(present[0])]
    with pytest.raises(AclLabError, match=run_name(configs[0])):
        src.find(present + configs, "single", strict=True)
    with pytest.raises(AclLabError, match="no results pack"):
        open_source(str(root / "nowhere"), "quick", root / "out")
    assert open_source("live", "quick", root / "out").caption([0, 1]) == "live: quick preset, 2 seeds"
