"""SIGKILL at seeded random moments of training, checkpoint and metrics writes, a batch and the evidence writer.

Each kill is a real ``SIGKILL`` to a real child process (see ``killing.py``). After it, the
files left behind are checked the way a resuming run reads them (every checkpoint folder
present loads whole, every JSON file parses), then the run is resumed (the batch or evidence
run re-run) and must end with exactly the metrics of an uninterrupted run, keeping what had
finished before the kill.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml
from conftest import kernel_name
from killing import kill_spec, run_job, trace_job

from acl_lab.atomic import read_jsonl, restore_folder
from acl_lab.checkpoint import load_model_weights, load_training_state
from acl_lab.model import build_model
from acl_lab.trainer import make_optimizer, train

pytestmark = pytest.mark.slow
SEED = 16
KEYS = ("dev", "dev_per_exit", "steps", "best_step", "gate", "exit_layers")


def _category(path: str) -> str:
    if path.startswith("run/checkpoints/"):
        return "checkpoint"
    return {"run/metrics.json": "metrics", "run/history.jsonl": "step"}.get(
        path.replace(".tmp-PID", ""), "other")


def _steps(path: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("angle")) for r in read_jsonl(path) if r.get("event") != "eval"]


def _check_left_behind(out: Path, cfg) -> dict:
    """What a resume will read must be whole: checkpoint folders load, JSON files parse. Returns what finished."""
    ckpt = out / "checkpoints"
    for name in ("last", "best"):
        restore_folder(ckpt / name)  # what train() does first
    finished: dict = {"step": 0}
    if (ckpt / "last").exists():
        model, _ = build_model("tiny", 2, dropout=0.0, seed=cfg.seed)
        finished["step"] = load_training_state(ckpt / "last", model, make_optimizer(model, cfg))["step"]
    if (ckpt / "best").exists():
        load_model_weights(ckpt / "best", build_model("tiny", 2, seed=cfg.seed)[0])
    for name in ("config.json", "metrics.json"):
        if (out / name).exists():
            json.loads((out / name).read_text())
    if (out / "metrics.json").exists():
        finished["metrics"] = (out / "metrics.json").read_bytes()
    if (out / "history.jsonl").exists():
        finished["rows"] = [r for r in _steps(out / "history.jsonl") if r[0] <= finished["step"]]
    return finished


def test_training_survives_sigkill_at_random_points(tiny_config, tmp_path):
    cfg = tiny_config.replace(objective="acl", max_steps=12, eval_every=4, batch_size=8)
    ref = train(cfg.replace(output_dir=str(tmp_path / "ref")), progress=False)
    ref_rows = _steps(ref.paths["history"])

    job = {"kind": "train", "root": str(tmp_path / "t"), "config": cfg.replace(output_dir=str(tmp_path / "t/run")).to_dict()}
    events, seconds = trace_job(job)
    traced = json.loads((tmp_path / "t/run/metrics.json").read_text())
    assert {k: traced.get(k) for k in KEYS} == {k: ref.metrics.get(k) for k in KEYS}, "a child run differs"

    rng = random.Random(SEED)
    by_cat: dict[str, list[int]] = {}
    for i, e in enumerate(events):
        by_cat.setdefault(_category(e["path"]), []).append(i)
    plan = []
    for cat, n in (("step", 3), ("checkpoint", 5), ("metrics", 2), ("other", 1)):
        for i in rng.sample(by_cat[cat], n):
            mode = rng.choice(["torn", "before"] if events[i]["kind"] == "write" else ["before", "after"])
            plan.append((cat, kill_spec(events, i, mode), None))
    swaps = [i for i in by_cat["checkpoint"] if events[i]["path"].endswith("last.old")]
    plan.append(("checkpoint", kill_spec(events, rng.choice(swaps), "after"), None))  # last is absent here
    plan += [("time", None, rng.uniform(0.1, 0.9) * seconds) for _ in range(4)]

    survived = []
    for n, (cat, kill, after) in enumerate(plan):
        root = tmp_path / f"k{n}"
        out = root / "run"
        run = cfg.replace(output_dir=str(out))
        res = run_job({**job, "root": str(root), "config": run.to_dict()}, kill=kill, after=after)
        where = f"kill {n} ({cat}: {kill or f'{after:.2f} s'})"
        if not res["killed"]:
            assert after is not None, f"{where}: the event never came: {res}"
            continue  # the run ended before the timer
        finished = _check_left_behind(out, run)
        again = train(run, resume=True, progress=False)
        assert {k: again.metrics.get(k) for k in KEYS} == {k: ref.metrics.get(k) for k in KEYS}, where
        assert _steps(out / "history.jsonl") == ref_rows, where
        if "metrics" in finished:  # it had finished: read back, not trained again
            assert (out / "metrics.json").read_bytes() == finished["metrics"], where
        assert _steps(out / "history.jsonl")[:len(finished.get("rows", []))] == finished.get("rows", []), where
        assert not list(out.glob("**/*.tmp*")), f"{where}: temporaries left after the resume"
        survived.append(cat)
    counts = {c: survived.count(c) for c in dict.fromkeys(survived)}
    print(f"training kill points survived: {len(survived)} {counts}")
    assert len(survived) >= 14, counts


# ---------------------------------------------------------------------------
# a batch of notebooks, killed and re-run until it completes
# ---------------------------------------------------------------------------
TOY = """\
import json, pathlib, time
time.sleep(0.3)
out = pathlib.Path(OUTPUT_DIR) / "smoke" / "metrics"
out.mkdir(parents=True, exist_ok=True)
(out / "toy.json").write_text(json.dumps({"x": X * 10}))
"""


def _toy_grid(folder: Path, out: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name(), "language": "python", "display_name": "Python 3"}
    params = nbformat.v4.new_code_cell('X = 1\nOUTPUT_DIR = "out"\nPRESET = "smoke"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(TOY)]
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(folder / "toy.ipynb"))
    grid = folder / "g.yaml"
    grid.write_text(yaml.safe_dump({"notebooks": ["toy.ipynb"], "output_dir": str(out), "kernel": kernel_name(),
                                    "timeout": 60, "grid": {"X": [1, 2, 3]}}))
    return grid


def test_batch_survives_sigkill_and_rerun_finishes_it(tmp_path):
    from acl_lab.lab.batch import expand_grid, previous_run, run_grid

    t0 = time.perf_counter()
    ref = run_grid(_toy_grid(tmp_path / "ref", tmp_path / "ref_out"), progress=False)
    seconds = time.perf_counter() - t0
    out = tmp_path / "out"
    grid = _toy_grid(tmp_path / "nbs", out)
    job = {"kind": "batch", "root": str(tmp_path), "grid": str(grid)}
    rng = random.Random(SEED)
    specs = expand_grid(grid)
    kills = 0
    for n in range(3):  # each kill lands in the re-run of the batch the previous kill cut short
        done = {s.output_path: s.output_path.stat().st_mtime_ns for s in specs
                if previous_run(s.notebook, s.output_path, s.parameters) is not None}
        kill = {"kind": "rename", "path": "out/results.csv", "nth": 0, "mode": "before"} if n == 2 else None
        res = run_job(job, kill=kill, after=None if kill else rng.uniform(0.2, 0.8) * seconds)
        if not res["killed"]:
            break
        kills += 1
        if (out / "results.csv").exists():
            pd.read_csv(out / "results.csv")  # whole, never half-written
        for p, stamp in done.items():  # runs that had completed are not executed again
            assert p.stat().st_mtime_ns == stamp, p
    final = run_grid(grid, progress=False)
    assert list(final["name"]) == list(ref["name"]) and list(final["x"]) == list(ref["x"]) == [10, 20, 30]
    assert set(final["status"]) <= {"completed", "skipped"}
    print(f"batch kill points survived: {kills} (runs completed before a kill: {len(done)})")
    assert kills >= 2


# ---------------------------------------------------------------------------
# the evidence writer
# ---------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """The smoke preset leaves torch's thread count alone; the children use one thread, so the reference does too
    (another count sums in another order and changes the last digits)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_evidence_survives_sigkill_in_its_writes(tmp_path, one_thread):
    from acl_lab.lab.evidence import EvidencePlan, run_evidence

    plan = {"tasks": ["rt-polarity"], "seeds": [0], "preset": "smoke"}
    t0 = time.perf_counter()
    run_evidence(EvidencePlan(**plan), tmp_path / "ref_home", tmp_path / "ref_results", parts=["pilot"],
                 progress=False)
    seconds = time.perf_counter() - t0
    ref = pd.read_csv(tmp_path / "ref_results/pilot_angles.csv").drop(columns=["train_seconds"], errors="ignore")
    job = {"kind": "evidence", "root": str(tmp_path), "plan": plan, "runs_home": str(tmp_path / "home"),
           "results": str(tmp_path / "results"), "parts": ["pilot"]}
    rng = random.Random(SEED)
    # the pack copy of a run is made the moment the run finishes (and not again), so its kill point comes first,
    # while that copy is still to be made
    points = [{"kind": "write", "path": "results/runs/ce-s0-", "mode": "torn"},
              {"after": rng.uniform(0.3, 0.8) * seconds},  # somewhere in the training of the runs left
              {"kind": "write", "path": "results/pilot_angles.csv.tmp-PID", "nth": 0, "mode": "torn"},
              {"kind": "rename", "path": "results/plan.json", "nth": 0, "mode": "after"}]
    kills = 0
    for point in points:
        if point.get("path", "").endswith("-"):  # a run's metrics in the pack: its folder name carries the config hash
            name = next(p.name for p in (tmp_path / "ref_results/runs").iterdir()
                        if p.name.startswith(point["path"].rsplit("/", 1)[1]))
            point = {**point, "path": f"results/runs/{name}/metrics.json.tmp-PID", "nth": 0}
        finished = {p: p.read_bytes() for p in (tmp_path / "home/runs").glob("*/metrics.json")}
        res = run_job(job, kill=None if "after" in point else point, after=point.get("after"))
        if not res["killed"] and "after" in point:
            assert res["status"]["ok"], res
            continue
        assert res["killed"], (point, res)
        kills += 1
        for p, data in finished.items():
            assert p.read_bytes() == data, p  # finished runs are kept as they were
        for p in (tmp_path / "results").rglob("*.json"):
            json.loads(p.read_text())
    run_evidence(EvidencePlan(**plan), tmp_path / "home", tmp_path / "results", parts=["pilot"], progress=False)
    got = pd.read_csv(tmp_path / "results/pilot_angles.csv").drop(columns=["train_seconds"], errors="ignore")
    pd.testing.assert_frame_equal(got, ref, check_exact=True)
    assert not list((tmp_path / "results").rglob("*.tmp*"))
    print(f"evidence kill points survived: {kills}")
