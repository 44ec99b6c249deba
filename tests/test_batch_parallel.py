"""Batches beyond one process: --jobs N, a Dask cluster, runs that come 'after' others, dying processes.

The toy notebooks are those of test_batch (no torch) plus one cell that records the
threads the run was given and its kernel's pid, fails at one X and, at another, waits
on a file so that the test can kill a process mid-run with a real signal. One test runs
the shipped smoke grid (notebook 00 in the smoke preset) with --jobs 1 and --jobs 2.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import kernel_name
from test_batch import write_grid, write_notebook

from acl_lab.lab import batch, workers
from acl_lab.cli import main
from acl_lab.errors import AclLabError

EXTRA = """\
import json, os, pathlib, time
out = pathlib.Path(OUTPUT_DIR) / PRESET
metrics = out / "metrics" / "{stem}.json"
values = json.loads(metrics.read_text())
values["threads"] = os.environ.get("OMP_NUM_THREADS", "unset")
metrics.write_text(json.dumps(values))
(out / "{stem}_pid_X={{}}".format(X)).write_text(str(os.getpid()))
if X == {fail_at}:
    raise RuntimeError("boom: X={fail_at}")
t0 = time.time()
while X == {hold_at} and pathlib.Path({block!r}).exists() and time.time() - t0 < 90:
    time.sleep(0.2)
"""


def toy_notebook(folder: Path, stem: str = "toy", fail_at: int = -1, hold_at: int = -1, block: Path | None = None):
    """test_batch's toy notebook, plus: record OMP_NUM_THREADS and the kernel pid; fail at X=fail_at; hold at X=hold_at."""
    path = write_notebook(folder, stem)
    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(EXTRA.format(stem=stem, fail_at=fail_at, hold_at=hold_at,
                                                           block=str(block or folder / "no-block"))))
    nbformat.write(nb, str(path))
    return path


def wait_for(path: Path, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def gone(pid: int, seconds: float = 60) -> bool:
    import psutil

    deadline = time.time() + seconds
    while time.time() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_jobs_2_gives_the_rows_of_jobs_1_on_the_smoke_grid(tmp_path):
    """notebooks/grids/seeds_smoke.yaml (00_tour, smoke preset, 2 tasks) one at a time and 2 at once."""
    raw = yaml.safe_load((batch.NOTEBOOKS_DIR / "grids" / "seeds_smoke.yaml").read_text())
    frames = {}
    for jobs in (1, 2):
        grid = {**raw, "output_dir": str(tmp_path / f"jobs{jobs}"), "kernel": kernel_name()}
        batch.run_grid(grid, jobs=jobs, progress=False)
        frames[jobs] = pd.read_csv(tmp_path / f"jobs{jobs}" / "results.csv").drop(columns="seconds")
    one, two = (frames[j].sort_values("name").reset_index(drop=True) for j in (1, 2))
    assert list(one["status"]) == ["completed", "completed"] and list(one.columns) == list(two.columns)
    assert {"mean_angle_scl", "separation_last_layer"} <= set(one.columns)
    floats = [c for c in one.columns if one[c].dtype.kind == "f"]
    pd.testing.assert_frame_equal(one.drop(columns=floats), two.drop(columns=floats))
    # float columns agree to ~1e-9: 2 threads (jobs 1) and 1 thread (jobs 2) sum in another order
    np.testing.assert_allclose(one[floats].to_numpy(), two[floats].to_numpy(), rtol=1e-6, atol=1e-9)


def test_threads_rule():
    assert workers.threads_per_run(2, cores=2) == 1
    assert workers.threads_per_run(3, cores=16) == 5
    assert workers.threads_per_run(8, cores=4) == 1  # never 0
    assert workers.threads_per_run(1, cores=12) == 12


def test_after_waits_for_the_same_point_and_skips_runs_whose_input_failed(tmp_path):
    """'second' reads the metrics 'first' wrote at the same grid point; at X=2 'first' fails, so 'second' is not run."""
    nbs = tmp_path / "nbs"
    toy_notebook(nbs, "first", fail_at=2)
    second = write_notebook(nbs, "second")
    nb = nbformat.read(str(second), as_version=4)
    nb.cells.insert(2, nbformat.v4.new_code_cell(  # before the body: fails if first has not finished
        "import json, pathlib\nX = json.loads((pathlib.Path(OUTPUT_DIR) / PRESET / 'metrics' / 'first.json')"
        ".read_text())['x'] * 10"))
    nbformat.write(nb, str(second))
    # first sleeps before it writes its metrics, so a second started too early would fail
    first = nbs / "first.ipynb"
    nb = nbformat.read(str(first), as_version=4)
    nb.cells.insert(2, nbformat.v4.new_code_cell("import time\ntime.sleep(1.5)"))
    nbformat.write(nb, str(first))
    out = tmp_path / "batch"
    grid = write_grid(nbs / "g.yaml", notebooks=["first.ipynb", "second.ipynb"], after={"second": ["first"]},
                      output_dir=str(out), kernel=kernel_name(), timeout=120, grid={"X": [1, 2]})
    specs = batch.expand_grid(grid)
    assert [s.after for s in specs] == [(), (out / "first" / "X=1.ipynb",), (), (out / "first" / "X=2.ipynb",)]
    df = batch.run_grid(grid, jobs=2, progress=False)
    assert list(zip(df["notebook"], df["name"], df["status"])) == [
        ("first.ipynb", "X=1", "completed"), ("second.ipynb", "X=1", "completed"),
        ("first.ipynb", "X=2", "failed"), ("second.ipynb", "X=2", "failed")]
    assert df.loc[1, "x"] == 10  # second read first's x=1 at its own point
    assert df.loc[3, "error"] == "not run: it runs after first.ipynb X=2, which failed"
    assert not (out / "second" / "X=2.ipynb").exists()


@pytest.mark.parametrize("after, words", [
    ({"second": ["missing"]}, r"Notebook 'missing' does not exist"),
    ({"second": ["third"]}, r"names 'third', which is not one of the grid's notebooks \(first.ipynb, second.ipynb\)"),
    ({"first": ["second"]}, r"first.ipynb runs after second.ipynb, but 'notebooks' lists second.ipynb later"),
    ({"first": "first"}, r"lists first.ipynb as the same notebook"),
    ({"second": []}, r"must be a non-empty list"),
    (["second"], r"must map a notebook to the notebooks it runs after"),
])
def test_bad_after_says_what_and_how(tmp_path, after, words):
    nbs = tmp_path / "nbs"
    for stem in ("first", "second", "third"):
        write_notebook(nbs, stem)
    path = write_grid(nbs / "bad.yaml", notebooks=["first.ipynb", "second.ipynb"], after=after)
    with pytest.raises(AclLabError, match=words):
        batch.expand_grid(path)


def test_bad_jobs_and_missing_dask_say_what_and_how(tmp_path, monkeypatch, capsys):
    toy = write_notebook(tmp_path / "nbs")
    grid = write_grid(tmp_path / "nbs" / "g.yaml", notebooks=[str(toy)], output_dir=str(tmp_path / "b"),
                      kernel=kernel_name(), grid={"X": [1]})
    with pytest.raises(AclLabError, match=r"--jobs 0 must be a whole number >= 1"):
        batch.run_grid(grid, jobs=0, progress=False)
    with pytest.raises(AclLabError, match=r"--jobs and --scheduler were both given"):
        batch.run_grid(grid, jobs=2, scheduler="tcp://127.0.0.1:1", progress=False)
    monkeypatch.setattr(workers, "CONNECT_TIMEOUT", "1s")
    with pytest.raises(AclLabError, match=r"Cannot reach the Dask scheduler at 'tcp://127.0.0.1:1'"):
        batch.run_grid(grid, scheduler="tcp://127.0.0.1:1", progress=False)
    monkeypatch.setitem(__import__("sys").modules, "distributed", None)  # as if dask were not installed
    assert main(["batch", str(grid), "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "pip install acl_lab[cluster]" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # nothing ran, nothing written


def held_grid(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A grid of the toy notebook at X=1, 2 whose X=1 run holds while the file ``block`` exists: (grid, out, block)."""
    nbs, block = tmp_path / "nbs", tmp_path / "block"
    block.write_text("X=1 waits while this exists")
    toy_notebook(nbs, hold_at=1, block=block)
    out = tmp_path / "batch"
    grid = write_grid(nbs / "g.yaml", notebooks=["toy.ipynb"], output_dir=str(out), kernel=kernel_name(),
                      timeout=120, grid={"X": [1, 2]})
    return grid, out, block


def test_killed_run_process_is_recorded_failed_and_the_batch_completes(tmp_path):
    """--jobs 2: SIGKILL to the process running X=1 (papermill's, the kernel's parent) mid-run."""
    import psutil

    grid, out, block = held_grid(tmp_path)
    pid_file = out / "artifacts" / "X=1" / "smoke" / "toy_pid_X=1"
    pids = {}

    def kill_when_running() -> None:
        wait_for(pid_file)
        kernel = psutil.Process(int(pid_file.read_text()))
        pids["kernel"], pids["run"] = kernel.pid, kernel.parent().pid
        os.kill(pids["run"], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    df = batch.run_grid(grid, jobs=2, progress=False)
    killer.join()
    assert list(df["status"]) == ["failed", "completed"]
    assert df.loc[0, "error"].startswith("the run's process was killed by SIGKILL")
    assert df.loc[1, "threads"] == str(workers.threads_per_run(2))
    assert gone(pids["kernel"])  # the orphaned kernel exits with its parent
    csv = pd.read_csv(out / "results.csv")
    assert list(csv["status"]) == ["failed", "completed"] and "SIGKILL" in csv.loc[0, "error"]


@pytest.fixture(scope="module")
def dask_cluster():
    """A LocalCluster with 2 worker processes (1 thread each), default scheduler settings."""
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                       host="127.0.0.1")
    client = distributed.Client(cluster)
    yield cluster, client
    client.close()
    cluster.close()


def test_dask_cluster_records_failure_and_rerun_skips_completed(tmp_path, dask_cluster, capsys):
    cluster, _ = dask_cluster
    nbs = tmp_path / "nbs"
    toy_notebook(nbs, fail_at=2)
    out = tmp_path / "batch"
    grid = write_grid(nbs / "g.yaml", notebooks=["toy.ipynb"], output_dir=str(out), kernel=kernel_name(),
                      timeout=120, parameters={"PRESET": "smoke"}, grid={"X": [1, 2, 3]})
    assert main(["batch", str(grid), "--scheduler", cluster.scheduler_address]) == 1
    out_text, bar = capsys.readouterr()
    assert "toy.ipynb X=2: failed in" in out_text and ": RuntimeError: boom: X=2" in out_text  # a line per run
    assert sum(f"toy.ipynb X={x}: completed in" in out_text for x in (1, 3)) == 2
    assert "done 2, failed 1, remaining 0" in bar  # the tqdm bar's counts
    csv = pd.read_csv(out / "results.csv")
    assert list(csv["name"]) == ["X=1", "X=2", "X=3"]
    assert list(csv["status"]) == ["completed", "failed", "completed"]
    assert csv.loc[1, "error"] == "RuntimeError: boom: X=2"
    assert list(csv["x"].iloc[[0, 2]]) == [1, 3]
    assert list(csv["threads"].iloc[[0, 2]]) == [workers.threads_per_run(2)] * 2  # 2 one-thread workers on one host
    assert "| X=2 | toy.ipynb | failed |" in (out / "results.md").read_text()
    stamps = [(out / "toy" / f"X={x}.ipynb").stat().st_mtime_ns for x in (1, 2, 3)]

    df = batch.run_grid(grid, scheduler=cluster.scheduler_address, progress=False)
    assert list(df["status"]) == ["skipped", "failed", "skipped"]
    after = [(out / "toy" / f"X={x}.ipynb").stat().st_mtime_ns for x in (1, 2, 3)]
    assert after[0] == stamps[0] and after[2] == stamps[2] and after[1] > stamps[1]  # only the failed one ran


def test_dask_worker_killed_mid_run_fails_its_run_and_the_batch_completes(tmp_path, dask_cluster):
    import psutil

    cluster, client = dask_cluster
    grid, out, block = held_grid(tmp_path)
    pid_file = out / "artifacts" / "X=1" / "smoke" / "toy_pid_X=1"
    worker_pids = set(client.run(os.getpid).values())
    pids = {}

    def kill_worker_when_running() -> None:
        wait_for(pid_file)
        kernel = psutil.Process(int(pid_file.read_text()))
        pids["kernel"], pids["run"] = kernel.pid, kernel.parent().pid
        worker = next(p for p in kernel.parents() if p.pid in worker_pids)
        os.kill(worker.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_worker_when_running)
    killer.start()
    df = batch.run_grid(grid, scheduler=cluster.scheduler_address, progress=False)
    killer.join()
    assert list(df["status"]) == ["failed", "completed"]
    # the scheduler handed the task to another worker, which found the first attempt's file and did not rerun it
    assert df.loc[0, "error"].startswith("the Dask worker running it died (tcp://127.0.0.1:")
    assert "not retried: rerun the batch" in df.loc[0, "error"]
    assert gone(pids["run"]) and gone(pids["kernel"])  # no orphan goes on writing the run
    assert not list((out / "toy").glob(".*.attempt"))  # the attempt files are cleaned up
    first = batch.expand_grid(grid)[0]
    assert batch.previous_run(first.notebook, first.output_path, first.parameters) is None  # a rerun runs it again
    client.wait_for_workers(2, timeout=120)  # the nanny restarts the worker (slowly on a loaded machine)
    assert len(client.run(os.getpid)) == 2


def test_run_in_a_child_reports_a_notebook_it_cannot_see(tmp_path):
    """What a Dask worker without the shared file system gives: the run fails with the path, nothing raises."""
    job = {"notebook": str(tmp_path / "elsewhere.ipynb"), "output": str(tmp_path / "o.ipynb"), "parameters": {},
           "name": "X=1", "kernel": kernel_name(), "timeout": None}
    rec = workers.record_from_dict(workers.run_in_subprocess(job, threads=1))
    assert rec.status == "failed" and rec.error.startswith(f"Notebook {str(tmp_path / 'elsewhere.ipynb')!r} does not")


def test_ctrl_c_stops_the_local_runs_and_keeps_the_finished(tmp_path):
    """A real SIGINT to `batch --jobs 2` while X=1 holds: exit 130, X=2's row kept, no run process left."""
    import subprocess
    import sys

    import psutil

    grid, out, block = held_grid(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "acl_lab", "batch", str(grid), "--jobs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results, pid_file = out / "results.csv", out / "artifacts" / "X=1" / "smoke" / "toy_pid_X=1"
    wait_for(pid_file)
    deadline = time.time() + 120
    while not (results.exists() and "completed" in results.read_text()):
        assert time.time() < deadline
        time.sleep(0.2)
    kernel = psutil.Process(int(pid_file.read_text()))
    run = kernel.parent()
    proc.send_signal(signal.SIGINT)
    printed = proc.communicate(timeout=600)[0].decode()  # a hang guard, not a speed check (slow under load)
    assert proc.returncode == 130 and "toy.ipynb X=2: completed in" in printed
    assert gone(run.pid) and gone(kernel.pid)
    csv = pd.read_csv(results)
    assert list(zip(csv["name"], csv["status"])) == [("X=2", "completed")]
    first = batch.expand_grid(grid)[0]
    assert batch.previous_run(first.notebook, first.output_path, first.parameters) is None  # the rerun runs it
