"""Scoring one audit prompt under the null and every design, in either regime.

Axes: ``setting``, ``layer``, ``head``, ``answer`` (answer tokens); one prompt at a time
(``batch = 1``: prompts differ in length, and a decode-regime prefill is per prompt).

A prompt is correct iff every answer token is the argmax given the correct prefix (greedy
decoding, teacher-forced). ``trained``: each model runs the whole prompt. ``decode``: the
uncompressed model prefills the document (everything before the question) once; the null and
each design then run the question and answer rows over that frozen cache. Per-head attention
is read from the position that predicts the first answer token onto the needle's first answer
token:
``hook_pattern`` on uncompressed layers, ``hook_token_pattern`` (exact for the selecting
designs and ``mean``) on compressed ones.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from phasemech.attention import CompressedAttentionMixin
from phasemech.model.decode import needed_queries, prefill, read_rows


def _attention_hooks(model, row: int, key: int, store: dict[int, Tensor]) -> list:
    """Hooks that keep, per layer, the attention of query ``row`` onto key ``key``."""

    def keep(pattern: Tensor, hook) -> None:
        store[int(hook.name.split(".")[1])] = pattern[0, :, row, key].float().cpu()

    hooks = []
    for i, block in enumerate(model.blocks):
        compressed = isinstance(block.attn, CompressedAttentionMixin)
        name = "hook_token_pattern" if compressed else "hook_pattern"
        hooks.append((f"blocks.{i}.attn.{name}", keep))
    return hooks


def _verdict(
    model, resid: Float[Tensor, "1 rows d_model"], answer: Tensor
) -> tuple[bool, bool, float]:
    """``(correct, first_correct, logprob)`` from the residual at the answer-predicting rows."""
    logits = model.unembed(model.ln_final(resid))[0]  # [answer, vocab]
    hit = logits.argmax(-1) == answer
    lp = logits.log_softmax(-1).gather(-1, answer[:, None]).sum()
    return bool(hit.all()), bool(hit[0]), float(lp)


def _grid(model, shift: int) -> tuple[Any, int]:
    """The grid context of a model with ``random`` offsets (this prompt's draw) and its shift."""
    comp = getattr(model.cfg, "compression", None)
    if comp is not None and comp.enabled and comp.offsets == "random":
        return model.shift_grid(shift), shift % comp.stride
    return contextlib.nullcontext(), 0


def _clock(device) -> float:
    """Wall time, after the device's queued work (a GPU runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def score_prompt(
    base,
    models: Sequence[tuple[str, Any]],
    batch,
    i: int,
    regime: str,
    attend: bool,
    shift: int = 0,
) -> tuple[list[dict], list[dict]]:
    """One prompt of ``batch`` under every ``(setting, model)``: a row per setting and, with
    ``attend``, a row per (setting, layer, head) of answer-onto-needle attention. A model with
    ``random`` offsets runs on its grid shifted by ``shift`` (``grid_shift`` in its row).
    ``seconds``: the setting's own forward; ``prefill_s``: the decode regime's shared prefill."""
    info = batch.frame.iloc[i]
    dev = base.cfg.device
    n_ans = batch.answer.shape[1]
    start, needle = int(info["answer_start"]), int(info["needle_pos"])
    width = start + n_ans - 1  # the last answer token is predicted, never read
    tokens = batch.tokens[i : i + 1, :width].to(dev)
    answer = batch.answer[i].to(dev)
    offset = int(info["question_start"]) if regime == "decode" else 0
    cache, t0 = None, _clock(dev)
    if regime == "decode":
        keep = max(needed_queries(m) for _, m in models)
        cache = prefill(base, tokens[:, :offset], keep_queries=keep)
    prefill_s = _clock(dev) - t0
    meta = {c: info[c] for c in ("prompt_id", "group_id", "depth", "needle_pos", "phase")}
    meta = {k: v.item() if hasattr(v, "item") else v for k, v in meta.items()}
    rows, heads = [], []
    for name, model in models:
        store: dict[int, Tensor] = {}
        hooks = _attention_hooks(model, start - 1 - offset, needle, store) if attend else []
        grid, grid_shift = _grid(model, shift)
        t0 = _clock(dev)
        with model.hooks(fwd_hooks=hooks), grid:
            if cache is None:
                resid = model(tokens, stop_at_layer=model.cfg.n_layers)
            else:
                resid = read_rows(model, cache, tokens[:, offset:])
        picked = resid[:, start - 1 - offset : width - offset]
        correct, first, lp = _verdict(model, picked, answer)
        rows.append(
            dict(meta, setting=name, correct=correct, first_correct=first, logprob=lp,
                 answer_start=start, length=width + 1, grid_shift=grid_shift,
                 seconds=_clock(dev) - t0, prefill_s=prefill_s, attention=attend)
        )  # fmt: skip
        for layer, mass in sorted(store.items()):
            heads += [
                dict(setting=name, prompt_id=meta["prompt_id"], phase=meta["phase"],
                     layer=layer, head=h, mass=float(m))
                for h, m in enumerate(mass.tolist())
            ]  # fmt: skip
    return rows, heads


__all__ = ["score_prompt"]
