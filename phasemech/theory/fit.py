"""Trained ``gated`` models read as the idealized model of ``phasemech.theory.dynamics``.

Axes: ``batch``, ``target``, ``layer``, ``head`` (a KV head of a gated layer: it owns one pooled
entry per block, the theory's head), ``phase`` (absolute, ``pos mod d``), ``slot``.

The theory's state is ``w_h[slot]``: how much of head ``h``'s pooled entry is the target token
when the target sits in slot ``l``. In a gated layer that mass is ``alpha[b, j] =
softmax_j(z_j + B[slot(j)])``: the content gate ``z_j = x_j . W_gate`` plus the learned bias
``B``. The bias alone can stay near uniform while the *effective* weight, which the gate also
shapes (it sees what the token is: a value, a key, a filler), specialises sharply, so we measure
the effective weight on the tokens that matter: the *targets* (the answers a query retrieves),
averaged over held-out targets at each phase (:func:`effective_weights`).

Reading ``W[head, phase]`` as the theory's ``w`` (the slot of a phase is fixed by the head's grid,
so per-phase weights absorb the offsets) gives the theory's accuracy proxy per phase
(:func:`theory_accuracy`), which :func:`compare` holds against the model's measured accuracy:
which phases are weak (rank correlation), which phases are covered, and which head serves which.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import torch
from datasets import Dataset
from jaxtyping import Float
from scipy import stats as sps

from phasemech.core.device import model_device
from phasemech.data.tasks import to_tensors
from phasemech.theory.dynamics import TheoryConfig, g

#: a phase counts as *weight-covered* when some head puts at least this much of its pooled
#: entry on the target: the target is then the majority of what that entry carries
COVER_WEIGHT = 0.5
#: a phase counts as *accuracy-covered* at this accuracy (the theory's ``covered`` level)
COVER_ACCURACY = 0.9


def _gated_layers(model: Any, layers: Any) -> list[int]:
    comp = model.cfg.compression
    gated = (
        [i for i in comp.compressed_layers(model.cfg.n_layers)] if comp.design == "gated" else []
    )
    if not gated:
        raise ValueError(
            f"effective pooling weights need a design='gated' model, not {comp.design!r}"
        )
    if comp.block_len != comp.stride:
        raise ValueError(
            f"effective weights assume one block per token: block_len={comp.block_len} must "
            f"equal stride={comp.stride}"
        )
    if layers is None:
        return gated
    bad = [i for i in layers if i not in gated]
    if bad:
        raise ValueError(f"layers={list(layers)!r}: {bad} are not gated layers (gated: {gated})")
    return list(layers)


@torch.no_grad()
def effective_weights(
    model: Any, ds: Dataset, layers: Any = None, batch_size: int = 256
) -> pd.DataFrame:
    """Mean pooling weight each gated KV head gives a target token, by the target's phase.

    Returns one row per ``(layer, head, phase)``: ``weight`` (mean over targets of the target's
    share of its block's pooled entry), ``weight_sd``, ``bias_weight`` (``softmax(B)`` at that
    slot: what the learned bias alone would give), ``slot`` (under the head's eval-mode grid)
    and ``n`` (targets). Phases are absolute (``pos mod d``). The model runs where it is; the
    weights are summed on the CPU, so the sums do not depend on the device.
    """
    if len(ds) == 0:
        raise ValueError("dataset is empty: no targets to weigh")
    if "source_pos" not in ds.column_names:
        raise ValueError(
            f"dataset lacks the column 'source_pos' (a phasemech task dataset has it); got "
            f"{ds.column_names}"
        )
    if layers is not None and (isinstance(layers, int) or not hasattr(layers, "__iter__")):
        raise ValueError(f"layers={layers!r} is invalid: expected None or a list of layer indices")
    layers = _gated_layers(model, layers)
    was_training = model.training
    model.eval()
    try:
        return _effective_weights(model, ds, layers, batch_size)
    finally:
        model.train(was_training)


def _effective_weights(model: Any, ds: Dataset, layers: list[int], batch_size: int) -> pd.DataFrame:
    d = model.cfg.compression.stride
    dev = model_device(model)
    tokens, _, _ = to_tensors(ds)
    src = torch.tensor(
        [[int(p) for p in row] for row in ds["source_pos"]], dtype=torch.long
    )  # [batch, target]
    sums = {i: torch.zeros(model.cfg.n_key_value_heads or model.cfg.n_heads, d) for i in layers}
    sq = {i: torch.zeros_like(s) for i, s in sums.items()}
    counts = torch.zeros(d)
    offsets_seen: dict[int, torch.Tensor] = {}
    store: dict[str, torch.Tensor] = {}

    def keep(value: torch.Tensor, hook) -> None:
        store[hook.name] = value.detach().cpu()  # the sums below stay on the CPU

    names = [f"blocks.{i}.attn.hook_block_weights" for i in layers]
    names += [f"blocks.{i}.attn.hook_grid_offset" for i in layers]
    for start in range(0, len(tokens), batch_size):
        tok, pos = tokens[start : start + batch_size], src[start : start + batch_size]
        model.run_with_hooks(tok.to(dev), return_type=None, fwd_hooks=[(n, keep) for n in names])
        phase = pos % d  # [batch, target]
        counts += torch.bincount(phase.flatten(), minlength=d).float()
        onehot = torch.nn.functional.one_hot(phase, d).float()  # [batch, target, phase]
        for i in layers:
            off = store[f"blocks.{i}.attn.hook_grid_offset"]  # [batch, kv_head]
            offsets_seen[i] = off[0]
            tw = _target_weights(store[f"blocks.{i}.attn.hook_block_weights"], off, pos, d)
            sums[i] += torch.einsum("bgt,btp->gp", tw, onehot)
            sq[i] += torch.einsum("bgt,btp->gp", tw**2, onehot)
    rows = []
    for i in layers:
        rows += _layer_rows(model, i, sums[i], sq[i], counts, offsets_seen[i])
    return pd.DataFrame(rows)


def _target_weights(
    w: torch.Tensor, off: torch.Tensor, pos: torch.Tensor, d: int
) -> Float[torch.Tensor, "batch kv_head target"]:
    """Each target's share of the pooled entry of the block that holds it, on each KV head's
    grid: ``w`` ``[batch, kv_head, block, slot(, channel)]``, ``off`` ``[batch, kv_head]``,
    ``pos`` ``[batch, target]``."""
    if w.ndim == 5:  # channel gates: one weight per channel; their mean, as attribution
        w = w.mean(-1)
    rel = pos[:, None, :] - off[:, :, None]  # [batch, kv_head, target]
    block = torch.div(rel, d, rounding_mode="floor") + 1  # block i ends at i*d + o - 1
    slot = rel % d
    b_idx = torch.arange(w.shape[0], device=w.device)[:, None, None]
    g_idx = torch.arange(w.shape[1], device=w.device)[None, :, None]
    return w[b_idx, g_idx, block, slot]


def _layer_rows(
    model: Any,
    layer: int,
    sums: torch.Tensor,
    sq: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
) -> list[dict]:
    """One row per ``(head, phase)`` of ``layer`` from its ``[kv_head, phase]`` sums of the
    target weights and of their squares; ``offsets`` ``[kv_head]`` (the eval-mode grid)."""
    d = len(counts)
    bias = model.blocks[layer].attn.phase_bias.detach().cpu()
    bias = bias.mean(-1) if bias.ndim == 3 else bias  # channel gates: mean over channels
    bias_w = torch.softmax(bias, -1)  # [kv_head, slot]
    n = counts.clamp(min=1)
    mean = sums / n
    sd = (sq / n - mean**2).clamp(min=0).sqrt()
    rows = []
    for h in range(mean.shape[0]):
        o = int(offsets[h])
        for phi in range(d):
            slot = (phi - o) % d
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "phase": phi,
                    "slot": slot,
                    "weight": float(mean[h, phi]),
                    "weight_sd": float(sd[h, phi]),
                    "bias_weight": float(bias_w[h, slot]),
                    "n": int(counts[phi]),
                }
            )
    return rows


def weight_matrix(weights: pd.DataFrame, layer: int | None = None) -> np.ndarray:
    """``[head, phase]`` effective weights of one layer (the last gated layer by default)."""
    layer = int(weights["layer"].max()) if layer is None else layer
    sub = weights[weights["layer"] == layer]
    if sub.empty:
        raise ValueError(
            f"layer={layer!r} has no rows (layers: {sorted(weights['layer'].unique())})"
        )
    return sub.pivot(index="head", columns="phase", values="weight").to_numpy()


def theory_accuracy(
    w: Float[np.ndarray, "head phase"], cfg: TheoryConfig
) -> Float[np.ndarray, "phase"]:
    """The theory's accuracy proxy ``p_phi = sigmoid(alpha sum_h g(w_{h,phi}) - log(V-1))`` for
    given per-phase weights (slot gain 1)."""
    w = np.asarray(w, dtype=float)
    m = cfg.alpha * g(w, cfg.beta, 1.0, cfg.n_windows).sum(0)
    return 1.0 / (1.0 + np.exp(-(m - math.log(cfg.vocab - 1))))


def compare(
    w: Float[np.ndarray, "head phase"],
    observed: Float[np.ndarray, "phase"],
    cfg: TheoryConfig,
) -> dict[str, Any]:
    """Theory read off the effective weights ``w`` against measured per-phase accuracy.

    ``spearman``/``spearman_p``: rank correlation between the theory's predicted accuracy per
    phase and the measured one (NaN when either is constant); ``weak_predicted`` /
    ``weak_observed``: the argmin phases; ``assignment``: each head's strongest phase;
    ``specialised_heads``: heads whose strongest weight is >= ``COVER_WEIGHT``;
    ``served_phases``: distinct strongest phases of those heads; ``covered_weight``: phases
    where some head's weight >= ``COVER_WEIGHT``; ``covered_accuracy``: phases measured at
    >= ``COVER_ACCURACY``.
    """
    w = np.asarray(w, dtype=float)
    observed = np.asarray(observed, dtype=float)
    if w.ndim != 2 or observed.shape != (w.shape[1],):
        raise ValueError(
            f"w must be [head, phase] and observed [phase]: got {w.shape} and {observed.shape}"
        )
    pred = theory_accuracy(w, cfg)
    if np.ptp(pred) > 0 and np.ptp(observed) > 0:
        rho, p = sps.spearmanr(pred, observed)
    else:
        rho, p = math.nan, math.nan
    assignment = w.argmax(1)
    # a head serves a phase only if it puts most of its entry there (argmax of flat weights
    # is not specialisation)
    specialised = w.max(1) >= COVER_WEIGHT
    return {
        "predicted_accuracy": pred.round(4).tolist(),
        "spearman": float(rho),
        "spearman_p": float(p),
        "weak_predicted": int(np.nanargmin(pred)),
        "weak_observed": int(np.nanargmin(observed)),
        "assignment": assignment.tolist(),
        "specialised_heads": int(specialised.sum()),
        "served_phases": int(len(set(assignment[specialised].tolist()))),
        "covered_weight": int((w.max(0) >= COVER_WEIGHT).sum()),
        "covered_accuracy": int((observed >= COVER_ACCURACY).sum()),
        "max_weight": w.max(1).round(4).tolist(),
    }


def pooled_rank_test(
    pairs: list[tuple[Any, Any]], n_perm: int = 20000, seed: int = 0
) -> dict[str, float]:
    """One test over several models that the theory ranks their phases right.

    ``pairs``: ``(predicted, observed)`` per-phase arrays, one pair per model. Statistic: the
    mean Spearman correlation over models; null: phases permuted independently within each
    model (exchangeable under "the prediction says nothing about the ranking"). With d = 4 a
    single model's Spearman takes only a handful of values, so only the pooled test can reach
    significance. Models where either array is constant are left out (``n_models`` says how
    many were used). Returns ``mean_spearman``, ``p`` (one-sided, >=) and ``n_models``.
    """
    used = [
        (np.asarray(p, float), np.asarray(o, float))
        for p, o in pairs
        if np.ptp(np.asarray(p, float)) > 0 and np.ptp(np.asarray(o, float)) > 0
    ]
    if not used:
        return {"mean_spearman": math.nan, "p": math.nan, "n_models": 0}
    rng = np.random.default_rng(seed)
    ranks = [(sps.rankdata(p), sps.rankdata(o)) for p, o in used]

    def rho(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a = a - a.mean(-1, keepdims=True)
        b = b - b.mean(-1, keepdims=True)
        return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))

    observed = float(np.mean([rho(p, o) for p, o in ranks]))
    null = np.zeros(n_perm)
    for p, o in ranks:
        perm = rng.permuted(np.broadcast_to(o, (n_perm, len(o))), axis=1)
        null += rho(np.broadcast_to(p, perm.shape), perm)
    null /= len(ranks)
    p_value = float((1 + np.sum(null >= observed - 1e-12)) / (n_perm + 1))
    return {"mean_spearman": observed, "p": p_value, "n_models": len(ranks)}


__all__ = [
    "COVER_ACCURACY",
    "COVER_WEIGHT",
    "compare",
    "effective_weights",
    "pooled_rank_test",
    "theory_accuracy",
    "weight_matrix",
]
