"""Attention mass per (layer, head, source phase).

Axes: ``layer, head, phase`` for results; ``batch, head, pos, key_pos`` for token patterns.

For every layer the token pattern ``m[batch, head, query_pos, key_pos]`` (``hook_token_pattern``
on compressed layers, ``hook_pattern`` on dense ones) is reduced over source phases. A compressed
head's phases are those of its own grid in that forward (``hook_grid_offset``: per-layer,
per-head and random offsets are honoured); dense layers, and every layer when
``reference_offset`` is given, use the reference grid ``phase = (j - reference_offset) mod d``.
With ``offsets="random"`` call it in eval mode (or seed torch): a training-mode forward draws
new offsets every call.

Two reductions:

* **query mean**: ``mass[l, h, phi] = mean_{b, t} sum_{j: phase(j)=phi} m[b, h, t, j]`` over the
  chosen (non-padding) query positions; each row of the result sums to 1 (for patterns whose
  rows sum to 1).
* **pairs** (answer -> needle): for one ``(query_pos, key_pos)`` pair per sequence (or several,
  ``[batch, n_pairs]``), ``m[b, h, q, k]``, averaged over the pairs whose target ``k`` has phase
  ``phi`` (``NaN`` where no pair has that phase; ``n`` says how many).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache, HookedTransformer

from phasemech.attention import CompressedAttentionMixin
from phasemech.core.config import is_int
from phasemech.core.device import model_device
from phasemech.core.grid import left_padding


@dataclass(frozen=True)
class PhaseAttention:
    """Result of :func:`phase_attention`.

    ``tensor`` is ``[layer, head, phase]``; ``counts`` the number of (query, sequence) rows or
    pairs behind each entry; ``frame`` the same numbers as a tidy DataFrame with columns
    ``layer, head, phase, mass, n, exact, kind``; ``pairs`` (pair mode only) one row per
    (layer, head, sequence, pair).
    """

    tensor: Float[Tensor, "layer head phase"]
    counts: Int[Tensor, "layer head phase"]
    stride: int
    kind: str
    frame: pd.DataFrame
    pairs: pd.DataFrame | None = None

    def table(self, layer: int | None = None) -> pd.DataFrame:
        """Head-by-phase table (rows ``L{layer}H{head}``, columns phases)."""
        df = self.frame if layer is None else self.frame[self.frame.layer == layer]
        # dropna=False: keep phases with no pair (NaN) so the table is always head x phase
        wide = df.pivot_table(
            index=["layer", "head"], columns="phase", values="mass", sort=True, dropna=False
        )
        wide.index = [f"L{layer_}H{head}" for layer_, head in wide.index]
        wide.columns.name = "phase"
        return wide


def pattern_hook_name(model: HookedTransformer, layer: int) -> str:
    """The hook of layer ``layer``'s per-token attention pattern (a compressed layer's
    ``hook_token_pattern``, a dense layer's ``hook_pattern``)."""
    attn = model.blocks[layer].attn
    if isinstance(attn, CompressedAttentionMixin):
        return f"blocks.{layer}.attn.hook_token_pattern"
    return f"blocks.{layer}.attn.hook_pattern"


def _required(model: HookedTransformer, cache, layer: int) -> str:
    name = pattern_hook_name(model, layer)
    if name not in cache:
        hint = (
            " (switch token patterns on: model.set_use_token_pattern(True))"
            if name.endswith("token_pattern")
            else ""
        )
        raise ValueError(f"phase_attention: the cache has no {name}{hint}")
    return name


def _check_args(
    model: HookedTransformer,
    tokens: Tensor | None,
    cache,
    stride: int | None,
    reference_offset: int | None,
    layers: Sequence[int] | None,
    query_pos,
    key_pos,
) -> tuple[int, list[int]]:
    """``(stride, layers)``: the stride defaulted to the model's, ``layers`` to all."""
    if (tokens is None) == (cache is None):
        raise ValueError("phase_attention: give exactly one of tokens= or cache=")
    comp = getattr(model.cfg, "compression", None)
    stride = stride if stride is not None else (comp.stride if comp is not None else None)
    if not is_int(stride) or stride < 1:
        raise ValueError(f"phase_attention: stride={stride!r} is invalid: must be an int >= 1")
    stride = int(stride)
    if reference_offset is not None and not 0 <= reference_offset < stride:
        raise ValueError(
            f"phase_attention: reference_offset={reference_offset} must lie in [0, {stride})"
        )
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"phase_attention: layers {bad} do not exist (0..{n_layers - 1})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"phase_attention: layers={layers} repeats a layer")
    if key_pos is not None and query_pos is None:
        raise ValueError("phase_attention: key_pos needs query_pos (one query per target)")
    return stride, layers


def _batch_shape(
    model: HookedTransformer, tokens: Tensor | None, cache, layers: list[int]
) -> tuple[Tensor | None, int, int]:
    """``(tokens, batch, seq)``, ``tokens`` made ``[batch, pos]``."""
    if tokens is None:
        first = cache[_required(model, cache, layers[0])]
        return None, first.shape[0], first.shape[-1]
    if not isinstance(tokens, Tensor) or tokens.is_floating_point():
        raise ValueError("phase_attention: tokens must be an integer tensor [batch, pos]")
    tokens = tokens if tokens.ndim == 2 else tokens[None]
    batch, seq = tokens.shape
    return tokens, batch, seq


def _check_positions(name: str, value: Tensor, batch: int, seq: int) -> Tensor:
    value = torch.as_tensor(value)
    if value.is_floating_point():
        raise ValueError(f"phase_attention: {name} has dtype {value.dtype}: positions must be ints")
    if value.ndim == 1:
        value = value[:, None]
    if value.ndim != 2 or value.shape[0] != batch:
        raise ValueError(
            f"phase_attention: {name} has shape {tuple(value.shape)}: expected [batch={batch}] "
            f"or [batch={batch}, n_pairs]"
        )
    if value.numel() and (value.min() < 0 or value.max() >= seq):
        raise ValueError(f"phase_attention: {name} must lie in [0, {seq}), got {value.tolist()}")
    return value.long()


def _check_query_positions(
    query_pos, key_pos, batch: int, seq: int
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(qp, kp, queries)``: the ``[batch, n_pairs]`` pairs in pair mode, else the flat list
    of query positions to average over (``None``: all)."""
    if key_pos is None:
        if query_pos is None:
            return None, None, None
        queries = torch.as_tensor(query_pos).long().reshape(-1)
        if queries.numel() == 0 or queries.min() < 0 or queries.max() >= seq:
            raise ValueError(f"phase_attention: query_pos must lie in [0, {seq})")
        return None, None, queries
    qp = _check_positions("query_pos", query_pos, batch, seq)
    kp = _check_positions("key_pos", key_pos, batch, seq)
    if qp.shape != kp.shape:
        raise ValueError(
            f"phase_attention: query_pos {tuple(qp.shape)} and key_pos {tuple(kp.shape)} differ"
        )
    if (kp > qp).any():
        raise ValueError("phase_attention: a target lies after its query (key_pos > query_pos)")
    return qp, kp, None


def _layer_phases(
    model: HookedTransformer,
    layer: int,
    offsets: Tensor | None,
    batch: int,
    seq: int,
    stride: int,
    reference_offset: int | None,
    device: torch.device,
    attention_mask: Tensor | None = None,
) -> Int[Tensor, "batch head key_pos"]:
    """Phase of every key position for every head of one layer.

    The reference grid, like the compressed layers' own grids, is anchored at each sequence's
    first real token: leading zeros of ``attention_mask`` shift it.
    """
    n_heads = model.cfg.n_heads
    pos = torch.arange(seq, device=device)
    if reference_offset is not None or offsets is None:
        o = torch.full((batch, n_heads), reference_offset or 0, dtype=torch.long, device=device)
        if attention_mask is not None:
            o = o + left_padding(attention_mask.to(device))[:, None]
    else:
        rep = n_heads // offsets.shape[1]
        o = torch.repeat_interleave(offsets.to(device).long(), rep, dim=1)
    return torch.remainder(pos[None, None, :] - o[..., None], stride)


def _query_mean_mass(
    m: Float[Tensor, "batch head pos key_pos"],
    phases: Int[Tensor, "batch head key_pos"],
    stride: int,
    attention_mask: Tensor | None,
    queries: Tensor | None,
) -> tuple[Float[Tensor, "head phase"], Int[Tensor, "head phase"]]:
    """Mass per (head, phase) averaged over the valid queries, and how many there were."""
    device = m.device
    onehot = torch.nn.functional.one_hot(phases, stride).to(m.dtype)  # [b, h, key, phase]
    per_query = m @ onehot  # [batch, head, query, phase]
    valid = per_query.sum(-1) > 0  # padding queries attend nothing
    if attention_mask is not None:
        valid = valid & attention_mask.to(device).bool()[:, None, :]
    if queries is not None:
        per_query, valid = per_query[:, :, queries.to(device)], valid[:, :, queries.to(device)]
    w = valid.float()[..., None]
    n = w.sum((0, 2))  # [head, 1]
    mass = ((per_query * w).sum((0, 2)) / n.clamp(min=1)).cpu()
    return mass, n.long().expand(-1, stride).cpu()


def _pair_mass(
    layer: int,
    m: Float[Tensor, "batch head pos key_pos"],
    phases: Int[Tensor, "batch head key_pos"],
    qp: Int[Tensor, "batch n_pairs"],
    kp: Int[Tensor, "batch n_pairs"],
    stride: int,
) -> tuple[Float[Tensor, "head phase"], Int[Tensor, "head phase"], pd.DataFrame]:
    """Mean mass per (head, target phase) over the pairs, their count, and one row per pair."""
    device = m.device
    batch, n_heads = qp.shape[0], phases.shape[1]
    q, k = qp.to(device), kp.to(device)
    b_idx = torch.arange(batch, device=device)[:, None].expand_as(q)
    mass = m[b_idx, :, q, k]  # [batch, n_pairs, head]
    ph = phases.gather(2, k[:, None, :].expand(-1, n_heads, -1)).permute(0, 2, 1)
    onehot = torch.nn.functional.one_hot(ph, stride).float()  # [batch, pairs, head, phase]
    n = onehot.sum((0, 1))
    mean = ((mass[..., None] * onehot).sum((0, 1)) / n).cpu()
    bb, pp, hh = np.meshgrid(
        np.arange(batch), np.arange(q.shape[1]), np.arange(n_heads), indexing="ij"
    )
    pairs = pd.DataFrame(
        {
            "layer": layer,
            "head": hh.ravel(),
            "sequence": bb.ravel(),
            "pair": pp.ravel(),
            "query_pos": q.cpu().numpy()[bb, pp].ravel(),
            "key_pos": k.cpu().numpy()[bb, pp].ravel(),
            "phase": ph.cpu().numpy().ravel(),
            "mass": mass.cpu().numpy().ravel(),
        }
    )
    return mean, n.long().cpu(), pairs


def _reduce_patterns(
    model: HookedTransformer,
    layers: list[int],
    tokens: Tensor | None,
    cache,
    attention_mask: Tensor | None,
    reduce_layer: Callable[[int, Tensor, Tensor | None], None],
) -> None:
    """Call ``reduce_layer(layer, pattern, grid_offsets)`` for every layer, from the cache or
    from one forward pass."""
    if tokens is None:
        for i in layers:
            off_name = f"blocks.{i}.attn.hook_grid_offset"
            reduce_layer(
                i,
                cache[_required(model, cache, i)],
                cache[off_name] if off_name in cache else None,
            )
        return
    layer_offsets: dict[int, Tensor] = {}

    def grab_offsets(value: Tensor, hook) -> None:
        layer_offsets[hook.layer()] = value.detach()

    def reduce_hook(value: Tensor, hook) -> None:
        # Reduce inside the hook: one layer's [pos, key_pos] pattern is alive at a time.
        reduce_layer(hook.layer(), value, layer_offsets.get(hook.layer()))

    fwd_hooks = []
    for i in layers:
        if isinstance(model.blocks[i].attn, CompressedAttentionMixin):
            fwd_hooks.append((f"blocks.{i}.attn.hook_grid_offset", grab_offsets))
        fwd_hooks.append((pattern_hook_name(model, i), reduce_hook))
    dev = model_device(model)  # tokens are often built on the CPU; the model may sit on a GPU
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask.to(dev)}
    with torch.no_grad():
        model.run_with_hooks(tokens.to(dev), return_type=None, fwd_hooks=fwd_hooks, **kwargs)


def _tidy_frame(
    model: HookedTransformer,
    layers: list[int],
    tensor: Float[Tensor, "layer head phase"],
    counts: Int[Tensor, "layer head phase"],
    kind: str,
) -> pd.DataFrame:
    """One row per (layer, head, phase) of the reported layers, in ``layers`` order."""
    n_heads, stride = tensor.shape[1:]
    rows = []
    for i in layers:
        exact = bool(getattr(model.blocks[i].attn, "token_pattern_exact", True))
        for h in range(n_heads):
            for phi in range(stride):
                rows.append((i, h, phi, float(tensor[i, h, phi]), int(counts[i, h, phi]), exact))
    frame = pd.DataFrame(rows, columns=["layer", "head", "phase", "mass", "n", "exact"])
    frame["kind"] = kind
    return frame


def phase_attention(
    model: HookedTransformer,
    tokens: Int[Tensor, "batch pos"] | None = None,
    *,
    cache: ActivationCache | dict | None = None,
    query_pos: Int[Tensor, "batch"] | Int[Tensor, "batch n_pairs"] | Sequence[int] | None = None,
    key_pos: Int[Tensor, "batch"] | Int[Tensor, "batch n_pairs"] | None = None,
    stride: int | None = None,
    reference_offset: int | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    layers: Sequence[int] | None = None,
) -> PhaseAttention:
    """Attention mass per (layer, head, source phase) of ``model`` on ``tokens`` (or a ``cache``).

    Args:
        model: a ``PhaseTransformer`` (or any ``HookedTransformer``: then every layer is dense
            and phases are on the reference grid).
        tokens: ``[batch, pos]``; run without storing full patterns of every layer at once.
        cache: alternatively, a cache holding each layer's ``hook_token_pattern`` (compressed)
            or ``hook_pattern`` (dense), e.g. from ``run_with_cache`` with token patterns on.
        query_pos, key_pos: both given: pair mode (answer -> needle), ``[batch]`` or
            ``[batch, n_pairs]``. ``query_pos`` alone: a list of query positions to average over.
        stride: phase period; defaults to the model's compression stride.
        reference_offset: report every layer on this one grid instead of each head's own.
        attention_mask: ``[batch, pos]`` padding mask (1 = token): forwarded to the model, used
            to skip padding queries and to anchor the reference grid at the first real token
            (pass it in cache mode too).
        layers: layers to report (default all).
    """
    stride, layers = _check_args(
        model, tokens, cache, stride, reference_offset, layers, query_pos, key_pos
    )
    tokens, batch, seq = _batch_shape(model, tokens, cache, layers)
    qp, kp, queries = _check_query_positions(query_pos, key_pos, batch, seq)

    shape = (model.cfg.n_layers, model.cfg.n_heads, stride)
    tensor, counts = torch.full(shape, float("nan")), torch.zeros(shape, dtype=torch.long)
    pair_frames: list[pd.DataFrame] = []

    def reduce_layer(i: int, m: Tensor, layer_offsets: Tensor | None) -> None:
        m = m.detach().float()
        phases = _layer_phases(
            model, i, layer_offsets, batch, seq, stride, reference_offset, m.device, attention_mask
        )
        if kp is None:
            tensor[i], counts[i] = _query_mean_mass(m, phases, stride, attention_mask, queries)
            return
        tensor[i], counts[i], pairs = _pair_mass(i, m, phases, qp, kp, stride)
        pair_frames.append(pairs)

    _reduce_patterns(model, layers, tokens, cache, attention_mask, reduce_layer)
    kind = "query_mean" if kp is None else "pair"
    frame = _tidy_frame(model, layers, tensor, counts, kind)
    pairs = None if kp is None else pd.concat(pair_frames, ignore_index=True)
    keep = torch.tensor(layers)  # rows follow `layers`, in its order
    return PhaseAttention(
        tensor=tensor[keep], counts=counts[keep], stride=stride, kind=kind, frame=frame, pairs=pairs
    )


def combine_frames(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Pool the ``frame`` s of several :func:`phase_attention` calls (e.g. over batches) into
    one: per (layer, head, phase) the ``n``-weighted mean ``mass`` (NaN where ``n`` is 0)."""
    df = pd.concat(frames)
    df = df.assign(total=df["mass"].fillna(0.0) * df["n"])
    out = df.groupby(["layer", "head", "phase"], as_index=False).agg(
        total=("total", "sum"), n=("n", "sum"), exact=("exact", "all"), kind=("kind", "first")
    )
    out["mass"] = np.where(out["n"] > 0, out["total"] / out["n"].clip(lower=1), np.nan)
    return out[["layer", "head", "phase", "mass", "n", "exact", "kind"]]


__all__ = ["PhaseAttention", "combine_frames", "pattern_hook_name", "phase_attention"]
