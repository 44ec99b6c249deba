"""scripts/gpu_check.sh runs here on the CPU with tiny settings (``--device cpu --tiny``), so it cannot rot before a
GPU is at hand: every part must pass and write its numbers into the one report file. About 2-3 minutes on 2 busy
cores (notebook 00 in the smoke suite, then 3 objectives x 2 precisions); marked ``notebooks``."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.notebooks
def test_gpu_check_script_on_cpu(tmp_path):
    report = tmp_path / "report.md"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--tiny", "--report",
                           str(report)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    text = report.read_text() if report.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n{text[-3000:]}"
    assert list(tmp_path.iterdir()) == [report], "the check writes one report file"
    assert re.search(r"## 1\. Smoke suite on cpu: exit 0 in \d+ s; 1 of 1 executed notebooks printed", text)
    numbers = json.loads(text.split("```json", 1)[1].split("```", 1)[0])
    assert numbers["device"] == "cpu" and numbers["failures"] == 0
    rows = numbers["step times"]
    assert [r["objective"] for r in rows] == ["ce", "acl", "me-acl-cl"]
    for row in rows:
        for key in ("fp32 step s", "bf16 step s"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0.0, row
    costs = numbers["2. ACL-Grad exact vs batched VJP (seconds, median; ratio to a CE step)"]
    assert costs["ce step s"] > 0 and costs["exact gate (all) / ce"] > 0
    assert "batched VJP / ce" in costs or "batched VJP error" in costs
    angles = numbers["3. Exact gate angle, bf16 vs fp32, same batches and weights (dropout off)"]
    assert angles["batches"] == 2 and 0.0 <= angles["max |bf16 - fp32| deg"] < 5.0
    screened = numbers["4. Screened angle scope (fp32)"]
    assert "skipped" in screened or screened["step s (fp32)"] >= 0.0
    assert "every part passed" in text.splitlines()[-1]


def test_gpu_check_rejects_unknown_options():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--bogus"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
