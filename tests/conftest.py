"""Shared fixtures: a tiny, fast run config and an easily separable toy task in GLUE's SST-2 layout."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from acl_lab.config import TrainConfig

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
