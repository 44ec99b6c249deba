"""Alignment, measured on results: representations against label embeddings, gradients against each other.

Two families of numbers the notebooks report, computed only from what a run
left behind (its representation dump, its per-step history), never from a
model being trained:

* **representation alignment** (notebook 03): how close each sample's [CLS]
  vector is to its own label embedding, by cosine (:func:`alignment_score`), and
  a 2-D picture of samples and label embeddings together (:func:`project_2d`);
* **gradient conflict** (notebook 01): the per-batch angles between grad(CE) and
  the contrastive gradients, summarised per seed and per phase of training
  (:func:`angle_long_frame`, :func:`conflict_summary`, :func:`phase_summary`).

It also holds :func:`pick_run`, which finds the run a notebook needs among the
finished runs under ``OUTPUT_DIR``.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from .errors import AclLabError, bad_value

EPS = 1e-12
METHODS = ("umap", "pca")
#: history columns written with ``probe_angles=True`` and their readable names
PROBES = {"angle_scl": "CE vs SCL", "angle_acl_embed": "CE vs ACL-Embed"}
PHASES = ("early", "middle", "late")


# ---------------------------------------------------------------------------
# representation alignment
# ---------------------------------------------------------------------------

def _unit_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), EPS)


def _check_shapes(reps: np.ndarray, label_embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    reps, emb = np.asarray(reps), np.asarray(label_embeddings)
    if reps.ndim != 2 or emb.ndim != 2:
        raise AclLabError(f"reps and label_embeddings must be 2-D arrays [N, d] and [C, d]; got shapes {reps.shape} "
                          f"and {emb.shape}. Fix: pass one exit's arrays, e.g. dump['reps'][layer].")
    if reps.shape[1] != emb.shape[1]:
        raise AclLabError(f"reps have width {reps.shape[1]} but label embeddings {emb.shape[1]}. Fix: pass the label "
                          "embeddings of the same exit (layer) as the representations.")
    return reps, emb


def alignment_score(reps: np.ndarray, labels: np.ndarray, label_embeddings: np.ndarray) -> dict[str, float]:
    """How well samples line up with their own label embedding, by cosine.

    With z_i = reps[i] / ||reps[i]|| and u_c = e_c / ||e_c||:

    * ``own_cos``: mean over samples of cos(z_i, u_{y_i});
    * ``other_cos``: mean over samples of the mean of cos(z_i, u_c) over the other classes c != y_i;
    * ``gap``: ``own_cos - other_cos``;
    * ``nearest_own``: fraction of samples whose nearest label embedding (largest cosine) is their own
      (ties go to the lowest class id).
    """
    reps, emb = _check_shapes(reps, label_embeddings)
    labels = np.asarray(labels).astype(int).reshape(-1)
    n, c = len(reps), len(emb)
    if c < 2:
        raise AclLabError(f"alignment_score needs at least 2 label embeddings (classes); got {c}.")
    if len(labels) != n or n == 0:
        raise AclLabError(f"Got {n} representations and {len(labels)} labels; they must match and not be empty.")
    if labels.min() < 0 or labels.max() >= c:
        raise AclLabError(f"Labels must be class ids in [0, {c - 1}]; got values from {labels.min()} to {labels.max()}.")
    cos = _unit_rows(reps) @ _unit_rows(emb).T  # [N, C]
    own = cos[np.arange(n), labels]
    other = (cos.sum(axis=1) - own) / (c - 1)
    return {"own_cos": float(own.mean()), "other_cos": float(other.mean()), "gap": float(own.mean() - other.mean()),
            "nearest_own": float((cos.argmax(axis=1) == labels).mean())}


def umap_unavailable() -> str | None:
    """Why umap-learn cannot be used here (not installed, or its import fails, e.g. a numba/llvmlite mismatch), or
    None when it imports. Importing it compiles numba code, so this is called only when UMAP is asked for."""
    try:
        import umap  # noqa: F401  (lazy: importing umap-learn compiles numba code)
    except Exception as exc:  # noqa: BLE001 - ImportError, and whatever numba raises on a broken install
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return None


def resolve_method(method: str) -> str:
    """``method`` if it can run here; ``"umap"`` without a working umap-learn falls back to ``"pca"`` with a note.

    The note is one line on stdout (the notebook shows it next to the picture). Notebook 03 calls this once so
    its titles and metrics name the projection actually used.
    """
    if method not in METHODS:
        raise bad_value("method", method, METHODS, "use 'umap' for the picture, 'pca' for a fast linear view.")
    if method == "umap":
        why = umap_unavailable()
        if why is not None:
            print(f"[acl_lab] UMAP unavailable ({why}); using PCA instead. For UMAP: pip install umap-learn")
            return "pca"
    return method


def project_2d(reps: np.ndarray, label_embeddings: np.ndarray, method: str = "umap", seed: int = 0,
               normalize: bool = True, n_neighbors: int = 15, min_dist: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Project samples and label embeddings *together* to 2-D; return ``(sample_xy [N, 2], label_xy [C, 2])``.

    Both are L2-normalised first (``normalize=True``), because ACL compares them by
    cosine and the classifier's rows have a different scale from [CLS] vectors.
    ``method="umap"`` uses umap-learn with ``random_state=seed`` (reproducible, single
    threaded, and the first call pays ~30 s of numba compilation); ``"pca"`` uses
    scikit-learn's PCA (instant, linear, deterministic). Where umap-learn is missing or
    fails to import, ``"umap"`` falls back to PCA with a one-line note (:func:`resolve_method`).
    """
    method = resolve_method(method)
    reps, emb = _check_shapes(reps, label_embeddings)
    points = np.concatenate([reps, emb]).astype(np.float64)
    if normalize:
        points = _unit_rows(points)
    n_points = len(points)
    if n_points < 3:
        raise AclLabError(f"Need at least 3 points to project (got {n_points}).")
    if method == "pca":
        from sklearn.decomposition import PCA

        xy = PCA(n_components=2, random_state=seed).fit_transform(points)
    else:
        import umap  # lazy: importing umap-learn compiles numba code (resolve_method checked it imports)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "n_jobs overridden by setting random_state" and numba chatter
            reducer = umap.UMAP(n_components=2, n_neighbors=max(2, min(n_neighbors, n_points - 1)),
                                min_dist=min_dist, random_state=seed, init="spectral" if n_points > 10 else "random")
            xy = reducer.fit_transform(points)
    xy = np.asarray(xy, dtype=np.float64)
    return xy[: len(reps)], xy[len(reps):]


# ---------------------------------------------------------------------------
# gradient conflict (pilot study)
# ---------------------------------------------------------------------------

def phase_of(step: int, total: int) -> str:
    """``early`` (first third of the steps, rounded up), ``late`` (last third) or ``middle``."""
    k = max(1, math.ceil(total / 3))
    if step <= k:
        return "early"
    if step > total - k:
        return "late"
    return "middle"


def angle_long_frame(history: pd.DataFrame, probes: dict[str, str] | None = None) -> pd.DataFrame:
    """Per-step probe angles in long form: objective, seed, step, probe, angle, cos, phase.

    ``history`` is :func:`acl_lab.experiments.history_frame` of runs trained with
    ``probe_angles=True``; ``probes`` maps history columns to readable names
    (default: :data:`PROBES`). Rows whose angle is missing or not finite are left out.
    """
    probes = PROBES if probes is None else probes
    missing = [c for c in probes if c not in history.columns]
    if missing:
        raise AclLabError(f"The history has no column(s) {missing}. Fix: train with probe_angles=True "
                          "(notebook 01 does) to log the pilot-study angles.")
    frames = []
    for column, name in probes.items():
        cos_col = column.replace("angle_", "cos_", 1)
        part = history[["objective", "seed", "step", column]].rename(columns={column: "angle"})
        part["cos"] = history[cos_col] if cos_col in history.columns else np.nan
        part["probe"] = name
        frames.append(part)
    long = pd.concat(frames, ignore_index=True)
    long = long[np.isfinite(long["angle"].astype(float))].copy()
    totals = long.groupby(["objective", "seed"])["step"].transform("max")
    long["phase"] = [phase_of(int(s), int(t)) for s, t in zip(long["step"], totals)]
    return long[["objective", "seed", "step", "probe", "angle", "cos", "phase"]].reset_index(drop=True)


def per_seed_conflict(long: pd.DataFrame, by: Sequence[str] = ("objective", "probe")) -> pd.DataFrame:
    """One row per group and seed: batches, fraction of batches over 90 degrees, median and mean angle."""
    keys = [*by, "seed"]
    g = long.groupby(keys, sort=False)["angle"]
    out = pd.DataFrame({"batches": g.size(), "frac_over_90": g.apply(lambda a: float((a > 90).mean())),
                        "median_angle": g.median(), "mean_angle": g.mean()})
    return out.reset_index()


def conflict_summary(long: pd.DataFrame, by: Sequence[str] = ("objective", "probe")) -> pd.DataFrame:
    """Mean and sd over seeds of the per-seed fraction over 90 degrees and of the median angle (numbers)."""
    per_seed = per_seed_conflict(long, by)
    g = per_seed.groupby(list(by), sort=False)
    stats = {}
    for col in ("frac_over_90", "median_angle", "mean_angle"):
        stats[f"{col}_mean"] = g[col].mean()
        stats[f"{col}_sd"] = g[col].std(ddof=1).fillna(0.0)
    stats["seeds"] = g.size()
    stats["batches"] = g["batches"].sum()
    return pd.DataFrame(stats).reset_index()


def format_conflict_table(summary: pd.DataFrame, by: Sequence[str] = ("objective", "probe")) -> pd.DataFrame:
    """:func:`conflict_summary` as a readable ``mean ± sd`` table."""
    table = summary.set_index(list(by))
    return pd.DataFrame({
        "fraction of batches > 90°": [f"{m:.2f} ± {s:.2f}" for m, s in zip(table["frac_over_90_mean"], table["frac_over_90_sd"])],
        "median angle (°)": [f"{m:.1f} ± {s:.1f}" for m, s in zip(table["median_angle_mean"], table["median_angle_sd"])],
        "seeds": table["seeds"].to_numpy(), "batches": table["batches"].to_numpy(),
    }, index=table.index)


def phase_summary(long: pd.DataFrame, by: Sequence[str] = ("objective", "probe")) -> pd.DataFrame:
    """:func:`conflict_summary` per phase of training (early / middle / late third of the steps)."""
    summary = conflict_summary(long, [*by, "phase"])
    keys = []
    for i, col in enumerate(by):  # keep each group in order of first appearance, phases in time order
        first_seen = {v: j for j, v in enumerate(dict.fromkeys(long[col]))}
        summary[f"_k{i}"] = summary[col].map(first_seen)
        keys.append(f"_k{i}")
    summary["_phase"] = summary["phase"].map({p: i for i, p in enumerate(PHASES)})
    order = [*keys, "_phase"]
    return summary.sort_values(order, kind="stable").drop(columns=order).reset_index(drop=True)


# ---------------------------------------------------------------------------
# finding runs
# ---------------------------------------------------------------------------

_SHAPE_FIELDS = ("task", "model", "max_train_samples", "max_eval_samples", "max_steps", "epochs", "batch_size",
                 "max_length")


def pick_run(results: Iterable[Any], objective: str, seed: int | None = None, like: Any = None,
             prefer: dict[str, Any] | None = None) -> Any | None:
    """The finished run (a TrainResult) of ``objective`` that a notebook should read, or ``None``.

    Candidates have that objective, ``seed`` (if given), no pilot-study probing, and the
    same task, model, data size and length as the config ``like`` (if given). Among them,
    runs whose config matches more of the fields in ``prefer`` (e.g. ``{"lam": 0.1}``) come
    first, then those differing from ``like`` in fewer other fields (objective and seed
    aside), then lower seeds; ties are broken by the run folder name.
    """
    from .config import RUNTIME_FIELDS

    candidates = []
    for r in results:
        c = r.config
        if c.objective != objective or c.probe_angles or (seed is not None and c.seed != seed):
            continue
        if like is not None and any(getattr(c, f) != getattr(like, f) for f in _SHAPE_FIELDS):
            continue
        candidates.append(r)
    if not candidates:
        return None
    prefer = prefer or {}

    skip = set(RUNTIME_FIELDS) | {"objective", "seed"}
    reference = like.to_dict() if like is not None else {}

    def rank(r):
        misses = sum(getattr(r.config, k) != v for k, v in prefer.items())
        mine = r.config.to_dict()
        others = sum(mine.get(k) != v for k, v in reference.items() if k not in skip)
        return misses, others, r.config.seed, str(r.output_dir)

    return min(candidates, key=rank)


def gate_phase_table(history: pd.DataFrame) -> pd.DataFrame:
    """ACL-Grad decisions per run and phase of training: steps, drop rate and median gate angle.

    ``history`` is :func:`acl_lab.experiments.history_frame`; only rows with a gate
    decision (``kept``) count. Empty when no run was gated.
    """
    cols = ["objective", "seed", "phase", "steps", "drop_rate", "median_angle"]
    if "kept" not in history.columns:
        return pd.DataFrame(columns=cols)
    gated = history[history["kept"].notna()].copy()
    if gated.empty:
        return pd.DataFrame(columns=cols)
    totals = gated.groupby(["objective", "seed"])["step"].transform("max")
    gated["phase"] = [phase_of(int(s), int(t)) for s, t in zip(gated["step"], totals)]
    gated["dropped"] = ~gated["kept"].astype(bool)
    g = gated.groupby(["objective", "seed", "phase"], sort=False)
    out = pd.DataFrame({"steps": g.size(), "drop_rate": g["dropped"].mean(), "median_angle": g["angle"].median()})
    out = out.reset_index()
    out["_order"] = out["phase"].map({p: i for i, p in enumerate(PHASES)})
    return out.sort_values(["objective", "seed", "_order"]).drop(columns="_order").reset_index(drop=True)[cols]


# ---------------------------------------------------------------------------
# per-exit pictures from a representation dump
# ---------------------------------------------------------------------------

def exit_panels(dump: dict, method: str = "umap", seed: int = 0, layers: Sequence[int] | None = None) -> list[dict]:
    """For each exit of a dump (:func:`acl_lab.evaluate.load_representations`): its 2-D projection and scores.

    Returns one dict per exit with ``layer``, ``xy``, ``label_xy``, ``labels`` and
    ``scores`` (:func:`alignment_score`), ready for :func:`acl_lab.plots.representation_grid`.
    """
    layers = list(dump["layers"]) if layers is None else list(layers)
    panels = []
    for layer in layers:
        reps, emb = dump["reps"][layer], dump["label_embeddings"][layer]
        xy, label_xy = project_2d(reps, emb, method=method, seed=seed)
        panels.append({"layer": layer, "xy": xy, "label_xy": label_xy, "labels": dump["labels"],
                       "scores": alignment_score(reps, dump["labels"], emb)})
    return panels
