"""Activation patching by source phase: contrasts, a batched exact engine, attribution patching.

Axes: ``batch`` (one clean/corrupted pair, one target each), ``pos``, ``layer``, ``head``,
``kv_head``, ``block``, ``phase``; ``copy`` is one patched run of one pair.

**Contrasts** (:func:`make_contrast`) pair a clean and a corrupted run of the same target:

* ``grid``: the same tokens, the corrupted run's compression grid shifted by ``shift``
  (``PhaseTransformer.shift_grid``): the needle's phase changes and nothing else does;
* ``content``: the content moved right by ``shift`` tokens (``shift`` new fillers in front, as
  many tail fillers dropped): phase and absolute position change together. Activations are
  patched content-aligned: clean position ``p`` goes to corrupted position ``p + shift``;
* ``answer``: the needle's value replaced by another value (the standard corrupted-answer pair;
  the replacement is the foil of the logit difference).

**Metric** per pair, read at the answer position only: ``logit_diff`` (answer minus foil logit;
the foil is the corrupted value, or for ``grid``/``content`` the corrupted run's best wrong
token), ``logprob`` or ``prob`` of the answer. Effects are reported raw (patched minus corrupted)
and normalised, ``(patched - corrupted) / (clean - corrupted)`` on group means, 1 = fully
restored.

**The engine** (:func:`patch_heads`) returns exactly what
``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` / ``_by_pos`` return for the
same pairs (tested to 1e-5), much faster:

* the output projection is linear per head, so patching head ``h`` at layer ``L`` adds
  ``(z_clean - z_corr) W_O[h]`` to the corrupted residual: no re-run of layer ``L``;
* a patch whose clean and corrupted activations are identical, or that sits after the answer
  position, cannot change the metric (causality) and is not run;
* the remaining patches run as copies in the batch dimension, from layer ``L + 1``, on positions
  up to the answer only, unembedding only the answer row; under ``torch.inference_mode``;
* after the last layer nothing but the final norm and unembedding follows, so its patches are a
  closed form on the answer rows (and only the answer position matters for ``_by_pos``).

:func:`patch_sites` patches other sites the same batched way (``kv_block``: a KV head's
compressed entries, ``pattern``: a head's attention pattern, both under the ``answer`` contrast
only, where entry ``i`` covers the same tokens in both runs; ``z``: the hook-based reference
path). :func:`attribution_patch` is the first-order estimate (AtP) of every head x position
patch from one forward and one backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from datasets import Dataset
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.attention import CompressedAttentionMixin
from phasemech.grid import phase_of
from phasemech.io import atomic_write, write_json_atomic
from phasemech.model import PhaseTransformer
from phasemech.tasks import targets_frame, task_of, to_tensors

CONTRASTS = ("grid", "content", "answer")
METRICS = ("logit_diff", "logprob", "prob")
SITES = ("z", "kv_block", "pattern")


# ------------------------------------------------------------------------------------ contrasts


@dataclass(frozen=True)
class Contrast:
    """Clean and corrupted runs of one target per pair (see the module docstring).

    ``shift`` is the content offset: corrupted position = clean position + ``shift`` for the
    ``content`` contrast, 0 otherwise. ``foil`` is ``-1`` where it is chosen from the corrupted
    run (its best wrong token). ``pairs`` has one row per pair: ``seq_id, group_id, target,
    query_pos, source_pos, depth, distance, phase`` (clean needle's phase) and
    ``corrupted_phase``.
    """

    kind: str
    clean_tokens: Int[Tensor, "batch pos"]
    corrupted_tokens: Int[Tensor, "batch pos"]
    clean_grid: Int[Tensor, "batch"]
    corrupted_grid: Int[Tensor, "batch"]
    query_pos: Int[Tensor, "batch"]
    answer: Int[Tensor, "batch"]
    foil: Int[Tensor, "batch"]
    stride: int
    shift: int
    pairs: pd.DataFrame = field(repr=False)

    @property
    def corrupted_query_pos(self) -> Int[Tensor, "batch"]:
        return self.query_pos + (self.shift if self.kind == "content" else 0)

    def __len__(self) -> int:
        return int(self.clean_tokens.shape[0])


def _check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed {', '.join(allowed)}")


def make_contrast(
    ds: Dataset,
    kind: str = "grid",
    *,
    stride: int,
    grid_offset: int = 0,
    shift: int | None = None,
    n_pairs: int | None = 256,
    seed: int = 0,
) -> Contrast:
    """Pairs from a task dataset: the first ``n_pairs`` sequences, one target each (drawn with
    ``seed``). ``shift`` (``grid``/``content``, default ``stride // 2``) must not be a multiple
    of ``stride`` (the phase would not change). Phases are on the grid ``(stride, grid_offset)``.
    """
    _check_choice("kind", kind, CONTRASTS)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 2:
        raise ValueError(f"stride={stride!r} is invalid: expected an int >= 2")
    if isinstance(grid_offset, bool) or not isinstance(grid_offset, int):
        raise ValueError(f"grid_offset={grid_offset!r} is invalid: expected an int")
    if shift is None:
        shift = stride // 2 if kind != "answer" else 0
    if kind == "answer" and shift != 0:
        raise ValueError(f"shift={shift} is invalid for the answer contrast: only 0 is allowed")
    if kind != "answer" and (
        isinstance(shift, bool) or not isinstance(shift, int) or shift % stride == 0
    ):
        raise ValueError(
            f"shift={shift!r} is invalid for the {kind} contrast: expected an int that is not a "
            f"multiple of stride={stride} (the needle's phase must change)"
        )
    if kind == "content" and shift < 0:
        raise ValueError(f"shift={shift} is invalid for the content contrast: expected > 0")
    n = len(ds) if n_pairs is None else n_pairs
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(ds):
        raise ValueError(f"n_pairs={n_pairs!r} is invalid: expected 1..{len(ds)} (dataset size)")
    rows = ds.select(range(n))
    tokens, query_pos, answer = to_tensors(rows)
    seq_len = tokens.shape[1]
    rng = np.random.default_rng(seed)
    pick = torch.as_tensor(rng.integers(0, query_pos.shape[1], size=n))
    ar = torch.arange(n)
    qp, ans = query_pos[ar, pick], answer[ar, pick]
    # targets_frame lists each row's targets in order: row i's pick sits at start_i + pick_i
    counts = np.array([len(q) for q in rows["query_pos"]])
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    df = targets_frame(rows, stride, grid_offset).iloc[starts + pick.numpy()]
    df = df.reset_index(drop=True)
    source = torch.tensor(df.source_pos.to_numpy())
    corrupted = tokens.clone()
    foil = torch.full((n,), -1, dtype=torch.long)
    clean_grid = torch.zeros(n, dtype=torch.long)
    corrupted_grid = torch.zeros(n, dtype=torch.long)
    vocab = _vocab_size(ds, tokens)
    if kind == "grid":
        corrupted_grid += shift
        df["corrupted_phase"] = phase_of(df.source_pos.to_numpy(), stride, grid_offset + shift)
    elif kind == "content":
        if int(qp.max()) + shift >= seq_len:
            raise ValueError(
                f"shift={shift} moves a query past the sequence end (query at {int(qp.max())}, "
                f"{seq_len} positions): use a smaller shift or sequences with more tail filler"
            )
        fill = torch.as_tensor(rng.integers(vocab // 2, vocab, size=(n, shift)))
        corrupted = torch.cat([fill, tokens[:, : seq_len - shift]], dim=1)
        df["corrupted_phase"] = phase_of(df.source_pos.to_numpy() + shift, stride, grid_offset)
    else:
        # another value from the value range (keys sit in [1, V/2), values in [V/2, V))
        other = torch.as_tensor(rng.integers(vocab // 2, vocab - 1, size=n))
        other = other + (other >= ans).long()
        corrupted[ar, source] = other
        after = qp + 1  # keep the query's own copy of the value consistent
        inside = after < seq_len
        corrupted[ar[inside], after[inside]] = other[inside]
        foil = other
        df["corrupted_phase"] = df["phase"]
    return Contrast(
        kind=kind,
        clean_tokens=tokens,
        corrupted_tokens=corrupted,
        clean_grid=clean_grid,
        corrupted_grid=corrupted_grid,
        query_pos=qp,
        answer=ans,
        foil=foil,
        stride=stride,
        shift=shift,
        pairs=df,
    )


def _vocab_size(ds: Dataset, tokens: Tensor) -> int:
    task = task_of(ds)
    return int(task.vocab_size) if task is not None else int(tokens.max()) + 1


# --------------------------------------------------------------------------------------- metric


def metric_values(
    logits: Float[Tensor, "copy vocab"],
    answer: Int[Tensor, "copy"],
    foil: Int[Tensor, "copy"],
    metric: str,
) -> Float[Tensor, "copy"]:
    """The per-pair metric from answer-position logits."""
    right = logits.gather(-1, answer[:, None])[:, 0]
    if metric == "logit_diff":
        return right - logits.gather(-1, foil[:, None])[:, 0]
    lp = logits.log_softmax(-1).gather(-1, answer[:, None])[:, 0]
    return lp if metric == "logprob" else lp.exp()


def _logits(model: HookedTransformer, rows: Float[Tensor, "copy d_model"]) -> Tensor:
    if model.cfg.normalization_type is not None:
        rows = model.ln_final(rows)
    return apply_softcap(model.unembed(rows[:, None])[:, 0], model.cfg.output_logits_soft_cap)


def _grid(model: HookedTransformer, shift: Tensor):
    """``shift_grid`` on a PhaseTransformer; nothing on a plain HookedTransformer."""
    if isinstance(model, PhaseTransformer):
        return model.shift_grid(shift)
    if bool((shift != 0).any()):
        raise ValueError("a grid contrast needs a PhaseTransformer (a plain model has no grid)")
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------- the baseline


@dataclass
class _Runs:
    """Cached clean and corrupted activations (corrupted positions; clean content-aligned)."""

    clean: Tensor  # [batch] metric
    corrupted: Tensor  # [batch]
    foil: Tensor  # [batch]
    qpos: Tensor  # [batch] answer position in the corrupted run
    src: dict[str, Tensor]  # hook name -> clean activation aligned to corrupted positions
    corr: dict[str, Tensor]  # hook name -> corrupted activation


def _align(clean: Tensor, corr: Tensor, shift: int, pos_dim: int = 1) -> Tensor:
    """Clean activation laid on corrupted positions (``p -> p + shift``); the first ``shift``
    positions have no clean counterpart and keep the corrupted value (not patched)."""
    if shift == 0:
        return clean
    out = corr.clone()
    n = clean.shape[pos_dim] - shift
    out.narrow(pos_dim, shift, n).copy_(clean.narrow(pos_dim, 0, n))
    return out


def _baseline(model: HookedTransformer, c: Contrast, metric: str, names: list[str]) -> _Runs:
    want = set(names)
    with _grid(model, c.clean_grid):
        logits, clean_cache = model.run_with_cache(c.clean_tokens, names_filter=lambda n: n in want)
    ar = torch.arange(len(c))
    clean_rows = logits[ar, c.query_pos]
    with _grid(model, c.corrupted_grid):
        logits, corr_cache = model.run_with_cache(
            c.corrupted_tokens, names_filter=lambda n: n in want
        )
    qpos = c.corrupted_query_pos
    corr_rows = logits[ar, qpos]
    foil = c.foil.clone()
    if bool((foil < 0).any()):  # the corrupted run's best wrong token
        best_wrong = corr_rows.scatter(-1, c.answer[:, None], -torch.inf).argmax(-1)
        foil = torch.where(foil < 0, best_wrong, foil)
    src, corr = {}, {}
    for name in names:
        if name not in corr_cache.cache_dict:
            continue  # a hook this design never calls (route has no hook_v_block)
        corr[name] = corr_cache[name]
        pos_dim = 2 if name.endswith("hook_pattern") else 1
        src[name] = (
            _align(clean_cache[name], corr_cache[name], c.shift, pos_dim)
            if c.kind == "content"
            else clean_cache[name]
        )
    return _Runs(
        clean=metric_values(clean_rows, c.answer, foil, metric),
        corrupted=metric_values(corr_rows, c.answer, foil, metric),
        foil=foil,
        qpos=qpos,
        src=src,
        corr=corr,
    )


# ------------------------------------------------------------------------------------ the result


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


# ------------------------------------------------------------------------------------ the engine


def _check_model(model: HookedTransformer, c: Contrast, metric: str) -> None:
    _check_choice("metric", metric, METRICS)
    if not isinstance(c, Contrast):
        raise ValueError(f"contrast={type(c).__name__} is invalid: build one with make_contrast")
    if c.clean_tokens.shape[1] > model.cfg.n_ctx:
        raise ValueError(
            f"pairs have {c.clean_tokens.shape[1]} positions: the model takes n_ctx="
            f"{model.cfg.n_ctx}"
        )
    top = int(max(c.clean_tokens.max(), c.corrupted_tokens.max()))
    if top >= model.cfg.d_vocab:
        raise ValueError(f"token id {top} is out of the model's vocabulary ({model.cfg.d_vocab})")
    if c.kind == "grid":
        # a grid contrast must move the needle's phase on the grid the model compresses with
        comp = model.cfg.compression if isinstance(model, PhaseTransformer) else None
        if comp is None or not comp.enabled:
            raise ValueError(
                "the grid contrast needs a model with compressed layers: on a dense model the "
                "clean and corrupted runs are identical (use the answer or content contrast)"
            )
        if c.shift % comp.stride == 0:
            raise ValueError(
                f"grid shift {c.shift} is a multiple of the model's stride {comp.stride}: the "
                "corrupted grid equals the clean one (build the contrast with the model's stride)"
            )


def _check_layers(model: HookedTransformer, layers: Iterable[int] | None) -> tuple[int, ...]:
    n = model.cfg.n_layers
    if layers is None:
        return tuple(range(n))
    layers = tuple(layers)
    bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n]
    if bad or not layers:
        raise ValueError(
            f"layers={list(layers)!r} is invalid: expected layer indices in 0..{n - 1}"
        )
    return tuple(sorted(set(layers)))


def _fast_block(model: HookedTransformer) -> bool:
    """Blocks whose attention output is added straight to the residual (the delta trick)."""
    cfg = model.cfg
    from transformer_lens.components.transformer_block import POST_NORM_ARCHITECTURES

    return not (
        cfg.parallel_attn_mlp
        or cfg.use_normalization_before_and_after
        or cfg.original_architecture in POST_NORM_ARCHITECTURES
    )


def _finish_block(model: HookedTransformer, layer: int, mid: Tensor) -> Tensor:
    """``resid_post`` from a patched ``resid_mid`` (the layer's MLP, if any)."""
    if model.cfg.attn_only:
        return mid
    block = model.blocks[layer]
    mid = mid.contiguous()  # TL's MLP views its input flat
    return mid + block.apply_mlp(block.ln2(mid))


def _rows_ok(model: HookedTransformer) -> bool:
    """Whether the last layer can be computed at the answer rows alone (:func:`_last_rows`):
    standard blocks, no hooks on it, and attention features this file reimplements."""
    cfg = model.cfg
    block = model.blocks[-1]
    if (
        cfg.use_split_qkv_input
        or cfg.use_attn_in
        or cfg.positional_embedding_type
        not in (
            "standard",
            "rotary",
        )
    ):
        return False
    if any(isinstance(m, HookPoint) and m.has_hooks() for m in block.modules()):
        return False
    if isinstance(block.attn, CompressedAttentionMixin):
        return True
    return (
        block.attn.attn_type == "global"
        and cfg.attention_dir == "causal"
        and cfg.clip_qkv is None
        and not cfg.use_attention_sinks
        and not cfg.use_logn_attn
        and not (cfg.original_architecture or "").startswith("Olmo")
    )


def _dense_rows(attn: Any, x: Tensor, rows: Tensor) -> Float[Tensor, "batch d_model"]:
    """TransformerLens attention's output at one query row per sequence (causal, no mask)."""
    ar = torch.arange(x.shape[0])
    q, k, v = attn.calculate_qkv_matrices(x, x, x)
    if attn.cfg.positional_embedding_type == "rotary":
        q, k = attn.apply_rotary(q, 0, None), attn.apply_rotary(k, 0, None)
    rep = q.shape[2] // k.shape[2]  # grouped-query attention shares K/V across heads
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bhd,bkhd->bhk", q[ar, rows], k) / attn.attn_scale
    scores = apply_softcap(scores, attn.cfg.attn_scores_soft_cap)
    causal = torch.arange(x.shape[1])[None, None, :] <= rows[:, None, None]
    pattern = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    z = torch.einsum("bhk,bkhd->bhd", pattern.nan_to_num(0.0), v)
    return torch.einsum("bhd,hdm->bm", z, attn.W_O) + attn.b_O


def _last_rows(model: HookedTransformer, x: Tensor, rows: Tensor) -> Float[Tensor, "batch d_model"]:
    """The final residual at one position per sequence: the last block run for that query
    row only (its keys and values still come from every position)."""
    last = model.cfg.n_layers - 1
    block = model.blocks[last]
    normed = block.ln1(x)
    if isinstance(block.attn, CompressedAttentionMixin):
        model.grid_state.begin_forward(False)
        attn_out = block.attn.forward_rows(normed, rows)
    else:
        attn_out = _dense_rows(block.attn, normed, rows)
    mid = x[torch.arange(x.shape[0]), rows] + attn_out
    return _finish_block(model, last, mid[:, None])[:, 0]


@torch.inference_mode()
def patch_heads(
    model: HookedTransformer,
    contrast: Contrast,
    *,
    metric: str = "logit_diff",
    by_pos: bool = False,
    layers: Iterable[int] | None = None,
    max_copies: int = 1024,
    progress: bool = False,
) -> PatchResult:
    """Patch each head's output (``hook_z``) from the clean into the corrupted run, at all
    positions or one position at a time. Exact; equal to TransformerLens'
    ``get_act_patch_attn_head_out_all_pos`` / ``_by_pos`` on the same pairs."""
    _check_model(model, contrast, metric)
    layers = _check_layers(model, layers)
    if isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 1:
        raise ValueError(f"max_copies={max_copies!r} is invalid: expected an int >= 1")
    if not _fast_block(model):
        return patch_sites(
            model,
            contrast,
            site="z",
            metric=metric,
            by_pos=by_pos,
            layers=layers,
            max_copies=max_copies,
            progress=progress,
        )
    model.eval()
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    mid = "hook_resid_post" if model.cfg.attn_only else "hook_resid_mid"
    names = [f"blocks.{lay}.attn.hook_z" for lay in layers]
    names += [f"blocks.{lay}.{mid}" for lay in layers]
    names += [f"blocks.{lay}.hook_resid_post" for lay in layers]
    runs = _baseline(model, contrast, metric, list(dict.fromkeys(names)))
    batch, seq = contrast.corrupted_tokens.shape
    n_pos = seq if by_pos else 1
    values = np.full((n_layers, n_pos, n_heads, batch), np.nan)
    corr_np = runs.corrupted.double().numpy()
    values[list(layers)] = corr_np  # every patch starts as "no change", then is overwritten
    ar = torch.arange(batch)
    n_run = 0
    rows_ok = _rows_ok(model) and isinstance(model, PhaseTransformer)
    bar = tqdm(total=len(layers) * n_heads, desc="patching heads", disable=not progress)
    for lay in layers:
        z_src, z_corr = (
            runs.src[f"blocks.{lay}.attn.hook_z"],
            runs.corr[f"blocks.{lay}.attn.hook_z"],
        )
        # causal: a patch after the answer position cannot reach it; identical z changes nothing
        upto = torch.arange(seq)[None, :] <= runs.qpos[:, None]  # [batch, pos]
        differs = (z_src != z_corr).any(-1) & upto[..., None]  # [batch, pos, head]
        dz = (z_src - z_corr) * upto[..., None, None]
        w_o = model.blocks[lay].attn.W_O  # [head, d_head, d_model]
        resid_mid = runs.corr[f"blocks.{lay}.{mid}"]
        if lay == n_layers - 1:
            # closed form: only the answer row matters after the last layer
            row_mid = resid_mid[ar, runs.qpos]  # [batch, d_model]
            d_row = torch.einsum("bhd,hdm->bhm", dz[ar, runs.qpos], w_o)
            rows = _finish_block(model, lay, row_mid[:, None] + d_row)  # [batch, head, d_model]
            logits = _logits(model, rows.reshape(batch * n_heads, -1))
            got = metric_values(
                logits,
                contrast.answer.repeat_interleave(n_heads),
                runs.foil.repeat_interleave(n_heads),
                metric,
            ).reshape(batch, n_heads)
            got = torch.where(differs[ar, runs.qpos], got, runs.corrupted[:, None])
            n_run += int(differs[ar, runs.qpos].sum())
            if by_pos:
                values[lay, runs.qpos.numpy(), :, ar.numpy()] = got.double().numpy()
            else:
                values[lay, 0] = got.T.double().numpy()
            bar.update(n_heads)
            continue
        resid_post = runs.corr[f"blocks.{lay}.hook_resid_post"]
        # copies: (pair, head[, pos]) whose patch can change the metric
        if by_pos:
            b_idx, p_idx, h_idx = differs.nonzero(as_tuple=True)
        else:
            b_idx, h_idx = differs.any(1).nonzero(as_tuple=True)
            p_idx = torch.zeros_like(b_idx)
        # longest answer position first: each chunk runs only up to its own longest
        order = torch.argsort(runs.qpos[b_idx], descending=True, stable=True)
        b_idx, p_idx, h_idx = b_idx[order], p_idx[order], h_idx[order]
        for start in range(0, len(b_idx), max_copies):
            b, p, h = (t[start : start + max_copies] for t in (b_idx, p_idx, h_idx))
            upto_len = int(runs.qpos[b].max()) + 1
            if by_pos:
                delta_rows = torch.einsum("cd,cdm->cm", dz[b, p, h], w_o[h])
                mid_rows = resid_mid[b, p] + delta_rows
                x = resid_post[b, :upto_len].clone()
                x[torch.arange(len(b)), p] = _finish_block(model, lay, mid_rows)
            else:
                delta = torch.einsum("cpd,cdm->cpm", dz[b, :upto_len, h], w_o[h])
                x = _finish_block(model, lay, resid_mid[b, :upto_len] + delta)
            with _grid(model, contrast.corrupted_grid[b]):
                if rows_ok:  # the last layer at the answer rows only
                    if lay + 1 < n_layers - 1:
                        x = model(
                            x, start_at_layer=lay + 1, stop_at_layer=n_layers - 1, return_type=None
                        )
                    final = _last_rows(model, x, runs.qpos[b])
                else:
                    out = model(x, start_at_layer=lay + 1, stop_at_layer=n_layers, return_type=None)
                    final = out[torch.arange(len(b)), runs.qpos[b]]
            logits = _logits(model, final)
            got = metric_values(logits, contrast.answer[b], runs.foil[b], metric)
            pos_idx = p.numpy() if by_pos else np.zeros(len(b), dtype=int)
            values[lay, pos_idx, h.numpy(), b.numpy()] = got.double().numpy()
            n_run += len(b)
        bar.update(n_heads)
    bar.close()
    return _result("z", by_pos, metric, contrast, values, runs, layers, n_run)


def _result(
    site: str,
    by_pos: bool,
    metric: str,
    c: Contrast,
    values: np.ndarray,
    runs: _Runs,
    layers: tuple[int, ...],
    n_run: int,
) -> PatchResult:
    pairs = c.pairs.copy()
    pairs["foil"] = runs.foil.numpy()
    pairs["clean"] = runs.clean.double().numpy()
    pairs["corrupted"] = runs.corrupted.double().numpy()
    return PatchResult(
        site=site,
        by_pos=by_pos,
        metric=metric,
        contrast=c.kind,
        stride=c.stride,
        values=values,
        clean=pairs["clean"].to_numpy(),
        corrupted=pairs["corrupted"].to_numpy(),
        pairs=pairs,
        layers=layers,
        n_run=n_run,
    )


# ------------------------------------------------------------------------ other sites (hooks)


def _site_hooks(model: HookedTransformer, site: str, layer: int) -> list[str]:
    attn = f"blocks.{layer}.attn"
    if site == "z":
        return [f"{attn}.hook_z"]
    if site == "pattern":
        return [f"{attn}.hook_pattern"]
    present = [f"{attn}.hook_k_block", f"{attn}.hook_v_block"]
    return [n for n in present if n in model.hook_dict]


def _unit_diff(site: str, ne: Tensor) -> Tensor:
    """Where clean and corrupted differ, as ``[batch, unit, pos]`` (``kv_block``: ``[batch,
    unit, 1]``) from the elementwise ``!=`` of the site's activations."""
    if site == "z":  # [batch, pos, head, d_head]
        return ne.any(-1).transpose(1, 2)
    if site == "pattern":  # [batch, head, pos, key]
        return ne.any(-1)
    return ne.any(-1).any(1)[..., None]  # [batch, block, kv_head, d_head]


def _copy_units(
    site: str, act: Tensor, src: Tensor, rows: Tensor, b: Tensor, u: Tensor, p: Tensor | None
) -> None:
    """In place: copy ``rows`` gets pair ``b``'s clean unit ``u`` (at position ``p``)."""
    if site == "z":  # [batch, pos, head, d_head]
        if p is None:
            act[rows, :, u] = src[b, :, u]
        else:
            act[rows, p, u] = src[b, p, u]
    elif site == "pattern":  # [batch, head, pos, key]
        if p is None:
            act[rows, u] = src[b, u]
        else:
            act[rows, u, p] = src[b, u, p]
    else:  # [batch, block, kv_head, d_head]
        act[rows, :, u] = src[b, :, u]


@torch.inference_mode()
def patch_sites(
    model: HookedTransformer,
    contrast: Contrast,
    *,
    site: str = "kv_block",
    metric: str = "logit_diff",
    by_pos: bool = False,
    layers: Iterable[int] | None = None,
    max_copies: int = 256,
    progress: bool = False,
) -> PatchResult:
    """Patch one unit of ``site`` at a time, as batched copies run from the patched layer's
    cached input with hooks: ``z`` (a head's output; the hook-based reference of
    :func:`patch_heads`), ``kv_block`` (a KV head's compressed entries, ``hook_k_block`` and
    ``hook_v_block``: all blocks at once) or ``pattern`` (a head's attention pattern; ``by_pos``
    patches one query position). Copies whose clean and corrupted slices are identical, or
    (position-resolved) sit after the answer, are not run: they cannot change the metric."""
    _check_model(model, contrast, metric)
    _check_choice("site", site, SITES)
    if isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 1:
        raise ValueError(f"max_copies={max_copies!r} is invalid: expected an int >= 1")
    if site == "kv_block" and by_pos:
        raise ValueError("by_pos=True is invalid for site='kv_block': entries have no position")
    if site != "z" and contrast.kind != "answer":
        # block i (and pattern column i) covers other tokens on a shifted grid or content:
        # the clean entry could hold tokens the corrupted query may not see yet (the answer)
        raise ValueError(
            f"site={site!r} needs the answer contrast (the same grid and positions in both "
            f"runs); under the {contrast.kind} contrast its entries cover different tokens and "
            "patching them would leak later tokens into earlier queries"
        )
    compressed = set(model.compressed_layers()) if isinstance(model, PhaseTransformer) else set()
    if site == "kv_block":
        layers = _check_layers(model, sorted(compressed) if layers is None else layers)
        bad = [x for x in layers if x not in compressed]
        if bad:
            raise ValueError(
                f"layers {bad} have no compressed entries: compressed layers are "
                f"{sorted(compressed)}"
            )
    else:
        layers = _check_layers(model, layers)
    model.eval()
    names = [n for lay in layers for n in _site_hooks(model, site, lay)]
    names += [f"blocks.{lay}.hook_resid_pre" for lay in layers]
    runs = _baseline(model, contrast, metric, names)
    batch, seq = contrast.corrupted_tokens.shape
    n_units = model.cfg.n_heads if site != "kv_block" else model.cfg.n_kv_heads
    n_pos = seq if by_pos else 1
    values = np.full((model.cfg.n_layers, n_pos, n_units, batch), np.nan)
    values[list(layers)] = runs.corrupted.double().numpy()
    upto = torch.arange(seq)[None, :] <= runs.qpos[:, None]  # [batch, pos]
    n_run = 0
    bar = tqdm(total=len(layers), desc=f"patching {site}", disable=not progress)
    for lay in layers:
        hooks = [n for n in _site_hooks(model, site, lay) if n in runs.corr]
        diff = None
        for name in hooks:
            d = _unit_diff(site, runs.src[name] != runs.corr[name])  # [batch, unit, (pos)]
            d = d & upto[:, None, :] if by_pos else d.flatten(2).any(-1)
            diff = d if diff is None else diff | d
        idx = diff.nonzero(as_tuple=True)
        b_idx, u_idx = idx[0], idx[1]
        p_idx = idx[2] if by_pos else None
        resid = runs.corr[f"blocks.{lay}.hook_resid_pre"]
        for start in range(0, len(b_idx), max_copies):
            b, u = b_idx[start : start + max_copies], u_idx[start : start + max_copies]
            p = None if p_idx is None else p_idx[start : start + max_copies]
            rows = torch.arange(len(b))

            def put(act: Tensor, hook, b=b, u=u, p=p, rows=rows) -> Tensor:
                act = act.clone()
                _copy_units(site, act, runs.src[hook.name], rows, b, u, p)
                return act

            with (
                _grid(model, contrast.corrupted_grid[b]),
                model.hooks(fwd_hooks=[(name, put) for name in hooks]),
            ):
                out = model(
                    resid[b],
                    start_at_layer=lay,
                    stop_at_layer=model.cfg.n_layers,
                    return_type=None,
                )
            logits = _logits(model, out[rows, runs.qpos[b]])
            got = metric_values(logits, contrast.answer[b], runs.foil[b], metric)
            pos_idx = np.zeros(len(b), dtype=int) if p is None else p.numpy()
            values[lay, pos_idx, u.numpy(), b.numpy()] = got.double().numpy()
            n_run += len(b)
        bar.update(1)
    bar.close()
    return _result(site, by_pos, metric, contrast, values, runs, layers, n_run)


# ------------------------------------------------------------------------ attribution patching


@dataclass(frozen=True)
class Attribution:
    """First-order estimates of every head x position ``hook_z`` patch.

    ``values`` ``[layer, pos, head, batch]``: estimated patched minus corrupted metric,
    ``(z_clean - z_corr) . d metric / d z`` at the corrupted run (zero after the answer);
    ``saturation`` ``[batch]``: the largest attention probability any last-layer head puts on one
    entry at the answer position in the corrupted run (AtP's known blind spot: a saturated
    softmax has almost no gradient, so first order misses patches that move it).
    """

    values: np.ndarray
    saturation: np.ndarray
    corrupted: np.ndarray
    pairs: pd.DataFrame
    metric: str


def attribution_patch(
    model: HookedTransformer,
    contrast: Contrast,
    *,
    metric: str = "logit_diff",
    batch_size: int = 128,
    progress: bool = False,
) -> Attribution:
    """Attribution patching (AtP): one forward and one backward per batch of pairs estimate the
    effect of patching every (layer, position, head) output."""
    _check_model(model, contrast, metric)
    model.eval()
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    batch, seq = contrast.corrupted_tokens.shape
    z_names = [f"blocks.{lay}.attn.hook_z" for lay in range(n_layers)]
    with torch.no_grad():  # not inference_mode: these tensors meet autograd below
        runs = _baseline(model, contrast, metric, z_names)
    values = np.zeros((n_layers, seq, n_heads, batch))
    saturation = np.zeros(batch)
    last_pattern = f"blocks.{n_layers - 1}.attn.hook_pattern"
    bar = tqdm(total=batch, desc="attribution patching", disable=not progress)
    for start in range(0, batch, batch_size):
        sl = slice(start, min(start + batch_size, batch))
        ar = torch.arange(sl.stop - sl.start)
        store: dict[str, Tensor] = {}

        def keep(act: Tensor, hook, store: dict[str, Tensor] = store) -> Tensor:
            store[hook.name] = act
            return act

        def leaf(act: Tensor, hook) -> Tensor:
            # a graph even when the weights are frozen
            return act.detach().requires_grad_(True)

        hooks = [("blocks.0.hook_resid_pre", leaf)] + [(n, keep) for n in z_names]
        hooks.append((last_pattern, keep))
        with (
            torch.enable_grad(),
            _grid(model, contrast.corrupted_grid[sl]),
            model.hooks(fwd_hooks=hooks),
        ):
            logits = model(contrast.corrupted_tokens[sl])
            qpos = runs.qpos[sl]
            m = metric_values(logits[ar, qpos], contrast.answer[sl], runs.foil[sl], metric)
            grads = torch.autograd.grad(m.sum(), [store[n] for n in z_names])
        upto = (torch.arange(seq)[None, :] <= qpos[:, None])[..., None]
        for lay, (name, g) in enumerate(zip(z_names, grads, strict=True)):
            dz = runs.src[name][sl] - runs.corr[name][sl]
            est = ((dz * g).sum(-1) * upto).detach()  # [b, pos, head]
            values[lay, :, :, sl] = est.permute(1, 2, 0).double().numpy()
        pat = store[last_pattern].detach()[ar, :, qpos]  # [b, head, key]
        saturation[sl] = pat.amax((-1, -2)).double().numpy()
        bar.update(sl.stop - sl.start)
    bar.close()
    pairs = contrast.pairs.copy()
    pairs["saturation"] = saturation
    return Attribution(values, saturation, runs.corrupted.double().numpy(), pairs, metric)


def compare_attribution(
    attribution: Attribution, exact: PatchResult, saturated: float = 0.95
) -> pd.DataFrame:
    """How well AtP tracks exact ``_by_pos`` patching: Pearson and Spearman correlations over
    (layer, pos, head) of pair-mean effects, and over single (pair, layer, pos, head) patches,
    overall and split by whether the pair's last-layer attention is saturated
    (``saturation >= saturated``). Entries exactly zero in both are left out."""
    from scipy.stats import pearsonr, spearmanr

    if exact.site != "z" or not exact.by_pos:
        raise ValueError("exact must come from patch_heads(..., by_pos=True)")
    if exact.values.shape[-1] != attribution.values.shape[-1]:
        raise ValueError("attribution and exact patching were run on different pairs")
    layers = list(exact.layers)
    true = exact.values[layers] - exact.corrupted  # [L', pos, head, batch]
    est = attribution.values[layers]
    rows = []

    def corr(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        keep = (x != 0) | (y != 0)
        x, y = x[keep], y[keep]
        if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
            return np.nan, np.nan
        return float(pearsonr(x, y)[0]), float(spearmanr(x, y)[0])

    sat = attribution.saturation >= saturated
    for label, sel in (("all", np.ones_like(sat)), ("saturated", sat), ("unsaturated", ~sat)):
        if not sel.any():
            continue
        for li, lay in [(None, "all")] + list(enumerate(layers)):
            t = true[..., sel] if li is None else true[li][None][..., sel]
            e = est[..., sel] if li is None else est[li][None][..., sel]
            pm_r, pm_rho = corr(t.mean(-1).ravel(), e.mean(-1).ravel())
            pp_r, pp_rho = corr(t.ravel(), e.ravel())
            rows.append(
                {
                    "pairs": label,
                    "layer": str(lay),
                    "n_pairs": int(sel.sum()),
                    "pearson_mean": pm_r,
                    "spearman_mean": pm_rho,
                    "pearson_single": pp_r,
                    "spearman_single": pp_rho,
                    "mean_abs_error": float(np.abs(t - e).mean()),
                }
            )
    return pd.DataFrame(rows)


def attribution_by_position(
    attribution: Attribution, exact: PatchResult, contrast: Contrast
) -> pd.DataFrame:
    """Where AtP's error sits: per (layer, position class) the number of patches, mean exact
    and estimated effects, mean absolute error, the share of all absolute error and Pearson r.
    Position classes relative to each pair: ``source`` (the needle token), ``query`` (the
    answer position), ``before`` the needle, ``between`` the two. Patches exactly zero in both
    are left out (nothing to estimate)."""
    if exact.values.shape != attribution.values.shape:
        raise ValueError("attribution and exact patching have different shapes: same pairs?")
    true = exact.values - exact.corrupted
    est = attribution.values
    n_layers, n_pos = true.shape[:2]
    src = contrast.pairs["source_pos"].to_numpy() + (
        contrast.shift if contrast.kind == "content" else 0
    )
    pos = np.arange(n_pos)[None, :, None, None]
    where = np.where(
        pos == src,
        "source",
        np.where(
            pos == contrast.corrupted_query_pos.numpy(),
            "query",
            np.where(pos < src, "before", "between"),
        ),
    )
    where = np.broadcast_to(where, true.shape)
    layer = np.broadcast_to(np.arange(n_layers)[:, None, None, None], true.shape)
    keep = ((true != 0) | (est != 0)) & np.isin(layer, exact.layers)
    df = pd.DataFrame(
        {"layer": layer[keep], "where": where[keep], "exact": true[keep], "atp": est[keep]}
    )
    df["abs_error"] = (df.exact - df.atp).abs()
    total = df.abs_error.sum()
    grouped = df.groupby(["layer", "where"])
    out = grouped.agg(
        n=("exact", "size"),
        mean_exact=("exact", "mean"),
        mean_atp=("atp", "mean"),
        mean_abs_error=("abs_error", "mean"),
    )
    out["share_of_error"] = grouped.abs_error.sum() / total if total > 0 else np.nan
    out["pearson"] = grouped.apply(
        lambda g: g.exact.corr(g.atp) if len(g) > 2 else np.nan, include_groups=False
    )
    return out.reset_index()


__all__ = [
    "CONTRASTS",
    "METRICS",
    "SITES",
    "Attribution",
    "Contrast",
    "PatchResult",
    "attribution_by_position",
    "attribution_patch",
    "compare_attribution",
    "make_contrast",
    "metric_values",
    "patch_heads",
    "patch_sites",
]
