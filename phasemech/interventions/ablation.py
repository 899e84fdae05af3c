"""Phase-resolved ablation of attention components: which unit serves which needle phase?

Axes: ``batch`` (sequences), ``pos`` (token positions), ``head`` (query head), ``kv_head``,
``block`` (compressed entries), ``layer``, ``target`` (answers per sequence), ``phase`` (the
needle's offset inside its compression chunk, ``(source_pos - grid_offset) mod stride``),
``unit`` (a head or a KV head, whichever the component acts on), ``perm`` (permutation draws),
``replicate`` (bootstrap draws).

One ablation knocks out ONE component instance (a *unit* of one layer) and rescores every target
of a dataset at its answer position. Components and modes:

========== ============================ ===========================================================
component  modes                        what is knocked out
========== ============================ ===========================================================
head       zero, mean, resample         ``hook_z[:, :, h]`` (the head's output, any layer)
blocks     mask (per head)              the head reads no compressed entry: its block columns of
                                        ``hook_attn_scores`` are ``-inf`` (pooled designs), or its
                                        ``hook_route_selected`` is all False (``route``: the head
                                        keeps its raw window)
blocks     mean, resample (per kv_head) ``hook_k_block`` and ``hook_v_block`` of the KV head
                                        (pooled designs)
raw        mask (per head)              the head's raw-band columns of ``hook_attn_scores`` are
                                        ``-inf`` (pooled designs): it reads blocks only
phase_bias zero (per kv_head)           ``gated``'s learned intra-block bias ``phase_bias[g]``:
                                        pooling by the content gate alone
========== ============================ ===========================================================

``mean`` replaces an activation by its mean over a *reference* set of sequences (per position for
``hook_z``, per block index for block entries); ``resample`` by the same activation of one
reference sequence drawn at random per dataset sequence (the same draw for every unit, seeded).
A query row that a mask leaves with nothing visible gets a zero output (``_masked_softmax``).

Metrics per target from the answer-position logits: ``accuracy`` (greedy answer right, 0/1),
``logprob`` (log-probability of the answer) and ``logit_diff`` (answer logit minus the best other
logit). The effect of an ablation is ``ablated - baseline`` per target; :attr:`AblationResult.
effects` averages it per phase with cluster-bootstrap intervals over contents (``group_id``: the
``stride`` shifted copies of a content in a phase-balanced set are correlated, so they are
resampled together). :func:`specialization` asks, per unit, whether the effect depends on phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from datasets import Dataset
from jaxtyping import Float, Int
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor

from phasemech.attention import CompressedAttentionMixin
from phasemech.core.config import SELECTING_DESIGNS, is_int
from phasemech.core.grid import n_blocks, reference_grid
from phasemech.core.io import atomic_write, write_json_atomic
from phasemech.core.validation import check_int
from phasemech.data.tasks import generate, targets_frame, task_of, to_tensors
from phasemech.measure.readout import answer_logits
from phasemech.model.transformer import PhaseTransformer

COMPONENTS = ("head", "blocks", "raw", "phase_bias")


MODES = ("zero", "mean", "resample", "mask")


#: (component -> modes) that are defined; ``blocks`` on ``route`` allows ``mask`` only
VALID_MODES: dict[str, tuple[str, ...]] = {
    "head": ("zero", "mean", "resample"),
    "blocks": ("mask", "mean", "resample"),
    "raw": ("mask",),
    "phase_bias": ("zero",),
}


DEFAULT_MODES = MODES  # each component runs every mode it allows


METRICS = ("accuracy", "logprob", "logit_diff")


UNIT_KINDS = ("head", "kv_head")


UNIT_KEYS = ["component", "mode", "layer", "unit"]


#: default size cap of a generated reference set (mean / resample statistics)
REFERENCE_CAP = 512


#: relative tolerance of "a permuted statistic is at least the observed one" (float rounding)
_TIE_RTOL = 1e-9


def _names(where: str, name: str, value: Any, allowed: Sequence[str]) -> tuple[str, ...]:
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


def _design(model: PhaseTransformer) -> str:
    return model.cfg.compression.design


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
    if component == "phase_bias" and design != "gated":
        raise ValueError(
            f"{where}: component 'phase_bias' needs design 'gated', the model's design is "
            f"{design!r} (no learned phase bias)"
        )


def unit_kind(component: str, mode: str) -> str:
    """``"kv_head"`` for components that act on a KV head's shared state, else ``"head"``."""
    per_kv = component == "phase_bias" or (component == "blocks" and mode in ("mean", "resample"))
    return "kv_head" if per_kv else "head"


def _n_units(model: PhaseTransformer, kind: str) -> int:
    return model.cfg.n_heads if kind == "head" else model.cfg.n_kv_heads


def _is_compressed(model: PhaseTransformer, layer: int) -> bool:
    return isinstance(model.blocks[layer].attn, CompressedAttentionMixin)


@dataclass(frozen=True)
class _Run:
    """One ablation: one unit of one layer, one component, one mode."""

    component: str
    mode: str
    layer: int
    unit: int

    @property
    def kind(self) -> str:
        return unit_kind(self.component, self.mode)


def _plan(
    model: PhaseTransformer, components: Any, modes: Any, layers: Any, where: str = "ablate"
) -> list[_Run]:
    """Every ablation to run, layer-major; raises on any invalid request before work starts."""
    comps = _names(where, "component", components, COMPONENTS)
    mode_list = _names(where, "mode", modes, MODES)
    n_layers = model.cfg.n_layers
    if isinstance(layers, np.ndarray | Tensor):
        layers = layers.tolist()
    if layers is not None:
        if isinstance(layers, str) or not isinstance(layers, Sequence) or len(layers) == 0:
            raise ValueError(
                f"{where}: layers={layers!r} is invalid: give None or a non-empty sequence of "
                f"ints in 0..{n_layers - 1}"
            )
        bad = [i for i in layers if not is_int(i) or not 0 <= i < n_layers]
        if bad:
            raise ValueError(
                f"{where}: layer {bad[0]!r} is invalid: allowed ints 0..{n_layers - 1}"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"{where}: layers={list(layers)} repeats a layer")
    design = _design(model)
    compressed = [i for i in range(n_layers) if _is_compressed(model, i)]
    runs = []
    for comp in comps:
        _check_design(where, comp, design)
        allowed = _modes_for(comp, design)
        # each component runs the requested modes it allows; one left with none is an error
        chosen = [m for m in mode_list if m in allowed]
        if not chosen:
            raise ValueError(
                f"{where}: no requested mode applies to component {comp!r}"
                + (f" on design {design!r}" if comp == "blocks" else "")
                + f": modes {list(mode_list)} given, {comp!r} allows {list(allowed)}"
            )
        if comp == "head":
            comp_layers = list(range(n_layers)) if layers is None else [int(i) for i in layers]
        elif layers is None:
            comp_layers = compressed
        else:
            dense = [i for i in layers if int(i) not in compressed]
            if dense:
                raise ValueError(
                    f"{where}: component {comp!r} needs a compressed layer, layer {dense[0]} is "
                    f"dense: compressed layers are {compressed}"
                )
            comp_layers = [int(i) for i in layers]
        for mode in chosen:
            n_units = _n_units(model, unit_kind(comp, mode))
            runs += [_Run(comp, mode, i, u) for i in comp_layers for u in range(n_units)]
    order = {c: k for k, c in enumerate(COMPONENTS)}
    return sorted(runs, key=lambda r: (r.layer, order[r.component], MODES.index(r.mode), r.unit))


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
            x[index] = value if not isinstance(value, Tensor) else value.to(x.dtype)
            return x

        return (prefix + name, hook)

    if component == "head":
        value = 0.0 if mode == "zero" else replacement  # [batch or 1, pos, d_head]
        return [set_axis(2, value, "hook_z")]
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


def _check_unit(
    where: str, model: PhaseTransformer, component: str, mode: str, layer: Any, unit: Any
) -> None:
    _names(where, "component", component, COMPONENTS)
    _names(where, "mode", mode, MODES)
    design = _design(model)
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
    n = _n_units(model, kind)
    if not is_int(unit) or not 0 <= unit < n:
        raise ValueError(f"{where}: unit {unit!r} is invalid: allowed {kind} indices 0..{n - 1}")


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
    _check_unit(where, model, component, mode, layer, unit)
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
    hooks = _hooks(model, component, mode, int(layer), int(unit), replacement)
    param, saved = None, None
    if component == "phase_bias":
        param = model.blocks[layer].attn.phase_bias
        saved = param.detach()[unit].clone()
    try:
        if param is not None:
            with torch.no_grad():
                param[unit] = 0.0
        with model.hooks(fwd_hooks=hooks):  # removes exactly these hooks on exit
            yield
    finally:
        if param is not None:
            with torch.no_grad():
                param[unit] = saved


def _scores(
    logits: Float[Tensor, "batch target vocab"], answer: Int[Tensor, "batch target"]
) -> Float[Tensor, "metric batch target"]:
    """``accuracy, logprob, logit_diff`` stacked (same definitions as ``evaluate.predict``)."""
    logits = logits.float()
    idx = answer[..., None]
    right = logits.gather(-1, idx)[..., 0]
    other = logits.scatter(-1, idx, float("-inf")).amax(-1)
    logprob = logits.log_softmax(-1).gather(-1, idx)[..., 0]
    correct = (logits.argmax(-1) == answer).float()
    return torch.stack([correct, logprob, right - other])


@dataclass
class _LayerStats:
    """Reference-set statistics of one layer (only those some planned run needs)."""

    z_mean: Tensor | None = None  # [pos, head, d_head]
    z_all: Tensor | None = None  # [ref, pos, head, d_head]
    kv_mean: tuple[Tensor, Tensor] | None = None  # 2 x [block, kv_head, d_head]
    kv_all: tuple[Tensor, Tensor] | None = None  # 2 x [ref, block, kv_head, d_head]


def _layer_stats(
    model: PhaseTransformer,
    ref_tokens: Tensor,
    layer: int,
    runs: list[_Run],
    batch_size: int,
    advance: Any,
) -> _LayerStats:
    want = {(r.component, r.mode) for r in runs}
    wants_z = bool(want & {("head", "mean"), ("head", "resample")})
    wants_kv = bool(want & {("blocks", "mean"), ("blocks", "resample")})
    out = _LayerStats()
    if not (wants_z or wants_kv):
        return out
    names = ["hook_z"] * wants_z + ["hook_k_block", "hook_v_block"] * wants_kv
    keep_all = {
        "hook_z": ("head", "resample") in want,
        "hook_k_block": ("blocks", "resample") in want,
        "hook_v_block": ("blocks", "resample") in want,
    }
    sums: dict[str, Tensor] = {}
    alls: dict[str, list[Tensor]] = {n: [] for n in names}
    got: dict[str, Tensor] = {}

    def grab(x: Tensor, hook: Any) -> None:
        got[hook.name.rsplit(".", 1)[-1]] = x.detach()

    hooks = [(f"blocks.{layer}.attn.{n}", grab) for n in names]
    for start in range(0, len(ref_tokens), batch_size):
        got.clear()
        with model.hooks(fwd_hooks=hooks):
            # nothing after this layer matters for its own activations
            model(ref_tokens[start : start + batch_size], return_type=None, stop_at_layer=layer + 1)
        for n in names:
            # float64 sums: a mean of identical copies comes back bit-exact
            s = got[n].double().sum(0)
            sums[n] = s if n not in sums else sums[n] + s
            if keep_all[n]:
                alls[n].append(got[n])
        advance()
    n_ref = len(ref_tokens)
    dtype = next(model.parameters()).dtype
    mean = {n: (sums[n] / n_ref).to(dtype) for n in names}
    if wants_z:
        out.z_mean = mean["hook_z"]
        out.z_all = torch.cat(alls["hook_z"]) if keep_all["hook_z"] else None
    if wants_kv:
        out.kv_mean = (mean["hook_k_block"], mean["hook_v_block"])
        if keep_all["hook_k_block"]:
            out.kv_all = (torch.cat(alls["hook_k_block"]), torch.cat(alls["hook_v_block"]))
    return out


def _replacement(run: _Run, stats: _LayerStats, donors: Tensor | None) -> Any:
    u = run.unit
    if run.mode == "mean":
        if run.component == "head":
            return stats.z_mean[None, :, u]
        k, v = stats.kv_mean
        return k[None, :, u], v[None, :, u]
    if run.mode == "resample":
        if run.component == "head":
            return stats.z_all[donors, :, u]
        k, v = stats.kv_all
        return k[donors, :, u], v[donors, :, u]
    return None


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
        _names(where, "metric", metric, METRICS)
        _names(where, "component", component, COMPONENTS)
        _names(where, "mode", mode, MODES)
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
        self, metric: str = "accuracy", n_perm: int = 1000, seed: int = 0
    ) -> pd.DataFrame:
        """:func:`specialization` of this result."""
        from phasemech.interventions.specialization import specialization

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


def _check_dataset(where: str, name: str, ds: Any, columns: tuple[str, ...]) -> int:
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


def _default_reference(ds: Dataset) -> Dataset:
    """A fresh unbalanced set of ``ds``'s task (seed + 1, at most ``REFERENCE_CAP`` sequences)."""
    task = task_of(ds)
    if task is None:
        raise ValueError(
            "ablate: modes 'mean'/'resample' need reference statistics, and ds carries no task "
            "to generate a reference set from: pass reference= (a Dataset)"
        )
    try:
        seed = json.loads(ds.info.description).get("seed", 0)
    except (json.JSONDecodeError, AttributeError):
        seed = 0
    seed = int(seed) if is_int(seed) else 0
    return generate(task, min(len(ds), REFERENCE_CAP), seed + 1)


def _grid(model: PhaseTransformer, stride: Any, grid_offset: Any, where: str) -> tuple[int, int]:
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


@torch.no_grad()
def ablate(
    model: PhaseTransformer,
    ds: Dataset,
    *,
    reference: Dataset | None = None,
    components: Sequence[str] | str = ("head",),
    modes: Sequence[str] | str = DEFAULT_MODES,
    layers: Sequence[int] | None = None,
    stride: int | None = None,
    grid_offset: int | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    batch_size: int = 256,
    progress: bool = False,
) -> AblationResult:
    """Ablate every unit of the chosen components, one at a time, and score each target of ``ds``.

    Args:
        model: the model (left in the mode it came in; scored in eval mode).
        ds: a task set from :func:`phasemech.data.tasks.generate`, ideally ``balanced=True``.
        reference: sequences for ``mean``/``resample`` statistics (same length as ``ds``);
            default: a fresh set of ``ds``'s task, seed + 1, at most 512 sequences.
        components, modes: see the module docstring. With the default modes, modes a component
            does not have are skipped; explicitly given ones must all apply.
        layers: layers to ablate (default: all for ``head``, compressed ones otherwise).
        stride, grid_offset: the grid phases are read on (default: the model's reference grid,
            :func:`phasemech.core.grid.reference_grid`).
        n_boot: cluster-bootstrap replicates for the effect intervals (0: no intervals).
        seed: seeds the resampling donors and the bootstrap.
    """
    where = "ablate"
    if not isinstance(model, PhaseTransformer):
        raise ValueError(f"{where}: model is a {type(model).__name__}: expected a PhaseTransformer")
    runs = _plan(model, components, modes, layers, where)
    stride, grid_offset = _grid(model, stride, grid_offset, where)
    n_boot = check_int(where, "n_boot", n_boot, 0)
    seed = check_int(where, "seed", seed, 0)
    batch_size = check_int(where, "batch_size", batch_size, 1)
    if not isinstance(progress, bool):
        raise ValueError(f"{where}: progress={progress!r} is invalid: must be a bool")
    columns = ("input_ids", "query_pos", "source_pos", "answer", "depth", "group_id", "seq_id")
    seq_len = _check_dataset(where, "ds", ds, columns)
    if seq_len > model.cfg.n_ctx:
        raise ValueError(
            f"{where}: ds has sequences of {seq_len} tokens: at most n_ctx={model.cfg.n_ctx}"
        )
    needs_ref = any(r.mode in ("mean", "resample") for r in runs)
    if needs_ref:
        reference = _default_reference(ds) if reference is None else reference
        ref_len = _check_dataset(where, "reference", reference, ("input_ids",))
        if ref_len != seq_len:
            raise ValueError(
                f"{where}: reference has sequences of {ref_len} tokens, ds of {seq_len}: "
                "per-position statistics need the same length"
            )
    tokens, query_pos, answer = to_tensors(ds)
    ref_tokens = torch.tensor(reference.with_format(None)["input_ids"]) if needs_ref else None
    for name, t in (("ds", tokens), ("reference", ref_tokens)):
        if t is not None and (t.min() < 0 or t.max() >= model.cfg.d_vocab):
            raise ValueError(
                f"{where}: {name} token ids span [{int(t.min())}, {int(t.max())}]: the model "
                f"allows 0..{model.cfg.d_vocab - 1}"
            )
    frame = targets_frame(ds, stride, grid_offset)

    device = next(model.parameters()).device
    tokens, query_pos, answer = tokens.to(device), query_pos.to(device), answer.to(device)
    if ref_tokens is not None:
        ref_tokens = ref_tokens.to(device)
    n_seq, n_tgt = query_pos.shape
    donors = None
    if any(r.mode == "resample" for r in runs):
        gen = np.random.default_rng([seed, 0])
        donors = torch.as_tensor(gen.integers(0, len(ref_tokens), size=n_seq), device=device)
    batches = [slice(i, min(i + batch_size, n_seq)) for i in range(0, n_seq, batch_size)]
    stat_layers = sorted({r.layer for r in runs if r.mode in ("mean", "resample")})
    n_ref_batches = 0 if ref_tokens is None else -(-len(ref_tokens) // batch_size)
    total = len(batches) * (1 + len(runs)) + n_ref_batches * len(stat_layers)

    base = np.empty((len(METRICS), n_seq * n_tgt), dtype=np.float32)
    ablated = np.empty((len(runs), len(METRICS), n_seq * n_tgt), dtype=np.float32)

    def score_into(out: np.ndarray, run: _Run | None, stats: _LayerStats | None) -> None:
        for sl in batches:
            if run is None:
                logits = answer_logits(model, tokens[sl], query_pos[sl])
            else:
                d = None if donors is None else donors[sl]
                repl = _replacement(run, stats, d)
                with ablation(
                    model, run.component, run.mode, run.layer, run.unit, replacement=repl
                ):
                    logits = answer_logits(model, tokens[sl], query_pos[sl])
            rows = slice(sl.start * n_tgt, sl.stop * n_tgt)
            out[:, rows] = _scores(logits, answer[sl]).flatten(1).cpu().numpy()
            bar.advance(task_id)

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not progress,
    )
    was_training = model.training
    model.eval()
    try:
        with bar:
            task_id = bar.add_task(f"ablate {_design(model)}: {len(runs)} runs", total=total)
            score_into(base, None, None)
            by_layer: dict[int, list[int]] = {}
            for k, r in enumerate(runs):
                by_layer.setdefault(r.layer, []).append(k)
            for layer, idx in by_layer.items():
                # one layer's reference activations alive at a time
                stats = _layer_stats(
                    model,
                    ref_tokens,
                    layer,
                    [runs[k] for k in idx],
                    batch_size,
                    lambda: bar.advance(task_id),
                )
                for k in idx:
                    score_into(ablated[k], runs[k], stats)
    finally:
        model.train(was_training)

    targets = _targets_frame(runs, frame, base, ablated, stride, grid_offset)
    effects = _effects(runs, frame, base, ablated, stride, n_boot, seed)
    return AblationResult(
        targets=targets,
        effects=effects,
        stride=stride,
        grid_offset=grid_offset,
        n_layers=model.cfg.n_layers,
        n_heads=model.cfg.n_heads,
        n_kv_heads=model.cfg.n_kv_heads,
        design=_design(model),
    )


def _run_columns(runs: list[_Run], repeat: int) -> dict[str, Any]:
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


def _targets_frame(
    runs: list[_Run],
    frame: pd.DataFrame,
    base: np.ndarray,
    ablated: np.ndarray,
    stride: int,
    grid_offset: int,
) -> pd.DataFrame:
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


def _effects(
    runs: list[_Run],
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
    d, n = stride, len(frame)
    cluster = pd.factorize(frame["group_id"].to_numpy())[0]
    n_clusters = int(cluster.max()) + 1
    phase = frame["phase"].to_numpy()
    flat = cluster * d + phase
    n_cp = np.bincount(flat, minlength=n_clusters * d).reshape(n_clusters, d).astype(float)
    n_phase = n_cp.sum(0)
    rng = np.random.default_rng([seed, 1])
    weights = (
        rng.multinomial(n_clusters, np.full(n_clusters, 1 / n_clusters), size=n_boot).astype(float)
        if n_boot
        else None
    )
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
            diff = ablated[chunk].astype(np.float64) - base64[None]  # [runs, metric, target]
            k = diff.shape[0] * rows
            idx = (np.arange(k)[:, None] * (n_clusters * d) + flat[None, :]).ravel()
            sums = np.bincount(
                idx, weights=diff.reshape(k, n).ravel(), minlength=k * n_clusters * d
            )
            sums = sums.reshape(diff.shape[0], rows, n_clusters, d)
            effect[chunk] = sums.sum(2) / n_phase
            mean_abl[chunk] = mean_base[chunk] + effect[chunk]
            if weights is not None:
                boot = np.einsum("bc,rmcd->rmbd", weights, sums) / den
                lo[chunk], hi[chunk] = _nan_quantiles(boot, axis=2)
    cols = _run_columns(runs, rows * d)
    cols["metric"] = pd.Categorical.from_codes(
        np.tile(np.repeat(np.arange(rows), d), len(runs)).astype(np.int8), categories=METRICS
    )
    cols["phase"] = np.tile(np.arange(d), len(runs) * rows).astype(np.int16)
    cols["effect"] = effect.ravel()
    cols["ci_low"] = lo.ravel()
    cols["ci_high"] = hi.ravel()
    cols["n"] = np.tile(n_phase.astype(np.int64), len(runs) * rows)
    cols["baseline"] = mean_base.ravel()
    cols["ablated"] = mean_abl.ravel()
    return pd.DataFrame(cols)


def _nan_quantiles(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a phase absent from a replicate: NaN
        lo, hi = np.nanquantile(x, [0.025, 0.975], axis=axis)
    return lo, hi


__all__ = ["AblationResult", "ablate", "ablation", "unit_kind"]
