"""Task registry and metrics.

Each task (the eight GLUE tasks the ACL paper fine-tunes on, plus two offline
Rotten Tomatoes tasks) is described once, by a frozen :class:`TaskSpec`: its
text columns, label names, metrics, which metric picks the best checkpoint, and
how its data is laid out on the hub and in GLUE's original TSV files. The data
loaders (:mod:`acl_lab.data`) and the trainer read everything from here, so a
task never needs special-casing elsewhere.

Metrics use scikit-learn and scipy only, and return plain Python floats so they
can go straight into JSON logs.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.stats import ConstantInputWarning, pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from .errors import AclLabError, bad_value

DEFAULT_TASK = "rt-polarity"


@dataclass(frozen=True)
class TaskSpec:
    """Everything the kit needs to know about one task.

    ``text_fields`` are the column names used by the Hugging Face ``glue``
    dataset (or by the RT corpus); the loaders rename them to ``text_a`` and,
    for sentence-pair tasks, ``text_b``. The ``tsv_*`` fields describe GLUE's
    original ``train.tsv``/``dev.tsv`` files under ``<data_dir>/<glue_dir>/``:
    whether they have a header line, the column names to assign when they do
    not, which columns hold the texts and the label, and the raw label strings
    in label-id order (so ``tsv_label_values[i]`` is the file's spelling of
    ``label_names[i]``).
    """

    name: str
    source: str  # "glue" or "rt"
    text_fields: tuple[str, ...]
    label_names: tuple[str, ...]
    metric_names: tuple[str, ...]
    main_metric: str
    is_regression: bool = False
    label_range: tuple[float, float] | None = None  # regression targets only
    glue_dir: str | None = None
    hub_name: str | None = None
    hub_splits: tuple[tuple[str, str], ...] = (("train", "train"), ("dev", "validation"))
    tsv_files: tuple[tuple[str, str], ...] = (("train", "train.tsv"), ("dev", "dev.tsv"))
    tsv_header: bool = True
    tsv_names: tuple[str, ...] = ()  # column names to assign when tsv_header is False
    tsv_text_columns: tuple[str, ...] = ()
    tsv_label_column: str = ""
    tsv_label_values: tuple[str, ...] = ()

    @property
    def num_labels(self) -> int:
        """Output size of the classifier head: 1 for regression, else the number of classes."""
        return 1 if self.is_regression else len(self.label_names)

    @property
    def is_pair(self) -> bool:
        """True for sentence-pair tasks (two text fields)."""
        return len(self.text_fields) == 2

    @property
    def eval_splits(self) -> tuple[str, ...]:
        """Names of the evaluation splits: ``dev`` (plus ``dev_mismatched`` for MNLI, ``test`` for RT)."""
        if self.source == "rt":
            return ("dev", "test")
        return tuple(split for split, _ in self.tsv_files if split != "train")


_BINARY_01 = ("0", "1")

TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec(
            name="cola", source="glue", text_fields=("sentence",),
            label_names=("unacceptable", "acceptable"),
            metric_names=("accuracy", "mcc"), main_metric="mcc",
            glue_dir="CoLA", hub_name="cola",
            tsv_header=False, tsv_names=("source", "label", "original_label", "sentence"),
            tsv_text_columns=("sentence",), tsv_label_column="label", tsv_label_values=_BINARY_01,
        ),
        TaskSpec(
            name="sst2", source="glue", text_fields=("sentence",),
            label_names=("negative", "positive"),
            metric_names=("accuracy",), main_metric="accuracy",
            glue_dir="SST-2", hub_name="sst2",
            tsv_text_columns=("sentence",), tsv_label_column="label", tsv_label_values=_BINARY_01,
        ),
        TaskSpec(
            name="mrpc", source="glue", text_fields=("sentence1", "sentence2"),
            label_names=("not_equivalent", "equivalent"),
            metric_names=("accuracy", "f1"), main_metric="f1",
            glue_dir="MRPC", hub_name="mrpc",
            tsv_text_columns=("#1 String", "#2 String"), tsv_label_column="Quality",
            tsv_label_values=_BINARY_01,
        ),
        TaskSpec(
            name="qqp", source="glue", text_fields=("question1", "question2"),
            label_names=("not_duplicate", "duplicate"),
            metric_names=("accuracy", "f1"), main_metric="f1",
            glue_dir="QQP", hub_name="qqp",
            tsv_text_columns=("question1", "question2"), tsv_label_column="is_duplicate",
            tsv_label_values=_BINARY_01,
        ),
        TaskSpec(
            name="stsb", source="glue", text_fields=("sentence1", "sentence2"),
            label_names=(), is_regression=True, label_range=(0.0, 5.0),
            metric_names=("pearson", "spearman", "pearson_spearman"), main_metric="pearson",
            glue_dir="STS-B", hub_name="stsb",
            tsv_text_columns=("sentence1", "sentence2"), tsv_label_column="score",
        ),
        TaskSpec(
            name="mnli", source="glue", text_fields=("premise", "hypothesis"),
            label_names=("entailment", "neutral", "contradiction"),
            metric_names=("accuracy",), main_metric="accuracy",
            glue_dir="MNLI", hub_name="mnli",
            hub_splits=(("train", "train"), ("dev", "validation_matched"),
                        ("dev_mismatched", "validation_mismatched")),
            tsv_files=(("train", "train.tsv"), ("dev", "dev_matched.tsv"),
                       ("dev_mismatched", "dev_mismatched.tsv")),
            tsv_text_columns=("sentence1", "sentence2"), tsv_label_column="gold_label",
            tsv_label_values=("entailment", "neutral", "contradiction"),
        ),
        TaskSpec(
            name="qnli", source="glue", text_fields=("question", "sentence"),
            label_names=("entailment", "not_entailment"),
            metric_names=("accuracy",), main_metric="accuracy",
            glue_dir="QNLI", hub_name="qnli",
            tsv_text_columns=("question", "sentence"), tsv_label_column="label",
            tsv_label_values=("entailment", "not_entailment"),
        ),
        TaskSpec(
            name="rte", source="glue", text_fields=("sentence1", "sentence2"),
            label_names=("entailment", "not_entailment"),
            metric_names=("accuracy",), main_metric="accuracy",
            glue_dir="RTE", hub_name="rte",
            tsv_text_columns=("sentence1", "sentence2"), tsv_label_column="label",
            tsv_label_values=("entailment", "not_entailment"),
        ),
        TaskSpec(
            name="rt-polarity", source="rt", text_fields=("text",),
            label_names=("rotten", "fresh"),
            metric_names=("accuracy",), main_metric="accuracy",
        ),
        TaskSpec(
            name="rt-3way", source="rt", text_fields=("text",),
            label_names=("rotten", "fresh", "plot"),
            metric_names=("accuracy",), main_metric="accuracy",
        ),
    )
}


def get_task(name: str) -> TaskSpec:
    """Look up a task by name; an unknown name raises :class:`AclLabError` listing the known ones."""
    if name not in TASKS:
        raise bad_value(
            "Task", name, TASKS,
            f"pick one of these; `{DEFAULT_TASK}` is the offline default (no download needed), "
            "the GLUE tasks need the Hugging Face hub or a local GLUE folder (--data-dir).",
        )
    return TASKS[name]


def _as_1d(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    """Turn predictions or labels (list, numpy array or torch tensor) into a 1-D numpy array."""
    if hasattr(values, "detach"):  # torch tensor
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise AclLabError(
            f"{what} must be one value per example (1-D); got shape {arr.shape}. "
            "Fix: pass class ids (e.g. logits.argmax(-1)), or the predicted scores for stsb."
        )
    return arr


def _correlation(fn, predictions: np.ndarray, labels: np.ndarray) -> float:
    """Pearson/Spearman as a float; 0.0 (no correlation) when either side is constant instead of NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)
        value = float(fn(predictions, labels)[0])
    return 0.0 if math.isnan(value) else value


def compute_metrics(task: str | TaskSpec,
                    predictions: Sequence[float] | np.ndarray,
                    labels: Sequence[float] | np.ndarray) -> dict[str, float]:
    """The task's metrics (``task.metric_names``) as plain floats.

    ``predictions`` are class ids for classification tasks and predicted scores
    for stsb. Accuracy is always reported for classification; F1 (of the
    positive class, id 1) for mrpc/qqp; Matthews correlation (``mcc``) for cola;
    ``pearson``, ``spearman`` and their mean ``pearson_spearman`` for stsb. A
    constant prediction vector gives correlation 0.0 rather than NaN, matching
    scikit-learn's convention for MCC, so checkpoint selection never sees NaN.
    """
    spec = get_task(task) if isinstance(task, str) else task
    preds = _as_1d(predictions, "predictions")
    gold = _as_1d(labels, "labels")
    if len(preds) != len(gold):
        raise AclLabError(
            f"predictions and labels differ in length ({len(preds)} vs {len(gold)}). "
            "Fix: pass one prediction per labelled example."
        )
    if len(preds) == 0:
        raise AclLabError("No examples to score (empty predictions). Fix: evaluate on a non-empty split.")
    if spec.is_regression:
        preds, gold = preds.astype(float), gold.astype(float)
        pearson = _correlation(pearsonr, preds, gold)
        spearman = _correlation(spearmanr, preds, gold)
        return {"pearson": pearson, "spearman": spearman, "pearson_spearman": (pearson + spearman) / 2}
    out = {"accuracy": float(accuracy_score(gold, preds))}
    if "f1" in spec.metric_names:
        out["f1"] = float(f1_score(gold, preds, pos_label=1, average="binary", zero_division=0))
    if "mcc" in spec.metric_names:
        out["mcc"] = float(matthews_corrcoef(gold, preds))
    return out
