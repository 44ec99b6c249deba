"""Classroom widgets (ipywidgets) on saved results and on a live small run.

Three widgets, each a ``ipywidgets.VBox`` built from results, never from training
internals:

* :func:`gate_explorer` — a threshold slider over a saved angle trace: the histogram of
  angles with the threshold line, and the fraction of batches ACL-Grad would drop;
* :func:`sensitivity_explorer` — pick lambda (and tau) among saved runs and compare the
  dev metric of CE+SCL and ACL;
* :func:`acl_lab.lab.live.live_run` — sliders for lambda, tau and the gate threshold and a
  *Train* button that runs a short ACL training and shows its metrics and angle/decision
  trace (it trains, so it lives in the lab layer; its display functions are here).

What each widget displays is computed by a pure function (:func:`drop_fraction`,
:func:`gate_summary`, :func:`sensitivity_at`, :func:`run_summary`),
so it can be checked without a browser. The key number is shown in an
``ipywidgets.HTML`` with the CSS class ``acl-result`` (and a class naming the widget,
e.g. ``acl-gate-result``); the box keeps references to its controls as attributes
(``box.slider``, ``box.result``, ``box.image``...), so a test can move a slider and read
the new text. Figures are drawn off-screen (Agg) into an ``ipywidgets.Image``, so they
render the same in Jupyter, Voila and a headless test.
"""
from __future__ import annotations

import html
import io
import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from ..analysis.gradients import dropped_share
from ..analysis.stats import finite, median, sd
from ..config import CONFLICT_DEGREES
from ..errors import AclLabError
from .style import DROPPED_COLOR, KEPT_COLOR, color, conflict_line, label, threshold_line

ANGLE_COLUMNS = ("angle", "angle_acl_embed", "angle_scl")
ANGLE_LABELS = {"angle": "grad(CE) vs grad(auxiliary term), as gated in training",
                "angle_acl_embed": "grad(CE) vs grad(ACL-Embed) (pilot probe)",
                "angle_scl": "grad(CE) vs grad(SCL) (pilot probe)"}
RESULT_CLASS = "acl-result"


# ---------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------

def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _figure(width: float = 6.0, height: float = 3.4):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot(111)


def result_html(css: str):
    import ipywidgets as widgets

    out = widgets.HTML(value="")
    out.add_class(RESULT_CLASS)
    out.add_class(css)
    return out


# ---------------------------------------------------------------------------
# (a) gate explorer
# ---------------------------------------------------------------------------

def angle_columns(history_df: pd.DataFrame) -> list[str]:
    """The angle columns of a history table that hold at least one finite value, best first."""
    return [c for c in ANGLE_COLUMNS if c in history_df.columns and len(finite(history_df[c])) > 0]


def drop_fraction(angles: Iterable[float], threshold: float) -> float:
    """Fraction of batches ACL-Grad drops at ``threshold`` degrees: angle > threshold (NaN if no angles)."""
    a = finite(angles)
    return float((a > threshold).mean()) if len(a) else math.nan


def gate_summary(angles: Iterable[float], threshold: float) -> dict:
    """What the gate explorer shows: counts, drop fraction and the angle distribution's median."""
    a = finite(angles)
    dropped = int((a > threshold).sum())
    return {"threshold": float(threshold), "batches": int(len(a)), "dropped": dropped,
            "kept": int(len(a)) - dropped, "drop_fraction": dropped / len(a) if len(a) else math.nan,
            "median_angle": median(a)}


def gate_text(summary: dict) -> str:
    """The explorer's one-line HTML for a :func:`gate_summary`."""
    if not summary["batches"]:
        return "<b>no angles recorded</b>"
    return (f"threshold <b>{summary['threshold']:.0f}°</b>: ACL-Grad would drop "
            f"<b>{summary['drop_fraction']:.1%}</b> of batches ({summary['dropped']} of {summary['batches']}); "
            f"median angle {summary['median_angle']:.1f}°")


def angle_histogram(angles: Iterable[float], threshold: float, column: str = "angle", title: str | None = None):
    """Histogram of angles with the threshold line; the dropped part (angle > threshold) is shaded."""
    a = finite(angles)
    fig, ax = _figure()
    bins = np.arange(0, 181, 5)
    ax.hist(a[a <= threshold], bins=bins, color=KEPT_COLOR, alpha=0.8, label="kept (angle <= threshold)")
    ax.hist(a[a > threshold], bins=bins, color=DROPPED_COLOR, alpha=0.8, label="dropped (angle > threshold)")
    threshold_line(ax, threshold, horizontal=False, label=f"threshold {threshold:.0f}°", lw=1.2)
    conflict_line(ax, horizontal=False, color="grey", ls=":")
    ax.set_xlim(0, 180)
    ax.set_xlabel(f"angle (degrees): {ANGLE_LABELS.get(column, column)}")
    ax.set_ylabel("batches")
    ax.set_title(title or f"ACL-Grad at {threshold:.0f}°: drops {drop_fraction(a, threshold):.0%} of {len(a)} batches")
    ax.legend(fontsize=7)
    return fig


def gate_explorer(history_df: pd.DataFrame, column: str | None = None, threshold: float = CONFLICT_DEGREES,
                  by: str = "objective"):
    """A threshold slider (0-180 degrees) over a saved angle trace.

    ``history_df`` holds per-step rows with ``angle`` (gated runs) and/or
    ``angle_acl_embed`` / ``angle_scl`` (pilot-study probes), e.g. from
    :func:`acl_lab.analysis.runs.history_frame`. If it has a ``by`` column with several
    values, a drop-down restricts the trace to one of them. Returns the ``VBox``;
    its ``slider``, ``column``, ``group``, ``result`` and ``image`` attributes are the controls.
    """
    import ipywidgets as widgets

    columns = angle_columns(history_df)
    if not columns:
        raise AclLabError("gate_explorer needs a history table with an angle column "
                          f"({', '.join(ANGLE_COLUMNS)}); this one has {sorted(history_df.columns)[:12]}. "
                          "Fix: pass the history of a run trained with ACL-Grad or with probe_angles=True "
                          "(notebook 01).")
    column = column if column in columns else columns[0]
    groups = ["all"] + ([str(g) for g in dict.fromkeys(history_df[by])] if by in history_df.columns else [])
    slider = widgets.FloatSlider(value=float(threshold), min=0.0, max=180.0, step=1.0, description="threshold (°)",
                                 continuous_update=True, readout_format=".0f", style={"description_width": "initial"},
                                 layout=widgets.Layout(width="420px"))
    col = widgets.Dropdown(options=columns, value=column, description="angle")
    group = widgets.Dropdown(options=groups, value="all", description=by)
    result = result_html("acl-gate-result")
    image = widgets.Image(format="png")

    def angles() -> np.ndarray:
        df = history_df if group.value == "all" else history_df[history_df[by].astype(str) == group.value]
        return finite(df[col.value]) if col.value in df else np.array([])

    def refresh(_=None) -> None:
        a = angles()
        result.value = gate_text(gate_summary(a, slider.value))
        image.value = png_bytes(angle_histogram(a, slider.value, col.value))

    for w in (slider, col, group):
        w.observe(refresh, names="value")
    refresh()
    controls = [slider, col] + ([group] if len(groups) > 2 else [])
    box = widgets.VBox([widgets.HBox(controls), result, image])
    box.slider, box.column, box.group, box.result, box.image = slider, col, group, result, image
    box.add_class("acl-gate-explorer")
    return box


# ---------------------------------------------------------------------------
# (b) sensitivity explorer
# ---------------------------------------------------------------------------

SENSITIVITY_OBJECTIVES = ("ce+scl", "acl")


def default_metric(results_df: pd.DataFrame) -> str:
    """The first ``dev_*`` metric column of a results table (``dev_accuracy`` when present)."""
    if "dev_accuracy" in results_df.columns:
        return "dev_accuracy"
    cols = [c for c in results_df.columns if c.startswith("dev_")]
    if not cols:
        raise AclLabError("The results table has no dev_* metric column. Fix: pass results_frame(runs).")
    return cols[0]


def sensitivity_at(results_df: pd.DataFrame, lam: float, temperature: float | None = None,
                   metric: str = "dev_accuracy", objectives: Sequence[str] = SENSITIVITY_OBJECTIVES) -> pd.DataFrame:
    """Mean, sd and seed count of ``metric`` per objective for runs with this lambda (and tau).

    ``results_df`` is :func:`acl_lab.analysis.runs.results_frame` (columns ``objective``,
    ``lam``, ``temperature``, ``seed`` and the metric). Objectives without a matching
    run get NaN and n = 0.
    """
    df = results_df[np.isclose(results_df["lam"].astype(float), float(lam))]
    if temperature is not None:
        df = df[np.isclose(df["temperature"].astype(float), float(temperature))]
    rows = []
    for obj in objectives:
        v = df.loc[df["objective"] == obj, metric].astype(float).dropna()
        rows.append({"objective": obj, "mean": float(v.mean()) if len(v) else math.nan,
                     "sd": sd(v) if len(v) else 0.0, "n": int(len(v))})
    return pd.DataFrame(rows).set_index("objective")


def sensitivity_text(table: pd.DataFrame, lam: float, temperature: float | None, metric: str) -> str:
    """The explorer's HTML line for a :func:`sensitivity_at` table."""
    head = f"λ = <b>{lam:g}</b>" + (f", τ = <b>{temperature:g}</b>" if temperature is not None else "")
    parts = [f"{html.escape(label(o))}: <b>{r['mean']:.4f}</b> ± {r['sd']:.4f} (n={int(r['n'])})" if r["n"] else
             f"{html.escape(label(o))}: no run" for o, r in table.iterrows()]
    text = f"{head} — {html.escape(metric)}: " + " · ".join(parts)
    if len(table) == 2 and table["n"].min() > 0:
        a, b = table.index
        gap = table.loc[b, "mean"] - table.loc[a, "mean"]
        text += f" · {html.escape(label(b))} − {html.escape(label(a))} = <b>{gap:+.4f}</b>"
    return text


def sensitivity_figure(results_df: pd.DataFrame, lam: float, temperature: float | None, metric: str,
                       objectives: Sequence[str] = SENSITIVITY_OBJECTIVES):
    """Metric against lambda for each objective (mean ± sd over seeds), the selected lambda marked."""
    df = results_df[results_df["objective"].isin(objectives)]
    if temperature is not None:
        df = df[np.isclose(df["temperature"].astype(float), float(temperature))]
    fig, ax = _figure()
    for obj in objectives:
        g = df[df["objective"] == obj].groupby("lam")[metric]
        if not len(g):
            continue
        mean, spread = g.mean(), g.apply(sd)
        ax.errorbar(mean.index, mean.values, yerr=spread.values, marker="o", capsize=4, color=color(obj),
                    label=label(obj))
    ax.axvline(lam, color="k", ls="--", lw=1, label=f"selected λ = {lam:g}")
    lams = sorted(df["lam"].unique())
    if lams and min(lams) > 0 and max(lams) / min(lams) > 4:
        ax.set_xscale("log")
    ax.set_xlabel("lambda")
    ax.set_ylabel(f"{metric} (mean ± sd over seeds)")
    ax.set_title("CE+SCL against ACL over lambda" + (f" (τ = {temperature:g})" if temperature is not None else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def sensitivity_explorer(results_df: pd.DataFrame, metric: str | None = None,
                         objectives: Sequence[str] = SENSITIVITY_OBJECTIVES):
    """Pick lambda and tau among saved runs; see the dev metric of CE+SCL against ACL.

    ``results_df`` is :func:`acl_lab.analysis.runs.results_frame` over saved runs. The
    box's ``lam``, ``tau``, ``result`` and ``image`` attributes are its controls.
    """
    import ipywidgets as widgets

    metric = metric or default_metric(results_df)
    df = results_df[results_df["objective"].isin(objectives)]
    if df.empty:
        raise AclLabError(f"sensitivity_explorer found no runs of {list(objectives)} in the results table. Fix: train "
                          "them first (notebooks 02 or 06), then pass results_frame(load_runs(OUT)).")
    lams = sorted(float(x) for x in df["lam"].unique())
    taus = sorted(float(x) for x in df["temperature"].unique())
    lam = widgets.SelectionSlider(options=[(f"{x:g}", x) for x in lams], value=lams[0], description="lambda",
                                  continuous_update=True)
    tau = widgets.Dropdown(options=[(f"{x:g}", x) for x in taus], value=taus[0], description="tau")
    result = result_html("acl-sensitivity-result")
    image = widgets.Image(format="png")

    def refresh(_=None) -> None:
        table = sensitivity_at(df, lam.value, tau.value, metric, objectives)
        result.value = sensitivity_text(table, lam.value, tau.value, metric)
        image.value = png_bytes(sensitivity_figure(df, lam.value, tau.value, metric, objectives))

    lam.observe(refresh, names="value")
    tau.observe(refresh, names="value")
    refresh()
    box = widgets.VBox([widgets.HBox([lam, tau]), result, image])
    box.lam, box.tau, box.result, box.image = lam, tau, result, image
    box.add_class("acl-sensitivity-explorer")
    return box


# ---------------------------------------------------------------------------
# (c) a live run's summary and trace (the Train widget itself is acl_lab.lab.live.live_run)
# ---------------------------------------------------------------------------

def run_summary(result) -> dict:
    """What the live run shows: dev metric, ACL-Grad drop rate, median angle, steps and seconds."""
    from ..tasks import get_task

    m = result.metrics
    main = get_task(result.config.task).main_metric
    angles = [r["angle"] for r in result.history if r.get("angle") is not None]
    kept = pd.Series([r["kept"] for r in result.history if "kept" in r], dtype=float)
    return {"objective": result.config.objective, "lam": result.config.lam, "temperature": result.config.temperature,
            "threshold": result.config.threshold, "metric": main, "dev": float(m["dev"][main]),
            "test": float(m["test"][main]) if "test" in m else math.nan,
            "drop_rate": float(dropped_share(kept).mean()) if len(kept) else math.nan,
            "median_angle": median(angles),
            "steps": int(m["steps"]), "train_seconds": float(m["train_seconds"]), "run": str(result.output_dir)}


def summary_text(s: dict) -> str:
    """The live run's HTML line for a :func:`run_summary`."""
    drop = "n/a" if math.isnan(s["drop_rate"]) else f"{s['drop_rate']:.0%}"
    angle = "n/a" if math.isnan(s["median_angle"]) else f"{s['median_angle']:.1f}°"
    test = "" if math.isnan(s["test"]) else f", test {s['metric']} {s['test']:.4f}"
    return (f"λ={s['lam']:g}, τ={s['temperature']:g}, threshold={s['threshold']:.0f}°: "
            f"dev {html.escape(s['metric'])} <b>{s['dev']:.4f}</b>{test}; ACL-Grad dropped <b>{drop}</b> of "
            f"{s['steps']} batches (median angle {angle}); {s['train_seconds']:.1f} s of training")


def trace_figure(result):
    """Angle per step with the gate's decision (kept / dropped) and the threshold line."""
    from matplotlib.ticker import MaxNLocator

    h = pd.DataFrame(result.history)
    fig, ax = _figure(6.0, 3.2)
    if "angle" in h and h["angle"].notna().any():
        kept = dropped_share(h["kept"]) == 0 if "kept" in h else pd.Series(True, index=h.index)
        ax.plot(h["step"], h["angle"], color="grey", lw=0.8)
        ax.scatter(h.loc[kept, "step"], h.loc[kept, "angle"], color=KEPT_COLOR, s=18, label="kept", zorder=3)
        ax.scatter(h.loc[~kept, "step"], h.loc[~kept, "angle"], color=DROPPED_COLOR, marker="x", s=24,
                   label="dropped", zorder=3)
    threshold_line(ax, result.config.threshold, label=f"threshold {result.config.threshold:.0f}°")
    ax.set_ylim(0, 180)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("angle grad(CE) vs grad(ACL) (°)")
    ax.set_title(f"Live run ({result.config.model}, {result.config.objective}): the ACL-Grad decision per batch")
    ax.legend(fontsize=7, loc="upper right")
    return fig
