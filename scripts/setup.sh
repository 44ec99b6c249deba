#!/usr/bin/env bash
# Set up acl_lab on a fresh machine: a virtualenv in .venv, the CPU torch wheel
# FIRST (an unpinned torch would pull a multi-GB CUDA build), then the project,
# a named Jupyter kernel for the notebooks, and the offline assets (checked by SHA-256).
# Safe to run again: each step is skipped or quick when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" -e ".[dev,lab]"
.venv/bin/python -m ipykernel install --sys-prefix --name acl-lab --display-name "acl_lab (Python 3)" >/dev/null
.venv/bin/python -m acl_lab fetch
