"""Browser tier: the tour (00) and the classroom widgets (07) opened in JupyterLab in headless
Chromium, in the smoke preset, run with "Run All", and checked on what a user sees: no error
output, the figures rendered as images, the widgets rendered and answering a moved slider.

Needs the system Chromium (``apt-get install -y chromium``) and the ``playwright`` package
(``pip install playwright``; never ``playwright install``); skipped with that message where
either is absent. Screenshots go to ``outputs/browser/`` (git-ignored); their paths are printed
(``pytest -s``). Timeouts: ``ACL_LAB_BROWSER_TIMEOUT`` (seconds per notebook, default 600).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import lab_driver as L

pytestmark = pytest.mark.browser

NOTEBOOK_STEMS = ["00_tour", "07_classroom_widgets"]
SHOTS = L.REPO / "outputs" / "browser"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving papermill-prepared smoke copies of the notebooks; stopped afterwards."""
    why = L.missing_prerequisites()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("browser")
    root, state = base / "root", base / "state"
    root.mkdir()
    copies = L.prepare_notebooks(NOTEBOOK_STEMS, root, output_dir=root / "output")
    server = L.LabServer(root, state)
    t0 = time.monotonic()
    server.start()
    print(f"\n[browser] jupyter lab on {server.url} serving {root} (up in {time.monotonic() - t0:.1f} s)")
    server.copies = copies
    server.display_name = L.kernel_display_name()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        chromium = L.launch_chromium(pw)
    except Exception:
        pw.stop()
        raise
    try:
        yield chromium
    finally:
        chromium.close()
        pw.stop()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(120_000)
    try:
        yield pg
    finally:
        context.close()


@pytest.fixture(scope="module")
def shots() -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS


def _screenshot(page, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path))
    print(f"[browser] screenshot {path}")
    return path


def _open_and_run(page, lab, stem: str, shots: Path) -> dict:
    """Open the prepared copy, check its kernel, Run All, and check the run shows no error."""
    path = f"{stem}.ipynb"
    t0 = time.monotonic()
    state = L.open_notebook(page, lab, path, lab.display_name)
    assert state is not None, f"{path} did not open as the current notebook"
    assert state["kernel"] == L.KERNEL_NAME, f"{path} runs on kernel {state['kernel']!r}, not {L.KERNEL_NAME!r}"
    opened = time.monotonic() - t0
    state, ran = L.run_all(page, path)
    print(f"[browser] {path}: opened in {opened:.1f} s, Run All took {ran:.1f} s "
          f"({state['done']}/{state['code']} code cells ran)")
    assert not state["errors"], f"{path} shows an error output:\n{L.error_report(state)}"
    assert state["done"] == state["code"]
    assert not L.visible_tracebacks(page), f"{path} shows a traceback:\n{L.visible_tracebacks(page)[0][-2000:]}"
    return state


def _check_figures(page, lab, stem: str) -> int:
    """At least one rendered, loaded <img> per figure cell (plt.show() / display(fig))."""
    expected = L.figure_cells(lab.copies[stem])
    assert expected > 0
    page.wait_for_function("n => document.querySelectorAll('.jp-RenderedImage img').length >= n", arg=expected,
                           timeout=60_000)
    page.wait_for_function("() => [...document.querySelectorAll('.jp-RenderedImage img')]"
                           ".every(i => i.complete && i.naturalWidth > 0)", timeout=60_000)
    images = L.rendered_images(page)
    assert len(images) >= expected, f"{stem}: {len(images)} figures rendered, {expected} figure cells"
    assert all(i["w"] >= 200 and i["h"] >= 100 for i in images), images
    return len(images)


def _fail_shot(page, shots, stem):
    try:
        _screenshot(page, shots, f"{stem}-failure")
    except Exception:  # noqa: BLE001 - the original failure matters more
        pass


def test_tour_runs_in_jupyterlab(lab, page, shots):
    stem = "00_tour"
    try:
        _open_and_run(page, lab, stem, shots)
        n = _check_figures(page, lab, stem)
        tables = page.locator(".jp-OutputArea-output table").count()
        assert tables >= 2, f"expected the data tables (label counts, examples), found {tables} tables"
        page.locator(".jp-RenderedImage img").last.scroll_into_view_if_needed()
        print(f"[browser] {stem}: {n} figures, {tables} tables rendered")
        _screenshot(page, shots, stem)
    except BaseException:
        _fail_shot(page, shots, stem)
        raise


def _text(page, selector: str) -> str:
    return page.locator(selector).first.inner_text()


def _wait_text(page, selector: str, js_predicate: str, timeout_ms: int = 120_000) -> str:
    """Wait until the first ``selector`` element's innerText satisfies ``js_predicate`` (a JS expression in t)."""
    page.wait_for_function(
        f"""(sel) => {{ const e = document.querySelector(sel); if (!e) return false;
                        const t = e.innerText; return {js_predicate}; }}""", arg=selector, timeout=timeout_ms,
        polling=250)
    return _text(page, selector)


def _threshold_and_drop(text: str) -> tuple[int, float]:
    m = re.search(r"threshold\s+(\d+)°.*?drop\s+([\d.]+)%", text, re.S)
    assert m, f"unexpected gate explorer text: {text!r}"
    return int(m.group(1)), float(m.group(2))


def test_classroom_widgets_run_and_answer_in_jupyterlab(lab, page, shots):
    stem = "07_classroom_widgets"
    try:
        _open_and_run(page, lab, stem, shots)
        n = _check_figures(page, lab, stem)

        # the three widgets are rendered with their controls
        for sel in (".acl-gate-explorer", ".acl-sensitivity-explorer", ".acl-live-run"):
            page.wait_for_selector(sel, state="visible", timeout=60_000)
        assert page.locator(".jupyter-widgets").count() > 5
        assert page.locator(".acl-gate-explorer .widget-slider .noUi-handle").count() == 1
        assert page.locator(".acl-live-run .widget-slider").count() == 3
        assert page.locator(".acl-train-button").count() == 1
        page.wait_for_function("() => { const i = document.querySelector('.acl-gate-explorer img');"
                               " return !!i && i.complete && i.naturalWidth > 0; }", timeout=60_000)

        # move the gate explorer's threshold slider with the keyboard; the text and histogram follow
        result = ".acl-gate-explorer .acl-gate-result"
        before = _wait_text(page, result, "t.includes('threshold')")
        thr0, drop0 = _threshold_and_drop(before)
        img0 = page.locator(".acl-gate-explorer img").first.get_attribute("src")
        handle = page.locator(".acl-gate-explorer .noUi-handle").first
        handle.scroll_into_view_if_needed()
        presses = 20
        for _ in range(presses):
            handle.press("ArrowLeft")
        target = thr0 - presses
        after = _wait_text(page, result, f"/threshold\\s+{target}°/.test(t)")
        thr1, drop1 = _threshold_and_drop(after)
        assert after != before and thr1 == target
        assert drop1 >= drop0, f"a lower threshold cannot drop fewer batches: {before!r} -> {after!r}"
        L.wait_settled(page, f"{stem}.ipynb", ".acl-gate-explorer img")
        assert page.locator(".acl-gate-explorer img").first.get_attribute("src") != img0, "histogram not redrawn"
        print(f"[browser] {stem}: {n} figures; gate explorer {before!r} -> {after!r}")
        page.locator(".acl-gate-explorer").scroll_into_view_if_needed()
        _screenshot(page, shots, stem)

        # the live run: press Train (these settings already ran in the notebook, so they are read back)
        live = ".acl-live-run .acl-live-result"
        assert "Train" in _text(page, live)
        page.locator(".acl-train-button").click()
        summary = _wait_text(page, live, "t.includes('dev ') && t.includes('batches')", timeout_ms=300_000)
        L.wait_settled(page, f"{stem}.ipynb", ".acl-live-run img")
        print(f"[browser] {stem}: live run {summary!r}")
        page.locator(".acl-live-run").scroll_into_view_if_needed()
        _screenshot(page, shots, f"{stem}-live")
    except BaseException:
        _fail_shot(page, shots, stem)
        raise
