"""What an ablation is: the components and modes, their checks against a model, and the plan of
every ablation :func:`phasemech.interventions.ablation.ablate` runs.

Axes: ``layer``, ``head`` (query head), ``kv_head``, ``unit`` (a head or a KV head, whichever the
component acts on), ``metric``.

Every check raises ``ValueError`` naming the offending value and what is allowed, before any
forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from datasets import Dataset
from torch import Tensor

from phasemech.attention import CompressedAttentionMixin
from phasemech.core.config import SELECTING_DESIGNS, is_int

# designs with a learned intra-block bias (``phase_bias`` ablates it per KV head; ``dsa``'s
# indexer has one bias shared by every head: one unit)
from phasemech.core.designs import BIAS_DESIGNS
from phasemech.core.grid import reference_grid
from phasemech.core.validation import check_int
from phasemech.model.transformer import PhaseTransformer

COMPONENTS = ("head", "blocks", "raw", "phase_bias", "branch_cmp", "branch_slc", "branch_win")

#: ``nsa``'s branches, in the order of its ``hook_branch_gate`` axis
BRANCH_COMPONENTS = ("branch_cmp", "branch_slc", "branch_win")


MODES = ("zero", "mean", "resample", "mask")


#: (component -> modes) that are defined; ``blocks`` on ``route`` allows ``mask`` only
VALID_MODES: dict[str, tuple[str, ...]] = {
    "head": ("zero", "mean", "resample"),
    "blocks": ("mask", "mean", "resample"),
    "raw": ("mask",),
    "phase_bias": ("zero",),
    **dict.fromkeys(BRANCH_COMPONENTS, ("zero",)),
}


DEFAULT_MODES = MODES  # each component runs every mode it allows


METRICS = ("accuracy", "logprob", "logit_diff")


UNIT_KINDS = ("head", "kv_head")


UNIT_KEYS = ["component", "mode", "layer", "unit"]


def checked_names(where: str, name: str, value: Any, allowed: Sequence[str]) -> tuple[str, ...]:
    """A str or a sequence of str, each in ``allowed``; duplicates dropped, order kept."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Sequence) or len(items) == 0:
        raise ValueError(
            f"{where}: {name}={value!r} is invalid: give a non-empty sequence of {list(allowed)}"
        )
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"{where}: {name} {bad[0]!r} is unknown: allowed {list(allowed)}")
    return tuple(dict.fromkeys(items))


def model_design(model: PhaseTransformer) -> str:
    """The compression design of ``model``'s config."""
    return model.cfg.compression.design


def components_for(design: str) -> tuple[str, ...]:
    """The components an ablation study of ``design`` knocks out by default: heads, and the
    compressed layer's parts that the design has."""
    if design == "none":
        return ("head",)
    if design == "nsa":
        return ("head", *BRANCH_COMPONENTS)
    if design in SELECTING_DESIGNS:
        return ("head", "blocks") + (("phase_bias",) if design in BIAS_DESIGNS else ())
    return ("head", "blocks", "raw") + (("phase_bias",) if design in BIAS_DESIGNS else ())


def _modes_for(component: str, design: str) -> tuple[str, ...]:
    # route's block entries only steer its top-k choice; replacing them is not "the head's
    # compressed read" (it reads selected blocks raw), so only masking the selection is defined
    if component == "blocks" and design in SELECTING_DESIGNS:
        return ("mask",)
    return VALID_MODES[component]


def _check_design(where: str, component: str, design: str) -> None:
    if component == "head":
        return
    if design == "none":
        raise ValueError(
            f"{where}: component {component!r} needs compressed layers, but the model's design "
            "is 'none' (dense attention): only 'head' applies"
        )
    if component == "raw" and design in SELECTING_DESIGNS:
        raise ValueError(
            f"{where}: component 'raw' is not defined for design {design!r}: it has no raw-band "
            "columns (it attends raw tokens of its selected blocks); use 'blocks' with 'mask'"
        )
    if component == "phase_bias" and design not in BIAS_DESIGNS:
        raise ValueError(
            f"{where}: component 'phase_bias' needs a design with a learned intra-block bias "
            f"{BIAS_DESIGNS}, the model's design is {design!r}"
        )
    if component in BRANCH_COMPONENTS and design != "nsa":
        raise ValueError(
            f"{where}: component {component!r} needs design 'nsa' (three gated branches), the "
            f"model's design is {design!r}"
        )
    if component in ("blocks", "raw") and design == "nsa":
        raise ValueError(
            f"{where}: component {component!r} is not defined for design 'nsa' (its branches "
            f"have separate softmaxes); use {list(BRANCH_COMPONENTS)}"
        )


def unit_kind(component: str, mode: str) -> str:
    """``"kv_head"`` for components that act on a KV head's shared state, else ``"head"``."""
    per_kv = component == "phase_bias" or (component == "blocks" and mode in ("mean", "resample"))
    return "kv_head" if per_kv else "head"


def bias_params(attn: Any) -> list[Tensor]:
    """A layer's learned intra-block biases, ``[unit, slot, ...]`` each: ``gated``'s
    ``phase_bias`` and ``csa``/``hca``'s key and value slot biases per KV head, ``dsa``'s
    indexer pool bias (one unit, as a view)."""
    if hasattr(attn, "phase_bias"):
        return [attn.phase_bias]
    if hasattr(attn, "pool_bias"):
        return [attn.pool_bias.unsqueeze(0)]
    return [attn.B_K, attn.B_V]


def _units(model: PhaseTransformer, component: str, mode: str, layer: int) -> int:
    """How many units ``component`` has in ``layer`` (a bias: its leading axis)."""
    if component == "phase_bias":
        return bias_params(model.blocks[layer].attn)[0].shape[0]
    return _n_units(model, unit_kind(component, mode))


def _n_units(model: PhaseTransformer, kind: str) -> int:
    return model.cfg.n_heads if kind == "head" else model.cfg.n_kv_heads


def _is_compressed(model: PhaseTransformer, layer: int) -> bool:
    return isinstance(model.blocks[layer].attn, CompressedAttentionMixin)


@dataclass(frozen=True)
class AblationRun:
    """One ablation: one unit of one layer, one component, one mode."""

    component: str
    mode: str
    layer: int
    unit: int

    @property
    def kind(self) -> str:
        return unit_kind(self.component, self.mode)


def _check_layers(where: str, layers: Any, n_layers: int) -> Any:
    """``layers`` as given (arrays as lists): None or distinct ints in ``0..n_layers - 1``."""
    if isinstance(layers, np.ndarray | Tensor):
        layers = layers.tolist()
    if layers is None:
        return None
    if isinstance(layers, str) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError(
            f"{where}: layers={layers!r} is invalid: give None or a non-empty sequence of "
            f"ints in 0..{n_layers - 1}"
        )
    bad = [i for i in layers if not is_int(i) or not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"{where}: layer {bad[0]!r} is invalid: allowed ints 0..{n_layers - 1}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{where}: layers={list(layers)} repeats a layer")
    return layers


def _chosen_modes(where: str, comp: str, mode_list: tuple[str, ...], design: str) -> list[str]:
    """The requested modes ``comp`` allows; a component left with none is an error."""
    allowed = _modes_for(comp, design)
    chosen = [m for m in mode_list if m in allowed]
    if not chosen:
        raise ValueError(
            f"{where}: no requested mode applies to component {comp!r}"
            + (f" on design {design!r}" if comp == "blocks" else "")
            + f": modes {list(mode_list)} given, {comp!r} allows {list(allowed)}"
        )
    return chosen


def _component_layers(
    where: str, comp: str, layers: Any, compressed: list[int], n_layers: int
) -> list[int]:
    """The layers ``comp`` is ablated in: all (``head``) or the compressed ones by default."""
    if comp == "head":
        return list(range(n_layers)) if layers is None else [int(i) for i in layers]
    if layers is None:
        return compressed
    dense = [i for i in layers if int(i) not in compressed]
    if dense:
        raise ValueError(
            f"{where}: component {comp!r} needs a compressed layer, layer {dense[0]} is "
            f"dense: compressed layers are {compressed}"
        )
    return [int(i) for i in layers]


def plan_runs(
    model: PhaseTransformer, components: Any, modes: Any, layers: Any, where: str = "ablate"
) -> list[AblationRun]:
    """Every ablation to run, layer-major; raises on any invalid request before work starts."""
    comps = checked_names(where, "component", components, COMPONENTS)
    mode_list = checked_names(where, "mode", modes, MODES)
    n_layers = model.cfg.n_layers
    layers = _check_layers(where, layers, n_layers)
    design = model_design(model)
    compressed = [i for i in range(n_layers) if _is_compressed(model, i)]
    runs = []
    for comp in comps:
        _check_design(where, comp, design)
        chosen = _chosen_modes(where, comp, mode_list, design)
        comp_layers = _component_layers(where, comp, layers, compressed, n_layers)
        for mode in chosen:
            runs += [AblationRun(comp, mode, i, u) for i in comp_layers
                     for u in range(_units(model, comp, mode, i))]  # fmt: skip
    order = {c: k for k, c in enumerate(COMPONENTS)}
    return sorted(runs, key=lambda r: (r.layer, order[r.component], MODES.index(r.mode), r.unit))


def check_unit(
    where: str, model: PhaseTransformer, component: str, mode: str, layer: Any, unit: Any
) -> None:
    """Refuse one ablation (``component``, ``mode``, ``layer``, ``unit``) ``model`` can't run."""
    checked_names(where, "component", component, COMPONENTS)
    checked_names(where, "mode", mode, MODES)
    design = model_design(model)
    _check_design(where, component, design)
    allowed = _modes_for(component, design)
    if mode not in allowed:
        raise ValueError(
            f"{where}: combination ({component!r}, {mode!r}) is invalid: {component!r} allows "
            f"modes {list(allowed)}"
        )
    n_layers = model.cfg.n_layers
    if not is_int(layer) or not 0 <= layer < n_layers:
        raise ValueError(f"{where}: layer {layer!r} is invalid: allowed ints 0..{n_layers - 1}")
    if component != "head" and not _is_compressed(model, layer):
        raise ValueError(
            f"{where}: component {component!r} needs a compressed layer, layer {layer} is dense"
        )
    kind = unit_kind(component, mode)
    n = _units(model, component, mode, layer)
    if not is_int(unit) or not 0 <= unit < n:
        raise ValueError(f"{where}: unit {unit!r} is invalid: allowed {kind} indices 0..{n - 1}")


def check_dataset(where: str, name: str, ds: Any, columns: tuple[str, ...]) -> int:
    """Refuse ``ds`` unless it is a non-empty task set with ``columns``; returns its length."""
    if not isinstance(ds, Dataset):
        raise ValueError(f"{where}: {name} is a {type(ds).__name__}: expected a datasets.Dataset")
    if len(ds) == 0:
        raise ValueError(f"{where}: {name} is empty: nothing to score")
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"{where}: {name} lacks column(s) {missing}: expected a set from "
            "phasemech.data.tasks.generate"
        )
    return len(ds[0]["input_ids"])


def resolve_grid(
    model: PhaseTransformer, stride: Any, grid_offset: Any, where: str
) -> tuple[int, int]:
    """The ``(stride, grid_offset)`` phases are read on: the given ones, checked, else the
    model's reference grid (a stride alone keeps the model's offset)."""
    m_stride, m_offset = reference_grid(model.cfg.compression)
    if stride is not None:
        stride = check_int(where, "stride", stride, 2)
    if grid_offset is not None and not is_int(grid_offset):
        raise ValueError(f"{where}: grid_offset={grid_offset!r} is invalid: must be an int")
    out_stride = m_stride if stride is None else stride
    if out_stride < 2:
        raise ValueError(f"{where}: stride={out_stride} is invalid for phases: need >= 2")
    # a stated stride alone keeps the model's offset, reduced onto the new grid (as evaluate)
    out_offset = m_offset % out_stride if grid_offset is None else int(grid_offset)
    return out_stride, out_offset
