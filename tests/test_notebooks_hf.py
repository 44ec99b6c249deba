"""Notebook 08 (ACLTrainer, the Hugging Face Trainer drop-in) in the smoke preset, checked through its metrics."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import notebook_result


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.notebooks
def test_08_hf_trainer(executed_suite):
    rec = notebook_result(executed_suite, "08_hf_trainer")
    m = rec["metrics"]
    assert m["preset"] == "smoke" and m["model"] == "tiny" and m["steps"] > 0 and len(m["seeds"]) >= 1
    assert m["objectives"] == ["ce", "acl"] and m["lambda"] == 0.1 and m["threshold"] == 90.0
    assert m["classifier_layer"] == "classifier"  # the rule found BERT's head
    # the parts reached the Trainer's log_history through its own log()
    assert {"loss", "ce", "aux", "cos", "angle", "kept"} <= set(m["logged_parts"])
    for objective in m["objectives"]:
        for split in ("dev", "test"):
            value = m[f"{objective}.{split}_accuracy"]
            assert _finite(value) and 0.0 <= value <= 1.0, (objective, split, value)
        assert _finite(m[f"{objective}.final_ce"]) and m[f"{objective}.final_ce"] > 0
    assert m["ce.drop_rate"] is None and m["ce.mean_angle"] is None  # no gate on plain CE
    assert 0.0 <= m["acl.drop_rate"] <= 1.0 and 0.0 <= m["acl.mean_angle"] <= 180.0
    folder = Path(rec["output_dir"]) / "smoke" / "figures"
    for name in ("08_hf_logged_parts", "08_hf_comparison"):
        path = folder / f"{name}.png"
        assert path.is_file() and path.stat().st_size > 1000, f"missing or empty figure {path}"
