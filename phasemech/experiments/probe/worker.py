"""The real-model studies' worker side: the model a worker process loads once
(:class:`ModelWorker`, :data:`WORKER`), the answer-onto-needle attention hooks
(:func:`attention_hooks`), the scoring of one prompt under the null and every design, in
either regime (:func:`score_prompt`), and the checks of a probe against its model before any
forward (:func:`check_probe`). Audit, explain and the studies after them import these names.

Axes: ``setting``, ``layer``, ``head``, ``answer`` (answer tokens); one prompt at a time
(``batch = 1``: prompts differ in length, and a decode-regime prefill is per prompt).

A prompt is correct iff every answer token is the argmax given the correct prefix (greedy
decoding, teacher-forced). ``trained``: each model runs the whole prompt. ``decode``: the
uncompressed model prefills the document (everything before the question) once; the null and
each design then run the question and answer rows over that frozen cache. Per-head attention
is read from the position that predicts the first answer token onto the needle's first answer
token.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from phasemech.attention import CompressedAttentionMixin
from phasemech.core.config import CompressionConfig
from phasemech.data.retrieval import RetrievalTask
from phasemech.experiments.probe.config import HOSTS, ProbeConfig
from phasemech.model.decode import needed_queries, prefill, read_rows


# ------------------------------------------------------------------------------ the model
class ModelWorker:
    """One per worker process (:data:`WORKER`): the model, loaded once and shared by every
    study's jobs in that process, its compressed copies (one per compression config, sharing
    the model's tensors) and the prompts of the last task asked for."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.base = None
        self.compressed: dict[str, Any] = {}
        self.prompts: dict[tuple, Any] = {}
        self.bos = False  # the model's prompts start with BOS (ModelSource.prepend_bos)

    def model(self, spec: str, n_ctx: int, device):
        from phasemech.model.fast import linear_layout, use_eval_sdpa
        from phasemech.model.sources import describe, load

        if self.key != (spec, str(device)) or self.base.cfg.n_ctx < n_ctx:
            self.prompts = {}
            source = describe(spec)
            self.bos = source.prepend_bos
            self.base = load(source, min(source.max_context, max(n_ctx, 2048)), device)
            use_eval_sdpa(self.base)  # dense attention through SDPA where nothing reads scores
            linear_layout(self.base)  # no per-forward weight copies (shared by the designs)
            self.key, self.compressed = (spec, str(device)), {}
        return self.base

    def setting(self, comp: CompressionConfig | None):
        from phasemech.model.fast import use_eval_sdpa
        from phasemech.model.transformer import PhaseTransformer

        if comp is None:
            return self.base
        name = json.dumps(comp.to_dict(), sort_keys=True)  # the whole config, not a label
        if name not in self.compressed:
            model = PhaseTransformer.from_hooked(self.base, comp).eval()
            # post hoc designs add no parameters: share the base's tensors instead of a copy
            # per design (a worker holds the model once, however many designs it scores)
            model.load_state_dict(self.base.state_dict(), strict=False, assign=True)
            use_eval_sdpa(model)  # its uncompressed layers
            self.compressed[name] = model
        return self.compressed[name]

    def probe(self, p: ProbeConfig, context: int, device) -> tuple[Any, Any]:
        """``(the uncompressed model, the prompts)`` of probe ``p`` at ``context`` tokens."""
        base = self.model(p.model, context + 64, device)
        return base, self.batch(p.retrieval_task(context), p.contents, p.seed)

    def batch(self, task: RetrievalTask, contents: int, seed: int):
        from phasemech.data.retrieval import build_retrieval_prompts

        key = (self.key, task, contents, seed)  # prompts are the model's tokenizer's
        if key not in self.prompts:
            tok, bos = self.base.tokenizer, self.bos
            self.prompts = {key: build_retrieval_prompts(tok, task, contents, seed, bos=bos)}
        return self.prompts[key]


#: the process's worker: every job of every real-model study in this process shares it
WORKER = ModelWorker()


# ------------------------------------------------------------------------------ scoring
def attention_hooks(model, row: int, key: int, store: dict[int, Tensor]) -> list:
    """Hooks that keep, per layer, the attention of query ``row`` onto key ``key`` (the answer
    onto the needle): ``hook_pattern`` on dense layers, ``hook_token_pattern`` on compressed
    ones (exact for the selecting designs and ``mean``)."""

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
    meta |= {c: info[c] for c in ("prefix", "template") if c in info}  # for a regression
    meta = {k: v.item() if hasattr(v, "item") else v for k, v in meta.items()}
    rows, heads = [], []
    for name, model in models:
        store: dict[int, Tensor] = {}
        hooks = attention_hooks(model, start - 1 - offset, needle, store) if attend else []
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


# ------------------------------------------------------------------------------ checks
def check_probe(a: ProbeConfig):
    """Every bad input fails here, in one line, before any forward: the model spec, contexts
    longer than the model was trained for, a tokenizer that cannot place the needle on every
    phase, a design the model's attention cannot host, layers the model lacks. Returns the
    model's resolved source (``phasemech.model.sources.ModelSource``)."""
    from phasemech.data.retrieval import check_task
    from phasemech.model.sources import describe, tokenizer

    source = describe(a.model)
    too_long = [c for c in a.contexts if c > source.max_context]
    if too_long:
        raise ValueError(
            f"contexts {too_long} are invalid: {a.model!r} was trained to {source.max_context} "
            f"tokens; allowed 64..{source.max_context}"
        )
    tok = tokenizer(source)
    for c in a.contexts:
        check_task(tok, a.retrieval_task(c), source.max_context, bos=source.prepend_bos)
    _check_host(a, source)
    return source


def _check_host(a: ProbeConfig, source) -> None:
    """The model can host the probe: its layers exist and its positions are keys' own."""
    if a.layers is not None and max(a.layers) >= source.n_layers:
        raise ValueError(
            f"layers={list(a.layers)} is invalid: {a.model!r} has {source.n_layers} layers; "
            f"allowed 0..{source.n_layers - 1}"
        )
    if source.positional not in HOSTS:
        raise ValueError(
            f"model {a.model!r} uses {source.positional} position encoding, which compressed "
            f"attention cannot host (an additive bias over [pos, key_pos]); allowed {HOSTS}"
        )


__all__ = ["WORKER", "ModelWorker", "attention_hooks", "check_probe", "score_prompt"]
