"""A notebook alone in a fresh environment, as on Colab: no source checkout, no editable install.

Builds the wheel with ``python -m build``, makes a fresh venv holding only the CPU torch wheel
(``pip install torch==2.13.0``), installs acl_lab into it *through the notebooks' own setup cell* (ACL_LAB_SPEC
pointed at the wheel), copies notebooks/00_tour.ipynb and 02_acl_finetuning.ipynb into an empty folder, and runs
them there with papermill in the smoke preset on a kernel of that venv, with PYTHONPATH cleared and ACL_LAB_HOME
on an empty folder, so the offline assets are fetched on first use as a user's would be. They must pass, leave
their artifacts next to themselves (OUTPUT_DIR = "outputs", the default) and their metrics must read back.

Time (2 cores, other jobs running): the venv takes about 1-3.5 minutes (3:29 with PyPI downloads, less from
the pip cache), the asset fetch ~11 s from the pip cache, 00_tour ~55 s and 02 ~110 s. Marked ``notebooks``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from acl_lab.lab.notebook import read_metrics

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = ("00_tour.ipynb", "02_acl_finetuning.ipynb")
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")  # the CPU wheel (scripts/setup.sh uses the same)
KERNEL = "acl-alone"
SOURCE_IGNORE = shutil.ignore_patterns(".git", ".venv", "data", "outputs", "runs", "build", "dist", "*.egg-info",
                                       "__pycache__", ".pytest_cache", ".ipynb_checkpoints", "tests", "bench")

pytestmark = pytest.mark.notebooks


def _clean_env(home: Path) -> dict[str, str]:
    """The environment of a user who never saw the checkout: no PYTHONPATH, no venv, assets cached in ``home``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "JUPYTER_PATH", "JUPYTER_DATA_DIR")}
    env["ACL_LAB_HOME"] = str(home)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int, what: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}) after {seconds:.0f} s: {' '.join(cmd)}\n"
                    f"{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout + proc.stderr, seconds


def _setup_cell_with_spec(notebook: Path, spec: str) -> str:
    """The notebook's setup cell, its ACL_LAB_SPEC line pointed at ``spec`` (a user edits just that line)."""
    src = nbformat.read(notebook, as_version=4).cells[1].source
    lines = src.splitlines()
    idx = [i for i, line in enumerate(lines) if line.startswith("ACL_LAB_SPEC = ")]
    assert len(idx) == 1, "the setup cell must hold exactly one ACL_LAB_SPEC line"
    lines[idx[0]] = f"ACL_LAB_SPEC = {spec!r}"
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Build, install and run; returns the work folder, the venv's python and the timings."""
    root = tmp_path_factory.mktemp("alone")
    times: dict[str, float] = {}
    env = _clean_env(root / "acl_lab_home")

    src = root / "src"
    shutil.copytree(REPO, src, ignore=SOURCE_IGNORE, symlinks=True)  # keeps the link acl_lab/_notebooks
    _, times["build"] = _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(root / "dist"), str(src)],
                             env, root, 600, "python -m build")
    wheels = sorted((root / "dist").glob("acl_lab-*.whl"))
    assert len(wheels) == 1, wheels

    venv = root / "venv"
    py = venv / "bin" / "python"
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "venv", str(venv)], env, root, 300, "python -m venv")
    _run([str(py), "-m", "pip", "install", "-q", "--no-compile", TORCH_SPEC], env, root, 900, f"pip install {TORCH_SPEC}")
    times["venv+torch"] = time.perf_counter() - t0
    work = root / "work"  # empty but for the notebooks
    work.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(REPO / "notebooks" / name, work / name)
    setup_out, times["setup cell (pip install acl_lab)"] = _run(
        [str(py), "-c", _setup_cell_with_spec(work / NOTEBOOKS[0], str(wheels[0]))], env, work, 1200, "the setup cell")
    _run([str(py), "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL], env, work, 120, "kernel install")
    outputs = {}
    for name in NOTEBOOKS:
        out, times[name] = _run([str(py), "-m", "papermill", name, name, "-p", "PRESET", "smoke", "-k", KERNEL,
                                 "--cwd", ".", "--no-progress-bar", "--execution-timeout", "600"],
                                env, work, 1200, f"papermill {name}")
        outputs[name] = out
    print("notebook-alone timings (s):", json.dumps({k: round(v, 1) for k, v in times.items()}))
    return {"root": root, "work": work, "py": py, "env": env, "wheel": wheels[0], "setup_out": setup_out,
            "times": times, "outputs": outputs}


def test_wheel_ships_the_notebooks_and_grids(alone):
    import zipfile

    names = set(zipfile.ZipFile(alone["wheel"]).namelist())
    for path in sorted((REPO / "notebooks").glob("*.ipynb")) + sorted((REPO / "notebooks" / "grids").glob("*.yaml")):
        assert f"acl_lab/_notebooks/{path.relative_to(REPO / 'notebooks')}" in names, path.name
    assert not any(n.startswith(("tests/", "data/", "notebooks/")) for n in names)


def test_the_venv_holds_only_torch_and_the_wheel(alone):
    """acl_lab comes from the venv's site-packages (not the checkout), torch is the CPU wheel that was there."""
    code = ("import acl_lab, acl_lab.lab.batch, torch, sys; print(acl_lab.__file__); print(torch.__version__); "
            f"print(acl_lab.lab.batch.NOTEBOOKS_DIR); print(any(p.startswith({str(REPO)!r}) for p in sys.path if p))")
    out = subprocess.run([str(alone["py"]), "-c", code], env=alone["env"], cwd=alone["work"], capture_output=True,
                         text=True, check=True).stdout.split()
    venv = alone["root"] / "venv"
    assert out[0].startswith(str(venv)) and "site-packages" in out[0], out
    assert out[1].startswith(TORCH_SPEC.split("==")[1]), out
    assert out[2].startswith(str(venv)) and Path(out[2], "02_acl_finetuning.ipynb").is_file(), out
    assert out[3] == "False"
    freeze = subprocess.run([str(alone["py"]), "-m", "pip", "freeze"], env=alone["env"], capture_output=True,
                            text=True, check=True).stdout
    acl_lines = [line for line in freeze.splitlines() if line.lower().startswith(("acl_lab", "acl-lab", "-e"))]
    assert acl_lines and all("@ file://" in line and ".whl" in line for line in acl_lines), acl_lines


def test_the_setup_cell_installed_it_and_printed_the_device(alone):
    assert "device: cpu" in alone["setup_out"] and "acl_lab 0.1.0" in alone["setup_out"]


def test_assets_were_fetched_into_the_user_cache_on_first_use(alone):
    home = Path(alone["env"]["ACL_LAB_HOME"])
    assert (home / "minilm-l6" / "tokenizer.json").is_file() and (home / "rt-corpus").is_dir()
    log = "".join(alone["outputs"].values())
    executed = nbformat.read(alone["work"] / NOTEBOOKS[0], as_version=4)
    shown = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "first use of asset minilm-l6" in shown + log


def test_tour_passes_alone_and_its_metrics_read_back(alone):
    out_dir = alone["work"] / "outputs" / "smoke"  # OUTPUT_DIR's default, next to the notebook
    m = read_metrics(out_dir, "00_tour")
    assert m["train_size"] == 64 and m["num_exits"] == 4
    for key in ("mean_angle_scl", "mean_angle_acl_embed"):
        assert 0.0 <= m[key] <= 180.0, (key, m[key])
    assert sorted(p.name for p in (out_dir / "figures").glob("00_*.png"))


def test_training_notebook_passes_alone_and_its_metrics_read_back(alone):
    out_dir = alone["work"] / "outputs" / "smoke"
    m = read_metrics(out_dir, "02_acl_finetuning")
    assert m["preset"] == "smoke" and m["objectives"] == ["ce", "ce+scl", "acl-embed", "acl"]
    for objective in m["objectives"]:
        value = m[f"{objective}.dev_accuracy"]
        assert isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0, (objective, value)
    assert 0.0 <= m["acl.drop_rate"] <= 1.0
    runs = sorted((out_dir / "runs").glob("*/metrics.json"))
    assert len(runs) == 4, runs
    executed = nbformat.read(alone["work"] / "02_acl_finetuning.ipynb", as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors and all(c.execution_count for c in executed.cells if c.cell_type == "code")
