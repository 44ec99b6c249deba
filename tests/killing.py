"""Fault injection for the kill tests: run a job in a real child process and SIGKILL it at a chosen moment.

Children are forked from a ``forkserver`` that has imported acl_lab once, so a child starts
in milliseconds instead of the seconds an interpreter needs to import torch; each child is an
ordinary process in its own process group, killed with a real ``SIGKILL`` (the whole group,
so the Jupyter kernels of a batch die with it).

Two kinds of kill point:

* at a time: the test sleeps, then kills the group (:func:`run_job` with ``after``);
* at an event, to land inside writes that take milliseconds: the child counts its own
  ``os.fsync`` calls on files (one per file written through :mod:`acl_lab.atomic`, the
  moment the file's bytes are complete but not yet in place) and its ``os.replace`` calls,
  and kills itself at the chosen one. ``torn`` first cuts the file being written to half
  (a temporary) or tears the last line (an append-only log), as a kill inside ``write()``
  would; ``before``/``after`` kill just before or after a rename.

:func:`trace_job` runs a job uninterrupted and returns its event list, from which a test
draws event kill points with a seeded generator.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import stat
import time
import traceback
from pathlib import Path
from typing import Any

# what a train imports lazily (model classes, tokenizers): imported once here instead of seconds per child
PRELOAD = ["acl_lab.trainer", "acl_lab.lab.batch", "acl_lab.lab.evidence", "acl_lab.lab.experiments", "killing",
           "transformers.modeling_utils", "transformers.models.bert.modeling_bert",
           "transformers.models.bert.tokenization_bert", "transformers.data.data_collator",
           "transformers.models.auto.tokenization_auto", "transformers.models.auto.modeling_auto"]
_CTX = None


def context():
    """The forkserver context (started once per test session, acl_lab preloaded)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _normal(path: str, root: str) -> str:
    """A path relative to the job's root with the writer's pid taken out of temporary names."""
    rel = os.path.relpath(path, root) if path.startswith(root) else path
    return re.sub(r"\.tmp-\d+", ".tmp-PID", rel)


class _Hooks:
    """Counts fsync (file complete) and replace (rename) events; records them or kills at one of them."""

    def __init__(self, root: str, kill: dict | None, trace: str | None) -> None:
        self.root, self.kill, self.seen = root, kill, 0  # seen: events matching the kill's kind and path
        self.trace = open(trace, "a") if trace else None
        self._fsync, self._replace = os.fsync, os.replace
        os.fsync, os.replace = self.fsync, self.replace

    def _event(self, kind: str, path: str, phase: str, fd: int | None = None) -> None:
        rel = _normal(path, self.root)
        if self.trace and phase == "before":
            self.trace.write(json.dumps({"kind": kind, "path": rel}) + "\n")
            self.trace.flush()
        k = self.kill
        if not k or k["kind"] != kind or k["path"] != rel:
            return
        if phase == "before":
            self.seen += 1
            if self.seen - 1 != k["nth"] or k["mode"] == "after":
                return
            if k["mode"] == "torn" and fd is not None:
                _tear(fd, path)
        elif self.seen - 1 != k["nth"] or k["mode"] != "after":
            return
        os.killpg(0, signal.SIGKILL)

    def fsync(self, fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            self._event("write", os.readlink(f"/proc/self/fd/{fd}"), "before", fd)
        self._fsync(fd)

    def replace(self, src, dst) -> None:
        self._event("rename", str(dst), "before")
        self._replace(src, dst)
        self._event("rename", str(dst), "after")


def _tear(fd: int, path: str) -> None:
    """Leave the file as a kill inside write() would: a temporary half-written, a log with a torn last line."""
    size = os.fstat(fd).st_size
    if ".tmp" in path:
        os.truncate(path, size // 2)
        return
    data = Path(path).read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1  # the last line
    os.truncate(path, start + max(1, (size - start) // 2))


def _child(job: dict, kill: dict | None, trace: str | None, result: str) -> None:
    os.setsid()  # its own process group: a kill takes its kernels and workers with it
    import torch

    torch.set_num_threads(1)
    _Hooks(job["root"], kill, trace)
    status: dict[str, Any] = {"ok": True}
    try:
        _run(job)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        status = {"ok": False, "type": type(exc).__name__, "error": str(exc), "tb": traceback.format_exc()[-3000:]}
    Path(result).write_text(json.dumps(status))
    os._exit(0)


def _run(job: dict) -> None:
    kind = job["kind"]
    if kind == "train":
        from acl_lab import trainer

        if job.get("fsize_after_checkpoint"):
            _limit_file_size_after_first_checkpoint(trainer, job["fsize_after_checkpoint"])
        trainer.train(job["config"], resume=True, progress=False)
    elif kind == "batch":
        from acl_lab.lab.batch import run_grid

        run_grid(job["grid"], progress=False)
    elif kind == "evidence":
        from acl_lab.lab.evidence import EvidencePlan, run_evidence

        run_evidence(EvidencePlan(**job["plan"]), job["runs_home"], job["results"], parts=job["parts"],
                     progress=False)
    elif kind != "noop":  # noop: starts the forkserver, so that a traced run's time is a warm child's
        raise ValueError(kind)


def _limit_file_size_after_first_checkpoint(trainer, limit: int) -> None:
    """A full disk from the next write on: RLIMIT_FSIZE makes larger writes fail with EFBIG (SIGXFSZ ignored)."""
    import resource

    real = trainer.save_checkpoint

    def save_then_limit(folder, *args, **kwargs):
        out = real(folder, *args, **kwargs)
        if Path(folder).name == "last":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return out

    trainer.save_checkpoint = save_then_limit


def run_job(job: dict, kill: dict | None = None, after: float | None = None, trace: str | None = None,
            timeout: float = 120.0) -> dict:
    """Run ``job`` in a child; kill it at event ``kill`` or ``after`` seconds. Returns what happened.

    ``{"killed": bool, "seconds": float, "status": dict | None}``; ``status`` is the child's own
    report when it ran to the end (``ok`` or the exception it raised).
    """
    Path(job["root"]).mkdir(parents=True, exist_ok=True)
    result = Path(job["root"]) / f".result-{time.time_ns()}.json"
    p = context().Process(target=_child, args=(job, kill, trace, str(result)))
    t0 = time.perf_counter()
    p.start()
    p.join(after if after is not None else timeout)
    if p.is_alive():
        if after is None:
            _kill_group(p)
            raise TimeoutError(f"job {job['kind']} did not finish in {timeout} s")
        _kill_group(p)
    p.join(30)
    seconds = time.perf_counter() - t0
    status = json.loads(result.read_text()) if result.exists() else None
    result.unlink(missing_ok=True)
    return {"killed": p.exitcode == -signal.SIGKILL, "seconds": seconds, "status": status}


def _kill_group(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not its own group leader yet
        p.kill()


def trace_job(job: dict) -> tuple[list[dict], float]:
    """Run ``job`` uninterrupted in a (warm) child; its events (in order) and its wall time."""
    Path(job["root"]).mkdir(parents=True, exist_ok=True)
    run_job({"kind": "noop", "root": job["root"]})
    trace = Path(job["root"]) / f".trace-{time.time_ns()}.jsonl"
    out = run_job(job, trace=str(trace))
    assert out["status"] and out["status"]["ok"], out
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    trace.unlink()
    return events, out["seconds"]


def kill_spec(events: list[dict], index: int, mode: str) -> dict:
    """A kill at ``events[index]``: the same path's n-th event of that kind, in ``mode`` (torn/before/after)."""
    e = events[index]
    nth = sum(1 for x in events[:index] if x["kind"] == e["kind"] and x["path"] == e["path"])
    return {"kind": e["kind"], "path": e["path"], "nth": nth, "mode": mode}
