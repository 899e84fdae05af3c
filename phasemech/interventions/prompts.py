"""Real-model prompts for the lab's intervention engines: one audit prompt as a run they take.

Axes: ``batch`` (copies of one prompt), ``pos`` (the rows a run computes), ``layer``, ``head``,
``d_head``, ``d_model``.

The lab's engines (:func:`~phasemech.interventions.patching_fast.patch_heads`,
:func:`~phasemech.interventions.attribution.attribution_patch`, the ablation hooks) take a model
and token batches. An audit prompt (:mod:`phasemech.data.retrieval`) differs in three ways, and
this adapter bridges each, so the engines themselves run unchanged:

* **the decode regime** prefills the document once with the uncompressed model; only the rows
  after it (question, answer) read the compressed cache. :func:`bound` makes every forward of a
  model read that frozen prefill, expanded (a view, no copy) to however many copies the engine
  batches: the prefill is computed once per prompt and shared by every patch. In the
  ``trained`` regime a run is the whole prompt and nothing is bound.
* **one answer row**: the engines read the row that predicts the FIRST answer token (``row``),
  where the needle must be retrieved; the other digits follow by copying from the needle.
* **one prompt per contrast**: prompts differ in length and each has its own prefill, so a
  contrast is one prompt (:func:`self_contrast`), and a clean run from another prompt comes in
  as the engine's ``source`` (:func:`cross_source`): the same content at another phase has the
  same question and answer tokens, so its rows align with the corrupted prompt's from the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache
from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

from phasemech.interventions.contrasts import Contrast, metric_values
from phasemech.model.decode import check_regime, prefill

#: columns of a prompt's metadata, as the audit's frame names them
META = ("prompt_id", "group_id", "prefix", "depth", "needle_pos", "phase")


@dataclass(frozen=True)
class PromptRun:
    """One audit prompt as the engines see it. ``tokens``: the rows computed (after the
    prefill in ``decode``, the whole prompt in ``trained``) up to the last answer-predicting
    row; ``row``: the row predicting the first answer token (within ``tokens``); ``answer``:
    every answer token; ``offset``: absolute position of ``tokens[0]`` (the prefill's length,
    0 in ``trained``); ``cache``: the frozen prefill (``decode``)."""

    tokens: Int[Tensor, "1 pos"]
    row: int
    answer: Int[Tensor, "answer"]
    offset: int
    needle: int  # absolute position of the needle's first answer token
    cache: TransformerLensKeyValueCache | None
    meta: dict[str, Any]

    @property
    def answer_rows(self) -> slice:
        """The rows predicting each answer token."""
        return slice(self.row, self.row + len(self.answer))


def prompt_run(
    base, batch, i: int, regime: str, keep_queries: int = 0, device: Any = None
) -> PromptRun:
    """Prompt ``i`` of ``batch`` (a retrieval ``PasskeyBatch``) in ``regime``; in ``decode`` its
    document is prefilled once by ``base`` (the uncompressed model), keeping the last
    ``keep_queries`` queries of each layer (``evict`` observes them)."""
    check_regime(regime)
    info = batch.frame.iloc[i]
    dev = device if device is not None else base.cfg.device
    start, n_ans = int(info["answer_start"]), batch.answer.shape[1]
    tokens = batch.tokens[i : i + 1, : start + n_ans - 1].to(dev)
    offset = int(info["question_start"]) if regime == "decode" else 0
    cache = prefill(base, tokens[:, :offset], keep_queries) if regime == "decode" else None
    # per column, not from the row: a row of an all-numeric frame is cast to float
    cells = {c: batch.frame[c].iloc[i] for c in META}
    meta = {c: v.item() if hasattr(v, "item") else v for c, v in cells.items()}
    return PromptRun(
        tokens=tokens[:, offset:],
        row=start - 1 - offset,
        answer=batch.answer[i].to(dev),
        offset=offset,
        needle=int(info["needle_pos"]),
        cache=cache,
        meta=meta,
    )


def plain_cache(cache: TransformerLensKeyValueCache) -> TransformerLensKeyValueCache:
    """A copy of ``cache`` made of ordinary tensors: the prefill runs under inference mode, and
    inference tensors cannot enter a graph (attribution patching differentiates through it)."""
    entries = []
    for e in cache.entries:
        x = TransformerLensKeyValueCacheEntry(e.past_keys.clone(), e.past_values.clone(), True)
        if getattr(e, "past_queries", None) is not None:
            x.past_queries = e.past_queries.clone()
        entries.append(x)
    return TransformerLensKeyValueCache(entries, cache.previous_attention_mask.clone(), True)


def expanded_cache(cache: TransformerLensKeyValueCache, n: int) -> TransformerLensKeyValueCache:
    """``cache`` for a batch of ``n`` copies: views, frozen (nothing is appended)."""
    entries = []
    for e in cache.entries:
        x = TransformerLensKeyValueCacheEntry(
            e.past_keys.expand(n, -1, -1, -1), e.past_values.expand(n, -1, -1, -1), frozen=True
        )
        queries = getattr(e, "past_queries", None)
        if queries is not None:
            x.past_queries = queries.expand(n, *queries.shape[1:])
        entries.append(x)
    mask = cache.previous_attention_mask.expand(n, -1)
    return TransformerLensKeyValueCache(entries, mask, frozen=True)


@contextlib.contextmanager
def bound(model, run: PromptRun) -> Iterator[None]:
    """Inside, every forward of ``model`` reads ``run``'s prefill (nothing in ``trained``):
    token input gets the cache and an all-ones mask of its rows, residual input
    (``start_at_layer``) the cache; the batch is any number of copies of the prompt."""
    if run.cache is None:
        yield
        return
    original, views, plain = model.forward, {}, plain_cache(run.cache)

    def forward(input, *args, **kw):  # noqa: A002 - TransformerLens' argument name
        n = input.shape[0]
        if n not in views:
            views[n] = expanded_cache(plain, n)
        kw["past_kv_cache"] = views[n]
        if kw.get("start_at_layer") is None and kw.get("attention_mask") is None:
            kw["attention_mask"] = torch.ones_like(input)
        return original(input, *args, **kw)

    model.forward, model.bound_prefill = forward, run.cache
    try:
        yield
    finally:
        del model.forward  # the class's forward again
        model.bound_prefill = None


def self_contrast(run: PromptRun, stride: int) -> Contrast:
    """``run`` against itself (clean = corrupted), read at its first answer token: the engines'
    corrupted side; what a patch copies in comes from ``source=``."""
    zero = torch.zeros(1, dtype=torch.long)
    pairs = pd.DataFrame([{**run.meta, "query_pos": run.row, "source_pos": run.needle}])
    pairs["corrupted_phase"] = pairs["phase"]
    return Contrast(
        kind="answer",
        clean_tokens=run.tokens.cpu(),
        corrupted_tokens=run.tokens.cpu(),
        clean_grid=zero,
        corrupted_grid=zero,
        query_pos=torch.tensor([run.row]),
        answer=run.answer[:1].cpu(),
        foil=torch.tensor([-1]),
        stride=stride,
        shift=0,
        pairs=pairs,
    )


def aligned(clean: Tensor, corrupted: Tensor) -> Tensor:
    """A clean activation ``[1, pos_c, ...]`` laid on the corrupted run's rows ``[n, pos_x,
    ...]``, aligned from the end (the same question and answer tokens end both runs); rows of
    the corrupted run without a clean counterpart keep their own value. Runs of different
    lengths are whole prompts (``trained``): both start with the same token at position 0, the
    sink, whose activations are the same in both; aligning it from the end would lay a prefix
    token on it, so row 0 keeps its own value."""
    out = corrupted.clone()
    n = min(clean.shape[1], corrupted.shape[1])
    if clean.shape[1] != corrupted.shape[1]:
        n = min(n, corrupted.shape[1] - 1)
    out[:, corrupted.shape[1] - n :] = clean[:, clean.shape[1] - n :]
    return out


@dataclass(frozen=True)
class CleanRun:
    """What a cross-prompt patch needs from the clean prompt: its activations (by hook name)
    and its answer-row logits."""

    acts: dict[str, Tensor]
    logits: Float[Tensor, "vocab"]

    def metric(self, answer: int, foil: int, metric: str = "logit_diff") -> float:
        lg = self.logits[None]
        return float(metric_values(lg, torch.tensor([answer]), torch.tensor([foil]), metric)[0])


@torch.inference_mode()
def clean_run(model, run: PromptRun, names: list[str]) -> CleanRun:
    """``run``'s activations at ``names`` and its answer-row logits (its prefill bound)."""
    with bound(model, run):
        logits, cache = model.run_with_cache(run.tokens, names_filter=lambda n: n in set(names))
    return CleanRun({n: cache[n] for n in names}, logits[0, run.row].float())


def cross_source(clean: CleanRun):
    """``patch_heads``' ``source``: the clean prompt's ``z``, aligned to the corrupted rows."""

    def source(name: str, z: Tensor) -> Tensor:
        return aligned(clean.acts[name].to(z.dtype), z)

    return source


@torch.inference_mode()
def score(model, run: PromptRun) -> dict[str, Any]:
    """``correct`` (every answer token greedy, teacher-forced), ``first_correct`` and
    ``margin`` (first answer token's logit minus the best other) of ``model`` on ``run``."""
    with bound(model, run):
        resid = model(run.tokens, stop_at_layer=model.cfg.n_layers)
    logits = model.unembed(model.ln_final(resid[:, run.answer_rows]))[0].float()
    hit = logits.argmax(-1) == run.answer
    margin = metric_values(logits[:1], run.answer[:1], run.answer[:1], "margin")
    return {"correct": bool(hit.all()), "first_correct": bool(hit[0]), "margin": float(margin[0])}


__all__ = [
    "CleanRun",
    "PromptRun",
    "aligned",
    "bound",
    "clean_run",
    "cross_source",
    "expanded_cache",
    "plain_cache",
    "prompt_run",
    "score",
    "self_contrast",
]
