"""Benchmark: ACLTrainer in 2 gloo processes against 1 process with the same global batch, and what the exact gate sends.

Command (from the repository root)::

    .venv/bin/python bench/bench_hf_ddp.py                 # MiniLM-L6, global batch 16, 8 steps per run
    .venv/bin/python bench/bench_hf_ddp.py --model tiny    # seconds, a sanity run

For each variant -- ``acl-embed`` (ungated: one backward, DDP's own reducer syncs the gradient),
``acl`` with ``scope="all"`` (the exact gate: forward and backward under ``no_sync()``, then g_CE and
g_aux averaged in one flat all-reduce by ``acl_lab.distributed.all_reduce_mean``) and ``acl``
with ``scope="repr"`` (three sums averaged over ranks, then the one combined gradient averaged by the
gate, also under ``no_sync()``) -- it trains
``acl_lab.hf.ACLTrainer`` on rt-polarity (length 40, SGD, the same batches in the same order) once
in one process and once under ``torchrun --nproc_per_node 2`` (gloo, CPU), each process with ONE
torch thread, and reports the median wall time of an optimizer step (steps after the first two).
In the 2-process runs the time spent inside the gate's ``all_reduce_mean`` calls and the bytes they
reduced are recorded per step: that is the communication of the gated step (DDP's reducer sends
nothing then; ``acl-embed`` shows DDP's own).

Writes ``--json`` (default ``bench/results/hf_ddp.json``) and prints a table. The machine is
shared: the output states the load average before and after, and the ratios are what to read.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"acl-embed": dict(objective="acl-embed"), "acl-all": dict(objective="acl", scope="all"),
            "acl-repr": dict(objective="acl", scope="repr")}


def worker(variant: str, model_name: str, global_batch: int, steps: int) -> None:
    """One run (inside torchrun or alone); rank 0 prints a JSON line with the per-step timings."""
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback, TrainingArguments

    import acl_lab.hf as hf_module
    from acl_lab.data import load_task, tokenize
    from acl_lab.distributed import is_main
    from acl_lab.hf import ACLTrainer, sequence_classifier

    torch.set_num_threads(1)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    comm = {"seconds": 0.0, "bytes": 0, "calls": 0}
    reduce = hf_module.all_reduce_mean

    def timed_reduce(tensor):
        start = time.perf_counter()
        out = reduce(tensor)
        comm["seconds"] += time.perf_counter() - start
        comm["bytes"] += tensor.numel() * tensor.element_size() if processes > 1 else 0
        comm["calls"] += 1
        return out

    hf_module.all_reduce_mean = timed_reduce  # what ACLTrainer hands to ACLGrad(reduce=...)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.start)

    class Ordered(ACLTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    model, tokenizer = sequence_classifier(model_name, 2, seed=0, dropout=0.0)  # the same update in 1 and 2 processes
    data = tokenize(load_task("rt-polarity", max_train_samples=global_batch * steps, seed=0), tokenizer, 40)
    timer = StepTimer()
    trainer = Ordered(model=model, processing_class=tokenizer, train_dataset=data["train"], callbacks=[timer],
                      args=TrainingArguments(str(REPO / "outputs" / "bench_hf_ddp" / variant),
                                             per_device_train_batch_size=global_batch // processes, max_steps=steps,
                                             optim="sgd", learning_rate=0.01, logging_steps=1, report_to="none",
                                             save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                                             dataloader_pin_memory=False),
                      lam=0.1, **VARIANTS[variant])
    trainer.train()
    if is_main():
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print("RESULT " + json.dumps({"variant": variant, "processes": processes, "step_seconds": timer.times,
                                      "reduce_seconds_per_step": comm["seconds"] / steps,
                                      "reduce_bytes_per_step": comm["bytes"] / steps,
                                      "reduce_calls_per_step": comm["calls"] / steps, "parameters": n_params,
                                      "kept": [g["kept"] for g in trainer.gate_history]}), flush=True)


def launch(variant: str, processes: int, ns: argparse.Namespace) -> dict:
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
                              if processes > 1 else []) + \
          [__file__, "--worker", variant, "--model", ns.model, "--batch", str(ns.batch), "--steps", str(ns.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{variant} x{processes} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "hf_ddp.json"))
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker, ns.model, ns.batch, ns.steps)
        return
    load_before = os.getloadavg()
    rows = []
    for variant in VARIANTS:  # interleaved: 1 process, then 2, per variant
        for processes in (1, 2):
            r = launch(variant, processes, ns)
            r["median_step_seconds"] = statistics.median(r["step_seconds"][2:] or r["step_seconds"])
            rows.append(r)
            print(f"  {variant:10s} x{processes}: {r['median_step_seconds']:.3f} s/step", flush=True)
    load_after = os.getloadavg()
    out = {"model": ns.model, "global_batch": ns.batch, "steps": ns.steps, "load_before": load_before,
           "load_after": load_after, "runs": rows}
    Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nACLTrainer, {ns.model}, global batch {ns.batch}, {ns.steps} SGD steps per run, length 40, CPU, "
          f"1 torch thread per process; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          "(a shared machine: other jobs were running; read the ratios)")
    print(f"{'variant':10s} {'1 proc s/step':>14s} {'2 procs s/step':>15s} {'2p/1p':>6s} "
          f"{'gate all-reduce MB/step':>24s} {'s/step':>7s}")
    by = {(r["variant"], r["processes"]): r for r in rows}
    for variant in VARIANTS:
        one, two = by[(variant, 1)], by[(variant, 2)]
        print(f"{variant:10s} {one['median_step_seconds']:14.3f} {two['median_step_seconds']:15.3f} "
              f"{two['median_step_seconds'] / one['median_step_seconds']:6.2f} "
              f"{two['reduce_bytes_per_step'] / 1e6:24.1f} {two['reduce_seconds_per_step']:7.3f}")
    agree = {v: by[(v, 1)]["kept"] == by[(v, 2)]["kept"] for v in VARIANTS if by[(v, 1)]["kept"]}
    print("gate decisions identical in 1 and 2 processes (dropout 0, same batches):", agree)
    params = rows[0]["parameters"]
    print(f"trainable parameters: {params:,} (a float32 gradient is {params * 4 / 1e6:.1f} MB; DDP's reducer sends "
          "it once per step for acl-embed; the gated variants run under no_sync and the gate all-reduces instead)")


if __name__ == "__main__":
    main()
