"""Task registry and metrics, checked against hand-computed values."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from acl_lab.errors import AclLabError
from acl_lab.tasks import DEFAULT_TASK, TASKS, TaskSpec, compute_metrics, get_task


def test_registry_has_all_tasks_and_default():
    assert set(TASKS) == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "rt-polarity", "rt-3way"}
    assert DEFAULT_TASK == "rt-polarity"
    assert get_task(DEFAULT_TASK).source == "rt"


@pytest.mark.parametrize("name,main,num_labels,pair", [
    ("cola", "mcc", 2, False), ("sst2", "accuracy", 2, False), ("mrpc", "f1", 2, True),
    ("qqp", "f1", 2, True), ("stsb", "pearson", 1, True), ("mnli", "accuracy", 3, True),
    ("qnli", "accuracy", 2, True), ("rte", "accuracy", 2, True),
    ("rt-polarity", "accuracy", 2, False), ("rt-3way", "accuracy", 3, False),
])
def test_task_specs(name, main, num_labels, pair):
    spec = get_task(name)
    assert spec.main_metric == main and main in spec.metric_names
    assert spec.num_labels == num_labels
    assert spec.is_pair is pair
    if spec.source == "glue":
        assert len(spec.tsv_text_columns) == len(spec.text_fields)
        assert spec.is_regression or len(spec.tsv_label_values) == len(spec.label_names)


def test_spec_details():
    stsb = get_task("stsb")
    assert stsb.is_regression and stsb.label_names == ()
    assert get_task("mnli").label_names == ("entailment", "neutral", "contradiction")
    assert get_task("mnli").eval_splits == ("dev", "dev_mismatched")
    assert get_task("rt-3way").label_names == ("rotten", "fresh", "plot")
    assert get_task("rt-polarity").eval_splits == ("dev", "test")
    assert get_task("qnli").text_fields == ("question", "sentence")
    assert get_task("cola").glue_dir == "CoLA" and get_task("sst2").glue_dir == "SST-2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_task("sst2").name = "x"  # type: ignore[misc]


def test_unknown_task_lists_names_and_offline_default():
    with pytest.raises(AclLabError) as err:
        get_task("sst-2")
    msg = str(err.value)
    assert "'sst-2'" in msg and "'sst2'" in msg and "'rt-3way'" in msg and "rt-polarity" in msg
    assert "offline default" in msg


def test_accuracy_three_of_four():
    m = compute_metrics("sst2", [1, 0, 1, 1], [1, 0, 0, 1])
    assert m == {"accuracy": 0.75}
    assert type(m["accuracy"]) is float


def test_f1_known_confusion():
    # gold 1 1 1 0 0 0 ; pred 1 1 0 1 0 0 -> TP=2 FP=1 FN=1 -> P=R=2/3, F1=2/3
    m = compute_metrics("mrpc", [1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0])
    assert m["f1"] == pytest.approx(2 / 3)
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert set(m) == {"accuracy", "f1"}


def test_mcc_known_case():
    # TP=2 TN=1 FP=1 FN=0 -> (2*1 - 1*0)/sqrt(3*2*2*1) = 2/sqrt(12)
    m = compute_metrics("cola", [1, 1, 1, 0], [1, 1, 0, 0])
    assert m["mcc"] == pytest.approx(2 / math.sqrt(12))
    assert compute_metrics("cola", [1, 1, 1, 1], [1, 0, 1, 0])["mcc"] == 0.0


def test_stsb_correlations():
    gold = [0.0, 1.0, 2.0, 3.0, 4.0]
    linear = compute_metrics("stsb", [2 * g + 1 for g in gold], gold)
    assert linear["pearson"] == pytest.approx(1.0) and linear["spearman"] == pytest.approx(1.0)
    monotone = compute_metrics("stsb", [g ** 3 for g in gold], gold)
    assert monotone["spearman"] == pytest.approx(1.0)
    assert monotone["pearson"] < 0.99
    assert monotone["pearson_spearman"] == pytest.approx((monotone["pearson"] + 1.0) / 2)
    assert all(type(v) is float for v in monotone.values())


def test_constant_prediction_correlation_is_zero_not_nan():
    m = compute_metrics("stsb", [2.5] * 4, [0.0, 1.0, 2.0, 3.0])
    assert m == {"pearson": 0.0, "spearman": 0.0, "pearson_spearman": 0.0}


def test_accepts_arrays_tensors_and_specs():
    m = compute_metrics(get_task("mnli"), torch.tensor([0, 1, 2, 2]), np.array([0, 1, 2, 1]))
    assert m == {"accuracy": 0.75}
    assert isinstance(get_task("rte"), TaskSpec)


def test_metric_input_errors():
    with pytest.raises(AclLabError, match="differ in length"):
        compute_metrics("sst2", [1, 0], [1])
    with pytest.raises(AclLabError, match="empty"):
        compute_metrics("sst2", [], [])
    with pytest.raises(AclLabError, match="argmax"):
        compute_metrics("sst2", [[0.1, 0.9], [0.8, 0.2]], [1, 0])
