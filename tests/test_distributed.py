"""DDP through torchrun on CPU (gloo): two processes train what one process trains with the same global batch.

Each comparison launches ``python -m torch.distributed.run --standalone --nproc_per_node 2 -m acl_lab train``
(the documented torchrun command) on the tiny model with dropout 0 and compares its ``history.jsonl`` and
``metrics.json`` with a one-process :func:`acl_lab.trainer.train` of the same config: per-step losses,
cosines, lam_t and gate decisions to 1e-5 (absolute; angles in degrees to 1e-5 relative, as float32
gradients allow near 90 degrees), final metrics and weights to 1e-4. Short runs (4 steps), the three
two-process runs in one torchrun launch (``tests/ddp_worker.py``: the same ``acl_lab.cli.main``).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from acl_lab import distributed as dist
from acl_lab.errors import AclLabError
from acl_lab.trainer import train

STEP_TOL, FINAL_TOL = 1e-5, 1e-4
CASES = {  # name: objective and extra flags; the gate on in the first two
    "acl": ("acl", []),
    "ce+scl-gated": ("ce+scl", ["--acl-grad"]),
    "me-acl-cl": ("me-acl-cl", []),
}


def _flags(data_dir: str, objective: str, extra: list[str], out: Path, steps: int, eval_every: int) -> list[str]:
    return ["--task", "sst2", "--source", "local", "--data-dir", data_dir, "--model", "tiny",
            "--objective", objective, "--batch-size", "16", "--max-length", "16", "--max-steps", str(steps),
            "--eval-every", str(eval_every), "--lr", "0.002", "--warmup-ratio", "0", "--dropout", "0",
            "--num-threads", "1", "--no-progress", "--output-dir", str(out), *extra]


def _torchrun(args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "acl_lab", "train", *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _rows(out: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") != "eval"], [r for r in rows if r.get("event") == "eval"]


def _assert_rows_close(two: list[dict], one: list[dict]) -> None:
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(two, one):
        assert set(a) == set(b), (a, b)
        for key, va in a.items():
            vb = b[key]
            if isinstance(va, bool) or isinstance(vb, bool) or isinstance(va, str):
                assert va == vb, (a["step"], key, va, vb)  # gate decisions agree exactly
            elif isinstance(va, float) and math.isnan(va):
                assert math.isnan(vb), (a["step"], key)
            elif key.startswith("angle"):
                # float32 rounding of the gradients moves an angle near 90 degrees by ~1e-5 degrees: relative
                assert math.isclose(va, vb, rel_tol=STEP_TOL, abs_tol=STEP_TOL), (a["step"], key, va, vb)
            else:
                assert abs(va - vb) <= STEP_TOL, (a["step"], key, va, vb)


def _assert_weights_close(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(wa) == set(wb)
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    assert worst <= FINAL_TOL, worst


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """The three cases trained by two processes in ONE torchrun launch (start-up dominates on a small CPU)."""
    from conftest import write_toy_sst2

    root = tmp_path_factory.mktemp("ddp")
    data = write_toy_sst2(root / "glue")
    argvs = [["train", *_flags(str(data), objective, extra, root / name, steps=4, eval_every=2)]
             for name, (objective, extra) in CASES.items()]
    worker = Path(__file__).with_name("ddp_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), json.dumps(argvs)], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "data": str(data), "stdout": proc.stdout}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one_process_with_the_same_global_batch(tiny_config, ddp_runs, case):
    objective, extra = CASES[case]
    two = ddp_runs["root"] / case
    cfg = tiny_config.replace(objective=objective, max_steps=4, eval_every=2, data_dir=ddp_runs["data"],
                              output_dir=str(Path(tiny_config.output_dir).parent / "one"),
                              acl_grad=True if "--acl-grad" in extra else None)
    one = train(cfg, progress=False)

    steps2, evals2 = _rows(two)
    _assert_rows_close(steps2, one.history)
    if objective != "me-acl-cl":
        assert all("angle" in r and isinstance(r["kept"], bool) and r["lam_t"] == (0.1 if r["kept"] else 0.0)
                   for r in steps2)
    else:
        assert all(r["acl_cl"] > 0 and r["lam_t"] == 0.1 for r in steps2)
    assert [e["step"] for e in evals2] == [e["step"] for e in one.evals] == [2, 4]
    for e2, e1 in zip(evals2, one.evals):
        assert abs(e2["score"] - e1["score"]) <= FINAL_TOL

    m2 = json.loads((two / "metrics.json").read_text())
    m1 = one.metrics
    assert m2["world_size"] == 2 and m1["world_size"] == 1
    assert json.loads((two / "config.json").read_text())["world_size"] == 2
    for split in ("dev_per_exit",):
        for ea, eb in zip(m2[split], m1[split]):
            assert all(abs(ea[k] - eb[k]) <= FINAL_TOL for k in eb)
    if "gate" in m1:
        assert m2["gate"] == m1["gate"]
    _assert_weights_close(two / "checkpoints" / "last", Path(one.output_dir) / "checkpoints" / "last")
    # only rank 0 reports: one JSON summary per run on stdout, not one per process
    assert ddp_runs["stdout"].count(f'"output_dir": "{two}"') == 1, ddp_runs["stdout"]


def test_ddp_interrupt_and_resume_continue_the_one_process_trajectory(tiny_config, tmp_path):
    """SIGINT to torchrun mid-run: both ranks stop at the same step boundary, save, and --resume completes it."""
    cut = tmp_path / "cut"
    args = _flags(tiny_config.data_dir, "acl", [], cut, steps=30, eval_every=10)
    proc = subprocess.Popen(_torchrun(args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    hist = cut / "history.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not hist.exists() or len(hist.read_text().splitlines()) < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    state = json.loads((cut / "checkpoints/last/trainer_state.json").read_text())
    assert 0 < state["step"] < 30, err[-2000:]
    assert len(state["rank_rng"]) == 1  # rank 1's random state travels in rank 0's checkpoint
    assert not (cut / "metrics.json").exists()
    done = subprocess.run(_torchrun([*args, "--resume"]), env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one = train(tiny_config.replace(objective="acl", max_steps=30, eval_every=10, output_dir=str(tmp_path / "one")),
                progress=False)
    steps2, _ = _rows(cut)
    _assert_rows_close(steps2, one.history)
    m2 = json.loads((cut / "metrics.json").read_text())
    assert m2["steps"] == 30 and abs(m2["dev"]["accuracy"] - one.metrics["dev"]["accuracy"]) <= FINAL_TOL


# ---------------------------------------------------------------------------
# the pieces, in one process
# ---------------------------------------------------------------------------

def test_global_batch_must_split_evenly(monkeypatch):
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    assert dist.local_batch_size(16) == 8
    with pytest.raises(AclLabError, match="batch_size 15 .*divisible by the world size 2.*--batch-size 14"):
        dist.local_batch_size(15)


def test_nccl_without_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AclLabError, match="'nccl' needs CUDA GPUs"):
        dist.init_from_env(torch.device("cpu"), "nccl")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(AclLabError, match="'nccl' needs CUDA GPUs"):
        dist.init_from_env(torch.device("cpu"), "nccl")
    assert dist.init_from_env(torch.device("cpu"), "auto") == torch.device("cpu")  # no launcher: nothing to join


def test_shard_gives_each_rank_its_rows_in_rank_order(monkeypatch):
    batch = {"input_ids": torch.arange(12).view(6, 2), "labels": torch.arange(6)}
    monkeypatch.setattr(dist, "world_size", lambda: 3)
    shards = []
    for r in range(3):
        monkeypatch.setattr(dist, "rank", lambda r=r: r)
        shards.append(dist.shard(batch))
    assert torch.equal(torch.cat([s["labels"] for s in shards]), batch["labels"])
    assert torch.equal(torch.cat([s["input_ids"] for s in shards]), batch["input_ids"])
    assert dist.shard({"labels": torch.arange(5)}) is None  # a last batch that does not split: skipped by all


def test_world_size_is_a_runtime_field_and_no_flag(tiny_config):
    from acl_lab.cli import build_parser
    from acl_lab.config import RUNTIME_FIELDS

    assert {"world_size", "dist_backend"} <= set(RUNTIME_FIELDS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--world-size", "2"])
    with pytest.raises(AclLabError, match="dist_backend"):
        tiny_config.replace(dist_backend="mpi").validate()


def test_accelerate_launch_runs_the_same_ddp_training(tiny_config, tmp_path):
    """``accelerate launch --multi_gpu`` starts torch's own launcher; on CPU acl_lab joins it with gloo."""
    pytest.importorskip("accelerate")
    acc = tmp_path / "acc"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "acl_lab", "train",
           *_flags(tiny_config.data_dir, "acl", [], acc, steps=2, eval_every=2)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = train(tiny_config.replace(objective="acl", max_steps=2, eval_every=2, output_dir=str(tmp_path / "one")),
                progress=False)
    _assert_rows_close(_rows(acc)[0], one.history)
    assert json.loads((acc / "metrics.json").read_text())["world_size"] == 2


def test_reduce_grads_is_one_call_on_a_flat_buffer_and_keeps_shapes_dtypes_and_nones():
    from acl_lab.grad import reduce_grads

    calls = []

    def double(t):
        calls.append(t.numel())
        return t.mul_(2)

    a = [torch.ones(2, 3), None, torch.full((4,), 3.0, dtype=torch.float64)]
    b = [torch.arange(3.0), None, None]
    ra, rb = reduce_grads(double, a, b)
    assert calls == [6 + 4 + 3]  # one collective for both sets
    assert ra[1] is None and rb[1] is None and rb[2] is None
    assert torch.equal(ra[0], 2 * a[0]) and ra[0].dtype == torch.float32
    assert torch.equal(ra[2], 2 * a[2]) and ra[2].dtype == torch.float64
    assert torch.equal(rb[0], 2 * b[0])
    assert torch.equal(a[0], torch.ones(2, 3))  # inputs untouched


@pytest.mark.parametrize("scope", ["all", "params", "repr", "screened", "screened-cheap"])
def test_gate_with_an_identity_reduce_equals_the_gate_without(scope):
    """One process with ``reduce`` (every collective the identity) takes the same decision and update."""
    from acl_lab.grad import ACLGrad

    def run(reduce):
        torch.manual_seed(0)
        lin, head = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
        x = torch.randn(8, 5)
        rep = torch.tanh(lin(x))
        ce = torch.nn.functional.cross_entropy(head(rep), torch.arange(8) % 3)
        aux = (rep ** 2).mean() - 0.3 * head.weight.sum()
        params = [*lin.parameters(), *head.parameters()]
        screen = None  # screened: warm-up (exact path); screened-cheap: a calibrated rule (cheap path)
        if scope.startswith("screened"):
            from acl_lab.grad import ScreenRule

            screen = ScreenRule(warmup=1, floor=0.0, slack=0.0, pairs=[(45.0, 45.0)]) if scope == "screened-cheap" \
                else ScreenRule()
        gate = ACLGrad(params, lam=1.0, threshold=90.0, scope=scope.split("-")[0], reduce=reduce, screen=screen,
                       scope_params=list(head.parameters()) if scope == "params" else None)
        rec = gate.backward(ce, aux, scope_tensors=[rep] if scope in ("repr", "screened", "screened-cheap") else None)
        assert rec.path == ("cheap" if scope in ("params", "repr", "screened-cheap") else "exact")
        return rec, [p.grad.clone() for p in params]

    calls = []
    rec0, g0 = run(None)
    rec1, g1 = run(lambda t: calls.append(t.numel()) or t)
    assert calls, "the reduce function was not called"
    assert (rec0.cos, rec0.kept) == (rec1.cos, rec1.kept)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(g0, g1))


def test_shutdown_frees_the_process_group_and_warns_when_something_still_holds_it(tmp_path):
    """shutdown() must leave no live gloo group for interpreter finalization (where gloo can abort the process):
    a group held only by a reference cycle (as a Trainer's DDP wrapper holds it) is freed, a live one warns."""
    import gc
    import warnings
    import weakref

    import torch.distributed as tdist

    def start(name):
        tdist.init_process_group("gloo", store=tdist.FileStore(str(tmp_path / name), 1), rank=0, world_size=1)

    class Holder:  # a reference cycle, freed only by the garbage collector
        def __init__(self):
            self.group, self.me = tdist.group.WORLD, self

    gc.disable()
    try:
        start("cycle")
        group = weakref.ref(tdist.group.WORLD)
        Holder()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dist.shutdown()
        assert not tdist.is_initialized() and group() is None
    finally:
        gc.enable()
    start("live")
    live = tdist.group.WORLD
    with pytest.warns(RuntimeWarning, match="still referenced after destroy_process_group"):
        dist.shutdown()
    assert not tdist.is_initialized() and live is not None
