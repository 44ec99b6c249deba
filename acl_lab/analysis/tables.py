"""Result tables as text: ``mean ± sd`` cells over seeds and GitHub markdown, for notebooks, batches and reports."""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from .stats import mean_sd_text


def text(value: Any) -> str:
    """A table value as short text: floats to 4 significant digits, missing values empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(df: pd.DataFrame) -> str:
    """``df`` as a GitHub markdown table (no ``tabulate`` needed); floats to 4 significant digits."""
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "|".join("---" for _ in df.columns) + "|"]
    lines += ["| " + " | ".join(text(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |"
              for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def summary_table(df: pd.DataFrame, metrics: list[str], by: str | list[str] = "objective",
                  digits: int = 4) -> pd.DataFrame:
    """``mean ± sd`` over seeds of each metric, one row per group (sd is 0 with one seed), and the seed count."""
    grouped = df.groupby(by, sort=False)
    table = pd.DataFrame({m: grouped[m].apply(lambda v: mean_sd_text(v, digits)) for m in metrics})
    table["seeds"] = grouped.size()
    return table
