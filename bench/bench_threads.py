"""Benchmark: on a 2-core machine, do two one-thread training processes beat one two-thread process? (issue 13)

The standard results pack is hours of independent MiniLM runs, so the question is throughput:
training steps per second of the whole machine. Both settings train the ``standard`` preset's
config (rt-polarity, batch 32, length 48, random batches) with the real ``Trainer(...).fit()``;
an ``on_step`` hook records ``time.perf_counter()`` after each optimizer step, and the time of
steps ``--warm``..``--warm + --steps`` is the measure (model loading, tokenization and the final
evaluation are not timed).

* **one process, 2 threads**: one run, ``num_threads=2``;
* **two processes, 1 thread each**: two runs at once (seeds 0 and 1), ``num_threads=1``.

Machine throughput = processes / (seconds per step). Run it on a quiet machine::

    .venv/bin/python bench/bench_threads.py --json bench/results/threads.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_run(threads: int, seed: int, steps: int, warm: int, objective: str, out: str) -> float:
    """Train ``warm + steps`` steps in this process; return seconds per step over the last ``steps``."""
    import torch

    torch.set_num_threads(threads)
    from acl_lab.presets import preset_config
    from acl_lab.trainer import Trainer

    cfg = preset_config("standard", task="rt-polarity", objective=objective, seed=seed, max_steps=warm + steps,
                        eval_every=10_000, max_eval_samples=32, num_threads=threads, output_dir=out,
                        save_checkpoints=False)
    trainer = Trainer(cfg, overwrite=True, progress=False)
    stamps: list[float] = []
    trainer.on_step.append(lambda t, row: stamps.append(time.perf_counter()))
    trainer.fit()
    return (stamps[-1] - stamps[warm - 1]) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--objective", default="ce")
    ap.add_argument("--json", default="bench/results/threads.json")
    ap.add_argument("--worker", nargs=3, metavar=("THREADS", "SEED", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        threads, seed, out = int(a.worker[0]), int(a.worker[1]), a.worker[2]
        print(json.dumps({"s_per_step": one_run(threads, seed, a.steps, a.warm, a.objective, out)}))
        return

    def launch(threads: int, seed: int, tmp: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--steps", str(a.steps), "--warm", str(a.warm),
                                 "--objective", a.objective, "--worker", str(threads), str(seed),
                                 f"{tmp}/run{seed}"], stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def result(p: subprocess.Popen) -> float:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a benchmark worker failed (exit {p.returncode})")
        return json.loads(out.strip().splitlines()[-1])["s_per_step"]

    with tempfile.TemporaryDirectory() as tmp:
        one = result(launch(2, 0, tmp))
        pair = [result(p) for p in [launch(1, 0, tmp), launch(1, 1, tmp)]]
    report = {"objective": a.objective, "steps": a.steps, "warm": a.warm,
              "one_process_2_threads_s_per_step": round(one, 3),
              "two_processes_1_thread_s_per_step": [round(s, 3) for s in pair],
              "steps_per_s_one_process": round(1 / one, 3),
              "steps_per_s_two_processes": round(sum(1 / s for s in pair), 3)}
    report["two_over_one"] = round(report["steps_per_s_two_processes"] / report["steps_per_s_one_process"], 3)
    text = (f"one process, 2 threads: {one:.3f} s/step -> {1 / one:.3f} steps/s\n"
            f"two processes, 1 thread each: {pair[0]:.3f} and {pair[1]:.3f} s/step -> "
            f"{report['steps_per_s_two_processes']:.3f} steps/s\n"
            f"machine throughput, two processes / one: {report['two_over_one']:.2f}x")
    print(text)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=1))
    Path(a.json).with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
