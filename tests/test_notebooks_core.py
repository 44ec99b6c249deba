"""The core notebooks (01 pilot study, 02 objective comparison, 03 label-embedding pictures) in the smoke preset,
checked through the metrics and figures they leave in OUTPUT_DIR; and the hygiene of every notebook."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import nbformat
import pytest

from acl_lab.analysis import gradients as G
from acl_lab.analysis import runs as R
from acl_lab.analysis.representations import alignment_score
from acl_lab.analysis.stats import summarize
from acl_lab.evaluate import load_representations
from acl_lab.lab import plans

from conftest import NOTEBOOKS, notebook_result

ALL_NOTEBOOKS = sorted(NOTEBOOKS.glob("*.ipynb"))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _figures(rec: dict, *names: str) -> None:
    folder = Path(rec["output_dir"]) / "smoke" / "figures"
    for name in names:
        path = folder / f"{name}.png"
        assert path.is_file() and path.stat().st_size > 1000, f"missing or empty figure {path}"


# ---------------------------------------------------------------------------
# executed in the smoke preset
# ---------------------------------------------------------------------------

@pytest.mark.notebooks
def test_01_gradient_conflict(executed_suite):
    rec = notebook_result(executed_suite, "01_gradient_conflict")
    m = rec["metrics"]
    assert m["preset"] == "smoke" and m["steps"] > 0 and len(m["seeds"]) >= 1
    for probe in ("scl", "acl_embed"):
        for phase in ("", ".early", ".late"):
            key = f"ce.{probe}{phase}"
            assert 0.0 <= m[f"{key}.frac_over_90"] <= 1.0, key
            assert 0.0 <= m[f"{key}.median_angle"] <= 180.0, key
        assert 0.0 <= m[f"ce.{probe}.mean_angle"] <= 180.0
        assert m[f"ce.{probe}.frac_over_90_sd"] >= 0.0
    _figures(rec, "01_angle_histograms", "01_angle_vs_step", "01_angle_by_phase")
    # the recorded numbers are the library's own, on the runs the notebook left behind
    runs = R.find_runs(plans.pilot("smoke", m["task"], seeds=m["seeds"]), Path(rec["output_dir"]) / "smoke")
    assert len(runs) == len(m["seeds"])
    summary = G.conflict_summary(G.angle_long_frame(R.history_frame(runs)))
    for row in summary.itertuples():
        key = f"{row.objective}.{G.PROBES_KEYS[row.probe]}"
        assert m[f"{key}.frac_over_90"] == row.frac_over_90_mean and m[f"{key}.median_angle"] == row.median_angle_mean


@pytest.mark.notebooks
def test_02_acl_finetuning(executed_suite):
    rec = notebook_result(executed_suite, "02_acl_finetuning")
    m = rec["metrics"]
    assert m["lambda"] == 0.1 and m["temperature"] == 0.1 and m["main_metric"] == "accuracy"
    objectives = ["ce", "ce+scl", "acl-embed", "acl"]
    assert m["objectives"] == objectives
    for objective in objectives:
        for split in ("dev", "test"):
            value = m[f"{objective}.{split}_accuracy"]
            assert _finite(value) and 0.0 <= value <= 1.0, (objective, split, value)
            assert _finite(m[f"{objective}.{split}_accuracy_sd"])
    for objective in ("ce", "ce+scl", "acl-embed"):
        assert m[f"{objective}.drop_rate"] is None  # no ACL-Grad gate
    assert 0.0 <= m["acl.drop_rate"] <= 1.0
    _figures(rec, "02_comparison", "02_training_curves", "02_acl_grad_gate")
    runs = R.find_runs(plans.single("smoke", m["task"], seeds=m["seeds"], lam=m["lambda"],
                                    temperature=m["temperature"]), Path(rec["output_dir"]) / "smoke")
    table = R.results_frame(runs)
    assert len(table) == len(objectives) * len(m["seeds"])
    for objective, g in table.groupby("objective"):
        for split in ("dev", "test"):
            s = summarize(g[f"{split}_accuracy"])
            assert math.isclose(m[f"{objective}.{split}_accuracy"], s["mean"], rel_tol=1e-12)
            assert math.isclose(m[f"{objective}.{split}_accuracy_sd"], s["sd"], rel_tol=1e-12, abs_tol=1e-15)
    acl_rates = table.loc[table["objective"] == "acl", "drop_rate"]
    assert math.isclose(m["acl.drop_rate"], summarize(acl_rates)["mean"], rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.notebooks
def test_03_label_embedding_umap(executed_suite):
    rec = notebook_result(executed_suite, "03_label_embedding_umap")
    m = rec["metrics"]
    assert m["method"] == "pca"  # the smoke preset never pays for UMAP's compilation
    for objective in ("ce", "acl"):
        assert _finite(m[f"{objective}.gap"])
        assert m[f"{objective}.gap"] == pytest.approx(m[f"{objective}.own_cos"] - m[f"{objective}.other_cos"])
        assert -1.0 <= m[f"{objective}.own_cos"] <= 1.0 and -1.0 <= m[f"{objective}.other_cos"] <= 1.0
        assert 0.0 <= m[f"{objective}.nearest_own"] <= 1.0
    _figures(rec, "03_embedding_ce_vs_acl")
    like = plans.single("smoke", m["task"], lam=m["lambda"])[0]
    saved = R.load_runs(Path(rec["output_dir"]) / "smoke")
    for objective in ("ce", "acl"):
        run = R.pick_run(saved, objective, seed=m["seed"], like=like, prefer={"lam": m["lambda"]})
        dump = load_representations(run.paths["representations"])
        last = dump["layers"][-1]
        own = alignment_score(dump["reps"][last], dump["labels"], dump["label_embeddings"][last])
        assert m[f"{objective}.gap"] == own["gap"] and m[f"{objective}.nearest_own"] == own["nearest_own"]
    if m["multi_exit_shown"]:  # notebook 04's runs were there when 03 ran
        assert any(k.endswith(".gap") and ".L" in k for k in m)
        _figures(rec, "03_embedding_per_exit", "03_alignment_per_exit")


# ---------------------------------------------------------------------------
# hygiene of every notebook (no execution needed)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_hygiene(path):
    """Committed without outputs; a markdown title first; exactly one `parameters` cell of `NAME = literal` lines,
    all of which papermill can see; a numbered notebook records its headline metrics under its own name."""
    import papermill as pm

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        assert cell.outputs == [], f"{path.name} code cell {i} has outputs; clear them before committing"
        assert cell.execution_count is None, f"{path.name} code cell {i} has an execution count"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), f"{path.name}: no title"
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters', expected exactly one"
    cell = tagged[0]
    assert cell.cell_type == "code"
    names = []
    for node in ast.parse(cell.source).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name), \
            f"{path.name}: the parameters cell may hold only `NAME = literal` lines, found {ast.dump(node)[:80]}"
        ast.literal_eval(node.value)  # raises if the value is not a literal
        names.append(node.targets[0].id)
    assert len(names) == len(set(names)), f"{path.name}: a parameter is assigned twice"
    # a comment with '=' in it would hide a parameter from papermill (and from the batch runner's checks)
    assert set(pm.inspect_notebook(str(path))) == set(names), f"{path.name}: papermill sees other parameters"
    if path.stem[:2].isdigit():  # the numbered suite shares these, and reports through record_metrics
        shared = {"PRESET", "TASK", "MODEL", "SEEDS", "OUTPUT_DIR"}
        # every notebook but 08 (the Hugging Face Trainer drop-in trains live: there is nothing of it in a pack)
        # can read the results pack instead of training
        assert shared | ({"SOURCE"} if path.stem != "08_hf_trainer" else set()) <= set(names), path.name
        assert f'record_metrics(OUT, "{path.stem}"' in "".join(c.source for c in code), path.name


def test_acl_finetuning_declares_the_batch_parameters():
    nb = nbformat.read(NOTEBOOKS / "02_acl_finetuning.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    values = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body}
    assert values["OBJECTIVES"] == ["ce", "ce+scl", "acl-embed", "acl"]
    assert values["LAMBDA"] == 0.1 and values["TEMPERATURE"] == 0.1
    assert {"PRESET", "TASK", "MODEL", "SEEDS", "OUTPUT_DIR"} <= set(values)
