"""Benchmark: wall time of the smoke grid (notebooks/grids/seeds_smoke.yaml) with --jobs 1 and --jobs 2.

Command (from the repository root)::

    .venv/bin/python bench/bench_batch_jobs.py --rounds 2     # about 2 minutes on an idle 2-core machine

Each round runs ``python -m acl_lab batch notebooks/grids/seeds_smoke.yaml --no-resume``
once with ``--jobs 1`` and once with ``--jobs 2`` (the order alternates between
rounds), each into its own output folder under ``--output`` (default
``outputs/bench_batch_jobs``), and times the whole command (process start to exit).
It prints every time, the median per setting, the ratio, the load average before and
after each command, and the cores this process may use: on a shared machine, other
jobs change the times, so compare the ratio of runs measured interleaved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GRID = Path(__file__).resolve().parent.parent / "notebooks" / "grids" / "seeds_smoke.yaml"


def one(jobs: int, output: Path) -> float:
    """Seconds of one whole ``batch`` command; raises if it fails."""
    import yaml

    grid = yaml.safe_load(GRID.read_text())
    grid["output_dir"] = str(output / f"jobs{jobs}")
    path = output / f"grid_jobs{jobs}.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "acl_lab", "batch", str(path), "--no-resume", "--jobs", str(jobs)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_batch_jobs"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    from acl_lab.lab.workers import usable_cores

    print(f"smoke grid {GRID.name}: 2 runs of 00_tour (smoke preset); {usable_cores()} usable cores; "
          f"this machine may be loaded (other jobs running): see the load averages")
    times: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for jobs in ((1, 2) if r % 2 == 0 else (2, 1)):
            before = os.getloadavg()[0]
            seconds = one(jobs, args.output)
            times[jobs].append(seconds)
            print(f"round {r + 1}: --jobs {jobs}: {seconds:.1f} s (load average {before:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after)", flush=True)
    med = {j: statistics.median(t) for j, t in times.items()}
    print(f"median wall time: --jobs 1 {med[1]:.1f} s, --jobs 2 {med[2]:.1f} s; ratio jobs2/jobs1 "
          f"{med[2] / med[1]:.2f}")


if __name__ == "__main__":
    main()
