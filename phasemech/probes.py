"""Two scikit-learn analyses: clustering heads by their phase profile, and linear phase probes.

Axes: ``batch`` (sequences), ``pos`` (token positions), ``layer``, ``head`` (a *unit* is one
``(layer, head)`` pair), ``phase`` (a token's offset in its compression chunk,
``(pos - offset) mod stride``), ``row`` (one ``(sequence, position)`` sample of a probe).

* :func:`cluster_heads` groups heads whose effect-by-phase profiles have the same *shape*
  (e.g. ablation effects per target phase): KMeans over the ``[unit, phase]`` matrix, ``k``
  chosen by silhouette score, each cluster named after the phases its centroid serves.
* :func:`phase_probe` asks whether the residual stream linearly encodes the token's phase.
  With standard positional embeddings ``pos mod d`` is decodable from the embedding alone, so
  phase on a fixed grid is confounded with absolute position. ``random_grid=True`` shifts each
  sequence's grid by a random ``s_b`` in ``[0, d)`` (``PhaseTransformer.shift_grid``), making the
  phase label ``(pos - offset - s_b) mod d`` independent of position: above-chance decoding must
  then come from a compressed layer's output (sites before the first compressed layer sit at
  chance). ``pos mod d`` is decoded from the same activations as a control.

Bad arguments raise ``ValueError`` naming the value and what is allowed, before any work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from scipy import stats as sps
from sklearn.cluster import KMeans
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import silhouette_score
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from torch import Tensor
from transformer_lens import HookedTransformer

from phasemech.config import is_int
from phasemech.grid import reference_grid
from phasemech.io import atomic_write
from phasemech.validation import check_int

__all__ = ["HeadClusters", "ProbeResult", "cluster_heads", "phase_probe"]

#: a centroid whose range is below this fraction of the largest centroid range is "flat"
FLAT_FRACTION = 0.25
#: a best silhouette below this is reported as weak structure in ``HeadClusters.note``
WEAK_SILHOUETTE = 0.25


# --------------------------------------------------------------------------- cluster_heads


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


def _check_effects(effects: Any, value: Any) -> tuple[pd.DataFrame, str]:
    """Checked ``(frame, head column name)``: one row per (layer, head, phase), finite values."""
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
    keys = ["layer", head, "phase"]
    extra = [c for c in effects.columns if c not in (*keys, value)]
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
            f"{where}: columns with several values: {shown}: cluster one condition at a time, "
            f"e.g. effects[effects[{col!r}] == {values[0]!r}]"
        )
    dup = effects.duplicated(keys, keep=False)
    if dup.any():
        varying = [c for c in extra if effects.loc[dup].groupby(keys)[c].nunique().max() > 1]
        row = effects.loc[dup].iloc[0]
        raise ValueError(
            f"{where}: {int(dup.sum())} rows repeat a (layer, {head}, phase), e.g. "
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
    where = "cluster_heads"
    df, head = _check_effects(effects, value)
    k_min, k_max = _check_k_range(k_range)
    if not is_int(seed):
        raise ValueError(f"{where}: seed={seed!r} is invalid: must be an int")
    for name, flag in (("normalize", normalize), ("center", center)):
        if not isinstance(flag, bool):
            raise ValueError(f"{where}: {name}={flag!r} is invalid: must be True or False")
    if not isinstance(min_norm, int | float) or isinstance(min_norm, bool) or not 0 <= min_norm < 1:
        raise ValueError(f"{where}: min_norm={min_norm!r} is invalid: must be a float in [0, 1)")

    wide = df.pivot(index=["layer", head], columns="phase", values=value).sort_index()
    wide = wide.sort_index(axis=1)
    if wide.isna().any().any():
        unit = wide.index[wide.isna().any(axis=1)][0]
        gaps = [int(p) for p in wide.columns[wide.loc[unit].isna()]]
        raise ValueError(
            f"{where}: unit (layer {unit[0]}, {head} {unit[1]}) has no {value!r} at phases "
            f"{gaps}: every unit needs every phase"
        )
    phases = wide.columns.to_numpy()
    raw = wide.to_numpy(dtype=float)  # [unit, phase]
    x = raw - raw.mean(1, keepdims=True) if center else raw.copy()
    notes = []
    if normalize:
        norm = np.linalg.norm(x, axis=1)
        small = (norm == 0) | (norm < min_norm * norm.max())
        if (norm[small] > 0).any():
            notes.append(f"{int(small.sum())} unit(s) with norm < {min_norm} x max set to zero")
        x[small] = 0.0
        x[~small] /= norm[~small, None]
    n_units = len(x)
    distinct = len(np.unique(x.round(12), axis=0))

    ks = [k for k in range(k_min, k_max + 1) if k < n_units and k <= distinct]
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

    if n_units < 3:
        notes.insert(0, f"{n_units} unit(s): too few to cluster, one cluster")
    elif distinct == 1:
        notes.insert(0, "all profiles identical: one cluster")
    elif not ks or silhouette["score"].isna().all():
        notes.insert(
            0,
            f"no k in k_range=({k_min}, {k_max}) below {n_units} units and at most {distinct} "
            "distinct profiles: one cluster",
        )
    if not ks or silhouette["score"].isna().all() or distinct == 1:
        k, raw_labels = 1, np.zeros(n_units, dtype=int)
        centers = x.mean(0, keepdims=True)
    else:
        best = silhouette.loc[silhouette["score"].idxmax()]  # first max: the smaller k
        k = int(best["k"])
        raw_labels, centers = fits[k].labels_, fits[k].cluster_centers_
        if best["score"] < WEAK_SILHOUETTE:
            notes.append(f"weak structure: best silhouette {best['score']:.2f} < {WEAK_SILHOUETTE}")

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


# --------------------------------------------------------------------------- phase_probe


@dataclass(frozen=True, eq=False)  # eq=False: DataFrame fields have no truth value
class ProbeResult:
    """Result of :func:`phase_probe`.

    ``frame``: one row per (site, label) with columns ``site`` ("resid_pre.0", ...,
    "resid_post.{n-1}"), ``layer`` (blocks applied before the site: ``l`` for ``resid_pre.l``,
    ``n_layers`` for the final ``resid_post``), ``after_compressed`` (a compressed layer writes
    before the site), ``label`` ("phase": on the shifted grid; "pos_mod_d": the control),
    ``accuracy`` (mean over folds), ``std`` (across folds, ddof=1), ``chance``, ``n`` (rows),
    ``p_value`` (one-sided binomial test of the pooled out-of-fold hits against ``chance``).
    """

    frame: pd.DataFrame
    stride: int
    grid_offset: int
    random_grid: bool

    def table(self, value: str = "accuracy") -> pd.DataFrame:
        """Site x label table of ``value``, sites in depth order."""
        if value not in self.frame.columns:
            raise ValueError(f"table: value={value!r} is not a column of {list(self.frame)}")
        wide = self.frame.pivot(index=["layer", "site"], columns="label", values=value)
        return wide.droplevel("layer")

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``frame`` as one parquet file (atomically); ``stride``, ``grid_offset`` and
        ``random_grid`` travel in the frame's ``attrs`` (parquet metadata)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        frame = self.frame.copy()
        frame.attrs = {
            "stride": self.stride,
            "grid_offset": self.grid_offset,
            "random_grid": self.random_grid,
        }
        atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))
        return path


def _probe_grid(model: HookedTransformer, stride: Any, grid_offset: Any) -> tuple[int, int]:
    """``(stride, offset)`` of the labels: the model's reference grid unless stated."""
    comp = getattr(model.cfg, "compression", None)
    enabled = comp is not None and comp.enabled
    if stride is None:
        if not enabled:
            raise ValueError(
                "phase_probe: stride=None is invalid for a dense model (no compression grid): "
                "pass stride= (e.g. the stride of its matched compressed models)"
            )
        stride = comp.stride
    stride = check_int("phase_probe", "stride", stride, 2)
    if grid_offset is None:
        # a stated stride keeps the model's reference offset, reduced onto that grid
        grid_offset = reference_grid(comp)[1] % stride if comp is not None else 0
    if not is_int(grid_offset) or not 0 <= grid_offset < stride:
        raise ValueError(
            f"phase_probe: grid_offset={grid_offset!r} is invalid: must be an int in "
            f"[0, stride={stride})"
        )
    return stride, int(grid_offset)


def _check_tokens(model: HookedTransformer, tokens: Any, cv: int) -> Tensor:
    if not isinstance(tokens, Tensor) or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError("phase_probe: tokens must be an integer tensor [batch, pos]")
    if tokens.ndim != 2:
        raise ValueError(f"phase_probe: tokens have shape {tuple(tokens.shape)}: need [batch, pos]")
    batch, seq = tokens.shape
    if seq < 1 or seq > model.cfg.n_ctx:
        raise ValueError(f"phase_probe: tokens have {seq} positions: allowed 1..{model.cfg.n_ctx}")
    if batch < cv:
        raise ValueError(
            f"phase_probe: tokens hold {batch} sequences: cv={cv} folds grouped by sequence "
            f"need at least {cv}"
        )
    if tokens.min() < 0 or tokens.max() >= model.cfg.d_vocab:
        raise ValueError(
            f"phase_probe: token ids span [{int(tokens.min())}, {int(tokens.max())}]: allowed "
            f"0..{model.cfg.d_vocab - 1}"
        )
    return tokens


def _check_index_list(name: str, value: Any, size: int, what: str) -> list[int]:
    """Unique ints in ``[0, size)``, sorted; ``None`` means all of them."""
    if value is None:
        return list(range(size))
    if isinstance(value, Tensor | np.ndarray):
        value = value.tolist()
    if is_int(value):
        value = [value]
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) == 0:
        raise ValueError(f"phase_probe: {name}={value!r} is invalid: need a non-empty list of ints")
    bad = [v for v in value if not is_int(v) or not 0 <= v < size]
    if bad:
        raise ValueError(
            f"phase_probe: {name} {bad} do not exist: {what} must be ints in 0..{size - 1}"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"phase_probe: {name}={list(value)} repeats an entry")
    return sorted(int(v) for v in value)


def _cross_validate(
    x: np.ndarray, y: np.ndarray, groups: np.ndarray, cv: int
) -> tuple[float, float, int]:
    """``(mean fold accuracy, std across folds, pooled out-of-fold hits)``."""
    accs, hits = [], 0
    for train, test in GroupKFold(n_splits=cv).split(x, y, groups):
        if len(np.unique(y[train])) < 2:  # LogisticRegression needs two classes: guess the one
            pred = np.full(len(test), y[train][0])
        else:
            clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
            pred = clf.fit(x[train], y[train]).predict(x[test])
        ok = pred == y[test]
        accs.append(float(ok.mean()))
        hits += int(ok.sum())
    return float(np.mean(accs)), float(np.std(accs, ddof=1)), hits


def phase_probe(
    model: HookedTransformer,
    tokens: Int[Tensor, "batch pos"],
    *,
    stride: int | None = None,
    grid_offset: int | None = None,
    random_grid: bool = True,
    positions: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    cv: int = 5,
    seed: int = 0,
    max_rows: int = 20000,
    batch_size: int = 128,
) -> ProbeResult:
    """Linear probes for the token's phase on the residual stream, at every layer.

    Args:
        model: a ``PhaseTransformer`` (any ``HookedTransformer`` works as a dense model; the
            grid shift then has nothing to shift). Run in eval mode (restored afterwards), so
            random-offset models use their ``eval_offset`` plus the probe's shift.
        tokens: ``[batch, pos]`` token ids, at least ``cv`` sequences.
        stride: ``d`` of the phase label; default the model's compression stride (a dense model
            must state it).
        grid_offset: offset of the label grid; default the model's reference grid
            (:func:`phasemech.grid.reference_grid`).
        random_grid: shift sequence ``b``'s grid by a seeded ``s_b`` in ``[0, d)`` (via
            ``model.shift_grid``), so the phase label ``(pos - grid_offset - s_b) mod d`` is
            independent of absolute position. ``False``: ``s_b = 0``, phase is a relabelled
            ``pos mod d`` and the two labels decode alike.
        positions: positions to probe (default all).
        layers: ``hook_resid_pre`` of these layers (default all) are probed, plus the final
            ``blocks.{n-1}.hook_resid_post`` always.
        cv: ``GroupKFold`` folds, grouped by sequence (no sequence in both train and test).
        seed: seeds the grid shifts and the row subsample.
        max_rows: at most this many ``(sequence, position)`` rows (a seeded subsample, the same
            rows at every site).
        batch_size: sequences per forward pass.

    Classifier: ``StandardScaler`` + ``LogisticRegression(max_iter=1000)``. ``chance`` is the
    accuracy of always guessing the commonest label (``1/d`` for balanced labels; higher when
    ``positions`` cover residues unevenly, where ``1/d`` would flatter the probe). The binomial
    test treats rows as independent; rows of one sequence are not quite, so read small
    p-values as "clearly above chance", not as exact error rates.
    """
    cv = check_int("phase_probe", "cv", cv, 2)
    stride, grid_offset = _probe_grid(model, stride, grid_offset)
    if not isinstance(random_grid, bool):
        raise ValueError(f"phase_probe: random_grid={random_grid!r} is invalid: True or False")
    seed = check_int("phase_probe", "seed", seed, 0)
    max_rows = check_int("phase_probe", "max_rows", max_rows, 1)
    batch_size = check_int("phase_probe", "batch_size", batch_size, 1)
    tokens = _check_tokens(model, tokens, cv)
    n_layers = model.cfg.n_layers
    layers = _check_index_list("layers", layers, n_layers, "layers")
    batch, seq = tokens.shape
    positions = np.asarray(_check_index_list("positions", positions, seq, "positions"))
    if len(np.unique(positions % stride)) < 2:
        raise ValueError(
            f"phase_probe: positions={positions.tolist()} cover one residue mod stride={stride}: "
            "the pos_mod_d control needs at least two"
        )

    rng = np.random.default_rng(seed)
    shifts = rng.integers(0, stride, batch) if random_grid else np.zeros(batch, dtype=np.int64)
    n_total = batch * len(positions)
    rows = np.arange(n_total)
    if n_total > max_rows:
        rows = np.sort(rng.choice(n_total, max_rows, replace=False))
    row_seq, row_pos = rows // len(positions), positions[rows % len(positions)]
    if len(np.unique(row_seq)) < cv:
        raise ValueError(
            f"phase_probe: max_rows={max_rows} keeps rows of {len(np.unique(row_seq))} "
            f"sequences: cv={cv} folds need at least {cv}"
        )
    labels = {
        "phase": (row_pos - grid_offset - shifts[row_seq]) % stride,
        "pos_mod_d": row_pos % stride,
    }

    sites = [(f"resid_pre.{i}", f"blocks.{i}.hook_resid_pre", i) for i in layers]
    sites.append((f"resid_post.{n_layers - 1}", f"blocks.{n_layers - 1}.hook_resid_post", n_layers))
    hook_names = [hook for _, hook, _ in sites]
    feats: dict[str, list[np.ndarray]] = {hook: [] for hook in hook_names}
    device = model.cfg.device
    was_training = model.training
    model.eval()  # a training forward would draw its own random offsets
    try:
        with torch.inference_mode():
            for start in range(0, batch, batch_size):
                stop = min(start + batch_size, batch)
                sel = (row_seq >= start) & (row_seq < stop)
                if not sel.any():
                    continue
                b_idx = torch.as_tensor(row_seq[sel] - start, device=device)
                p_idx = torch.as_tensor(row_pos[sel], device=device)
                shift_ctx = (
                    model.shift_grid(torch.as_tensor(shifts[start:stop], device=device))
                    if hasattr(model, "shift_grid")
                    else contextlib.nullcontext()
                )
                with shift_ctx:
                    _, cache = model.run_with_cache(
                        tokens[start:stop].to(device), names_filter=hook_names, return_type=None
                    )
                for hook in hook_names:
                    feats[hook].append(cache[hook][b_idx, p_idx].float().cpu().numpy())
                del cache
    finally:
        model.train(was_training)

    comp = getattr(model.cfg, "compression", None)
    compressed = comp.compressed_layers(n_layers) if comp is not None else []
    out = []
    for site, hook, depth in sites:
        x = np.concatenate(feats[hook])
        for name, y in labels.items():
            chance = max(1.0 / stride, float(np.bincount(y).max()) / len(y))
            acc, std, hits = _cross_validate(x, y, row_seq, cv)
            p = sps.binomtest(hits, len(y), chance, alternative="greater").pvalue
            out.append(
                {
                    "site": site,
                    "layer": depth,
                    "after_compressed": any(c < depth for c in compressed),
                    "label": name,
                    "accuracy": acc,
                    "std": std,
                    "chance": chance,
                    "n": len(y),
                    "p_value": float(p),
                }
            )
    frame = pd.DataFrame(out).astype({"layer": "int64", "n": "int64"})
    return ProbeResult(frame=frame, stride=stride, grid_offset=grid_offset, random_grid=random_grid)
