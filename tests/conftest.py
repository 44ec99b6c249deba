"""Shared fixtures: a tiny, fast run config and an easily separable toy task in GLUE's SST-2 layout."""
from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from acl_lab.config import TrainConfig

# A suite started in the background of a non-interactive shell (`nohup ... &`) inherits SIGINT as
# ignored, and so would every subprocess it starts: the Ctrl-C and shutdown tests would then test
# nothing. Give the suite Python's usual handler, so its subprocesses start with the default again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

POS = "good great fine superb lovely brilliant wonderful".split()
NEG = "bad awful poor dreadful boring terrible dull".split()


def write_toy_sst2(root: Path, n_train: int = 96, n_dev: int = 32, seed: int = 0) -> Path:
    """Write SST-2/train.tsv and dev.tsv where the label is given away by the words used."""
    rng = random.Random(seed)
    folder = root / "SST-2"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        lines = ["sentence\tlabel"]
        for i in range(n):
            label = i % 2
            words = rng.choices(POS if label else NEG, k=5)
            lines.append(f"{' '.join(words)} movie\t{label}")
        (folder / name).write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def toy_dir(tmp_path: Path) -> Path:
    return write_toy_sst2(tmp_path / "glue")


@pytest.fixture
def tiny_config(tmp_path: Path, toy_dir: Path) -> TrainConfig:
    """A tiny random BERT on the toy task: a step takes well under a second on CPU."""
    return TrainConfig(task="sst2", source="local", data_dir=str(toy_dir), model="tiny", objective="ce",
                       output_dir=str(tmp_path / "run"), batch_size=16, max_length=16, max_steps=6,
                       eval_every=3, lr=2e-3, warmup_ratio=0.0, dropout=0.0, num_threads=1)


# ---------------------------------------------------------------------------
# notebooks: the whole suite executed once per session, in order, smoke preset
# ---------------------------------------------------------------------------
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK_TIMEOUT = 300  # seconds per cell


def kernel_name() -> str:
    """The explicit kernel the notebooks run on: 'acl-lab' (registered by scripts/setup.sh), else python3."""
    from jupyter_client.kernelspec import KernelSpecManager

    return "acl-lab" if "acl-lab" in KernelSpecManager().find_kernel_specs() else "python3"


@pytest.fixture(scope="session")
def executed_suite(tmp_path_factory):
    """Run every notebook in notebooks/ (numbered order) with PRESET='smoke' through the kit's own suite runner.

    Returns {stem: {"output": path of the executed copy, "error": the failed run's error line or None,
    "metrics": OUTPUT_DIR/smoke/metrics/<stem>.json or None, "output_dir": shared OUTPUT_DIR}}.
    A failing notebook does not stop the later ones; its test reports the error.
    """
    import json as _json

    from acl_lab.lab.batch import run_suite

    root = tmp_path_factory.mktemp("suite")
    # two notebooks at once, as `suite --jobs 2` runs them: the notebook tests also check that the order of
    # batch.SUITE_AFTER is enough for every notebook to find what it reads
    table = run_suite("smoke", output_dir=root, kernel_name=kernel_name(), resume=False, progress=False,
                      timeout=NOTEBOOK_TIMEOUT, jobs=2)
    out_dir = root / "artifacts"
    results = {}
    for row in table.itertuples():
        metrics_file = out_dir / "smoke" / "metrics" / f"{row.name}.json"
        results[row.name] = {"output": root / f"{row.name}.ipynb", "output_dir": out_dir,
                             "error": row.error if row.status == "failed" else None,
                             "metrics": _json.loads(metrics_file.read_text()) if metrics_file.exists() else None}
    return results


def notebook_result(suite: dict, stem: str) -> dict:
    """The executed notebook's record; fails the test with the notebook's error if it did not run through."""
    assert stem in suite, f"notebook {stem}.ipynb not found in notebooks/"
    rec = suite[stem]
    if rec["error"] is not None:
        pytest.fail(f"{stem}.ipynb failed in the smoke preset: {rec['error']} (the executed copy {rec['output']} "
                    "shows the cell)")
    assert rec["metrics"] is not None, f"{stem}.ipynb wrote no OUTPUT_DIR/metrics/{stem}.json"
    return rec


# ---------------------------------------------------------------------------
# a small results pack: the evidence pipeline at the smoke preset (tiny model), once per session
# ---------------------------------------------------------------------------
SMOKE_PACK_COMMAND = ("python -m acl_lab evidence --preset smoke --tasks rt-polarity --seeds 0,1 --lambdas 0.1,1.0 "
                      "--thresholds 60,90 (test fixture)")


@pytest.fixture(scope="session")
def smoke_pack(tmp_path_factory):
    """(plan, root): every evidence part on rt-polarity with 2 seeds, runs in root/home, the pack in root/pack
    (report built). Shared by the evidence tests and the saved-mode notebook tests."""
    import torch

    from acl_lab.lab.evidence import EvidencePlan, build_report, run_evidence

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pack")
    plan = EvidencePlan(tasks=["rt-polarity"], seeds=[0, 1], preset="smoke", lambdas=[0.1, 1.0],
                        thresholds=[60.0, 90.0], latency_samples=16)
    run_evidence(plan, root / "home", root / "pack", progress=False, command=SMOKE_PACK_COMMAND)
    build_report(root / "pack")
    return plan, root
