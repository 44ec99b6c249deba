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

from ..errors import AclLabError

PACKAGES = ("acl_lab", "torch", "transformers", "datasets", "numpy", "scikit-learn", "matplotlib", "umap-learn",
            "ipywidgets", "papermill")


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
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def record_metrics(output_dir: str | Path, notebook: str, metrics: dict[str, Any]) -> Path:
    """Write a notebook's headline numbers to ``OUTPUT_DIR/metrics/<notebook>.json`` (read by tests and batches)."""
    folder = Path(output_dir) / "metrics"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{notebook}.json"
    path.write_text(json.dumps(metrics, indent=2, default=float) + "\n")
    return path


def read_metrics(output_dir: str | Path, notebook: str) -> dict[str, Any]:
    """Read what :func:`record_metrics` wrote."""
    path = require(Path(output_dir) / "metrics" / f"{notebook}.json", notebook)
    return json.loads(path.read_text())
