"""Seeded random mutations of the files and values users hand to the kit: each gives a result or one AclLabError.

Four kinds of input, mutated at the text/byte level (truncation, stray tabs, quotes, NUL bytes,
invalid UTF-8, YAML/JSON syntax) and at the value level (wrong types, NaN, infinities, huge
numbers, paths with '..'):

* grid YAML files, through :func:`acl_lab.lab.batch.expand_grid`;
* GLUE TSV files, through :func:`acl_lab.data.load_task` (``source="local"``);
* the ``config.json`` of a finished run, through ``python -m acl_lab train --config ... --resume``
  (the CLI's :func:`acl_lab.cli.main`, in-process);
* notebook parameter values, through the batch's type check :func:`acl_lab.lab.batch.check_parameters`
  and the kit's notebook setup call :func:`acl_lab.presets.preset_config`.

Any other exception, or a case that takes longer than :data:`CASE_SECONDS`, is a failure; the
test lists every failure with the mutation that caused it. Counts go to stdout (``-s``).
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import signal
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import nbformat
import pytest
import yaml
from conftest import kernel_name, write_toy_sst2

from acl_lab.lab import batch
from acl_lab.cli import main
from acl_lab.data import load_task
from acl_lab.errors import AclLabError
from acl_lab.presets import preset_config
from acl_lab.trainer import train

SEED = 16
CASE_SECONDS = 10
TOKENS = ["\t", "\n", "\r", "\r\n", '"', "'", ":", ": ", "- ", "[", "]", "{", "}", ",", "#", "&a ", "*a", "!!str ",
          "!!python/object/apply:os.system ['true']", "|", ">", "%", "@", "`", "\x00", "é", "../", "/", "~", "{name}",
          "{X}", "{0}", "{notebook!r}", "1e-3", "null", "true", ".inf", ".nan", "-1", "0", "99999999999999999999",
          " ", "label", "\ufeff", "\u2028", "NaN", "Infinity", "-Infinity", "1.5", "[]", "{}", "\\"]
RAW = [b"\xff", b"\xfe\xff", b"\x80", b"\xc3", b"\xed\xa0\x80"]  # invalid UTF-8
VALUES: list[Any] = [None, 0, -1, 1, 2, 1.5, -0.0, float("nan"), float("inf"), -float("inf"), 10**30, "", "x" * 300,
                     "../..", "/tmp/elsewhere", "~", [], [None], [1, "a"], [[1]], {}, {"a": 1}, True, False, "1e-3",
                     "0.1", "ce", "tiny", "smoke", "sst2"]


def mutate_bytes(rng: random.Random, data: bytes, ops: int) -> bytes:
    """``ops`` random edits: insert/replace a token or invalid byte, delete a span, truncate, copy or swap lines."""
    for _ in range(ops):
        op = rng.choice(["insert", "insert", "replace", "delete", "truncate", "dup_line", "swap_lines", "raw"])
        at = rng.randrange(len(data) + 1)
        token = rng.choice(RAW) if op == "raw" else rng.choice(TOKENS).encode()
        if op in ("insert", "raw"):
            data = data[:at] + token + data[at:]
        elif op == "replace":
            data = data[:at] + token + data[at + rng.randint(1, 8):]
        elif op == "delete":
            data = data[:at] + data[at + rng.randint(1, 20):]
        elif op == "truncate":
            data = data[:at]
        else:
            lines = data.split(b"\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            if op == "dup_line":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            data = b"\n".join(lines)
    return data


def mutate_value(rng: random.Random, obj: Any, depth: int = 0) -> Any:
    """Replace, drop or add one entry somewhere in a nested dict/list (or replace the whole thing)."""
    if not isinstance(obj, (dict, list)) or not obj or depth > 3 or rng.random() < 0.1:
        return rng.choice(VALUES)
    obj = json.loads(json.dumps(obj)) if isinstance(obj, dict) else list(obj)
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    key = rng.choice(keys)
    op = rng.random()
    if op < 0.15:
        del obj[key]
    elif op < 0.25 and isinstance(obj, dict):
        obj[rng.choice(["extra", "Notebooks", "lam ", "", "1"])] = rng.choice(VALUES)
    else:
        obj[key] = mutate_value(rng, obj[key], depth + 1)
    return obj


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def run_cases(kind: str, n: int, case: Callable[[random.Random, int], str]) -> Counter:
    """Run ``n`` seeded cases; each returns "ok" or raises. Failures (not AclLabError, or too slow) fail the test."""
    rng = random.Random(f"{SEED}-{kind}")
    counts: Counter = Counter()
    failures = []
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(n):
            signal.alarm(CASE_SECONDS)
            what = "?"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    what = case(rng, i)
                counts["ok"] += 1
            except AclLabError as exc:
                assert "\n" not in str(exc).strip() or kind == "tsv", f"{kind} case {i}: a multi-line error: {exc}"
                counts["AclLabError"] += 1
            except _Timeout:
                failures.append((i, "hang", what))
            except Exception as exc:  # noqa: BLE001 - every other exception is what the fuzz looks for
                failures.append((i, f"{type(exc).__name__}: {str(exc)[:200]}", what))
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    print(f"fuzz {kind}: {n} cases, {dict(counts)}, {len(failures)} failures")
    assert not failures, "\n".join(f"case {i}: {err}" for i, err, _ in failures[:20])
    assert counts["ok"] and counts["AclLabError"], counts  # both outcomes occur: the mutations bite, not all
    return counts


# ---------------------------------------------------------------------------
# grid YAML
# ---------------------------------------------------------------------------
def test_fuzz_grid_yaml(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name(), "language": "python"}
    cell = nbformat.v4.new_code_cell('X = 1\nLAMBDA = 0.1\nNAME = "a"\nFLAG = False\nSEEDS = None\nOUTPUT_DIR = "out"')
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    folder = tmp_path / "nbs"
    folder.mkdir()
    nbformat.write(nb, str(folder / "toy.ipynb"))
    kernels = batch._kernels()
    monkeypatch.setattr(batch, "_kernels", lambda: kernels)  # the kernel list does not change between cases
    base = {"notebooks": ["toy.ipynb"], "output_dir": str(tmp_path / "out"), "kernel": kernel_name(), "timeout": 60,
            "output_template": "{notebook}/{name}.ipynb", "parameters": {"NAME": "b", "SEEDS": [0, 1]},
            "grid": {"X": [1, 2], "LAMBDA": [0.1, 1.0], "FLAG": [True, False]}}
    text = yaml.safe_dump(base, sort_keys=False).encode()
    path = folder / "g.yaml"

    def case(rng: random.Random, i: int) -> str:
        if i % 2:
            data = mutate_bytes(rng, text, rng.randint(1, 3))
        else:
            data = yaml.safe_dump(mutate_value(rng, base), sort_keys=False, allow_unicode=True).encode()
        path.write_bytes(data)
        batch.expand_grid(path)
        return data.decode("utf-8", "replace")[:300]

    run_cases("grid", 160, case)


# ---------------------------------------------------------------------------
# GLUE TSV files
# ---------------------------------------------------------------------------
def test_fuzz_glue_tsv(tmp_path):
    root = write_toy_sst2(tmp_path / "glue", n_train=24, n_dev=8)
    files = {name: (root / "SST-2" / name).read_bytes() for name in ("train.tsv", "dev.tsv")}
    stsb = tmp_path / "stsb"
    (stsb / "STS-B").mkdir(parents=True)
    pair = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n" + "".join(
        f"{i}\tmain\tf\t2012\t{i}\ts\ts\ta cat {i}\ta dog {i}\t{i % 6}.0\n" for i in range(8))
    for name in ("train.tsv", "dev.tsv"):
        (stsb / "STS-B" / name).write_text(pair)

    def case(rng: random.Random, i: int) -> str:
        task, folder, originals = ("stsb", stsb, {n: pair.encode() for n in files}) if i % 5 == 0 else \
            ("sst2", root, files)
        name = rng.choice(list(originals))
        glue = folder / ("STS-B" if task == "stsb" else "SST-2")
        data = mutate_bytes(rng, originals[name], rng.randint(1, 4))
        for n, original in originals.items():
            (glue / n).write_bytes(data if n == name else original)
        dd = load_task(task, source="local", data_dir=str(folder))
        assert len(dd["train"]) > 0 and len(dd["dev"]) > 0
        return f"{task}/{name}: {data[:200]!r}"

    run_cases("tsv", 160, case)


# ---------------------------------------------------------------------------
# config.json of a run, resumed from the command line
# ---------------------------------------------------------------------------
def test_fuzz_config_json_on_resume(tiny_config, tmp_path):
    cfg = tiny_config.replace(max_steps=2, eval_every=2)
    out = Path(cfg.output_dir)
    train(cfg, progress=False)
    metrics = (out / "metrics.json").read_bytes()
    original = (out / "config.json").read_bytes()
    data = json.loads(original)

    def case(rng: random.Random, i: int) -> str:
        if i % 3 == 0:
            mutated = mutate_bytes(rng, original, rng.randint(1, 3))
        else:
            mutated = json.dumps(mutate_value(rng, data), indent=2).encode()
        (out / "config.json").write_bytes(mutated)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["train", "--config", str(out / "config.json"), "--output-dir", str(out), "--resume",
                       "--no-progress"])
        assert (out / "metrics.json").read_bytes() == metrics, "the finished run was changed"
        if rc == 2:
            lines = err.getvalue().strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()
            raise AclLabError(lines[0])
        assert rc == 0, rc
        return mutated.decode("utf-8", "replace")[:300]

    run_cases("config", 120, case)


# ---------------------------------------------------------------------------
# notebook parameter values
# ---------------------------------------------------------------------------
# the kit's notebooks pass these parameters to preset_config (see each notebook's setup cell)
CONFIG_OF = {"TASK": "task", "MODEL": "model", "LAMBDA": "lam", "TEMPERATURE": "temperature", "MU": "mu",
             "EXIT_WEIGHTS": "exit_weights", "POOLING": "pooling", "THRESHOLD": "threshold"}


def test_fuzz_notebook_parameter_values():
    notebooks = batch.suite_notebooks()
    declared = {nb: batch.declared_parameters(nb) for nb in notebooks}
    palette = VALUES + ["quick", "full", "fast", "rt-polarity", "mean", "cls", "ascending", "minilm-l6", 90.0,
                        200.0, -5.0, 0.5, ["ce", "acl"], ["nope"], [0, 1], "umap", "entropy"]

    def case(rng: random.Random, i: int) -> str:
        nb = rng.choice(notebooks)
        names = rng.sample(sorted(declared[nb]), rng.randint(1, 3))
        values = {n: rng.choice(palette) for n in names}
        batch.check_parameters(nb, {n: [v] for n, v in values.items()})
        params = {n: batch._literal_default(d) for n, d in declared[nb].items()} | values
        overrides = {CONFIG_OF[n]: params[n] for n in CONFIG_OF if n in params}
        preset_config(params["PRESET"], **overrides)
        return f"{nb.name}: {values}"

    run_cases("params", 200, case)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_numbers_are_refused_by_name(value):
    for field in ("lam", "mu", "temperature", "threshold", "lr", "epochs", "weight_decay", "max_grad_norm"):
        with pytest.raises(AclLabError, match=field):
            preset_config("smoke", **{field: value})
