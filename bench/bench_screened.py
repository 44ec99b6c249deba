"""The screened exact ACL-Grad gate on real MiniLM fine-tuning: cost against CE, exact fraction, agreement.

Part [3] of ``bench/bench_objectives.py`` (which imports this module; run it there,
see its docstring for the command). Kept apart so the two older parts stay as they were.

Setting. The gate must really decide, so the gated term is SCL (objective
``ce+scl`` with ``acl_grad=True``, lambda 0.1, threshold 90): early in fine-tuning the
CE vs SCL angle sits around 90 degrees (docs/RESULTS.md: median 88 deg in the first
third of training on rt-polarity, 26% of batches over 90), the hardest case for a
screen. Real MiniLM-L6, rt-polarity, batch 32, max length 64, CPU float32, one thread.

(a) Step cost, interleaved. On the same fixed batches, round-robin (order rotated per
round), each variant its own ``acl_lab.trainer.Trainer`` (same pretrained model, its own
AdamW; the gate set through the public ``Trainer.gate`` seam), one call of
``Trainer.step([batch])`` per step: ``ce``; the exact gate (``all``); the screened gate forced onto
its exact path (cheap ``repr`` cosine + exact angle); the screened gate forced onto its
cheap path (``repr`` cosine + one combined backward); and the GPU-style alternative, one
batched VJP (``torch.autograd.grad(stack([ce, aux]), params, eye(2), is_grads_batched=True)``)
that computes g_CE and g_aux in one vmapped backward pass. Ratio = median over
(round, batch) of t_variant / t_ce on the same batch in the same round, for wall-clock
time and for the process's CPU time (``time.process_time``; one torch thread). On a
machine loaded by other jobs the CPU-time ratio is the steadier one, and the cost
figures of (b) and (c) use it; both are printed.

(b) Decisions on a real run. ``Trainer(...).fit()`` with ``angle_scope="screened"`` and the
default :class:`acl_lab.grad.ScreenRule` drives the update. Its gate is the real one,
with one addition made here: before each decision it also computes the exact cosine
over all parameters (``gradient_cosine``, retained graphs, no ``.grad`` touched, so the
run is the one it would be without it) and the ``repr`` cosine. So every step has both
angles, and the screened decision is compared with the exact decision on every step.

(c) The cost-agreement curve. The same per-step (cheap, exact) angle pairs are replayed
through ``ScreenRule`` with other settings (the slack, the quantile, the floor, the
debiasing offset): each setting gives the fraction of steps needing the exact path and
the agreement with the exact decision; its cost is modelled as
f * (exact-path ratio) + (1 - f) * (cheap-path ratio), the two ratios measured in (a).
Replayed decisions are counterfactual on the trajectory of (b) (the update of a step
where another setting would decide differently would differ), which is a fair test of
the decision rule but not of the training it would produce.
"""
from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import binomtest

from acl_lab.config import TrainConfig
from acl_lab.data import make_loader
from acl_lab.grad import ACLGrad, ScreenRule, _cosine, _grads, angle_degrees, gradient_cosine
from acl_lab.trainer import Trainer

TASK = "rt-polarity"
THRESHOLD = 90.0
LAM = 0.1
TARGET_AGREEMENT, TARGET_COST = 0.99, 1.2


class BatchedVJPGate(ACLGrad):
    """The exact gate with g_CE and g_aux from ONE batched VJP (``is_grads_batched=True``; vmap over the backward)."""

    def _backward_all(self, ce, aux):
        stacked = torch.stack([ce.reshape(()), aux.reshape(())])
        eye = torch.eye(2, dtype=stacked.dtype, device=stacked.device)
        both = torch.autograd.grad(stacked, self.params, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
        g_ce = [None if g is None else g[0] for g in both]
        g_aux = [None if g is None else g[1] for g in both]
        cos = _cosine(g_ce, g_aux)
        lam_t = self._lam_t(cos)
        for p, gc, ga in zip(self.params, g_ce, g_aux):
            if gc is None and (ga is None or lam_t == 0.0):
                continue
            step = (gc if gc is not None else torch.zeros_like(p)) + (lam_t * ga if ga is not None and lam_t else 0.0)
            p.grad = step if p.grad is None else p.grad + step
        return cos


def _forced_rule(path: str) -> ScreenRule:
    """A ScreenRule that always takes ``path``: exact (endless warm-up) or cheap (zero margin, zero offset)."""
    if path == "exact":
        return ScreenRule(warmup=10**9)
    return ScreenRule(warmup=1, floor=0.0, slack=0.0, pairs=[(45.0, 45.0)])


VARIANTS = ("ce", "exact (all)", "screened: exact path", "screened: cheap path", "batched VJP (exact)")


def _gate(label: str, model) -> ACLGrad | None:
    """The gate of a timing variant, over ``model``'s trainable parameters (None for ce)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if label == "ce":
        return None
    if label == "exact (all)":
        return ACLGrad(params, lam=1.0, threshold=THRESHOLD, scope="all")
    if label == "batched VJP (exact)":
        return BatchedVJPGate(params, lam=1.0, threshold=THRESHOLD, scope="all")
    path = "exact" if "exact path" in label else "cheap"
    return ACLGrad(params, lam=1.0, threshold=THRESHOLD, scope="screened", screen=_forced_rule(path))


def _cfg(args, **kw) -> TrainConfig:
    return TrainConfig(task=TASK, model=args.model, batch_size=args.batch_size, max_length=args.max_length,
                       seed=args.seed, lam=LAM, threshold=THRESHOLD, **kw).validate()


def time_paths(args, say) -> dict:
    """(a): the per-path and alternative step costs, interleaved on fixed batches."""
    n_train = max(args.screen_batches * args.batch_size, 64)
    work = Path(tempfile.mkdtemp(prefix="acl_bench_screen_steps_"))
    runners: dict[str, Trainer] = {}
    try:
        for i, label in enumerate(VARIANTS):
            gated = dict(objective="ce+scl", acl_grad=True, angle_scope="all") if label != "ce" else dict(objective="ce")
            cfg = _cfg(args, **gated, max_train_samples=n_train, max_eval_samples=64, max_steps=100_000,
                       device="cpu", num_threads=args.threads, save_checkpoints=False, output_dir=str(work / str(i)))
            trainer = Trainer(cfg, overwrite=True, progress=False)  # builds; fit() is never called
            trainer.gate = _gate(label, trainer.model)  # the public seam: this variant's gate
            runners[label] = trainer
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = runners["ce"]
    loader = make_loader(first.encoded["train"], first.tokenizer, args.batch_size, shuffle=True, seed=args.seed)
    batches = [b for _, b in zip(range(args.screen_batches), loader)]
    paths: dict[str, list] = {label: [] for label in VARIANTS}

    def step(label, batch) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        row = runners[label].step([batch])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        paths[label].append(row.get("exact_path"))
        return dt, dc

    for label in VARIANTS:  # warm-up: one step each
        step(label, batches[0])
    times = {label: [] for label in VARIANTS}
    ratios = {label: [] for label in VARIANTS}
    cpu_ratios = {label: [] for label in VARIANTS}
    t_start = time.perf_counter()
    for r in range(args.screen_rounds):
        order = list(VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)])
        for b in batches:
            this = {label: step(label, b) for label in order}
            for label in VARIANTS:
                times[label].append(this[label][0])
                ratios[label].append(this[label][0] / this["ce"][0])
                cpu_ratios[label].append(this[label][1] / this["ce"][1])
        say(f"  round {r + 1}/{args.screen_rounds} done ({time.perf_counter() - t_start:.0f}s)")
    assert all(p for p in paths["screened: exact path"]) and not any(paths["screened: cheap path"])
    rows = [{"variant": label, "median_ms": 1000 * statistics.median(times[label]),
             "ratio_to_ce": statistics.median(ratios[label]),
             "ratio_iqr": [float(np.percentile(ratios[label], 25)), float(np.percentile(ratios[label], 75))],
             "cpu_ratio_to_ce": statistics.median(cpu_ratios[label]),
             "cpu_ratio_iqr": [float(np.percentile(cpu_ratios[label], 25)), float(np.percentile(cpu_ratios[label], 75))],
             "n": len(times[label])} for label in VARIANTS]
    return {"rows": rows, "padded_lengths": [int(b["input_ids"].shape[1]) for b in batches],
            "rounds": args.screen_rounds, "batches": len(batches)}


class AlongsideGate(ACLGrad):
    """The real screened gate, plus the exact angle computed alongside where the gate itself does not compute it.

    Before each decision it measures the ``repr`` cosine as the gate will (the same
    ``_cosine(_grads(...))`` on the same graph, deterministic on CPU) and asks the
    gate's own rule whether the cheap angle will decide; only then does it compute the
    exact cosine alongside (``gradient_cosine``: retained graphs, ``.grad`` untouched).
    On exact-path steps the gate's own exact angle is used.
    """

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self.rows: list[dict] = []

    def backward(self, ce_loss, aux_loss, scale=1.0, scope_tensors=None):
        reps = list(scope_tensors)
        cheap = angle_degrees(_cosine(_grads(ce_loss, reps, True), _grads(aux_loss, reps, True)))
        will_be_cheap = self.screen.cheap_decision(cheap, self.threshold) is not None
        alongside = angle_degrees(gradient_cosine(ce_loss, aux_loss, self.params)) if will_be_cheap else math.nan
        rec = super().backward(ce_loss, aux_loss, scale=scale, scope_tensors=scope_tensors)
        assert rec.path == ("cheap" if will_be_cheap else "exact") and rec.cheap_angle == cheap
        self.rows.append({"exact": alongside if will_be_cheap else rec.exact_angle, "cheap": rec.cheap_angle,
                          "path": rec.path, "kept": rec.kept, "angle": rec.angle, "margin": rec.margin})
        return rec


def decisions(args, say) -> dict:
    """(b): a real screened run with the exact decision computed alongside on every step."""
    work = Path(tempfile.mkdtemp(prefix="acl_bench_screen_"))
    cfg = _cfg(args, objective="ce+scl", acl_grad=True, angle_scope="screened", max_steps=args.screen_steps,
               eval_every=args.screen_steps + 1, save_checkpoints=False, max_eval_samples=args.eval_samples,
               output_dir=str(work / "run"), num_threads=args.threads)
    try:
        t0 = time.perf_counter()
        trainer = Trainer(cfg, overwrite=True, progress=False)
        # the public seam: the run's own screened gate, with the alongside probe
        trainer.gate = gate = AlongsideGate([p for p in trainer.model.parameters() if p.requires_grad], lam=1.0,
                                            threshold=cfg.threshold, scope="screened")
        result = trainer.fit()
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = gate.rows
    hist = result.history
    assert len(rows) == len(hist)
    for r, h in zip(rows, hist):  # the log holds what the gate decided
        assert bool(h["exact_path"]) == (r["path"] == "exact") and bool(h["kept"]) == r["kept"]
    cheap = np.array([r["cheap"] for r in rows])
    exact = np.array([r["exact"] for r in rows])
    kept = np.array([r["kept"] for r in rows])
    exact_kept = ~(exact > THRESHOLD)
    agree = kept == exact_kept
    is_exact = np.array([r["path"] == "exact" for r in rows])
    n_cheap = int((~is_exact).sum())
    ci = binomtest(int(agree.sum()), len(agree)).proportion_ci(confidence_level=0.95, method="exact")
    return {"steps": len(rows), "wall_seconds": wall, "dev_accuracy": result.metrics.get("dev", {}).get("accuracy"),
            "exact_fraction": float(is_exact.mean()), "exact_fraction_after_warmup":
                float(is_exact[ScreenRule().warmup:].mean()) if len(rows) > ScreenRule().warmup else None,
            "agreement": float(agree.mean()), "agreement_ci95": [float(ci.low), float(ci.high)],
            "disagreements": int((~agree).sum()), "cheap_decisions": n_cheap,
            "exact_kept_fraction": float(exact_kept.mean()),
            "repr_alone_agreement": float(np.mean(~(cheap > THRESHOLD) == exact_kept)),
            "angles": {"cheap": cheap.tolist(), "exact": exact.tolist()},
            "paths": ["exact" if e else "cheap" for e in is_exact], "margins": [r["margin"] for r in rows],
            "exact_median": float(np.median(exact)), "exact_range": [float(exact.min()), float(exact.max())],
            "residual_median": float(np.median(exact - cheap)), "residual_sd": float(np.std(exact - cheap)),
            "pearson": float(np.corrcoef(cheap, exact)[0, 1])}


def replay(cheap: np.ndarray, exact: np.ndarray, rule: ScreenRule, threshold: float = THRESHOLD) -> dict:
    """Run ``rule`` over the per-step angle pairs in order; the exact path observes its pair, as the gate does."""
    exact_kept = ~(exact > threshold)
    n_exact, agree = 0, 0
    for c, x, truth in zip(cheap.tolist(), exact.tolist(), exact_kept.tolist()):
        keep = rule.cheap_decision(c, threshold)
        if keep is None:
            n_exact += 1
            rule.observe(c, x)
            keep = truth
        agree += int(keep == truth)
    return {"exact_fraction": n_exact / len(cheap), "agreement": agree / len(cheap),
            "disagreements": len(cheap) - agree}


def curve(dec: dict, timing: dict) -> list[dict]:
    """(c): the cost-agreement curve of ScreenRule settings, replayed on the run's angle pairs."""
    cheap, exact = np.array(dec["angles"]["cheap"]), np.array(dec["angles"]["exact"])
    ratio = {r["variant"]: r["cpu_ratio_to_ce"] for r in timing["rows"]}
    c_exact, c_cheap = ratio["screened: exact path"], ratio["screened: cheap path"]
    default = ScreenRule()
    settings = [("default", {})]
    settings += [(f"slack {s:g}", {"slack": float(s)}) for s in (0, 1, 4, 6, 10, 15)]
    settings += [(f"quantile {q:g}", {"quantile": q}) for q in (0.5, 0.8, 0.9, 1.0)]
    settings += [(f"floor {f:g}", {"floor": float(f), "slack": 0.0}) for f in (0, 10, 15)]
    settings += [("no debias", {"debias": False}), (f"warm-up {default.warmup // 2}", {"warmup": default.warmup // 2})]
    out = []
    for name, kw in settings:
        rule = ScreenRule(**kw)
        res = replay(cheap, exact, rule)
        res.update(setting=name, params={k: getattr(rule, k) for k in ("warmup", "quantile", "slack", "floor", "debias")},
                   cost_ratio=res["exact_fraction"] * c_exact + (1 - res["exact_fraction"]) * c_cheap)
        out.append(res)
    return out


def run(args, say) -> dict:
    say(f"\n[3] screened gate: objective ce+scl gated (lambda {LAM}, threshold {THRESHOLD:g}), "
        f"default {ScreenRule()!r}".replace("pairs=[]", "").replace(", )", ")"))
    say(f"  (a) step cost, {len(VARIANTS)} variants x {args.screen_rounds} rounds x {args.screen_batches} batches")
    timing = time_paths(args, say)
    say(f"  padded lengths: {timing['padded_lengths']}")
    say(f"  {'variant':<24} {'median ms':>10} {'wall/CE':>8} {'IQR':>12} {'CPU/CE':>8} {'IQR':>12}")
    for r in timing["rows"]:
        say(f"  {r['variant']:<24} {r['median_ms']:>10.0f} {r['ratio_to_ce']:>7.2f}x "
            f"{r['ratio_iqr'][0]:>5.2f}-{r['ratio_iqr'][1]:.2f}  {r['cpu_ratio_to_ce']:>6.2f}x "
            f"{r['cpu_ratio_iqr'][0]:>5.2f}-{r['cpu_ratio_iqr'][1]:.2f}")
    say("  (wall/CE: median over (round, batch) of the wall-clock ratio to CE on the same batch; CPU/CE: the same with"
        " the process's CPU time, which a loaded machine inflates far less than wall-clock (1 torch thread);"
        " the cost figures below use CPU/CE)")
    say(f"\n  (b) real Trainer.fit() with angle_scope='screened', {args.screen_steps} steps, exact angle computed alongside")
    dec = decisions(args, say)
    ratio = {r["variant"]: r["cpu_ratio_to_ce"] for r in timing["rows"]}
    cost = dec["exact_fraction"] * ratio["screened: exact path"] + (1 - dec["exact_fraction"]) * ratio[
        "screened: cheap path"]
    dec["cost_ratio"] = cost
    say(f"  {dec['steps']} steps in {dec['wall_seconds']:.0f}s (with the alongside probes); dev accuracy "
        f"(first {args.eval_samples} dev samples) {dec['dev_accuracy']}")
    say(f"  exact angle: median {dec['exact_median']:.1f}, range {dec['exact_range'][0]:.1f}-{dec['exact_range'][1]:.1f};"
        f" exact gate keeps in {dec['exact_kept_fraction']:.2f} of steps; exact - repr angle: median "
        f"{dec['residual_median']:.1f}, sd {dec['residual_sd']:.1f}, r = {dec['pearson']:.2f}")
    say(f"  exact path on {dec['exact_fraction']:.2f} of steps (after the {ScreenRule().warmup}-step warm-up: "
        f"{dec['exact_fraction_after_warmup']}); cheap decisions {dec['cheap_decisions']}")
    say(f"  agreement with the exact decision: {dec['agreement']:.3f} ({dec['disagreements']} of {dec['steps']} "
        f"differ; 95% CI {dec['agreement_ci95'][0]:.3f}-{dec['agreement_ci95'][1]:.3f}); repr alone: "
        f"{dec['repr_alone_agreement']:.3f}")
    say(f"  cost = f x exact-path + (1 - f) x cheap-path = {cost:.2f}x CE over the run")
    if dec["exact_fraction_after_warmup"] is not None:
        f = dec["exact_fraction_after_warmup"]
        dec["cost_ratio_after_warmup"] = f * ratio["screened: exact path"] + (1 - f) * ratio["screened: cheap path"]
        say(f"  after the warm-up ({dec['steps'] - ScreenRule().warmup} steps): {dec['cost_ratio_after_warmup']:.2f}x "
            "CE (what a longer run tends to, if its later steps behave like these)")
    cur = curve(dec, timing)
    say(f"\n  (c) cost-agreement curve (ScreenRule settings replayed on the {dec['steps']} angle pairs of (b)):")
    say(f"  {'setting':<14} {'exact frac':>10} {'agreement':>10} {'differ':>7} {'cost/CE':>8}")
    for c in cur:
        say(f"  {c['setting']:<14} {c['exact_fraction']:>10.2f} {c['agreement']:>10.3f} {c['disagreements']:>7d} "
            f"{c['cost_ratio']:>7.2f}x")
    met_a, met_c = dec["agreement"] >= TARGET_AGREEMENT, cost <= TARGET_COST
    say(f"\n  [target] >= {TARGET_AGREEMENT:.0%} agreement at <= {TARGET_COST}x CE: agreement {dec['agreement']:.3f} "
        f"({'MET' if met_a else 'NOT MET'}), cost {cost:.2f}x ({'MET' if met_c else 'NOT MET'}); over "
        f"{dec['steps']} steps a 99% claim is resolved only to the CI above")
    wall = {r["variant"]: r["ratio_to_ce"] for r in timing["rows"]}
    say(f"  batched VJP (exact, one vmapped backward): {ratio['batched VJP (exact)']:.2f}x CE CPU time "
        f"({wall['batched VJP (exact)']:.2f}x wall-clock) on CPU; the exact gate with two backward passes: "
        f"{ratio['exact (all)']:.2f}x ({wall['exact (all)']:.2f}x)")
    return {"timing": timing, "decisions": dec, "curve": cur,
            "targets": {"agreement": {"value": dec["agreement"], "target": TARGET_AGREEMENT, "met": met_a},
                        "cost": {"value": cost, "target": TARGET_COST, "met": met_c}}}
