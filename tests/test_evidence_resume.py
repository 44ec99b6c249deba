"""The results pack as the place a long computation goes on from: every finished run lands in the pack at once, a
later session (no run cache, no checkpoints) reads them back instead of training, shards split the training over
processes side by side, and a partial pack writes tables that say they are partial."""
from __future__ import annotations

import json
import shutil
import warnings

import pandas as pd
import pytest

from acl_lab.errors import AclLabError
from acl_lab.lab import evidence as ev
from acl_lab.lab.evidence import FILES, EvidencePlan, build_report, parse_shard, run_evidence


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    keys = [c for c in ("task", "objective", "seed", "threshold", "lam", "split", "layer", "probe", "step",
                        "batch_size", "criterion") if c in df.columns]
    drop = [c for c in df.columns if "seconds" in c or c in ("wall_speedup", "samples_per_s")]  # timings differ
    return df.drop(columns=drop).sort_values(keys).reset_index(drop=True)


def test_a_committed_pack_alone_goes_on_without_training(smoke_pack, tmp_path, monkeypatch):
    plan, root = smoke_pack
    pack = tmp_path / "pack"
    shutil.copytree(root / "pack", pack, ignore=shutil.ignore_patterns("figures", "tables.md"))
    for table in pack.glob("*.csv"):  # the part tables go; each run's files (early sweeps included) stay
        table.unlink()
    assert not list(pack.glob("*.csv"))

    def no_training(*_a, **_k):
        raise AssertionError("a run already in the pack was trained again")

    monkeypatch.setattr("acl_lab.lab.experiments.run_many", no_training)
    run_evidence(plan, tmp_path / "fresh-home", pack, progress=False, command="resume test")
    assert not (tmp_path / "fresh-home" / "runs").exists()
    for part, name in FILES.items():  # the same tables as the session that trained them (timings aside)
        pd.testing.assert_frame_equal(_sorted(pd.read_csv(pack / name)), _sorted(pd.read_csv(root / "pack" / name)))
    meta = json.loads((pack / "plan.json").read_text())
    assert all(d["runs"] == d["planned"] for d in meta["done"].values()) and ev.pack_progress(meta) == []
    assert "A partial pack" not in build_report(pack).read_text()


def test_shards_split_the_runs_and_a_partial_pack_says_so(smoke_pack, tmp_path):
    _, root = smoke_pack
    plan = EvidencePlan(tasks=["rt-polarity"], seeds=[0, 1], preset="smoke")
    home, pack = tmp_path / "home", tmp_path / "pack"
    run_evidence(plan, home, pack, parts=["single"], progress=False, command="shard 0", shard=(0, 2))
    assert not (pack / FILES["single"]).exists()  # a shard writes runs, not tables
    assert "command" not in json.loads((pack / "plan.json").read_text())
    first = sorted(p.name for p in (pack / "runs").iterdir())
    # whole seeds first, the plan's objective order within a seed, every second run
    assert sorted(n.rsplit("-", 1)[0] for n in first) == sorted(["ce-s0", "acl-embed-s0", "ce-s1", "acl-embed-s1"])

    run_evidence(plan, home, pack, parts=["single"], progress=False, command="collect", train=False)
    single = pd.read_csv(pack / FILES["single"])
    assert len(single) == 4 and set(single["objective"]) == {"ce", "acl-embed"}
    meta = json.loads((pack / "plan.json").read_text())
    assert meta["done"]["single/rt-polarity"] == {"runs": 4, "planned": 8}
    assert ev.pack_progress(meta) == ["single/rt-polarity: 4 of 8 runs"]
    assert "single/rt-polarity: 4 of 8 runs" in build_report(pack).read_text()
    assert "partial: 4 of 8 runs in" in ev.pack_caption(meta)

    run_evidence(plan, home, pack, parts=["single"], progress=False, command="shard 1", shard=(1, 2))
    second = sorted(p.name for p in (pack / "runs").iterdir())
    assert len(second) == 8 and set(first) < set(second)
    run_evidence(plan, home, pack, parts=["single"], progress=False, command="collect", train=False)
    meta = json.loads((pack / "plan.json").read_text())
    assert meta["done"]["single/rt-polarity"] == {"runs": 8, "planned": 8}
    assert meta["commands"] == ["shard 0", "collect", "shard 1", "collect"]
    assert meta["command"] == "collect"  # the tables' command, not the last shard's
    assert set(meta["seconds"]) >= {"single/rt-polarity/shard 0/2", "single/rt-polarity/shard 1/2"}
    # the same runs as one process training them all (same configs, same seeds: deterministic on a CPU)
    pd.testing.assert_frame_equal(_sorted(pd.read_csv(pack / FILES["single"])),
                                  _sorted(pd.read_csv(root / "pack" / FILES["single"])))


@pytest.mark.parametrize("text", ["2/2", "-1/2", "0/0", "a/b", "1", "0/2/3"])
def test_a_bad_shard_is_a_clear_error(text):
    with pytest.raises(AclLabError, match="--shard|Shard"):
        parse_shard(text)


def test_shard_parsing_and_order():
    assert parse_shard(None) is None and parse_shard("") is None and parse_shard("1/3") == (1, 3)
    configs = EvidencePlan(preset="smoke", seeds=[0, 1, 2]).configs("single", "rt-polarity")
    shards = [ev.shard_of(configs, (i, 3)) for i in range(3)]
    assert sorted(c.objective + str(c.seed) for s in shards for c in s) == sorted(
        c.objective + str(c.seed) for c in configs)
    assert [c.seed for c in shards[0]] == [0, 0, 1, 2]  # every third of the seed-ordered 12: whole seeds first


def test_a_committed_pack_run_is_never_overwritten_by_a_cached_one(smoke_pack, tmp_path):
    """A run trained again into the cache (another device, another torch) neither replaces the committed pack run
    nor enters the tables; other results say so in a warning that names the fix, other timings alone do not."""
    plan, root = smoke_pack
    home, pack = tmp_path / "home", tmp_path / "pack"
    shutil.copytree(root / "pack", pack)
    committed = {p.parent.name: p.read_bytes() for p in (pack / "runs").glob("*/metrics.json")}
    for run in (pack / "runs").glob("ce-s0-*"):  # the single part's, and the pilot's (probes on), as cached runs
        shutil.copytree(run, home / "runs" / run.name)
    cached = sorted((home / "runs").glob("ce-s0-*"))
    metrics = {run: json.loads((run / "metrics.json").read_text()) for run in cached}
    for run, m in metrics.items():
        (run / "metrics.json").write_text(json.dumps(m | {"train_seconds": m["train_seconds"] + 99.0, "device": "cuda"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # other seconds and device only: no warning
        run_evidence(plan, home, pack, parts=["single"], progress=False, command="timings", train=False)

    for run, m in metrics.items():
        (run / "metrics.json").write_text(json.dumps(m | {"test": {"accuracy": m["test"]["accuracy"] + 0.25}}))
    with pytest.warns(UserWarning, match="different results.*delete the pack's run folder"):
        run_evidence(plan, home, pack, parts=["single"], progress=False, command="retrained", train=False)
    assert {p.parent.name: p.read_bytes() for p in (pack / "runs").glob("*/metrics.json")} == committed
    table = pd.read_csv(pack / FILES["single"])
    row = table[(table.objective == "ce") & (table.seed == 0)]
    packed = [json.loads((pack / "runs" / run.name / "metrics.json").read_text())["test"]["accuracy"] for run in cached]
    assert len(row) == 1 and row.test_accuracy.iloc[0] in packed
    assert all(m["test"]["accuracy"] + 0.25 != row.test_accuracy.iloc[0] for m in metrics.values())


def test_a_run_naming_fewer_tasks_keeps_the_others_in_the_recorded_plan(smoke_pack, tmp_path):
    """``--tasks rt-3way --shard I/N`` beside a pack of rt-polarity runs: the recorded plan, which the report reads,
    keeps rt-polarity (and the pack's seeds) and adds rt-3way, so the report keeps every rt-polarity table."""
    plan, root = smoke_pack
    pack = tmp_path / "pack"
    shutil.copytree(root / "pack", pack)
    before = build_report(pack).read_text()
    other = EvidencePlan(tasks=["rt-3way"], seeds=[1], preset="smoke")
    run_evidence(other, tmp_path / "home", pack, parts=["single"], progress=False, command="other task",
                 shard=(99, 100))  # a share with no run in it: nothing is trained
    recorded = json.loads((pack / "plan.json").read_text())["plan"]
    assert recorded["tasks"] == ["rt-polarity", "rt-3way"] and recorded["seeds"] == [0, 1]
    after = build_report(pack).read_text()

    def rows(report: str) -> list[str]:  # the table rows of rt-polarity (the recorded command differs)
        return [line for line in report.splitlines() if line.startswith("|") and "rt-polarity" in line]

    assert len(rows(before)) > 10 and rows(after) == rows(before)
    assert ev.merged_plan(None, other)["tasks"] == ["rt-3way"]


def test_runs_the_early_part_trains_keep_their_representations(tmp_path):
    """The early-exit part trains the multi-exit part's models: the lowest multi-exit seed keeps its representations
    (notebook 03 reads them), and a pack run without them gets them from a finished cached run of its config."""
    import torch
    from safetensors.torch import load_file

    from acl_lab.analysis.runs import run_name

    plan = EvidencePlan(tasks=["rt-polarity"], seeds=[0, 1], preset="smoke", latency_samples=4)
    home, pack = tmp_path / "home", tmp_path / "pack"
    run_evidence(plan, home, pack, parts=["early"], progress=False, command="early first")
    reps = "representations.safetensors"
    names = {(c.objective, c.seed): run_name(c) for c in ev.part_configs(plan, "early", "rt-polarity")}
    assert len(names) == 4
    for (objective, seed), name in names.items():
        assert (pack / "runs" / name / reps).is_file() == (seed == 0), (objective, seed)
        assert (pack / "runs" / name / ev.EARLY_FILE).is_file()
    ce0 = pack / "runs" / names[("me-ce", 0)]
    kept = load_file(ce0 / reps)
    (ce0 / reps).unlink()  # a pack made before the early part kept them
    run_evidence(plan, home, pack, parts=["multi"], progress=False, command="collect", train=False)
    again = load_file(ce0 / reps)
    assert again.keys() == kept.keys() and all(torch.equal(again[k], kept[k]) for k in kept)
    assert not (pack / "runs" / names[("me-ce", 1)] / reps).exists()  # not the other seeds
    # a cached run with other results is another model: its representations are not taken
    (ce0 / reps).unlink()
    cached = home / "runs" / ce0.name / "metrics.json"
    m = json.loads(cached.read_text())
    cached.write_text(json.dumps(m | {"test": {"accuracy": m["test"]["accuracy"] + 0.25}}))
    with pytest.warns(UserWarning, match="different results"):
        run_evidence(plan, home, pack, parts=["multi"], progress=False, command="retrained", train=False)
    assert not (ce0 / reps).exists()
