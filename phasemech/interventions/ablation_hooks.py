"""One ablation applied to a model: the hooks (or the parameter edit) that knock out one unit of
one layer, as the context manager :func:`ablation`. ``ablate`` in
:mod:`phasemech.interventions.ablation` runs it for every planned unit; what a component and a
mode knock out is in that module's table.

Axes: ``batch``, ``pos`` (query position), ``head`` (query head), ``kv_head``, ``block``
(compressed entries), ``branch`` (``nsa``'s three branches), ``d_head``, ``unit`` (a head or a
KV head, whichever the component acts on).

A hook clones the activation before writing into it; the hooks are removed and a zeroed
``phase_bias`` restored on exit, also when the ``with`` block raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from phasemech.core.config import SELECTING_DESIGNS
from phasemech.core.grid import n_blocks
from phasemech.interventions.ablation_plan import BRANCH_COMPONENTS, bias_params, check_unit
from phasemech.model.transformer import PhaseTransformer


def _hooks(
    model: PhaseTransformer, component: str, mode: str, layer: int, unit: int, replacement: Any
) -> list[tuple[str, Any]]:
    attn = model.blocks[layer].attn
    prefix = f"blocks.{layer}.attn."

    def set_axis(axis: int, value: Any, name: str):
        # clone: never write into a tensor a later hook or the caller may still hold
        def hook(x: Tensor, hook: Any) -> Tensor:
            x = x.clone()
            index = (slice(None),) * axis + (unit,)
            # the activation's device and dtype: a replacement given on another device works
            x[index] = value if not isinstance(value, Tensor) else value.to(x.device, x.dtype)
            return x

        return (prefix + name, hook)

    if component == "head":
        value = 0.0 if mode == "zero" else replacement  # [batch or 1, pos, d_head]
        return [set_axis(2, value, "hook_z")]
    if component in BRANCH_COMPONENTS:  # nsa: the head's gate on one branch is 0

        def close(gates: Tensor, hook: Any) -> Tensor:
            gates = gates.clone()  # [batch, pos, head, branch]
            gates[:, :, unit, BRANCH_COMPONENTS.index(component)] = 0.0
            return gates

        return [(prefix + "hook_branch_gate", close)]
    if component == "blocks" and mode == "mask" and attn.design in SELECTING_DESIGNS:
        return [set_axis(1, False, "hook_route_selected")]
    if component in ("blocks", "raw") and mode == "mask":
        block_cols = component == "blocks"

        def mask(scores: Tensor, hook: Any) -> Tensor:
            # [batch, head, pos, block + w]: the first n_blocks columns are compressed entries
            nb = n_blocks(scores.shape[2], attn.stride)
            scores = scores.clone()
            cols = slice(None, nb) if block_cols else slice(nb, None)
            scores[:, unit, :, cols] = float("-inf")
            return scores

        return [(prefix + "hook_attn_scores", mask)]
    if component == "blocks":  # mean / resample: [batch, block, kv_head, d_head]
        k, v = replacement
        return [set_axis(2, k, "hook_k_block"), set_axis(2, v, "hook_v_block")]
    return []  # phase_bias: a parameter edit, no hook


def _check_replacement(where: str, component: str, mode: str, replacement: Any) -> None:
    needs = mode in ("mean", "resample")
    if needs and replacement is None:
        raise ValueError(f"{where}: mode {mode!r} needs replacement= values (see the docstring)")
    if not needs and replacement is not None:
        raise ValueError(f"{where}: mode {mode!r} takes no replacement")
    if needs and component == "blocks":
        ok = isinstance(replacement, tuple) and len(replacement) == 2
        if not ok or not all(isinstance(t, Tensor) and t.ndim == 3 for t in replacement):
            raise ValueError(
                f"{where}: blocks/{mode} needs replacement=(k_block, v_block), each a tensor "
                "[batch or 1, block, d_head]"
            )
    elif needs and not (isinstance(replacement, Tensor) and replacement.ndim == 3):
        raise ValueError(
            f"{where}: head/{mode} needs replacement= a tensor [batch or 1, pos, d_head]"
        )


@contextlib.contextmanager
def ablation(
    model: PhaseTransformer,
    component: str,
    mode: str,
    layer: int,
    unit: int,
    *,
    replacement: Float[Tensor, "batch pos d_head"]
    | tuple[Float[Tensor, "batch block d_head"], Float[Tensor, "batch block d_head"]]
    | None = None,
) -> Iterator[None]:
    """Apply one ablation to ``model`` inside the ``with`` block (forwards, caches, anything).

    ``replacement`` is needed by ``mean`` / ``resample`` only: for ``head`` the head's ``hook_z``
    values ``[batch or 1, pos, d_head]``; for ``blocks`` a pair ``(k_block, v_block)`` of the KV
    head's entries ``[batch or 1, block, d_head]``. Hooks are removed and ``phase_bias`` restored
    on exit, also when the block raises.

    Example::

        with ablation(model, "raw", "mask", layer=1, unit=0):
            _, cache = model.run_with_cache(tokens)  # head 0 of layer 1 reads blocks only
    """
    where = "ablation"
    if not isinstance(model, PhaseTransformer):
        raise ValueError(f"{where}: model is a {type(model).__name__}: expected a PhaseTransformer")
    for name, value in (("component", component), ("mode", mode)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: {name}={value!r} is invalid: give one name (a str)")
    check_unit(where, model, component, mode, layer, unit)
    _check_replacement(where, component, mode, replacement)
    hooks = _hooks(model, component, mode, int(layer), int(unit), replacement)
    params = bias_params(model.blocks[layer].attn) if component == "phase_bias" else []
    saved = [p.detach()[unit].clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p[unit] = 0.0
        with model.hooks(fwd_hooks=hooks):  # removes exactly these hooks on exit
            yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p[unit] = value
