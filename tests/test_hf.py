"""acl_lab.hf.ACLTrainer: the ACL objectives inside the Hugging Face Trainer, on tiny random BERT / RoBERTa.

No download: the models are built from configs and fed input_ids directly. Dropout is 0 everywhere.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from transformers import (BertConfig, BertForSequenceClassification, RobertaConfig,  # noqa: E402
                          RobertaForSequenceClassification, Trainer, TrainingArguments)

from acl_lab.errors import AclLabError  # noqa: E402
from acl_lab.hf import OBJECTIVES, ACLTrainer, find_classifier  # noqa: E402

VOCAB, LENGTH, N = 64, 10, 48
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=2,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)


def toy_dataset(n: int = N, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Label 0 sentences use tokens 5..29, label 1 tokens 30..59: separable, so training moves the weights."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        label = i % 2
        lo, hi = (5, 30) if label == 0 else (30, 60)
        ids = torch.randint(lo, hi, (LENGTH,), generator=g)
        ids[0] = 2  # a fixed first token, the [CLS] / <s> position
        rows.append({"input_ids": ids, "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                     "labels": torch.tensor(label)})
    return rows


def tiny_model(kind: str, seed: int = 0, initializer_range: float = 0.02) -> nn.Module:
    torch.manual_seed(seed)
    sizes = {**SIZES, "initializer_range": initializer_range}
    if kind == "bert":
        return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, max_position_embeddings=32, **sizes))
    return RobertaForSequenceClassification(RobertaConfig(vocab_size=VOCAB, max_position_embeddings=LENGTH + 4,
                                                          pad_token_id=1, **sizes))


def args(tmp_path: Path, **over) -> TrainingArguments:
    torch.set_num_threads(1)
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=3, learning_rate=2e-3,
                logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_num_workers=0, lr_scheduler_type="constant")
    base.update(over)
    return TrainingArguments(**base)


def train_logs(trainer: Trainer) -> list[dict]:
    trainer.train()
    return [row for row in trainer.state.log_history if "loss" in row]


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_classifier_rule_finds_the_layer_that_outputs_the_logits(kind):
    name, layer = find_classifier(tiny_model(kind))
    assert name == {"bert": "classifier", "roberta": "classifier.out_proj"}[kind]
    assert layer.out_features == 2 and layer.in_features == 32


def _other_config(name: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, max_position_embeddings=32, num_labels=2)
    return {"distilbert": lambda: T.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, **common),
            "deberta-v2": lambda: T.DebertaV2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, pooler_hidden_size=32, **common),
            "electra": lambda: T.ElectraConfig(embedding_size=32, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=64, **common),
            "albert": lambda: T.AlbertConfig(embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, **common)}[name]()


@pytest.mark.parametrize("name, layer", [("distilbert", "classifier"), ("deberta-v2", "classifier"),
                                         ("electra", "classifier.out_proj"), ("albert", "classifier")])
def test_other_architectures_by_the_same_rule(tmp_path, name, layer):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(_other_config(name))
    trainer = ACLTrainer(model=model, args=args(tmp_path, max_steps=2), train_dataset=toy_dataset(), objective="acl")
    trainer.train()
    assert trainer.classifier_name == layer
    assert len(trainer.gate_history) == 2 and all(0.0 < g["angle"] < 180.0 for g in trainer.gate_history)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objective_trains_and_logs_its_parts(tmp_path, kind, objective):
    model = tiny_model(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ACLTrainer(model=model, args=args(tmp_path), train_dataset=toy_dataset(), objective=objective,
                         lam=0.5, temperature=0.2)
    logs = train_logs(trainer)
    assert [row["step"] for row in logs] == [1, 2, 3]
    for row in logs:
        assert math.isfinite(row["ce"]) and row["ce"] > 0
        if objective == "ce":
            assert "aux" not in row and "cos" not in row
            assert abs(row["loss"] - row["ce"]) < 1e-4
        else:
            assert math.isfinite(row["aux"]) and row["aux"] > 0
            assert abs(row["loss"] - (row["ce"] + row["aux"])) < 1e-4, row  # loss = ce + aux, as the Trainer sees it
        if objective == "acl":
            assert -1.0 <= row["cos"] <= 1.0 and 0.0 <= row["angle"] <= 180.0
            assert abs(math.degrees(math.acos(row["cos"])) - row["angle"]) < 1e-6  # one micro-batch per log
            assert row["kept"] in (0.0, 1.0)
        else:
            assert "cos" not in row and "angle" not in row and "kept" not in row
    assert (trainer.drop_rate() is not None) == (objective == "acl")
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter moved"
    head = trainer.classifier_name if objective != "ce" else "classifier"
    assert any(k.startswith(head) and not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_threshold_zero_drops_every_batch_and_equals_plain_trainer_ce(tmp_path, kind):
    steps = 4
    plain_model = tiny_model(kind)
    Trainer(model=plain_model, args=args(tmp_path / "plain", max_steps=steps), train_dataset=toy_dataset()).train()
    acl_model = tiny_model(kind)
    trainer = ACLTrainer(model=acl_model, args=args(tmp_path / "acl", max_steps=steps), train_dataset=toy_dataset(),
                         objective="acl", lam=0.5, threshold=0.0)
    trainer.train()
    assert len(trainer.gate_history) == steps and trainer.drop_rate() == 1.0
    assert all(0.0 < r["angle"] < 180.0 for r in trainer.gate_history)
    plain, acl = plain_model.state_dict(), acl_model.state_dict()
    moved = [k for k in plain if not torch.equal(plain[k], tiny_model(kind).state_dict()[k])]
    assert moved, "the CE run did not train"
    for k in plain:
        assert torch.equal(plain[k], acl[k]), f"{k} differs from the plain Trainer's CE run"


def test_ce_objective_equals_plain_trainer(tmp_path):
    plain_model, ce_model = tiny_model("bert"), tiny_model("bert")
    Trainer(model=plain_model, args=args(tmp_path / "plain"), train_dataset=toy_dataset()).train()
    ACLTrainer(model=ce_model, args=args(tmp_path / "ce"), train_dataset=toy_dataset(), objective="ce").train()
    for k, v in plain_model.state_dict().items():
        assert torch.equal(v, ce_model.state_dict()[k]), k


def test_bf16_autocast_on_cpu_trains_the_gated_objective(tmp_path):
    """Under the Trainer's bf16 autocast the contrastive terms are computed in float32 (acl_lab.losses)."""
    trainer = ACLTrainer(model=tiny_model("bert"), args=args(tmp_path, bf16=True), train_dataset=toy_dataset(),
                         objective="acl")
    logs = train_logs(trainer)
    assert len(trainer.gate_history) == 3
    assert all(math.isfinite(row[k]) for row in logs for k in ("loss", "ce", "aux", "cos", "angle"))


def test_gate_under_gradient_accumulation_matches_the_ungated_objective(tmp_path):
    """threshold 180 keeps every term: the gated path (ACLGrad + the accelerator's scaling) must then apply
    the same update as acl-embed through accelerator.backward, with 2 micro-batches per step. Plain SGD, so
    that rounding-level differences of the two summation orders are not amplified by Adam's normalisation."""
    results = {}
    for objective, extra in (("acl-embed", {}), ("acl", {"threshold": 180.0})):
        model = tiny_model("bert")
        trainer = ACLTrainer(model=model, args=args(tmp_path / objective, per_device_train_batch_size=4,
                                                    gradient_accumulation_steps=2, max_steps=3, optim="sgd"),
                             train_dataset=toy_dataset(), objective=objective, lam=0.5, **extra)
        results[objective] = (train_logs(trainer), model.state_dict(), trainer)
    assert results["acl"][2].drop_rate() == 0.0 and len(results["acl"][2].gate_history) == 6
    for (a, b) in zip(results["acl-embed"][0], results["acl"][0]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["aux"] - b["aux"]) < 1e-5
    for k, v in results["acl-embed"][1].items():
        assert torch.allclose(v, results["acl"][1][k], atol=1e-6, rtol=1e-5), k


def test_gradient_accumulation_averages_micro_batches(tmp_path):
    """CE over 2 micro-batches of 4 must give the step of one batch of 8 (means of equal-sized halves)."""
    states = []
    for batch, accum in ((8, 1), (4, 2)):
        model = tiny_model("bert")
        ACLTrainer(model=model, args=args(tmp_path / str(batch), per_device_train_batch_size=batch,
                                          gradient_accumulation_steps=accum, max_steps=3, optim="sgd"),
                   train_dataset=toy_dataset(), objective="ce").train()
        states.append(model.state_dict())
    for k, v in states[0].items():
        assert torch.allclose(v, states[1][k], atol=1e-6, rtol=1e-5), k


@pytest.mark.parametrize("scope", ["head", "repr"])
def test_cheap_scopes_run_and_record_their_decisions(tmp_path, scope):
    trainer = ACLTrainer(model=tiny_model("roberta"), args=args(tmp_path), train_dataset=toy_dataset(),
                         objective="acl", scope=scope)
    logs = train_logs(trainer)
    assert len(trainer.gate_history) == 3 and all(0.0 <= r["angle"] <= 180.0 for r in trainer.gate_history)
    assert all("kept" in row for row in logs)


class _RowDotHead(nn.Module):
    """A classifier head without an nn.Linear: logits = h @ W.T."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, d))

    def forward(self, h):
        return h @ self.weight.T


def test_a_head_it_cannot_find_gives_a_clear_error(tmp_path):
    model = tiny_model("bert")
    model.classifier = _RowDotHead(32, 2)
    with pytest.raises(AclLabError, match="cannot find the classifier layer.*classifier="):
        ACLTrainer(model=model, args=args(tmp_path), train_dataset=toy_dataset(), objective="acl")
    with pytest.raises(AclLabError, match="classifier='nope' is no such module"):
        ACLTrainer(model=tiny_model("bert"), args=args(tmp_path), train_dataset=toy_dataset(), classifier="nope")
    # objective "ce" needs no head: it is the plain Trainer
    ACLTrainer(model=model, args=args(tmp_path, max_steps=1), train_dataset=toy_dataset(), objective="ce").train()


def test_a_linear_whose_output_is_not_the_logits_is_refused(tmp_path):
    """RoBERTa's classifier.dense is an nn.Linear but its output is not the logits: named by hand, it is refused
    on the first batch, before any weight changed."""
    model = tiny_model("roberta")
    model.config.num_labels = 2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ACLTrainer(model=model, args=args(tmp_path), train_dataset=toy_dataset(), objective="acl",
                         classifier="classifier.dense")
    with pytest.raises(AclLabError, match="is not the model's logits"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_arguments_are_clear_errors(tmp_path):
    common = dict(model=tiny_model("bert"), args=args(tmp_path), train_dataset=toy_dataset())
    for kwargs, match in (({"objective": "me-acl"}, "objective"), ({"lam": -1.0}, "lam"),
                          ({"temperature": 0.0}, "temperature"), ({"anchors": "x"}, "anchors"),
                          ({"threshold": 200.0}, "threshold"), ({"scope": "top"}, "scope"),
                          ({"objective": "ce", "acl_grad": True}, "acl_grad"),
                          ({"objective": "ce+scl", "scope": "head"}, "SCL does not use the classifier layer")):
        with pytest.raises(AclLabError, match=match):
            ACLTrainer(**common, **kwargs)


def test_regression_labels_are_refused_for_a_contrastive_objective(tmp_path):
    model = tiny_model("bert")
    data = [{**row, "labels": row["labels"].float()} for row in toy_dataset()]
    model.config.problem_type = "multi_label_classification"
    data = [{**row, "labels": torch.nn.functional.one_hot(row["labels"].long(), 2).float()} for row in data]
    trainer = ACLTrainer(model=model, args=args(tmp_path), train_dataset=data, objective="acl-embed")
    with pytest.raises(AclLabError, match="integer class label"):
        trainer.train()


def test_two_gloo_processes_under_torchrun_match_one_process(tmp_path):
    """torchrun, 2 CPU processes x 4 samples against 1 process x 8 (same order, SGD, dropout 0): the global-batch
    contrastive terms (gather_with_grad) and the gate deciding on averaged gradients make every logged part,
    every gate decision and the final weights agree. Runs hf_ddp_worker.py's five runs (~20 s on 2 cores)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import hf_ddp_worker as worker

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(worker.__file__)), str(tmp_path / "ddp"), "8"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    decisions = []
    for name in worker.RUNS:
        ddp = torch.load(tmp_path / "ddp" / f"{name}.pt", weights_only=False)
        one = worker.run(name, tmp_path / "one", 8)
        assert ddp["world_size"] == 2 and one["world_size"] == 1
        assert len(ddp["logs"]) == len(one["logs"]) == worker.STEPS
        for a, b in zip(ddp["logs"], one["logs"]):
            for key in ("loss", "ce", "aux", "cos", "angle", "kept"):
                if key in b:  # angles in degrees: 1e-4 deg is 2e-6 rad (float32 gradients summed in another order)
                    tol = 1e-4 if key == "angle" else 1e-5
                    assert abs(a[key] - b[key]) < tol, (name, key, a[key], b[key])
        assert [g["kept"] for g in ddp["gate"]] == [g["kept"] for g in one["gate"]], name
        assert (len(one["gate"]) == worker.STEPS) == (name != "acl-embed")
        decisions += [g["kept"] for g in one["gate"]]
        for key, value in one["params"].items():
            assert torch.allclose(ddp["params"][key], value, atol=1e-5, rtol=0), (name, key)
    assert True in decisions and False in decisions, "the runs should exercise both gate decisions"
