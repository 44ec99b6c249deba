"""One writer per folder, a full disk, and hostile files (paths out of the batch folder, pickles, remote code)."""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import kernel_name
from test_batch import parameters_notebook
from killing import run_job

from acl_lab import atomic
from acl_lab.lab import batch
from acl_lab.atomic import write_text
from acl_lab.checkpoint import load_model_weights, load_training_state
from acl_lab.errors import AclLabError
from acl_lab.locks import FolderLock
from acl_lab.model import build_model, load_backbone
from acl_lab.trainer import make_optimizer, train

HOLD = ("import sys, time\nfrom acl_lab.locks import FolderLock\n"
        "with FolderLock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n    time.sleep(120)\n")


def _holder(folder: Path, command: str) -> subprocess.Popen:
    """A live process that holds the folder's lock, as a running train/batch does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), command], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---------------------------------------------------------------------------
# one writer per folder
# ---------------------------------------------------------------------------
def test_second_train_on_a_live_runs_folder_is_refused_at_once(tiny_config):
    """A live `python -m acl_lab train` holds its folder; a second train is refused at once, then resumes after
    the first is SIGKILLed (the dead process leaves the lock free)."""
    out = Path(tiny_config.output_dir)
    cfg = tiny_config.replace(max_steps=400, eval_every=400)
    cmd = [sys.executable, "-m", "acl_lab", "train", "--task", "sst2", "--source", "local", "--data-dir",
           cfg.data_dir, "--model", "tiny", "--batch-size", "16", "--max-length", "16", "--max-steps", "400",
           "--eval-every", "400", "--lr", "0.002", "--warmup-ratio", "0", "--dropout", "0", "--num-threads", "1",
           "--no-progress", "--output-dir", str(out)]
    live = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "history.jsonl").exists():
            time.sleep(0.05)
        assert live.poll() is None, "the live run ended too soon"
        history = (out / "history.jsonl").read_bytes()
        t0 = time.perf_counter()
        with pytest.raises(AclLabError, match=rf"in use by another acl_lab train \(pid {live.pid} .*Fix: wait"):
            train(cfg, resume=True, progress=False)
        with pytest.raises(AclLabError, match="in use by another acl_lab train"):
            train(cfg, overwrite=True, progress=False)  # would have deleted the live run's files
        assert time.perf_counter() - t0 < 5
        assert (out / "history.jsonl").read_bytes()[:len(history)] == history  # nothing of the live run touched
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    with FolderLock(out, "train"):  # the dead run left the lock free (the kill tests resume such runs)
        assert json.loads((out / ".acl_lab.lock").read_text())["pid"] == os.getpid()


def test_lock_is_per_folder_and_released_on_exit(tiny_config, tmp_path):
    with FolderLock(tiny_config.output_dir, "train"):
        with pytest.raises(AclLabError, match="in use by another acl_lab train"):
            train(tiny_config, progress=False)  # also within one process (a notebook thread)
        train(tiny_config.replace(output_dir=str(tmp_path / "other"), max_steps=1), progress=False)
    assert train(tiny_config, progress=False).metrics["steps"] == 6
    assert (Path(tiny_config.output_dir) / ".acl_lab.lock").read_text() == ""  # free, no holder named


def test_second_batch_or_suite_on_a_busy_folder_is_refused(tmp_path, monkeypatch):
    nbs = tmp_path / "nbs"
    parameters_notebook(nbs / "00_toy.ipynb", "X = 1")
    out = tmp_path / "out"
    grid = nbs / "g.yaml"
    grid.write_text(yaml.safe_dump({"notebooks": ["00_toy.ipynb"], "output_dir": str(out), "grid": {"X": [1]}}))
    monkeypatch.setattr(batch, "NOTEBOOKS_DIR", nbs)
    holder = _holder(out, "batch")
    try:
        with pytest.raises(AclLabError, match=rf"in use by another acl_lab batch \(pid {holder.pid} "):
            batch.run_grid(grid, progress=False)
        with pytest.raises(AclLabError, match="in use by another acl_lab batch"):
            batch.run_suite("smoke", output_dir=out, kernel_name=kernel_name(), progress=False)
        assert not (out / "results.csv").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert list(batch.run_grid(grid, progress=False)["status"]) == ["completed"]  # free once the holder died


# ---------------------------------------------------------------------------
# a full disk
# ---------------------------------------------------------------------------
def test_full_disk_stops_training_and_keeps_the_last_checkpoint(tiny_config, tmp_path):
    """RLIMIT_FSIZE in a child (SIGXFSZ ignored, so writes fail with EFBIG) after its first checkpoint."""
    cfg = tiny_config.replace(max_steps=9, eval_every=3)
    ref = train(cfg.replace(output_dir=str(tmp_path / "ref")), progress=False)
    out = tmp_path / "full" / "run"
    run = cfg.replace(output_dir=str(out))
    res = run_job({"kind": "train", "root": str(tmp_path / "full"), "config": run.to_dict(),
                   "fsize_after_checkpoint": 1_000_000})  # a checkpoint's model file is about 4 MB
    status = res["status"]
    assert status and status["type"] == "AclLabError", res
    assert "disk is full or a file-size limit was reached" in status["error"] and "--resume" in status["error"]
    assert "File too large" in status["error"]
    model, _ = build_model("tiny", 2, dropout=0.0)
    state = load_training_state(out / "checkpoints" / "last", model, make_optimizer(model, run))
    assert state["step"] == 3  # the previous checkpoint is whole and loads
    load_model_weights(out / "checkpoints" / "best", build_model("tiny", 2)[0])
    assert not list(out.glob("**/*.tmp*")) and not (out / "metrics.json").exists()
    again = train(run, resume=True, progress=False)  # space freed: resume ends where an uninterrupted run ends
    assert again.metrics["dev"] == ref.metrics["dev"] and again.metrics["best_step"] == ref.metrics["best_step"]


def test_enospc_leaves_the_old_file_and_names_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    write_text(path, "old")

    def full(_path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "fsync_file", full)
    with pytest.raises(AclLabError, match=r"metrics.json.*disk is full.*No space left.*kept intact.*Fix: free"):
        write_text(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["metrics.json"]
    assert atomic.is_disk_full(RuntimeError("Error while serializing: I/O error: No space left (os error 28)"))
    assert not atomic.is_disk_full(OSError(errno.EACCES, "Permission denied"))


# ---------------------------------------------------------------------------
# hostile files
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("template, grid, words", [
    ("../{name}.ipynb", {"X": [1]}, "would write outside the batch's output folder"),
    ("/tmp/{name}.ipynb", {"X": [1]}, "would write outside"),
    ("~/{name}.ipynb", {"X": [1]}, "would write outside"),
    ("{NAME}/{name}.ipynb", {"NAME": ["..", "a"]}, r"Run 'NAME=\.\.' of toy.ipynb would write .*outside"),
    ("{NAME}/../../{name}.ipynb", {"NAME": ["a"]}, "would write outside"),
])
def test_grid_cannot_write_outside_its_output_folder(tmp_path, template, grid, words):
    parameters_notebook(tmp_path / "toy.ipynb", 'X = 1\nNAME = "a"')
    g = {"notebooks": [str(tmp_path / "toy.ipynb")], "output_dir": str(tmp_path / "out"),
         "output_template": template, "grid": grid}
    with pytest.raises(AclLabError, match=words):
        batch.expand_grid(g)
    assert not (tmp_path / "out").exists()


def _tiny_folder(folder: Path) -> torch.nn.Module:
    """A Hugging Face folder of the tiny BERT (config + tokenizer), without weights; returns the encoder."""
    encoder, tokenizer = load_backbone("tiny")
    encoder.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return encoder


class _Payload:
    """Pickled, it runs code on load: the kind of file weights_only=True must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_checkpoint_loads_weights_only(tmp_path):
    """Only pytorch_model.bin: plain tensors load (weights_only=True); a pickle carrying code is refused, unrun."""
    good = tmp_path / "good"
    encoder = _tiny_folder(good)
    torch.save(encoder.state_dict(), good / "pytorch_model.bin")
    loaded, _ = load_backbone(str(good))
    key = "embeddings.word_embeddings.weight"
    assert torch.equal(loaded.state_dict()[key], encoder.state_dict()[key])

    bad = tmp_path / "bad"
    _tiny_folder(bad)
    marker = tmp_path / "code_ran"
    with open(bad / "pytorch_model.bin", "wb") as f:
        pickle.dump({key: _Payload(marker)}, f)
    with pytest.raises(AclLabError, match=r"Could not load model .*bad"):
        load_backbone(str(bad))
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # set only while loading


def test_models_never_load_remote_code(tmp_path, monkeypatch):
    """A folder whose config names its own code (auto_map) loads the library's BERT; the code never runs."""
    folder = tmp_path / "remote"
    encoder = _tiny_folder(folder)
    torch.save(encoder.state_dict(), folder / "pytorch_model.bin")
    marker = tmp_path / "remote_code_ran"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import BertModel as EvilModel, BertConfig as EvilConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))

    import transformers

    seen = []
    for cls in (transformers.AutoModel, transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code")))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    loaded, _ = load_backbone(str(folder))
    assert type(loaded).__name__ == "BertModel" and not marker.exists()
    assert {name for name, _ in seen} == {"AutoModel", "AutoTokenizer"}
    assert all(trust is False for _, trust in seen), seen
    shutil.rmtree(folder)


# ---------------------------------------------------------------------------
# files edited by hand
# ---------------------------------------------------------------------------
def test_hand_edited_config_cannot_pass_off_a_finished_run(tiny_config):
    """config.json edited, then --resume: refused (metrics.json records the config the run really had)."""
    cfg = tiny_config.replace(max_steps=2, eval_every=2)
    train(cfg, progress=False)
    path = Path(cfg.output_dir) / "config.json"
    edited = {**json.loads(path.read_text()), "lr": 0.5}
    path.write_text(json.dumps(edited))
    with pytest.raises(AclLabError, match=r"different config \(differs in: lr\)"):
        train(edited, resume=True, progress=False)
    (Path(cfg.output_dir) / "metrics.json").write_text('{"dev": ')
    path.write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(AclLabError, match=r"metrics.json' is damaged .*Fix: restore it, or delete it and run again with --resume"):
        train(cfg, resume=True, progress=False)


def test_damaged_notebook_metrics_do_not_crash_a_batch(tmp_path):
    parameters_notebook(tmp_path / "toy.ipynb", 'OUTPUT_DIR = "out"\nPRESET = "smoke"')
    metrics = tmp_path / "o" / "smoke" / "metrics" / "toy.json"
    metrics.parent.mkdir(parents=True)
    for text, words in (('{"x": 1', "not valid JSON"), ("[1, 2]", "not a mapping")):
        metrics.write_text(text)
        got = batch.gather_metrics(tmp_path / "toy.ipynb", {"OUTPUT_DIR": str(tmp_path / "o"), "PRESET": "smoke"})
        assert words in got["metrics_error"]


def test_torn_last_log_line_is_dropped_other_damage_is_named(tmp_path):
    log = tmp_path / "history.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert atomic.read_jsonl(log) == [{"step": 1}, {"step": 2}]
    log.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(AclLabError, match="Line 2 of .* is not a JSON object"):
        atomic.read_jsonl(log)
