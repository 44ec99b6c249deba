"""The layering the README promises: the analysis and viz layers read results and never import the trainer."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import acl_lab

PACKAGE = Path(acl_lab.__file__).resolve().parent
READERS = sorted(p for layer in ("analysis", "viz") for p in (PACKAGE / layer).glob("*.py"))
FORBIDDEN = ("acl_lab.trainer", "acl_lab.lab")  # training, and what composes training


def _module(path: Path) -> str:
    return ".".join(("acl_lab", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved), at any depth of the file."""
    package = _module(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module(path)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def test_readers_are_found():
    assert len(READERS) >= 10, READERS


@pytest.mark.parametrize("path", READERS, ids=lambda p: _module(p))
def test_no_reader_imports_training(path):
    bad = sorted(n for n in _imports(path) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN))
    assert not bad, f"{_module(path)} imports {bad}: the analysis and viz layers must only read saved results"


def test_importing_every_reader_loads_no_training_module():
    """Transitively too: importing all of analysis/ and viz/ in a fresh interpreter never loads the trainer."""
    code = ("import sys, importlib\n"
            f"for m in {[_module(p) for p in READERS]!r}: importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m == 'acl_lab.trainer' or m.startswith('acl_lab.lab'))\n"
            "print(loaded); sys.exit(1 if loaded else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"training modules loaded by the readers: {done.stdout} {done.stderr[-2000:]}"


def test_the_import_checker_sees_a_forbidden_import(tmp_path):
    """The checker itself can fail: a relative import of the trainer two levels up is resolved and caught."""
    fake = PACKAGE / "analysis" / "_probe_for_test.py"
    try:
        fake.write_text("from ..trainer import train\n")
        assert "acl_lab.trainer" in _imports(fake)
    finally:
        fake.unlink()
