"""Why a phase is weak: a selecting design's choice at the answer row, split into the tokens
that make it.

Axes: ``head``, ``kv_head``, ``block``, ``slot`` (a token's offset in its block: block ``j`` of
offset ``o`` holds tokens ``(j-1) d + o + slot``), ``d_head``, ``u`` (an observation query of
``evict``), ``layer``, ``role`` (``needle``: the block holding the needle's first answer token;
``competitor``: the last kept pick, the ``k``-th, or where that is the needle's own block the
best block left out; ``sink``: the block holding token 0).

At the row predicting the first answer token each selecting design scores every block with
its own rule (:meth:`~phasemech.attention.selection.SelectingAttention.block_scores`), and the
needle's block is kept when its score beats the last kept pick's
(:func:`~phasemech.interventions.oracle.needle_selection`'s ``margin``). Every rule is a sum
over the block's tokens, so the score splits into one term per slot:

* ``route``: ``q . mean_j k_j = sum_j w_j q . k_j`` (``w_j = 1/l`` over the real tokens);
* ``quest``: ``sum_i max_j q_i k_j,i``: each channel's term goes to the token that supplies
  that channel's max (``q_i > 0``) or min (``q_i < 0``; the first such token on a tie);
* ``kpool``: ``max_j q . k_j``: the whole score is the best token's;
* ``evict``: the attention that the observation window's queries (every head of the KV
  group) pay each token under dense causal attention.

The split is computed in float64 from the very inputs the layer's forward handed its rule, and
its sum equals the design's own ``block_scores`` on those inputs (checked on every call). A
prompt's contents differ across phases only by the prefix shift, so the query and the needle's
key hardly change with phase: what changes is which tokens share the needle's block (its
slot) and which blocks compete with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.attention.rows import masked_softmax, query_rows
from phasemech.interventions.oracle import block_of, needle_selection, selecting_layers
from phasemech.interventions.prompts import PromptRun, bound

#: the designs whose block score splits over tokens here
DESIGNS = ("route", "quest", "kpool", "evict")
ROLES = ("needle", "competitor", "sink")
#: largest |sum of terms - the design's own score| accepted (float64)
TOLERANCE = 1e-9


def check_decomposable(model) -> list[int]:
    """The selecting layers, after refusing a design whose score does not split here."""
    layers = selecting_layers(model)
    bad = {model.blocks[i].attn.design for i in layers} - set(DESIGNS)
    if bad:
        raise ValueError(
            f"design {sorted(bad)[0]!r} is invalid for the decomposition: allowed {DESIGNS}"
        )
    return layers


@contextlib.contextmanager
def captured_inputs(model, layers: list[int], store: dict[int, dict]) -> Iterator[None]:
    """Inside, each layer's ``block_scores`` runs as before and keeps its inputs in
    ``store[layer]`` (the rule itself is the design's: only a wrapper on the instance)."""
    for i in layers:
        attn = model.blocks[i].attn
        rule = attn.block_scores

        def keep(summary, q, rows, k, geo, rule=rule, i=i):
            store[i] = dict(q=q, rows=rows, k=k, geo=geo)
            return rule(summary, q, rows, k, geo)

        attn.block_scores = keep
    try:
        yield
    finally:
        for i in layers:
            del model.blocks[i].attn.block_scores  # the class's method again


def slot_keys(
    k: Float[Tensor, "1 pos kv_head d_head"], geo
) -> tuple[Float[Tensor, "kv_head block slot d_head"], Bool[Tensor, "kv_head block slot"]]:
    """Each block's keys by slot (zero on missing slots) and which slots are real."""
    pos, valid = geo.slot_pos[0], geo.slot_valid[0]  # [kv_head, block, slot]
    kg = k[0].transpose(0, 1)  # [kv_head, pos, d]
    g = torch.arange(kg.shape[0], device=k.device)[:, None, None]
    keys = kg[g, pos.clamp(0, kg.shape[1] - 1)] * valid[..., None]
    return keys, valid


def _per_head(x: Tensor, n_heads: int) -> Tensor:
    return x.repeat_interleave(n_heads // x.shape[0], 0)


def slot_terms(
    attn, q: Float[Tensor, "1 pos head d_head"], row: int, k: Tensor, geo
) -> Float[Tensor, "head block slot"]:
    """Each slot's term of the design's score for query ``row`` (float64 inputs): their sum
    over slots is the block's score."""
    design = attn.design
    keys, valid = slot_keys(k, geo)
    h = q.shape[2]
    kh, vh = _per_head(keys, h), _per_head(valid, h)  # [head, block, slot, d], [head, block, slot]
    qr = q[0, row]  # [head, d]
    if design == "route":
        w = _per_head(attn.pooling_weights(None, geo)[0].to(q.dtype), h)
        return w * torch.einsum("hd,hnsd->hns", qr, kh)
    if design == "quest":  # the box's bound: each channel's max over the tokens
        prod = (qr[:, None, None, :] * kh).masked_fill(~vh[..., None], float("-inf"))
        best, who = prod.max(2)  # [head, block, d]: the first token on a tie
        best = best.masked_fill(~vh.any(-1)[..., None], 0.0)
        out = torch.zeros_like(prod[..., 0])
        return out.scatter_add_(2, who, best)
    if design == "kpool":
        qk = torch.einsum("hd,hnsd->hns", qr, kh).masked_fill(~vh, float("-inf"))
        best, who = qk.max(-1)
        has = vh.any(-1)
        out = torch.zeros_like(qk)
        return out.scatter_(-1, who[..., None], best.where(has, 0.0)[..., None])
    return _observed_terms(attn, q, row, k, geo) * vh


def _observed_terms(attn, q, row: int, k, geo) -> Float[Tensor, "head block slot"]:
    """``evict``: per slot, the dense causal attention that the observation queries ``u in
    [row - obs_window + 1, row]`` of the KV group's heads pay its token (the group's total on
    each of its heads)."""
    u = row - attn.obs_window + 1 + torch.arange(attn.obs_window, device=q.device)
    seq = k.shape[1]
    keys = torch.arange(seq, device=q.device)
    visible = keys[None, :] <= u[:, None]  # [u, key_pos]
    if geo.key_valid is not None:
        visible = visible & geo.key_valid[0][None]
    h, g = q.shape[2], k.shape[2]
    qu = query_rows(q, u[None])[0]  # [head, u, d]
    scores = torch.einsum("hud,hpd->hup", qu, _per_head(k[0].transpose(0, 1), h))
    scores = apply_softcap(scores / attn.attn_scale, attn.cfg.attn_scores_soft_cap)
    p = masked_softmax(scores, visible[None].expand_as(scores))
    real = u >= 0
    if geo.key_valid is not None:
        real = real & geo.key_valid[0].gather(0, u.clamp(min=0))
    p = (p * real[None, :, None]).sum(1)  # [head, key_pos]
    p = p.reshape(g, h // g, seq).sum(1)  # [kv_head, key_pos]: the group's total
    pos, valid = geo.slot_pos[0], geo.slot_valid[0]
    per = p.gather(1, pos.clamp(0, seq - 1).flatten(1)).reshape(pos.shape) * valid
    return _per_head(per, h)


def own_scores(attn, q: Tensor, row: int, k: Tensor, geo) -> Float[Tensor, "head block"]:
    """The design's own ``block_scores`` for query ``row`` on these (float64) inputs."""
    rows = torch.tensor([[row]], device=q.device)
    summary = attn.block_summary(None, k, k, geo)
    return attn.block_scores(summary, q, rows, k, geo)[0, :, 0]


def _gates(model, run: PromptRun, layers: list[int], store: dict) -> dict[int, dict]:
    """One forward of ``model`` on ``run``: per layer, the gate ``[head, block]`` and kept set
    at the answer row (the engine's hooks, as the oracle reads them), the grid offsets, and
    the inputs of the design's rule."""
    seen: dict[tuple[int, str], Tensor] = {}

    def grab(x: Tensor, hook) -> None:
        layer, name = int(hook.name.split(".")[1]), hook.name.rsplit(".", 1)[-1]
        seen[layer, name] = x[0, :, run.row] if x.ndim == 4 else x

    names = ("hook_grid_offset", "hook_route_scores", "hook_route_selected")
    hooks = [(f"blocks.{i}.attn.{n}", grab) for i in layers for n in names]
    with torch.inference_mode(), bound(model, run), captured_inputs(model, layers, store):
        with model.hooks(fwd_hooks=hooks):
            model(run.tokens, stop_at_layer=model.cfg.n_layers)
    return {i: {n: seen[i, n] for n in names} | store[i] for i in layers}


def _roles(
    gate: Float[Tensor, "head block"], kept: Bool[Tensor, "head block"], needle: Tensor
) -> Int[Tensor, "head"]:
    """The competitor per head: the last kept pick (the lowest-gated ranked kept block), or,
    where that is the needle's block, the best ranked block left out (-1: none)."""
    ranked = gate.isfinite()
    picks = ranked & kept
    last = gate.masked_fill(~picks, float("inf")).argmin(-1)
    out_best = gate.masked_fill(~ranked | kept, float("-inf"))
    runner = out_best.argmax(-1)
    runner = torch.where(out_best.amax(-1).isfinite(), runner, -1)
    comp = torch.where(last == needle, runner, last)
    return torch.where(picks.any(-1), comp, -1)


@torch.inference_mode()
def decompose(model, run: PromptRun) -> pd.DataFrame:
    """Per (layer, head, role, slot) at the answer row: ``block``, ``pos`` (the slot's token),
    ``valid``, ``term`` (its share of the block's score), ``qk`` (``q . k``), ``key_norm``,
    ``score`` (the block's score, float64: the sum of its terms), ``gate`` (the engine's own
    float score); per (layer, head): ``selected``, ``rank``, ``margin`` (the oracle's:
    needle gate minus the last kept pick's), ``needle_slot``, ``competitor_is_sink``,
    ``sink_kept``, ``sink_over_needle`` (sink score minus needle score)."""
    layers = check_decomposable(model)
    if not 0 <= run.needle < run.offset + run.row:
        raise ValueError(
            f"needle={run.needle} is invalid: it must precede the answer row {run.offset + run.row}"
        )
    got = _gates(model, run, layers, {})
    sel = needle_selection(model, run).set_index(["layer", "head"])
    frames = []
    for i in layers:
        frames.append(_layer_frame(model.blocks[i].attn, run, got[i], sel.loc[i], i))
    return pd.concat(frames, ignore_index=True)


def _layer_frame(attn, run: PromptRun, got: dict, sel: pd.DataFrame, layer: int) -> pd.DataFrame:
    q, k, geo = got["q"].double(), got["k"].double(), got["geo"]
    hits = (got["rows"][0] == run.offset + run.row).nonzero()
    row = int(got["rows"][0, hits[0, 0]])
    terms = slot_terms(attn, q, row, k, geo)  # [head, block, slot]
    score = terms.sum(-1)
    own = own_scores(attn, q, row, k, geo)
    real = _per_head(geo.slot_valid[0].any(-1), q.shape[2])  # a block with no token: no score
    gap = float((score - own).abs()[real].max())
    if gap > TOLERANCE:  # never a silent mismatch: the split must be the design's score
        raise RuntimeError(f"layer {layer} ({attn.design}): terms miss the score by {gap:.3g}")
    h, (stride, sl) = q.shape[2], (attn.stride, geo.slot_pos.shape[-1])
    offsets = got["hook_grid_offset"][:1]
    needle = block_of(run.needle, offsets, stride, h)[0]  # [head]
    sink = block_of(0, offsets, stride, h)[0]
    gate, kept = got["hook_route_scores"], got["hook_route_selected"]
    comp = _roles(gate, kept, needle)
    keys, valid = slot_keys(k, geo)
    norms, rep = keys.norm(dim=-1), h // keys.shape[0]  # [kv_head, block, slot]
    qk = torch.einsum("hd,hnsd->hns", q[0, row], _per_head(keys, h))
    ranked_kept = gate.isfinite() & kept
    rows = []
    for hd in range(h):
        j, s, c = int(needle[hd]), int(sink[hd]), int(comp[hd])
        head = dict(
            layer=layer, head=hd, selected=bool(sel.loc[hd, "selected"]),
            rank=float(sel.loc[hd, "rank"]), margin=float(sel.loc[hd, "margin"]),
            needle_block=j, sink_block=s, competitor_block=c,
            needle_slot=run.needle - (j - 1) * stride - int(offsets[0, hd // rep]),
            competitor_is_sink=c == s, sink_kept=bool(ranked_kept[hd, s]),
            sink_over_needle=float(score[hd, s] - score[hd, j]),
        )  # fmt: skip
        for role, b in (("needle", j), ("competitor", c), ("sink", s)):
            if b < 0:
                continue
            for t in range(sl):
                pos = int(geo.slot_pos[0, hd // rep, b, t])
                rows.append(head | dict(
                    role=role, block=b, slot=t, pos=pos, valid=bool(valid[hd // rep, b, t]),
                    term=float(terms[hd, b, t]), qk=float(qk[hd, b, t]),
                    key_norm=float(norms[hd // rep, b, t]), score=float(score[hd, b]),
                    gate=float(gate[hd, b]), is_needle=pos == run.needle,
                ))  # fmt: skip
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------ summaries
UNIT = ["prompt_id", "layer", "head"]


def mechanism_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per phase, over the (prompt, layer, head) whose needle block is ranked: ``recall``,
    ``margin``, ``needle_score``, ``needle_term`` (the needle token's), ``rest_term`` (the rest
    of its block), ``competitor_score``, ``sink_wins`` (of the misses, the share whose
    competitor is the sink's block), ``sink_kept``, ``sink_over_needle`` and ``needle_slot``
    (its most common slot); ``n`` units. ``df``: :func:`decompose`'s rows with the prompt's
    ``prompt_id`` and ``phase``."""
    df = df[df["rank"].notna()]
    unit = df.drop_duplicates(UNIT).set_index(UNIT)
    needle = df[df.role == "needle"]
    mine = needle[needle.is_needle].set_index(UNIT).term
    rest = needle[~needle.is_needle].groupby(UNIT).term.sum()
    comp = df[df.role == "competitor"].drop_duplicates(UNIT).set_index(UNIT).score
    frame = unit.assign(needle_term=mine, rest_term=rest, needle_score=mine + rest,
                        competitor_score=comp, missed=~unit.selected)  # fmt: skip
    by = frame.groupby("phase")
    missed = frame[frame.missed].groupby("phase")
    return pd.DataFrame(dict(
        recall=by.selected.mean(), margin=by.margin.mean(), needle_score=by.needle_score.mean(),
        needle_term=by.needle_term.mean(), rest_term=by.rest_term.mean(),
        competitor_score=by.competitor_score.mean(),
        sink_wins=missed.competitor_is_sink.mean(), sink_kept=by.sink_kept.mean(),
        sink_over_needle=by.sink_over_needle.mean(),
        needle_slot=by.needle_slot.agg(lambda s: s.mode().iloc[0]), n=by.size(),
    ))  # fmt: skip


def needle_reading_heads(attention: pd.DataFrame, layers, top: int = 10) -> list[tuple[int, int]]:
    """The ``top`` (layer, head) of ``layers`` whose answer row attends most to the needle
    under the dense null (``attention``: per (setting or not, layer, head, ...) ``mass``, as
    explain's ``attend`` step or ``head_attention`` table holds it; mean over the rest)."""
    if "setting" in attention:
        attention = attention[attention.setting == "null"]
    mass = attention[attention.layer.isin(list(layers))].groupby(["layer", "head"]).mass.mean()
    return [(int(a), int(b)) for a, b in mass.nlargest(top).index]


def slot_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (phase, role, slot): mean ``term``, ``qk`` and ``key_norm`` over the real slots of
    the (prompt, layer, head) whose needle block is ranked."""
    df = df[df["rank"].notna() & df.valid]
    return df.groupby(["phase", "role", "slot"], as_index=False).agg(
        term=("term", "mean"), qk=("qk", "mean"), key_norm=("key_norm", "mean"),
        n=("term", "size"),
    )  # fmt: skip


__all__ = [
    "DESIGNS",
    "ROLES",
    "captured_inputs",
    "check_decomposable",
    "decompose",
    "mechanism_table",
    "needle_reading_heads",
    "own_scores",
    "slot_keys",
    "slot_table",
    "slot_terms",
]
