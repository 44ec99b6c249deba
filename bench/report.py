"""Shared by the benchmark scripts: print report lines and keep them for the saved .txt copy."""
from __future__ import annotations

import json
from pathlib import Path


class Report:
    """Print lines and keep them for the .txt copy."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, figures: dict, json_path: Path, txt_path: Path) -> None:
        """Write the figures as JSON and the printed lines as text."""
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
        txt_path.write_text("\n".join(self.lines) + "\n")
        print(f"\nwrote {json_path} and {txt_path}")
