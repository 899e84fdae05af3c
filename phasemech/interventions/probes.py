"""Linear phase probes: does the residual stream linearly encode a token's phase?

Axes: ``batch`` (sequences), ``pos`` (token positions), ``layer``, ``phase`` (a token's offset in
its compression chunk, ``(pos - offset) mod stride``), ``row`` (one ``(sequence, position)``
sample of a probe).

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
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from torch import Tensor
from transformer_lens import HookedTransformer

from phasemech.core.config import is_int
from phasemech.core.device import model_device
from phasemech.core.grid import reference_grid
from phasemech.core.io import atomic_write
from phasemech.core.validation import check_int


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


def grouped_cross_validate(
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


def _check_options(
    random_grid: Any, seed: Any, max_rows: Any, batch_size: Any
) -> tuple[int, int, int]:
    if not isinstance(random_grid, bool):
        raise ValueError(f"phase_probe: random_grid={random_grid!r} is invalid: True or False")
    seed = check_int("phase_probe", "seed", seed, 0)
    max_rows = check_int("phase_probe", "max_rows", max_rows, 1)
    batch_size = check_int("phase_probe", "batch_size", batch_size, 1)
    return seed, max_rows, batch_size


def _check_positions(positions: Any, seq: int, stride: int) -> np.ndarray:
    positions = np.asarray(_check_index_list("positions", positions, seq, "positions"))
    if len(np.unique(positions % stride)) < 2:
        raise ValueError(
            f"phase_probe: positions={positions.tolist()} cover one residue mod stride={stride}: "
            "the pos_mod_d control needs at least two"
        )
    return positions


@dataclass(frozen=True)
class _Rows:
    """The probed ``(sequence, position)`` samples, their labels, and each sequence's grid
    shift ``s_b``."""

    seq: Int[np.ndarray, "row"]
    pos: Int[np.ndarray, "row"]
    labels: dict[str, Int[np.ndarray, "row"]]  # "phase" and the "pos_mod_d" control
    shifts: Int[np.ndarray, "batch"]


def _sample_rows(
    batch: int,
    positions: np.ndarray,
    stride: int,
    grid_offset: int,
    random_grid: bool,
    seed: int,
    max_rows: int,
    cv: int,
) -> _Rows:
    """At most ``max_rows`` rows (a seeded subsample), labelled on the shifted grid."""
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
    return _Rows(seq=row_seq, pos=row_pos, labels=labels, shifts=shifts)


def _sites(layers: list[int], n_layers: int) -> list[tuple[str, str, int]]:
    """``(site, hook name, blocks applied before it)``: the chosen ``resid_pre`` and the final
    ``resid_post``."""
    sites = [(f"resid_pre.{i}", f"blocks.{i}.hook_resid_pre", i) for i in layers]
    sites.append((f"resid_post.{n_layers - 1}", f"blocks.{n_layers - 1}.hook_resid_post", n_layers))
    return sites


def _shifted_grid(model: HookedTransformer, shifts: np.ndarray, device: Any) -> Any:
    if not hasattr(model, "shift_grid"):  # a dense HookedTransformer: no grid to shift
        return contextlib.nullcontext()
    return model.shift_grid(torch.as_tensor(shifts, device=device))


def _residuals(
    model: HookedTransformer,
    tokens: Int[Tensor, "batch pos"],
    hook_names: list[str],
    rows: _Rows,
    batch_size: int,
) -> dict[str, list[np.ndarray]]:
    """Per hook, the residual stream at the probed rows (``[row, d_model]`` pieces in row
    order), each sequence run on its shifted grid."""
    feats: dict[str, list[np.ndarray]] = {hook: [] for hook in hook_names}
    # the parameters' device: cfg.device can say "cuda" for a model that was never moved there
    device = model_device(model)
    batch = tokens.shape[0]
    was_training = model.training
    model.eval()  # a training forward would draw its own random offsets
    try:
        with torch.inference_mode():
            for start in range(0, batch, batch_size):
                stop = min(start + batch_size, batch)
                sel = (rows.seq >= start) & (rows.seq < stop)
                if not sel.any():
                    continue
                b_idx = torch.as_tensor(rows.seq[sel] - start, device=device)
                p_idx = torch.as_tensor(rows.pos[sel], device=device)
                with _shifted_grid(model, rows.shifts[start:stop], device):
                    _, cache = model.run_with_cache(
                        tokens[start:stop].to(device), names_filter=hook_names, return_type=None
                    )
                for hook in hook_names:
                    feats[hook].append(cache[hook][b_idx, p_idx].float().cpu().numpy())
                del cache
    finally:
        model.train(was_training)
    return feats


def _probe_scores(
    x: np.ndarray, y: np.ndarray, groups: np.ndarray, stride: int, cv: int
) -> dict[str, Any]:
    """``accuracy, std, chance, n, p_value`` of one probe."""
    chance = max(1.0 / stride, float(np.bincount(y).max()) / len(y))
    acc, std, hits = grouped_cross_validate(x, y, groups, cv)
    p = sps.binomtest(hits, len(y), chance, alternative="greater").pvalue
    return {"accuracy": acc, "std": std, "chance": chance, "n": len(y), "p_value": float(p)}


def _probe_frame(
    model: HookedTransformer,
    sites: list[tuple[str, str, int]],
    feats: dict[str, list[np.ndarray]],
    rows: _Rows,
    stride: int,
    cv: int,
) -> pd.DataFrame:
    n_layers = model.cfg.n_layers
    comp = getattr(model.cfg, "compression", None)
    compressed = comp.compressed_layers(n_layers) if comp is not None else []
    out = []
    for site, hook, depth in sites:
        x = np.concatenate(feats[hook])
        for name, y in rows.labels.items():
            out.append(
                {
                    "site": site,
                    "layer": depth,
                    "after_compressed": any(c < depth for c in compressed),
                    "label": name,
                    **_probe_scores(x, y, rows.seq, stride, cv),
                }
            )
    return pd.DataFrame(out).astype({"layer": "int64", "n": "int64"})


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
            (:func:`phasemech.core.grid.reference_grid`).
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
    seed, max_rows, batch_size = _check_options(random_grid, seed, max_rows, batch_size)
    tokens = _check_tokens(model, tokens, cv)
    layers = _check_index_list("layers", layers, model.cfg.n_layers, "layers")
    positions = _check_positions(positions, tokens.shape[1], stride)
    batch = len(tokens)
    rows = _sample_rows(batch, positions, stride, grid_offset, random_grid, seed, max_rows, cv)
    sites = _sites(layers, model.cfg.n_layers)
    feats = _residuals(model, tokens, [hook for _, hook, _ in sites], rows, batch_size)
    frame = _probe_frame(model, sites, feats, rows, stride, cv)
    return ProbeResult(frame=frame, stride=stride, grid_offset=grid_offset, random_grid=random_grid)


__all__ = ["ProbeResult", "grouped_cross_validate", "phase_probe"]
