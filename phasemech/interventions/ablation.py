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
phase_bias zero (per kv_head)           the learned intra-block bias of KV head ``g``: ``gated``'s
                                        ``phase_bias[g]``, ``csa``/``hca``'s ``B_K[g], B_V[g]``
                                        (``dsa``: its indexer's ``pool_bias``, one unit):
                                        pooling by the content gate alone
branch_*   zero (per head)              ``nsa``: the head's gate on one branch (``cmp``, ``slc`` or
                                        ``win``) is 0 (``hook_branch_gate``)
========== ============================ ===========================================================

``mean`` replaces an activation by its mean over a *reference* set of sequences (per position for
``hook_z``, per block index for block entries); ``resample`` by the same activation of one
reference sequence drawn at random per dataset sequence (the same draw for every unit, seeded).
A query row that a mask leaves with nothing visible gets a zero output (``masked_softmax``).
One ablation applied to a model (the hooks, as the context manager :func:`ablation`) is
:mod:`phasemech.interventions.ablation_hooks`.

Metrics per target from the answer-position logits: ``accuracy`` (greedy answer right, 0/1),
``logprob`` (log-probability of the answer) and ``logit_diff`` (answer logit minus the best other
logit). The effect of an ablation is ``ablated - baseline`` per target; :attr:`AblationResult.
effects` averages it per phase with cluster-bootstrap intervals over contents (``group_id``: the
``stride`` shifted copies of a content in a phase-balanced set are correlated, so they are
resampled together). :func:`specialization` asks, per unit, whether the effect depends on phase.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from jaxtyping import Float, Int
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor

from phasemech.core.config import is_int
from phasemech.core.device import model_device
from phasemech.core.validation import check_int
from phasemech.data.tasks import generate, targets_frame, task_of, to_tensors
from phasemech.interventions.ablation_hooks import ablation

# the vocabulary (``COMPONENTS``, ``MODES``, ``UNIT_*``, ``VALID_MODES``) and the result moved
# to their own modules; `X as X` keeps them importable here
from phasemech.interventions.ablation_plan import COMPONENTS as COMPONENTS
from phasemech.interventions.ablation_plan import (
    DEFAULT_MODES,
    METRICS,
    AblationRun,
    check_dataset,
    model_design,
    plan_runs,
    resolve_grid,
    unit_kind,
)
from phasemech.interventions.ablation_plan import MODES as MODES
from phasemech.interventions.ablation_plan import UNIT_KEYS as UNIT_KEYS
from phasemech.interventions.ablation_plan import UNIT_KINDS as UNIT_KINDS
from phasemech.interventions.ablation_plan import VALID_MODES as VALID_MODES
from phasemech.interventions.ablation_result import (
    AblationResult,
    ablation_targets_frame,
    phase_effects,
)
from phasemech.measure.readout import answer_logits
from phasemech.model.transformer import PhaseTransformer

#: default size cap of a generated reference set (mean / resample statistics)
REFERENCE_CAP = 512


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
    runs: list[AblationRun],
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


def _replacement(run: AblationRun, stats: _LayerStats, donors: Tensor | None) -> Any:
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


def _check_options(
    where: str, n_boot: Any, seed: Any, batch_size: Any, progress: Any
) -> tuple[int, int, int]:
    n_boot = check_int(where, "n_boot", n_boot, 0)
    seed = check_int(where, "seed", seed, 0)
    batch_size = check_int(where, "batch_size", batch_size, 1)
    if not isinstance(progress, bool):
        raise ValueError(f"{where}: progress={progress!r} is invalid: must be a bool")
    return n_boot, seed, batch_size


def _checked_tensors(
    where: str, model: PhaseTransformer, ds: Any, reference: Any, runs: list[AblationRun]
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``ds``'s tokens ``[batch, pos]``, query positions and answers ``[batch, target]``, and
    the reference tokens ``[ref, pos]`` (None when no run needs reference statistics)."""
    columns = ("input_ids", "query_pos", "source_pos", "answer", "depth", "group_id", "seq_id")
    seq_len = check_dataset(where, "ds", ds, columns)
    if seq_len > model.cfg.n_ctx:
        raise ValueError(
            f"{where}: ds has sequences of {seq_len} tokens: at most n_ctx={model.cfg.n_ctx}"
        )
    needs_ref = any(r.mode in ("mean", "resample") for r in runs)
    if needs_ref:
        reference = _default_reference(ds) if reference is None else reference
        ref_len = check_dataset(where, "reference", reference, ("input_ids",))
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
    return tokens, query_pos, answer, ref_tokens


@dataclass(frozen=True)
class _Scoring:
    """The scored set on the model's device, cut into batches."""

    model: PhaseTransformer
    tokens: Tensor  # [batch, pos]
    query_pos: Tensor  # [batch, target]
    answer: Tensor  # [batch, target]
    donors: Tensor | None  # [batch]: the reference sequence each one resamples
    batches: list[slice]


def _score_into(
    out: np.ndarray,
    s: _Scoring,
    run: AblationRun | None,
    stats: _LayerStats | None,
    advance: Callable[[], Any],
) -> None:
    """``out[metric, target]``: every target scored with ``run`` applied (None: intact)."""
    n_tgt = s.query_pos.shape[1]
    for sl in s.batches:
        if run is None:
            logits = answer_logits(s.model, s.tokens[sl], s.query_pos[sl])
        else:
            d = None if s.donors is None else s.donors[sl]
            repl = _replacement(run, stats, d)
            with ablation(s.model, run.component, run.mode, run.layer, run.unit, replacement=repl):
                logits = answer_logits(s.model, s.tokens[sl], s.query_pos[sl])
        rows = slice(sl.start * n_tgt, sl.stop * n_tgt)
        out[:, rows] = _scores(logits, s.answer[sl]).flatten(1).cpu().numpy()
        advance()


def _progress_bar(progress: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not progress,
    )


def _score_runs(
    model: PhaseTransformer,
    runs: list[AblationRun],
    tensors: tuple[Tensor, Tensor, Tensor, Tensor | None],
    seed: int,
    batch_size: int,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Scores of the intact model ``[metric, target]`` and of each run ``[run, metric, target]``
    (targets sequence-major), in eval mode."""
    device = model_device(model)  # data are built on the CPU; the model may sit on a GPU
    tokens, query_pos, answer, ref_tokens = (t if t is None else t.to(device) for t in tensors)
    n_seq, n_tgt = query_pos.shape
    donors = None
    if any(r.mode == "resample" for r in runs):
        gen = np.random.default_rng([seed, 0])
        donors = torch.as_tensor(gen.integers(0, len(ref_tokens), size=n_seq), device=device)
    batches = [slice(i, min(i + batch_size, n_seq)) for i in range(0, n_seq, batch_size)]
    scoring = _Scoring(model, tokens, query_pos, answer, donors, batches)
    stat_layers = sorted({r.layer for r in runs if r.mode in ("mean", "resample")})
    n_ref_batches = 0 if ref_tokens is None else -(-len(ref_tokens) // batch_size)
    total = len(batches) * (1 + len(runs)) + n_ref_batches * len(stat_layers)
    base = np.empty((len(METRICS), n_seq * n_tgt), dtype=np.float32)
    ablated = np.empty((len(runs), len(METRICS), n_seq * n_tgt), dtype=np.float32)
    by_layer: dict[int, list[int]] = {}
    for k, r in enumerate(runs):
        by_layer.setdefault(r.layer, []).append(k)
    bar = _progress_bar(progress)
    was_training = model.training
    model.eval()
    try:
        with bar:
            task_id = bar.add_task(f"ablate {model_design(model)}: {len(runs)} runs", total=total)
            advance = functools.partial(bar.advance, task_id)
            _score_into(base, scoring, None, None, advance)
            for layer, idx in by_layer.items():
                # one layer's reference activations alive at a time
                layer_runs = [runs[k] for k in idx]
                stats = _layer_stats(model, ref_tokens, layer, layer_runs, batch_size, advance)
                for k in idx:
                    _score_into(ablated[k], scoring, runs[k], stats, advance)
    finally:
        model.train(was_training)
    return base, ablated


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
    runs = plan_runs(model, components, modes, layers, where)
    stride, grid_offset = resolve_grid(model, stride, grid_offset, where)
    n_boot, seed, batch_size = _check_options(where, n_boot, seed, batch_size, progress)
    tensors = _checked_tensors(where, model, ds, reference, runs)
    frame = targets_frame(ds, stride, grid_offset)
    base, ablated = _score_runs(model, runs, tensors, seed, batch_size, progress)
    return AblationResult(
        targets=ablation_targets_frame(runs, frame, base, ablated, stride, grid_offset),
        effects=phase_effects(runs, frame, base, ablated, stride, n_boot, seed),
        stride=stride,
        grid_offset=grid_offset,
        n_layers=model.cfg.n_layers,
        n_heads=model.cfg.n_heads,
        n_kv_heads=model.cfg.n_kv_heads,
        design=model_design(model),
    )


__all__ = ["AblationResult", "ablate", "ablation", "unit_kind"]
