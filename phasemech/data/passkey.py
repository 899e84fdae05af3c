"""Passkey retrieval prompts for pretrained models, with the needle's phase swept exactly.

Axes: ``batch`` (prompts), ``pos`` (token positions), ``answer`` (answer tokens), ``phase``.

A prompt is built from token pieces, concatenated as token ids (so that adding one token in
front shifts every later token by exactly one position):

``[shift prefix: k tokens] [filler ... needle sentence ... filler] [question] [answer]``

- needle: ``" The pass code for {name} is {number}."`` at a chosen depth of the filler (at a
  sentence boundary), optionally with ``distractors`` other names' codes elsewhere;
- question: ``" What is the pass code for {name}? The pass code for {name} is"``;
- answer: the tokens of ``" {number}"`` (SmolLM2 writes one token per digit).

Each *content* (name, number, filler rotation, depth) is emitted with every prefix length
``k = 0..stride-1`` (``group_id`` = content): the needle lands on every phase at each depth,
and the prompts of a group are paired (same content, shifted). The needle position is the
first digit of the number in the needle sentence; its phase is ``needle_pos mod stride`` (the
grid starts at the first token; there is no BOS).

Scoring is greedy decoding done in one forward (teacher forcing): the key is produced iff every
answer token is the argmax given the correct prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from phasemech.core.device import model_device

FILLER = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)
PREFIX = " Please read the following text carefully and remember what it says."
NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Peter "
    "Quinn Rachel Sam Tina Victor Wendy Xavier Yara Zoe Adam Bella Chris Diana Ethan Fiona "
    "George Hannah Ivan Julia Kevin Laura Mark Nina Oscar Paula Robert Sara Thomas Ursula Vincent"
).split()


@dataclass(frozen=True)
class PasskeyTask:
    """What prompts look like. ``context`` is the filler length in tokens (about)."""

    context: int = 96
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    digits: int = 4
    stride: int = 4  # prefixes 0..stride-1: one prompt per phase per content
    distractors: int = 0

    def __post_init__(self) -> None:
        for name, low in (("context", 16), ("digits", 1), ("stride", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"PasskeyTask: {name}={v!r} is invalid: expected an int >= {low}")
        if not isinstance(self.distractors, int) or not 0 <= self.distractors < len(NAMES) - 1:
            raise ValueError(
                f"PasskeyTask: distractors={self.distractors!r} is invalid: expected an int in "
                f"[0, {len(NAMES) - 2}]"
            )
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise ValueError(
                f"PasskeyTask: depths={self.depths!r} is invalid: expected fractions in [0, 1]"
            )


@dataclass(frozen=True)
class PasskeyBatch:
    """Prompts as right-padded token ids and one row per prompt in ``frame``.

    ``frame`` columns: ``prompt_id, group_id, prefix, depth, name, number, needle_pos`` (first
    digit of the needle's number), ``phase`` (``needle_pos mod stride``), ``answer_start`` (first
    answer token), ``length``, ``distance`` (from the needle to the first answer token).
    """

    tokens: Int[Tensor, "batch pos"]
    answer: Int[Tensor, "batch answer"]
    frame: pd.DataFrame
    stride: int


def token_ids(tok, text: str) -> list[int]:
    """The token ids of ``text`` alone (no special tokens), to assemble prompts from."""
    return list(tok.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class _Content:
    """One content's token pieces: the needle sits between ``before`` and ``after``."""

    depth: float
    name: str
    number: int
    before: list[int]
    needle_head: list[int]  # " The pass code for {name} is"
    digits: list[int]  # " {number}": also the answer
    needle: list[int]  # the whole needle sentence
    after: list[int]
    question: list[int]


def build_prompts(
    tok, task: PasskeyTask, n_contents: int, seed: int = 0, pad_id: int | None = None
) -> PasskeyBatch:
    """``n_contents`` contents (cycling through the depths), each at every prefix ``0..d-1``."""
    if isinstance(n_contents, bool) or not isinstance(n_contents, int) or n_contents < 1:
        raise ValueError(f"n_contents={n_contents!r} is invalid: expected an int >= 1")
    rng = np.random.default_rng(seed)
    prefix = token_ids(tok, PREFIX)
    if len(prefix) < task.stride - 1:
        raise ValueError(f"stride={task.stride} needs a prefix of {task.stride - 1} tokens")
    sentences = [token_ids(tok, s) for s in FILLER]
    pad = pad_id if pad_id is not None else (tok.pad_token_id or 0)
    rows, seqs, answers = [], [], []
    for g in range(n_contents):
        depth = float(task.depths[g % len(task.depths)])
        content = _draw_content(tok, task, rng, sentences, depth)
        for k in range(task.stride):
            row, ids = _shifted_prompt(content, prefix[:k], task)
            rows.append(dict(prompt_id=len(rows), group_id=g, prefix=k) | row)
            seqs.append(ids + content.digits)
            answers.append(content.digits)
    n_ans = {len(a) for a in answers}
    if len(n_ans) != 1:  # the digits of every number tokenise alike; a tokenizer that doesn't
        raise ValueError(f"answers tokenise to different lengths {sorted(n_ans)}")
    width = max(map(len, seqs))
    tokens = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):  # right padding: a causal model never sees it
        tokens[i, : len(s)] = torch.tensor(s)
    return PasskeyBatch(tokens, torch.tensor(answers), pd.DataFrame(rows), task.stride)


def _draw_content(
    tok, task: PasskeyTask, rng: np.random.Generator, sentences: list[list[int]], depth: float
) -> _Content:
    """Draw a name, its number, a filler rotation and the distractors; place the needle."""
    names = rng.choice(len(NAMES), size=1 + task.distractors, replace=False)
    name = NAMES[names[0]]
    number = int(rng.integers(10 ** (task.digits - 1), 10**task.digits))
    start = int(rng.integers(len(sentences)))
    filler: list[list[int]] = []
    while sum(map(len, filler)) < task.context:
        filler.append(sentences[(start + len(filler)) % len(sentences)])
    cut = int(round(depth * len(filler)))
    others = []
    for i in names[1:]:
        other = int(rng.integers(10 ** (task.digits - 1), 10**task.digits))
        others.append(token_ids(tok, f" The pass code for {NAMES[i]} is {other}."))
    # distractors at random other sentence boundaries
    body: list[list[int]] = list(filler)
    slots = sorted(rng.choice(len(filler) + 1, size=len(others), replace=True).tolist())
    for s_, o in zip(reversed(slots), reversed(others), strict=True):
        body.insert(s_, o)
    cut_b = cut + sum(1 for s_ in slots if s_ < cut)
    needle_head = token_ids(tok, f" The pass code for {name} is")
    digits = token_ids(tok, f" {number}")
    return _Content(
        depth=depth,
        name=name,
        number=number,
        before=[t for piece in body[:cut_b] for t in piece],
        needle_head=needle_head,
        digits=digits,
        needle=needle_head + digits + token_ids(tok, "."),
        after=[t for piece in body[cut_b:] for t in piece],
        question=token_ids(tok, f" What is the pass code for {name}? The pass code for {name} is"),
    )


def _shifted_prompt(c: _Content, head: list[int], task: PasskeyTask) -> tuple[dict, list[int]]:
    """The frame row (less its ids) and the prompt tokens up to the answer, behind ``head``."""
    # the first digit: the needle's tokens after " The pass code for X is", skipping a
    # bare-space token if the tokenizer splits one off
    lead = 1 if len(c.digits) > task.digits else 0
    needle_pos = len(head) + len(c.before) + len(c.needle_head) + lead
    ids = head + c.before + c.needle + c.after + c.question
    row = dict(
        depth=c.depth,
        name=c.name,
        number=c.number,
        needle_pos=needle_pos,
        phase=needle_pos % task.stride,
        answer_start=len(ids),
        length=len(ids) + len(c.digits),
        distance=len(ids) - needle_pos,
    )
    return row, ids


@torch.inference_mode()
def score(model, batch: PasskeyBatch, batch_size: int = 16, progress=None) -> pd.DataFrame:
    """``batch.frame`` plus ``correct`` (every answer token is the argmax: greedy decoding
    yields the key), ``first_correct`` (the first answer token) and ``logprob`` (of the whole
    answer), teacher-forced in one forward per prompt. The prompts (built on the CPU) are
    moved to the model's device batch by batch."""
    dev = model_device(model)
    starts = torch.tensor(batch.frame["answer_start"].to_numpy())
    n_ans = batch.answer.shape[1]
    correct, first, logprob = [], [], []
    for i in range(0, len(batch.tokens), batch_size):
        sl = slice(i, i + batch_size)
        tokens, ans, st = batch.tokens[sl].to(dev), batch.answer[sl].to(dev), starts[sl].to(dev)
        width = int((st + n_ans).max())
        # the unembedding at the answer rows only (a 49k vocabulary at every position would
        # cost a fifth of the forward): the residual after the last block, then ln_final + W_U
        resid = model(tokens[:, :width], stop_at_layer=model.cfg.n_layers)  # [batch, pos, d]
        # the logits at position p predict token p + 1: answer token a is predicted at st - 1 + a
        rows = st[:, None] - 1 + torch.arange(n_ans, device=dev)[None, :]
        picked = resid.gather(1, rows[..., None].expand(-1, -1, resid.shape[-1]))
        picked = model.unembed(model.ln_final(picked))  # [batch, answer, vocab]
        lp = picked.log_softmax(-1).gather(-1, ans[..., None])[..., 0]
        hit = picked.argmax(-1) == ans
        correct.append(hit.all(-1))
        first.append(hit[:, 0])
        logprob.append(lp.sum(-1))
        if progress is not None:
            progress(len(tokens))
    out = batch.frame.copy()
    out["correct"] = torch.cat(correct).cpu().numpy()
    out["first_correct"] = torch.cat(first).cpu().numpy()
    out["logprob"] = torch.cat(logprob).float().cpu().numpy()
    return out


__all__ = ["FILLER", "NAMES", "PasskeyBatch", "PasskeyTask", "build_prompts", "score", "token_ids"]
