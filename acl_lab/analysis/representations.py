"""Representations against label embeddings, from a run's saved dump (notebook 03).

How close each sample's exit representation is to its own label embedding, by cosine
(:func:`alignment_score`), and a 2-D picture of samples and label embeddings together
(:func:`project_2d`: UMAP, or PCA); :func:`exit_panels` does both for every exit of a dump
written by :func:`acl_lab.evaluate.dump_representations`.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from ..errors import AclLabError, bad_value

EPS = 1e-12
METHODS = ("umap", "pca")


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


def exit_panels(dump: dict, method: str = "umap", seed: int = 0, layers: Sequence[int] | None = None) -> list[dict]:
    """For each exit of a dump (:func:`acl_lab.evaluate.load_representations`): its 2-D projection and scores.

    Returns one dict per exit with ``layer``, ``xy``, ``label_xy``, ``labels`` and
    ``scores`` (:func:`alignment_score`), ready for :func:`acl_lab.viz.plots.representation_grid`.
    """
    layers = list(dump["layers"]) if layers is None else list(layers)
    panels = []
    for layer in layers:
        reps, emb = dump["reps"][layer], dump["label_embeddings"][layer]
        xy, label_xy = project_2d(reps, emb, method=method, seed=seed)
        panels.append({"layer": layer, "xy": xy, "label_xy": label_xy, "labels": dump["labels"],
                       "scores": alignment_score(reps, dump["labels"], emb)})
    return panels
