"""Clustering heads by the shape of their effect-by-phase profile.

Axes: ``layer``, ``head`` (a *unit* is one ``(layer, head)`` pair), ``phase``.

:func:`cluster_heads` groups heads whose profiles (e.g. ablation effects per target phase) have
the same *shape*: KMeans over the ``[unit, phase]`` matrix, ``k`` chosen by silhouette score,
each cluster named after the phases its centroid serves. Bad arguments raise ``ValueError``
naming the value and what is allowed, before any work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score

from phasemech.core.config import is_int

#: a centroid whose range is below this fraction of the largest centroid range is "flat"
FLAT_FRACTION = 0.25


#: a best silhouette below this is reported as weak structure in ``HeadClusters.note``
WEAK_SILHOUETTE = 0.25


@dataclass(frozen=True, eq=False)  # eq=False: DataFrame fields have no truth value
class HeadClusters:
    """Result of :func:`cluster_heads`.

    ``labels``: one row per unit: ``layer``, ``head`` (or ``unit``, as named in the input),
    ``cluster``, ``name`` (the cluster's name), ``peak_phase`` (phase of the row's most negative
    value, i.e. the phase the head serves; ``<NA>`` when no value is negative) and the clustered
    profile ``phase_<p>`` (L2-normalised when ``normalize=True``).
    ``silhouette``: ``k, score, inertia`` for every ``k`` tried. ``centroids``: cluster x phase.
    ``names``: cluster -> short name ("phase 2-3": the phases where the centroid is below half
    its minimum; "flat": a centroid whose range is small next to the others').
    Clusters are numbered in order of first appearance over units sorted by ``(layer, head)``.
    """

    labels: pd.DataFrame
    silhouette: pd.DataFrame
    k: int
    centroids: pd.DataFrame
    names: dict[int, str]
    note: str = ""


def _runs(phases: Sequence[int]) -> str:
    """``[0, 2, 3]`` -> ``"0,2-3"``."""
    phases = sorted(int(p) for p in phases)
    parts, start = [], 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[i - 1] + 1:
            a, b = phases[start], phases[i - 1]
            parts.append(str(a) if a == b else f"{a}-{b}")
            start = i
    return ",".join(parts)


def _centroid_names(centroids: np.ndarray, phases: np.ndarray) -> list[str]:
    ranges = centroids.max(1) - centroids.min(1)
    top = ranges.max() if len(ranges) else 0.0
    names = []
    for c, row in enumerate(centroids):
        if ranges[c] == 0 or ranges[c] < FLAT_FRACTION * top:
            name = "flat"
        elif row.min() < 0:  # the phases whose effect is strongest (most negative)
            name = "phase " + _runs(phases[row <= 0.5 * row.min()])
        else:  # only positive effects: name the phases above half the maximum instead
            name = "phase " + _runs(phases[row >= 0.5 * row.max()]) + " (+)"
        names.append(name)
    counts = pd.Series(names).value_counts()
    return [f"{n} #{c}" if counts[n] > 1 else n for c, n in enumerate(names)]


def _check_columns(effects: Any, value: Any) -> str:
    """The head column's name (``head`` or ``unit``) of a frame with the needed columns, integer
    keys and finite numeric values."""
    where = "cluster_heads"
    if not isinstance(effects, pd.DataFrame):
        raise ValueError(f"{where}: expected a pandas DataFrame, got {type(effects).__name__}")
    if not isinstance(value, str):
        raise ValueError(f"{where}: value={value!r} is invalid: must be a column name (str)")
    head = "head" if "head" in effects.columns else "unit"
    missing = [c for c in ("layer", head, "phase", value) if c not in effects.columns]
    if missing:
        raise ValueError(
            f"{where}: columns {missing} are missing (have {list(effects.columns)}): need "
            f"layer, head (or unit), phase and value={value!r}"
        )
    if effects.empty:
        raise ValueError(f"{where}: the effects frame has no rows")
    for col in ("layer", head, "phase"):
        if not pd.api.types.is_integer_dtype(effects[col]):
            raise ValueError(f"{where}: column {col!r} has dtype {effects[col].dtype}: need ints")
    if not pd.api.types.is_numeric_dtype(effects[value]) or pd.api.types.is_bool_dtype(
        effects[value]
    ):
        raise ValueError(
            f"{where}: column {value!r} has dtype {effects[value].dtype}: need numbers"
        )
    bad = ~np.isfinite(effects[value].to_numpy(dtype=float))
    if bad.any():
        row = effects.loc[bad].iloc[0]
        raise ValueError(
            f"{where}: {int(bad.sum())} non-finite {value!r} values, e.g. layer {row['layer']} "
            f"{head} {row[head]} phase {row['phase']}: drop or fill them first"
        )
    return head


def _check_one_condition(effects: pd.DataFrame, extra: list[str]) -> None:
    # A grouping column (component, mode, metric...) with several values would mix profiles
    # measured under different conditions into one clustering.
    several = {}
    for col in extra:
        s = effects[col]
        if pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s):
            continue  # numeric extras (n, se, ...) are ignored unless they duplicate rows
        values = s.unique()
        if len(values) > 1:
            several[col] = values
    if several:
        shown = "; ".join(
            f"{col!r} ({len(v)}: "
            + ", ".join(repr(x) for x in v[:4])
            + (", ...)" if len(v) > 4 else ")")
            for col, v in several.items()
        )
        col, values = next(iter(several.items()))
        raise ValueError(
            f"cluster_heads: columns with several values: {shown}: cluster one condition at a "
            f"time, e.g. effects[effects[{col!r}] == {values[0]!r}]"
        )


def _check_effects(effects: Any, value: Any) -> tuple[pd.DataFrame, str]:
    """Checked ``(frame, head column name)``: one row per (layer, head, phase), finite values."""
    head = _check_columns(effects, value)
    keys = ["layer", head, "phase"]
    extra = [c for c in effects.columns if c not in (*keys, value)]
    _check_one_condition(effects, extra)
    dup = effects.duplicated(keys, keep=False)
    if dup.any():
        varying = [c for c in extra if effects.loc[dup].groupby(keys)[c].nunique().max() > 1]
        row = effects.loc[dup].iloc[0]
        raise ValueError(
            f"cluster_heads: {int(dup.sum())} rows repeat a (layer, {head}, phase), e.g. "
            f"({row['layer']}, {row[head]}, {row['phase']})"
            + (f"; they differ in {varying}: filter to one value" if varying else "")
            + ": give one value per (layer, head, phase)"
        )
    return effects, head


def _check_k_range(k_range: Any) -> tuple[int, int]:
    ok = (
        isinstance(k_range, Sequence)
        and not isinstance(k_range, str)
        and len(k_range) == 2
        and all(is_int(k) for k in k_range)
        and 2 <= k_range[0] <= k_range[1]
    )
    if not ok:
        raise ValueError(
            f"cluster_heads: k_range={k_range!r} is invalid: need (k_min, k_max), ints with "
            "2 <= k_min <= k_max (both ends included)"
        )
    return int(k_range[0]), int(k_range[1])


def _check_options(seed: Any, normalize: Any, center: Any, min_norm: Any) -> None:
    where = "cluster_heads"
    if not is_int(seed):
        raise ValueError(f"{where}: seed={seed!r} is invalid: must be an int")
    for name, flag in (("normalize", normalize), ("center", center)):
        if not isinstance(flag, bool):
            raise ValueError(f"{where}: {name}={flag!r} is invalid: must be True or False")
    if not isinstance(min_norm, int | float) or isinstance(min_norm, bool) or not 0 <= min_norm < 1:
        raise ValueError(f"{where}: min_norm={min_norm!r} is invalid: must be a float in [0, 1)")


def _profiles(df: pd.DataFrame, head: str, value: str) -> pd.DataFrame:
    """``[unit, phase]`` table of ``value``, units and phases sorted; every cell filled."""
    wide = df.pivot(index=["layer", head], columns="phase", values=value).sort_index()
    wide = wide.sort_index(axis=1)
    if wide.isna().any().any():
        unit = wide.index[wide.isna().any(axis=1)][0]
        gaps = [int(p) for p in wide.columns[wide.loc[unit].isna()]]
        raise ValueError(
            f"cluster_heads: unit (layer {unit[0]}, {head} {unit[1]}) has no {value!r} at "
            f"phases {gaps}: every unit needs every phase"
        )
    return wide


def _shapes(
    raw: np.ndarray, center: bool, normalize: bool, min_norm: float, notes: list[str]
) -> np.ndarray:
    """The ``[unit, phase]`` rows that are clustered: centred and L2-normalised as asked."""
    x = raw - raw.mean(1, keepdims=True) if center else raw.copy()
    if normalize:
        norm = np.linalg.norm(x, axis=1)
        small = (norm == 0) | (norm < min_norm * norm.max())
        if (norm[small] > 0).any():
            notes.append(f"{int(small.sum())} unit(s) with norm < {min_norm} x max set to zero")
        x[small] = 0.0
        x[~small] /= norm[~small, None]
    return x


def _silhouettes(x: np.ndarray, ks: list[int], seed: int) -> tuple[pd.DataFrame, dict[int, Any]]:
    """``k, score, inertia`` of a KMeans fit for each ``k``, and the fits."""
    scores, inertias, fits = [], [], {}
    for k in ks:
        km = KMeans(n_clusters=k, n_init=10, random_state=int(seed)).fit(x)
        fits[k] = km
        inertias.append(float(km.inertia_))
        # silhouette is undefined with one populated cluster
        ok = len(np.unique(km.labels_)) > 1
        scores.append(float(silhouette_score(x, km.labels_)) if ok else np.nan)
    silhouette = pd.DataFrame({"k": ks, "score": scores, "inertia": inertias}).astype(
        {"k": "int64", "score": "float64", "inertia": "float64"}
    )
    return silhouette, fits


def _choose_k(
    x: np.ndarray,
    silhouette: pd.DataFrame,
    fits: dict[int, Any],
    distinct: int,
    k_range: tuple[int, int],
    notes: list[str],
) -> tuple[int, np.ndarray, np.ndarray]:
    """``(k, label per unit, centroids)`` of the best silhouette, or of one cluster when no
    ``k`` applies; the reason goes first in ``notes``."""
    n_units = len(x)
    no_k = silhouette.empty or silhouette["score"].isna().all()
    if n_units < 3:
        notes.insert(0, f"{n_units} unit(s): too few to cluster, one cluster")
    elif distinct == 1:
        notes.insert(0, "all profiles identical: one cluster")
    elif no_k:
        notes.insert(
            0,
            f"no k in k_range=({k_range[0]}, {k_range[1]}) below {n_units} units and at most "
            f"{distinct} distinct profiles: one cluster",
        )
    if no_k or distinct == 1:
        return 1, np.zeros(n_units, dtype=int), x.mean(0, keepdims=True)
    best = silhouette.loc[silhouette["score"].idxmax()]  # first max: the smaller k
    k = int(best["k"])
    if best["score"] < WEAK_SILHOUETTE:
        notes.append(f"weak structure: best silhouette {best['score']:.2f} < {WEAK_SILHOUETTE}")
    return k, fits[k].labels_, fits[k].cluster_centers_


def _head_clusters(
    wide: pd.DataFrame,
    raw: np.ndarray,
    x: np.ndarray,
    k: int,
    raw_labels: np.ndarray,
    centers: np.ndarray,
    silhouette: pd.DataFrame,
    notes: list[str],
) -> HeadClusters:
    phases = wide.columns.to_numpy()
    # KMeans numbers clusters arbitrarily: renumber by first appearance for stable output
    order = list(dict.fromkeys(raw_labels.tolist()))
    remap = {old: new for new, old in enumerate(order)}
    labels_ = np.array([remap[c] for c in raw_labels])
    centers = centers[order]
    names = dict(enumerate(_centroid_names(centers, phases)))
    has_neg = raw.min(1) < 0
    peak = pd.array(np.where(has_neg, phases[raw.argmin(1)], 0), dtype="Int64")
    peak[~has_neg] = pd.NA
    labels = wide.index.to_frame(index=False).astype("int64")
    labels["cluster"] = labels_.astype("int64")
    labels["name"] = [names[c] for c in labels_]
    labels["peak_phase"] = peak
    for j, p in enumerate(phases):
        labels[f"phase_{p}"] = x[:, j]
    centroids = pd.DataFrame(
        centers, index=pd.Index(range(k), name="cluster"), columns=pd.Index(phases, name="phase")
    )
    return HeadClusters(
        labels=labels,
        silhouette=silhouette,
        k=k,
        centroids=centroids,
        names=names,
        note="; ".join(notes),
    )


def cluster_heads(
    effects: pd.DataFrame,
    *,
    value: str = "effect",
    k_range: tuple[int, int] = (2, 8),
    seed: int = 0,
    normalize: bool = True,
    min_norm: float = 0.1,
    center: bool = True,
) -> HeadClusters:
    """Cluster units (``(layer, head)``) by their profile of ``value`` across phases.

    Args:
        effects: tidy frame with columns ``layer``, ``head`` (or ``unit``), ``phase`` and
            ``value``, one row per (layer, head, phase), every unit measured at every phase.
            Other text/categorical columns (component, mode, metric...) must hold one value:
            filter the frame first. Other numeric columns are ignored.
        value: the column to cluster on.
        k_range: ``(k_min, k_max)``, both included; only ``k < n_units`` is tried (silhouette
            needs it). The ``k`` with the highest silhouette score wins (ties: the smaller).
        seed: ``KMeans(n_init=10, random_state=seed)``.
        normalize: divide each row by its L2 norm, so clusters follow profile shape, not
            magnitude.
        min_norm: with ``normalize``, rows whose norm is below ``min_norm`` times the largest
            row norm are set to zero before normalising: a head with (almost) no effect has no
            shape, and scaling its noise to unit length would scatter it at random.
        center: subtract each unit's mean over phases first, so units cluster by how their
            effect *varies* with phase: a head that matters equally at every phase is "flat",
            not grouped with the phase-specialised ones.

    A single cluster (with a ``note``) is returned when there are fewer than 3 units, no ``k``
    in ``k_range`` lies below the number of units, or all profiles are identical.
    """
    df, head = _check_effects(effects, value)
    k_min, k_max = _check_k_range(k_range)
    _check_options(seed, normalize, center, min_norm)
    wide = _profiles(df, head, value)
    raw = wide.to_numpy(dtype=float)  # [unit, phase]
    notes: list[str] = []
    x = _shapes(raw, center, normalize, min_norm, notes)
    distinct = len(np.unique(x.round(12), axis=0))
    ks = [k for k in range(k_min, k_max + 1) if k < len(x) and k <= distinct]
    silhouette, fits = _silhouettes(x, ks, seed)
    k, raw_labels, centers = _choose_k(x, silhouette, fits, distinct, (k_min, k_max), notes)
    return _head_clusters(wide, raw, x, k, raw_labels, centers, silhouette, notes)


__all__ = ["HeadClusters", "cluster_heads"]
