"""The setup cell every notebook opens with (acl_lab.lab.notebook.setup_runtime), logins off, Google Drive as the
working folder on Colab (with a stand-in for google.colab), and notebook 03's PCA fallback where umap fails."""
from __future__ import annotations

import builtins
import os
import sys
import types
from pathlib import Path

import nbformat
import numpy as np
import pytest

from acl_lab.analysis import representations as alignment
from acl_lab.errors import AclLabError
from acl_lab.lab.notebook import setup_runtime, use_drive
from acl_lab.utils import QUIET_ENV, quiet_integrations
from conftest import NOTEBOOKS

ALL_NOTEBOOKS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(path: Path):
    return nbformat.read(path, as_version=4).cells


def test_one_setup_cell_the_same_everywhere():
    sources = {p.name: _cells(p)[1].source for p in ALL_NOTEBOOKS}
    assert len(ALL_NOTEBOOKS) >= 8 and len(set(sources.values())) == 1, "the setup cells differ"
    src = next(iter(sources.values()))
    assert "ACL_LAB_SPEC = " in src and "setup_runtime(drive_folder=DRIVE_FOLDER)" in src
    assert "-e" not in src.split("check_call")[1].split("\n")[0], "no editable install from a clone"
    for path in ALL_NOTEBOOKS:
        params = [c for c in _cells(path) if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1
        line = next(x for x in params[0].source.splitlines() if x.startswith("OUTPUT_DIR"))
        value = line.split("=", 1)[1].split("#")[0].strip().strip('"')
        assert not value.startswith(("..", "/")), f"{path.name}: OUTPUT_DIR {value!r} depends on the checkout"


def test_setup_cell_installs_nothing_when_present_and_prints_the_device(capsys, tmp_path, monkeypatch):
    """The cell as committed, run here: acl_lab is importable, so no pip; it prints versions, device, workdir."""
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr("subprocess.check_call", lambda *a, **k: calls.append(a))
    exec(compile(_cells(ALL_NOTEBOOKS[0])[1].source, "setup-cell", "exec"), {})
    out = capsys.readouterr().out
    assert calls == []
    assert "device: cpu" in out and "acl_lab 0.1.0" in out and str(tmp_path) in out


def test_logins_off_unless_asked_for(monkeypatch):
    for key in QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")  # the user asked for W&B: kept
    env = quiet_integrations()
    assert env["WANDB_MODE"] == "online" and os.environ["WANDB_DISABLED"] == "true"
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1" and os.environ["DISABLE_MLFLOW_INTEGRATION"] == "TRUE"


def test_drive_folder_outside_colab_is_one_clear_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    with pytest.raises(AclLabError, match="DRIVE_FOLDER.*Colab.*Fix"):
        setup_runtime(drive_folder="acl_lab")


def test_drive_folder_on_colab_holds_relative_output_dir(monkeypatch, tmp_path, capsys):
    """A stand-in google.colab: mount() is called once, then MyDrive/<folder> is the working folder, so
    OUTPUT_DIR = "outputs" lands on Drive; a second call does not mount again."""
    mounts = []
    mount_point = tmp_path / "drive"

    def mount(path):
        mounts.append(path)
        (Path(path) / "MyDrive").mkdir(parents=True)

    google = types.ModuleType("google")
    colab = types.ModuleType("google.colab")
    colab.drive = types.SimpleNamespace(mount=mount)
    google.colab = colab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.chdir(tmp_path)
    target = use_drive("acl_lab", mount_point=mount_point)
    assert target == mount_point / "MyDrive" / "acl_lab" and Path.cwd() == target
    assert Path("outputs").absolute() == target / "outputs"
    use_drive("acl_lab", mount_point=mount_point)
    assert mounts == [str(mount_point)]
    monkeypatch.chdir(tmp_path)
    info = setup_runtime(drive_folder=None)  # on "Colab" without Drive: a hint that runs are lost on recycle
    assert "DRIVE_FOLDER" in info["workdir"] and "recycles" in info["workdir"]


# ---------------------------------------------------------------------------------------------------------------
# umap: lazy, and PCA with a one-line note where it is missing or its import fails
# ---------------------------------------------------------------------------------------------------------------
def _points(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(20, 8)), rng.normal(size=(2, 8))


@pytest.mark.parametrize("failure", ["missing", "broken"])
def test_umap_import_failure_falls_back_to_pca(monkeypatch, capsys, failure):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "umap" or name.startswith("umap."):
            if failure == "missing":
                raise ModuleNotFoundError("No module named 'umap'")
            raise OSError("numba: could not load llvmlite library\nsecond line")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "umap", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    reps, emb = _points()
    xy, label_xy = alignment.project_2d(reps, emb, method="umap")
    note = capsys.readouterr().out.strip().splitlines()
    assert len(note) == 1 and "using PCA" in note[0] and ("ModuleNotFoundError" if failure == "missing" else
                                                          "OSError: numba") in note[0]
    pca_xy, pca_label_xy = alignment.project_2d(reps, emb, method="pca")
    assert np.array_equal(xy, pca_xy) and np.array_equal(label_xy, pca_label_xy)
    assert alignment.resolve_method("umap") == "pca"
    assert alignment.resolve_method("pca") == "pca"


def test_umap_is_imported_lazily():
    import subprocess

    code = ("import sys, acl_lab.analysis.representations, acl_lab.lab.notebook, acl_lab.viz.plots; "
            "print('umap' in sys.modules, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
