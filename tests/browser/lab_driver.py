"""Helpers of the browser tier: a throw-away JupyterLab server and a headless Chromium driving it.

* :func:`missing_prerequisites` says what is absent (Chromium, the ``playwright`` package,
  JupyterLab) and how to install it, so the tier is skipped with that message;
* :func:`prepare_notebooks` writes papermill-prepared copies of notebooks (parameters
  injected, nothing executed) into the folder the server serves, on the ``acl-lab`` kernel;
* :class:`LabServer` starts ``jupyter lab`` on 127.0.0.1, a free port and a random token,
  with every Jupyter state folder in a temporary directory, and stops it again (the
  server's REST shutdown, then its process group, then any kernel left behind);
* :func:`open_notebook`, :func:`run_all` and :func:`notebook_state` drive a notebook through
  ``window.jupyterapp`` (``--LabApp.expose_app_in_browser``) and read back what ran.

Playwright is used only through its sync API with the system Chromium
(``executable_path``); ``playwright install`` is never needed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
CHROMIUM = os.environ.get("ACL_LAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SERVER_START_TIMEOUT = float(os.environ.get("ACL_LAB_BROWSER_SERVER_TIMEOUT", 240))
NOTEBOOK_TIMEOUT = float(os.environ.get("ACL_LAB_BROWSER_TIMEOUT", 600))  # seconds per notebook's run-all
KERNEL_NAME = "acl-lab"

# JupyterLab user settings for a quiet, deterministic page: no news / update toasts, every cell in the DOM
USER_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def missing_prerequisites() -> str | None:
    """None when the tier can run, else why not and how to install what is missing."""
    missing = []
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"Chromium ({CHROMIUM}): apt-get install -y chromium")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package: .venv/bin/pip install playwright (or pip install -e '.[dev]'); "
                       "never 'playwright install', the system Chromium is used")
    if importlib.util.find_spec("jupyterlab") is None:
        missing.append("JupyterLab: .venv/bin/pip install -e '.[lab]'")
    if not missing:
        return None
    return "browser tier skipped, missing " + "; ".join(missing)


def kernel_display_name(name: str = KERNEL_NAME) -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    return KernelSpecManager().get_kernel_spec(name).display_name


def prepare_notebooks(stems: list[str], root: Path, output_dir: Path, preset: str = "smoke") -> dict[str, Path]:
    """Papermill-prepared copies (parameters injected, not executed) of notebooks/<stem>.ipynb in ``root``.

    The copies run on the ``acl-lab`` kernel (papermill's ``kernel_name`` does not touch the
    metadata when it only prepares, so the kernelspec is written here) and start clean:
    no outputs, no execution counts.
    """
    import nbformat
    import papermill as pm

    spec = {"name": KERNEL_NAME, "display_name": kernel_display_name(), "language": "python"}
    copies = {}
    for stem in stems:
        dest = root / f"{stem}.ipynb"
        pm.execute_notebook(str(NOTEBOOKS / f"{stem}.ipynb"), str(dest), prepare_only=True, kernel_name=KERNEL_NAME,
                            parameters={"PRESET": preset, "OUTPUT_DIR": str(output_dir)}, progress_bar=False)
        nb = nbformat.read(dest, as_version=4)
        nb.metadata["kernelspec"] = spec
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, dest)
        copies[stem] = dest
    return copies


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """``jupyter lab`` serving ``root`` on 127.0.0.1 with a token; state folders under ``state``."""

    def __init__(self, root: Path, state: Path):
        self.root, self.state = Path(root), Path(state)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.state / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None
        self._kernel_pids: set[int] = set()

    def env(self) -> dict:
        env = dict(os.environ)
        for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("JUPYTER_DATA_DIR", "data"), ("JUPYTERLAB_SETTINGS_DIR", "lab-settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces"), ("IPYTHONDIR", "ipython")):
            path = self.state / sub
            path.mkdir(parents=True, exist_ok=True)
            env[var] = str(path)
        env.pop("JUPYTER_TOKEN", None)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def write_settings(self, env: dict) -> None:
        settings = Path(env["JUPYTERLAB_SETTINGS_DIR"])
        for rel, values in USER_SETTINGS.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values, indent=2))

    def command(self) -> list[str]:
        return [sys.executable, "-m", "jupyterlab", "--no-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                "--ServerApp.allow_root=True", "--ServerApp.open_browser=False",
                "--ServerApp.terminals_enabled=False",
                "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]

    def request(self, path: str, method: str = "GET", timeout: float = 10.0):
        req = urllib.request.Request(self.url + path, method=method, data=b"" if method == "POST" else None,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return json.loads(body) if body else None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self) -> "LabServer":
        env = self.env()
        self.write_settings(env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), cwd=self.root, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.request("/api/status", timeout=5)
                return self
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"jupyter lab did not answer within {SERVER_START_TIMEOUT:.0f} s:\n{self.log_tail()}")

    def lab_url(self, notebook: str) -> str:
        """The notebook in a fresh workspace (``reset``), token in the query."""
        return f"{self.url}/lab/tree/{notebook}?token={self.token}&reset"

    def _remember_kernels(self) -> None:
        """The pids of the server's children (kernels live in their own sessions, not its process group)."""
        if self.proc is None:
            return
        try:
            import psutil

            self._kernel_pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except Exception:  # noqa: BLE001 - psutil missing or the server already gone
            pass

    def stop(self) -> None:
        """REST shutdown (kernels first), then SIGTERM / SIGKILL to the process group, then leftover kernels."""
        if self.proc is None:
            return
        self._remember_kernels()
        if self.proc.poll() is None:
            try:
                self.request("/api/shutdown", method="POST", timeout=10)
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - fall back to signals
                pass
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything still in the group (the leader has exited)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self._kernel_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()
        self.proc = None


# ---------------------------------------------------------------------------
# driving a notebook through window.jupyterapp
# ---------------------------------------------------------------------------

# What ran: code cells, how many have an execution count, error outputs, the kernel and its status.
STATE_JS = """
(path) => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.context || panel.context.path !== path || !panel.content || !panel.content.model) {
    return null;
  }
  const cells = panel.content.model.cells;
  let code = 0, done = 0, running = 0;
  const errors = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    code++;
    if (c.executionCount !== null && c.executionCount !== undefined) done++;
    if (c.executionState === 'running') running++;
    for (const o of c.outputs.toJSON()) {
      if (o.output_type === 'error') {
        errors.push({cell: i, ename: o.ename, evalue: o.evalue, traceback: (o.traceback || []).join('\\n')});
      }
    }
  }
  const session = panel.sessionContext.session;
  const kernel = session && session.kernel;
  return {code, done, running, errors,
          kernel: kernel ? kernel.name : null, status: kernel ? kernel.status : null,
          dirty: panel.context.model.dirty};
}
"""


def notebook_state(page, path: str) -> dict | None:
    return page.evaluate(STATE_JS, path)


def open_notebook(page, lab: LabServer, path: str, display_name: str, timeout_s: float = 240) -> dict:
    """Open the notebook in a fresh workspace and wait for its kernel: the status bar reads '<kernel> | Idle'."""
    page.goto(lab.lab_url(path), wait_until="domcontentloaded", timeout=timeout_s * 1000)
    page.wait_for_function("() => !!window.jupyterapp", timeout=timeout_s * 1000, polling=500)
    page.wait_for_function(
        """([path, label]) => {
             const panel = window.jupyterapp.shell.currentWidget;
             if (!panel || !panel.context || panel.context.path !== path) return false;
             const bar = document.querySelector('#jp-main-statusbar');
             return !!bar && bar.innerText.includes(label + ' | Idle');
           }""",
        arg=[path, display_name], timeout=timeout_s * 1000, polling=500)
    return notebook_state(page, path)


def run_all(page, path: str, timeout_s: float = NOTEBOOK_TIMEOUT) -> tuple[dict, float]:
    """Run all cells (the Run menu's command) and poll until every code cell has an execution count
    and the kernel is idle (twice in a row), or an error output appears. Returns (state, seconds)."""
    t0 = time.monotonic()
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    stable, state = 0, None
    while time.monotonic() - t0 < timeout_s:
        state = notebook_state(page, path)
        if state and state["errors"] and state["status"] == "idle":
            return state, time.monotonic() - t0
        finished = (state and state["done"] == state["code"] and state["running"] == 0
                    and state["status"] == "idle")
        stable = stable + 1 if finished else 0
        if stable >= 2:
            return state, time.monotonic() - t0
        time.sleep(1.0)
    raise TimeoutError(f"{path}: run-all did not finish within {timeout_s:.0f} s; last state {state}")


def wait_settled(page, path: str, selector: str, timeout_s: float = 120, quiet_s: float = 2.0) -> None:
    """Wait until the kernel is idle and the first ``selector`` <img> has loaded and kept its src for ``quiet_s``:
    a widget's figure that follows a moved control has arrived (the text comes first, the image after)."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        state = notebook_state(page, path)
        img = page.evaluate("sel => { const i = document.querySelector(sel);"
                            " return i ? [i.getAttribute('src'), i.complete && i.naturalWidth > 0] : null; }", selector)
        ready = bool(state and state["status"] == "idle" and img and img[1])
        if not ready or img[0] != last:
            last, since = (img[0] if img else None), time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.25)
    raise TimeoutError(f"{path}: {selector} did not settle within {timeout_s:.0f} s")


def error_report(state: dict) -> str:
    import re

    ansi = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
    return "\n\n".join(f"cell {e['cell']}: {e['ename']}: {e['evalue']}\n{ansi.sub('', e['traceback'])[-2500:]}"
                       for e in state["errors"])


def visible_tracebacks(page) -> list[str]:
    """Text of stderr-typed outputs (where JupyterLab renders errors) that show a Python traceback.
    Warnings and progress bars also go to stderr; they are not errors and are not returned."""
    texts = page.eval_on_selector_all(
        '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]', "els => els.map(e => e.innerText)")
    return [t for t in texts if "Traceback" in t]


def rendered_images(page, selector: str = ".jp-RenderedImage img") -> list[dict]:
    """Every matching <img>: whether it finished loading and its natural size."""
    return page.eval_on_selector_all(
        selector, "els => els.map(e => ({complete: e.complete, w: e.naturalWidth, h: e.naturalHeight}))")


def figure_cells(path: Path) -> int:
    """How many code cells of a notebook show a matplotlib figure (plt.show() or display(fig))."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" and ("plt.show()" in c.source or "display(fig)" in c.source))


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def clean_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path
