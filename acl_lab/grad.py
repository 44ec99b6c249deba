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
the full scope has to be measured, not assumed. This module knows only
tensors and parameters.

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
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from acl_lab.errors import bad_value

SCOPES = ("all", "params", "repr")
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
    """One ACL-Grad decision: cosine, angle (degrees), whether the aux term was kept, lam, lam_t, scope."""

    cos: float
    angle: float
    kept: bool
    lam: float
    lam_t: float
    scope: str

    def to_dict(self) -> dict[str, float | bool | str]:
        return asdict(self)


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

    Args:
        params: the trainable parameters (those with ``requires_grad=False``
            are ignored, repeats are dropped).
        lam: weight lambda >= 0 of the auxiliary loss.
        threshold: angle threshold in degrees, in [0, 180] (default 90).
        scope: "all", "params" or "repr".
        scope_params: the parameter subset for ``scope="params"`` (required
            there, not allowed otherwise).
        reduce: for several processes, a function averaging a tensor over
            them in place (:func:`acl_lab.distributed.all_reduce_mean`); the
            decision is then global and ``.grad`` receives the global gradient
            (see the module docstring). None (the default) in one process.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lam: float,
        threshold: float = 90.0,
        scope: str = "all",
        scope_params: Iterable[Tensor] | None = None,
        reduce: Reduce | None = None,
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

        ``scope_tensors`` (required for, and only used by, ``scope="repr"``):
        the intermediate tensors of this batch to measure the angle on; they
        must be part of both graphs.
        """
        if self.scope == "repr":
            if not scope_tensors:
                raise bad_value("scope_tensors", scope_tensors, "a non-empty list of tensors in the graph",
                                "pass e.g. the [CLS] representations at the exits with scope='repr'")
            if not all(t.requires_grad for t in scope_tensors):
                raise bad_value("scope_tensors", "a tensor without grad", "tensors that require grad",
                                "pass the representations before any .detach()")
        ce = _apply_scale(ce_loss, scale)
        aux = _apply_scale(aux_loss, scale)
        if not aux.requires_grad:
            self._backward_reduced(ce)
            return self._record(math.nan)
        if self.scope == "all":
            cos = self._backward_all(ce, aux)
        else:
            cos = self._backward_cheap(ce, aux, self.scope_params if self.scope == "params" else list(scope_tensors))
        return self._record(cos)

    def _keep(self, cos: float) -> bool:
        """Keep the aux term when the angle <= threshold, or when the cosine is not finite (NaN)."""
        return math.isnan(cos) or angle_degrees(cos) <= self.threshold

    def _lam_t(self, cos: float) -> float:
        return self.lam if self._keep(cos) else 0.0

    def _record(self, cos: float) -> GateRecord:
        return GateRecord(cos=cos, angle=angle_degrees(cos), kept=self._keep(cos), lam=self.lam,
                          lam_t=self._lam_t(cos), scope=self.scope)

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
