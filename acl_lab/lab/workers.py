"""Where the runs of a batch execute: in this process, in N local processes, or on a Dask cluster.

:func:`acl_lab.lab.batch.run_grid` decides *what* runs (skipping completed runs, waiting for
the runs a run is declared to come ``after``) and records every result; a runner here
only executes one :class:`~acl_lab.lab.batch.RunSpec` and hands back its
:class:`~acl_lab.lab.batch.RunRecord`. There are three, with one interface (``slots``,
``submit``, ``wait_any``, ``record``, ``cancel``, ``close``):

* :class:`InProcess` (``--jobs 1``, the default): papermill in this process, one run at a time.
* :class:`LocalProcesses` (``--jobs N``): up to N runs at once, each in its own Python
  process (and so its own kernel), because papermill's ``cwd`` handling is not
  thread-safe and kernels misbehave under ``multiprocessing``. Threads here only wait.
* :class:`DaskCluster` (``--scheduler ADDRESS``): every run is one task on an existing
  ``dask.distributed`` cluster; the task, too, runs the notebook in a child process.

Threads per run (the rule): a run gets ``max(1, cores // slots)`` threads, where cores
are the CPUs this process may use (``os.sched_getaffinity``) and slots are the runs that
execute at once on those CPUs: N for ``--jobs N``; for Dask, the summed ``nthreads`` of
the workers on the worker's host with the same CPUs (one Slurm job's workers, say). They reach torch (and NumPy, numba, tokenizers)
through ``OMP_NUM_THREADS`` and friends in the child's environment, which torch reads
when it starts. ``--jobs 1`` leaves the threads as they are (torch's default: all cores).

A child process that dies (a signal, the OOM killer) or a Dask worker that dies gives
its run a "failed" record with the reason; the other runs go on.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from .batch import RunRecord, RunSpec, failed_record, run_notebook
from ..errors import AclLabError

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS",
                    "RAYON_NUM_THREADS")
CONNECT_TIMEOUT = "20s"  # how long --scheduler waits for the scheduler to answer
INSTALL_HINT = "pip install acl_lab[cluster]"


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask, e.g. a Slurm allocation), else all of them."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return tuple(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(usable_cpus())


def threads_per_run(slots: int, cores: int | None = None) -> int:
    """The rule: ``max(1, cores // slots)`` threads for each of ``slots`` runs executing at once."""
    return max(1, (cores or usable_cores()) // max(1, slots))


# ---------------------------------------------------------------------------
# one run in a child process (the same function for local processes and Dask tasks)
# ---------------------------------------------------------------------------
def record_to_dict(rec: RunRecord) -> dict[str, Any]:
    return {"name": rec.name, "notebook": str(rec.notebook), "parameters": rec.parameters,
            "output_path": str(rec.output_path), "status": rec.status, "error": rec.error,
            "seconds": rec.seconds, "metrics": rec.metrics}


def record_from_dict(d: dict[str, Any]) -> RunRecord:
    return RunRecord(**{**d, "notebook": Path(d["notebook"]), "output_path": Path(d["output_path"])})


def job_dict(spec: RunSpec, kernel: str, timeout: int | None) -> dict[str, Any]:
    """What a child process needs to run ``spec`` (plain JSON, so it can travel to a Dask worker)."""
    return {"notebook": str(spec.notebook), "output": str(spec.output_path), "parameters": spec.parameters,
            "name": spec.name, "kernel": kernel, "timeout": timeout}


def _watch_parent() -> None:
    """Exit this child when its parent dies (e.g. a killed Dask worker), so no orphan goes on writing the run."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)  # its kernel notices its own parent is gone and exits as well

    threading.Thread(target=watch, daemon=True).start()


def run_child(job_path: str, record_path: str) -> int:
    """Entry point of the child process: run the job in ``job_path``, write its record to ``record_path``."""
    _watch_parent()
    job = json.loads(Path(job_path).read_text())
    start = time.perf_counter()
    try:
        rec = run_notebook(job["notebook"], job["output"], job["parameters"], kernel_name=job["kernel"],
                           timeout=job["timeout"], name=job["name"])
    except AclLabError as exc:  # e.g. the notebook is not visible on this Dask worker
        rec = RunRecord(name=job["name"], notebook=Path(job["notebook"]), parameters=job["parameters"],
                        output_path=Path(job["output"]), status="failed", error=str(exc),
                        seconds=time.perf_counter() - start)
    tmp = Path(record_path + ".tmp")
    tmp.write_text(json.dumps(record_to_dict(rec)))
    os.replace(tmp, record_path)
    return 0


def _death_reason(returncode: int, log: Path) -> str:
    """Why a child gave no record: the signal that killed it, or its exit status and last stderr line."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (SIGKILL: killed by hand, by a job scheduler, or by the out-of-memory killer)" \
            if name == "SIGKILL" else ""
        return f"the run's process was killed by {name}{hint}"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] \
        if log.is_file() else []
    return f"the run's process exited with status {returncode}" + (f": {lines[-1]}" if lines else "")


_CHILD = f"import sys; from {__name__} import run_child; sys.exit(run_child(sys.argv[1], sys.argv[2]))"


def run_in_subprocess(job: dict[str, Any], threads: int | None,
                      started: Callable[[subprocess.Popen], None] | None = None) -> dict[str, Any]:
    """Run ``job`` (see :func:`job_dict`) in a fresh Python process and return its record as a dict.

    ``threads`` sets the child's :data:`THREAD_VARIABLES` (None: inherit). The child is
    its own session, so a Ctrl-C meant for the batch reaches it only through
    :meth:`LocalProcesses.cancel`; ``started`` is told its ``Popen``.
    """
    env = dict(os.environ)
    if threads:
        env.update({name: str(threads) for name in THREAD_VARIABLES})
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="acl-lab-run-") as tmp:
        job_path, record_path, log = Path(tmp) / "job.json", Path(tmp) / "record.json", Path(tmp) / "log.txt"
        job_path.write_text(json.dumps(job))
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(job_path), str(record_path)], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            if started is not None:
                started(proc)
            returncode = proc.wait()
        if record_path.is_file():
            return json.loads(record_path.read_text())
        reason = _death_reason(returncode, log)
    return _failed_dict(job, reason, time.perf_counter() - start)


def _failed_dict(job: dict[str, Any], reason: str, seconds: float = 0.0) -> dict[str, Any]:
    return {"name": job["name"], "notebook": job["notebook"], "parameters": job["parameters"],
            "output_path": job["output"], "status": "failed", "error": reason, "seconds": seconds, "metrics": {}}


# ---------------------------------------------------------------------------
# runners
# ---------------------------------------------------------------------------
class InProcess:
    """``--jobs 1``: each run with papermill in this process, when it is submitted (Ctrl-C interrupts it)."""

    slots = 1

    def __init__(self, kernel: str, timeout: int | None):
        self.kernel, self.timeout = kernel, timeout

    def submit(self, spec: RunSpec) -> cf.Future:
        future: cf.Future = cf.Future()
        future.set_result(run_notebook(spec.notebook, spec.output_path, spec.parameters, kernel_name=self.kernel,
                                       timeout=self.timeout, name=spec.name))
        return future

    def wait_any(self, futures: list) -> list:
        return [f for f in futures if f.done()]

    def record(self, future: cf.Future, spec: RunSpec) -> RunRecord:
        return future.result()

    def cancel(self, futures: list) -> None:
        pass

    def close(self) -> None:
        pass


class LocalProcesses:
    """``--jobs N``: up to N runs at once, each in its own process, ``threads_per_run(N)`` threads each."""

    def __init__(self, jobs: int, kernel: str, timeout: int | None):
        self.slots, self.kernel, self.timeout = jobs, kernel, timeout
        self.threads = threads_per_run(jobs)
        self.pool = cf.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="acl-lab-run")
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def _run(self, spec: RunSpec) -> dict[str, Any]:
        def started(proc: subprocess.Popen) -> None:
            with self.lock:
                self.procs.add(proc)

        return run_in_subprocess(job_dict(spec, self.kernel, self.timeout), self.threads, started)

    def submit(self, spec: RunSpec) -> cf.Future:
        return self.pool.submit(self._run, spec)

    def wait_any(self, futures: list) -> list:
        return list(cf.wait(futures, return_when=cf.FIRST_COMPLETED).done)

    def record(self, future: cf.Future, spec: RunSpec) -> RunRecord:
        try:
            return record_from_dict(future.result())
        except Exception as exc:  # noqa: BLE001 - e.g. no temporary folder: the run fails, the batch goes on
            return failed_record(spec, f"{type(exc).__name__}: {exc}")

    def cancel(self, futures: list) -> None:
        """Stop every running child (its whole session: papermill and the kernel it started)."""
        for future in futures:
            future.cancel()
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _distributed():
    """The ``distributed`` package, or an AclLabError naming the extra to install."""
    try:
        import distributed
    except ImportError:
        raise AclLabError(f"--scheduler needs dask.distributed, which is not installed. Fix: {INSTALL_HINT} "
                          "(or pip install 'dask[distributed]'), on this machine and on the workers.") from None
    return distributed


def run_on_worker(job: dict[str, Any], threads_by_worker: dict[str, int]) -> dict[str, Any]:
    """The Dask task of one run: the notebook in a child process on the worker, the record back as a dict.

    Threads: this worker's entry in ``threads_by_worker`` (computed by the client from
    every worker's host), else ``threads_per_run(nthreads of this worker)`` for a worker
    that joined later.

    A worker that dies mid-run: the scheduler hands the task to another worker, which
    finds the attempt file the first one left beside the output (same submission id)
    and returns a "failed" record naming the dead worker instead of running it again,
    so a notebook that kills its worker (out of memory, say) does not kill the next.
    """
    from distributed import get_worker

    worker = get_worker()
    marker = Path(job["attempt_file"])
    try:
        earlier = json.loads(marker.read_text())
    except (OSError, ValueError):
        earlier = None
    if earlier and earlier.get("id") == job["attempt_id"]:
        marker.unlink(missing_ok=True)
        return _failed_dict(job, f"the Dask worker running it died ({earlier['worker']}, pid {earlier['pid']}, "
                                 f"{time.time() - earlier['started']:.0f} s after the run started; its log says "
                                 "why); not retried: rerun the batch to run it again")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"id": job["attempt_id"], "worker": worker.address, "pid": os.getpid(),
                                  "started": time.time()}))
    threads = threads_by_worker.get(worker.address) or threads_per_run(worker.state.nthreads)
    try:
        return run_in_subprocess(job, threads)
    finally:
        marker.unlink(missing_ok=True)


def _host_threads(client) -> dict[str, int]:
    """{worker address: threads per run}: the CPUs a worker may use over the task slots (threads) of all the
    workers that share those CPUs (same host, same affinity mask: e.g. the workers of one Slurm job)."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    cpus = client.run(usable_cpus)
    slots: Counter = Counter()
    for addr, info in workers.items():
        if addr in cpus:
            slots[info["host"], tuple(cpus[addr])] += info["nthreads"]
    return {addr: threads_per_run(slots[info["host"], tuple(cpus[addr])], len(cpus[addr]))
            for addr, info in workers.items() if addr in cpus}


class DaskCluster:
    """``--scheduler ADDRESS``: each run is one task on an existing ``dask.distributed`` cluster.

    The workers must see the notebooks and the grid's ``output_dir`` at the same paths
    (a shared file system), have acl_lab installed and the grid's kernel registered. A
    worker that dies while running a task fails that run with the reason (see
    :func:`run_on_worker`); runs only queued on it go to other workers. Should the
    scheduler give up first (``distributed.scheduler.allowed-failures``), the run is
    recorded failed with ``KilledWorker``.
    """

    slots = None  # no limit here: the cluster queues the tasks

    def __init__(self, address: str, kernel: str, timeout: int | None):
        distributed = _distributed()
        self.distributed, self.kernel, self.timeout = distributed, kernel, timeout
        try:
            self.client = distributed.Client(address, timeout=CONNECT_TIMEOUT, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as exc:
            raise AclLabError(f"Cannot reach the Dask scheduler at {address!r} ({type(exc).__name__}: {exc}). Fix: "
                              "start one (dask scheduler, or a dask-jobqueue cluster) and pass the address it "
                              "prints, e.g. --scheduler tcp://10.0.0.5:8786.") from None
        self.threads = _host_threads(self.client)

    def submit(self, spec: RunSpec):
        attempt = uuid.uuid4().hex
        job = {**job_dict(spec, self.kernel, self.timeout), "attempt_id": attempt,
               "attempt_file": str(spec.output_path.with_name(f".{spec.output_path.name}.attempt"))}
        return self.client.submit(run_on_worker, job, self.threads, key=f"acl-lab-{spec.notebook.stem}-{spec.name}-"
                                  f"{attempt[:8]}", pure=False, retries=0)

    def wait_any(self, futures: list) -> list:
        return list(self.distributed.wait(futures, return_when="FIRST_COMPLETED").done)

    def record(self, future, spec: RunSpec) -> RunRecord:
        try:
            return record_from_dict(future.result())
        except self.distributed.KilledWorker as exc:
            return failed_record(spec, f"KilledWorker: the Dask worker running it died (last on "
                                       f"{exc.last_worker.address}, tried on {exc.allowed_failures + 1} worker(s); "
                                       "its log says why)")
        except Exception as exc:  # noqa: BLE001 - any task error fails this run only
            return failed_record(spec, f"{type(exc).__name__}: {exc}".splitlines()[0])

    def cancel(self, futures: list) -> None:
        """Cancel queued tasks; a run already executing on a worker finishes there (a rerun then skips it)."""
        self.client.cancel(futures)

    def close(self) -> None:
        self.client.close()


def make_runner(jobs: int = 1, scheduler: str | None = None, *, kernel: str, timeout: int | None):
    """The runner for ``--jobs``/``--scheduler`` (see the module docstring); bad values raise an AclLabError."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise AclLabError(f"--jobs {jobs!r} must be a whole number >= 1 (how many runs execute at once). "
                          "Fix: e.g. --jobs 2.")
    if scheduler:
        if jobs != 1:
            raise AclLabError("--jobs and --scheduler were both given. Fix: use --jobs N on this machine, or "
                              "--scheduler ADDRESS for a Dask cluster (its workers set how many runs go at once).")
        return DaskCluster(scheduler, kernel, timeout)
    return InProcess(kernel, timeout) if jobs == 1 else LocalProcesses(jobs, kernel, timeout)
