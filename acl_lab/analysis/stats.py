"""The one statistics convention of the kit, used by every table, figure, widget and notebook.

Over seeds (or any small sample of runs):

* the **mean**;
* the **sd** is the sample standard deviation (``ddof=1``), and 0 for a single value;
* the **median** is NumPy's (the mean of the two middle values for an even count),
  also in the trainer's ``metrics.json``, so a saved run and a live widget agree;
* the **95% interval** of the mean is Student's t-interval (``scipy.stats``), NaN for
  fewer than two values.

Non-finite values (NaN, inf: e.g. a probe that overflowed) are left out everywhere.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

CONFIDENCE = 0.95


def finite(values: Iterable) -> np.ndarray:
    """``values`` as a float array without NaN/inf (non-numbers such as None count as NaN)."""
    arr = pd.to_numeric(pd.Series(list(values), dtype="object"), errors="coerce").to_numpy(dtype=float)
    return arr[np.isfinite(arr)]


def sd(values: Iterable) -> float:
    """Sample standard deviation (ddof=1); 0.0 for one value, NaN for none."""
    a = finite(values)
    if len(a) == 0:
        return math.nan
    return float(a.std(ddof=1)) if len(a) > 1 else 0.0


def median(values: Iterable) -> float:
    """NumPy's median of the finite values (NaN for none)."""
    a = finite(values)
    return float(np.median(a)) if len(a) else math.nan


def t_interval(values: Iterable, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student's t confidence interval of the mean (``scipy.stats.t``); (NaN, NaN) below two values."""
    from scipy import stats

    a = finite(values)
    if len(a) < 2:
        return math.nan, math.nan
    sem = float(a.std(ddof=1)) / math.sqrt(len(a))
    if sem == 0.0:
        m = float(a.mean())
        return m, m
    low, high = stats.t.interval(confidence, len(a) - 1, loc=float(a.mean()), scale=sem)
    return float(low), float(high)


def summarize(values: Iterable, confidence: float = CONFIDENCE) -> dict[str, float]:
    """``n``, ``mean``, ``sd``, ``median`` and the t-interval (``ci_low``, ``ci_high``) of the finite values."""
    a = finite(values)
    low, high = t_interval(a, confidence)
    return {"n": int(len(a)), "mean": float(a.mean()) if len(a) else math.nan, "sd": sd(a), "median": median(a),
            "ci_low": low, "ci_high": high}


def group_summary(df: pd.DataFrame, by: str | Sequence[str], value: str, sort: bool = False) -> pd.DataFrame:
    """:func:`summarize` of ``value`` per group of ``by`` (groups in order of first appearance unless ``sort``)."""
    keys = [by] if isinstance(by, str) else list(by)
    rows = [{**dict(zip(keys, key if isinstance(key, tuple) else (key,))), **summarize(g[value])}
            for key, g in df.groupby(keys, sort=sort)]
    return pd.DataFrame(rows, columns=[*keys, "n", "mean", "sd", "median", "ci_low", "ci_high"])


def mean_sd_text(values: Iterable, digits: int = 4) -> str:
    """``"mean ± sd"`` of the finite values, e.g. ``"0.8123 ± 0.0040"`` (``"-"`` when there are none, and
    ``"0.8123 (n=1)"`` for a single value, whose spread is unknown rather than zero)."""
    a = finite(values)
    if not len(a):
        return "-"
    return pm_text(float(a.mean()), sd(a), digits, n=len(a))


def pm_text(mean: float, spread: float, digits: int = 4, n: int | None = None) -> str:
    """``"mean ± spread"`` with ``digits`` decimals; ``"mean (n=1)"`` when ``n`` says the mean
    rests on one value, whose spread is unknown rather than zero."""
    if n == 1:
        return f"{mean:.{digits}f} (n=1)"
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"
