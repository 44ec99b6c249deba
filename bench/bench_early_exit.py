"""Benchmark: early exit on well-trained multi-exit models, calibrated on dev (issue 14, part 2).

For each finished multi-exit run given (``--runs``; the standard-preset ``me-ce`` and ``me-acl-cl`` runs of
the results pack, trained by ``python -m acl_lab evidence --preset standard --parts early``), with its best
checkpoint:

1. **Calibrate on dev** (``acl_lab.early_exit.calibrate``): per criterion (entropy, DeeBERT; patience, PABEE),
   the threshold with the largest *layer* speed-up whose dev accuracy drop is at most ``--max-drop`` (one
   point). Its curve (layer speed-up and drop for every candidate threshold) goes into the JSON.
2. **Time it** (``acl_lab.early_exit.sweep`` at that threshold): the early-exit model and the full model run
   back to back on every batch, best of ``--repeats`` passes, so the load of a shared machine hits both alike.
   At batch size 64 (throughput, the whole split) and at batch size 1 (latency, the first
   ``--latency-samples`` samples), on dev (where the threshold was picked) and on test (held out).

Target: at least 2x wall-clock within 1 point of the full model's dev accuracy, for at least one model.
One torch thread (the machine's other core trains). Run::

    .venv/bin/python bench/bench_early_exit.py --runs outputs/standard/runs/me-ce-s0-* \
        outputs/standard/runs/me-acl-cl-s0-* --json bench/results/early_exit_standard.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from acl_lab.data import make_loader, tokenize  # noqa: E402
from acl_lab.early_exit import DROP_TOLERANCE, calibrate, load_for_exit, sweep  # noqa: E402

TARGET = 2.0
CRITERIA = ("entropy", "patience")


def bench_run(run: Path, args, say) -> dict:
    """Calibrate and time one run; return its JSON record."""
    model, tok, cfg, task, data = load_for_exit(run / "checkpoints" / "best", device="cpu")
    metric = task.main_metric
    enc = tokenize(type(data)({s: data[s] for s in ("dev", "test")}), tok, cfg.max_length)  # not the training split
    device = torch.device("cpu")
    metrics = json.loads((run / "metrics.json").read_text())
    per_exit = [e[metric] for e in metrics["dev_per_exit"]]
    say(f"\n{run.name}: {cfg.objective} seed {cfg.seed}, {cfg.task}, length {cfg.max_length}; dev {len(enc['dev'])}, "
        f"test {len(enc['test'])} samples; per-exit dev {metric} " + " ".join(f"{a:.3f}" for a in per_exit))
    out = {"run": run.name, "objective": cfg.objective, "seed": cfg.seed, "task": cfg.task,
           "dev_per_exit": per_exit, "criteria": {}}
    for criterion in CRITERIA:
        t0 = time.perf_counter()
        cal = calibrate(model, make_loader(enc["dev"], tok, 64, shuffle=False), task, criterion,
                        max_drop=args.max_drop, device=device)
        curve = cal.pop("table")
        rec = {"calibration": cal, "curve": curve.to_dict("records"), "timed": []}
        say(f"  {criterion}: calibrated threshold {cal['threshold']:g} (dev {metric} {cal['dev_' + metric]:.4f} vs "
            f"full {cal['full_dev_' + metric]:.4f}, drop {cal['quality_drop']:.4f}, mean exit layer "
            f"{cal['mean_exit_layer']:.2f}, layer speed-up {cal['layer_speedup']:.2f}x; {time.perf_counter() - t0:.0f} s)")
        say(f"    {'split':>5} {'batch':>5} {'samples':>7} {metric:>9} {'full':>7} {'drop':>7} {'layer x':>8} "
            f"{'wall x':>7} {'early s':>8} {'full s':>7}")
        for split in ("dev", "test"):
            for batch in (64, 1):
                ds = enc[split] if batch > 1 else enc[split].select(range(min(args.latency_samples, len(enc[split]))))
                row = sweep(model, make_loader(ds, tok, batch, shuffle=False), task, criterion, [cal["threshold"]],
                            device, repeats=args.repeats)[0]
                row.update(split=split, batch_size=batch, samples=len(ds))
                rec["timed"].append(row)
                say(f"    {split:>5} {batch:>5} {len(ds):>7} {row[metric]:>9.4f} {row['full_' + metric]:>7.4f} "
                    f"{row['quality_drop']:>7.4f} {row['layer_speedup']:>7.2f}x {row['wall_speedup']:>6.2f}x "
                    f"{row['seconds']:>8.2f} {row['full_seconds']:>7.2f}")
        dev_rows = [r for r in rec["timed"] if r["split"] == "dev"]
        whole_dev = next(r for r in dev_rows if r["batch_size"] > 1)  # the quality is judged on the whole split;
        # the batch-1 rows time a subset (the same per-sample exits, so the same predictions on it)
        rec["met"] = bool((not cal["fallback"]) and whole_dev["quality_drop"] <= args.max_drop + DROP_TOLERANCE
                          and any(r["wall_speedup"] >= TARGET for r in dev_rows))
        out["criteria"][criterion] = rec
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", type=Path, required=True, help="finished multi-exit run folders")
    p.add_argument("--max-drop", type=float, default=0.01, help="dev accuracy budget (default 0.01: one point)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per setting, the fastest kept (default 2)")
    p.add_argument("--latency-samples", type=int, default=300, help="samples timed at batch size 1 (default 300)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "early_exit_standard.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"bench_early_exit: threads={args.threads} torch={torch.__version__} machine={platform.processor() or '?'} "
        f"cpus={os.cpu_count()} load avg={os.getloadavg()[0]:.2f}; budget {args.max_drop:g} dev accuracy; "
        f"command: {' '.join(sys.argv)}")
    results = [bench_run(run, args, say) for run in args.runs]
    say("")
    for r in results:
        for criterion, rec in r["criteria"].items():
            best = max(rec["timed"], key=lambda row: row["wall_speedup"] if row["split"] == "dev" else 0)
            say(f"{r['objective']} {criterion}: best dev wall-clock speed-up {best['wall_speedup']:.2f}x at batch "
                f"{best['batch_size']} (drop {best['quality_drop']:.4f}) -> target >= {TARGET:g}x within "
                f"{args.max_drop:g}: {'MET' if rec['met'] else 'NOT MET'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": " ".join(sys.argv), "load_avg": os.getloadavg(),
                                     "results": results}, indent=1, default=float))
    args.json.with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
