"""The output of :func:`phasemech.interventions.ablation.ablate`: per-target scores, per-phase
effects with cluster-bootstrap intervals, and their folder on disk.

Axes: ``target`` (answers of the dataset, sequence-major), ``layer``, ``unit`` (a head or a KV
head), ``metric``, ``phase`` (the needle's offset inside its compression chunk), ``cluster``
(a content: the ``group_id`` shared by the shifted copies of one needle), ``replicate``
(bootstrap draws), ``run`` (one ablation).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, write_json_atomic
from phasemech.interventions.ablation_plan import (
    COMPONENTS,
    METRICS,
    MODES,
    UNIT_KINDS,
    AblationRun,
    checked_names,
    unit_kind,
)
from phasemech.interventions.specialization import specialization


@dataclass(frozen=True, eq=False)  # frames inside: == would be ambiguous
class AblationResult:
    """Output of :func:`ablate`.

    ``targets``: one row per (component, mode, layer, unit, target) with ``unit_kind``,
    ``seq_id, group_id, target, phase, depth`` and the metrics ``accuracy_base, accuracy,
    logprob_base, logprob, logit_diff_base, logit_diff`` (baseline and ablated).
    ``effects``: one row per (component, mode, layer, unit, metric, phase) with ``effect`` (mean of
    ablated - baseline), its cluster-bootstrap percentile interval ``ci_low, ci_high``, ``n``
    targets, and the per-phase means ``baseline`` and ``ablated``.
    """

    targets: pd.DataFrame
    effects: pd.DataFrame
    stride: int
    grid_offset: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    design: str

    def tensor(
        self, metric: str = "accuracy", component: str = "head", mode: str = "zero"
    ) -> np.ndarray:
        """Per-phase mean effects ``[layer, unit, phase]`` over all the model's layers (NaN for
        layers, or phases, without that ablation)."""
        where = "AblationResult.tensor"
        checked_names(where, "metric", metric, METRICS)
        checked_names(where, "component", component, COMPONENTS)
        checked_names(where, "mode", mode, MODES)
        e = self.effects
        sel = e[(e.metric == metric) & (e.component == component) & (e["mode"] == mode)]
        if sel.empty:
            have = e[["component", "mode"]].drop_duplicates().astype(str)
            raise ValueError(
                f"{where}: no ({component!r}, {mode!r}) ablation in this result: it holds "
                f"{sorted(map(tuple, have.to_numpy().tolist()))}"
            )
        kind = unit_kind(component, mode)
        n_units = self.n_heads if kind == "head" else self.n_kv_heads
        out = np.full((self.n_layers, n_units, self.stride), np.nan)
        out[sel.layer.to_numpy(), sel.unit.to_numpy(), sel.phase.to_numpy()] = sel.effect.to_numpy()
        return out

    def specialization(
        self, metric: str = "accuracy", n_perm: int | str = 1000, seed: int = 0
    ) -> pd.DataFrame:
        """:func:`specialization` of this result."""
        return specialization(self, metric=metric, n_perm=n_perm, seed=seed)

    def save(self, folder: str | Path, specialization: pd.DataFrame | None = None) -> Path:
        """Write ``targets.parquet``, ``effects.parquet``, ``specialization.parquet`` (the given
        frame, else :meth:`specialization` with its defaults: accuracy, 1000 permutations, seed
        0) and ``ablation.json`` (grid and model shape) under ``folder``."""
        folder = Path(folder)
        # computed before any write: a failure leaves no partial folder
        spec = self.specialization() if specialization is None else specialization
        folder.mkdir(parents=True, exist_ok=True)
        for name, df in (
            ("targets", self.targets),
            ("effects", self.effects),
            ("specialization", spec),
        ):
            atomic_write(folder / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
        meta = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        write_json_atomic(folder / "ablation.json", {k: meta[k] for k in _META})
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> AblationResult:
        """Read a folder written by :meth:`save`."""
        folder = Path(folder)
        files = [folder / "ablation.json", folder / "targets.parquet", folder / "effects.parquet"]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} is missing: not an ablation folder")
        meta = json.loads(files[0].read_text())
        return cls(pd.read_parquet(files[1]), pd.read_parquet(files[2]), **meta)


_META = ("stride", "grid_offset", "n_layers", "n_heads", "n_kv_heads", "design")


def _run_columns(runs: list[AblationRun], repeat: int) -> dict[str, Any]:
    """``component, mode, layer, unit, unit_kind`` of each run, each repeated ``repeat`` times."""

    def cat(values: list[str], categories: tuple[str, ...]) -> pd.Categorical:
        codes = np.repeat([categories.index(v) for v in values], repeat).astype(np.int8)
        return pd.Categorical.from_codes(codes, categories=list(categories))

    return {
        "component": cat([r.component for r in runs], COMPONENTS),
        "mode": cat([r.mode for r in runs], MODES),
        "layer": np.repeat([r.layer for r in runs], repeat).astype(np.int16),
        "unit": np.repeat([r.unit for r in runs], repeat).astype(np.int16),
        "unit_kind": cat([r.kind for r in runs], UNIT_KINDS),
    }


def ablation_targets_frame(
    runs: list[AblationRun],
    frame: pd.DataFrame,
    base: np.ndarray,
    ablated: np.ndarray,
    stride: int,
    grid_offset: int,
) -> pd.DataFrame:
    """One row per (run, target): the run's unit, the target's phase and depth, and each
    metric's base and ablated value (the ``targets`` table of :class:`AblationResult`)."""
    n_runs, n = len(runs), len(frame)
    cols = _run_columns(runs, n)
    for c, dtype in (
        ("seq_id", np.int32),
        ("group_id", np.int32),
        ("target", np.int16),
        ("phase", np.int16),
        ("depth", np.float32),
    ):
        cols[c] = np.tile(frame[c].to_numpy().astype(dtype), n_runs)
    for m, metric in enumerate(METRICS):
        dtype = np.int8 if metric == "accuracy" else np.float32
        cols[f"{metric}_base"] = np.tile(base[m].astype(dtype), n_runs)
        cols[metric] = ablated[:, m].reshape(-1).astype(dtype)
    out = pd.DataFrame(cols)
    out.attrs = {"stride": int(stride), "grid_offset": int(grid_offset)}
    return out


def _bootstrap_weights(n_clusters: int, n_boot: int, seed: int) -> np.ndarray | None:
    """``[replicate, cluster]`` multinomial counts of each cluster in each replicate."""
    if not n_boot:
        return None
    rng = np.random.default_rng([seed, 1])
    uniform = np.full(n_clusters, 1 / n_clusters)
    return rng.multinomial(n_clusters, uniform, size=n_boot).astype(float)


def _cell_sums(
    ablated: np.ndarray, base64: np.ndarray, cell: np.ndarray, n_cells: int
) -> np.ndarray:
    """Sums of ``ablated - base`` per ``[run, metric, cell]``, all in one bincount."""
    diff = ablated.astype(np.float64) - base64[None]  # [run, metric, target]
    n_runs, rows, n = diff.shape
    k = n_runs * rows
    idx = (np.arange(k)[:, None] * n_cells + cell[None, :]).ravel()
    sums = np.bincount(idx, weights=diff.reshape(k, n).ravel(), minlength=k * n_cells)
    return sums.reshape(n_runs, rows, n_cells)


def phase_effects(
    runs: list[AblationRun],
    frame: pd.DataFrame,
    base: np.ndarray,
    ablated: np.ndarray,
    stride: int,
    n_boot: int,
    seed: int,
) -> pd.DataFrame:
    """Per-phase mean effects with cluster-bootstrap (contents) percentile 95% intervals.

    Every run scores the same targets, so one set of bootstrap cluster weights serves all runs
    and metrics: a replicate's per-phase sums are ``w @ S`` over the per-(cluster, phase) sums.
    """
    d = stride
    cluster = pd.factorize(frame["group_id"].to_numpy())[0]
    n_clusters = int(cluster.max()) + 1
    phase = frame["phase"].to_numpy()
    flat = cluster * d + phase
    n_cp = np.bincount(flat, minlength=n_clusters * d).reshape(n_clusters, d).astype(float)
    n_phase = n_cp.sum(0)
    weights = _bootstrap_weights(n_clusters, n_boot, seed)
    base64 = base.astype(np.float64)
    rows = len(METRICS)
    effect, lo, hi, mean_base, mean_abl = (np.full((len(runs), rows, d), np.nan) for _ in range(5))
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_base[:] = np.stack(
            [np.bincount(phase, weights=base64[m], minlength=d) / n_phase for m in range(rows)]
        )[None]
        den = None if weights is None else weights @ n_cp  # [replicate, phase]
        # chunks of runs: [runs, metric, replicate, phase] stays a few tens of MB
        step = max(1, 2**22 // max(1, rows * max(n_boot, 1) * d))
        for start in range(0, len(runs), step):
            chunk = slice(start, min(start + step, len(runs)))
            sums = _cell_sums(ablated[chunk], base64, flat, n_clusters * d)
            sums = sums.reshape(sums.shape[0], rows, n_clusters, d)
            effect[chunk] = sums.sum(2) / n_phase
            mean_abl[chunk] = mean_base[chunk] + effect[chunk]
            if weights is not None:
                boot = np.einsum("bc,rmcd->rmbd", weights, sums) / den
                lo[chunk], hi[chunk] = _nan_quantiles(boot, axis=2)
    per_phase = {"effect": effect, "ci_low": lo, "ci_high": hi}
    return _effects_frame(runs, per_phase, n_phase, mean_base, mean_abl)


def _effects_frame(
    runs: list[AblationRun],
    per_phase: dict[str, np.ndarray],
    n_phase: np.ndarray,
    mean_base: np.ndarray,
    mean_abl: np.ndarray,
) -> pd.DataFrame:
    """One row per (run, metric, phase) from ``[run, metric, phase]`` arrays."""
    rows, d = mean_base.shape[1:]
    cols = _run_columns(runs, rows * d)
    cols["metric"] = pd.Categorical.from_codes(
        np.tile(np.repeat(np.arange(rows), d), len(runs)).astype(np.int8), categories=METRICS
    )
    cols["phase"] = np.tile(np.arange(d), len(runs) * rows).astype(np.int16)
    for name, values in per_phase.items():
        cols[name] = values.ravel()
    cols["n"] = np.tile(n_phase.astype(np.int64), len(runs) * rows)
    cols["baseline"] = mean_base.ravel()
    cols["ablated"] = mean_abl.ravel()
    return pd.DataFrame(cols)


def _nan_quantiles(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a phase absent from a replicate: NaN
        lo, hi = np.nanquantile(x, [0.025, 0.975], axis=axis)
    return lo, hi


__all__ = ["AblationResult", "ablation_targets_frame", "phase_effects"]
