"""Early-exit calibration on dev (issue 14): simulated exits equal real ones, the chosen threshold is the fastest
within the quality budget, the never-fires warning, clear errors, and the CLI's --calibrate path."""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch

from acl_lab.early_exit import (DROP_TOLERANCE, calibrate, early_exit_predict, exit_logits, full_predict,
                                simulate_exits, sweep)
from acl_lab.errors import AclLabError
from acl_lab.model import build_model
from acl_lab.tasks import compute_metrics, get_task

WORDS = "a fine movie the worst plot ever great acting dull long script laughed not good bad waste superb".split()
TASK = get_task("rt-3way")  # 3 labels, accuracy


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 9)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    """A tiny random 4-layer multi-exit BERT and a loader (a list of labelled batches, the shape make_loader gives).

    The random [CLS] states of a tiny BERT barely differ between inputs, so each head is set to random
    directions applied to the centred states, scaled to logits of sd 0.8 at layer 1 up to 2.6 at layer 4:
    predictions and confidences then vary between samples and exits. The labels are the full model's
    predictions with every 5th flipped, so early exits lose quality by different amounts.
    """
    model, tok = build_model("tiny", num_labels=3, multi_exit=True, seed=1)
    model.eval()
    texts = _texts(60)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        reps = model(**tok(texts, padding=True, return_tensors="pt")).reps
        for i, (head, rep) in enumerate(zip(model.heads, reps)):
            w = torch.randn(head.weight.shape, generator=g)
            mu = rep.mean(0)
            scale = (0.8 + 0.6 * i) / ((rep - mu) @ w.T).std()
            head.weight.copy_(scale * w)
            head.bias.copy_(-scale * (w @ mu))
    batches = []
    for start in range(0, len(texts), 16):
        b = dict(tok(texts[start:start + 16], padding=True, return_tensors="pt"))
        full = full_predict(model, **b)
        flip = torch.arange(start, start + len(full)) % 5 == 0
        b["labels"] = torch.where(flip, (full + 1) % 3, full)
        batches.append(b)
    return model, tok, batches


def _predict_all(model, batches, criterion, threshold):
    outs = [early_exit_predict(model, **{k: v for k, v in b.items() if k != "labels"}, criterion=criterion,
                               threshold=threshold) for b in batches]
    return torch.cat([o.predictions for o in outs]), torch.cat([o.exit_layers for o in outs])


SETTINGS = {"entropy": [0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0], "maxprob": [0.0, 0.4, 0.6, 0.8, 0.9, 0.99, 1.0],
            "patience": [0, 1, 2, 3, 5]}


@pytest.mark.parametrize("criterion", list(SETTINGS))
def test_simulated_exits_equal_early_exit_predict(tiny, criterion):
    model, _, batches = tiny
    all_logits, labels = exit_logits(model, batches, "cpu")
    assert all_logits.shape == (4, 60, 3) and all_logits.dtype == torch.float32 and labels.shape == (60,)
    seen_layers = set()
    for thr in SETTINGS[criterion]:
        preds, layers = simulate_exits(all_logits, criterion, thr, model.exit_layers)
        ref_preds, ref_layers = _predict_all(model, batches, criterion, thr)
        assert torch.equal(preds, ref_preds), (criterion, thr)
        assert torch.equal(layers, ref_layers), (criterion, thr)
        seen_layers |= set(layers.tolist())
    assert seen_layers == {1, 2, 3, 4}, "the fixture should make samples leave at every layer"


def test_last_exit_logits_are_the_full_model(tiny):
    model, _, batches = tiny
    all_logits, labels = exit_logits(model, batches, "cpu")
    full = torch.cat([full_predict(model, **{k: v for k, v in b.items() if k != "labels"}) for b in batches])
    assert torch.equal(all_logits[-1].argmax(-1), full)
    assert np.array_equal(labels, torch.cat([b["labels"] for b in batches]).numpy())


def _brute_force(model, batches, criterion, thresholds):
    """Each threshold's drop and layer speed-up, computed with early_exit_predict and full_predict directly."""
    labels = torch.cat([b["labels"] for b in batches]).numpy()
    full = torch.cat([full_predict(model, **{k: v for k, v in b.items() if k != "labels"}) for b in batches])
    full_metric = compute_metrics(TASK, full.numpy(), labels)["accuracy"]
    out = {}
    for thr in thresholds:
        preds, layers = _predict_all(model, batches, criterion, thr)
        drop = full_metric - compute_metrics(TASK, preds.numpy(), labels)["accuracy"]
        out[thr] = (drop, model.num_layers / float(layers.float().mean()))
    return out


@pytest.mark.parametrize("criterion", list(SETTINGS))
def test_calibrate_picks_the_fastest_threshold_within_the_drop(tiny, criterion):
    model, _, batches = tiny
    strictly_inside = False  # some budget must pick a threshold that is neither the fastest overall nor the fallback
    brute = None
    for max_drop in (0.0, 0.02, 0.05, 0.1, 0.2, 1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback warning, tested on its own below
            res = calibrate(model, batches, TASK, criterion, max_drop=max_drop)
        table = res["table"]
        if brute is None:
            brute = _brute_force(model, batches, criterion, list(table["threshold"]))
            expected_grid = {"entropy": 101, "maxprob": 51, "patience": 4}[criterion]
            assert len(table) == expected_grid
        for row in table.itertuples():  # the table's numbers are the real early-exit numbers
            assert row.quality_drop == pytest.approx(brute[row.threshold][0], abs=1e-12)
            assert row.layer_speedup == pytest.approx(brute[row.threshold][1], rel=1e-12)
        ok = {t: v for t, v in brute.items() if v[0] <= max_drop + DROP_TOLERANCE and v[1] > 1.0 + 1e-9}
        drop, speed = brute[res["threshold"]]
        assert res["quality_drop"] == pytest.approx(drop, abs=1e-12)
        assert res["layer_speedup"] == pytest.approx(speed, rel=1e-12)
        assert res["full_dev_accuracy"] == pytest.approx(0.8)  # every 5th label flipped
        assert int(table["chosen"].sum()) == 1
        if ok:
            assert not res["fallback"]
            assert drop <= max_drop + DROP_TOLERANCE
            assert speed == pytest.approx(max(v[1] for v in ok.values()), rel=1e-12)
            overall = max(v[1] for v in brute.values())
            strictly_inside |= 1.0 < speed < overall - 1e-9
        else:
            assert res["fallback"] and res["layer_speedup"] == 1.0 and res["quality_drop"] == 0.0
    assert strictly_inside, "the budgets should choose a middle threshold at least once (the test must be able to fail)"
    # max_drop 1 allows anything: the fastest candidate (entropy 1 and patience 0 send everyone out at layer 1; the
    # maxprob grid starts at 0.5, which some samples stay below)
    assert res["max_drop"] == 1.0 and res["layer_speedup"] == pytest.approx(max(v[1] for v in brute.values()))
    if criterion != "maxprob":
        assert res["layer_speedup"] == pytest.approx(4.0)


def test_calibrate_falls_back_to_the_full_model_with_a_warning(tiny):
    model, _, batches = tiny
    all_logits, _ = exit_logits(model, batches, "cpu")
    first_exit = all_logits[0].argmax(-1)
    assert not torch.equal(first_exit, all_logits[-1].argmax(-1)), "precondition: layer 1 disagrees somewhere"
    for criterion, thresholds, never in (("entropy", [1.0], 0.0), ("maxprob", [0.0], 1.0), ("patience", [0], 3.0)):
        with pytest.warns(UserWarning, match=f"no {criterion} threshold.*never exits early"):
            res = calibrate(model, batches, TASK, criterion, max_drop=0.0, thresholds=thresholds)
        assert res["fallback"] and res["threshold"] == never
        assert res["layer_speedup"] == 1.0 and res["mean_exit_layer"] == 4.0 and res["quality_drop"] == 0.0
        assert res["last_layer_share"] == 1.0
        assert sorted(res["table"]["threshold"]) == sorted([float(t) for t in thresholds] + [never])


def test_never_fires_warning(tiny):
    model, _, batches = tiny
    old_columns = {"criterion", "threshold", "accuracy", "full_accuracy", "quality_drop", "mean_exit_layer",
                   "layer_speedup", "wall_speedup", "seconds", "full_seconds"}
    with pytest.warns(UserWarning) as record:
        rows = sweep(model, batches, TASK, "entropy", [0.0], torch.device("cpu"), repeats=1)
    msgs = [str(w.message) for w in record if "never fires" in str(w.message)]
    assert len(msgs) == 1
    for word in ("entropy threshold 0 ", "100.0%", "last layer", "speed-up", "DeeBERT", "looser",
                 "higher entropy threshold", "lower maxprob", "smaller patience", "--calibrate"):
        assert word in msgs[0], word
    assert rows[0]["last_layer_share"] == 1.0 and old_columns <= set(rows[0])

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rows = sweep(model, batches, TASK, "entropy", [1.0], torch.device("cpu"), repeats=1)
    assert not [w for w in record if "never fires" in str(w.message)]
    assert rows[0]["last_layer_share"] == 0.0 and rows[0]["mean_exit_layer"] == 1.0

    with pytest.warns(UserWarning, match="the patience threshold 3 almost never fires"):  # one per such threshold
        rows = sweep(model, batches, TASK, "patience", [0, 3], torch.device("cpu"), repeats=1)
    assert [r["last_layer_share"] for r in rows] == [0.0, 1.0]


def test_bad_input_is_refused_with_the_fix(tiny):
    model, _, batches = tiny
    for bad in (-0.01, math.nan, math.inf, "0.01"):
        with pytest.raises(AclLabError, match=r"max_drop .*not valid.*finite number >= 0.*Fix: use e\.g\. 0\.01"):
            calibrate(model, batches, TASK, "entropy", max_drop=bad)
    with pytest.raises(AclLabError, match="no batches.*Fix"):
        calibrate(model, [], TASK, "entropy")
    with pytest.raises(AclLabError, match="no batches.*Fix"):
        exit_logits(model, [], "cpu")
    single, _ = build_model("tiny", num_labels=3, multi_exit=False)
    with pytest.raises(AclLabError, match="one exit.*Fix: train it with a multi-exit objective"):
        calibrate(single, batches, TASK, "entropy")
    with pytest.raises(AclLabError, match="criterion.*Fix"):
        calibrate(model, batches, TASK, "confidence")
    with pytest.raises(AclLabError, match="threshold 1.5.*Fix"):
        calibrate(model, batches, TASK, "entropy", thresholds=[0.1, 1.5])
    with pytest.raises(AclLabError, match="patience.*integer"):
        calibrate(model, batches, TASK, "patience", thresholds=[1.5])
    with pytest.raises(AclLabError, match="empty list of thresholds.*Fix"):
        calibrate(model, batches, TASK, "entropy", thresholds=[])
    with pytest.raises(AclLabError, match=r"\[n_exits, N, C\].*Fix"):
        simulate_exits(torch.zeros(3, 5, 2), "entropy", 0.3, [1, 2, 3, 4])


# ---------------------------------------------------------------------------
# the CLI on a tiny finished run
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    from acl_lab.presets import preset_config
    from acl_lab.trainer import train

    out = tmp_path_factory.mktemp("ee_cal") / "run"
    train(preset_config("smoke", objective="me-ce", output_dir=str(out), num_threads=1), progress=False)
    return out


def _dev_loader(run, split="dev"):
    from acl_lab.checkpoint import load_trained
    from acl_lab.data import load_task, make_loader, tokenize

    model, tokenizer, cfg = load_trained(run / "checkpoints" / "best", device="cpu")
    data = load_task(cfg.task, source=cfg.source, data_dir=cfg.data_dir, max_eval_samples=cfg.max_eval_samples,
                     seed=cfg.seed)
    enc = tokenize(data, tokenizer, cfg.max_length)
    return model, make_loader(enc[split], tokenizer, 64, shuffle=False)


def _table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["criterion", "threshold"])
    return [line.split() for line in lines[head + 1:] if line.strip()]


def test_cli_calibrate_prints_the_chosen_threshold_and_times_it_on_test(smoke_run, capsys):
    from acl_lab.cli import main

    for criterion in ("entropy", "patience"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert main(["early-exit", "--run", str(smoke_run), "--calibrate", "0.01", "--criterion", criterion,
                         "--repeats", "1", "--device", "cpu"]) == 0
            model, loader = _dev_loader(smoke_run)
            expected = calibrate(model, loader, get_task("rt-polarity"), criterion, max_drop=0.01)
        out = capsys.readouterr().out
        m = re.search(rf"calibrated on dev \(64 samples, (\d+) candidates, max drop 0.01\): {criterion} threshold "
                      r"(\S+)", out)
        assert m, out
        assert float(m.group(2)) == expected["threshold"] and int(m.group(1)) == len(expected["table"])
        assert f"dev accuracy {expected['dev_accuracy']:.4f} vs full {expected['full_dev_accuracy']:.4f}" in out
        assert f"layer speed-up {expected['layer_speedup']:.2f}x" in out
        assert "test (timed" in out and "optimistic" not in out
        rows = _table_rows(out)
        assert len(rows) == 1 and rows[0][0] == criterion and float(rows[0][1]) == expected["threshold"]


def test_cli_calibrate_split_note_errors_and_unchanged_default(smoke_run, capsys):
    from acl_lab.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["early-exit", "--run", str(smoke_run), "--calibrate", "0.05", "--split", "dev",
                     "--thresholds", "0,0.5,1", "--repeats", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "3 candidates" in out and "optimistic" in out and "dev (timed" in out

    assert main(["early-exit", "--run", str(smoke_run), "--calibrate", "-1", "--device", "cpu"]) == 2
    assert "max_drop" in capsys.readouterr().err
    assert main(["early-exit", "--run", str(smoke_run), "--calibrate", "0.01", "--calibrate-split", "valid",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "'valid' is not in task" in err and "--calibrate-split" in err

    with warnings.catch_warnings():  # without --calibrate: today's sweep on dev with the 7 default thresholds
        warnings.simplefilter("ignore")
        assert main(["early-exit", "--run", str(smoke_run), "--repeats", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "calibrated" not in out
    rows = _table_rows(out)
    assert [float(r[1]) for r in rows] == [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
