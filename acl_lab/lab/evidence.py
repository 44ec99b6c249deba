"""The evidence behind docs/RESULTS.md: the paper's five comparisons, run on the offline tasks, saved small.

Two stages, so that the published figures can be redrawn without training:

* :func:`run_evidence` trains (or reads back, from :func:`acl_lab.lab.experiments.run_many`'s
  run cache or from the pack) every run the comparisons need, copies each finished run into
  the pack at once, sweeps early exit, and writes small CSV and JSON files under ``results_dir``
  after *each* part, so an interrupted session keeps every run it finished; ``--shard I/N``
  splits the training over processes side by side;
* :func:`build_report` reads only those files and writes the PNG figures and
  ``tables.md``. ``python -m acl_lab evidence --report-only`` runs it alone.

``results_dir`` is the *pack*: a self-contained folder (e.g. ``results/standard/``, committed)
that the report and every notebook's saved mode (:mod:`acl_lab.lab.source`) read without
training. It holds the part CSVs, ``plan.json`` (the plan, the exact command, the git commit,
the machine and the seconds of each part), ``tables.md`` and ``figures/``, and under
``runs/<run_name>/`` each run's ``config.json``, ``metrics.json``, ``history.jsonl.gz`` (gzipped; read by
:func:`acl_lab.result.load_result` like a plain one) and ``predictions.npz``; the representations (float16, ``rep_samples`` dev samples) only for the
lowest seed of each objective of the single- and multi-exit parts; never checkpoints.

Every objective gets the same data, steps and hyper-parameters (those of ``preset``);
nothing is tuned, so each objective's tuning budget is one configuration. The runs of each
part are the comparisons of :mod:`acl_lab.lab.plans`, the same configs the notebooks train.
"""
from __future__ import annotations

import functools
import gzip
import json
import platform
import shutil
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from ..analysis.stats import mean_sd_text, pm_text
from ..atomic import target, write_json, write_text
from ..config import TrainConfig
from ..errors import AclLabError
from ..locks import held
from . import plans

PARTS = ("pilot", "single", "gate", "multi", "early", "sensitivity")
FILES = {"pilot": "pilot_angles.csv", "single": "single_exit.csv", "gate": "acl_grad_gate.csv",
         "multi": "multi_exit.csv", "early": "early_exit.csv", "sensitivity": "sensitivity.csv"}
#: the run files a pack keeps (checkpoints never; representations for one seed per objective, see module docstring)
PACK_RUN_FILES = ("config.json", "predictions.npz")  # and history.jsonl, gzipped, and metrics.json (last)
REPRESENTATION_PARTS = ("single", "multi")


@dataclass
class EvidencePlan:
    """What to run. The defaults are what docs/RESULTS.md shows (a CPU-sized scale: the ``quick`` preset)."""
    tasks: list[str] = field(default_factory=lambda: ["rt-polarity", "rt-3way"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    preset: str = "quick"
    model: str | None = None
    lam: float = 0.1
    temperature: float = 0.1
    mu: float = 0.1
    multi_pooling: str = plans.MULTI_POOLING
    lambdas: list[float] = field(default_factory=lambda: [0.1, 1.0])
    exit_settings: dict[str, list[float]] = field(default_factory=lambda: {"entropy": [0.3, 0.6, 0.8, 0.9],
                                                                         "patience": [1, 2]})
    exit_split: str = "dev"
    exit_repeats: int = 1
    exit_batch_sizes: list[int] = field(default_factory=lambda: [64, 1])
    latency_samples: int = 200  # samples timed at batch size 1 (each costs a pass)
    max_drop: float = 0.01
    pilot_objectives: list[str] = field(default_factory=lambda: ["ce", "ce+scl"])
    thresholds: list[float] = field(default_factory=lambda: list(plans.GATE_THRESHOLDS))
    scl_thresholds: list[float] = field(default_factory=lambda: [90.0])
    part_seeds: dict[str, list[int]] = field(default_factory=dict)  # e.g. {"sensitivity": [0, 1, 2]}
    rep_samples: int = 400  # dev samples of the representations kept in the pack

    def seeds_for(self, part: str) -> list[int]:
        """The seeds of ``part``: ``part_seeds[part]`` if given, else ``seeds`` (``early`` follows ``multi``)."""
        part = "multi" if part == "early" else part
        return list(self.part_seeds.get(part) or self.seeds)

    def configs(self, part: str, task: str) -> list[TrainConfig]:
        """The training runs of one part on one task (``early`` reuses ``multi``'s runs), from :mod:`.plans`."""
        common = dict(model=self.model, seeds=self.seeds_for(part))
        if part == "pilot":
            return plans.pilot(self.preset, task, objectives=self.pilot_objectives, lam=self.lam,
                               temperature=self.temperature, **common)
        if part == "single":
            return plans.single(self.preset, task, lam=self.lam, temperature=self.temperature, **common)
        if part == "gate":
            return plans.gate(self.preset, task, thresholds=self.thresholds, scl_thresholds=self.scl_thresholds,
                              lam=self.lam, temperature=self.temperature, **common)
        if part in ("multi", "early"):
            return plans.multi(self.preset, task, lam=self.lam, mu=self.mu, pooling=self.multi_pooling,
                               temperature=self.temperature, **common)
        if part == "sensitivity":
            return plans.sensitivity(self.preset, task, lambdas=self.lambdas, temperatures=[self.temperature],
                                     **common)
        raise AclLabError(f"Unknown evidence part {part!r}; allowed: {', '.join(PARTS)}.")


def _machine() -> dict[str, Any]:
    import os

    import torch

    from ..utils import get_device
    from .notebook import versions

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(get_device("auto")),
            "versions": versions()}


def _with_task(df: pd.DataFrame, task: str) -> pd.DataFrame:
    df = df.drop(columns=["task"], errors="ignore")
    df.insert(0, "task", task)
    return df


def _save_part(results_dir: Path, part: str, frame: pd.DataFrame) -> Path:
    path = results_dir / FILES[part]
    with target(path) as tmp:
        frame.to_csv(tmp, index=False)
    return path


RUN_CIRCUMSTANCE_FIELDS = ("train_seconds", "device")  # metrics.json fields that say how a run ran, not what it found


def results_differ(a: Path, b: Path) -> bool:
    """Whether the finished runs in folders ``a`` and ``b`` report different results: their ``metrics.json`` differ
    in anything but :data:`RUN_CIRCUMSTANCE_FIELDS` (the same config trained again elsewhere takes other seconds)."""
    def results(folder: Path) -> dict:
        metrics = json.loads((folder / "metrics.json").read_text())
        return {k: v for k, v in metrics.items() if k not in RUN_CIRCUMSTANCE_FIELDS}
    return results(a) != results(b)


def _warn_if_results_differ(packed: Path, cached: Path) -> None:
    """Warn, naming the fix, when the finished cached run of a pack run's config reports other results: the pack keeps
    its committed copy (every table is built from it), and the cached one is not used. Both runs must be finished."""
    if results_differ(packed, cached):
        warnings.warn(f"The pack's run {packed} and the cached run {cached} have the same config but different "
                      "results (trained again, e.g. on another device or torch). The pack keeps its committed copy and "
                      "every table uses it. Fix: to replace it, delete the pack's run folder and run the same command "
                      "again.", UserWarning, stacklevel=3)


def _save_run(results_dir: Path, r: Any, reps_seed: int | None, rep_samples: int) -> None:
    """Copy one run's small files into the pack, ``results_dir/runs/<run folder>/`` (:data:`PACK_RUN_FILES`, and
    ``history.jsonl`` as ``history.jsonl.gz``: it is most of a pack's size), and, for a run of seed ``reps_seed``, its
    representations shrunk to ``rep_samples`` float16 dev samples. A run already in the pack is never overwritten:
    its committed copy stays, with a warning when the cached run reports other results
    (:func:`_warn_if_results_differ`).

    The pack's ``runs/`` is an exception in .gitignore (``/results/*/runs/``); other ``runs/`` folders are run
    caches and stay ignored."""
    from ..evaluate import shrink_representations

    src = Path(r.output_dir)
    dest = results_dir / "runs" / src.name
    if src.resolve() == dest.resolve():
        return
    done = dest / "metrics.json"
    if done.is_file():  # copied before (metrics.json is copied last): the committed pack run is never overwritten
        _warn_if_results_differ(dest, src)
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name in PACK_RUN_FILES:
        if (src / name).is_file():
            with target(dest / name) as tmp:  # complete or absent, like every file the kit writes
                shutil.copyfile(src / name, tmp)
    if (src / "history.jsonl").is_file():  # mtime 0: the same history gives the same bytes
        with target(dest / "history.jsonl.gz") as tmp:
            Path(tmp).write_bytes(gzip.compress((src / "history.jsonl").read_bytes(), mtime=0))
    reps = src / "representations.safetensors"
    if reps_seed is not None and r.config.seed == reps_seed and reps.is_file():
        with target(dest / reps.name) as tmp:
            shrink_representations(reps, tmp, rep_samples)
    with target(done) as tmp:  # last: its presence says the copy is complete
        shutil.copyfile(src / "metrics.json", tmp)


def representation_seed(plan: EvidencePlan, part: str) -> int | None:
    """The seed whose runs of ``part`` keep their representations in the pack (the part's lowest seed; for
    ``early``, whose models are the multi-exit part's runs, the multi-exit part's), or ``None`` for parts without."""
    if part == "early":
        part = "multi"
    return min(plan.seeds_for(part)) if part in REPRESENTATION_PARTS else None


def _add_missing_representations(results_dir: Path, runs_home: Path, cfg: TrainConfig, reps_seed: int | None,
                                 rep_samples: int) -> None:
    """Give a pack run of seed ``reps_seed`` that lacks its representations (one copied by a kit that did not keep
    them for runs the early-exit part trained) those of the finished run of the same config in the run cache, e.g.
    one trained again from the pack's ``config.json`` (same config and seed: the same model on a CPU), unless its
    results differ from the pack's. Nothing in the pack is overwritten."""
    from ..analysis.runs import run_name
    from ..evaluate import shrink_representations
    from ..result import is_finished

    if reps_seed is None or cfg.seed != reps_seed:
        return
    name = run_name(cfg)
    packed, cached = results_dir / "runs" / name, runs_home / "runs" / name
    reps = "representations.safetensors"
    if not is_finished(packed) or (packed / reps).is_file() or not is_finished(cached) or \
            not (cached / reps).is_file():
        return
    if results_differ(packed, cached):  # another model (obtain_run has warned): its representations would mislead
        return
    with target(packed / reps) as tmp:
        shrink_representations(cached / reps, tmp, rep_samples)


EARLY_OBJECTIVES = ("me-ce", "me-acl-cl")
EARLY_FILE = "early_exit.csv"  # per multi-exit run of the pack: its early-exit sweep (needs the checkpoint once)


def part_configs(plan: EvidencePlan, part: str, task: str) -> list[TrainConfig]:
    """The runs ``part`` needs on ``task``: :meth:`EvidencePlan.configs`, restricted for ``early`` to the
    multi-exit models it sweeps (:data:`EARLY_OBJECTIVES`)."""
    configs = plan.configs(part, task)
    return [c for c in configs if c.objective in EARLY_OBJECTIVES] if part == "early" else configs


def _check_shard(i: int, n: int) -> None:
    """Raise a clear :class:`AclLabError` unless shard ``i`` of ``n`` exists (``n >= 1`` and ``0 <= i < n``)."""
    if not (n >= 1 and 0 <= i < n):
        raise AclLabError(f"Shard {i}/{n} does not exist. Fix: give --shard I/N with 0 <= I < N, e.g. 0/2 and 1/2 for "
                          "two processes.")


def shard_of(configs: list[TrainConfig], shard: tuple[int, int] | None) -> list[TrainConfig]:
    """Shard ``i`` of ``n`` of ``configs``: every n-th run in seed order, so that shards running side by side finish
    whole seeds first. ``None``: all of them, in plan order."""
    if shard is None:
        return list(configs)
    i, n = shard
    _check_shard(i, n)
    ordered = sorted(configs, key=lambda c: c.seed)  # stable: the plan's objective order within a seed
    return ordered[i::n]


def obtain_run(cfg: TrainConfig, runs_home: Path, results_dir: Path, train: bool, need_checkpoint: bool = False,
               progress: bool = True) -> Any | None:
    """The finished run of ``cfg``: from the pack's ``runs/`` (small files only, so not when ``need_checkpoint``),
    else from the run cache ``runs_home/runs`` (with its checkpoint), else trained into the cache when ``train``
    (an interrupted run resumes); ``None`` when it is nowhere and ``train`` is False."""
    from ..analysis.runs import run_name
    from ..result import is_finished, load_result
    from .experiments import run_many

    home = runs_home / "runs" / run_name(cfg)
    packed = results_dir / "runs" / run_name(cfg)
    if is_finished(packed) and not need_checkpoint:  # the committed evidence first, so tables match --report-only
        if is_finished(home):
            _warn_if_results_differ(packed, home)
        return load_result(packed)
    if is_finished(home) and (not need_checkpoint or (home / "checkpoints" / "best").is_dir()):
        return load_result(home)
    if not train:
        return None
    return run_many([cfg], runs_home, progress=progress)[0]


def _early_rows(plan: EvidencePlan, r: Any, results_dir: Path) -> pd.DataFrame:
    """One multi-exit run's early-exit sweep at every batch size of ``plan``, saved beside its pack files (so the
    sweep, which needs the checkpoint, is done once, in the session that trained the run)."""
    from ..early_exit import sweep_run

    frame = pd.concat([sweep_run(r.output_dir, plan.exit_settings, split=plan.exit_split, repeats=plan.exit_repeats,
                                 batch_size=bs, max_samples=None if bs > 1 else plan.latency_samples)
                       for bs in plan.exit_batch_sizes], ignore_index=True).drop(columns=["run"])
    path = results_dir / "runs" / Path(r.output_dir).name / EARLY_FILE
    with target(path) as tmp:  # target creates the run's pack folder if needed
        frame.to_csv(tmp, index=False)
    return frame


def part_runs(plan: EvidencePlan, part: str, task: str, runs_home: Path, results_dir: Path, train: bool = True,
              shard: tuple[int, int] | None = None, progress: bool = True) -> tuple[list, list[pd.DataFrame]]:
    """Obtain (:func:`obtain_run`) the runs of ``part`` on ``task`` (only ``shard`` of them, when given), copying
    each into the pack as soon as it is there, so a session cut short keeps every run it finished. For ``early``,
    also each run's sweep (read from the pack when it was done before). Returns (runs, early sweeps)."""
    from ..analysis.runs import run_name

    reps_seed = representation_seed(plan, part)
    results, sweeps = [], []
    for cfg in shard_of(part_configs(plan, part, task), shard):
        if part == "early":
            saved = results_dir / "runs" / run_name(cfg) / EARLY_FILE
            if saved.is_file():
                sweeps.append(pd.read_csv(saved))
                continue
        r = obtain_run(cfg, runs_home, results_dir, train, need_checkpoint=part == "early", progress=progress)
        if r is None:
            continue
        _save_run(results_dir, r, reps_seed, plan.rep_samples)
        _add_missing_representations(results_dir, runs_home, cfg, reps_seed, plan.rep_samples)
        results.append(r)
        if part == "early":
            sweeps.append(_early_rows(plan, r, results_dir))
    return results, sweeps


def run_part(plan: EvidencePlan, part: str, task: str, runs_home: Path, results_dir: Path,
             progress: bool = True, train: bool = True) -> pd.DataFrame | None:
    """Obtain one part's runs on ``task`` (:func:`part_runs`; ``train=False``: only those already finished) and
    return its long table (with a ``task`` column), or ``None`` when no run of it is there yet."""
    from ..analysis.gradients import angle_long_frame
    from ..analysis.runs import history_frame, per_exit_frame, results_frame

    results, sweeps = part_runs(plan, part, task, Path(runs_home), Path(results_dir), train=train, progress=progress)
    if part == "early":
        return _with_task(pd.concat(sweeps, ignore_index=True), task) if sweeps else None
    if not results:
        return None
    if part == "pilot":
        return _with_task(angle_long_frame(history_frame(results)), task)
    if part in ("single", "sensitivity", "gate"):
        return _with_task(results_frame(results).drop(columns=["run"]), task)
    frames = [per_exit_frame(results, split).assign(split=split) for split in ("dev", "test")]
    return _with_task(pd.concat(frames, ignore_index=True), task)


def _git_commit() -> str:
    """The commit of the kit's checkout (``"unknown"`` outside git), with ``+dirty`` if files are changed."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def plan_of(results_dir: str | Path) -> EvidencePlan:
    """The :class:`EvidencePlan` a pack was made with (from its ``plan.json``)."""
    path = Path(results_dir) / "plan.json"
    if not path.is_file():
        raise AclLabError(f"{str(path)!r} does not exist, so {str(results_dir)!r} is not a results pack. Fix: point at "
                          "a pack folder (e.g. results/standard), or make one with `python -m acl_lab evidence "
                          "--pack DIR`.")
    raw = json.loads(path.read_text()).get("plan", {})
    known = {f for f in EvidencePlan.__dataclass_fields__}
    return EvidencePlan(**{k: v for k, v in raw.items() if k in known})


def _update_meta(meta_path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Read ``plan.json``, apply ``change(meta)`` and write it back, holding a lock beside it, so shards running
    side by side never lose each other's entries (:func:`acl_lab.locks.held` on ``.plan.lock``)."""
    with held(meta_path.with_name(".plan.lock")):
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        change(meta)
        write_json(meta_path, meta, indent=1)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``"0/2"`` -> ``(0, 2)``; ``None``/``""`` -> ``None``; anything else a clear error."""
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise AclLabError(f"--shard {text!r} is not I/N. Fix: e.g. --shard 0/2 in one process and --shard 1/2 in "
                          "another.") from None
    _check_shard(i, n)
    return i, n


def _record_part(meta: dict[str, Any], key: str, seconds: float, done: int, planned: int, train: bool) -> None:
    """Note in ``plan.json``'s ``meta`` that part/task ``key`` ended: its ``seconds`` (when it could ``train``), how
    many of its ``planned`` runs are ``done``, and when."""
    if train:
        meta["seconds"][key] = round(seconds, 1)
    meta.setdefault("done", {})[key] = {"runs": done, "planned": planned}
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")


def merged_plan(packed: dict[str, Any] | None, plan: EvidencePlan) -> dict[str, Any]:
    """The plan a pack records after ``plan`` adds to it: ``plan``'s settings, with the tasks and seeds of the plan
    already recorded (``packed``) kept in front of any new ones, so that a shard or a re-run naming fewer tasks or
    seeds (``--tasks rt-3way``) does not drop the others from the report, which reads the recorded plan."""
    merged = asdict(plan)
    for key in ("tasks", "seeds"):
        before = list((packed or {}).get(key) or [])
        merged[key] = before + [v for v in merged[key] if v not in before]
    return merged


def run_evidence(plan: EvidencePlan, runs_home: str | Path, results_dir: str | Path,
                 parts: Iterable[str] = PARTS, progress: bool = True, command: str | None = None,
                 train: bool = True, shard: tuple[int, int] | None = None) -> dict[str, Path]:
    """Run ``parts`` for every task of ``plan``; after each (part, task), rewrite that part's CSV.

    Runs (with checkpoints) live under ``runs_home/runs`` and are reused by config; each finished
    run is copied into the pack (``results_dir/runs/``) at once, and a run already in the pack is
    read from there, so a later session goes on from a committed pack (only ``early`` needs a
    checkpoint, and sweeps each model once, see :func:`part_runs`). ``results_dir`` gets only small
    files: the part CSVs, the runs' small files, and ``plan.json`` (the plan, the commands, the
    machine, the seconds each part took, and how many of each part's runs are in).

    ``train=False`` trains nothing: the CSVs are written from the runs already there (a partial
    pack says so in ``plan.json["done"]``). With ``shard=(i, n)`` this process trains only its
    share of each part (:func:`shard_of`) and writes no CSV; run the shards side by side, then
    once more with ``train=False`` to write the tables.
    """
    from ..analysis.runs import run_name

    parts = list(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise AclLabError(f"Unknown evidence part(s) {unknown}; allowed: {', '.join(PARTS)}.")
    runs_home, results_dir = Path(runs_home), Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    meta_path = results_dir / "plan.json"

    def start(meta: dict) -> None:
        meta.update({"plan": merged_plan(meta.get("plan"), plan), "machine": _machine(), "commit": _git_commit()})
        if command:  # every command that added to this pack; "command" is the latest that wrote the tables
            if shard is None:  # a shard writes runs only: the tables (and the figures' captions) are not its own
                meta["command"] = command
            meta.setdefault("commands", []).append(command)
        meta.setdefault("seconds", {})

    _update_meta(meta_path, start)
    written = {}
    for part in parts:
        for task in plan.tasks:
            t0 = time.perf_counter()
            if shard is not None:
                part_runs(plan, part, task, runs_home, results_dir, train=train, shard=shard, progress=progress)
                key = f"{part}/{task}/shard {shard[0]}/{shard[1]}"
                _update_meta(meta_path, lambda m: m["seconds"].update({key: round(time.perf_counter() - t0, 1)}))
                continue
            frame = run_part(plan, part, task, runs_home, results_dir, progress=progress, train=train)
            planned = part_configs(plan, part, task)
            packed = results_dir / "runs"
            done = sum((packed / run_name(c) / (EARLY_FILE if part == "early" else "metrics.json")).is_file()
                       for c in planned)
            old = results_dir / FILES[part]
            kept = pd.read_csv(old) if old.exists() else None
            # rows of other tasks stay; the rows of this task are replaced
            keep = kept[kept["task"] != task] if kept is not None else None
            frames = [f for f in (keep, frame) if f is not None and len(f)]  # no empty frame: it turns ints to floats
            if frames:
                written[part] = _save_part(results_dir, part, pd.concat(frames, ignore_index=True))
            _update_meta(meta_path, functools.partial(_record_part, key=f"{part}/{task}",
                                                      seconds=time.perf_counter() - t0, done=done,
                                                      planned=len(planned), train=train))
    return written


def pack_progress(meta: dict[str, Any]) -> list[str]:
    """The parts of a pack that are not complete, as ``"single/rt-3way: 12 of 20 runs"`` (from ``plan.json``)."""
    return [f"{key}: {d['runs']} of {d['planned']} runs" for key, d in (meta.get("done") or {}).items()
            if d["runs"] < d["planned"]]


# ---------------------------------------------------------------------------
# the report: figures and tables from the saved files only
# ---------------------------------------------------------------------------

def _read(results_dir: Path, part: str) -> pd.DataFrame | None:
    path = results_dir / FILES[part]
    return pd.read_csv(path) if path.exists() else None


def pilot_tables(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per task and probe: fraction of batches over 90 degrees and median angle (mean ± sd over seeds), overall and
    per third of training (:func:`acl_lab.analysis.gradients.conflict_summary` and ``phase_summary``, formatted)."""
    from ..analysis.gradients import conflict_summary, phase_summary

    def cells(s: pd.DataFrame) -> dict[str, list[str]]:
        return {"over 90°": [pm_text(m, sd, 3) for m, sd in zip(s["frac_over_90_mean"], s["frac_over_90_sd"])],
                "median angle (°)": [pm_text(m, sd, 1) for m, sd in zip(s["median_angle_mean"], s["median_angle_sd"])]}

    by = ("task", "objective", "probe") if "objective" in df.columns else ("task", "probe")
    overall = conflict_summary(df, by)
    phases = phase_summary(df, by)
    return (overall[[*by, "seeds", "batches"]].assign(**cells(overall)),
            phases[list(by)].assign(third=phases["phase"], **cells(phases)))


def single_table(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Per task and objective: dev and test ``metric`` and ACL-Grad's drop rate, mean ± sd over seeds."""
    rows = []
    for (task, objective), d in df.groupby(["task", "objective"], sort=False):
        row = {"task": task, "objective": objective, "seeds": len(d)}
        for split in ("dev", "test"):
            row[f"{split} {metric}"] = mean_sd_text(d[f"{split}_{metric}"], 3)
        rate = d["drop_rate"].dropna()
        row["ACL-Grad drop rate"] = mean_sd_text(rate, 3) if len(rate) else "-"
        rows.append(row)
    return pd.DataFrame(rows)


def multi_table(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Per task, split and objective: mean over the shallow half of the exits and the final exit."""
    from ..analysis.exits import shallow_and_final

    rows = []
    for (task, split), d in df.groupby(["task", "split"], sort=False):
        head = shallow_and_final(d, metric)
        for objective, r in head.iterrows():
            rows.append({"task": task, "split": split, "objective": objective,
                         "shallow layers": ",".join(str(k) for k in r["shallow_layers"]),
                         f"shallow-half {metric}": pm_text(r["shallow_mean"], r["shallow_sd"], 3),
                         f"final-exit {metric}": pm_text(r["final"], r["final_sd"], 3), "seeds": r["seeds"]})
    return pd.DataFrame(rows)


def gate_table(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Per task, objective (gated) and threshold: the gate's drop rate and dev/test ``metric``, mean ± sd over seeds."""
    rows = []
    for (task, objective, threshold), d in df.groupby(["task", "objective", "threshold"], sort=False):
        row = {"task": task, "objective": objective + (" + gate" if objective == "ce+scl" else ""),
               "threshold (°)": f"{threshold:g}", "seeds": len(d),
               "drop rate": mean_sd_text(d["drop_rate"].dropna(), 3) if d["drop_rate"].notna().any() else "-"}
        for split in ("dev", "test"):
            row[f"{split} {metric}"] = mean_sd_text(d[f"{split}_{metric}"], 3)
        rows.append(row)
    return pd.DataFrame(rows)


def paired_groups(results_dir: str | Path, plan: EvidencePlan, part: str, task: str) -> dict[str, dict[int, Any]]:
    """The pack's runs of ``part`` on ``task`` as ``{label: {seed: TrainResult}}`` (:func:`plans.run_label`); the gate
    part also gets its baselines ``ce`` and ``ce+scl`` from the single part. Missing runs are left out."""
    from ..analysis.runs import find_runs

    sources = [(part, plan.configs(part, task))]
    if part == "gate":
        sources.append(("single", [c for c in plan.configs("single", task) if c.objective in ("ce", "ce+scl")]))
    groups: dict[str, dict[int, Any]] = {}
    for source, configs in sources:
        for r in find_runs(configs, results_dir):
            groups.setdefault(plans.run_label(r.config, source), {})[r.config.seed] = r
    return groups


def paired_tables(results_dir: str | Path, plan: EvidencePlan, part: str, metric: str = "accuracy",
                  n_resamples: int = 2000) -> pd.DataFrame:
    """Numeric paired comparisons (:func:`acl_lab.analysis.paired.paired_frame`) of ``part`` for every task of the
    pack, with a ``task`` column; the pairs are :func:`plans.paired_pairs`."""
    from ..analysis.paired import paired_frame

    frames = []
    for task in plan.tasks:
        groups = paired_groups(results_dir, plan, part, task)
        pairs = plans.paired_pairs(part, list(groups))
        if pairs:
            frames.append(_with_task(paired_frame(groups, pairs, metric=metric, n_resamples=n_resamples), task))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _paired_markdown(frame: pd.DataFrame) -> list[str]:
    from ..analysis.paired import format_paired
    from ..analysis.tables import markdown_table

    out = []
    for task, d in frame.groupby("task", sort=False):
        out += [f"{task}:", "", markdown_table(format_paired(d)), ""]
    return out


def early_table(df: pd.DataFrame, metric: str = "accuracy", max_drop: float = 0.01) -> pd.DataFrame:
    """Per task, model and batch size, per seed: the fastest setting losing at most ``max_drop``; then mean ± sd
    over seeds."""
    from ..analysis.exits import best_speedup

    if "batch_size" not in df.columns:
        df = df.assign(batch_size=64)
    rows = []
    for (task, objective, batch_size), d in df.groupby(["task", "objective", "batch_size"], sort=False):
        best = pd.concat([best_speedup(s, metric, max_drop=max_drop).assign(seed=seed)
                          for seed, s in d.groupby("seed")])
        full = d.groupby("seed")[f"full_{metric}"].first()
        rows.append({"task": task, "objective": objective, "batch size": int(batch_size), "seeds": len(best),
                     f"full-model {metric}": mean_sd_text(full, 3),
                     f"wall speed-up at <= {max_drop:g} lost": mean_sd_text(best["wall_speedup"], 2),
                     "layer speed-up": mean_sd_text(best["layer_speedup"], 2),
                     "settings chosen": ", ".join(f"{c} {t:g}" if c != "full model" else c
                                                  for c, t in zip(best["criterion"], best["threshold"])),
                     "max layer speed-up seen": round(float(d["layer_speedup"].max()), 2)})
    return pd.DataFrame(rows)


def sensitivity_table(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Per task, objective and lambda: dev ``metric`` mean ± sd over seeds, and each objective's range over lambda.
    ``seeds`` counts the row's seeds; a cell with fewer (a lambda still being run) says how many it has."""
    rows = []
    for (task, objective), d in df.groupby(["task", "objective"], sort=False):
        means = d.groupby("lam")[f"dev_{metric}"].mean()
        row = {"task": task, "objective": objective}
        n_row = int(d["seed"].nunique())
        for lam, g in d.groupby("lam"):
            n = int(g["seed"].nunique())
            text = mean_sd_text(g[f"dev_{metric}"], 3)
            row[f"λ={lam:g}"] = f"{text} (n={n})" if 1 < n < n_row else text  # one value says "(n=1)" itself
        row["range over λ"] = round(float(means.max() - means.min()), 4)
        row["seeds"] = n_row
        rows.append(row)
    return pd.DataFrame(rows)


PAIRED_NOTE = ("Each row reads \"a − b\" in accuracy points. *Paired over seeds*: the per-seed difference (same "
               "seed, same data order), its mean and 95% t-interval. *Paired over examples*: the seed-averaged "
               "per-example correctness of a and b on the same examples, 95% paired-bootstrap interval "
               "(scipy.stats.bootstrap, percentile, 2000 resamples); McNemar: exact p of each seed "
               "(scipy.stats.binomtest on the discordant examples). Verdict: an interval containing 0 is \"no "
               "difference at this scale\"; above 0 \"higher\", below 0 \"lower\".")


def pack_caption(meta: dict[str, Any]) -> str:
    """What a figure of a pack shows: "saved: standard preset, 5 seeds, command ..." (from plan.json)."""
    plan = meta.get("plan") or {}
    seeds = plan.get("seeds") or []
    text = f"saved: {plan.get('preset', '?')} preset, {len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
    done = list((meta.get("done") or {}).values())
    if any(d["runs"] < d["planned"] for d in done):
        text += f" (partial: {sum(d['runs'] for d in done)} of {sum(d['planned'] for d in done)} runs in)"
    return text + (f", command {meta['command']}" if meta.get("command") else "")


def build_report(results_dir: str | Path, metric: str = "accuracy") -> Path:
    """Figures (PNG) and ``tables.md`` from the CSVs in ``results_dir``; trains nothing. Returns tables.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..analysis.tables import markdown_table
    from ..viz.plots import angle_curves, angle_histogram, plot_early_exit, plot_layer_scores, plot_sensitivity
    from .notebook import save_figure

    results_dir = Path(results_dir)
    if not any((results_dir / f).exists() for f in FILES.values()):
        raise AclLabError(f"No evidence files in {results_dir} ({', '.join(FILES.values())}). Fix: run "
                          "`python -m acl_lab evidence` first (it trains), or point --results at the folder.")
    meta = json.loads((results_dir / "plan.json").read_text()) if (results_dir / "plan.json").exists() else {}
    out = ["# Evidence tables", "", "Generated by `python -m acl_lab evidence --report-only --results "
           f"{results_dir}` from the CSV files beside this one; do not edit by hand.", ""]

    missing = pack_progress(meta)
    if missing:
        out += ["**A partial pack.** These parts hold fewer runs than planned (the tables below use the runs that are "
                "in; the paired statistics use the seeds both sides have): " + "; ".join(missing) + ". The same "
                "command goes on from here.", ""]
    plan = EvidencePlan(**{k: v for k, v in (meta.get("plan") or {}).items() if k in EvidencePlan.__dataclass_fields__})
    caption = pack_caption(meta)
    pack_runs = (results_dir / "runs").is_dir()
    noted: list[bool] = []  # the note on the paired tables goes above the first one only

    def paired(part: str, title: str) -> None:
        if not pack_runs:
            return
        frame = paired_tables(results_dir, plan, part, metric)
        if len(frame):
            note = [] if noted else [PAIRED_NOTE, ""]
            noted.append(True)
            out.extend([f"### {title}: paired differences and verdicts", "", *note, *_paired_markdown(frame)])

    pilot = _read(results_dir, "pilot")
    if pilot is not None:
        if "objective" not in pilot.columns:
            pilot = pilot.assign(objective="ce")
        overall, phases = pilot_tables(pilot)
        out += ["## Pilot study: angle between grad(CE) and the contrastive gradient", "",
                "Measured while training each objective (`objective` column): CE alone, and CE+SCL jointly.", "",
                markdown_table(overall), "", "Per third of training:", "", markdown_table(phases), ""]
        for (task, objective), d in pilot.groupby(["task", "objective"], sort=False):
            fig, axes = plt.subplots(1, 2, figsize=(13, 4))
            angle_histogram(d, ax=axes[0], title=f"Angle to grad(CE) while training {objective}, all probed batches "
                                                 f"({task})")
            angle_curves(d, ax=axes[1], window=3, title=f"Angle against step while training {objective}, mean ± sd "
                                                        f"over seeds ({task})")
            fig.tight_layout()
            save_figure(fig, results_dir, f"pilot_{task}" + ("" if objective == "ce" else f"_{objective}"),
                        caption=caption)
            plt.close(fig)

    single = _read(results_dir, "single")
    if single is not None:
        out += ["## Single-exit objectives", "", markdown_table(single_table(single, metric)), ""]
        paired("single", "Single exit")

    gate = _read(results_dir, "gate")
    if gate is not None:
        out += ["## ACL-Grad where it acts: the gate at several thresholds", "",
                "`acl` with the gate at each threshold, and the same gate on CE+SCL's SCL term (`ce+scl + gate`).", "",
                markdown_table(gate_table(gate, metric)), ""]
        paired("gate", "The gate")

    multi = _read(results_dir, "multi")
    if multi is not None:
        out += ["## Multi-exit objectives", "", markdown_table(multi_table(multi, metric)), ""]
        paired("multi", "Multi-exit, final exit")
        for task, d in multi[multi["split"] == "dev"].groupby("task", sort=False):
            fig = plot_layer_scores(d, metric, title=f"Dev {metric} per exit ({task}, mean ± sd over seeds)")
            save_figure(fig, results_dir, f"multi_exit_{task}", caption=caption)
            plt.close(fig)

    early = _read(results_dir, "early")
    if early is not None:
        drop = (meta.get("plan") or {}).get("max_drop", 0.01)
        out += [f"## Early exit (fastest setting losing at most {drop:g}, per seed, then mean ± sd)", "",
                markdown_table(early_table(early, metric, drop)), ""]
        if "batch_size" not in early.columns:
            early = early.assign(batch_size=64)
        for (task, bs), d in early.groupby(["task", "batch_size"], sort=False):
            mean = d.groupby(["objective", "criterion", "threshold"], sort=False).mean(numeric_only=True).reset_index()
            fig = plot_early_exit(mean, metric, title=f"Early exit on {task}, batch size {bs}: {metric} against "
                                                      f"speed-up, mean over {d['seed'].nunique()} seed(s) (star: full "
                                                      "model)")
            save_figure(fig, results_dir, f"early_exit_{task}" + ("" if bs == 64 else f"_batch{bs}"), caption=caption)
            plt.close(fig)

    sens = _read(results_dir, "sensitivity")
    if sens is not None:
        out += ["## Sensitivity to lambda (dev)", "", markdown_table(sensitivity_table(sens, metric)), ""]
        paired("sensitivity", "ACL against CE+SCL at each lambda")
        for task, d in sens.groupby("task", sort=False):
            long = d.rename(columns={f"dev_{metric}": "value"})[["objective", "lam", "seed", "value"]]
            fig = plot_sensitivity(long, metric=metric, title=f"Dev {metric} against lambda ({task})")
            save_figure(fig, results_dir, f"sensitivity_{task}", caption=caption)
            plt.close(fig)

    if meta:
        out += ["## Where and how long", "", f"Command: `{meta.get('command', '?')}`; git commit "
                f"{meta.get('commit', '?')}.", "", f"Machine: {meta['machine']['platform']}, "
                f"{meta['machine']['cpu_count']} CPU(s), device {meta['machine']['device']}, torch "
                f"{meta['machine']['versions'].get('torch', '?')}.", "",
                (markdown_table(pd.DataFrame([{"part/task": k, "seconds": v} for k, v in meta["seconds"].items()]))
                 if meta.get("seconds") else "No part has been timed yet (a shard records its seconds when it ends)."),
                ""]
    path = results_dir / "tables.md"
    write_text(path, "\n".join(out))
    return path
