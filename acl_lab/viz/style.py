"""The kit's look, in one place: colours and names of objectives and probes, line styles, reference lines.

An objective has the same colour and name in every notebook, figure and widget. Reference
lines take their value from the data (a run's ``threshold`` from its config), never from a
copy of the default.
"""
from __future__ import annotations

from ..config import CONFLICT_DEGREES

OBJECTIVE_COLORS = {"ce": "#4c72b0", "ce+scl": "#dd8452", "acl-embed": "#55a868", "acl": "#c44e52",
                    "me-ce": "#4c72b0", "me-acl": "#55a868", "me-acl-cl": "#c44e52"}
PROBE_COLORS = {"CE vs SCL": "#dd8452", "CE vs ACL-Embed": "#55a868"}
OBJECTIVE_LABELS = {"ce": "CE", "ce+scl": "CE+SCL", "acl-embed": "ACL-Embed", "acl": "ACL",
                    "me-ce": "multi-exit CE", "me-acl": "multi-exit ACL-Embed", "me-acl-cl": "multi-exit ACL-CL"}
CRITERION_STYLES = {"entropy": "-", "maxprob": "--", "patience": ":"}
PHASE_LABELS = {"early": "first third", "middle": "middle third", "late": "last third"}
KEPT_COLOR, DROPPED_COLOR = "tab:blue", "tab:red"


def color(name: str, i: int = 0) -> str:
    """The colour of an objective or probe (the i-th default colour for an unknown name)."""
    return OBJECTIVE_COLORS.get(name) or PROBE_COLORS.get(name) or f"C{i % 10}"


def label(objective: str) -> str:
    """A readable name for an objective ("me-acl-cl" -> "multi-exit ACL-CL")."""
    return OBJECTIVE_LABELS.get(objective, objective)


def threshold_line(ax, value: float, horizontal: bool = True, label: str | None = None, **style):
    """A dashed line at ``value`` degrees: the ACL-Grad threshold of the run(s) shown."""
    kw = {"color": "k", "ls": "--", "lw": 1, **style}
    text = label if label is not None else f"{value:g}° (ACL-Grad threshold)"
    return (ax.axhline if horizontal else ax.axvline)(value, label=text, **kw)


def conflict_line(ax, horizontal: bool = True, **style):
    """The 90-degree line of the pilot study: above it, the two gradients point apart (a conflict)."""
    return threshold_line(ax, CONFLICT_DEGREES, horizontal,
                          label=f"{CONFLICT_DEGREES:g}° (orthogonal gradients: conflict above)", **style)


def thresholds_of(frame) -> list[float]:
    """The distinct gate thresholds of the runs in a history/results table (its ``threshold`` column)."""
    if "threshold" not in getattr(frame, "columns", ()):
        return [CONFLICT_DEGREES]
    values = sorted({float(v) for v in frame["threshold"].dropna()})
    return values or [CONFLICT_DEGREES]
