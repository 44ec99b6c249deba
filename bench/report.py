"""Shared by the benchmark scripts: print report lines and keep them for the saved .txt copy."""
from __future__ import annotations


class Report:
    """Print lines and keep them for the .txt copy."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
