"""Small helpers every notebook uses: versions, artifacts between notebooks, figures, headline metrics.

Notebooks pass artifacts through ``OUTPUT_DIR``: training runs under
``OUTPUT_DIR/runs/<name>``, figures under ``OUTPUT_DIR/figures``, and each
notebook's headline numbers in ``OUTPUT_DIR/metrics/<notebook>.json``, which
tests and the batch runner read back.
"""
from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from ..atomic import target, write_json
from ..errors import AclLabError

PACKAGES = ("acl_lab", "torch", "transformers", "accelerate", "datasets", "numpy", "scikit-learn", "matplotlib",
            "umap-learn", "ipywidgets", "papermill")


def versions() -> dict[str, str]:
    """Versions of Python and the kit's main packages ("not installed" where missing)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def print_versions() -> None:
    """Print package versions and the device the kit will use."""
    from ..utils import get_device

    for name, version in versions().items():
        print(f"{name:>14}: {version}")
    print(f"{'device':>14}: {get_device('auto')}")


def require(path: str | Path, made_by: str) -> Path:
    """Return ``path`` if it exists; otherwise say which notebook makes it."""
    path = Path(path)
    if not path.exists():
        raise AclLabError(f"Missing artifact {str(path)!r}. It is made by notebook {made_by!r}: run that notebook "
                          "first with the same OUTPUT_DIR and PRESET, then run this one again.")
    return path


def caption_figure(fig, caption: str | None) -> None:
    """Write ``caption`` (what the figure shows: "saved: standard preset, 5 seeds, command ..." or "live: quick
    preset, 2 seeds") in small type above the figure's title, once."""
    if not caption or getattr(fig, "_acl_caption", None) == caption:
        return
    import textwrap

    # wrapped by hand: matplotlib's wrap=True confuses bbox_inches="tight" (a tall blank band above the figure)
    width = max(60, int(fig.get_figwidth() * 18))
    lines = textwrap.wrap(caption, width, break_on_hyphens=False)
    fig.text(0.5, 1.0, "\n".join(lines), ha="center", va="bottom", fontsize=7, color="0.35")
    fig._acl_caption = caption


def save_figure(fig, output_dir: str | Path, name: str, caption: str | None = None) -> Path:
    """Save a matplotlib figure as ``OUTPUT_DIR/figures/<name>.png`` (with :func:`caption_figure`'s ``caption``
    above it) and return the path."""
    caption_figure(fig, caption)
    folder = Path(output_dir) / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    with target(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    return path


def record_metrics(output_dir: str | Path, notebook: str, metrics: dict[str, Any]) -> Path:
    """Write a notebook's headline numbers to ``OUTPUT_DIR/metrics/<notebook>.json`` (read by tests and batches)."""
    folder = Path(output_dir) / "metrics"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{notebook}.json"
    write_json(path, metrics, indent=2, default=float)
    return path


def read_metrics(output_dir: str | Path, notebook: str) -> dict[str, Any]:
    """Read what :func:`record_metrics` wrote."""
    path = require(Path(output_dir) / "metrics" / f"{notebook}.json", notebook)
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------
# the setup cell (the same in every notebook; it installs acl_lab where missing, then calls this)
# ---------------------------------------------------------------------------
COLAB_DRIVE = Path("/content/drive")


def on_colab() -> bool:
    """True inside a Google Colab kernel."""
    import sys

    return "google.colab" in sys.modules


def device_line() -> str:
    """One line: the device the kit will use and, on CUDA, the GPU's name and memory."""
    import torch

    from ..utils import get_device

    device = get_device("auto")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bf16 = "bf16 supported" if torch.cuda.is_bf16_supported() else "no bf16: --amp auto uses fp16 + GradScaler"
        return f"device: cuda ({props.name}, {props.total_memory / 2**30:.1f} GiB, {bf16})"
    hint = " (no GPU: on Colab, Runtime > Change runtime type > GPU)" if on_colab() else ""
    return f"device: {device.type}{hint}"


def use_drive(folder: str, mount_point: Path = COLAB_DRIVE) -> Path:
    """Mount Google Drive (Colab asks once for access) and make ``MyDrive/<folder>`` the working folder.

    Relative paths, ``OUTPUT_DIR = "outputs"`` among them, then resolve on Drive, so runs, checkpoints and
    figures survive a recycled runtime, and re-running a notebook reuses its finished runs and resumes an
    interrupted one from its last checkpoint there.
    """
    import os

    if not on_colab():
        raise AclLabError(f"DRIVE_FOLDER={folder!r} needs Google Colab (Google Drive is mounted through "
                          "google.colab). Fix: set DRIVE_FOLDER = None outside Colab; OUTPUT_DIR is used as it is.")
    from google.colab import drive  # type: ignore[import-not-found]

    if not (mount_point / "MyDrive").is_dir():
        drive.mount(str(mount_point))
    target = mount_point / "MyDrive" / folder
    target.mkdir(parents=True, exist_ok=True)
    os.chdir(target)
    return target


def setup_runtime(drive_folder: str | None = None) -> dict[str, str]:
    """What the setup cell does once acl_lab is importable: logging integrations off, a line on versions and the
    device, and on Colab, if ``drive_folder`` is given, Google Drive as the working folder (:func:`use_drive`).

    Returns what it printed, as a dict (``versions``, ``device``, ``workdir``), for tests.
    """
    import os

    from .. import __version__
    from ..utils import quiet_integrations

    quiet_integrations()
    v = versions()
    info = {"versions": f"acl_lab {__version__}, torch {v['torch']}, transformers {v['transformers']}, "
                        f"python {v['python']}",
            "device": device_line()}
    if drive_folder:
        info["workdir"] = f"{use_drive(drive_folder)} (Google Drive: relative OUTPUT_DIR paths are kept there)"
    else:
        info["workdir"] = os.getcwd()
        if on_colab():
            info["workdir"] += (" (local: lost when the runtime recycles; set DRIVE_FOLDER = \"acl_lab\" in this "
                                "cell to keep runs on Google Drive)")
    for key, line in info.items():
        print(f"{key}: {line}" if key != "device" else line)
    return info
