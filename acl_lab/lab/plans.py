"""The kit's comparisons, defined once: the configs that notebooks 01/02/04/06, the batch runner and
``python -m acl_lab evidence`` train.

Each function returns the list of :class:`~acl_lab.config.TrainConfig` of one comparison on one
task at one preset's scale. Because a run's folder is named by its config
(:func:`acl_lab.analysis.runs.run_name`), the notebook and the evidence pipeline that ask for the
same comparison get the same run folders, and whichever runs second reads the first one's runs
back instead of training again.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..config import MULTI_EXIT_OBJECTIVES, SINGLE_EXIT_OBJECTIVES, TrainConfig
from ..presets import DEFAULT_SEEDS, preset_config

SENSITIVITY_OBJECTIVES = ("ce+scl", "acl")
MULTI_POOLING = "mean"  # the offline MiniLM's shallow [CLS] vectors are degenerate (see docs/METHOD.md)


def default_seeds(preset: str, part: str = "single") -> list[int]:
    """The seeds a comparison uses when none are given: one seed for the CPU-sized multi-exit and
    sensitivity runs of ``smoke``/``quick`` (each point is its own run), the preset's seeds otherwise."""
    if part in ("multi", "sensitivity", "gate") and preset in ("smoke", "quick"):
        return [0]
    return list(DEFAULT_SEEDS[preset])


def base_config(preset: str, task: str, model: str | None = None, **overrides: Any) -> TrainConfig:
    """The shared config of every run of a comparison: the preset, the task, the model, and ``overrides``."""
    return preset_config(preset, task=task, model=model, **overrides)


def _grid(base: TrainConfig, objectives: Sequence[str], seeds: Sequence[int]) -> list[TrainConfig]:
    return [base.replace(objective=o, seed=s).validate() for o in objectives for s in seeds]


def pilot(preset: str, task: str, model: str | None = None, seeds: Sequence[int] | None = None,
          objectives: Sequence[str] = ("ce",), **overrides: Any) -> list[TrainConfig]:
    """The pilot study (notebook 01): ``objectives`` trained with the CE/SCL and CE/ACL-Embed angles probed."""
    base = base_config(preset, task, model, probe_angles=True, **overrides)
    return _grid(base, objectives, seeds or default_seeds(preset, "pilot"))


def single(preset: str, task: str, model: str | None = None, seeds: Sequence[int] | None = None,
           objectives: Sequence[str] = SINGLE_EXIT_OBJECTIVES, lam: float = 0.1, temperature: float = 0.1,
           **overrides: Any) -> list[TrainConfig]:
    """The single-exit comparison (notebook 02): CE, CE+SCL, ACL-Embed and ACL at one lambda and tau."""
    base = base_config(preset, task, model, lam=lam, temperature=temperature, **overrides)
    return _grid(base, objectives, seeds or default_seeds(preset, "single"))


def multi(preset: str, task: str, model: str | None = None, seeds: Sequence[int] | None = None,
          objectives: Sequence[str] = MULTI_EXIT_OBJECTIVES, lam: float = 0.1, mu: float = 0.1,
          exit_weights: str = "uniform", pooling: str = MULTI_POOLING, **overrides: Any) -> list[TrainConfig]:
    """The multi-exit comparison (notebooks 04 and 05): multi-exit CE, ACL-Embed at every exit, and ACL-CL."""
    base = base_config(preset, task, model, lam=lam, mu=mu, exit_weights=exit_weights, pooling=pooling, **overrides)
    return _grid(base, objectives, seeds or default_seeds(preset, "multi"))


def sensitivity(preset: str, task: str, model: str | None = None, seeds: Sequence[int] | None = None,
                objectives: Sequence[str] = SENSITIVITY_OBJECTIVES, lambdas: Sequence[float] = (0.1, 1.0),
                temperatures: Sequence[float] = (0.1,), **overrides: Any) -> list[TrainConfig]:
    """Lambda (x tau) sensitivity (notebook 06): :func:`single` of ``objectives`` at every grid point.

    Notebook 06 runs notebook 02 once per (lambda, tau, seed) through the batch runner; each of
    those runs trains exactly these configs, so the runs can be found by config afterwards.
    """
    seeds = seeds or default_seeds(preset, "sensitivity")
    return [c for lam in lambdas for tau in temperatures for s in seeds
            for c in single(preset, task, model, [s], objectives, lam=lam, temperature=tau, **overrides)]


GATE_THRESHOLDS = (60.0, 70.0, 80.0, 90.0)


def gate(preset: str, task: str, model: str | None = None, seeds: Sequence[int] | None = None,
         thresholds: Sequence[float] = GATE_THRESHOLDS, scl_thresholds: Sequence[float] = (90.0,), lam: float = 0.1,
         temperature: float = 0.1, **overrides: Any) -> list[TrainConfig]:
    """ACL-Grad where it acts: ``acl`` at gate ``thresholds`` (the gate drops the ACL-Embed term of batches whose
    angle to grad(CE) exceeds the threshold), and the same gate on CE+SCL's SCL term (``ce+scl`` with
    ``acl_grad=True``) at ``scl_thresholds``, where the pilot study finds the conflicts. ``acl`` at 90 degrees is
    :func:`single`'s run (same config, same folder)."""
    seeds = seeds or default_seeds(preset, "gate")
    acl = single(preset, task, model, seeds, ("acl",), lam=lam, temperature=temperature, **overrides)
    scl = [c.replace(acl_grad=True) for c in single(preset, task, model, seeds, ("ce+scl",), lam=lam,
                                                     temperature=temperature, **overrides)]
    return ([c.replace(threshold=float(t)).validate() for t in thresholds for c in acl]
            + [c.replace(threshold=float(t)).validate() for t in scl_thresholds for c in scl])


#: the paired comparisons of the evidence tables, per part: (a, b) reads "a - b"; names are :func:`run_label`'s
PAIRED = {"single": [("ce+scl", "ce"), ("acl-embed", "ce"), ("acl", "ce"), ("acl", "ce+scl")],
          "multi": [("me-acl", "me-ce"), ("me-acl-cl", "me-ce")]}


def run_label(cfg: TrainConfig, part: str) -> str:
    """The name a run goes by in a part's paired table: the objective, plus what the part varies."""
    if part == "gate":
        gated = "+gate" if cfg.objective == "ce+scl" and cfg.use_acl_grad else ""
        return f"{cfg.objective}{gated} {cfg.threshold:g}°"
    if part == "sensitivity":
        return f"{cfg.objective} λ={cfg.lam:g}"
    return cfg.objective


def paired_pairs(part: str, labels: Sequence[str]) -> list[tuple[str, str]]:
    """The (a, b) pairs of a part's paired table among the run ``labels`` present (every one against CE, and ACL
    against CE+SCL): single and multi from :data:`PAIRED`; gate: every ``acl`` threshold against ``ce`` and
    ``ce+scl`` (both from the single part), the gated CE+SCL against plain ``ce+scl``; sensitivity: ``acl``
    against ``ce+scl`` at each lambda."""
    present = set(labels)
    if part in PAIRED:
        return [(a, b) for a, b in PAIRED[part] if a in present and b in present]
    pairs = []
    for lab in labels:
        if part == "gate" and lab.startswith("acl "):
            pairs += [(lab, "ce"), (lab, "ce+scl")]
        elif part == "gate" and lab.startswith("ce+scl+gate"):
            pairs += [(lab, "ce+scl")]
        elif part == "sensitivity" and lab.startswith("acl "):
            other = lab.replace("acl ", "ce+scl ", 1)
            if other in present:
                pairs.append((lab, other))
    return [(a, b) for a, b in pairs if b in present]
