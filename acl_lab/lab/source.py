"""Where a notebook's runs come from: trained here (``live``) or read from a results pack (``saved``).

Every notebook takes one parameter, ``SOURCE``:

* ``"live"`` (the default): train as always, into ``OUTPUT_DIR/<PRESET>/runs`` (finished runs are reused);
* ``"saved"``: the committed pack :data:`DEFAULT_PACK` (``results/standard``), or the path of another pack
  folder. Nothing trains: the runs are found in the pack *by config*
  (:func:`acl_lab.analysis.runs.find_runs` with the configs of :mod:`acl_lab.lab.plans` at the pack's
  preset, seeds and model, read from its ``plan.json``), so a notebook reads exactly the runs the
  evidence pipeline made for the same comparison. This is the classroom mode: seconds, not an hour.

:func:`open_source` returns a :class:`RunSource`; notebooks only call it. Its :meth:`RunSource.caption`
is the line every figure carries: ``"saved: standard preset, 5 seeds, command ..."`` or
``"live: quick preset, 2 seeds"``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from ..analysis.runs import find_runs, load_runs, run_name
from ..config import TrainConfig
from ..errors import AclLabError
from ..presets import check_preset
from ..result import TrainResult

MODES = ("live", "saved")
DEFAULT_PACK = Path(__file__).resolve().parents[2] / "results" / "standard"


@dataclass
class RunSource:
    """A notebook's run source; see the module docstring. ``pack``/``meta`` are set in the saved mode only."""

    mode: str
    preset: str
    out: Path
    pack: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.mode == "live"

    @property
    def root(self) -> Path:
        """Where runs are read: ``OUTPUT_DIR/<PRESET>`` (its ``runs/``) live, the pack saved."""
        return self.out if self.live else self.pack

    @property
    def plan(self):
        """The pack's :class:`~acl_lab.lab.evidence.EvidencePlan` (saved mode)."""
        from .evidence import plan_of

        return plan_of(self.pack)

    # ---- the pack's choices, where the notebook leaves them open ----------
    def seeds(self, seeds: Sequence[int] | None, part: str = "single") -> list[int] | None:
        """``seeds`` if given; else, saved, the pack's seeds of ``part`` (live: ``None``, the plans' default)."""
        if seeds or self.live:
            return list(seeds) if seeds else None
        return self.plan.seeds_for(part)

    def model(self, model: str | None) -> str | None:
        """``model`` if given; else, saved, the pack's model (``None``: the preset's)."""
        return model if model or self.live else self.plan.model

    @property
    def lambdas(self) -> list[float] | None:
        """The pack's sensitivity lambdas (saved), ``None`` live."""
        return None if self.live else list(self.plan.lambdas)

    def caption(self, seeds: Sequence[int] | None = None) -> str:
        """What the figures show: "saved: <preset> preset, N seeds, command ..." or "live: <preset> preset, N seeds"."""
        if not self.live:
            from .evidence import pack_caption

            return pack_caption(self.meta)
        n = len(seeds) if seeds else 0
        return f"live: {self.preset} preset" + (f", {n} seed{'s' if n != 1 else ''}" if n else "")

    # ---- runs -----------------------------------------------------------
    def runs(self, configs: Iterable[TrainConfig], part: str, live_root: str | Path | None = None,
             progress: bool = True) -> list[TrainResult]:
        """Live: train (or read back) ``configs`` under ``live_root`` (default :attr:`out`); saved: those of them that
        are in the pack. A partial pack (a long computation still going on, see ``plan.json["done"]``) shows the
        runs it has with a warning naming the missing ones; none at all is one :class:`AclLabError` naming the
        runs and the command that makes them."""
        configs = list(configs)
        if self.live:
            from .experiments import run_many

            return run_many(configs, live_root or self.out, progress=progress)
        return self.find(configs, part)

    def find(self, configs: Iterable[TrainConfig], part: str, strict: bool = False) -> list[TrainResult]:
        """The finished runs of ``configs`` (nothing trains). Live, missing ones are left out. Saved, a partial pack
        (a long computation still going on, see ``plan.json["done"]``) gives the runs it has with a warning naming
        the missing ones, and none at all raises :meth:`missing`. ``strict``: any missing run raises."""
        configs = list(configs)
        found = find_runs(configs, self.root)
        if len(found) == len(configs):
            return found
        if strict or (not self.live and not found):
            raise self.missing(_lacking(configs, found) if strict else configs, part)
        if not self.live:
            import warnings

            lacking = [run_name(c) for c in _lacking(configs, found)]
            warnings.warn(f"A partial pack: {self.pack} holds {len(found)} of the {len(configs)} runs of part {part!r} "
                          f"this notebook reads; showing those. Missing: {', '.join(lacking[:6])}"
                          f"{' ...' if len(lacking) > 6 else ''}. The pack's command goes on from here.", stacklevel=2)
        return found

    def all_runs(self) -> list[TrainResult]:
        """Every finished run of the source (``root/runs``), for notebooks that pick runs with ``pick_run``."""
        return load_runs(self.root)

    def missing(self, configs: Sequence[TrainConfig], part: str, made_by: str | None = None) -> AclLabError:
        """The error for runs that are not there: which, and how to make them (a notebook live, or the evidence
        command for the pack)."""
        names = [run_name(c) for c in configs]
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        if self.live:
            where = f"{self.out / 'runs'}"
            fix = f"run notebook {made_by} first with the same OUTPUT_DIR and PRESET" if made_by else "train them"
            return AclLabError(f"{len(names)} run(s) this notebook reads are not in {where}: {listed}. Fix: {fix}, "
                               "then run this notebook again.")
        tasks = sorted({c.task for c in configs})
        command = self.meta.get("command")
        make = (f"python -m acl_lab evidence --preset {self.preset} --tasks {','.join(tasks)} --parts {part} "
                f"--pack {self.pack}")
        hint = f" (the pack was made with: {command})" if command else ""
        return AclLabError(f"The pack {str(self.pack)!r} has no run for {len(names)} config(s) this notebook reads "
                           f"(part {part!r}, task {', '.join(tasks)}): {listed}. Fix: make them with `{make}` "
                           f"plus the pack's other options{hint}; or use SOURCE=\"live\" to train here.")

    # ---- measured tables of the pack (what needs checkpoints live) --------
    def table(self, part: str) -> pd.DataFrame:
        """The pack's CSV of ``part`` (e.g. ``early``: the early-exit sweep measured when the pack was made)."""
        from .evidence import FILES

        if self.live:
            raise AclLabError(f"SOURCE='live' has no saved table of {part!r}. Fix: compute it here, or use "
                              "SOURCE='saved'.")
        path = self.pack / FILES[part]
        if not path.is_file():
            raise AclLabError(f"The pack {str(self.pack)!r} has no {FILES[part]} (part {part!r}). Fix: make it with "
                              f"`python -m acl_lab evidence --preset {self.preset} --parts {part} --pack {self.pack}`.")
        return pd.read_csv(path)

    def early_exit_sweep(self, runs: Iterable[TrainResult], settings: Mapping[str, Sequence[float]],
                         split: str = "dev", repeats: int = 2, batch_size: int = 64) -> pd.DataFrame:
        """The early-exit sweep of ``runs`` (:func:`acl_lab.early_exit.sweep_run`'s rows): measured here live (it
        needs the checkpoints), read from the pack's ``early_exit.csv`` saved (the rows of these runs' task,
        objective and seed at ``batch_size``, for the ``settings`` asked)."""
        runs = list(runs)
        if self.live:
            from ..early_exit import sweep_run

            return pd.concat([sweep_run(r.output_dir, dict(settings), split=split, repeats=repeats,
                                        batch_size=batch_size) for r in runs], ignore_index=True)
        table = self.table("early")
        if "batch_size" not in table.columns:
            table = table.assign(batch_size=64)
        frames = []
        for r in runs:
            c = r.config
            rows = table[(table["task"] == c.task) & (table["objective"] == c.objective) & (table["seed"] == c.seed)
                         & (table["batch_size"] == batch_size)]
            keep = pd.concat([rows[(rows["criterion"] == crit) & rows["threshold"].isin([float(t) for t in ts])]
                              for crit, ts in settings.items()])
            want = sum(len(ts) for ts in settings.values())
            if len(keep) < want:
                have = sorted({(k, float(t)) for k, t in zip(rows["criterion"], rows["threshold"])})
                raise AclLabError(f"The pack's early-exit sweep of {c.objective} seed {c.seed} ({c.task}, batch "
                                  f"{batch_size}) lacks some of the settings asked {dict(settings)}; it has {have}. "
                                  "Fix: ask for those settings (THRESHOLDS, PATIENCES), or remake the part with "
                                  f"`python -m acl_lab evidence --parts early --pack {self.pack}`.")
            frames.append(keep.drop(columns=["task"]))
        return pd.concat(frames, ignore_index=True)

    def no_grid(self) -> pd.DataFrame:
        """What the batch runner's table is when nothing ran (saved mode: notebook 06 reads the pack)."""
        return pd.DataFrame(columns=["name", "status", "seconds", "error"])


def _lacking(configs: Iterable[TrainConfig], found: Iterable[TrainResult]) -> list[TrainConfig]:
    """The ``configs`` that no run of ``found`` is (matched by run folder name, :func:`run_name`), in their order."""
    have = {Path(r.output_dir).name for r in found}
    return [c for c in configs if run_name(c) not in have]


def open_source(source: str, preset: str, output_dir: str | Path) -> RunSource:
    """The :class:`RunSource` of a notebook's ``SOURCE`` parameter: "live", "saved" (:data:`DEFAULT_PACK`) or a pack
    folder. Saved, the preset is the pack's (the notebook's ``PRESET`` is ignored)."""
    if not isinstance(source, str) or not source:
        raise AclLabError(f"SOURCE={source!r} is not valid; allowed: 'live', 'saved', or the path of a results pack. "
                          "Fix: use SOURCE='live' to train here, SOURCE='saved' to read results/standard.")
    if source == "live":
        check_preset(preset)
        return RunSource("live", preset, Path(output_dir) / preset)
    pack = DEFAULT_PACK if source == "saved" else Path(source).expanduser()
    plan_file = pack / "plan.json"
    if not plan_file.is_file():
        raise AclLabError(f"SOURCE={source!r}: no results pack at {str(pack)!r} (no plan.json); SOURCE is 'live', "
                          "'saved' or the path of a pack folder. Fix: use "
                          "SOURCE='live', or make the pack with `python -m acl_lab evidence --preset standard "
                          f"--pack {pack}` (CPU hours), or give the path of a pack folder.")
    meta = json.loads(plan_file.read_text())
    pack_preset = (meta.get("plan") or {}).get("preset") or preset
    return RunSource("saved", pack_preset, Path(output_dir) / pack_preset, pack=pack, meta=meta)
