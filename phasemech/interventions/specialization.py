"""Which unit serves which phase: a within-stratum permutation test of whether an ablation's
effect depends on the needle's phase (beside it a blocked ANOVA F), with Holm correction and a
ranking of units.

Axes: ``unit`` (a head or KV head), ``target``, ``row`` (a row of the targets frame: one unit's
score of one target), ``perm`` (permutation draws), ``phase``, ``stratum``.

Holm over ``m`` units cannot go below ``m / (n_perm + 1)`` with ``n_perm`` draws per unit (540
heads x modes at 1000 draws: 0.539, no unit can ever be significant). ``n_perm="auto"`` sizes
the draws to the number of units (:data:`AUTO_HOLM_FLOOR`) and stops a unit early once it is
clearly null (Besag & Clifford's sequential p-value), so the cost stays that of the few units
that are not.
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
from phasemech.measure.stats.anova import blocked_phase_anova
from phasemech.measure.stats.omnibus import holm

#: relative tolerance of "a permuted statistic is at least the observed one" (float rounding)
_TIE_RTOL = 1e-9
#: ``n_perm="auto"``: the most draws per unit are ``ceil(m / AUTO_HOLM_FLOOR) - 1``, so that
#: the smallest attainable Holm p over ``m`` units, ``m / (n_max + 1)``, is at most this
AUTO_HOLM_FLOOR = 1e-3
#: ``n_perm="auto"``: a unit stops once this many draws reach its statistic (then
#: ``p = h / draws``: Besag & Clifford 1991); a null unit stops after ~``h / p`` draws
STOP_EXCEEDANCES = 10
#: ``n_perm="auto"``: the first round's draws; each later round doubles
_FIRST_ROUND = 64


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
) -> tuple[pd.DataFrame, int | str, int, int]:
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
    if n_perm != "auto":
        if isinstance(n_perm, str):
            raise ValueError(
                f"{where}: n_perm={n_perm!r} is invalid: must be an int >= 1 or 'auto'"
            )
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


@dataclass(frozen=True)
class _Null:
    """One group's permutation null: what every draw compares against."""

    mat: Float[np.ndarray, "unit target"]
    labels: Int[np.ndarray, "target"]
    strata: Int[np.ndarray, "target"]
    stat: Float[np.ndarray, "unit"]
    n_phase: Float[np.ndarray, "phase"]
    grand: Float[np.ndarray, "unit"]  # each unit's mean effect: the same under every labelling
    d: int

    def hits(self, units: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """``[unit, perm]``: whether each of ``n`` fresh relabellings reaches ``stat``
        (``units``: sorted indices; all of them read the matrix without a copy)."""
        perm = _permuted_labels(self.labels, self.strata, n, rng)
        mat = self.mat if len(units) == len(self.mat) else self.mat[units]
        s_perm = _between_var(_phase_sums(mat, perm, self.d), self.n_phase, self.grand[units])
        stat = self.stat[units]
        return s_perm >= (stat - _TIE_RTOL * np.maximum(np.abs(stat), 1e-300))[:, None]

    def chunk(self) -> int:
        return max(1, 2**21 // (len(self.labels) * self.d))  # onehot chunk of ~16 MB


def _exceedances(null: _Null, n_perm: int, rng: np.random.Generator) -> Float[np.ndarray, "unit"]:
    """Per unit, how many of ``n_perm`` within-strata relabellings reach the observed ``stat``."""
    exceed = np.zeros(len(null.mat))
    every = np.arange(len(null.mat))
    for start in range(0, n_perm, null.chunk()):
        exceed += null.hits(every, min(null.chunk(), n_perm - start), rng).sum(1)
    return exceed


def _sequential(
    null: _Null, n_max: int, rng: np.random.Generator
) -> tuple[Float[np.ndarray, "unit"], Int[np.ndarray, "unit"]]:
    """Besag & Clifford's sequential test: ``(p, draws)`` per unit. Each unit draws until
    :data:`STOP_EXCEEDANCES` relabellings reach its statistic (``p = h / draws``) or until
    ``n_max`` draws (``p = (1 + exceed) / (1 + n_max)``). The undecided units share each
    round's relabellings (one matmul); rounds double, so a null unit costs a few rounds."""
    n_units, h = len(null.mat), STOP_EXCEEDANCES
    exceed = np.zeros(n_units, dtype=np.int64)
    draws = np.zeros(n_units, dtype=np.int64)
    stopped = np.zeros(n_units, dtype=bool)
    live, done, size = np.arange(n_units), 0, _FIRST_ROUND
    while live.size and done < n_max:
        n = min(size, n_max - done, null.chunk())
        count = exceed[live, None] + np.cumsum(null.hits(live, n, rng), 1)
        stop = count[:, -1] >= h
        # the draw at which the h-th exceedance came: later draws of a stopped unit are unused
        first = np.argmax(count >= h, 1)
        draws[live] = done + np.where(stop, first + 1, n)
        exceed[live] = np.where(stop, h, count[:, -1])
        stopped[live] = stop
        live, done, size = live[~stop], done + n, size * 2
    p = np.where(stopped, h / np.maximum(draws, 1), (1 + exceed) / (1 + n_max))
    return p, draws


def _log_relabellings(strata: np.ndarray, labels: np.ndarray, d: int) -> float:
    """``log |G|``: the number of distinct within-strata relabellings (a multinomial per
    stratum); an exact permutation p cannot go below ``1 / |G|``."""
    ns = int(strata.max()) + 1
    counts = np.bincount(strata * d + labels, minlength=ns * d).reshape(ns, d)
    lg = np.vectorize(math.lgamma)
    return float((lg(counts.sum(1) + 1.0) - lg(counts + 1.0).sum(1)).sum())


def _specialization_index(e_phi: Float[np.ndarray, "unit phase"], d: int) -> np.ndarray:
    """``1 - H(p) / log(d)``, ``p_phi = |e_phi| / sum |e|``; 0 for a unit without effect."""
    mag = np.abs(np.nan_to_num(e_phi))
    total = mag.sum(1, keepdims=True)
    p = np.divide(mag, total, out=np.zeros_like(mag), where=total > 0)
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(1)
    return np.where(total[:, 0] > 0, 1 - entropy / math.log(d), 0.0)


def _permutation_p(
    null: _Null, n_perm: int | str, n_max: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(p_perm, draws)``: a fixed ``n_perm`` draws, or sequential up to ``n_max``."""
    if n_perm == "auto":
        return _sequential(null, n_max, rng)
    exceed = _exceedances(null, n_perm, rng)
    return (1 + exceed) / (1 + n_perm), np.full(len(exceed), n_perm)


def _test_units(
    rows: _UnitRows,
    units: list[int],
    d: int,
    n_perm: int | str,
    n_max: int,
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
    null = _Null(mat, labels, strata, stat, n_phase, grand, d)
    p_perm, draws = _permutation_p(null, n_perm, n_max, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        e_phi = np.where(n_phase > 0, obs_sums / n_phase, np.nan)
    idx = np.asarray(units)
    out["overall"][idx] = grand
    out["phase_range"][idx] = np.nanmax(e_phi, 1) - np.nanmin(e_phi, 1)
    out["served_phase"][idx] = np.nanargmin(e_phi, 1)
    out["min_effect"][idx] = np.nanmin(e_phi, 1)
    out["si"][idx] = _specialization_index(e_phi, d)
    out["stat"][idx] = stat
    out["p_perm"][idx] = p_perm
    out["n_perm"][idx] = draws
    # the Monte Carlo floor, or the exact test's where the strata allow fewer relabellings
    floor = max(1 / (1 + (n_max if n_perm == "auto" else n_perm)), math.exp(-min(
        _log_relabellings(strata, labels, d), 700.0)))  # fmt: skip
    out["p_floor"][idx] = floor
    out["f_stat"][idx], out["p_anova"][idx], _ = blocked_phase_anova(mat, labels, strata, d)
    out["n"][idx] = len(rows0)
    out["null"][idx] = scheme


def auto_draws(n_units: int) -> int:
    """``n_perm="auto"``'s most draws per unit for ``n_units`` tests: the Holm floor
    ``n_units / (n_max + 1)`` at most :data:`AUTO_HOLM_FLOOR` (and never under 999 draws)."""
    return max(999, math.ceil(n_units / AUTO_HOLM_FLOOR) - 1)


def _unit_tests(rows: _UnitRows, d: int, n_perm: int | str, seed: int) -> dict[str, np.ndarray]:
    """Per-unit statistics and permutation p-values, one array per column."""
    n_units = len(rows.starts)
    stats = ("overall", "phase_range", "served_phase", "min_effect", "si", "stat", "p_perm",
             "p_floor", "f_stat", "p_anova")  # fmt: skip
    out = {k: np.full(n_units, np.nan) for k in stats}
    out["n"] = np.zeros(n_units, dtype=np.int64)
    out["n_perm"] = np.zeros(n_units, dtype=np.int64)
    out["null"] = np.empty(n_units, dtype=object)
    rng = np.random.default_rng(seed)
    n_max = auto_draws(n_units)
    for units in _shared_targets(rows).values():
        _test_units(rows, units, d, n_perm, n_max, rng, out)
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
    res["n_perm"] = out["n_perm"]
    res["p_floor"] = out["p_floor"]
    # Holm's first step multiplies by m: no row's adjusted p can be smaller
    res["p_holm_floor"] = np.minimum(1.0, len(res) * out["p_floor"])
    res["f_stat"] = out["f_stat"]
    res["p_anova"] = out["p_anova"]
    res["p_anova_holm"] = holm(np.nan_to_num(out["p_anova"], nan=1.0))
    res["rank"] = _ranks(out["p_perm"], out["phase_range"])
    res["null"] = pd.Categorical(out["null"], categories=["within_block", "depth_quintile"])
    return res


def specialization(
    data: Ablated | pd.DataFrame,
    metric: str = "accuracy",
    n_perm: int | str = 1000,
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
    all rows); ``n_perm`` (the draws the unit used); ``p_floor`` (the smallest ``p_perm`` the
    test can give: ``1 / (1 + most draws)``, or ``1 / |G|`` where the strata allow fewer
    distinct relabellings ``|G|``: there the floor is the exact test's, which random draws with
    replacement can undershoot by chance) and ``p_holm_floor`` (``m * p_floor`` over the ``m``
    rows: Holm's smallest attainable value; with ``"auto"`` a unit's draws depend on ``m``, so
    one unit's p differs between frames that hold different units); ``f_stat``, ``p_anova``,
    ``p_anova_holm`` (the blocked
    ANOVA F for phase on the same strata, :func:`~phasemech.measure.stats.anova.
    blocked_phase_anova`: a parametric check of ``p_perm``, and its Holm); ``rank`` (1 = most
    specialised: by ``p_perm``, then larger ``phase_range``).

    ``n_perm``: an int (that many draws for every unit, as before), or ``"auto"``: at most
    :func:`auto_draws` ``(m)`` draws, so ``p_holm_floor <= AUTO_HOLM_FLOOR``, with sequential
    stopping (a unit stops at :data:`STOP_EXCEEDANCES` draws reaching its statistic, ``p = h /
    draws``; the others run to the most draws, ``p = (1 + exceed) / (1 + n_max)``).

    ``data``: an :class:`AblationResult` or its ``targets`` frame; a frame's ``stride`` comes from
    ``stride=``, else ``frame.attrs["stride"]``, else the largest phase + 1.
    """
    df, n_perm, seed, d = _check_frame("specialization", data, metric, n_perm, seed, stride)
    rows = _unit_rows(df, metric)
    return _specialization_frame(df, metric, rows, _unit_tests(rows, d, n_perm, seed))


def floor_note(spec: pd.DataFrame) -> str:
    """One sentence for a page that shows ``spec``'s p-values: how many units Holm ran over
    and the smallest ``p_perm`` / ``p_holm`` the test could give (a table written before
    ``p_floor`` existed says so)."""
    if not isinstance(spec, pd.DataFrame) or "p_holm" not in spec.columns:
        raise ValueError("floor_note: spec must be a specialization() frame (with p_holm)")
    if "p_floor" not in spec.columns:
        return (
            f"Holm over {len(spec)} rows; smallest attainable p not recorded (a table from "
            "before p_floor: with n fixed draws it is 1/(n+1), times the rows for Holm)."
        )
    groups = spec.groupby("metric", observed=True) if "metric" in spec.columns else [("", spec)]
    parts = []
    for metric, g in groups:
        name = f"{metric}: " if metric else ""
        parts.append(
            f"{name}Holm over {len(g)} units, smallest attainable p {g.p_floor.min():.2g}, "
            f"Holm p {g.p_holm_floor.min():.2g} (up to {int(g.n_perm.max())} permutations)"
        )
    return "; ".join(parts) + "."


def rank_heads(
    data: Ablated | pd.DataFrame,
    metric: str = "accuracy",
    n_perm: int | str = 1000,
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


__all__ = [
    "AUTO_HOLM_FLOOR",
    "STOP_EXCEEDANCES",
    "Ablated",
    "auto_draws",
    "rank_heads",
    "specialization",
]
