"""The live-run widget: sliders for lambda, tau and the gate threshold, and a *Train* button (notebook 07).

It composes training (:func:`acl_lab.lab.experiments.run_many`) with the pure display
functions of :mod:`acl_lab.viz.widgets`, which is why it lives in the lab layer and not
in ``viz`` (``viz`` never trains).
"""
from __future__ import annotations

import html
from pathlib import Path

from ..errors import AclLabError
from ..viz.widgets import png_bytes, result_html, run_summary, summary_text, trace_figure


def live_config(base_config, lam: float, temperature: float, threshold: float, objective: str = "acl",
                max_steps: int | None = None):
    """The config of a live run: ``base_config`` (a preset's size) with the sliders' values on top."""
    # rounded like the sliders show them, so the same settings map to the same (reusable) run
    changes = {"objective": objective, "lam": float(f"{float(lam):.3g}"), "temperature": round(float(temperature), 3),
               "threshold": round(float(threshold), 1)}
    if max_steps is not None:
        changes["max_steps"] = int(max_steps)
    return base_config.replace(**changes).validate()


def train_live(base_config, root: str | Path, lam: float, temperature: float, threshold: float,
               objective: str = "acl", max_steps: int | None = None, progress: bool = False):
    """Train (or reuse, if these exact settings ran before) a live run under ``root/runs``; return the result."""
    from .experiments import run_many

    cfg = live_config(base_config, lam, temperature, threshold, objective, max_steps)
    return run_many([cfg], root, progress=progress)[0]


def live_run(base_config, root: str | Path, lam: float | None = None, temperature: float | None = None,
             threshold: float | None = None, max_steps: int | None = None):
    """Sliders for lambda, tau and the threshold, and a *Train* button running a short ACL training.

    The run has ``base_config``'s size (a preset: smoke = the tiny model for a few steps),
    optionally capped at ``max_steps``; settings that ran before are read back, not
    retrained. The box's ``lam``, ``tau``, ``threshold``, ``button``, ``result`` and
    ``image`` attributes are its controls; ``box.last`` holds the last summary dict.
    """
    import ipywidgets as widgets

    style = {"description_width": "initial"}
    lam_w = widgets.FloatLogSlider(value=lam if lam is not None else base_config.lam, base=10, min=-3, max=1, step=0.1,
                                   description="lambda", readout_format=".3g", style=style)
    tau_w = widgets.FloatSlider(value=temperature if temperature is not None else base_config.temperature, min=0.02,
                                max=1.0, step=0.01, description="tau", readout_format=".2f", style=style)
    thr_w = widgets.FloatSlider(value=threshold if threshold is not None else base_config.threshold, min=0.0,
                                max=180.0, step=1.0, description="threshold (°)", readout_format=".0f", style=style)
    button = widgets.Button(description="Train", button_style="primary", icon="play")
    button.add_class("acl-train-button")
    steps = max_steps or base_config.max_steps
    info = widgets.HTML(value=f"<i>{base_config.model}, {steps or 'all'} steps, batch {base_config.batch_size}; "
                              f"runs go to {html.escape(str(Path(root) / 'runs'))}</i>")
    result = result_html("acl-live-result")
    result.value = "press <b>Train</b>"
    image = widgets.Image(format="png")
    box = widgets.VBox([widgets.HBox([lam_w, tau_w, thr_w]), widgets.HBox([button, info]), result, image])

    def on_click(_=None) -> None:
        button.disabled = True
        result.value = (f"training λ={lam_w.value:.3g}, τ={tau_w.value:.2f}, threshold={thr_w.value:.0f}° ...")
        try:
            res = train_live(base_config, root, lam_w.value, tau_w.value, thr_w.value, max_steps=max_steps)
            box.last = run_summary(res)
            result.value = summary_text(box.last)
            image.value = png_bytes(trace_figure(res))
        except AclLabError as exc:
            result.value = f"<b>error</b>: {html.escape(str(exc))}"
        finally:
            button.disabled = False

    button.on_click(on_click)
    box.lam, box.tau, box.threshold, box.button, box.result, box.image = lam_w, tau_w, thr_w, button, result, image
    box.last = None
    box.add_class("acl-live-run")
    return box
