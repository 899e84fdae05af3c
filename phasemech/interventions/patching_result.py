"""The output of the activation-patching engines (``patching.patch_sites``,
``patching_fast.patch_heads`` in :mod:`phasemech.interventions`): the patched metric of every
pair for every patch, its effects per unit and per needle phase, and its folder on disk.

Axes: ``layer``, ``pos`` (length 1 for all-position patches), ``unit`` (a head, or a KV head
for ``kv_block``), ``batch`` / ``pair`` (one clean/corrupted pair), ``phase`` (the clean
needle's phase), ``boot`` (cluster-bootstrap draws; clusters: ``group_id``, one content).

Effects are reported raw (patched minus corrupted) and normalised, ``(patched - corrupted) /
(clean - corrupted)`` on group means, 1 = fully restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from phasemech.core.io import atomic_write, write_json_atomic


@dataclass(frozen=True)
class PatchResult:
    """Patched metric of every pair for every patch.

    ``values`` is ``[layer, pos, unit, batch]`` (``pos`` has length 1 for all-position patches;
    ``unit`` is a head, or a KV head for ``kv_block``; ``NaN`` for layers not patched).
    :meth:`tensor` gives TransformerLens' output (mean over pairs): ``[layer, unit]`` or
    ``[layer, pos, unit]``.
    """

    site: str
    by_pos: bool
    metric: str
    contrast: str
    stride: int
    values: np.ndarray
    clean: np.ndarray  # [batch]
    corrupted: np.ndarray  # [batch]
    pairs: pd.DataFrame  # one row per pair, with foil, clean, corrupted
    layers: tuple[int, ...]
    n_run: int  # patched copies actually run (the rest are exact by causality or identity)

    def _mean(self) -> np.ndarray:
        """``[layer, pos, unit]`` mean patched metric over pairs (``NaN`` on unpatched layers)."""
        out = np.full(self.values.shape[:-1], np.nan)
        out[list(self.layers)] = self.values[list(self.layers)].mean(-1)
        return out

    def tensor(self) -> Float[Tensor, "..."]:
        out = torch.as_tensor(self._mean())
        return out if self.by_pos else out[:, 0]

    def frame(self) -> pd.DataFrame:
        """One row per (layer, [pos,] unit): mean patched metric, raw effect and normalised."""
        n_layers, n_pos, n_unit, _ = self.values.shape
        layer, pos, unit = np.meshgrid(
            np.arange(n_layers), np.arange(n_pos), np.arange(n_unit), indexing="ij"
        )
        mean = self._mean()
        denom = self.clean.mean() - self.corrupted.mean()
        df = pd.DataFrame(
            {
                "layer": layer.ravel(),
                "pos": pos.ravel(),
                "unit": unit.ravel(),
                "patched": mean.ravel(),
                "effect": (mean - self.corrupted.mean()).ravel(),
                "normalized": ((mean - self.corrupted.mean()) / denom).ravel(),
            }
        )
        df = df[df.layer.isin(self.layers)].reset_index(drop=True)
        return df if self.by_pos else df.drop(columns="pos")

    def by_phase(self, n_boot: int = 1000, seed: int = 0, phase_col: str = "phase") -> pd.DataFrame:
        """Per (layer, [pos,] unit, phase of the clean needle): raw effect with a 95% cluster
        bootstrap CI (clusters: ``group_id``, i.e. one content), normalised effect
        ``(patched - corrupted) / (clean - corrupted)`` on the phase's means, and ``n``."""
        if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 0:
            raise ValueError(f"n_boot={n_boot!r} is invalid: expected an int >= 0 (0: no CIs)")
        phase = self.pairs[phase_col].to_numpy()
        groups = pd.factorize(self.pairs["group_id"])[0]
        rng = np.random.default_rng(seed)
        out = []
        vals = self.values[list(self.layers)]  # [L', pos, unit, batch]
        for ph in range(self.stride):
            sel = np.flatnonzero(phase == ph)
            if not len(sel):
                continue
            g = groups[sel]
            ug, inv = np.unique(g, return_inverse=True)
            # cluster bootstrap weights: how often each group is drawn
            draws = rng.integers(0, len(ug), size=(n_boot, len(ug)))
            w = np.zeros((n_boot, len(ug)))
            np.add.at(w, (np.arange(n_boot)[:, None], draws), 1.0)
            w = w[:, inv]
            w = w / w.sum(1, keepdims=True)  # [boot, n]
            eff = vals[..., sel] - self.corrupted[sel]  # [L', pos, unit, n]
            if n_boot:
                lo, hi = np.nanpercentile(eff @ w.T, [2.5, 97.5], axis=-1)  # w: [boot, n]
            else:
                lo = hi = np.full(eff.shape[:-1], np.nan)
            denom = self.clean[sel].mean() - self.corrupted[sel].mean()
            mean = eff.mean(-1)
            for idx in np.ndindex(mean.shape):
                out.append(
                    (
                        self.layers[idx[0]],
                        idx[1],
                        idx[2],
                        ph,
                        mean[idx],
                        lo[idx],
                        hi[idx],
                        mean[idx] / denom if denom != 0 else np.nan,
                        len(sel),
                        denom,
                    )
                )
        cols = [
            "layer",
            "pos",
            "unit",
            "phase",
            "effect",
            "ci_low",
            "ci_high",
            "normalized",
            "n",
            "clean_minus_corrupted",
        ]
        df = pd.DataFrame(out, columns=cols)
        return df if self.by_pos else df.drop(columns="pos")

    def long(self) -> pd.DataFrame:
        """Every patched run: ``layer, pos, unit, pair, value`` (patched layers only)."""
        lay = np.asarray(self.layers)
        vals = self.values[lay]
        idx = np.indices(vals.shape).reshape(4, -1)
        return pd.DataFrame(
            {
                "layer": lay[idx[0]].astype(np.int16),
                "pos": idx[1].astype(np.int16),
                "unit": idx[2].astype(np.int16),
                "pair": idx[3].astype(np.int32),
                "value": vals.ravel(),
            }
        )

    def save(self, folder: str | Path, n_boot: int = 1000, seed: int = 0) -> Path:
        """``effects.parquet`` (:meth:`frame`), ``by_phase.parquet``, ``pairs.parquet``,
        ``values.parquet`` (:meth:`long`) and ``patch.json`` under ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tables = {
            "effects": self.frame(),
            "by_phase": self.by_phase(n_boot=n_boot, seed=seed),
            "pairs": self.pairs,
            "values": self.long(),
        }
        for name, df in tables.items():
            atomic_write(folder / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
        meta = {
            "site": self.site,
            "by_pos": self.by_pos,
            "metric": self.metric,
            "contrast": self.contrast,
            "stride": self.stride,
            "layers": list(self.layers),
            "n_run": self.n_run,
            "clean_mean": float(self.clean.mean()),
            "corrupted_mean": float(self.corrupted.mean()),
        }
        write_json_atomic(folder / "patch.json", meta)
        return folder
