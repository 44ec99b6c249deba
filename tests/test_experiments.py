"""Run folders of experiments.run_many: one name per computation, stable when defaults are spelled out."""
from __future__ import annotations

from acl_lab.config import TrainConfig
from acl_lab.analysis.runs import run_name
from acl_lab.lab.experiments import run_many


def test_run_name_depends_on_what_is_computed_only():
    base = TrainConfig(task="rt-polarity", objective="acl", seed=1, max_steps=60)
    assert run_name(base).startswith("acl-s1-")
    # spelling out a default, or changing where/how it runs, names the same computation
    assert run_name(base.replace(lam=TrainConfig().lam, pooling="cls")) == run_name(base)
    assert run_name(base.replace(output_dir="elsewhere", device="cpu", num_threads=1, eval_every=5)) == run_name(base)
    # any field that changes the computation changes the name
    for change in (dict(lam=0.5), dict(pooling="mean"), dict(max_steps=61), dict(probe_angles=True),
                   dict(probe_every=2), dict(seed=2), dict(task="rt-3way")):
        assert run_name(base.replace(**change)) != run_name(base), change


def test_run_many_reads_a_finished_run_back_instead_of_training_again(tiny_config, tmp_path):
    cfg = tiny_config.replace(objective="ce", max_steps=2)
    first = run_many([cfg], tmp_path, progress=False)[0]
    stamp = (first.output_dir / "metrics.json").stat().st_mtime_ns
    again = run_many([cfg.replace(eval_every=1)], tmp_path, progress=False)[0]  # runtime field: same run
    assert again.output_dir == first.output_dir
    assert (again.output_dir / "metrics.json").stat().st_mtime_ns == stamp
    assert again.metrics["dev"] == first.metrics["dev"]
