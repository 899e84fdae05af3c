"""Which unit serves which phase: a within-stratum permutation test of whether an ablation's
effect depends on the needle's phase, with Holm correction and a ranking of units.

Axes: ``unit`` (a head or KV head), ``target``, ``row`` (a row of the targets frame: one unit's
score of one target), ``perm`` (permutation draws), ``phase``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int

from phasemech.core.validation import check_int
from phasemech.interventions.ablation_plan import METRICS, UNIT_KEYS, VALID_MODES, checked_names
from phasemech.measure.stats.omnibus import holm

#: relative tolerance of "a permuted statistic is at least the observed one" (float rounding)
_TIE_RTOL = 1e-9


@runtime_checkable
class Ablated(Protocol):
    """What the tests read of an ablation's result (an
    :class:`~phasemech.interventions.ablation_result.AblationResult`, which builds on this
    module: it names the fields it needs instead of importing it): the targets frame and the
    grid's stride."""

    @property
    def targets(self) -> pd.DataFrame: ...

    @property
    def stride(self) -> int: ...


def _permuted_labels(
    labels: Int[np.ndarray, "target"],
    strata: Int[np.ndarray, "target"],
    n_perm: int,
    rng: np.random.Generator,
) -> Int[np.ndarray, "perm target"]:
    """``n_perm`` permutations of ``labels`` within ``strata`` (each stratum keeps its multiset).

    Vectorised: sorting ``stratum + uniform key`` orders each row by stratum, then at random
    inside it; writing those labels back onto the stratum-sorted positions shuffles within
    strata only.
    """
    base = np.argsort(strata, kind="stable")
    keys = strata[None, :].astype(np.float64) + rng.random((n_perm, len(labels)))
    order = np.argsort(keys, axis=1)
    out = np.empty((n_perm, len(labels)), dtype=labels.dtype)
    out[:, base] = labels[order]
    return out


def _phase_sums(
    effects: Float[np.ndarray, "unit target"], labels: Int[np.ndarray, "perm target"], d: int
) -> Float[np.ndarray, "unit perm phase"]:
    """Per-phase sums of each unit's effects under each labelling (one matmul per chunk)."""
    n_perm, n = labels.shape
    onehot = np.zeros((n, n_perm * d))
    onehot[np.arange(n)[:, None], np.arange(n_perm)[None, :] * d + labels.T] = 1.0
    # torch's matmul: numpy's OpenBLAS takes a slow path on this skinny shape (100x slower)
    sums = torch.from_numpy(np.ascontiguousarray(effects)) @ torch.from_numpy(onehot)
    return sums.numpy().reshape(len(effects), n_perm, d)


def _between_var(
    sums: Float[np.ndarray, "unit perm phase"], n_phase: np.ndarray, grand: np.ndarray
) -> Float[np.ndarray, "unit perm"]:
    """``sum_phi n_phi (mean_phi - grand)^2 / N``: ANOVA's between-phase variance."""
    seen = n_phase > 0
    means = sums[..., seen] / n_phase[seen]
    return ((means - grand[:, None, None]) ** 2 * n_phase[seen]).sum(-1) / n_phase.sum()


def _strata(
    group: np.ndarray, target: np.ndarray, phase: np.ndarray, depth: np.ndarray, d: int
) -> tuple[np.ndarray, str]:
    """Permutation strata: blocks ``(group_id, target)`` when every block holds each phase equally
    often (a phase-balanced set: the shifted copies of one needle), else depth quintiles."""
    block = pd.factorize(pd.MultiIndex.from_arrays([group, target]))[0]
    nb = int(block.max()) + 1
    counts = np.bincount(block * d + phase, minlength=nb * d).reshape(nb, d)
    if (counts[:, 0] >= 1).all() and (counts == counts[:, :1]).all():
        return block, "within_block"
    # ordinal ranks: five equal-size bins even when many depths tie
    rank = np.argsort(np.argsort(depth, kind="stable"), kind="stable")
    return (rank * 5 // len(depth)).astype(np.int64), "depth_quintile"


def _check_frame(
    where: str, data: Any, metric: Any, n_perm: Any, seed: Any, stride: Any
) -> tuple[pd.DataFrame, int, int, int]:
    """Checked ``(targets frame, n_perm, seed, stride)``."""
    if isinstance(data, pd.DataFrame):
        df = data
    elif isinstance(data, Ablated):
        df = data.targets
        stride = data.stride if stride is None else stride
    else:
        raise ValueError(
            f"{where}: data is a {type(data).__name__}: expected an AblationResult or its "
            "targets DataFrame"
        )
    checked_names(where, "metric", metric, METRICS)
    n_perm = check_int(where, "n_perm", n_perm, 1)
    seed = check_int(where, "seed", seed, 0)
    need = [*UNIT_KEYS, "group_id", "target", "phase", "depth", f"{metric}_base", metric]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"{where}: the frame lacks column(s) {missing}: need {need}")
    if len(df) == 0:
        raise ValueError(f"{where}: the frame is empty")
    phase_all = df["phase"].to_numpy()
    if not np.issubdtype(phase_all.dtype, np.integer) or phase_all.min() < 0:
        raise ValueError(f"{where}: column 'phase' must hold ints >= 0")
    if stride is None:
        stride = df.attrs.get("stride", int(phase_all.max()) + 1)
    d = check_int(where, "stride", stride, 2)
    if phase_all.max() >= d:
        raise ValueError(
            f"{where}: column 'phase' has value {int(phase_all.max())} outside [0, stride={d})"
        )
    return df, n_perm, seed, d


@dataclass(frozen=True)
class _UnitRows:
    """The frame's columns as arrays, rows grouped by unit: unit ``u`` owns the rows
    ``order[starts[u]:ends[u]]``, sorted by ``(group_id, seq_id, target)``."""

    order: Int[np.ndarray, "row"]
    starts: Int[np.ndarray, "unit"]
    ends: Int[np.ndarray, "unit"]
    group: Int[np.ndarray, "row"]
    seq: Int[np.ndarray, "row"]
    target: Int[np.ndarray, "row"]
    phase: Int[np.ndarray, "row"]
    depth: Float[np.ndarray, "row"]
    effect: Float[np.ndarray, "row"]  # ablated - baseline

    def of(self, unit: int) -> Int[np.ndarray, "row"]:
        return self.order[self.starts[unit] : self.ends[unit]]


def _unit_rows(df: pd.DataFrame, metric: str) -> _UnitRows:
    codes = df.groupby(UNIT_KEYS, observed=True, sort=True).ngroup().to_numpy()
    seq = df["seq_id"].to_numpy() if "seq_id" in df.columns else np.zeros(len(df), np.int64)
    group, target = df["group_id"].to_numpy(), df["target"].to_numpy()
    order = np.lexsort((target, seq, group, codes))
    starts = np.flatnonzero(np.r_[True, np.diff(codes[order]) != 0])
    ends = np.r_[starts[1:], len(order)]
    effect = df[metric].to_numpy(np.float64) - df[f"{metric}_base"].to_numpy(np.float64)
    phase, depth = df["phase"].to_numpy(), df["depth"].to_numpy(np.float64)
    return _UnitRows(order, starts, ends, group, seq, target, phase, depth, effect)


def _shared_targets(rows: _UnitRows) -> dict[bytes, list[int]]:
    """Units grouped by the targets they were scored on: each group shares one set of
    permutations."""
    groups: dict[bytes, list[int]] = {}
    for u in range(len(rows.starts)):
        r = rows.of(u)
        key = np.stack([rows.group[r], rows.seq[r], rows.target[r], rows.phase[r]]).astype(np.int64)
        digest = hashlib.sha1(key.tobytes() + rows.depth[r].tobytes()).digest()
        groups.setdefault(digest, []).append(u)
    return groups


def _exceedances(
    mat: Float[np.ndarray, "unit target"],
    labels: Int[np.ndarray, "target"],
    strata: Int[np.ndarray, "target"],
    stat: Float[np.ndarray, "unit"],
    n_phase: Float[np.ndarray, "phase"],
    grand: Float[np.ndarray, "unit"],
    d: int,
    n_perm: int,
    rng: np.random.Generator,
) -> Float[np.ndarray, "unit"]:
    """Per unit, how many of ``n_perm`` within-strata relabellings reach the observed ``stat``."""
    exceed = np.zeros(len(mat))
    chunk = max(1, 2**21 // (len(labels) * d))  # onehot chunk of ~16 MB
    for start in range(0, n_perm, chunk):
        perm = _permuted_labels(labels, strata, min(chunk, n_perm - start), rng)
        s_perm = _between_var(_phase_sums(mat, perm, d), n_phase, grand)
        tol = _TIE_RTOL * np.maximum(np.abs(stat), 1e-300)
        exceed += (s_perm >= (stat - tol)[:, None]).sum(1)
    return exceed


def _specialization_index(e_phi: Float[np.ndarray, "unit phase"], d: int) -> np.ndarray:
    """``1 - H(p) / log(d)``, ``p_phi = |e_phi| / sum |e|``; 0 for a unit without effect."""
    mag = np.abs(np.nan_to_num(e_phi))
    total = mag.sum(1, keepdims=True)
    p = np.divide(mag, total, out=np.zeros_like(mag), where=total > 0)
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(1)
    return np.where(total[:, 0] > 0, 1 - entropy / math.log(d), 0.0)


def _test_units(
    rows: _UnitRows,
    units: list[int],
    d: int,
    n_perm: int,
    rng: np.random.Generator,
    out: dict[str, np.ndarray],
) -> None:
    """Writes ``out[column][units]`` for units scored on the same targets."""
    rows0 = rows.of(units[0])
    labels = rows.phase[rows0].astype(np.int64)
    strata, scheme = _strata(rows.group[rows0], rows.target[rows0], labels, rows.depth[rows0], d)
    mat = np.stack([rows.effect[rows.of(u)] for u in units])  # [unit, target]
    n_phase = np.bincount(labels, minlength=d).astype(float)
    grand = mat.mean(1)
    obs_sums = _phase_sums(mat, labels[None], d)[:, 0]  # [unit, phase]
    stat = _between_var(obs_sums[:, None], n_phase, grand)[:, 0]
    exceed = _exceedances(mat, labels, strata, stat, n_phase, grand, d, n_perm, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        e_phi = np.where(n_phase > 0, obs_sums / n_phase, np.nan)
    idx = np.asarray(units)
    out["overall"][idx] = grand
    out["phase_range"][idx] = np.nanmax(e_phi, 1) - np.nanmin(e_phi, 1)
    out["served_phase"][idx] = np.nanargmin(e_phi, 1)
    out["min_effect"][idx] = np.nanmin(e_phi, 1)
    out["si"][idx] = _specialization_index(e_phi, d)
    out["stat"][idx] = stat
    out["p_perm"][idx] = (1 + exceed) / (1 + n_perm)
    out["n"][idx] = len(rows0)
    out["null"][idx] = scheme


def _unit_tests(rows: _UnitRows, d: int, n_perm: int, seed: int) -> dict[str, np.ndarray]:
    """Per-unit statistics and permutation p-values, one array per column."""
    n_units = len(rows.starts)
    stats = ("overall", "phase_range", "served_phase", "min_effect", "si", "stat", "p_perm")
    out = {k: np.full(n_units, np.nan) for k in stats}
    out["n"] = np.zeros(n_units, dtype=np.int64)
    out["null"] = np.empty(n_units, dtype=object)
    rng = np.random.default_rng(seed)
    for units in _shared_targets(rows).values():
        _test_units(rows, units, d, n_perm, rng, out)
    return out


def _ranks(p_perm: np.ndarray, phase_range: np.ndarray) -> Int[np.ndarray, "unit"]:
    # rank 1: smallest p, ties broken by the larger per-phase range
    by = np.lexsort((-np.nan_to_num(phase_range, nan=-np.inf), p_perm))
    rank = np.empty(len(p_perm), dtype=np.int64)
    rank[by] = np.arange(1, len(p_perm) + 1)
    return rank


def _specialization_frame(
    df: pd.DataFrame, metric: str, rows: _UnitRows, out: dict[str, np.ndarray]
) -> pd.DataFrame:
    keys = [*UNIT_KEYS] + (["unit_kind"] * ("unit_kind" in df.columns))
    res = df.iloc[rows.order[rows.starts]][keys].reset_index(drop=True)
    res["metric"] = metric
    res["n"] = out["n"]
    for k in ("overall", "phase_range"):
        res[k] = out[k]
    # a unit whose effect is never negative serves no phase
    served = pd.array(out["served_phase"], dtype="Int64")
    served[~(out["min_effect"] < 0)] = pd.NA
    res["served_phase"] = served
    # floor effects: a unit that wipes out every phase has an effect profile equal to minus the
    # intact profile; base_range vs ablated_range tells that apart from opening a weak spot
    per_phase = df.groupby([*UNIT_KEYS, "phase"], observed=True, sort=True)
    for col, name in ((f"{metric}_base", "base_range"), (metric, "ablated_range")):
        means = per_phase[col].mean().groupby(level=list(UNIT_KEYS), observed=True, sort=True)
        res[name] = (means.max() - means.min()).to_numpy()
    for k in ("si", "stat", "p_perm"):
        res[k] = out[k]
    res["p_holm"] = holm(out["p_perm"])
    res["rank"] = _ranks(out["p_perm"], out["phase_range"])
    res["null"] = pd.Categorical(out["null"], categories=["within_block", "depth_quintile"])
    return res


def specialization(
    data: Ablated | pd.DataFrame,
    metric: str = "accuracy",
    n_perm: int = 1000,
    seed: int = 0,
    *,
    stride: int | None = None,
) -> pd.DataFrame:
    """How much each ablated unit's effect depends on the needle's phase.

    One row per (component, mode, layer, unit): ``n`` targets; ``overall`` (mean effect);
    ``phase_range`` (max - min of the per-phase mean effects ``e_phi``); ``served_phase`` (the
    phase with the most negative ``e_phi``: the phase the unit serves most; ``<NA>`` when no
    ``e_phi`` is negative); ``base_range`` and ``ablated_range`` (max - min over phases of the
    intact and the ablated per-phase means: a unit that wipes out every phase has
    ``e_phi = -baseline_phi``, so its ``phase_range`` only mirrors the intact model's own phase
    profile, while its ``ablated_range`` is small; a unit that *opens* a weak spot has
    ``ablated_range > base_range``); ``si`` (specialization
    index ``1 - H(p) / log(stride)``, ``p_phi = |e_phi| / sum |e|``; 1: one phase carries the whole
    effect, 0: spread evenly or no effect); ``stat`` (between-phase variance
    ``sum_phi n_phi (e_phi - overall)^2 / N``); ``p_perm`` from a permutation test of "the effect
    does not depend on phase" (``null``: within blocks ``(group_id, target)`` when every block
    holds each phase equally often, an exact paired null on phase-balanced sets; else within
    depth quintiles), ``p = (1 + #{stat_perm >= stat}) / (1 + n_perm)``; ``p_holm`` (Holm over
    all rows); ``rank`` (1 = most specialised: by ``p_perm``, then larger ``phase_range``).

    ``data``: an :class:`AblationResult` or its ``targets`` frame; a frame's ``stride`` comes from
    ``stride=``, else ``frame.attrs["stride"]``, else the largest phase + 1.
    """
    df, n_perm, seed, d = _check_frame("specialization", data, metric, n_perm, seed, stride)
    rows = _unit_rows(df, metric)
    return _specialization_frame(df, metric, rows, _unit_tests(rows, d, n_perm, seed))


def rank_heads(
    data: Ablated | pd.DataFrame,
    metric: str = "accuracy",
    n_perm: int = 1000,
    seed: int = 0,
    *,
    mode: str | None = None,
    stride: int | None = None,
) -> pd.DataFrame:
    """:func:`specialization` of the ``head`` ablations only (optionally one ``mode``), Holm and
    ranks taken among those rows, sorted by rank."""
    ablated = not isinstance(data, pd.DataFrame) and isinstance(data, Ablated)
    df = data.targets if ablated else data
    if ablated and stride is None:
        stride = data.stride
    if not isinstance(df, pd.DataFrame) or "component" not in df.columns:
        raise ValueError("rank_heads: data must be an AblationResult or its targets frame")
    keep = df["component"] == "head"
    if mode is not None:
        checked_names("rank_heads", "mode", mode, VALID_MODES["head"])
        keep &= df["mode"] == mode
    if not keep.any():
        raise ValueError(f"rank_heads: no head ablation{'' if mode is None else f' ({mode})'}")
    out = specialization(df[keep], metric=metric, n_perm=n_perm, seed=seed, stride=stride)
    return out.sort_values("rank", ignore_index=True)


__all__ = ["Ablated", "rank_heads", "specialization"]
