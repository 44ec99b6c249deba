"""The evidence behind docs/RESULTS.md: the paper's five comparisons, run on the offline tasks, saved small.

Two stages, so that the published figures can be redrawn without training:

* :func:`run_evidence` trains (or reads back, through :func:`acl_lab.lab.experiments.run_many`'s
  run cache) every run the comparisons need, sweeps early exit, and writes small CSV and
  JSON files under ``results_dir`` after *each* part, so an interrupted session keeps the
  parts it finished;
* :func:`build_report` reads only those files and writes the PNG figures and
  ``tables.md``. ``python -m acl_lab evidence --report-only`` runs it alone.

Every objective gets the same data, steps and hyper-parameters (those of ``preset``);
nothing is tuned, so each objective's tuning budget is one configuration. The runs of each
part are the comparisons of :mod:`acl_lab.lab.plans`, the same configs the notebooks train.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from ..analysis.stats import mean_sd_text, pm_text
from ..atomic import target, write_json, write_text
from ..config import TrainConfig
from ..errors import AclLabError
from . import plans

PARTS = ("pilot", "single", "multi", "early", "sensitivity")
FILES = {"pilot": "pilot_angles.csv", "single": "single_exit.csv", "multi": "multi_exit.csv",
         "early": "early_exit.csv", "sensitivity": "sensitivity.csv"}


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
    max_drop: float = 0.01

    def configs(self, part: str, task: str) -> list[TrainConfig]:
        """The training runs of one part on one task (``early`` reuses ``multi``'s runs), from :mod:`.plans`."""
        common = dict(model=self.model, seeds=self.seeds)
        if part == "pilot":
            return plans.pilot(self.preset, task, **common)
        if part == "single":
            return plans.single(self.preset, task, lam=self.lam, temperature=self.temperature, **common)
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


def _save_metrics(results_dir: Path, results: Iterable) -> None:
    """Each run's metrics.json (small) under ``results_dir/run_metrics/<task>/<run folder>.json`` (committed:
    a folder named ``runs/`` is git-ignored as a run cache)."""
    for r in results:
        dest = results_dir / "run_metrics" / r.config.task / f"{Path(r.output_dir).name}.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_json(dest, r.metrics, indent=1)


def run_part(plan: EvidencePlan, part: str, task: str, runs_home: Path, results_dir: Path,
             progress: bool = True) -> pd.DataFrame:
    """Train (or read back) one part's runs on ``task`` and return its long table (with a ``task`` column)."""
    from ..analysis.gradients import angle_long_frame
    from ..analysis.runs import history_frame, per_exit_frame, results_frame
    from ..early_exit import sweep_run
    from .experiments import run_many

    results = run_many(plan.configs(part, task), runs_home, progress=progress)
    _save_metrics(results_dir, results)
    if part == "pilot":
        return _with_task(angle_long_frame(history_frame(results)), task)
    if part in ("single", "sensitivity"):
        return _with_task(results_frame(results).drop(columns=["run"]), task)
    if part == "multi":
        frames = [per_exit_frame(results, split).assign(split=split) for split in ("dev", "test")]
        return _with_task(pd.concat(frames, ignore_index=True), task)
    sweeps = [sweep_run(r.output_dir, plan.exit_settings, split=plan.exit_split, repeats=plan.exit_repeats)
              for r in results if r.config.objective in ("me-ce", "me-acl-cl")]
    return _with_task(pd.concat(sweeps, ignore_index=True).drop(columns=["run"]), task)


def run_evidence(plan: EvidencePlan, runs_home: str | Path, results_dir: str | Path,
                 parts: Iterable[str] = PARTS, progress: bool = True) -> dict[str, Path]:
    """Run ``parts`` for every task of ``plan``; after each (part, task), rewrite that part's CSV.

    Runs (with checkpoints) live under ``runs_home/runs`` and are reused by config;
    ``results_dir`` gets only small files: the CSVs, each run's metrics JSON, and
    ``plan.json`` (the plan, the machine, the seconds each part took).
    """
    parts = list(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise AclLabError(f"Unknown evidence part(s) {unknown}; allowed: {', '.join(PARTS)}.")
    runs_home, results_dir = Path(runs_home), Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    meta_path = results_dir / "plan.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.update({"plan": asdict(plan), "machine": _machine()})
    meta.setdefault("seconds", {})
    written = {}
    for part in parts:
        frames = []
        old = results_dir / FILES[part]
        kept = pd.read_csv(old) if old.exists() else None
        for i, task in enumerate(plan.tasks):
            t0 = time.perf_counter()
            frames.append(run_part(plan, part, task, runs_home, results_dir, progress=progress))
            meta["seconds"][f"{part}/{task}"] = round(time.perf_counter() - t0, 1)
            # rows of other tasks from an earlier session stay; the rows of the tasks run now are replaced
            keep = kept[~kept["task"].isin(plan.tasks[:i + 1])] if kept is not None else None
            earlier = [keep] if keep is not None and len(keep) else []  # no empty frame: it would turn ints to floats
            written[part] = _save_part(results_dir, part, pd.concat([*earlier, *frames], ignore_index=True))
            meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
            write_json(meta_path, meta, indent=1)
    return written


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

    by = ("task", "probe")
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


def early_table(df: pd.DataFrame, metric: str = "accuracy", max_drop: float = 0.01) -> pd.DataFrame:
    """Per task, model and seed: the fastest setting losing at most ``max_drop``, then mean ± sd over seeds."""
    from ..analysis.exits import best_speedup

    rows = []
    for (task, objective), d in df.groupby(["task", "objective"], sort=False):
        best = pd.concat([best_speedup(s, metric, max_drop=max_drop).assign(seed=seed)
                          for seed, s in d.groupby("seed")])
        full = d.groupby("seed")[f"full_{metric}"].first()
        rows.append({"task": task, "objective": objective, "seeds": len(best),
                     f"full-model {metric}": mean_sd_text(full, 3),
                     f"wall speed-up at <= {max_drop:g} lost": mean_sd_text(best["wall_speedup"], 2),
                     "layer speed-up": mean_sd_text(best["layer_speedup"], 2),
                     "settings chosen": ", ".join(f"{c} {t:g}" if c != "full model" else c
                                                  for c, t in zip(best["criterion"], best["threshold"])),
                     "max layer speed-up seen": round(float(d["layer_speedup"].max()), 2)})
    return pd.DataFrame(rows)


def sensitivity_table(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """Per task, objective and lambda: dev ``metric`` mean ± sd over seeds, and each objective's range over lambda."""
    rows = []
    for (task, objective), d in df.groupby(["task", "objective"], sort=False):
        means = d.groupby("lam")[f"dev_{metric}"].mean()
        row = {"task": task, "objective": objective}
        for lam, g in d.groupby("lam"):
            row[f"λ={lam:g}"] = mean_sd_text(g[f"dev_{metric}"], 3)
        row["range over λ"] = round(float(means.max() - means.min()), 4)
        row["seeds"] = int(d["seed"].nunique())
        rows.append(row)
    return pd.DataFrame(rows)


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

    pilot = _read(results_dir, "pilot")
    if pilot is not None:
        overall, phases = pilot_tables(pilot)
        out += ["## Pilot study: angle between grad(CE) and the contrastive gradient (CE training)", "",
                markdown_table(overall), "", "Per third of training:", "", markdown_table(phases), ""]
        for task, d in pilot.groupby("task", sort=False):
            fig, axes = plt.subplots(1, 2, figsize=(13, 4))
            angle_histogram(d, ax=axes[0], title=f"Angle to grad(CE), all probed batches ({task})")
            angle_curves(d, ax=axes[1], window=3, title=f"Angle against step, mean ± sd over seeds ({task})")
            fig.tight_layout()
            save_figure(fig, results_dir, f"pilot_{task}")
            plt.close(fig)

    single = _read(results_dir, "single")
    if single is not None:
        out += ["## Single-exit objectives", "", markdown_table(single_table(single, metric)), ""]

    multi = _read(results_dir, "multi")
    if multi is not None:
        out += ["## Multi-exit objectives", "", markdown_table(multi_table(multi, metric)), ""]
        for task, d in multi[multi["split"] == "dev"].groupby("task", sort=False):
            fig = plot_layer_scores(d, metric, title=f"Dev {metric} per exit ({task}, mean ± sd over seeds)")
            save_figure(fig, results_dir, f"multi_exit_{task}")
            plt.close(fig)

    early = _read(results_dir, "early")
    if early is not None:
        drop = (meta.get("plan") or {}).get("max_drop", 0.01)
        out += [f"## Early exit (fastest setting losing at most {drop:g}, per seed, then mean ± sd)", "",
                markdown_table(early_table(early, metric, drop)), ""]
        for task, d in early.groupby("task", sort=False):
            mean = d.groupby(["objective", "criterion", "threshold"], sort=False).mean(numeric_only=True).reset_index()
            fig = plot_early_exit(mean, metric, title=f"Early exit on {task}: {metric} against speed-up, mean over "
                                                      f"{d['seed'].nunique()} seed(s) (star: full model)")
            save_figure(fig, results_dir, f"early_exit_{task}")
            plt.close(fig)

    sens = _read(results_dir, "sensitivity")
    if sens is not None:
        out += ["## Sensitivity to lambda (dev)", "", markdown_table(sensitivity_table(sens, metric)), ""]
        for task, d in sens.groupby("task", sort=False):
            long = d.rename(columns={f"dev_{metric}": "value"})[["objective", "lam", "seed", "value"]]
            fig = plot_sensitivity(long, metric=metric, title=f"Dev {metric} against lambda ({task})")
            save_figure(fig, results_dir, f"sensitivity_{task}")
            plt.close(fig)

    if meta:
        out += ["## Where and how long", "", f"Machine: {meta['machine']['platform']}, "
                f"{meta['machine']['cpu_count']} CPU(s), device {meta['machine']['device']}, torch "
                f"{meta['machine']['versions'].get('torch', '?')}.", "",
                markdown_table(pd.DataFrame([{"part/task": k, "seconds": v} for k, v in meta.get("seconds", {}).items()])), ""]
    path = results_dir / "tables.md"
    write_text(path, "\n".join(out))
    return path
