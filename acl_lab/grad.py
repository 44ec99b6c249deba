"""ACL-Grad: gate an auxiliary (contrastive) loss by its gradient angle to CE.

Per mini-batch (docs/METHOD.md, "ACL-Grad")::

    cos   = <g_CE, g_aux> / (||g_CE|| * ||g_aux|| + eps)
    angle = degrees(arccos(cos))
    lam_t = lam if angle <= threshold else 0
    update direction = g_CE + lam_t * g_aux   (over all trainable parameters)

The paper's angle scope is all model parameters (``scope="all"``). The cheap
scopes ``"params"`` (a subset of parameters, e.g. the classifier heads or the
top layers) and ``"repr"`` (the gradient with respect to intermediate tensors,
e.g. the [CLS] representations at the exits) are this kit's own
approximations: they decide with a cheaper cosine, and their agreement with
the full scope has to be measured, not assumed.

``scope="screened"`` is exact where it matters and cheap elsewhere: it
measures the ``repr`` cosine first and decides from it only when the cheap
angle is far from the threshold, by more than a safety margin calibrated
online from the steps where both angles were computed (:class:`ScreenRule`);
otherwise it computes the exact ``all`` angle and decides from that. Every
decision records which path decided. This module knows only tensors and
parameters.

Several processes (DDP): pass ``reduce``, a function that averages a tensor
over the processes in place (:func:`acl_lab.distributed.all_reduce_mean`).
Then every decision is taken on the global gradients, identically on every
process: the exact scope and the ``"params"`` scope average the two gradient
sets (g_CE and g_aux, in one flat all-reduce) before the cosine; the
``"repr"`` scope, whose tensors are per-process shards of the global batch,
averages the three partial sums <a, b>, ||a||^2, ||b||^2 (a cosine is
invariant to the common 1/W factor). What ``ACLGrad.backward`` adds to
``.grad`` is then the global (averaged) gradient, so the caller must not
all-reduce it again (with DDP: run the step under ``no_sync()``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

import torch
from torch import Tensor

from acl_lab.errors import bad_value

SCOPES = ("all", "params", "repr", "screened")
PATHS = ("exact", "cheap")
COS_EPS = 1e-12

Scale = float | Callable[[Tensor], Tensor]
Grads = Sequence[Tensor | None]
Reduce = Callable[[Tensor], Tensor]  # averages a tensor over processes in place (and returns it)


def _wide(t: Tensor) -> Tensor:
    """``t`` in at least float32, so squares of fp16/bf16 gradients do not overflow."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _dot_and_squares(grads_a: Grads, grads_b: Grads, reduce: Reduce | None = None) -> tuple[float, float, float]:
    """<a, b>, ||a||^2, ||b||^2 of two flattened, concatenated gradient lists (``None`` = zeros).

    Accumulated in float64 on the device, with one host sync at the end. ``reduce`` (optional)
    is applied to the three partial sums (the lists are per-process shards of one vector).
    """
    acc: Tensor | None = None
    for a, b in zip(grads_a, grads_b, strict=True):
        if a is None and b is None:
            continue
        ref = a if a is not None else b
        zero = ref.new_zeros((), dtype=torch.float64)
        a_w = _wide(a) if a is not None else None
        b_w = _wide(b) if b is not None else None
        dot = torch.sum(a_w * b_w, dtype=torch.float64) if a_w is not None and b_w is not None else zero
        sq_a = torch.sum(a_w * a_w, dtype=torch.float64) if a_w is not None else zero
        sq_b = torch.sum(b_w * b_w, dtype=torch.float64) if b_w is not None else zero
        part = torch.stack([dot, sq_a, sq_b])
        acc = part if acc is None else acc + part.to(acc.device)
    if reduce is not None:
        # every process has the same tensors in the same order, so all hold an accumulator (or none)
        ref = next((g for g in (*grads_a, *grads_b) if g is not None), None)
        acc = reduce(acc if acc is not None else torch.zeros(3, dtype=torch.float64,
                                                             device=ref.device if ref is not None else "cpu"))
    if acc is None:
        return 0.0, 0.0, 0.0
    dot, sq_a, sq_b = acc.tolist()
    return dot, sq_a, sq_b


def _cosine(grads_a: Grads, grads_b: Grads, reduce: Reduce | None = None) -> float:
    """cos = <a, b> / (||a|| ||b|| + eps); NaN when not finite (e.g. an AMP overflow)."""
    dot, sq_a, sq_b = _dot_and_squares(grads_a, grads_b, reduce)
    cos = dot / (math.sqrt(sq_a) * math.sqrt(sq_b) + COS_EPS)
    return cos if math.isfinite(cos) else math.nan


def _grads(loss: Tensor, inputs: Sequence[Tensor], retain_graph: bool) -> Grads:
    """d loss / d inputs, ``None`` where there is no path (or when ``loss`` has no graph at all)."""
    if not loss.requires_grad:
        return [None] * len(inputs)
    return torch.autograd.grad(loss, inputs, retain_graph=retain_graph, allow_unused=True)


def reduce_grads(reduce: Reduce | None, *grad_sets: Grads) -> list[list[Tensor | None]]:
    """Each gradient set averaged over processes with ONE call of ``reduce`` on a flat buffer.

    ``None`` entries stay ``None`` (every process has the same graph, so the same entries are
    ``None`` everywhere). The returned tensors are new (the inputs are not modified), in the
    inputs' dtypes. Without ``reduce`` the sets are returned as lists, unchanged.
    """
    if reduce is None:
        return [list(g) for g in grad_sets]
    present = [g for grads in grad_sets for g in grads if g is not None]
    if not present:
        return [list(g) for g in grad_sets]
    dtype = present[0].dtype
    for g in present[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    flat = reduce(torch.cat([g.reshape(-1).to(dtype) for g in present]))
    out, offset = [], 0
    for grads in grad_sets:
        part = []
        for g in grads:
            if g is None:
                part.append(None)
            else:
                part.append(flat[offset:offset + g.numel()].view_as(g).to(g.dtype))
                offset += g.numel()
        out.append(part)
    return out


def gradient_cosine(loss_a: Tensor, loss_b: Tensor, params: Iterable[Tensor]) -> float:
    """Cosine between the gradients of two losses over ``params`` (flattened and concatenated).

    Parameters without a gradient path from a loss count as zeros; eps=1e-12
    in the denominator, so zero gradients give 0. The graphs are retained
    (``retain_graph=True``) and no ``.grad`` is touched, so the caller can
    still call ``backward`` on either loss. Returns NaN if not finite.
    """
    inputs = list(params)
    return _cosine(_grads(loss_a, inputs, True), _grads(loss_b, inputs, True))


def gradient_cosines(reference: Tensor | Grads, others: Sequence[Tensor], params: Iterable[Tensor],
                     reduce: Reduce | None = None) -> list[float]:
    """Cosines between the gradient of ``reference`` and that of each loss in ``others``.

    Same conventions as :func:`gradient_cosine`, but the reference gradient is
    computed once, so k probes cost k + 1 backward passes instead of 2k.
    ``reference`` may also be that gradient already computed (a list aligned
    with ``params``, e.g. the g_CE the update used), which saves one more pass.
    With ``reduce`` (several processes) every gradient is averaged over the
    processes before its cosine; a given ``reference`` gradient must already be.
    """
    inputs = list(params)
    if isinstance(reference, Tensor):
        (g_ref,) = reduce_grads(reduce, _grads(reference, inputs, True))
    else:
        g_ref = list(reference)
    return [_cosine(g_ref, reduce_grads(reduce, _grads(other, inputs, True))[0]) for other in others]


def angle_degrees(cos: float) -> float:
    """arccos(cos) in degrees, with ``cos`` clamped to [-1, 1]; NaN stays NaN."""
    if math.isnan(cos):
        return math.nan
    return math.degrees(math.acos(min(1.0, max(-1.0, cos))))


@dataclass
class GateRecord:
    """One ACL-Grad decision: cosine, angle (degrees), whether the aux term was kept, lam, lam_t, scope.

    ``cos``/``angle`` are those the decision was taken from (``kept`` is
    ``angle <= threshold``, or NaN): ``path`` says which, ``"exact"`` (the
    angle over all parameters) or ``"cheap"`` (an approximate scope; for the
    screened scope the cheap estimate of the exact angle, ``cheap_angle`` plus
    the rule's offset, clamped to [0, 180]). For ``scope="screened"`` the record also holds ``cheap_angle`` (the
    ``repr`` angle, always measured), ``exact_angle`` (NaN where the exact
    angle was not computed) and ``margin`` (the safety margin in degrees in
    force for this decision; ``inf`` during the always-exact warm-up).
    """

    cos: float
    angle: float
    kept: bool
    lam: float
    lam_t: float
    scope: str
    path: str = "exact"
    cheap_angle: float = math.nan
    exact_angle: float = math.nan
    margin: float = math.nan

    def to_dict(self) -> dict[str, float | bool | str]:
        return asdict(self)

    def log_fields(self) -> dict[str, float | bool]:
        """The numeric fields a training log keeps per step (``history.jsonl``).

        ``cos``, ``angle``, ``kept`` always; for the screened scope also
        ``exact_path`` (True when the exact angle decided), ``cheap_angle``,
        ``exact_angle`` and ``margin``. All are numbers or booleans, so rows of
        accumulated micro-batches can be averaged.
        """
        row: dict[str, float | bool] = {"cos": self.cos, "angle": self.angle, "kept": bool(self.kept)}
        if self.scope == "screened":
            row.update(exact_path=self.path == "exact", cheap_angle=self.cheap_angle,
                       exact_angle=self.exact_angle, margin=self.margin)
        return row


@dataclass
class ScreenRule:
    """The calibration rule of ``scope="screened"``: when may the cheap angle decide?

    From the steps where both angles were measured it keeps the pairs
    (cheap angle a_c, exact angle a_x), in degrees, and their residuals
    r = a_x - a_c. Then, for a new step with cheap angle a_c:

    * **warm-up**: while fewer than ``warmup`` pairs are known, always take the
      exact path (the margin is infinite);
    * **estimate**: a_x is estimated as a_c + ``offset``, where ``offset`` is
      the median residual when ``debias`` is on (the cheap angle has a
      systematic bias: on MiniLM the ``repr`` angle runs several degrees below
      the exact one), else 0;
    * **margin** = max(``floor``, Q_q(|r - offset|) + ``slack``), where
      Q_q is the ``quantile``-th quantile of the absolute centred residuals
      over all pairs so far (or the last ``window``), numpy's conservative
      ``method="higher"``: the observed value at index ceil(q (n - 1)) of the
      sorted residuals, never an interpolation below it (with few pairs a
      high q is the largest residual seen);
    * **decide**: if |a_c + offset - threshold| > margin the cheap estimate
      decides (keep iff a_c + offset <= threshold); otherwise, or if the cheap
      cosine is not finite, compute the exact angle, decide from it and add the
      pair.

    The rule is conservative by construction: a cheap decision is only wrong
    when the residual of that step is larger than a high quantile of all the
    residuals seen, plus slack, and in the direction that crosses the threshold.
    Pairs are only observed on exact-path steps, i.e. near the threshold, which
    is where the residuals matter. The defaults (warm-up 20, quantile 0.95,
    slack 2 degrees, floor 5 degrees) come from ``bench/bench_objectives.py``'s
    cost-agreement curve on MiniLM (README, "Benchmarks").
    """

    warmup: int = 20
    quantile: float = 0.95
    slack: float = 2.0
    floor: float = 5.0
    debias: bool = True
    window: int | None = None
    pairs: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise bad_value("warmup", self.warmup, "an integer >= 1 (pairs measured before any cheap decision)",
                            "use e.g. warmup=20")
        if not (math.isfinite(self.quantile) and 0.0 < self.quantile <= 1.0):
            raise bad_value("quantile", self.quantile, "a number in (0, 1]", "use e.g. quantile=0.95")
        for name in ("slack", "floor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise bad_value(name, value, "a number of degrees >= 0", f"use e.g. {name}=2")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < self.warmup):
            raise bad_value("window", self.window, f"None (all pairs) or an integer >= warmup ({self.warmup})",
                            "leave window=None")

    def _residuals(self) -> np.ndarray:
        pairs = self.pairs if self.window is None else self.pairs[-self.window:]
        return np.array([x - c for c, x in pairs], dtype=float)

    def offset(self) -> float:
        """The median residual (exact - cheap) when ``debias`` is on and the warm-up is over, else 0."""
        if not self.debias or len(self.pairs) < self.warmup:
            return 0.0
        return float(np.median(self._residuals()))

    def margin(self) -> float:
        """The safety margin in degrees now: ``inf`` during warm-up, else max(floor, Q_q(|r - offset|) + slack)."""
        if len(self.pairs) < self.warmup:
            return math.inf
        spread = np.abs(self._residuals() - self.offset())
        return max(self.floor, float(np.quantile(spread, self.quantile, method="higher")) + self.slack)

    def cheap_decision(self, cheap_angle: float, threshold: float) -> bool | None:
        """``True``/``False`` (keep/drop) when the cheap angle may decide, ``None`` when the exact path is needed."""
        if not math.isfinite(cheap_angle):
            return None
        estimate = cheap_angle + self.offset()
        if abs(estimate - threshold) > self.margin():
            return estimate <= threshold
        return None

    def observe(self, cheap_angle: float, exact_angle: float) -> None:
        """Add a pair measured on the same batch (ignored unless both angles are finite)."""
        if math.isfinite(cheap_angle) and math.isfinite(exact_angle):
            self.pairs.append((float(cheap_angle), float(exact_angle)))

    def restore(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Rebuild the pairs from logged rows (``history.jsonl`` steps with ``exact_path``); returns how many.

        For resuming a run: the rule is a function of the pairs only, and every
        exact-path step logs both angles. With gradient accumulation a logged
        row averages its micro-batches, so there the rebuilt pairs are
        approximate (exact for ``grad_accum=1``).
        """
        self.pairs.clear()
        for row in rows:
            if row.get("exact_path"):
                self.observe(float(row.get("cheap_angle", math.nan)), float(row.get("exact_angle", math.nan)))
        return len(self.pairs)


def _unique_trainable(params: Iterable[Tensor]) -> list[Tensor]:
    """The tensors that require grad, each once (a repeated tensor would get its gradient twice)."""
    seen: set[int] = set()
    unique = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


def _apply_scale(loss: Tensor, scale: Scale) -> Tensor:
    return scale(loss) if callable(scale) else loss * scale


class ACLGrad:
    """The ACL-Grad component: per batch, add ``scale * (g_CE + lam_t * g_aux)`` to ``.grad``.

    ``lam_t = lam`` if the angle between g_CE and g_aux is <= ``threshold``
    degrees, else 0. The update always covers all ``params``; ``scope`` only
    chooses where the angle is measured:

    - ``"all"``: over all ``params`` -- the paper's exact definition. Costs one
      extra gradient copy (g_aux) while deciding.
    - ``"params"``: over ``scope_params`` only (e.g. classifier heads, top-k
      layers). An approximation of "all".
    - ``"repr"``: over the gradients with respect to intermediate tensors passed
      per call as ``scope_tensors`` (e.g. the [CLS] representations at the
      exits). An approximation of "all".
    - ``"screened"``: the ``"repr"`` cosine first; it decides when its angle is
      outside the safety margin of ``screen`` (a :class:`ScreenRule`, calibrated
      online), else the exact ``"all"`` angle decides. The record says which.

    Args:
        params: the trainable parameters (those with ``requires_grad=False``
            are ignored, repeats are dropped).
        lam: weight lambda >= 0 of the auxiliary loss.
        threshold: angle threshold in degrees, in [0, 180] (default 90).
        scope: "all", "params", "repr" or "screened".
        scope_params: the parameter subset for ``scope="params"`` (required
            there, not allowed otherwise).
        reduce: for several processes, a function averaging a tensor over
            them in place (:func:`acl_lab.distributed.all_reduce_mean`); the
            decision is then global and ``.grad`` receives the global gradient
            (see the module docstring). None (the default) in one process.
        screen: the calibration rule of ``scope="screened"`` (default
            ``ScreenRule()``; not allowed with other scopes). It keeps its
            pairs, so one gate object carries its calibration across steps.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lam: float,
        threshold: float = 90.0,
        scope: str = "all",
        scope_params: Iterable[Tensor] | None = None,
        reduce: Reduce | None = None,
        screen: ScreenRule | None = None,
    ) -> None:
        self.params = _unique_trainable(params)
        if not self.params:
            raise bad_value("params", "[]", "at least one parameter with requires_grad=True", "pass model.parameters()")
        if not (math.isfinite(lam) and lam >= 0):
            raise bad_value("lam", lam, "a finite number >= 0", "use e.g. lam=0.1")
        if not (math.isfinite(threshold) and 0.0 <= threshold <= 180.0):
            raise bad_value("threshold", threshold, "a number of degrees in [0, 180]", "use 90 (the paper's default)")
        if scope not in SCOPES:
            raise bad_value("scope", scope, SCOPES, "use 'all' (the paper's definition) or a cheap approximation")
        self.scope_params = _unique_trainable(scope_params) if scope_params is not None else None
        if scope == "params" and not self.scope_params:
            raise bad_value("scope_params", scope_params, "a non-empty list of trainable parameters",
                            "pass e.g. the classifier parameters with scope='params'")
        if scope != "params" and scope_params is not None:
            raise bad_value("scope_params", "given", "None unless scope='params'",
                            f"drop scope_params or use scope='params' (scope is {scope!r})")
        self.lam = float(lam)
        self.threshold = float(threshold)
        self.scope = scope
        self.reduce = reduce
        if screen is not None and scope != "screened":
            raise bad_value("screen", "given", "None unless scope='screened'",
                            f"drop screen or use scope='screened' (scope is {scope!r})")
        self.screen = (screen or ScreenRule()) if scope == "screened" else None

    def restore(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """On resume: rebuild the screened calibration from the logged step rows (a no-op for other scopes)."""
        if self.screen is not None:
            self.screen.restore(rows)

    def backward(
        self,
        ce_loss: Tensor,
        aux_loss: Tensor,
        scale: Scale = 1.0,
        scope_tensors: Sequence[Tensor] | None = None,
    ) -> GateRecord:
        """Measure the angle, decide lam_t and add ``scale * (g_CE + lam_t * g_aux)`` to each ``.grad``.

        Existing ``.grad`` values are kept and added to (gradient accumulation
        over micro-batches works; the caller steps and zeroes). ``scale`` is a
        float (e.g. 1/accum_steps) or a callable applied to each loss, such as
        ``torch.amp.GradScaler.scale`` for fp16 AMP; the decision is
        scale-invariant for a positive scale.

        If the cosine is not finite (an AMP overflow, or ``aux_loss`` without a
        graph) cos and angle are recorded as NaN and lam_t = lam is kept: the
        gradient scaler skips an overflowed step anyway, and an aux loss
        without a graph contributes nothing.

        ``scope_tensors`` (required for, and only used by, ``scope="repr"`` and
        ``"screened"``): the intermediate tensors of this batch to measure the
        angle on; they must be part of both graphs.
        """
        if self.scope in ("repr", "screened"):
            if not scope_tensors:
                raise bad_value("scope_tensors", scope_tensors, "a non-empty list of tensors in the graph",
                                f"pass e.g. the [CLS] representations at the exits with scope={self.scope!r}")
            if not all(t.requires_grad for t in scope_tensors):
                raise bad_value("scope_tensors", "a tensor without grad", "tensors that require grad",
                                "pass the representations before any .detach()")
        ce = _apply_scale(ce_loss, scale)
        aux = _apply_scale(aux_loss, scale)
        if not aux.requires_grad:
            self._backward_reduced(ce)
            return self._record(math.nan, "exact" if self.scope in ("all", "screened") else "cheap")
        if self.scope == "screened":
            return self._backward_screened(ce, aux, list(scope_tensors))
        if self.scope == "all":
            return self._record(self._backward_all(ce, aux), "exact")
        cos = self._backward_cheap(ce, aux, self.scope_params if self.scope == "params" else list(scope_tensors))
        return self._record(cos, "cheap")

    def _keep(self, cos: float) -> bool:
        """Keep the aux term when the angle <= threshold, or when the cosine is not finite (NaN)."""
        return math.isnan(cos) or angle_degrees(cos) <= self.threshold

    def _lam_t(self, cos: float) -> float:
        return self.lam if self._keep(cos) else 0.0

    def _record(self, cos: float, path: str, **screened: float) -> GateRecord:
        return GateRecord(cos=cos, angle=angle_degrees(cos), kept=self._keep(cos), lam=self.lam,
                          lam_t=self._lam_t(cos), scope=self.scope, path=path, **screened)

    def _backward_screened(self, ce: Tensor, aux: Tensor, reps: Sequence[Tensor]) -> GateRecord:
        """The ``repr`` cosine first; it decides outside the margin, else the exact path (and calibrates).

        With ``reduce`` the cheap cosine reduces its partial sums like ``"repr"`` and the exact path
        averages the two gradient sets like ``"all"``, so every process takes the same path and decision.
        """
        cheap_cos = _cosine(_grads(ce, reps, True), _grads(aux, reps, True), self.reduce)
        cheap_angle = angle_degrees(cheap_cos)
        margin = self.screen.margin()
        keep = self.screen.cheap_decision(cheap_angle, self.threshold)
        if keep is not None:
            lam_t = self.lam if keep else 0.0
            self._backward_reduced(ce + lam_t * aux if lam_t != 0.0 else ce)
            estimate = min(180.0, max(0.0, cheap_angle + self.screen.offset()))
            return GateRecord(cos=math.cos(math.radians(estimate)), angle=estimate, kept=keep, lam=self.lam,
                              lam_t=lam_t, scope=self.scope, path="cheap", cheap_angle=cheap_angle, margin=margin)
        cos = self._backward_all(ce, aux)
        self.screen.observe(cheap_angle, angle_degrees(cos))
        return self._record(cos, "exact", cheap_angle=cheap_angle, exact_angle=angle_degrees(cos), margin=margin)

    def _backward_all(self, ce: Tensor, aux: Tensor) -> float:
        """Full scope with at most one extra gradient copy and no graph held afterwards.

        The existing ``.grad`` tensors are set aside (no copy), CE is
        back-propagated into ``.grad`` (= g_CE), g_aux is taken with
        ``autograd.grad`` (the one extra copy; releases the graph), and then
        ``.grad = old + g_CE + lam_t * g_aux`` in place. With ``reduce``, g_CE
        and g_aux are first averaged over the processes in one flat all-reduce
        (twice the gradient size: the communication the exact gate adds).
        """
        stashed = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        ce.backward(retain_graph=True, inputs=self.params)
        g_aux = _grads(aux, self.params, retain_graph=False)
        if self.reduce is not None:
            g_ce, g_aux = reduce_grads(self.reduce, [p.grad for p in self.params], g_aux)
            for p, g in zip(self.params, g_ce):
                p.grad = g
        cos = _cosine([p.grad for p in self.params], g_aux)
        lam_t = self._lam_t(cos)
        for p, old, ga in zip(self.params, stashed, g_aux):
            if ga is not None and lam_t != 0.0:
                if p.grad is None:
                    p.grad = ga * lam_t  # not in place: autograd.grad may return an expanded view
                else:
                    p.grad.add_(ga, alpha=lam_t)
            if old is not None:
                if p.grad is not None:
                    old.add_(p.grad)
                p.grad = old
        return cos

    def _backward_cheap(self, ce: Tensor, aux: Tensor, scope_inputs: Sequence[Tensor]) -> float:
        """Approximate scopes: decide on the gradients w.r.t. ``scope_inputs``, then one combined backward."""
        g_ce, g_aux = _grads(ce, scope_inputs, True), _grads(aux, scope_inputs, True)
        if self.scope == "repr":
            cos = _cosine(g_ce, g_aux, self.reduce)  # shards of one vector: reduce the partial sums
        else:
            cos = _cosine(*reduce_grads(self.reduce, g_ce, g_aux))  # the same parameters: average the gradients
        lam_t = self._lam_t(cos)
        self._backward_reduced(ce + lam_t * aux if lam_t != 0.0 else ce)
        return cos

    def _backward_reduced(self, loss: Tensor) -> None:
        """``loss.backward()`` into ``.grad``; with ``reduce``, what it adds is averaged over the processes first."""
        if self.reduce is None:
            loss.backward(inputs=self.params)
            return
        stashed = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        loss.backward(inputs=self.params)
        (fresh,) = reduce_grads(self.reduce, [p.grad for p in self.params])
        for p, old, g in zip(self.params, stashed, fresh):
            if old is not None and g is not None:
                old.add_(g)
            p.grad = old if old is not None else g
