"""Sensitivity to lambda: the dev metric of CE+SCL and ACL over a lambda (x tau) grid of saved runs.

Notebook 06 trains the grid through the batch runner into one shared run cache; the
numbers here come from those runs themselves (:func:`acl_lab.analysis.runs.results_frame`),
so nothing travels through notebook metrics and back.
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from .exits import need_columns
from .stats import group_summary


def sensitivity_frame(runs: pd.DataFrame, objectives: Sequence[str], metric: str = "accuracy",
                      split: str = "dev") -> pd.DataFrame:
    """Long table, one row per run: objective, lam, temperature, seed, value (``split`` ``metric``), run.

    ``runs`` is :func:`acl_lab.analysis.runs.results_frame` over the grid's runs.
    """
    column = f"{split}_{metric}"
    need_columns(runs, ("objective", "lam", "temperature", "seed", column), "sensitivity_frame")
    df = runs[runs["objective"].isin(objectives)]
    out = pd.DataFrame({"objective": df["objective"], "lam": df["lam"].astype(float),
                        "temperature": df["temperature"].astype(float), "seed": df["seed"],
                        "value": df[column].astype(float), "run": df.get("run", "")})
    order = {o: i for i, o in enumerate(objectives)}
    return out.sort_values(["objective", "temperature", "lam", "seed"],
                           key=lambda c: c.map(order) if c.name == "objective" else c, ignore_index=True)


def sensitivity_summary(df: pd.DataFrame, value: str = "value", x: str = "lam", by: str = "objective",
                        extra: Sequence[str] = ()) -> pd.DataFrame:
    """Mean, sd and count of ``value`` per (``by``, *extra*, ``x``), from one row per run and seed."""
    keys = [by, *extra, x]
    need_columns(df, (*keys, value), "sensitivity_summary")
    return group_summary(df, keys, value, sort=True)[[*keys, "mean", "sd", "n"]]


def sensitivity_spread(summary: pd.DataFrame, x: str = "lam", by: str = "objective") -> pd.DataFrame:
    """Per objective: the range (max - min) of the mean metric over the lambdas, and the mean sd over seeds.

    A smaller range means the objective is less sensitive to the choice of lambda.
    """
    g = summary.groupby(by, sort=False)
    # a cell from one seed has no spread (its sd reads 0.0): leave it out of the mean sd
    spread = summary["sd"].where(summary["n"] > 1).groupby(summary[by], sort=False).mean()
    return pd.DataFrame({"range_over_lambda": g["mean"].max() - g["mean"].min(), "best": g["mean"].max(),
                         "worst": g["mean"].min(), "mean_sd_over_seeds": spread, "lambdas": g[x].nunique()})
