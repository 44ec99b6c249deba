"""Run notebooks in batches with papermill: parameter grids and the whole suite, restartable.

A sensitivity study (lambda x objective) or a smoke/quick pass over every notebook is
many notebook executions; done by hand, one loses track of which ran, which failed and
what each measured. Here every run leaves

* an executed copy of its notebook (papermill records the parameters in its metadata),
* its artifacts under its own ``OUTPUT_DIR``,
* one row in ``results.csv`` and ``results.md``: status, seconds, error, the grid
  parameters, and the headline numbers the notebook wrote with
  :func:`acl_lab.lab.notebook.record_metrics`.

A failed run does not stop the batch. A rerun skips every run whose executed copy is
a completed run of the same notebook code with the same parameters, so an interrupted
or partly failed batch simply continues.

Runs execute one after another in this process, or up to N at once in their own
processes (``jobs=N``), or as tasks on a Dask cluster (``scheduler=ADDRESS``); see
:mod:`acl_lab.lab.workers`. A grid's ``after`` key says which notebooks read another's
artifacts, and those runs wait for the runs they need at the same grid point.
"""
from __future__ import annotations

import ast
import itertools
import json
import re
import shutil
import string
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import nbformat
import pandas as pd
import papermill as pm
import yaml

from ..analysis.tables import markdown_table, text
from ..assets import notebooks_dir
from ..errors import AclLabError
from ..atomic import write_text
from ..locks import FolderLock

NOTEBOOKS_DIR = notebooks_dir()  # the checkout's notebooks/, or the copy shipped in the wheel
GRID_KEYS = ("notebooks", "output_dir", "output_template", "kernel", "timeout", "parameters", "grid", "after")
DEFAULT_TEMPLATE = "{notebook}/{name}.ipynb"
# the declared default's type -> the value types a run may give it (an int is a fine float)
ACCEPTED_TYPES: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,),
                                                list: (list, tuple)}


@dataclass
class RunSpec:
    """One planned notebook execution: which notebook, with which parameters, saved where, under which name.

    ``after`` holds the output paths of the runs it waits for (the grid's ``after`` key).
    """

    notebook: Path
    parameters: dict[str, Any]
    output_path: Path
    name: str
    after: tuple[Path, ...] = ()


@dataclass
class RunRecord:
    """What one execution gave: its status ("completed", "failed" or "skipped"), error line, time and metrics."""

    name: str
    notebook: Path
    parameters: dict[str, Any]
    output_path: Path
    status: str
    error: str | None
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# notebooks and their parameters
# ---------------------------------------------------------------------------
def default_kernel() -> str:
    """'acl-lab' (registered by scripts/setup.sh) if it exists, else 'python3'."""
    return "acl-lab" if "acl-lab" in _kernels() else "python3"


def _kernels() -> list[str]:
    from jupyter_client.kernelspec import KernelSpecManager

    return sorted(KernelSpecManager().find_kernel_specs())


def suite_notebooks() -> list[Path]:
    """The kit's notebooks ``notebooks/NN_*.ipynb`` in their numbered order."""
    return sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


def find_notebook(name: str | Path, base: Path | None = None) -> Path:
    """Resolve a notebook given absolute, relative to ``base`` (the grid file's folder), or in notebooks/.

    The ``.ipynb`` suffix may be left out. Raises an :class:`AclLabError` listing the
    available notebooks when none matches.
    """
    path = Path(name)
    options = [path] if path.suffix == ".ipynb" else [path, path.with_name(path.name + ".ipynb")]
    folders = list(dict.fromkeys(d.resolve() for d in (base, NOTEBOOKS_DIR) if d is not None))
    for option in options:
        for candidate in [option] if option.is_absolute() else [d / option for d in folders]:
            if candidate.is_file():
                return candidate.resolve()
    if path.is_absolute():
        folders = [path.parent]
    available = sorted({p.name for d in folders if d.is_dir() for p in d.glob("*.ipynb")})
    looked = ", ".join(map(str, folders))
    raise AclLabError(f"Notebook {str(name)!r} does not exist (looked in: {looked}); available: "
                      f"{', '.join(available) or 'none'}. Fix: use one of these names, or an absolute path.")


def declared_parameters(notebook: Path) -> dict[str, str]:
    """The notebook's ``parameters`` cell as {name: default source text}, read by papermill."""
    try:
        params = pm.inspect_notebook(str(notebook))
    except Exception as exc:  # noqa: BLE001 - papermill raises ValueError, JSON and IO errors alike
        raise AclLabError(f"Cannot read the parameters of notebook {str(notebook)!r}: {exc}. Fix: open it in "
                          "Jupyter, check it is a valid notebook with a kernel, and save it again.") from None
    return {name: p["default"] for name, p in params.items()}


def _literal_default(source: str) -> Any:
    """The default's value if it is a plain literal; ``None`` (accept anything) when it is an expression."""
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return None


def _check_value(notebook: Path, name: str, value: Any, default_source: str) -> None:
    """Raise if ``value`` does not have the type of the declared default (int/float/str/bool/list defaults only)."""
    default = _literal_default(default_source)
    accepted = ACCEPTED_TYPES.get(type(default))
    if accepted is None:
        return
    if isinstance(value, accepted) and (type(default) is bool or not isinstance(value, bool)):
        return
    kind = type(default).__name__
    hint = ""
    if isinstance(default, float) and isinstance(value, str):
        hint = " YAML reads a number like 1e-3 as text: write 1.0e-3 or 0.001, unquoted."
    raise AclLabError(f"Parameter {name}={value!r} ({type(value).__name__}) does not match the type of its "
                      f"default {default_source} ({kind}{' or int' if kind == 'float' else ''}) in {notebook.name}."
                      f" Fix: give a {kind} value.{hint}")


def check_parameters(notebook: Path, values: Mapping[str, list[Any]]) -> None:
    """Raise unless every parameter is declared by the notebook and every value has its default's type."""
    declared = declared_parameters(notebook)
    if not declared:
        raise AclLabError(f"Notebook {notebook.name} has no cell tagged 'parameters', so it takes no parameters "
                          f"(asked for: {', '.join(values)}). Fix: tag its parameters cell, or leave out the "
                          "parameters.")
    for name, options in values.items():
        if name not in declared:
            raise AclLabError(f"Parameter {name!r} is not declared in the parameters cell of {notebook.name}; "
                              f"declared: {', '.join(declared)}. Fix: use one of these names (case matters).")
        for value in options:
            _check_value(notebook, name, value, declared[name])


# ---------------------------------------------------------------------------
# grids
# ---------------------------------------------------------------------------
def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise AclLabError(f"Grid file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}). Fix: save "
                          "it as UTF-8.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise AclLabError(f"Grid file {str(path)!r} is not valid YAML{where}: {problem}. Fix: check the "
                          "indentation and quoting there (lists as [a, b], mappings as {key: value}).") from None


def load_grid(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Read and validate a grid (a YAML file or a dict) and return it normalised.

    The result has every key of :data:`GRID_KEYS`: absolute notebook paths, an absolute
    ``output_dir`` (relative ones are taken from the current directory; default
    ``outputs/batch/<yaml stem>``), the kernel, the timeout, the fixed ``parameters``
    and the ``grid`` of lists. Normalising is idempotent, so the result can be passed
    back in. Every mistake raises an :class:`AclLabError` naming the value and the fix.
    """
    if isinstance(source, Mapping):
        raw, base, stem, label = source, Path.cwd(), "grid", "the grid"
    else:
        path = Path(source)
        if not path.is_file():
            raise AclLabError(f"Grid file {str(path)!r} does not exist. Fix: give the path of a YAML grid, e.g. "
                              "notebooks/grids/seeds_smoke.yaml.")
        raw, base, stem, label = _read_yaml(path), path.resolve().parent, path.stem, f"grid file {str(path)!r}"
    if not isinstance(raw, Mapping):
        raise AclLabError(f"{label} must be a mapping with keys {', '.join(GRID_KEYS)}, not "
                          f"{type(raw).__name__}. Fix: see notebooks/grids/ for examples.")
    unknown = [k for k in raw if k not in GRID_KEYS]
    if unknown:
        raise AclLabError(f"Unknown key(s) {', '.join(map(repr, unknown))} in {label}; allowed: "
                          f"{', '.join(GRID_KEYS)}. Fix: rename or remove them (notebook parameters go under "
                          "'parameters' or 'grid').")

    notebooks = raw.get("notebooks")
    if not isinstance(notebooks, list) or not notebooks or not all(isinstance(n, (str, Path)) for n in notebooks):
        raise AclLabError(f"'notebooks' in {label} must be a non-empty list of notebook names, not {notebooks!r}. "
                          "Fix: e.g. notebooks: [00_tour.ipynb].")
    paths = [find_notebook(n, base) for n in notebooks]
    after = _load_after(raw.get("after"), paths, base, label)

    parameters, grid = raw.get("parameters") or {}, raw.get("grid") or {}
    for key, value in (("parameters", parameters), ("grid", grid)):
        if not isinstance(value, Mapping):
            raise AclLabError(f"'{key}' in {label} must be a mapping of parameter names, not {value!r}. "
                              f"Fix: e.g. {key}: {{PRESET: smoke}}.")
    for name, values in grid.items():
        if not isinstance(values, list) or not values:
            raise AclLabError(f"Grid entry {name}: {values!r} must be a non-empty list of values. Fix: e.g. "
                              f"{name}: [value1, value2]; a single fixed value goes under 'parameters'.")
    both = sorted(set(parameters) & set(grid))
    if both:
        raise AclLabError(f"Parameter(s) {', '.join(both)} are both fixed ('parameters') and varied ('grid'). "
                          "Fix: keep each in one place.")
    for path in paths:
        check_parameters(path, {**{k: [v] for k, v in parameters.items()}, **grid})

    kernel = raw.get("kernel") or default_kernel()
    if kernel not in _kernels():
        raise AclLabError(f"Kernel {kernel!r} is not registered; available: {', '.join(_kernels())}. Fix: run "
                          "scripts/setup.sh (it registers 'acl-lab'), or leave 'kernel' out.")
    timeout = raw.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0):
        raise AclLabError(f"'timeout' {timeout!r} must be a positive whole number of seconds per cell. "
                          "Fix: e.g. timeout: 1800, or leave it out for no limit.")
    template = raw.get("output_template", DEFAULT_TEMPLATE)
    if not isinstance(template, str) or not template.endswith(".ipynb"):
        raise AclLabError(f"'output_template' {template!r} must be a path ending in .ipynb. Fix: e.g. "
                          f"{DEFAULT_TEMPLATE!r}.")
    if Path(template).is_absolute() or ".." in Path(template).parts or template.startswith("~"):
        raise AclLabError(f"'output_template' {template!r} would write outside the batch's output folder. Fix: give "
                          f"a relative path without '..', e.g. {DEFAULT_TEMPLATE!r}; move the whole batch with "
                          "'output_dir' instead.")
    output_dir = raw.get("output_dir") or f"outputs/batch/{stem}"
    if not isinstance(output_dir, (str, Path)):
        raise AclLabError(f"'output_dir' {output_dir!r} in {label} must be a folder path. Fix: e.g. output_dir: "
                          f"outputs/batch/{stem}, or leave it out.")
    output_dir = Path(output_dir)
    return {"notebooks": paths, "after": after, "output_dir": output_dir.absolute(), "output_template": template,
            "kernel": kernel, "timeout": timeout, "parameters": dict(parameters), "grid": dict(grid)}


def _load_after(raw: Any, paths: list[Path], base: Path, label: str) -> dict[Path, list[Path]]:
    """The grid's ``after`` key, ``{notebook: [notebooks whose runs it reads]}``, resolved and checked.

    Each notebook named must be in the grid's ``notebooks``, and a notebook's
    prerequisites must be listed before it, so the one-at-a-time order already honours
    them and there can be no cycle.
    """
    if raw is None:
        return {}
    example = "Fix: e.g. after: {06_sensitivity.ipynb: [02_acl_finetuning.ipynb]}."
    if not isinstance(raw, Mapping):
        raise AclLabError(f"'after' in {label} must map a notebook to the notebooks it runs after, not {raw!r}. "
                          f"{example}")
    names = ", ".join(p.name for p in paths)
    after: dict[Path, list[Path]] = {}
    for dependent, needs in raw.items():
        needs = [needs] if isinstance(needs, (str, Path)) else needs
        if not isinstance(needs, list) or not needs or not all(isinstance(n, (str, Path)) for n in needs):
            raise AclLabError(f"'after' entry {dependent}: {needs!r} in {label} must be a non-empty list of "
                              f"notebook names. {example}")
        resolved = []
        for name in [dependent, *needs]:
            path = find_notebook(name, base)
            if path not in paths:
                raise AclLabError(f"'after' in {label} names {str(name)!r}, which is not one of the grid's notebooks "
                                  f"({names}). Fix: add it to 'notebooks', or remove it from 'after'.")
            resolved.append(path)
        me, needs_paths = resolved[0], resolved[1:]
        for need in needs_paths:
            if paths.index(need) >= paths.index(me):
                raise AclLabError(f"In {label}, {me.name} runs after {need.name}, but 'notebooks' lists "
                                  f"{need.name} {'as the same notebook' if need == me else 'later'}. Fix: list "
                                  f"{need.name} before {me.name} in 'notebooks'.")
        after[me] = list(dict.fromkeys(needs_paths))
    return after


def _slug(value: Any) -> str:
    """A value as file-name-safe text: lists joined by commas, odd characters replaced by '-'."""
    text = ",".join(_slug(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    return re.sub(r"[^A-Za-z0-9._+,=-]", "-", text)


def run_name(values: Mapping[str, Any]) -> str:
    """The name of one grid point: ``k=v`` pairs joined by '_' ("default" for an empty grid)."""
    return "_".join(f"{k}={_slug(v)}" for k, v in values.items()) or "default"


def expand_grid(grid: str | Path | Mapping[str, Any]) -> list[RunSpec]:
    """The cartesian product of the grid, one :class:`RunSpec` per (grid point, notebook).

    Runs are ordered by grid point, then by notebook in the listed order. Each point gets
    ``OUTPUT_DIR = <output_dir>/artifacts/<name>`` (shared by the notebooks of that
    point) unless the grid sets ``OUTPUT_DIR`` itself. A notebook named in the grid's
    ``after`` waits, at each point, for the runs of its prerequisites at that point
    (``RunSpec.after``); the others may run at once when ``jobs`` > 1.
    """
    g = load_grid(grid)
    points = [dict(zip(g["grid"], values)) for values in itertools.product(*g["grid"].values())]
    names = [run_name(p) for p in points]
    if len(set(names)) < len(names):
        raise AclLabError("Two grid points get the same run name once their values are made file-name safe "
                          f"({', '.join(sorted({n for n in names if names.count(n) > 1}))}). Fix: make the values "
                          "differ in letters or digits.")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(g["output_template"]) if f is not None]
    except ValueError as exc:
        raise AclLabError(f"'output_template' {g['output_template']!r} is not a valid template ({exc}). Fix: use "
                          "placeholders like {name} with matching braces; write {{ and }} for literal braces.") from None
    allowed = ["notebook", "name", *g["parameters"], *g["grid"]]
    bad = [f for f in fields if f not in allowed]
    if bad:
        raise AclLabError(f"'output_template' {g['output_template']!r} uses unknown placeholder(s) "
                          f"{', '.join('{' + f + '}' for f in bad)}; allowed: "
                          f"{', '.join('{' + f + '}' for f in allowed)}.")
    specs, seen = [], {}
    for point, name in zip(points, names):
        outputs: dict[Path, Path] = {}
        for notebook in g["notebooks"]:
            params = {**g["parameters"], **point}
            params.setdefault("OUTPUT_DIR", str(g["output_dir"] / "artifacts" / name))
            values = {**{k: _slug(v) for k, v in params.items()}, "notebook": notebook.stem, "name": name}
            try:
                output = g["output_dir"] / g["output_template"].format(**values)
            except ValueError as exc:
                raise AclLabError(f"'output_template' {g['output_template']!r} cannot be filled in: {exc}. Fix: "
                                  "use plain placeholders such as {name}, without format specs.") from None
            root = g["output_dir"].resolve()
            if not output.resolve().is_relative_to(root):
                raise AclLabError(f"Run {name!r} of {notebook.name} would write {str(output)!r}, outside the batch's "
                                  f"output folder {str(root)!r} ('output_template' {g['output_template']!r} filled "
                                  "with its values). Fix: use values without '..' in the template's placeholders, "
                                  f"or the default template {DEFAULT_TEMPLATE!r}.")
            if output in seen:
                raise AclLabError(f"'output_template' {g['output_template']!r} gives the same file {str(output)!r} "
                                  f"to runs {seen[output]!r} and {name!r} of {notebook.name}. Fix: include {{name}} "
                                  "and {notebook} in it.")
            seen[output] = name
            outputs[notebook] = output
            specs.append(RunSpec(notebook=notebook, parameters=params, output_path=output, name=name,
                                 after=tuple(outputs[n] for n in g["after"].get(notebook, []))))
    return specs


# ---------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------
def _error_line(exc: Exception) -> str:
    """The last line of an execution error: ``ename: evalue`` for a cell error, else the exception's last line."""
    if isinstance(exc, pm.PapermillExecutionError):
        return f"{exc.ename}: {exc.evalue}".strip().splitlines()[-1]
    lines = [line for line in str(exc).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    return f"{type(exc).__name__}: {last}" if type(exc).__name__ not in last else last


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists (curves, per-exit tables) are left out of the flat table."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif not isinstance(value, list):
            flat[f"{prefix}{key}"] = value
    return flat


def gather_metrics(notebook: Path, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The run's ``<OUTPUT_DIR>/<PRESET>/metrics/<notebook stem>.json``, flattened; {} if there is none.

    ``OUTPUT_DIR`` and ``PRESET`` come from ``parameters``, else from the notebook's
    defaults; a relative ``OUTPUT_DIR`` is taken from the notebook's folder, where it ran.
    """
    notebook = Path(notebook)
    defaults = declared_parameters(notebook)
    output_dir = parameters.get("OUTPUT_DIR", _literal_default(defaults.get("OUTPUT_DIR", "None")))
    preset = parameters.get("PRESET", _literal_default(defaults.get("PRESET", "None")))
    if not isinstance(output_dir, str) or not isinstance(preset, str):
        return {}
    path = notebook.parent / output_dir / preset / "metrics" / f"{notebook.stem}.json"
    try:
        metrics = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (ValueError, OSError):  # damaged or edited by hand: the run's row says so instead of a crash
        return {"metrics_error": f"{path.name} is not valid JSON"}
    return _flatten(metrics) if isinstance(metrics, Mapping) else {"metrics_error": f"{path.name} is not a mapping"}


def run_notebook(input_path: str | Path, output_path: str | Path, parameters: Mapping[str, Any],
                 kernel_name: str | None = None, timeout: int | None = None, name: str | None = None) -> RunRecord:
    """Execute one notebook with papermill into ``output_path`` and return its :class:`RunRecord`.

    It runs in the notebook's own folder (so relative paths mean what they mean in
    Jupyter), on ``kernel_name`` (default: :func:`default_kernel`), with ``timeout``
    seconds per cell. An error inside the notebook does not raise: the record says
    "failed" with the error's last line, and the executed copy shows where. The input
    notebook is never written; ``name`` defaults to the output's stem.
    """
    input_path, output_path = Path(input_path).resolve(), Path(output_path).absolute()
    if not input_path.is_file():
        raise AclLabError(f"Notebook {str(input_path)!r} does not exist. Fix: check the path.")
    if output_path.resolve() == input_path:
        raise AclLabError(f"The output {str(output_path)!r} is the input notebook itself; executing into it would "
                          "overwrite the notebook. Fix: give another output path.")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    error = None
    try:
        pm.execute_notebook(str(input_path), str(output_path), parameters=dict(parameters),
                            kernel_name=kernel_name or default_kernel(), execution_timeout=timeout,
                            cwd=str(input_path.parent), progress_bar=False)
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded and the batch goes on
        error = _error_line(exc)
    return RunRecord(name=name or output_path.stem, notebook=input_path, parameters=dict(parameters),
                     output_path=output_path, status="failed" if error else "completed", error=error,
                     seconds=time.perf_counter() - start,
                     metrics={} if error else gather_metrics(input_path, parameters))


def _code_sources(nb: nbformat.NotebookNode) -> list[str]:
    return [c.source for c in nb.cells
            if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])]


def previous_run(input_path: Path, output_path: Path, parameters: Mapping[str, Any]) -> float | None:
    """Seconds the earlier run took if ``output_path`` is a completed run of this notebook, else ``None``.

    Completed means: papermill recorded an end and no exception, every non-empty code
    cell was executed without an error output (an interrupted run leaves some
    unexecuted), the recorded parameters equal ``parameters``, and the code equals the
    input notebook's now (an edited notebook is run again).
    """
    if not Path(output_path).is_file():
        return None
    try:
        done = nbformat.read(str(output_path), as_version=4)
        source = nbformat.read(str(input_path), as_version=4)
    except (OSError, ValueError):  # a half-written or hand-broken copy: run again
        return None
    meta = done.metadata.get("papermill", {})
    if meta.get("exception") or not meta.get("end_time"):
        return None
    if json.loads(json.dumps(meta.get("parameters"))) != json.loads(json.dumps(dict(parameters))):
        return None
    for cell in done.cells:
        if cell.cell_type == "code" and cell.source.strip() and (
                cell.execution_count is None or any(o.output_type == "error" for o in cell.outputs)
                or cell.metadata.get("papermill", {}).get("status") in ("running", "failed")):
            return None
    if _code_sources(done) != _code_sources(source):
        return None
    return float(meta.get("duration") or 0.0)


# ---------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------
def _cell(value: Any) -> Any:
    """A parameter value for a table cell: lists become comma-joined text (hashable, groupable)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value




def write_results(df: pd.DataFrame, output_dir: Path) -> None:
    """Write ``results.csv`` and ``results.md`` into ``output_dir`` (each replaced whole, never half-written)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_text(output_dir / "results.csv", df.to_csv(index=False))
    write_text(output_dir / "results.md", markdown_table(df))


def _row(rec: RunRecord, extra: Mapping[str, Any]) -> dict[str, Any]:
    """A results row: name, notebook, status, seconds, error, then ``extra`` (never replacing those five)."""
    row = {"name": rec.name, "notebook": rec.notebook.name, "status": rec.status, "seconds": round(rec.seconds, 1),
           "error": rec.error or ""}
    row.update({k: v for k, v in extra.items() if k not in row})
    return row


def failed_record(spec: RunSpec, error: str, seconds: float = 0.0) -> RunRecord:
    """A "failed" record for a run that gave no record of its own (not run, or its process or worker died)."""
    return RunRecord(name=spec.name, notebook=spec.notebook, parameters=spec.parameters,
                     output_path=spec.output_path, status="failed", error=error, seconds=seconds)


def _skipped(spec: RunSpec, seconds: float) -> RunRecord:
    return RunRecord(name=spec.name, notebook=spec.notebook, parameters=spec.parameters, output_path=spec.output_path,
                     status="skipped", error=None, seconds=seconds, metrics=gather_metrics(spec.notebook, spec.parameters))


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="batch", unit="run", dynamic_ncols=True)


def _execute(specs: list[RunSpec], output_dir: Path, kernel: str, timeout: int | None, resume: bool,
             progress: bool, table: Callable[[list[RunRecord]], pd.DataFrame], jobs: int = 1,
             scheduler: str | None = None) -> pd.DataFrame:
    """Run (or skip) every spec on the runner for ``jobs``/``scheduler`` and return the results table.

    Completed runs are skipped (with ``resume``); a run starts once the runs in its
    ``after`` have finished, and is recorded failed without running when one of them
    failed. The results (rows in spec order) are rewritten after every finished run, a
    line is printed for each, and a tqdm bar counts done, failed and remaining runs. On
    Ctrl-C the running runs are stopped and the results so far are kept. Bad ``jobs`` or
    ``scheduler`` values are refused before anything is written; then the batch holds its
    output folder's lock (one batch per folder, :class:`acl_lab.locks.FolderLock`).
    """
    from .workers import make_runner

    runner = make_runner(jobs, scheduler, kernel=kernel, timeout=timeout)
    with FolderLock(output_dir, "batch"):
        return _execute_on(runner, specs, output_dir, resume, progress, table)


def _execute_on(runner, specs: list[RunSpec], output_dir: Path, resume: bool, progress: bool,
                table: Callable[[list[RunRecord]], pd.DataFrame]) -> pd.DataFrame:
    """The body of :func:`_execute`, with the runner made and the folder locked."""
    start = time.perf_counter()
    index = {spec.output_path: i for i, spec in enumerate(specs)}
    records: dict[int, RunRecord] = {}
    bar = _progress_bar(len(specs), progress)

    def finish(i: int, rec: RunRecord) -> None:
        records[i] = rec
        write_results(table([records[j] for j in sorted(records)]), output_dir)
        counts = Counter(r.status for r in records.values())
        detail = f" (earlier run: {rec.seconds:.1f} s)" if rec.status == "skipped" else f" in {rec.seconds:.1f} s"
        if progress:
            bar.write(f"[{len(records)}/{len(specs)}] {specs[i].notebook.name} {rec.name}: {rec.status}{detail}"
                      f"{': ' + rec.error if rec.error else ''}")
        bar.set_postfix_str(f"done {counts['completed'] + counts['skipped']}, failed {counts['failed']}, "
                            f"remaining {len(specs) - len(records)}", refresh=False)
        bar.update(1)

    waiting: list[int] = []
    for i, spec in enumerate(specs):
        earlier = previous_run(spec.notebook, spec.output_path, spec.parameters) if resume else None
        if earlier is not None:
            finish(i, _skipped(spec, earlier))
        else:
            waiting.append(i)
    running: dict[Any, int] = {}
    try:
        while waiting or running:
            for i in list(waiting):
                needs = [index[p] for p in specs[i].after]
                if any(n not in records for n in needs):
                    continue
                if runner.slots is not None and len(running) >= runner.slots:
                    break
                waiting.remove(i)
                failed = [n for n in needs if records[n].status == "failed"]
                if failed:
                    first = specs[failed[0]]
                    finish(i, failed_record(specs[i], f"not run: it runs after {first.notebook.name} {first.name}, "
                                                      "which failed"))
                    continue
                running[runner.submit(specs[i])] = i
            if running:
                for future in runner.wait_any(list(running)):
                    i = running.pop(future)
                    finish(i, runner.record(future, specs[i]))
    except KeyboardInterrupt:
        runner.cancel(list(running))
        raise
    finally:
        runner.close()
        bar.close()
    counts = Counter(r.status for r in records.values())
    if progress:
        print(f"{counts['completed']} completed, {counts['failed']} failed, {counts['skipped']} skipped in "
              f"{time.perf_counter() - start:.1f} s; results: {output_dir / 'results.md'}", flush=True)
    return table([records[j] for j in sorted(records)])


def run_grid(grid: str | Path | Mapping[str, Any], resume: bool = True, progress: bool = True, jobs: int = 1,
             scheduler: str | None = None) -> pd.DataFrame:
    """Run every point of a grid (see :func:`load_grid`) and return the results table.

    One row per run, in the grid's order: name, notebook, status, seconds (for a skipped
    run, those of its earlier run), error, the grid parameters (lists as comma-joined
    text) and the notebook's flattened metrics. Written to ``<output_dir>/results.csv``
    and ``results.md`` after every run. With ``resume``, completed runs are skipped.
    ``jobs`` runs that many at once, each in its own process; ``scheduler`` (a Dask
    scheduler address) runs each as a task on that cluster (see :mod:`acl_lab.lab.workers`).
    """
    g = load_grid(grid)
    specs = expand_grid(g)

    def table(records: list[RunRecord]) -> pd.DataFrame:
        return pd.DataFrame([_row(r, {**{k: _cell(r.parameters[k]) for k in g["grid"]}, **r.metrics})
                             for r in records])

    return _execute(specs, g["output_dir"], g["kernel"], g["timeout"], resume, progress, table, jobs, scheduler)


#: which notebooks of the suite read another's artifacts (through the shared OUTPUT_DIR), by number: a notebook
#: runs after these when the suite runs several at once (``jobs`` > 1). 03 draws 02's representations, 05 sweeps
#: 04's checkpoints, 06 reads 02's lambda-0.1 runs back (and would otherwise train them beside it), 07 explores the
#: runs of 01, 02 and 06.
SUITE_AFTER: dict[str, tuple[str, ...]] = {"03": ("02",), "05": ("04",), "06": ("02",), "07": ("01", "02", "06")}


def suite_specs(chosen: list[Path], parameters: Mapping[str, Any], out: Path) -> list[RunSpec]:
    """The suite's runs: one per notebook of ``chosen`` (numbered order), each ``after`` the chosen notebooks whose
    artifacts it reads (:data:`SUITE_AFTER`)."""
    outputs = {nb.stem[:2]: out / f"{nb.stem}.ipynb" for nb in chosen}
    return [RunSpec(notebook=nb, parameters=dict(parameters), output_path=outputs[nb.stem[:2]], name=nb.stem,
                    after=tuple(outputs[n] for n in SUITE_AFTER.get(nb.stem[:2], ()) if n in outputs))
            for nb in chosen]


def run_suite(preset: str = "quick", output_dir: str | Path | None = None, notebooks: list[str] | None = None,
              kernel_name: str | None = None, resume: bool = True, progress: bool = True,
              timeout: int | None = None, parameters: Mapping[str, Any] | None = None, jobs: int = 1
              ) -> pd.DataFrame:
    """Run the kit's notebooks in numbered order with ``PRESET=preset`` and one shared artifacts folder.

    ``parameters`` go to every notebook on top, e.g. ``{"SOURCE": "saved"}`` for the classroom mode
    (the saved pack, no training; give the pack's preset as ``preset``). A notebook whose parameters
    cell does not declare one of them (notebook 08, the live-only Hugging Face Trainer notebook, has no
    ``SOURCE``) is left out of that suite, with a line saying so.

    ``output_dir`` (default ``outputs/suite-<preset>``) receives the executed copies
    ``<stem>.ipynb``, ``artifacts/`` (the shared ``OUTPUT_DIR`` through which notebooks
    pass runs to each other), ``figures/`` (every PNG the notebooks saved) and
    ``results.csv``/``results.md`` (one row per notebook: status, seconds, error and its
    headline metrics as ``key=value`` text). ``notebooks`` picks some by stem or file
    name; they still run in numbered order. A failure does not stop the suite.

    ``jobs=N`` runs up to N notebooks at once, each in its own process with ``cores // N`` torch threads
    (:mod:`acl_lab.lab.workers`); a notebook still waits for those whose artifacts it reads
    (:data:`SUITE_AFTER`), and one whose predecessor failed is recorded failed without running.
    """
    from ..presets import check_preset

    check_preset(preset)
    out = Path(output_dir or f"outputs/suite-{preset}").absolute()
    chosen = sorted({find_notebook(n, NOTEBOOKS_DIR) for n in notebooks}) if notebooks else suite_notebooks()
    if not chosen:
        raise AclLabError(f"No notebooks NN_*.ipynb in {str(NOTEBOOKS_DIR)!r}. Fix: run from a source checkout, "
                          "or reinstall acl_lab from its wheel.")
    kernel = kernel_name or default_kernel()
    if kernel not in _kernels():
        raise AclLabError(f"Kernel {kernel!r} is not registered; available: {', '.join(_kernels())}. Fix: run "
                          "scripts/setup.sh (it registers 'acl-lab'), or leave the kernel out.")
    params = {"PRESET": preset, "OUTPUT_DIR": str(out / "artifacts"), **(parameters or {})}
    extra = set(parameters or {})
    left_out = [nb for nb in chosen if not extra <= set(declared_parameters(nb))]
    if left_out and progress:
        print(f"left out (no {', '.join(sorted(extra))} parameter): {', '.join(nb.stem for nb in left_out)}", flush=True)
    chosen = [nb for nb in chosen if nb not in left_out]
    specs = suite_specs(chosen, params, out)

    def table(records: list[RunRecord]) -> pd.DataFrame:
        return pd.DataFrame([_row(r, {"metrics": "; ".join(f"{k}={text(v)}" for k, v in r.metrics.items())})
                             for r in records])

    start = time.perf_counter()
    df = _execute(specs, out, kernel, timeout, resume, progress, table, jobs=jobs)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    pngs = sorted((out / "artifacts" / preset / "figures").glob("*.png"))
    for png in pngs:
        shutil.copy2(png, figures / png.name)
    if progress:
        print(f"suite {preset}: {len(pngs)} figures in {figures}; total wall time {time.perf_counter() - start:.1f} s",
              flush=True)
    return df

