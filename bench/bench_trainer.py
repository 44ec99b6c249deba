"""Benchmark: acl_lab's trainer against Hugging Face ``transformers.Trainer``, and early-exit speed-ups.

Commands (from the repository root)::

    .venv/bin/python bench/bench_trainer.py            # full run (about 35 min on an idle 2-core machine)
    .venv/bin/python bench/bench_trainer.py --quick    # sanity run (about 5 min)
    # throughput only, with and without length-grouped batches on both sides (issue 14):
    .venv/bin/python bench/bench_trainer.py --skip-early-exit --grouped --repeats 1 --warm-steps 3 --steps 20 \
        --json bench/results/trainer_grouped.json

On a loaded machine run the two parts as two processes, e.g. (what produced
bench/results/trainer*.json, with load average 5-10 on 2 cores; the two JSONs
were then merged into trainer.json)::

    .venv/bin/python bench/bench_trainer.py --skip-early-exit --json bench/results/trainer_throughput.json
    .venv/bin/python bench/bench_trainer.py --skip-throughput --ee-steps 150 --ee-eval-every 75 \
        --json bench/results/trainer_early_exit.json

Writes ``--json`` (default ``bench/results/trainer.json``) and the printed report
as ``--txt`` (default: the JSON path with ``.txt``). ``--skip-throughput`` /
``--skip-early-exit`` run one part only.

Threads: ``--threads`` (default 1) is applied with ``torch.set_num_threads``
(and ``TrainConfig.num_threads`` for acl_lab runs), so both trainers and the
early-exit passes use the same. One thread because the machine is shared: with
2 threads on 2 cores, any other busy process makes the OpenMP threads wait on
each other and a step gets 3-5x slower, erratically (measured). On an idle
machine ``--threads 2`` is the faster setting.

(a) Training throughput, objective ``ce``. Both sides fine-tune the pretrained
MiniLM-L6 (``acl_lab.assets.model_dir()``) on the same rt-polarity train subset
(``--train-samples``, default 2000, tokenized once by ``acl_lab.data.tokenize``
with max length 64, no padding), batch 32, dynamic padding
(``DataCollatorWithPadding`` on both sides), lr 5e-5, weight decay 0.01, linear
schedule with 10% warm-up, gradient clipping at 1.0, float32 on CPU, no
evaluation and no checkpoint saving during training, ``--warm-steps`` +
``--steps`` optimizer steps per run (defaults 5 + 30), one thread each.

* acl_lab: the real ``acl_lab.trainer.Trainer(...).fit()`` with ``eval_every`` > max_steps.
  An ``on_step`` hook (the trainer's public seam) records
  ``time.perf_counter()`` when each step returns; nothing else changes.
  Model: ``MultiExitClassifier`` (BertModel without pooler + dropout + linear on [CLS]).
* HF: ``transformers.Trainer`` with its defaults otherwise (``optim="adamw_torch_fused"``,
  the default for torch >= 2.8, set explicitly; ``dataloader_num_workers=0`` as acl_lab),
  on ``BertForSequenceClassification`` (pooler + dropout + linear), eval and save
  strategies "no", logging "no", ``report_to="none"``. A ``TrainerCallback``
  records ``time.perf_counter()`` at ``on_step_end``.

Timed on both sides: the wall-clock from the end of warm-up step W to the end of
step W + N, i.e. N complete steps each with batch fetching and collation,
forward, backward, clipping, optimizer step, scheduler step and the trainer's
own per-step bookkeeping (acl_lab: its history.jsonl line; HF: its callbacks and
loss tracking). Not timed: model loading, tokenization, the trainer's set-up,
the W warm-up steps, and acl_lab's final evaluation / representation dump
after training. Runs go in the order acl_lab, HF, HF, acl_lab, ... (ABBA, so a
linear drift in machine load cancels; ``--repeats`` runs per side, default 2); the
report gives the median samples/s of each side and the ratio acl_lab / HF
(target >= 1.0). With ``--grouped`` both sides also run with length-grouped
batches on equal settings -- acl_lab ``TrainConfig(group_by_length=True)``
(``acl_lab.data.make_loader``, HF's ``LengthGroupedSampler`` seeded by the run's
seed), HF ``train_sampling_strategy="group_by_length"`` (the same sampler, on the
global RNG) -- in the order acl_lab, HF, HF grouped, acl_lab grouped (reversed
on the next repeat); the report adds the grouped ratio acl_lab / HF, each side's
speed-up from grouping and the mean padded length of the timed steps (from the
batches each side's collator produced). Besides wall-clock, every run records the process CPU time
(``time.process_time``) over the same steps, and the report gives samples per
CPU-second too: with one torch thread on a machine loaded by other jobs, CPU time
is inflated far less than wall-clock by the load (runs are sequential, minutes
apart, so their wall-clock ratios carry the load's drift). Each run's whole-run figure (acl_lab ``train_seconds``, HF
``train_runtime``) is kept in the JSON for reference. A micro-benchmark of
the optimizer step alone (acl_lab's AdamW vs fused AdamW on the same
parameters) is printed too, to explain a gap if there is one.

(b) Early exit. ``train()`` of ``me-ce`` and ``me-acl-cl`` (defaults: 300 steps,
2000 train samples (4.8 epochs), seed 0; dev evaluated every 100 steps on a
fixed 500-sample subset of dev (``--ee-select-samples``) to pick the best
checkpoint), then the best checkpoint (``load_trained``) is evaluated on the
full rt-polarity dev split, batch size 64, with ``acl_lab.early_exit.sweep``
(criterion entropy, thresholds ``--thresholds``): accuracy, mean exit layer,
layer speed-up (6 / mean layer) and sweep()'s own wall-clock speed-up (it times
the full model once, then each threshold, best of ``--sweep-repeats``). Because
this machine is shared, the headline wall-clock speed-up is measured again
interleaved: for every dev batch the full model (``full_predict``) and each
threshold's ``early_exit_predict`` run back to back in a rotating order, and
speed-up = total full time / total early-exit time (``--paired-rounds``
passes). Reported per model: full-model accuracy, per threshold accuracy, mean
exit layer, layer and wall-clock speed-ups, and the best (interleaved)
wall-clock speed-up with at most 0.01 accuracy lost (target >= 2x).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from report import Report  # noqa: E402  (bench/report.py, beside this script)

from acl_lab.assets import model_dir  # noqa: E402
from acl_lab.checkpoint import load_trained  # noqa: E402
from acl_lab.config import TrainConfig  # noqa: E402
from acl_lab.data import load_task, make_loader, tokenize  # noqa: E402
from acl_lab.early_exit import early_exit_predict, full_predict, sweep  # noqa: E402
from acl_lab.tasks import get_task  # noqa: E402
from acl_lab.trainer import Trainer, make_optimizer, train  # noqa: E402

TASK = "rt-polarity"
MODEL = "minilm-l6"
BATCH = 32
MAX_LEN = 64
LR, WD, WARMUP, CLIP = 5e-5, 0.01, 0.1, 1.0
EVAL_BATCH = 64
DROP_TOLERANCE = 0.01


def _load_avg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


# ---------------------------------------------------------------------------
# (a) throughput
# ---------------------------------------------------------------------------

def _padded(stamps_len: list[int], w: int, n: int) -> float:
    """Mean padded length of the timed steps W+1..W+N."""
    return statistics.fmean(stamps_len[w:w + n])


def run_acl_lab(args, work: Path, tag: str, grouped: bool = False) -> dict:
    total = args.warm_steps + args.steps
    cfg = TrainConfig(task=TASK, model=MODEL, objective="ce", seed=args.seed, batch_size=BATCH, max_length=MAX_LEN,
                      group_by_length=grouped,
                      lr=LR, weight_decay=WD, warmup_ratio=WARMUP, max_grad_norm=CLIP,
                      max_train_samples=args.train_samples, max_steps=total, eval_every=total + 1,
                      save_checkpoints=False, max_eval_samples=64, output_dir=str(work / f"acl-ce-{tag}"),
                      num_threads=args.threads)
    stamps: list[float] = []
    cpu: list[float] = []
    lengths: list[int] = []
    trainer = Trainer(cfg, overwrite=True, progress=False)
    inner = trainer.step  # the public step, timed from outside

    def timed_step(group):
        row = inner(group)
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        lengths.append(int(group[0]["input_ids"].shape[1]))
        return row

    trainer.step = timed_step
    result = trainer.fit()
    shutil.rmtree(work / f"acl-ce-{tag}", ignore_errors=True)
    w, n = args.warm_steps, args.steps
    steady = stamps[w + n - 1] - stamps[w - 1]
    steady_cpu = cpu[w + n - 1] - cpu[w - 1]
    return {"side": "acl_lab grouped" if grouped else "acl_lab", "steady_seconds": steady,
            "samples_per_s": n * BATCH / steady, "cpu_seconds": steady_cpu, "samples_per_cpu_s": n * BATCH / steady_cpu, "whole_run_seconds": result.metrics["train_seconds"],
            "steps": len(stamps), "mean_padded_length": _padded(lengths, w, n)}


def run_hf(args, enc_train, tokenizer, work: Path, tag: str, grouped: bool = False) -> dict:
    from transformers import (BertForSequenceClassification, DataCollatorWithPadding, Trainer, TrainerCallback,
                              TrainingArguments)

    total = args.warm_steps + args.steps
    stamps: list[float] = []
    cpu: list[float] = []
    lengths: list[int] = []

    class Collator(DataCollatorWithPadding):
        def __call__(self, features):
            batch = super().__call__(features)
            lengths.append(int(batch["input_ids"].shape[1]))
            return batch

    class Stamp(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

    torch.manual_seed(args.seed)
    model = BertForSequenceClassification.from_pretrained(str(model_dir()), num_labels=2)
    targs = TrainingArguments(
        output_dir=str(work / f"hf-{tag}"), per_device_train_batch_size=BATCH, max_steps=total,
        learning_rate=LR, weight_decay=WD, warmup_steps=WARMUP, lr_scheduler_type="linear", max_grad_norm=CLIP,
        eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False, seed=args.seed,
        train_sampling_strategy="group_by_length" if grouped else "random", optim="adamw_torch_fused",
    )
    trainer = Trainer(model=model, args=targs, train_dataset=enc_train, processing_class=tokenizer,
                      data_collator=Collator(tokenizer), callbacks=[Stamp()])
    out = trainer.train()
    shutil.rmtree(work / f"hf-{tag}", ignore_errors=True)
    w, n = args.warm_steps, args.steps
    steady = stamps[w + n - 1] - stamps[w - 1]
    # the collator runs once per batch fetched; HF fetches batch k before step k, so lengths[k] is step k+1's
    steady_cpu = cpu[w + n - 1] - cpu[w - 1]
    return {"side": "hf grouped" if grouped else "hf", "steady_seconds": steady, "samples_per_s": n * BATCH / steady,
            "cpu_seconds": steady_cpu, "samples_per_cpu_s": n * BATCH / steady_cpu,
            "whole_run_seconds": out.metrics.get("train_runtime"), "steps": len(stamps), "optim": str(targs.optim),
            "mean_padded_length": _padded(lengths, w, n)}


def optimizer_micro(args) -> dict:
    """Time one optimizer step alone: acl_lab's AdamW (``trainer.make_optimizer``) vs fused AdamW, same parameters."""
    from acl_lab.model import build_model

    model, _ = build_model(MODEL, 2)
    cfg = TrainConfig(objective="ce")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {"acl_lab AdamW": make_optimizer(model, cfg),
            "fused AdamW": torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)}
    res = {}
    for name, opt in opts.items():
        opt.step()  # allocate state
    times = {name: [] for name in opts}
    for _ in range(args.opt_reps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        res[name] = 1000 * statistics.median(ts)
    defaults = opts["acl_lab AdamW"].defaults
    res["acl_lab_flags"] = {k: defaults.get(k) for k in ("foreach", "fused")}
    return res


def throughput(args, say: Report, work: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    data = load_task(TASK, max_train_samples=args.train_samples, seed=args.seed, max_eval_samples=64)
    enc = tokenize(data, tok, MAX_LEN)
    runs = []
    sides = ("acl_lab", "hf", "hf grouped", "acl_lab grouped") if args.grouped else ("acl_lab", "hf")
    for r in range(args.repeats):
        for side in (sides if r % 2 == 0 else sides[::-1]):  # ABBA order: linear drift cancels
            load = _load_avg()
            grouped = side.endswith("grouped")
            res = (run_acl_lab(args, work, str(r), grouped) if side.startswith("acl_lab")
                   else run_hf(args, enc["train"], tok, work, str(r), grouped))
            res["repeat"], res["load_avg_before"] = r, load
            runs.append(res)
            say(f"  repeat {r + 1}/{args.repeats} {side:<16} {res['samples_per_s']:7.1f} samples/s, "
                f"{res['samples_per_cpu_s']:5.1f} per CPU-s ({args.steps} steps in {res['steady_seconds']:.1f}s, "
                f"{res['cpu_seconds']:.1f} CPU-s; mean padded length "
                f"{res['mean_padded_length']:.1f}; whole run {res['whole_run_seconds']:.1f}s; load avg before {load})")
    per_side = {side: [r["samples_per_s"] for r in runs if r["side"] == side] for side in sides}
    med = {side: statistics.median(v) for side, v in per_side.items()}
    per_cpu = {side: statistics.median(r["samples_per_cpu_s"] for r in runs if r["side"] == side) for side in sides}
    paired = [a / h for a, h in zip(per_side["acl_lab"], per_side["hf"])]
    opt = optimizer_micro(args)
    out = {"runs": runs, "acl_lab_samples_per_s": med["acl_lab"], "hf_samples_per_s": med["hf"],
           "ratio": med["acl_lab"] / med["hf"], "paired_ratios": paired,
           "samples_per_cpu_s": per_cpu, "cpu_ratio": per_cpu["acl_lab"] / per_cpu["hf"],
           "optimizer_step_ms": opt, "hf_optim": next(r["optim"] for r in runs if r["side"] == "hf")}
    if args.grouped:
        out.update(grouped_samples_per_s={s: med[s] for s in ("acl_lab grouped", "hf grouped")},
                   grouped_ratio=med["acl_lab grouped"] / med["hf grouped"],
                   grouping_speedup={"acl_lab": med["acl_lab grouped"] / med["acl_lab"],
                                     "hf": med["hf grouped"] / med["hf"]},
                   grouped_cpu_ratio=per_cpu["acl_lab grouped"] / per_cpu["hf grouped"],
                   grouping_cpu_speedup={"acl_lab": per_cpu["acl_lab grouped"] / per_cpu["acl_lab"],
                                         "hf": per_cpu["hf grouped"] / per_cpu["hf"]},
                   mean_padded_length={s: statistics.fmean(r["mean_padded_length"] for r in runs if r["side"] == s)
                                       for s in sides})
    return out


# ---------------------------------------------------------------------------
# (b) early exit
# ---------------------------------------------------------------------------

def paired_wall_speedups(model, loader, thresholds, rounds: int) -> dict[float, float]:
    """Wall-clock speed-up of each threshold, timed interleaved with the full model batch by batch.

    For every dev batch the full model (``full_predict``) and each threshold's
    ``early_exit_predict`` run back to back, in an order rotated per batch, so a
    burst of load from other processes hits all of them alike. Speed-up =
    total full-model time / total early-exit time over all batches and rounds.
    """
    batches = [{k: v for k, v in b.items() if k != "labels"} for b in loader]
    names = ["full", *thresholds]
    total = {n: 0.0 for n in names}
    i = 0
    for _ in range(rounds):
        for b in batches:
            order = names[i % len(names):] + names[:i % len(names)]
            i += 1
            for n in order:
                t0 = time.perf_counter()
                if n == "full":
                    full_predict(model, **b)
                else:
                    early_exit_predict(model, criterion="entropy", threshold=n, **b)
                total[n] += time.perf_counter() - t0
    return {thr: total["full"] / total[thr] for thr in thresholds}


def early_exit(args, say: Report, work: Path) -> dict:
    task = get_task(TASK)
    device = torch.device("cpu")
    out = {}
    for objective in ("me-ce", "me-acl-cl"):
        cfg = TrainConfig(task=TASK, model=MODEL, objective=objective, seed=args.seed, batch_size=BATCH,
                          max_length=MAX_LEN, max_train_samples=args.ee_train_samples, max_steps=args.ee_steps,
                          max_eval_samples=args.ee_select_samples, eval_every=args.ee_eval_every,
                          save_checkpoints=False, output_dir=str(work / objective), num_threads=args.threads)
        t0 = time.perf_counter()
        result = train(cfg, overwrite=True, progress=False)
        train_wall = time.perf_counter() - t0
        model, tok, _ = load_trained(result.paths["best"], device="cpu")
        data = load_task(TASK, max_train_samples=64, max_eval_samples=args.ee_eval_samples, seed=args.seed)
        enc = tokenize(data, tok, MAX_LEN)
        loader = make_loader(enc["dev"], tok, EVAL_BATCH, shuffle=False)
        calls = []
        for _ in range(args.sweeps):
            calls.append(sweep(model, loader, task, "entropy", args.thresholds, device, repeats=args.sweep_repeats))
        paired = paired_wall_speedups(model, loader, args.thresholds, args.paired_rounds)
        rows = []
        for i, thr in enumerate(args.thresholds):
            row = dict(calls[0][i])
            row["sweep_wall_speedup_each_call"] = [c[i]["wall_speedup"] for c in calls]
            row["sweep_wall_speedup"] = statistics.median(row["sweep_wall_speedup_each_call"])
            row["wall_speedup"] = paired[thr]
            row["seconds"] = statistics.median(c[i]["seconds"] for c in calls)
            row["full_seconds"] = statistics.median(c[i]["full_seconds"] for c in calls)
            rows.append(row)
        full_acc = rows[0]["full_accuracy"]
        ok = [r for r in rows if r["quality_drop"] <= DROP_TOLERANCE + 1e-9]
        best = max(ok, key=lambda r: r["wall_speedup"]) if ok else None
        out[objective] = {
            "train_steps": result.metrics["steps"], "best_step": result.metrics["best_step"],
            "train_seconds": result.metrics["train_seconds"], "train_wall_seconds": train_wall,
            "dev_per_exit_accuracy": [e.get("accuracy") for e in result.metrics.get("dev_per_exit", [])],
            "dev_samples": len(enc["dev"]), "full_accuracy": full_acc, "rows": rows,
            "best_within_1pt": None if best is None else {k: best[k] for k in (
                "threshold", "accuracy", "quality_drop", "mean_exit_layer", "layer_speedup", "wall_speedup",
                "sweep_wall_speedup")},
        }
        say(f"\n  {objective}: trained {result.metrics['steps']} steps in {result.metrics['train_seconds']:.0f}s "
            f"(best dev step {result.metrics['best_step']}); dev samples {len(enc['dev'])}")
        say(f"  per-exit accuracy (layers 1-6) on the {args.ee_select_samples}-sample dev selection subset, best "
            "checkpoint: " + " ".join(f"{a:.3f}" for a in out[objective]["dev_per_exit_accuracy"]))
        say(f"  full model (6 layers) dev accuracy: {full_acc:.4f}; full pass {rows[0]['full_seconds']:.2f}s")
        say(f"  {'entropy thr':>11} {'accuracy':>9} {'drop':>7} {'mean layer':>11} {'layer x':>8} {'wall x':>7}"
            f" {'sweep() wall x':>15}")
        for r in rows:
            each = ", ".join(f"{x:.2f}" for x in r["sweep_wall_speedup_each_call"])
            say(f"  {r['threshold']:>11.2f} {r['accuracy']:>9.4f} {r['quality_drop']:>7.4f} {r['mean_exit_layer']:>11.2f}"
                f" {r['layer_speedup']:>7.2f}x {r['wall_speedup']:>6.2f}x {'[' + each + ']':>15}")
        say("  (wall x: interleaved per-batch timing against the full model; sweep() wall x: sweep()'s own figure,"
            " full model timed before the thresholds, so exposed to load changes between them)")
        if best:
            say(f"  best wall-clock speed-up with <= {DROP_TOLERANCE} accuracy lost: {best['wall_speedup']:.2f}x at "
                f"threshold {best['threshold']} (accuracy {best['accuracy']:.4f}, mean layer "
                f"{best['mean_exit_layer']:.2f}, layer speed-up {best['layer_speedup']:.2f}x) -> target >= 2x "
                f"{'MET' if best['wall_speedup'] >= 2.0 else 'NOT MET'}")
        else:
            say(f"  no threshold loses <= {DROP_TOLERANCE} accuracy -> target >= 2x NOT MET")
        shutil.rmtree(work / objective, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a fast sanity run")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "trainer.json"))
    p.add_argument("--txt", default=None, help="copy of the printed report (default: JSON path with .txt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=2000, help="(a) train subset")
    p.add_argument("--warm-steps", type=int, default=None, help="(a) untimed steps per run (default 5; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="(a) timed steps per run (default 30; quick 4)")
    p.add_argument("--repeats", type=int, default=None, help="(a) runs per side, order ABBA... (default 2; quick 1)")
    p.add_argument("--opt-reps", type=int, default=None, help="(a) optimizer micro-benchmark steps (default 20)")
    p.add_argument("--grouped", action="store_true",
                   help="(a) also time both sides with length-grouped batches (acl_lab group_by_length=True, HF "
                        "train_sampling_strategy='group_by_length'); order acl_lab, hf, hf grouped, acl_lab grouped")
    p.add_argument("--ee-steps", type=int, default=None, help="(b) training steps per model (default 300; quick 20)")
    p.add_argument("--ee-train-samples", type=int, default=None, help="(b) train subset (default 2000; quick 320)")
    p.add_argument("--ee-eval-samples", type=int, default=None, help="(b) dev subset swept (default: all; quick 256)")
    p.add_argument("--ee-select-samples", type=int, default=None,
                   help="(b) dev subset for choosing the best checkpoint during training (default 500; quick 128)")
    p.add_argument("--ee-eval-every", type=int, default=None, help="(b) steps between dev evals (default 100; quick 10)")
    p.add_argument("--thresholds", type=float, nargs="+", default=None,
                   help="(b) normalised-entropy thresholds (default 0.05 0.1 0.2 0.3 0.45)")
    p.add_argument("--sweeps", type=int, default=None, help="(b) sweep() calls, median of its speed-up (default 1)")
    p.add_argument("--sweep-repeats", type=int, default=None, help="(b) sweep()'s repeats (default 1)")
    p.add_argument("--paired-rounds", type=int, default=1, help="(b) rounds of interleaved timing (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see the module docstring)")
    p.add_argument("--work-dir", default=None, help="where runs write (default: a temp folder, removed after)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-early-exit", action="store_true")
    args = p.parse_args(argv)
    q = args.quick
    args.warm_steps = args.warm_steps or (2 if q else 5)
    args.steps = args.steps or (4 if q else 30)
    args.repeats = args.repeats or (1 if q else 2)
    args.opt_reps = args.opt_reps or (5 if q else 20)
    args.ee_steps = args.ee_steps or (20 if q else 300)
    args.ee_train_samples = args.ee_train_samples or (320 if q else 2000)
    args.ee_eval_samples = args.ee_eval_samples or (256 if q else None)
    args.ee_select_samples = args.ee_select_samples or (128 if q else 500)
    args.ee_eval_every = args.ee_eval_every or (10 if q else 100)
    args.thresholds = args.thresholds or ([0.1, 0.3, 0.5] if q else [0.05, 0.1, 0.2, 0.3, 0.45])
    args.sweeps = args.sweeps or 1
    args.sweep_repeats = args.sweep_repeats or 1
    torch.set_num_threads(args.threads)
    json_path = Path(args.json)
    txt_path = Path(args.txt) if args.txt else json_path.with_suffix(".txt")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="acl_bench_trainer_"))

    import transformers
    transformers.logging.set_verbosity_error()

    say = Report()
    say(f"bench_trainer: model={MODEL} task={TASK} batch={BATCH} max_length={MAX_LEN} device=cpu "
        f"threads={torch.get_num_threads()} torch={torch.__version__} transformers={transformers.__version__} "
        f"quick={q} load avg={_load_avg()}")
    out: dict = {"args": vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads()}
    if not args.skip_throughput:
        say(f"\n(a) training throughput, objective ce: {args.train_samples} train samples, {args.warm_steps} warm-up "
            f"+ {args.steps} timed steps per run, {args.repeats} run(s) per side, alternating")
        tp = throughput(args, say, work)
        out["throughput"] = tp
        ratio = tp["ratio"]
        say("")
        say(f"  {'side':<10} {'samples/s (median)':>19}")
        say(f"  {'acl_lab':<10} {tp['acl_lab_samples_per_s']:>19.1f}")
        say(f"  {'HF Trainer':<10} {tp['hf_samples_per_s']:>19.1f}")
        say(f"  ratio acl_lab / HF = {ratio:.3f} (paired per repeat: "
            + ", ".join(f"{x:.3f}" for x in tp["paired_ratios"]) + f") -> target >= 1.0 "
            f"{'MET' if ratio >= 1.0 else 'NOT MET'}")
        c = tp["samples_per_cpu_s"]
        say(f"  per CPU-second (process CPU time; steadier than wall-clock on a loaded machine): acl_lab "
            f"{c['acl_lab']:.1f}, HF {c['hf']:.1f}, ratio {tp['cpu_ratio']:.3f} -> target >= 1.0 "
            f"{'MET' if tp['cpu_ratio'] >= 1.0 else 'NOT MET'}")
        if args.grouped:
            g = tp["grouped_samples_per_s"]
            say(f"  {'acl_lab grouped':<16} {g['acl_lab grouped']:>13.1f}")
            say(f"  {'HF grouped':<16} {g['hf grouped']:>13.1f}")
            gr = tp["grouped_ratio"]
            say(f"  length-grouped, equal settings: ratio acl_lab / HF = {gr:.3f} -> target >= 1.0 "
                f"{'MET' if gr >= 1.0 else 'NOT MET'}; grouping speed-up acl_lab {tp['grouping_speedup']['acl_lab']:.2f}x,"
                f" HF {tp['grouping_speedup']['hf']:.2f}x; mean padded length of the timed steps: "
                + ", ".join(f"{s} {v:.1f}" for s, v in tp["mean_padded_length"].items()))
            gc = tp["grouping_cpu_speedup"]
            say(f"  per CPU-second: grouped ratio acl_lab / HF = {tp['grouped_cpu_ratio']:.3f} -> target >= 1.0 "
                f"{'MET' if tp['grouped_cpu_ratio'] >= 1.0 else 'NOT MET'}; grouping speed-up acl_lab "
                f"{gc['acl_lab']:.2f}x, HF {gc['hf']:.2f}x")
        o = tp["optimizer_step_ms"]
        say(f"  optimizer step alone (median of {args.opt_reps}): acl_lab AdamW {o['acl_lab AdamW']:.1f} ms "
            f"(flags {o['acl_lab_flags']}), fused AdamW {o['fused AdamW']:.1f} ms; HF optim = {tp['hf_optim']}")
    if not args.skip_early_exit:
        say(f"\n(b) early exit: train() of me-ce and me-acl-cl, {args.ee_steps} steps, {args.ee_train_samples} train "
            f"samples; sweep(entropy) on dev, batch {EVAL_BATCH}, {args.sweeps} sweep call(s) x best of "
            f"{args.sweep_repeats}")
        out["early_exit"] = early_exit(args, say, work)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)

    say.save(out, json_path, txt_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
