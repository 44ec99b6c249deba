"""Benchmark: a 2-process gloo DDP step against a 1-process step with the same global batch, and what the exact gate adds.

Command (from the repository root)::

    .venv/bin/python bench/bench_ddp.py            # about 6-10 min on a 2-core machine
    .venv/bin/python bench/bench_ddp.py --quick    # tiny model, a sanity run (about 2 min)

Writes ``--json`` (default ``bench/results/ddp.json``) and the printed report as ``--txt``.

What is timed. For each objective -- ``ce`` (DDP's own reducer), ``ce+scl`` (reducer, plus the
differentiable all-gather of the exit representations and labels) and ``acl`` (exact ACL-Grad:
DDP's reducer bypassed with ``no_sync``, g_CE and g_aux all-reduced by the gate in one flat
buffer) -- one launch of ``torchrun --standalone --nproc_per_node W`` (W = 1, then 2, alternated,
``--rounds`` times) runs the real ``acl_lab.trainer.Trainer(...).fit()`` on rt-polarity with the
same global batch; an ``on_step`` hook stamps each optimizer step. The step time is the median over
the steps after ``--warm`` warm-up steps; the ratio 2-process / 1-process is taken per round and
the median over rounds is reported. One thread per process (``--num-threads 1``), CPU, gloo.

Communication: the time spent inside :func:`acl_lab.distributed.all_reduce_mean` (what the gate,
the logged scalars and explicit reductions call) is measured by wrapping that function in the
worker; its payload in bytes is counted. DDP's reducer runs in C++ and is not wrapped: its
payload is the gradient size, one all-reduce of every trainable parameter per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OBJECTIVES = ("ce", "ce+scl", "acl")


def _load_avg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


# ---------------------------------------------------------------------------
# worker: runs under torchrun
# ---------------------------------------------------------------------------

def worker(args) -> None:
    import torch

    from acl_lab import distributed as dist
    from acl_lab.config import TrainConfig
    from acl_lab.trainer import Trainer

    comm = {"calls": 0, "bytes": 0, "seconds": 0.0}
    plain = dist.all_reduce_mean

    def timed(tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = plain(tensor)
        comm["seconds"] += time.perf_counter() - t0
        comm["calls"] += 1
        comm["bytes"] += tensor.numel() * tensor.element_size()
        return out

    dist.all_reduce_mean = timed  # the trainer and the gate look it up when they are built
    results = {}
    for objective in args.objectives.split(","):
        cfg = TrainConfig(task="rt-polarity", model=args.model, objective=objective, seed=0,
                          batch_size=args.batch_size, max_length=args.max_length,
                          max_train_samples=args.batch_size * (args.warm + args.steps), max_eval_samples=16,
                          max_steps=args.warm + args.steps, eval_every=10_000, save_checkpoints=False,
                          num_threads=1, device="cpu", output_dir=str(Path(args.work) / f"{objective}-w{os.environ.get('WORLD_SIZE', '1')}"))
        trainer = Trainer(cfg, overwrite=True, progress=False)
        stamps: list[float] = []
        marks: list[dict] = []
        trainer.on_step.append(lambda _t, _r: (stamps.append(time.perf_counter()), marks.append(dict(comm))))
        t0 = time.perf_counter()
        stamps.append(t0)
        marks.append(dict(comm))
        trainer.fit()
        w = args.warm
        steps = [b - a for a, b in zip(stamps[w:-1], stamps[w + 1:])]
        comm_s = [b["seconds"] - a["seconds"] for a, b in zip(marks[w:-1], marks[w + 1:])]
        comm_b = [b["bytes"] - a["bytes"] for a, b in zip(marks[w:-1], marks[w + 1:])]
        n_params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        results[objective] = {"step_s": statistics.median(steps), "steps": steps,
                              "reduce_s_per_step": statistics.median(comm_s),
                              "reduce_bytes_per_step": statistics.median(comm_b) if comm_b else 0,
                              "trainable_params": n_params, "gradient_bytes": 4 * n_params,
                              "ddp_reducer": trainer.gate is None and dist.world_size() > 1}
    if dist.is_main():
        print("RESULT " + json.dumps({"world_size": dist.world_size(), "results": results}), flush=True)


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def launch(args, world: int, work: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(Path(__file__).resolve()), "--worker", "--model", args.model, "--batch-size", str(args.batch_size),
           "--max-length", str(args.max_length), "--warm", str(args.warm), "--steps", str(args.steps),
           "--objectives", args.objectives, "--work", str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun with {world} processes failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", type=int, default=16, help="the GLOBAL batch (each of 2 processes gets half)")
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "ddp.json"))
    p.add_argument("--txt", default=None)
    args = p.parse_args()
    args.model = args.model or ("tiny" if args.quick else "minilm-l6")
    args.steps = args.steps or (4 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.worker:
        worker(args)
        return

    from report import Report

    say = Report()
    say(f"bench_ddp: {args.model}, global batch {args.batch_size}, max length {args.max_length}, gloo on CPU, "
        f"1 thread per process, {args.warm} warm-up + {args.steps} timed steps, {args.rounds} round(s) of 1 then "
        f"2 processes; load average at start {_load_avg()} (the machine is shared: other jobs were running)")
    rounds = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="acl_bench_ddp_") as tmp:
        for r in range(args.rounds):
            one = launch(args, 1, Path(tmp) / f"r{r}")
            two = launch(args, 2, Path(tmp) / f"r{r}")
            rounds.append({"one": one["results"], "two": two["results"], "load_avg": _load_avg()})
            say(f"  round {r + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f}s, load {_load_avg()})")
    say("")
    say(f"  {'objective':<8} {'1-proc step':>12} {'2-proc step':>12} {'2/1 ratio':>10} {'gate+log all-reduce':>20}"
        f" {'payload/step':>13} {'DDP reducer payload':>20}")
    figures = {"config": vars(args), "rounds": rounds, "summary": {}}
    for obj in args.objectives.split(","):
        t1 = statistics.median(rd["one"][obj]["step_s"] for rd in rounds)
        t2 = statistics.median(rd["two"][obj]["step_s"] for rd in rounds)
        ratio = statistics.median(rd["two"][obj]["step_s"] / rd["one"][obj]["step_s"] for rd in rounds)
        red_s = statistics.median(rd["two"][obj]["reduce_s_per_step"] for rd in rounds)
        red_b = statistics.median(rd["two"][obj]["reduce_bytes_per_step"] for rd in rounds)
        grad_b = rounds[0]["two"][obj]["gradient_bytes"]
        reducer = grad_b if rounds[0]["two"][obj]["ddp_reducer"] else 0
        figures["summary"][obj] = {"one_step_s": t1, "two_step_s": t2, "ratio_two_over_one": ratio,
                                   "explicit_all_reduce_s_per_step": red_s, "explicit_all_reduce_bytes_per_step": red_b,
                                   "ddp_reducer_bytes_per_step": reducer, "gradient_bytes": grad_b}
        say(f"  {obj:<8} {1000 * t1:>10.0f}ms {1000 * t2:>10.0f}ms {ratio:>9.2f}x {1000 * red_s:>18.1f}ms"
            f" {red_b / 2**20:>10.2f}MiB {reducer / 2**20:>17.2f}MiB")
    say("  (step: median wall time of an optimizer step after warm-up; ratio: median over rounds of 2-proc/1-proc;"
        " all-reduce: time inside acl_lab.distributed.all_reduce_mean on rank 0 -- for acl the gate's g_CE + g_aux,"
        " 2 x the gradient; for all: the logged scalars; DDP reducer payload: the gradient, for the ungated objectives)")
    json_path = Path(args.json)
    say.save(figures, json_path, Path(args.txt) if args.txt else json_path.with_suffix(".txt"))


if __name__ == "__main__":
    main()
