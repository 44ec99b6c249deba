"""ACL-Grad: gradient cosine and the gated, accumulating backward against hand computations."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from acl_lab.errors import AclLabError
from acl_lab.grad import ACLGrad, GateRecord, ScreenRule, angle_degrees, gradient_cosine
from acl_lab.losses import acl_embed_loss

LAM = 0.7


# ---------------------------------------------------------------- toy model
@dataclass
class Toy:
    """Small MLP; ``emb`` is used only by the aux loss, ``unused`` by neither loss."""

    trunk: nn.Module
    head: nn.Linear
    emb: nn.Parameter
    unused: nn.Parameter
    x: Tensor
    y: Tensor

    def params(self) -> list[Tensor]:
        return [*self.trunk.parameters(), *self.head.parameters(), self.emb, self.unused]


def make_toy(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    head = nn.Linear(8, 3).double()
    emb = nn.Parameter(torch.randn(3, 8, dtype=torch.float64))
    unused = nn.Parameter(torch.randn(2, dtype=torch.float64))
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.arange(12) % 3
    return Toy(trunk, head, emb, unused, x, y)


def forward(toy: Toy, aux_kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """(ce, aux, h): aux is ACL-Embed on h, or built to agree/conflict with CE."""
    h = toy.trunk(toy.x)
    ce = F.cross_entropy(toy.head(h), toy.y)
    contrastive = acl_embed_loss(h, toy.y, toy.emb, temperature=0.5)
    aux = {
        "contrastive": contrastive,
        "along": 3.0 * ce + 1e-3 * contrastive,  # angle ~ 0
        "against": -2.0 * ce + 1e-3 * contrastive,  # angle ~ 180
    }[aux_kind]
    return ce, aux, h


def grads(loss: Tensor, inputs: list[Tensor]) -> list[Tensor]:
    """Gradient per input, zeros where there is no path."""
    got = torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, inputs)]


def hand_cos(ga: list[Tensor], gb: list[Tensor]) -> float:
    a = torch.cat([g.flatten() for g in ga])
    b = torch.cat([g.flatten() for g in gb])
    return (a @ b / (a.norm() * b.norm() + 1e-12)).item()


def hand_reference(aux_kind: str, scope: str) -> tuple[float, list[Tensor], list[Tensor]]:
    """(scope cosine, g_CE, g_aux) computed independently on a fresh toy."""
    toy = make_toy()
    ce, aux, h = forward(toy, aux_kind)
    params = toy.params()
    scope_inputs = {"all": params, "params": list(toy.head.parameters()), "repr": [h]}[scope]
    cos = hand_cos(grads(ce, scope_inputs), grads(aux, scope_inputs))
    return cos, grads(ce, params), grads(aux, params)


def run_gate(aux_kind: str, scope: str, threshold: float = 90.0, scale=1.0,
             old: list[Tensor] | None = None) -> tuple[GateRecord, list[Tensor]]:
    """ACLGrad.backward on a fresh toy; returns the record and each param's .grad (zeros for None)."""
    toy = make_toy()
    params = toy.params()
    if old is not None:
        for p, g in zip(params, old):
            p.grad = g.clone()
    scope_params = list(toy.head.parameters()) if scope == "params" else None
    gate = ACLGrad(params, lam=LAM, threshold=threshold, scope=scope, scope_params=scope_params)
    ce, aux, h = forward(toy, aux_kind)
    record = gate.backward(ce, aux, scale=scale, scope_tensors=[h] if scope == "repr" else None)
    return record, [torch.zeros_like(p) if p.grad is None else p.grad for p in params]


def assert_grads(got: list[Tensor], expected: list[Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- gradient_cosine
def test_gradient_cosine_matches_hand_computation() -> None:
    toy = make_toy()
    ce, aux, _ = forward(toy, "contrastive")
    params = toy.params()
    expected = hand_cos(grads(ce, params), grads(aux, params))
    assert gradient_cosine(ce, aux, params) == pytest.approx(expected, rel=1e-12)
    ce.backward()  # graphs are retained for the caller
    assert toy.head.weight.grad is not None


def test_gradient_cosine_designed_values() -> None:
    w = torch.randn(4, requires_grad=True)
    assert gradient_cosine(w.sum(), -w.sum(), [w]) == pytest.approx(-1.0)
    assert gradient_cosine(w.sum(), 2 * w.sum(), [w]) == pytest.approx(1.0)
    assert gradient_cosine(w[:2].sum(), w[2:].sum(), [w]) == pytest.approx(0.0)
    v = torch.randn(3, requires_grad=True)  # each loss touches a different param: orthogonal
    assert gradient_cosine(w.sum(), v.sum(), [w, v]) == pytest.approx(0.0)
    assert gradient_cosine((w * 0).sum(), w.sum(), [w]) == 0.0  # zero gradient -> 0, not NaN


def test_angle_degrees() -> None:
    assert angle_degrees(1.0) == pytest.approx(0.0)
    assert angle_degrees(0.0) == pytest.approx(90.0)
    assert angle_degrees(-1.0) == pytest.approx(180.0)
    assert angle_degrees(0.5) == pytest.approx(60.0)
    assert angle_degrees(1.0 + 1e-9) == 0.0
    assert angle_degrees(-1.0 - 1e-9) == pytest.approx(180.0)
    assert math.isnan(angle_degrees(math.nan))


# ---------------------------------------------------------------- ACLGrad decisions
@pytest.mark.parametrize("scope", ["all", "params", "repr"])
def test_conflicting_aux_is_dropped(scope: str) -> None:
    cos, g_ce, _ = hand_reference("against", scope)
    record, got = run_gate("against", scope)
    assert record.angle > 170 and not record.kept and record.lam_t == 0.0
    assert record.cos == pytest.approx(cos, rel=1e-10)
    for g, e in zip(got, g_ce):
        assert torch.equal(g, e) if scope == "all" else torch.allclose(g, e, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scope", ["all", "params", "repr"])
def test_agreeing_aux_is_kept(scope: str) -> None:
    cos, g_ce, g_aux = hand_reference("along", scope)
    record, got = run_gate("along", scope)
    assert record.angle < 10 and record.kept and record.lam_t == LAM
    assert record.cos == pytest.approx(cos, rel=1e-10)
    assert_grads(got, [c + LAM * a for c, a in zip(g_ce, g_aux)])


@pytest.mark.parametrize("scope", ["all", "params", "repr"])
def test_each_scope_uses_its_own_decision(scope: str) -> None:
    cos, g_ce, g_aux = hand_reference("contrastive", scope)
    for threshold in (angle_degrees(cos) - 1.0, angle_degrees(cos) + 1.0):
        record, got = run_gate("contrastive", scope, threshold=threshold)
        kept = angle_degrees(cos) <= threshold
        assert record.cos == pytest.approx(cos, rel=1e-10)
        assert record.kept is kept and record.scope == scope
        lam_t = LAM if kept else 0.0
        assert_grads(got, [c + lam_t * a for c, a in zip(g_ce, g_aux)])


@pytest.mark.parametrize("scope", ["all", "params", "repr"])
@pytest.mark.parametrize("aux_kind", ["along", "against"])
def test_accumulates_onto_existing_grad_with_scale(scope: str, aux_kind: str) -> None:
    _, g_ce, g_aux = hand_reference(aux_kind, scope)
    lam_t = LAM if aux_kind == "along" else 0.0
    torch.manual_seed(1)
    old = [torch.randn_like(g) for g in g_ce]
    for scale in (0.5, lambda loss: loss * 4.0):
        factor = 0.5 if scale == 0.5 else 4.0
        _, got = run_gate(aux_kind, scope, scale=scale, old=old)
        assert_grads(got, [o + factor * (c + lam_t * a) for o, c, a in zip(old, g_ce, g_aux)])


def test_params_without_any_gradient_stay_none() -> None:
    toy = make_toy()
    gate = ACLGrad(toy.params(), lam=LAM)
    ce, aux, _ = forward(toy, "along")
    gate.backward(ce, aux)
    assert toy.unused.grad is None
    assert toy.emb.grad is not None  # aux-only parameter gets lam * g_aux


def test_scope_all_releases_the_graph() -> None:
    toy = make_toy()
    ce, aux, _ = forward(toy, "contrastive")
    ACLGrad(toy.params(), lam=LAM).backward(ce, aux)
    with pytest.raises(RuntimeError):
        aux.backward()


def test_aux_without_graph_backprops_ce_only() -> None:
    _, g_ce, _ = hand_reference("contrastive", "all")
    toy = make_toy()
    ce, _, _ = forward(toy, "contrastive")
    record = ACLGrad(toy.params(), lam=LAM).backward(ce, torch.tensor(0.0, dtype=torch.float64))
    assert math.isnan(record.cos) and math.isnan(record.angle)
    assert_grads([torch.zeros_like(p) if p.grad is None else p.grad for p in toy.params()], g_ce)


def test_non_finite_cosine_keeps_lambda() -> None:
    w = torch.ones(3, requires_grad=True)
    record = ACLGrad([w], lam=LAM).backward(w.sum(), (w * float("inf")).sum())
    assert math.isnan(record.cos) and record.kept and record.lam_t == LAM


def test_gate_record_to_dict() -> None:
    record = GateRecord(cos=0.5, angle=60.0, kept=True, lam=0.1, lam_t=0.1, scope="all")
    got = record.to_dict()
    assert {k: got.pop(k) for k in ("cheap_angle", "exact_angle", "margin")} == pytest.approx(
        {"cheap_angle": math.nan, "exact_angle": math.nan, "margin": math.nan}, nan_ok=True)
    assert got == {"cos": 0.5, "angle": 60.0, "kept": True, "lam": 0.1, "lam_t": 0.1, "scope": "all", "path": "exact"}


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scope": "layers"}, "scope"),
        ({"threshold": -1.0}, "threshold"),
        ({"threshold": 180.5}, "threshold"),
        ({"threshold": math.nan}, "threshold"),
        ({"lam": -0.1}, "lam"),
        ({"scope": "params"}, "scope_params"),
        ({"scope": "all", "scope_params": "head"}, "scope_params"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    toy = make_toy()
    if kwargs.get("scope_params") == "head":
        kwargs = {**kwargs, "scope_params": list(toy.head.parameters())}
    with pytest.raises(AclLabError, match=match):
        ACLGrad(toy.params(), **{"lam": LAM, **kwargs})


def test_repr_scope_needs_scope_tensors() -> None:
    toy = make_toy()
    ce, aux, h = forward(toy, "contrastive")
    gate = ACLGrad(toy.params(), lam=LAM, scope="repr")
    with pytest.raises(AclLabError, match="scope_tensors"):
        gate.backward(ce, aux)
    with pytest.raises(AclLabError, match="scope_tensors"):
        gate.backward(ce, aux, scope_tensors=[h.detach()])


def test_gradient_cosines_equal_pairwise_cosines():
    from acl_lab.grad import gradient_cosines

    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    ref = (w ** 2).sum()
    others = [(w * torch.arange(5.0)).sum(), w.sin().sum(), -(w ** 2).sum()]
    got = gradient_cosines(ref, others, [w])
    want = [gradient_cosine(ref, o, [w]) for o in others]
    assert got == want
    assert got[2] < -0.999999


# ---------------------------------------------------------------- the screened scope
def screened_run(rule, threshold: float, aux_kind: str = "contrastive"):
    """A screened gate with ``rule`` on a fresh toy: (record, grads) plus the repr and exact reference cosines."""
    cos_repr, _, _ = hand_reference(aux_kind, "repr")
    cos_all, _, _ = hand_reference(aux_kind, "all")
    toy = make_toy()
    params = toy.params()
    gate = ACLGrad(params, lam=LAM, threshold=threshold, scope="screened", screen=rule)
    ce, aux, h = forward(toy, aux_kind)
    record = gate.backward(ce, aux, scope_tensors=[h])
    return record, [torch.zeros_like(p) if p.grad is None else p.grad for p in params], cos_repr, cos_all


def calibrated(pairs, **kw) -> ScreenRule:
    rule = ScreenRule(warmup=len(pairs), **kw)
    for c, x in pairs:
        rule.observe(c, x)
    return rule


@pytest.mark.parametrize("offset", [-3.0, 3.0])
def test_screened_exact_path_equals_the_exact_gate(offset: float) -> None:
    # warm-up (no pairs yet): always exact; then a calibrated rule with the threshold inside the margin
    cos_repr, _, _ = hand_reference("contrastive", "repr")
    cos_all, _, _ = hand_reference("contrastive", "all")
    for rule, threshold in ((ScreenRule(), 90.0), (ScreenRule(), angle_degrees(cos_all) + offset),
                            (calibrated([(40.0, 41.0)] * 3, floor=10.0), angle_degrees(cos_repr) + offset)):
        record, got, _, _ = screened_run(rule, threshold)
        exact_record, exact_got = run_gate("contrastive", "all", threshold=threshold)
        assert record.path == "exact" and record.scope == "screened"
        for g, e in zip(got, exact_got, strict=True):
            assert torch.equal(g, e)
        assert record.cos == exact_record.cos and record.kept is exact_record.kept
        assert record.exact_angle == exact_record.angle and record.cheap_angle == pytest.approx(
            angle_degrees(cos_repr), abs=1e-9)


def test_screened_cheap_path_decides_from_the_debiased_cheap_angle() -> None:
    cos_repr, g_ce, g_aux = hand_reference("contrastive", "repr")
    a_c = angle_degrees(cos_repr)
    # calibration says: the exact angle is the cheap one + 10 deg, residual spread 0 -> margin = floor = 2
    rule = calibrated([(30.0, 40.0), (50.0, 60.0), (70.0, 80.0)], floor=2.0, slack=1.0)
    assert rule.offset() == 10.0 and rule.margin() == 2.0
    for threshold, kept in ((a_c + 5.0, False), (a_c + 15.0, True)):  # raw cheap angle keeps in both cases
        record, got, _, _ = screened_run(rule, threshold)
        assert record.path == "cheap" and record.kept is kept and record.lam_t == (LAM if kept else 0.0)
        assert math.isnan(record.exact_angle) and record.margin == 2.0
        assert record.cheap_angle == pytest.approx(a_c, abs=1e-9)
        assert record.angle == pytest.approx(a_c + 10.0, abs=1e-9)  # the estimate that decided
        # the same update as the cheap repr gate making the same decision
        repr_record, repr_got = run_gate("contrastive", "repr", threshold=a_c + (1.0 if kept else -1.0))
        assert repr_record.kept is kept
        for g, e in zip(got, repr_got, strict=True):
            assert torch.equal(g, e)
        assert_grads(got, [c + record.lam_t * a for c, a in zip(g_ce, g_aux)])
    assert len(rule.pairs) == 3  # cheap decisions add no pair


def test_screened_near_the_threshold_takes_the_exact_path_and_calibrates() -> None:
    cos_repr, _, _ = hand_reference("contrastive", "repr")
    cos_all, _, _ = hand_reference("contrastive", "all")
    rule = calibrated([(30.0, 40.0), (50.0, 60.0)], floor=2.0, slack=1.0)
    record, _, _, _ = screened_run(rule, threshold=angle_degrees(cos_repr) + 10.0 + 1.5)  # inside +-2
    assert record.path == "exact"
    assert rule.pairs[-1] == pytest.approx((angle_degrees(cos_repr), angle_degrees(cos_all)), abs=1e-9)


def test_screen_rule_calibration_as_documented() -> None:
    rule = ScreenRule(warmup=4, quantile=0.5, slack=1.5, floor=3.0)
    assert rule.margin() == math.inf and rule.offset() == 0.0
    assert rule.cheap_decision(10.0, 90.0) is None  # warm-up: always exact
    residuals = [2.0, 4.0, 6.0, 16.0]
    for i, r in enumerate(residuals):
        rule.observe(50.0 + i, 50.0 + i + r)
    rule.observe(math.nan, 10.0)  # not finite: ignored
    rule.observe(10.0, math.inf)
    assert len(rule.pairs) == 4
    assert rule.offset() == 5.0  # median of 2, 4, 6, 16
    # |r - 5| = 3, 1, 1, 11, sorted 1, 1, 3, 11; numpy's "higher" quantile at q is the value at index
    # ceil(q * (n - 1)): 3 at q = 0.5 (index 2; the interpolated median would be 2), 11 at q = 0.75
    assert rule.margin() == 3.0 + 1.5
    assert ScreenRule(warmup=4, quantile=0.75, slack=1.5, floor=3.0, pairs=list(rule.pairs)).margin() == 11.0 + 1.5
    assert rule.cheap_decision(80.0, 90.0) is True  # estimate 85, 5 below
    assert rule.cheap_decision(82.0, 90.0) is None  # estimate 87, within the margin
    assert rule.cheap_decision(90.0, 90.0) is False  # estimate 95, 5 above
    assert rule.cheap_decision(math.nan, 90.0) is None
    assert ScreenRule(warmup=4, quantile=0.5, slack=1.5, floor=6.0, pairs=list(rule.pairs)).margin() == 6.0
    plain = ScreenRule(warmup=4, quantile=1.0, slack=0.0, floor=0.0, debias=False, pairs=list(rule.pairs))
    assert plain.offset() == 0.0 and plain.margin() == 16.0  # max |r| without centring
    assert ScreenRule(warmup=2, window=2, floor=0.0, slack=0.0, quantile=1.0,
                      pairs=list(rule.pairs)).margin() == 5.0  # last two residuals 6, 16: median 11, |.-11| = 5


def test_screen_rule_restores_from_logged_rows() -> None:
    rule = calibrated([(30.0, 41.0), (50.0, 58.0)])
    rows = [{"exact_path": True, "cheap_angle": c, "exact_angle": x} for c, x in rule.pairs]
    rows.insert(1, {"exact_path": False, "cheap_angle": 12.0, "exact_angle": math.nan})
    rows.append({"cos": 0.1})  # a row without the screened fields
    again = ScreenRule(warmup=2)
    assert again.restore(rows) == 2 and again.pairs == rule.pairs and again.margin() == rule.margin()


def test_screened_log_fields_are_complete_on_both_paths() -> None:
    cos_repr, _, _ = hand_reference("contrastive", "repr")
    exact, _, _, _ = screened_run(ScreenRule(), 90.0)
    cheap, _, _, _ = screened_run(calibrated([(30.0, 30.0)] * 2), angle_degrees(cos_repr) + 40.0)
    keys = {"cos", "angle", "kept", "exact_path", "cheap_angle", "exact_angle", "margin"}
    for rec, path in ((exact, "exact"), (cheap, "cheap")):
        row = rec.log_fields()
        assert set(row) == keys and row["exact_path"] is (path == "exact") and rec.path == path
        assert math.isfinite(row["cheap_angle"]) and math.isfinite(row["angle"])
        assert math.isfinite(row["exact_angle"]) is (path == "exact")
    assert exact.log_fields()["margin"] == math.inf and cheap.log_fields()["margin"] == 5.0  # the floor
    assert set(run_gate("contrastive", "all")[0].log_fields()) == {"cos", "angle", "kept"}


@pytest.mark.parametrize("kwargs, match", [({"warmup": 0}, "warmup"), ({"quantile": 0.0}, "quantile"),
                                           ({"quantile": 1.5}, "quantile"), ({"slack": -1.0}, "slack"),
                                           ({"floor": math.nan}, "floor"), ({"warmup": 5, "window": 3}, "window")])
def test_bad_screen_rules_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(AclLabError, match=match):
        ScreenRule(**kwargs)


def test_screened_needs_scope_tensors_and_screen_needs_screened() -> None:
    toy = make_toy()
    ce, aux, _ = forward(toy, "contrastive")
    with pytest.raises(AclLabError, match="scope_tensors"):
        ACLGrad(toy.params(), lam=LAM, scope="screened").backward(ce, aux)
    with pytest.raises(AclLabError, match="screen"):
        ACLGrad(toy.params(), lam=LAM, scope="all", screen=ScreenRule())
