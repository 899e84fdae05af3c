"""The sites of the activation-patching engine (``patch_sites`` in
:mod:`phasemech.interventions.patching`): which activation a patch copies, and how one unit of
it is copied from the clean run into a corrupted copy (the *setters*, in the manner of
TransformerLens' patch setters).

Axes: ``batch`` (one clean/corrupted pair), ``pos``, ``head``, ``kv_head``, ``block``, ``unit``
(a head or KV head), ``query`` / ``key`` (a pattern's rows and columns), ``d`` (an activation's
channels), ``copy`` (one patched run of one pair; a setter's ``rows`` index them).

Sites: ``z``, ``q`` (per head), ``k``, ``v`` (per KV head), ``pattern`` (per head, answer
contrast only), ``kv_block`` (a KV head's compressed entries, answer contrast only: under a
shifted grid or content entry ``i`` covers other tokens). A new site is a :class:`Site`: its
hooks, a ``differs`` reduction and a setter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor
from transformer_lens import HookedTransformer


def head_vector_setter(
    act: Tensor, src: Tensor, rows: Tensor, b: Tensor, u: Tensor, p: Tensor | None
) -> None:
    """``[batch, pos, unit, d]`` activations (``hook_z``, ``hook_q``, ``hook_k``, ``hook_v``):
    copy ``rows`` gets pair ``b``'s clean unit ``u``, at every position or at ``p``."""
    if p is None:
        act[rows, :, u] = src[b, :, u]
    else:
        act[rows, p, u] = src[b, p, u]


def head_pattern_setter(
    act: Tensor, src: Tensor, rows: Tensor, b: Tensor, u: Tensor, p: Tensor | None
) -> None:
    """``[batch, head, query, key]`` patterns: a head's whole pattern, or its query row ``p``."""
    if p is None:
        act[rows, u] = src[b, u]
    else:
        act[rows, u, p] = src[b, u, p]


def block_entry_setter(
    act: Tensor, src: Tensor, rows: Tensor, b: Tensor, u: Tensor, p: Tensor | None
) -> None:
    """``[batch, block, kv_head, d]`` compressed entries: every block of KV head ``u``."""
    act[rows, :, u] = src[b, :, u]


@dataclass(frozen=True)
class Site:
    """One kind of activation the engine can patch, in the manner of TransformerLens' patch
    setters: the hooks that hold it, the position axis, how many units a layer has, where clean
    and corrupted differ (``differs``: the elementwise ``!=`` of the activations ->
    ``[batch, unit, pos]``), and how one unit is copied (``setter``)."""

    name: str
    hook_names: tuple[str, ...]  # under ``blocks.{layer}.attn``; absent ones are skipped
    setter: Callable[..., None]
    differs: Callable[[Tensor], Tensor]
    kv_units: bool = False  # units are KV heads (else query heads)
    positional: bool = True  # ``by_pos`` patches one position at a time
    # entries or pattern columns that cover other tokens under a shifted grid or content: only
    # the answer contrast (same grid, same positions) leaks nothing into earlier queries
    answer_contrast_only: bool = False
    compressed_only: bool = False  # exists in compressed layers only

    def hooks(self, model: HookedTransformer, layer: int) -> list[str]:
        names = [f"blocks.{layer}.attn.{h}" for h in self.hook_names]
        return [n for n in names if n in model.hook_dict]

    def n_units(self, model: HookedTransformer) -> int:
        cfg = model.cfg
        grouped = cfg.n_key_value_heads is not None and not cfg.ungroup_grouped_query_attention
        return cfg.n_key_value_heads if self.kv_units and grouped else cfg.n_heads


def _vector_differs(ne: Tensor) -> Tensor:  # [batch, pos, unit, d] -> [batch, unit, pos]
    return ne.any(-1).transpose(1, 2)


def _pattern_differs(ne: Tensor) -> Tensor:  # [batch, head, query, key] -> [batch, head, query]
    return ne.any(-1)


def _block_differs(ne: Tensor) -> Tensor:  # [batch, block, kv_head, d] -> [batch, kv_head, 1]
    return ne.any(-1).any(1)[..., None]


def _vector_site(name: str, kv_units: bool = False) -> Site:
    return Site(name, (f"hook_{name}",), head_vector_setter, _vector_differs, kv_units=kv_units)


#: the sites :func:`patch_sites` knows; a new one is a :class:`Site` (hooks + setter)
SITES: dict[str, Site] = {
    "z": _vector_site("z"),
    "q": _vector_site("q"),
    "k": _vector_site("k", kv_units=True),
    "v": _vector_site("v", kv_units=True),
    "pattern": Site(
        "pattern",
        ("hook_pattern",),
        head_pattern_setter,
        _pattern_differs,
        answer_contrast_only=True,
    ),
    "kv_block": Site(
        "kv_block",
        ("hook_k_block", "hook_v_block"),
        block_entry_setter,
        _block_differs,
        kv_units=True,
        positional=False,
        answer_contrast_only=True,
        compressed_only=True,
    ),
}
