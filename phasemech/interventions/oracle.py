"""Selection on one prompt: does a query keep the needle's block, and does forcing it restore
the answer? The read-out and the selection of a selecting design, told apart.

Axes: ``copy`` (copies of one prompt, one intervention each), ``head``, ``kv_head``, ``row``
(rows a run computes), ``block``, ``layer``, ``answer`` (answer tokens).

Every selecting design (``route``, ``quest``, ``kpool``, ``evict``) ranks blocks through
``hook_route_scores`` (its gate, ``-inf`` off the ranked candidates and on the block the query
closes, which is forced) and keeps them through ``hook_route_selected`` (a hook may change the
kept set; :mod:`phasemech.attention.selection`). The needle's block in a layer follows from the
layer's grid offset ``o`` (``hook_grid_offset``): block ``i`` covers tokens ``[(i-1) d + o,
i d + o - 1]``, so token ``t`` sits in block ``floor((t - o) / d) + 1``.

* :func:`needle_selection`: at the row predicting the first answer token, per (layer, head):
  whether the needle's block is kept, its rank among the candidates (1 = the gate's best) and
  its margin to the last kept pick (needle gate minus the ``k``-th best gate: > 0 inside the
  top-k, up to exact ties).
* :func:`force_needle`: copies of the prompt, each under one :class:`Force`: the needle's block
  (for the row predicting answer token ``m``, the block of the needle's token ``m``; for other
  rows, of its first token) added to the kept set (``add``: budget + 1 block), or put in place
  of the query's lowest-ranked pick (``replace``: same budget), at the answer rows or at every
  row after the needle, in a chosen set of (layer, head) units; ``every`` keeps every
  candidate (dense attention, a check). Each copy reports the answer's correctness and what
  the forced picks displaced (how many were the sink's block, the block holding token 0).
* :func:`copy_selection`: the patching site "a layer's selection": the clean prompt's kept
  sets (the same content at another phase) copied into the corrupted prompt, one layer per
  copy (and one copy with every layer). The grids do not line up across phases (a clean block
  straddles two corrupted blocks), so a copied pick keeps every corrupted block that holds one
  of its tokens: the corrupted query reads at least every token the clean query read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from phasemech.attention.selection import SelectingAttention
from phasemech.interventions.prompts import PromptRun, bound

FORMS = ("add", "replace", "every")
ROWS = ("answer", "after")


def selecting_layers(model) -> list[int]:
    """The layers whose attention selects blocks (a ``ValueError`` if there are none)."""
    layers = [i for i, b in enumerate(model.blocks) if isinstance(b.attn, SelectingAttention)]
    if not layers:
        design = getattr(getattr(model.cfg, "compression", None), "design", "none")
        raise ValueError(
            f"design {design!r} selects no blocks: the selection analyses need route, quest, "
            "kpool or evict"
        )
    for i in layers:
        attn = model.blocks[i].attn
        if attn.block_len != attn.stride:
            raise ValueError(
                f"block_len={attn.block_len} is invalid for the selection analyses: a token "
                f"must sit in one block; allowed block_len == stride ({attn.stride})"
            )
    return layers


def block_of(
    t: int | Int[Tensor, "row"], offsets: Int[Tensor, "copy kv_head"], stride: int, n_heads: int
) -> Int[Tensor, "copy head"] | Int[Tensor, "copy head row"]:
    """The block holding token ``t`` (one, or one per row) per query head (offsets are per KV
    head)."""
    rep = n_heads // offsets.shape[1]
    o = offsets.repeat_interleave(rep, 1)
    if isinstance(t, Tensor):
        o = o[..., None]
    return torch.div(t - o, stride, rounding_mode="floor") + 1


def _targets(run: PromptRun, n_rows: int) -> Int[Tensor, "row"]:
    """The needle token each row must read: answer row ``m`` predicts answer token ``m``, whose
    copy in the needle is ``needle + m``; every other row, the needle's first token."""
    t = torch.full((n_rows,), run.needle, dtype=torch.long, device=run.tokens.device)
    rows = run.answer_rows
    t[rows] += torch.arange(rows.stop - rows.start, device=t.device)
    return t


@torch.inference_mode()
def needle_selection(model, run: PromptRun) -> pd.DataFrame:
    """Per (layer, head) of the selecting layers, at the row predicting the first answer token:
    ``selected``, ``rank`` (among ``candidates``; NaN when the needle's block is no candidate:
    in the raw window, or the block the query closes), ``margin`` (needle gate minus the
    lowest kept pick's) and ``kept`` (blocks kept, the forced one included)."""
    store: dict[tuple[int, str], Tensor] = {}

    def grab(x: Tensor, hook) -> None:
        layer, name = int(hook.name.split(".")[1]), hook.name.rsplit(".", 1)[-1]
        store[layer, name] = x[0, :, run.row] if x.ndim == 4 else x

    layers = selecting_layers(model)
    hooks = [
        (f"blocks.{i}.attn.{n}", grab)
        for i in layers
        for n in ("hook_grid_offset", "hook_route_scores", "hook_route_selected")
    ]
    with bound(model, run), model.hooks(fwd_hooks=hooks):
        model(run.tokens, stop_at_layer=model.cfg.n_layers)
    rows = []
    for i in layers:
        attn = model.blocks[i].attn
        gate, kept = store[i, "hook_route_scores"], store[i, "hook_route_selected"]  # [head, block]
        j = block_of(run.needle, store[i, "hook_grid_offset"][:1], attn.stride, gate.shape[0])[0]
        mine = gate.gather(-1, j[:, None])[:, 0]
        finite = gate.isfinite()
        ranked = finite & kept  # kept picks that were ranked (not the forced own block)
        last = gate.masked_fill(~ranked, float("inf")).amin(-1)
        rank = (gate > mine[:, None]).sum(-1) + 1
        for h in range(gate.shape[0]):
            cand = bool(mine[h].isfinite())
            rows.append(
                dict(
                    layer=i,
                    head=h,
                    selected=bool(kept[h, j[h]]),
                    rank=float(rank[h]) if cand else float("nan"),
                    margin=float(mine[h] - last[h]) if cand and ranked[h].any() else float("nan"),
                    candidates=int(finite[h].sum()),
                    kept=int(kept[h].sum()),
                )
            )
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Force:
    """One oracle intervention: ``form`` (``add``, ``replace`` or ``every``), ``rows``
    (``answer``: the rows predicting answer tokens; ``after``: every row after the needle), and
    the ``units`` (layer, head) it acts on (empty: the unforced baseline)."""

    form: str
    rows: str
    units: tuple[tuple[int, int], ...]
    scope: str = ""  # a label: "all", "layer 7", "top heads"

    def __post_init__(self) -> None:
        if self.form not in FORMS or self.rows not in ROWS:
            raise ValueError(
                f"Force(form={self.form!r}, rows={self.rows!r}) is invalid: allowed forms "
                f"{FORMS}, rows {ROWS}"
            )


def _row_mask(
    forces: Sequence[Force], run: PromptRun, n_rows: int, device
) -> Bool[Tensor, "copy row"]:
    pos = torch.arange(n_rows, device=device) + run.offset
    answer = torch.zeros(n_rows, dtype=torch.bool, device=device)
    answer[run.answer_rows] = True
    after = pos > run.needle
    return torch.stack([answer if f.rows == "answer" else after for f in forces])


def _forcing_hooks(model, run: PromptRun, forces: Sequence[Force], log: dict) -> list:
    """Per selecting layer: keep the offsets and the gate, then change the kept set."""
    n, h = len(forces), model.cfg.n_heads
    dev = run.tokens.device
    seen: dict[int, dict[str, Tensor]] = {}
    units = torch.zeros(n, model.cfg.n_layers, h, dtype=torch.bool)  # [copy, layer, head]
    for c, f in enumerate(forces):
        if f.units:
            units[(c, *zip(*f.units, strict=True))] = True
    units = units.to(dev)
    every = torch.tensor([f.form == "every" for f in forces], device=dev)[:, None, None]
    replace = torch.tensor([f.form == "replace" for f in forces], device=dev)[:, None, None]

    def keep(x: Tensor, hook) -> None:
        seen.setdefault(int(hook.name.split(".")[1]), {})[hook.name.rsplit(".", 1)[-1]] = x

    def force(mask: Tensor, hook) -> Tensor:
        layer = int(hook.name.split(".")[1])
        gate, offsets = seen[layer]["hook_route_scores"], seen[layer]["hook_grid_offset"]
        where = units[:, layer, :, None] & _row_mask(forces, run, mask.shape[2], dev)[:, None]
        cand = gate.isfinite()
        out = mask | (where[..., None] & cand & every[..., None])
        j = block_of(_targets(run, mask.shape[2]), offsets, model.blocks[layer].attn.stride, h)
        jj = j[..., None]  # [copy, head, row, 1]
        had = mask.gather(-1, jj)[..., 0]
        add = where & ~every & ~had & (cand.gather(-1, jj)[..., 0])
        low = gate.masked_fill(~(mask & cand), float("inf")).min(-1)
        drop = add & replace & low.values.isfinite()
        out = out.scatter(-1, jj, out.gather(-1, jj) | add[..., None])
        out = out.scatter(
            -1, low.indices[..., None], out.gather(-1, low.indices[..., None]) & ~drop[..., None]
        )
        sink = block_of(0, offsets, model.blocks[layer].attn.stride, h)[:, :, None]
        log["forced"] += add.sum((1, 2))
        log["displaced"] += drop.sum((1, 2))
        log["displaced_sink"] += (drop & (low.indices == sink)).sum((1, 2))
        return out

    hooks = []
    for i in selecting_layers(model):
        p = f"blocks.{i}.attn."
        hooks += [(p + "hook_grid_offset", keep), (p + "hook_route_scores", keep)]
        hooks.append((p + "hook_route_selected", force))
    return hooks


@torch.inference_mode()
def force_needle(model, run: PromptRun, forces: Sequence[Force], chunk: int = 64) -> pd.DataFrame:
    """Each :class:`Force` on a copy of ``run``: ``correct`` (every answer token greedy),
    ``first_correct``, ``margin`` (first answer token's logit minus the best other), ``forced``
    (kept sets changed: head x row x layer), ``displaced`` and ``displaced_sink`` (picks
    removed by ``replace``, and how many of those were the sink's block)."""
    out = []
    for s in range(0, len(forces), chunk):
        part = list(forces[s : s + chunk])
        n = len(part)
        zeros = torch.zeros(n, dtype=torch.long, device=run.tokens.device)
        log = {"forced": zeros.clone(), "displaced": zeros.clone(), "displaced_sink": zeros}
        hooks = _forcing_hooks(model, run, part, log)
        with bound(model, run), model.hooks(fwd_hooks=hooks):
            resid = model(run.tokens.expand(n, -1), stop_at_layer=model.cfg.n_layers)
        logits = model.unembed(model.ln_final(resid[:, run.answer_rows])).float()
        out.append(_verdicts(logits, run.answer, part, log))
    return pd.concat(out, ignore_index=True)


def _verdicts(
    logits: Float[Tensor, "copy answer vocab"], answer: Tensor, forces, log: dict
) -> pd.DataFrame:
    hit = logits.argmax(-1) == answer[None]
    first = logits[:, 0]
    right = first[:, answer[0]]
    other = first.scatter(-1, answer[:1].expand(len(first), 1), float("-inf")).amax(-1)
    return pd.DataFrame(
        dict(
            form=[f.form for f in forces],
            rows=[f.rows for f in forces],
            scope=[f.scope for f in forces],
            n_units=[len(f.units) for f in forces],
            correct=hit.all(-1).cpu().numpy(),
            first_correct=hit[:, 0].cpu().numpy(),
            margin=(right - other).cpu().numpy(),
            **{k: v.cpu().numpy() for k, v in log.items()},
        )
    )


def position_map(clean: PromptRun, corrupt: PromptRun) -> Callable[[Tensor], Tensor]:
    """Clean positions to corrupted ones (-1: none). A prompt is ``PREFIX[:k] + body``: the
    shift prefix's tokens keep their place, everything after it moves by the prefix difference;
    token 0 stays token 0 (the attention sink is a place, whatever token holds it)."""
    kc, kx = int(clean.meta["prefix"]), int(corrupt.meta["prefix"])

    def move(t: Tensor) -> Tensor:
        out = torch.where((t >= kc) & (t > 0), t + (kx - kc), t)
        return torch.where((t < 0) | ((t < kc) & (t >= kx) & (t > 0)), -1, out)

    return move


@torch.inference_mode()
def _kept(model, run: PromptRun) -> dict[int, tuple[Tensor, Tensor]]:
    """Per selecting layer: the kept set ``[head, row, block]`` and the offsets ``[kv_head]``."""
    store: dict[tuple[int, str], Tensor] = {}

    def grab(x: Tensor, hook) -> None:
        store[int(hook.name.split(".")[1]), hook.name.rsplit(".", 1)[-1]] = x[0]

    layers = selecting_layers(model)
    hooks = [(f"blocks.{i}.attn.{n}", grab) for i in layers
             for n in ("hook_grid_offset", "hook_route_selected")]  # fmt: skip
    with bound(model, run), model.hooks(fwd_hooks=hooks):
        model(run.tokens, stop_at_layer=model.cfg.n_layers)
    return {i: (store[i, "hook_route_selected"], store[i, "hook_grid_offset"]) for i in layers}


def map_kept_set(
    kept: Bool[Tensor, "head row block"],
    o_clean: Int[Tensor, "kv_head"],
    o_corrupt: Int[Tensor, "kv_head"],
    move: Callable[[Tensor], Tensor],
    stride: int,
    shape: tuple[int, int],
) -> tuple[Bool[Tensor, "head row block"], Bool[Tensor, "row"]]:
    """The clean kept set in the corrupted geometry (``shape``: its rows and blocks): every
    corrupted block holding a token of a kept clean block; rows aligned from the end, and which
    corrupted rows have a clean counterpart."""
    h, rc, nb = kept.shape
    rows, nbx = shape
    rep = h // o_clean.shape[0]
    oc, ox = (o.repeat_interleave(rep)[:, None] for o in (o_clean, o_corrupt))  # [head, 1]
    j = torch.arange(nb, device=kept.device)[None]
    hits = torch.zeros(h, rc, nbx, dtype=torch.int32, device=kept.device)
    for u in range(stride):  # block j holds tokens (j - 1) d + o + u
        tok = (j - 1) * stride + oc + u
        mt = move(tok)
        b = torch.div(mt - ox, stride, rounding_mode="floor") + 1
        ok = (tok >= 0) & (mt >= 0) & (b >= 0) & (b < nbx)
        src = (kept & ok[:, None]).to(torch.int32)
        hits.scatter_add_(-1, b.clamp(0, nbx - 1)[:, None].expand(h, rc, nb), src)
    n = min(rc, rows)
    out = torch.zeros(h, rows, nbx, dtype=torch.bool, device=kept.device)
    out[:, rows - n :] = hits[:, rc - n :] > 0
    has = torch.zeros(rows, dtype=torch.bool, device=kept.device)
    has[rows - n :] = True
    return out, has


@torch.inference_mode()
def copy_selection(
    model, clean: PromptRun, corrupt: PromptRun
) -> tuple[list[str], Float[Tensor, "copy vocab"], Float[Tensor, "copy"]]:
    """The corrupted prompt with the clean prompt's selection, in each selecting layer alone
    and then in all of them: ``(labels, logits at the first answer row, kept)`` per copy
    (labels ``"layer 7"``, ..., ``"all"``; ``kept``: blocks kept per query and head in the
    patched layers, the corrupted run's own count being the unpatched copies' baseline)."""
    layers = selecting_layers(model)
    clean_kept, n = _kept(model, clean), len(layers) + 1
    move = position_map(clean, corrupt)
    offsets: dict[int, Tensor] = {}  # the corrupted run's, per layer
    gates: dict[int, Tensor] = {}
    kept_sum = torch.zeros(n, dtype=torch.float64)

    def keep(store: dict[int, Tensor]):
        def hook(x: Tensor, hook) -> None:
            store[int(hook.name.split(".")[1])] = x

        return hook

    def patch(mask: Tensor, hook) -> Tensor:
        layer = int(hook.name.split(".")[1])
        k, oc = clean_kept[layer]
        stride = model.blocks[layer].attn.stride
        new, has = map_kept_set(k, oc, offsets[layer][0], move, stride, tuple(mask.shape[2:]))
        cand = torch.isfinite(gates[layer])  # [copy, head, row, block]
        on = torch.zeros(n, dtype=torch.bool, device=mask.device)
        on[[layers.index(layer), n - 1]] = True
        out = (mask & ~cand) | (new[None] & cand)
        out = torch.where(on[:, None, None, None] & has[None, None, :, None], out, mask)
        kept_sum[on.cpu()] += out[on].sum(-1).double().mean((-1, -2)).cpu()
        return out

    hooks = []
    for i in layers:
        p = f"blocks.{i}.attn."
        hooks += [(p + "hook_grid_offset", keep(offsets)), (p + "hook_route_scores", keep(gates)),
                  (p + "hook_route_selected", patch)]  # fmt: skip
    with bound(model, corrupt), model.hooks(fwd_hooks=hooks):
        resid = model(corrupt.tokens.expand(n, -1), stop_at_layer=model.cfg.n_layers)
    logits = model.unembed(model.ln_final(resid[:, corrupt.row])).float()
    kept_sum[-1] /= len(layers)
    return [f"layer {i}" for i in layers] + ["all"], logits, kept_sum


__all__ = [
    "FORMS",
    "ROWS",
    "Force",
    "block_of",
    "copy_selection",
    "force_needle",
    "needle_selection",
    "selecting_layers",
    "map_kept_set",
    "position_map",
]
