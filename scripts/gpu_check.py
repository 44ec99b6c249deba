"""Measurements for scripts/gpu_check.sh (run that; it calls this after the smoke suite and appends here to its report).

Parts, each timed on ``--device`` (cuda on a GPU; cpu in the test suite, with ``--tiny``):

1. one training-step time per objective, float32 and bf16 autocast, ``full`` preset shapes (MiniLM-L6, batch 32,
   length 128): after one untimed warm-up run of K steps (the process's first CUDA kernels, cuBLAS handles and
   autotuning land there), ``train()`` runs K and K+N steps on the same data, and the step time is the difference
   of their ``train_seconds`` over N (model loading and the final evaluation cancel out). A difference that is not
   positive is timing noise, reported as an error, never as 0 s (the first H200 run, without the warm-up and with
   N=5, printed 0 s for CE);
2. the exact ACL-Grad gate (``scope="all"``: CE backward into .grad plus one ``autograd.grad`` of the ACL term)
   against one batched VJP (``autograd.grad(stack([ce, acl]), params, eye(2), is_grads_batched=True)``, both
   gradients in one vmapped backward), each with its forward pass, as a ratio to a CE-only step on the same batch;
3. the exact gate's angle in bf16 against float32 on the same batches and weights (dropout off);
4. the ``screened`` angle scope, where this version of the kit has it (skipped with a note otherwise).

Appends markdown to ``--report``, ending with the same numbers as a fenced JSON block (one report file).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from acl_lab.config import ANGLE_SCOPES, OBJECTIVES, TrainConfig
from acl_lab.data import load_task, make_loader, tokenize
from acl_lab.grad import ACLGrad, _cosine
from acl_lab.model import build_model
from acl_lab.objectives import compute_losses
from acl_lab.presets import preset_config
from acl_lab.tasks import get_task
from acl_lab.trainer import train
from acl_lab.utils import autocast, get_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shapes(tiny: bool) -> dict:
    """The full preset's shapes, or tiny ones for the CPU test of this script."""
    if tiny:
        return dict(model="tiny", batch_size=8, max_length=16, k=1, n=4, reps=1, gate_batches=2,
                    objectives=("ce", "acl", "me-acl-cl"))
    full = preset_config("full")
    return dict(model=full.model, batch_size=full.batch_size, max_length=full.max_length, k=3, n=20, reps=10,
                gate_batches=8, objectives=OBJECTIVES)


def step_time(objective: str, amp: str, device: str, sh: dict, work: Path, **extra) -> tuple[float, list[dict]]:
    """Seconds per optimizer step (see module docstring); also the longer run's history."""
    seconds, history = [], []
    for steps in (sh["k"], sh["k"], sh["k"] + sh["n"]):  # the first is the warm-up, not timed
        cfg = preset_config("full", model=sh["model"], objective=objective, amp=amp, device=device,
                            batch_size=sh["batch_size"], max_length=sh["max_length"], max_steps=steps,
                            max_train_samples=sh["batch_size"] * (sh["k"] + sh["n"]), max_eval_samples=32,
                            eval_every=10**6, save_checkpoints=False, num_threads=1 if device == "cpu" else None,
                            output_dir=str(work / f"{objective}-{amp}-{steps}-{'-'.join(map(str, extra.values()))}"),
                            **extra)
        res = train(cfg, overwrite=True, progress=False)
        seconds.append(res.metrics["train_seconds"])
        history = res.history
    per_step = (seconds[2] - seconds[1]) / sh["n"]
    if not per_step > 0:
        raise RuntimeError(f"{sh['k'] + sh['n']} steps took {seconds[2]:.2f} s, not more than {sh['k']} steps' "
                           f"{seconds[1]:.2f} s: timing noise; rerun on a quiet device or raise N in shapes()")
    return per_step, history


def fixed_batches(sh: dict, device: torch.device, count: int):
    task = get_task("rt-polarity")
    model, tok = build_model(sh["model"], task.num_labels, dropout=0.0, seed=0)
    data = load_task("rt-polarity", max_train_samples=sh["batch_size"] * count, seed=0)
    enc = tokenize(data, tok, sh["max_length"])
    loader = make_loader(enc["train"], tok, sh["batch_size"], shuffle=False)
    batches = [{k: v.to(device) for k, v in b.items()} for _, b in zip(range(count), loader)]
    return model.to(device), batches


def gate_costs(sh: dict, device: torch.device) -> dict:
    """Part 2: CE step, exact gate, batched VJP; median seconds over ``reps`` and ratios to CE."""
    cfg = TrainConfig(objective="acl", model=sh["model"]).validate()
    model, batches = fixed_batches(sh, device, 1)
    batch = batches[0]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    gate = ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="all")

    def losses():
        out = model(**batch)
        return compute_losses(model, out, batch["labels"], cfg)

    def ce_only():
        losses().ce.backward()

    def exact():
        lp = losses()
        gate.backward(lp.ce, lp.aux)

    def batched_vjp():
        lp = losses()
        stacked = torch.stack([lp.ce.reshape(()), lp.aux.reshape(())])
        eye = torch.eye(2, dtype=stacked.dtype, device=stacked.device)
        both = torch.autograd.grad(stacked, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
        cos = _cosine([g[0] if g is not None else None for g in both], [g[1] if g is not None else None for g in both])
        assert math.isfinite(cos)

    variants = {"ce step": ce_only, "exact gate (all)": exact, "batched VJP": batched_vjp}
    out: dict = {}
    times = {name: [] for name in variants}
    for rep in range(sh["reps"] + 1):  # the first round warms up
        for name, fn in variants.items():
            model.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - e.g. an op without a vmap rule: reported, not fatal
                out[f"{name} error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                continue
            _sync(device)
            if rep:
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        if ts:
            out[f"{name} s"] = statistics.median(ts)
    for name in ("exact gate (all)", "batched VJP"):
        if f"{name} s" in out and out.get("ce step s"):
            out[f"{name} / ce"] = out[f"{name} s"] / out["ce step s"]
    return out


def bf16_angles(sh: dict, device: torch.device) -> dict:
    """Part 3: the exact gate's angle in bf16 vs float32 on the same batches and weights, dropout off."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return {"skipped": "this GPU has no bf16"}
    cfg = TrainConfig(objective="acl", model=sh["model"]).validate()
    model, batches = fixed_batches(sh, device, sh["gate_batches"])
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    pairs = []
    for batch in batches:
        angles = []
        for dtype in (None, torch.bfloat16):
            gate = ACLGrad(params, lam=1.0, threshold=cfg.threshold, scope="all")
            with autocast(device, dtype):
                out = model(**batch)
            lp = compute_losses(model, out, batch["labels"], cfg)
            angles.append(gate.backward(lp.ce, lp.aux).angle)
            model.zero_grad(set_to_none=True)
        pairs.append(angles)
    diffs = [abs(a - b) for a, b in pairs]
    return {"batches": len(pairs), "fp32 angles": [round(a, 2) for a, _ in pairs],
            "max |bf16 - fp32| deg": max(diffs), "median |bf16 - fp32| deg": statistics.median(diffs),
            "decisions equal at 90 deg": sum((a <= 90) == (b <= 90) for a, b in pairs)}


def screened(sh: dict, device: str, work: Path, exact_step: float | None) -> dict:
    """Part 4, where the kit has the ``screened`` scope."""
    if "screened" not in ANGLE_SCOPES:
        return {"skipped": f"this version has no 'screened' angle scope (scopes: {', '.join(ANGLE_SCOPES)})"}
    t, history = step_time("acl", "off", device, sh, work, angle_scope="screened")
    out = {"step s (fp32)": t}
    paths = [row.get("exact_path") for row in history if "exact_path" in row]
    if paths:
        out["exact-path fraction"] = sum(bool(p) for p in paths) / len(paths)
    if exact_step:
        out["/ exact (all) step"] = t / exact_step
    return out


def _md_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model and shapes (the CPU test of this script)")
    ap.add_argument("--report", type=Path, required=True, help="markdown report to append to")
    args = ap.parse_args(argv)
    device = get_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    sh = shapes(args.tiny)
    amps = ["off", "bf16"]
    results: dict = {"device": str(device), "shapes": sh}
    failures = 0
    md = [f"## Measurements ({'tiny shapes' if args.tiny else 'full preset shapes'}: model {sh['model']}, batch "
          f"{sh['batch_size']}, length {sh['max_length']}, device {device})", ""]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = []
        for objective in sh["objectives"]:
            row: dict = {"objective": objective}
            for amp in amps:
                t0 = time.perf_counter()
                try:
                    row[f"{'fp32' if amp == 'off' else amp} step s"], _ = step_time(objective, amp, args.device, sh, work)
                except Exception as exc:  # noqa: BLE001 - one failing objective is reported, the others still run
                    failures += 1
                    row[f"{amp} error"] = f"{type(exc).__name__}: {exc}"[:200]
                    traceback.print_exc()
                print(f"[gpu_check] step time {objective} {amp}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            rows.append(row)
        results["step times"] = rows
        md += ["### 1. Seconds per training step, fp32 and bf16 autocast", "",
               f"train() with {sh['k']} and {sh['k'] + sh['n']} steps after an untimed {sh['k']}-step warm-up; "
               f"the difference of train_seconds over {sh['n']}.",
               "", _md_table(rows), ""]
        for name, fn in (("2. ACL-Grad exact vs batched VJP (seconds, median; ratio to a CE step)",
                          lambda: gate_costs(sh, device)),
                         ("3. Exact gate angle, bf16 vs fp32, same batches and weights (dropout off)",
                          lambda: bf16_angles(sh, device)),
                         ("4. Screened angle scope (fp32)",
                          lambda: screened(sh, args.device, work,
                                           next((r.get("fp32 step s") for r in rows if r["objective"] == "acl"), None)))):
            try:
                value = fn()
            except Exception as exc:  # noqa: BLE001
                failures += 1
                value = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                traceback.print_exc()
            results[name] = value
            md += [f"### {name}", "", _md_table([value]) if value else "(nothing)", ""]
    results["failures"] = failures
    md += ["### The numbers above as JSON", "", "```json", json.dumps(results, indent=1, default=str), "```", ""]
    with open(args.report, "a") as f:
        f.write("\n".join(md) + "\n")
    print(f"[gpu_check] measurements appended to {args.report} ({failures} failed)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
