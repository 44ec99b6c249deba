"""The papermill batch runner: grids, failures, resume, results tables, suite, CLI, and grid validation.

The notebooks are tiny ones written here (no torch), so each execution costs only a
kernel start; the file executes five of them in all.
"""
from __future__ import annotations

import nbformat
import pandas as pd
import pytest
import yaml
from conftest import kernel_name

from acl_lab.lab import batch
from acl_lab.cli import main
from acl_lab.errors import AclLabError

BODY = """\
import json, pathlib
if FAIL:
    raise RuntimeError("boom: FAIL was set")
out = pathlib.Path(OUTPUT_DIR) / PRESET
(out / "metrics").mkdir(parents=True, exist_ok=True)
(out / "metrics" / "{stem}.json").write_text(json.dumps({{"x": X, "nested": {{"twice": 2 * X}}, "curve": [1, 2]}}))
(out / "figures").mkdir(parents=True, exist_ok=True)
(out / "figures" / "{stem}_fig.png").write_bytes(b"\\x89PNG")
"""


def write_notebook(folder, stem="toy"):
    """A notebook with a parameters cell (X, FAIL, OUTPUT_DIR, PRESET) that records metrics, or raises if FAIL."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name(), "language": "python", "display_name": "Python 3"}
    params = nbformat.v4.new_code_cell('X = 1\nFAIL = False\nOUTPUT_DIR = "out"\nPRESET = "smoke"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# toy"), params, nbformat.v4.new_code_cell(BODY.format(stem=stem))]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.ipynb"
    nbformat.write(nb, str(path))
    return path


def parameters_notebook(path, source: str):
    """A notebook holding only a parameters cell with ``source`` (e.g. ``"X = 1"``), for the grid checks."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name(), "language": "python"}
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def write_grid(path, **grid):
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


@pytest.fixture
def toy(tmp_path):
    return write_notebook(tmp_path / "nbs")


def test_grid_failure_results_and_resume(tmp_path, toy):
    before = toy.read_bytes()
    grid = write_grid(tmp_path / "nbs" / "g.yaml", notebooks=["toy.ipynb"], output_dir=str(tmp_path / "batch"),
                      kernel=kernel_name(), timeout=120, parameters={"X": 3}, grid={"FAIL": [False, True]})
    df = batch.run_grid(grid, progress=False)
    assert list(df["name"]) == ["FAIL=False", "FAIL=True"]
    assert list(df["status"]) == ["completed", "failed"]
    assert df.loc[1, "error"] == "RuntimeError: boom: FAIL was set"
    assert df.loc[0, "x"] == 3 and df.loc[0, "nested.twice"] == 6 and "curve" not in df.columns
    assert pd.isna(df.loc[1, "x"])  # a failed run reports no numbers
    out = tmp_path / "batch"
    csv = pd.read_csv(out / "results.csv")
    assert list(csv.columns[:6]) == ["name", "notebook", "status", "seconds", "error", "FAIL"]
    assert list(csv["status"]) == ["completed", "failed"] and csv.loc[0, "x"] == 3
    md = (out / "results.md").read_text().splitlines()
    assert md[0].startswith("| name | notebook | status | seconds | error | FAIL | x | nested.twice |")
    assert len(md) == 4 and "| failed |" in md[3] and "boom" in md[3]

    done, failed = out / "toy" / "FAIL=False.ipynb", out / "toy" / "FAIL=True.ipynb"
    meta = nbformat.read(str(done), as_version=4).metadata["papermill"]
    assert meta["parameters"] == {"X": 3, "FAIL": False,
                                  "OUTPUT_DIR": str(out / "artifacts" / "FAIL=False")}
    assert (out / "artifacts" / "FAIL=False" / "smoke" / "metrics" / "toy.json").is_file()
    assert toy.read_bytes() == before  # the input notebook is never written

    # restart through the CLI: the completed run is skipped untouched, the failed one runs again
    stamps = done.stat().st_mtime_ns, failed.stat().st_mtime_ns
    assert main(["batch", str(grid)]) == 1
    again = pd.read_csv(out / "results.csv")
    assert list(again["status"]) == ["skipped", "failed"] and again.loc[0, "x"] == 3
    assert done.stat().st_mtime_ns == stamps[0] and failed.stat().st_mtime_ns > stamps[1]
    assert toy.read_bytes() == before


def test_resume_needs_same_parameters_and_code(tmp_path, toy):
    """No execution: a completed copy is reused only for the same parameters and the same notebook code."""
    out = tmp_path / "done.ipynb"
    nb = nbformat.read(str(toy), as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
    nb.metadata["papermill"] = {"parameters": {"X": [1, 2]}, "exception": None, "end_time": "t", "duration": 2.5}
    nbformat.write(nb, str(out))
    assert batch.previous_run(toy, out, {"X": (1, 2)}) == 2.5
    assert batch.previous_run(toy, out, {"X": [1, 3]}) is None
    nb.cells[-1].source += "\nprint('edited')"
    nbformat.write(nb, str(toy))
    assert batch.previous_run(toy, out, {"X": [1, 2]}) is None


def test_run_suite_shares_artifacts_and_collects_figures(tmp_path, monkeypatch):
    folder = tmp_path / "notebooks"
    write_notebook(folder, "00_toy")
    write_notebook(folder, "notes")  # not NN_*: not part of the suite
    monkeypatch.setattr(batch, "NOTEBOOKS_DIR", folder)
    out = tmp_path / "suite"
    df = batch.run_suite("smoke", output_dir=out, kernel_name=kernel_name(), progress=False)
    assert list(df["name"]) == ["00_toy"] and list(df["status"]) == ["completed"]
    assert df.loc[0, "metrics"] == "x=1; nested.twice=2"
    assert (out / "00_toy.ipynb").is_file() and (out / "figures" / "00_toy_fig.png").is_file()
    assert (out / "artifacts" / "smoke" / "metrics" / "00_toy.json").is_file()
    assert "| 00_toy | 00_toy.ipynb | completed |" in (out / "results.md").read_text()
    with pytest.raises(AclLabError, match="available: 00_toy.ipynb, notes.ipynb"):
        batch.run_suite("smoke", output_dir=out, notebooks=["01_missing"])
    with pytest.raises(AclLabError, match="PRESET 'fast' is not valid"):
        batch.run_suite("fast", output_dir=out)


def test_suite_runs_wait_for_the_notebooks_whose_artifacts_they_read(tmp_path):
    out = tmp_path / "suite"
    every = batch.suite_notebooks()
    specs = {s.name[:2]: s for s in batch.suite_specs(every, {"PRESET": "smoke"}, out)}
    assert [s.name for s in specs.values()] == [nb.stem for nb in every]  # numbered order, one run each
    after = {n: sorted(p.name[:2] for p in s.after) for n, s in specs.items() if s.after}
    assert after == {"03": ["02"], "05": ["04"], "06": ["02"], "07": ["01", "02", "06"]}
    assert all(p.parent == out and p.suffix == ".ipynb" for s in specs.values() for p in s.after)
    some = [nb for nb in every if nb.stem[:2] in ("01", "03", "07")]  # 02 and 06 not chosen: nothing to wait for
    assert {s.name[:2]: [p.name[:2] for p in s.after] for s in batch.suite_specs(some, {}, out)} == \
        {"01": [], "03": [], "07": ["01"]}


def test_run_notebook_refuses_to_overwrite_its_input(toy):
    with pytest.raises(AclLabError, match="overwrite the notebook"):
        batch.run_notebook(toy, toy, {"X": 2})


def test_cli_dry_run_lists_runs(tmp_path, toy, capsys):
    grid = write_grid(tmp_path / "g.yaml", notebooks=[str(toy)], output_dir=str(tmp_path / "b"),
                      parameters={"PRESET": "smoke"}, grid={"X": [1, 2], "FAIL": [False]})
    assert main(["batch", str(grid), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "2 runs" in text and str(tmp_path / "b" / "toy" / "X=1_FAIL=False.ipynb") in text
    assert "X=2_FAIL=False" in text and not (tmp_path / "b").exists()
    assert main(["batch", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("grid, words", [
    ({"notebooks": ["missing.ipynb"]}, r"'missing.ipynb' does not exist .*available: .*toy.ipynb"),
    ({"grid": {"Y": [1]}}, r"'Y' is not declared .*declared: X, FAIL, OUTPUT_DIR, PRESET"),
    ({"parameters": {"X": "one"}}, r"X='one' \(str\) does not match .*default 1 \(int\)"),
    ({"grid": {"X": [1, 2.5]}}, r"X=2.5 \(float\) does not match"),
    ({"grid": {"FAIL": [0]}}, r"FAIL=0 \(int\) does not match .*\(bool\)"),
    ({"grid": {"X": []}}, r"must be a non-empty list"),
    ({"grid": {"X": 3}}, r"must be a non-empty list .*goes under 'parameters'"),
    ({"parameters": {"X": 1}, "grid": {"X": [2]}}, r"both fixed .* and varied"),
    ({"params": {"X": 1}}, r"Unknown key\(s\) 'params' .*allowed: notebooks, output_dir"),
    ({"kernel": "no-such-kernel"}, r"Kernel 'no-such-kernel' is not registered"),
    ({"output_template": "{LAMBDA}.ipynb"}, r"unknown placeholder\(s\) \{LAMBDA\}"),
    ({"output_template": "{notebook}.ipynb", "grid": {"X": [1, 2]}}, r"gives the same file"),
])
def test_bad_grids_say_what_and_how(tmp_path, toy, grid, words):
    path = write_grid(tmp_path / "nbs" / "bad.yaml", **{"notebooks": ["toy.ipynb"], **grid})
    with pytest.raises(AclLabError, match=words):
        batch.expand_grid(path)


def test_grid_values_accept_int_for_float_and_anything_for_none(tmp_path):
    parameters_notebook(tmp_path / "f.ipynb", "LAMBDA = 0.1\nMODEL = None\nOBJECTIVES = ['acl']")
    specs = batch.expand_grid({"notebooks": [str(tmp_path / "f.ipynb")], "output_dir": str(tmp_path / "o"),
                               "grid": {"LAMBDA": [1, 0.5], "MODEL": ["tiny", 3], "OBJECTIVES": [["ce+scl"]]}})
    assert [s.name for s in specs][:2] == ["LAMBDA=1_MODEL=tiny_OBJECTIVES=ce+scl",
                                           "LAMBDA=1_MODEL=3_OBJECTIVES=ce+scl"]
    with pytest.raises(AclLabError, match="write 1.0e-3 or 0.001"):
        batch.load_grid({"notebooks": [str(tmp_path / "f.ipynb")], "grid": {"LAMBDA": ["1e-3"]}})


def test_bad_yaml_names_line_and_column(tmp_path, toy):
    path = tmp_path / "broken.yaml"
    path.write_text("notebooks: [toy.ipynb\ngrid: {X: [1, 2]}\n")
    with pytest.raises(AclLabError, match=r"not valid YAML at line \d+, column \d+"):
        batch.load_grid(path)


def test_example_grids_are_valid():
    """The shipped grids parse; their notebooks are checked when they exist (02 may still be in the works)."""
    for path in sorted(batch.NOTEBOOKS_DIR.glob("grids/*.yaml")):
        raw = yaml.safe_load(path.read_text())
        assert set(raw) <= set(batch.GRID_KEYS) and raw["grid"], path
        if all((batch.NOTEBOOKS_DIR / n).is_file() for n in raw["notebooks"]):
            assert batch.expand_grid(path), path
    assert batch.run_name({"OBJECTIVES": ["ce+scl"], "LAMBDA": 0.5}) == "OBJECTIVES=ce+scl_LAMBDA=0.5"
    assert batch.run_name({}) == "default"


def test_interrupted_batch_restarts_and_skips_finished_runs(tmp_path, toy):
    """A real SIGINT to `python -m acl_lab batch` mid-way; the restart skips the runs that finished."""
    import os
    import signal
    import subprocess
    import sys
    import time

    nbs = tmp_path / "nbs"
    slow = write_notebook(nbs, stem="slow")
    nb = nbformat.read(str(slow), as_version=4)
    block = tmp_path / "block"
    block.write_text("runs after the first wait while this file exists")
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import pathlib, time\nt0 = time.time()\nwhile X > 1 and pathlib.Path({str(block)!r}).exists() "
        "and time.time() - t0 < 60:\n    time.sleep(0.2)"))
    nbformat.write(nb, str(slow))
    out = tmp_path / "batch"
    grid = write_grid(nbs / "g.yaml", notebooks=["slow.ipynb"], output_dir=str(out), kernel=kernel_name(),
                      timeout=120, grid={"X": [1, 2, 3]})
    proc = subprocess.Popen([sys.executable, "-m", "acl_lab", "batch", str(grid)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    results = out / "results.csv"
    deadline = time.time() + 180
    while time.time() < deadline and not (results.exists() and "completed" in results.read_text()):
        time.sleep(0.2)
    time.sleep(3)  # now inside the second run, which waits on the block file
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=600)  # a hang guard, not a speed check: shutting kernels down is slow under load
    assert proc.returncode != 0
    first = out / "slow" / "X=1.ipynb"
    stamp = first.stat().st_mtime_ns
    block.unlink()
    df = batch.run_grid(grid, progress=False)  # the restart: X=1 finished before the signal and is skipped
    assert list(df["status"]) == ["skipped", "completed", "completed"]
    assert first.stat().st_mtime_ns == stamp
