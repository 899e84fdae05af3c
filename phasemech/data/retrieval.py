"""Long-context retrieval prompts (passkey, multi-key, key-value) with the needle's phase swept.

Axes: ``batch`` (prompts), ``pos`` (token positions), ``answer`` (answer tokens), ``phase``
(``needle_pos mod stride``).

They serve ``phasemech audit`` (per-phase retrieval of a compressed pretrained model at 512 to
8192 tokens). As in :mod:`phasemech.data.passkey`, a prompt is concatenated from token pieces,
tokenised once per content, so one more token in front shifts everything after it by one:

``[start] [shift prefix: k tokens] [body: filler sentences, needle and distractors] [question]
[answer]``

``start`` is the BOS token where the model reads text behind one (``bos=True``: a local folder
whose tokenizer puts BOS in front of any text, as Gemma's and Llama's do; the caller decides,
from ``ModelSource.prepend_bos``), else nothing (SmolLM2, GPT-2); it counts in the context and
in the phase.

Kinds (``RetrievalTask.kind``):

- ``passkey``: one needle ``" The pass code for {name} is {code}."`` (``code_len`` digits);
  question ``" What is the pass code for {name}? The pass code for {name} is"``. Other needle
  templates (``RetrievalTask.template``, :data:`TEMPLATES`) change the words before the code,
  so the lead-in tokens differ, each with its matching question: ``pass_code`` (the default,
  above: ``" is"`` before the code), ``colon`` (``" Pass code of {name}: {code}."``),
  ``equals`` (``" The secret number of {name} equals {code}."``) and ``assign``
  (``" Pass code for {name}={code}."``: no space, so ``"="`` is the token right before the
  code's first digit).
- ``multikey``: the same with ``distractors`` other names' codes (distinct names, distinct
  codes) at other sentence boundaries; the question names the target.
- ``kv``: ``1 + distractors`` records ``" Record {key}: value {value}."`` (``key`` a distinct
  3-digit id, ``value`` ``code_len`` alternating letters and digits such as ``"b7k2"``, one token
  per character for SmolLM2); question ``" What is the value of record {key}? Record {key}:
  value"``.

Answer: the tokens of ``" {code}"``, less a bare-space first token where the tokenizer splits
one off (SmolLM2 does before a digit): that token carries nothing and ends the question, so the
answer starts at the first informative token, like passkey.py's needle position. The answer
appears verbatim in the needle: ``tokens[needle_pos : needle_pos + n] == tokens[answer_start :
answer_start + n] == answer``. Codes are redrawn until they tokenise to the common length.

Phases: each content (group) is emitted behind the first ``e + k`` tokens of ``PREFIX``,
``k = 0..stride-1`` and ``e = prefix_extra`` (default 0), so the first answer token of the
needle lands on every phase once per group: prompt ``k`` has prefix length ``e + k`` (the
frame's ``prefix``) and phase ``(len(start) + e + k + needle_at) mod stride``, ``needle_at``
the content's own offset. ``e`` takes ``e`` tokens from the filler's budget, so the prompts'
lengths stay as below whatever ``e`` is: runs at several ``e`` meet every phase at several
prefix lengths (and, as ``needle_at`` varies between contents, so does one run).

Length tolerance: the body is filled to an exact token count, so the prompt (+ answer) with
prefix ``k`` is ``context - (stride - 1) + k`` tokens: all lie in ``[context - stride + 1,
context]`` and the last of every group is exactly ``context``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from numbers import Real

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from phasemech.data.passkey import FILLER, NAMES, PREFIX, PasskeyBatch, token_ids

TASK_KINDS = ("passkey", "multikey", "kv")
MIN_CONTEXT = 64  # below this a needle at depth 0.1 and one at 0.9 are a few sentences apart
MAX_CODE_LEN = 12
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_KV_KEYS = tuple(str(k) for k in range(100, 1000))  # 3-digit ids: same width, one run of digits
_DISTRACTORS = {"passkey": (0, 0), "multikey": (1, len(NAMES) - 1), "kv": (0, len(_KV_KEYS) - 1)}
_DEFAULT_DISTRACTORS = {"passkey": 0, "multikey": 4, "kv": 4}
#: needle templates of ``passkey`` and ``multikey``: name -> (needle head, question, the text
#: between head and code); the needle is head + sep + code + ``"."``
TEMPLATES: dict[str, tuple[str, str, str]] = {
    "pass_code": (
        " The pass code for {key} is",
        " What is the pass code for {key}? The pass code for {key} is",
        " ",
    ),
    "colon": (" Pass code of {key}:", " What is the pass code of {key}? Pass code of {key}:", " "),
    "equals": (
        " The secret number of {key} equals",
        " What does the secret number of {key} equal? The secret number of {key} equals",
        " ",
    ),
    "assign": (
        " Pass code for {key}=",
        " What is the pass code for {key}? Pass code for {key}=",
        "",
    ),
}
_KV_TEMPLATE = (
    " Record {key}: value",
    " What is the value of record {key}? Record {key}: value",
    " ",
)
COLUMNS = (  # of the frame, one row per prompt (``prefix``: the shift prefix's length)
    "prompt_id", "group_id", "prefix", "kind", "depth", "key", "target", "needle_pos", "phase",
    "question_start", "answer_start", "length", "distance", "template",
)  # fmt: skip


def _bad(name: str, value, why: str, allowed: str) -> ValueError:
    """One line naming the field, the bad value, why and what is allowed."""
    return ValueError(f"RetrievalTask: {name}={value!r} is invalid: {why}allowed: {allowed}")


def _is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _code_space(kind: str, code_len: int) -> int:
    """How many distinct codes of ``code_len`` characters a kind draws from."""
    if kind == "kv":  # letters at even places, digits at odd ones
        return 26 ** ((code_len + 1) // 2) * 10 ** (code_len // 2)
    return 9 * 10 ** (code_len - 1)  # no leading zero: the number reads as written


@dataclass(frozen=True)
class RetrievalTask:
    """What a retrieval prompt set looks like (see the module docstring for the layout).

    ``context`` is the total length (shift prefix + body + question + answer): every prompt is
    in ``[context - stride + 1, context]``. ``distractors=None`` takes the kind's default (0 for
    ``passkey``, which refuses any other value; 4 for ``multikey`` and ``kv``). ``template``:
    the needle's words (:data:`TEMPLATES`; ``kv`` has its record template only);
    ``prefix_extra``: shift-prefix tokens in front of every prompt's ``k``, taken from the
    filler (module docstring, Phases).
    """

    kind: str = "passkey"
    context: int = 1024
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    stride: int = 4
    distractors: int | None = None
    code_len: int = 4
    template: str = "pass_code"
    prefix_extra: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise _bad("kind", self.kind, "", " | ".join(TASK_KINDS))
        if self.template not in TEMPLATES or (self.kind == "kv" and self.template != "pass_code"):
            why = "kv has its record template only; " if self.template in TEMPLATES else ""
            allowed = "pass_code" if self.kind == "kv" else " | ".join(TEMPLATES)
            raise _bad("template", self.template, why, allowed)
        if not _is_int(self.prefix_extra) or self.prefix_extra < 0:
            raise _bad("prefix_extra", self.prefix_extra, "", "an int >= 0")
        for name, low, high in (
            ("context", MIN_CONTEXT, None),
            ("stride", 1, None),
            ("code_len", 1, MAX_CODE_LEN),
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < low or (high is not None and v > high):
                raise _bad(name, v, "", f"an int in {low}..{high or ''}")
        depths = self.depths
        if (
            isinstance(depths, str | bytes)
            or not hasattr(depths, "__len__")
            or not depths
            or any(isinstance(d, bool) or not isinstance(d, Real) for d in depths)
            or any(not 0.0 <= float(d) <= 1.0 for d in depths)
        ):
            raise _bad("depths", depths, "", "a non-empty tuple of fractions in [0, 1]")
        object.__setattr__(self, "depths", tuple(float(d) for d in depths))  # hashable, exact
        if self.distractors is None:
            object.__setattr__(self, "distractors", _DEFAULT_DISTRACTORS[self.kind])
        low, high = _DISTRACTORS[self.kind]
        d = self.distractors
        if not _is_int(d) or not low <= d <= high:
            why = "a passkey has one needle only; " if high == 0 else f"kind={self.kind!r}; "
            raise _bad("distractors", d, why, f"an int in {low}..{high}")
        if 1 + d > _code_space(self.kind, self.code_len):
            raise _bad(
                "code_len",
                self.code_len,
                f"{1 + d} distinct {self.kind} codes do not exist at this length; ",
                f"a code_len with >= {1 + d} codes",
            )


@dataclass(frozen=True)
class _Pieces:
    """Token pieces shared by every content of a build, tokenised once."""

    prefix: list[int]
    sentences: list[list[int]]
    tails: dict[int, list[int]]  # filler budget -> sentence indices that fill it exactly
    fill_min: int  # every filler budget >= this is filled exactly
    n_answer: int  # the common answer length, in tokens
    dot: list[int]
    start: list[int]  # the model's BOS where it reads text behind one: every prompt's start


@dataclass(frozen=True)
class _Content:
    """One content's pieces: everything but the shift prefix."""

    depth: float
    key: str
    code: str
    body: list[int]
    needle_at: int  # the first answer token of the target's needle, within the body
    question: list[int]  # ends with the bare-space token where the tokenizer splits one off
    answer: list[int]


def exact_tails(lengths: list[int], limit: int) -> tuple[dict[int, list[int]], int | None]:
    """Fewest-sentence fills of every reachable budget up to ``limit``, and the least budget
    from which every larger one is reachable (``None`` when none is, e.g. a common divisor)."""
    tails: dict[int, list[int]] = {0: []}
    for total in range(1, limit + 1):  # breadth-first by budget: the shortest path to each
        best = [tails[total - n] + [i] for i, n in enumerate(lengths) if total - n in tails]
        if best:
            tails[total] = min(best, key=len)
    step = max(lengths)  # a window of `step` reachable budgets reaches every larger one
    for start in range(1, limit - step + 2):
        if all(b in tails for b in range(start, start + step)):
            return tails, start
    return tails, None


def _split_answer(tok, code: str, sep: str = " ") -> tuple[list[int], list[int]]:
    """``(lead, answer)``: the tokens of ``sep + code``, a bare-space first token split off."""
    ids = token_ids(tok, f"{sep}{code}")
    if len(ids) > 1 and tok.decode(ids[:1]).strip() == "":
        return ids[:1], ids[1:]
    return [], ids


def _draw_code(rng: np.random.Generator, kind: str, code_len: int) -> str:
    if kind == "kv":  # alternate letters and digits: no letter pair for a tokenizer to merge
        return "".join(
            _LETTERS[int(rng.integers(26))] if i % 2 == 0 else str(int(rng.integers(10)))
            for i in range(code_len)
        )
    return str(int(rng.integers(10 ** (code_len - 1), 10**code_len)))


def _texts(task: RetrievalTask, key: str) -> tuple[str, str]:
    """``(needle head, question)``: the needle is head + sep + code + ``"."``."""
    head, question, _ = _KV_TEMPLATE if task.kind == "kv" else TEMPLATES[task.template]
    return head.format(key=key), question.format(key=key)


def _sep(task: RetrievalTask) -> str:
    return _KV_TEMPLATE[2] if task.kind == "kv" else TEMPLATES[task.template][2]


def _prepare(
    tok, task: RetrievalTask, max_context: int | None = None, bos: bool = False
) -> _Pieces:
    """Tokenise the shared pieces; refuse a stride the prefix cannot shift or a context too
    short for the needle, the distractors and the question (at the longest keys)."""
    prefix = token_ids(tok, PREFIX)
    if len(prefix) < task.prefix_extra + task.stride - 1:
        if task.prefix_extra:
            raise _bad(
                "prefix_extra",
                task.prefix_extra,
                f"the shift prefix is {len(prefix)} tokens and stride {task.stride} takes "
                f"{task.stride - 1} of them; ",
                f"0..{max(len(prefix) - task.stride + 1, 0)}",
            )
        raise _bad(
            "stride",
            task.stride,
            f"the shift prefix is {len(prefix)} tokens, so the needle reaches at most "
            f"{len(prefix) + 1} phases; ",
            f"1..{len(prefix) + 1}",
        )
    sentences = [token_ids(tok, s) for s in FILLER]
    lengths = [len(s) for s in sentences]
    tails, fill_min = exact_tails(lengths, 64 * max(lengths))
    if fill_min is None:
        raise ValueError(f"filler sentences of {lengths} tokens cannot fill a body exactly")
    # the common answer length: the commonest over a fixed probe, whatever the seed
    probe = np.random.default_rng(0)
    sep = _sep(task)
    splits = [
        _split_answer(tok, _draw_code(probe, task.kind, task.code_len), sep) for _ in range(32)
    ]
    n_answer = Counter(len(a) for _, a in splits).most_common(1)[0][0]
    lead = max(len(ld) for ld, _ in splits)
    keys = _KV_KEYS if task.kind == "kv" else NAMES
    heads, questions = zip(*(_texts(task, k) for k in keys), strict=True)
    dot = token_ids(tok, ".")
    needle = max(len(token_ids(tok, h)) for h in heads) + lead + n_answer + len(dot)
    question = max(len(token_ids(tok, q)) for q in questions) + lead
    d = task.distractors
    start = [tok.bos_token_id] if bos else []
    # d + 1 distinct sentence boundaries need d sentences at least
    need = len(start) + task.prefix_extra + task.stride - 1 + question + n_answer + (1 + d) * needle
    need += max(fill_min, d * max(lengths))
    if task.context < need:
        raise _bad(
            "context",
            task.context,
            f"the needle, {d} distractors and the question need {need} tokens; ",
            f"{need}..{max_context}" if max_context is not None else f">= {need}",
        )
    return _Pieces(prefix, sentences, tails, fill_min, n_answer, dot, start)


def _draw_codes(tok, task: RetrievalTask, rng: np.random.Generator, n: int, n_answer: int):
    """``n`` distinct ``(code, lead, answer)`` whose answers are ``n_answer`` tokens long."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for _ in range(100 * n):
        code = _draw_code(rng, task.kind, task.code_len)
        if code not in out:
            lead, answer = _split_answer(tok, code, _sep(task))
            if len(answer) == n_answer:
                out[code] = (lead, answer)
                if len(out) == n:
                    return [(c, *la) for c, la in out.items()]
    raise _bad(
        "code_len",
        task.code_len,
        f"cannot draw {n} distinct codes that tokenise to {n_answer} tokens; ",
        "another code_len",
    )


def _filler(p: _Pieces, budget: int, start: int) -> list[list[int]]:
    """Filler sentences of exactly ``budget`` tokens: the rotation from ``start``, then the
    fewest sentences that make up the rest exactly (so a group's last prompt is ``context``)."""
    out, left, i = [], budget, start
    top = p.fill_min + max(map(len, p.sentences))  # every remainder up to here has a tail
    while left > top:
        out.append(p.sentences[i % len(p.sentences)])
        left -= len(out[-1])
        i += 1
    return out + [p.sentences[j] for j in p.tails[left]]


def _draw_content(
    tok, task: RetrievalTask, p: _Pieces, rng: np.random.Generator, depth: float
) -> _Content:
    """Draw keys, codes, a filler rotation and distractor slots; lay the body out."""
    d = task.distractors
    keys = (
        [_KV_KEYS[i] for i in rng.choice(len(_KV_KEYS), size=1 + d, replace=False)]
        if task.kind == "kv"
        else [NAMES[i] for i in rng.choice(len(NAMES), size=1 + d, replace=False)]
    )
    codes = _draw_codes(tok, task, rng, 1 + d, p.n_answer)
    needles, offsets = [], []  # offsets: the first answer token within each needle
    for key, (_, lead, answer) in zip(keys, codes, strict=True):
        head = token_ids(tok, _texts(task, key)[0]) + lead
        needles.append(head + answer + p.dot)
        offsets.append(len(head))
    question = token_ids(tok, _texts(task, keys[0])[1]) + codes[0][1]
    shift = len(p.start) + task.prefix_extra + task.stride - 1  # the longest prompt's
    budget = task.context - shift - len(question) - p.n_answer
    budget -= sum(map(len, needles))
    filler = _filler(p, budget, int(rng.integers(len(p.sentences))))
    # the target sits at the boundary nearest `depth` of the filler's tokens; distractors at
    # distinct other boundaries, drawn at random
    cum = np.concatenate([[0], np.cumsum([len(s) for s in filler])])
    at = int(np.argmin(np.abs(cum / max(budget, 1) - depth)))
    others = [b for b in range(len(filler) + 1) if b != at]
    slots = dict(zip(rng.choice(others, size=d, replace=False).tolist(), needles[1:], strict=True))
    slots[at] = needles[0]
    body: list[int] = []
    needle_at = -1
    for b in range(len(filler) + 1):
        if b == at:
            needle_at = len(body) + offsets[0]
        body += slots.get(b, [])
        if b < len(filler):
            body += filler[b]
    return _Content(depth, keys[0], codes[0][0], body, needle_at, question, codes[0][2])


def _build(tok, task: RetrievalTask, p: _Pieces, n_contents: int, seed: int) -> PasskeyBatch:
    rng = np.random.default_rng(seed)
    rows, seqs = [], []
    for g in range(n_contents):
        c = _draw_content(tok, task, p, rng, task.depths[g % len(task.depths)])
        for k in range(task.prefix_extra, task.prefix_extra + task.stride):  # only the shift
            shift = len(p.start) + k  # differs: the pieces are reused
            question_start = shift + len(c.body)
            answer_start = question_start + len(c.question)
            needle_pos = shift + c.needle_at
            rows.append(
                (len(rows), g, k, task.kind, c.depth, c.key, c.code, needle_pos)
                + (needle_pos % task.stride, question_start, answer_start)
                + (answer_start + len(c.answer), answer_start - needle_pos, task.template)
            )
            seqs.append(p.start + p.prefix[:k] + c.body + c.question + c.answer)
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else 0
    tokens: Int[Tensor, "batch pos"] = torch.full(
        (len(seqs), max(map(len, seqs))), pad, dtype=torch.long
    )
    for i, s in enumerate(seqs):  # right padding: a causal model never attends to it
        tokens[i, : len(s)] = torch.as_tensor(s)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    answer: Int[Tensor, "batch answer"] = torch.stack(
        [tokens[r.prompt_id, r.answer_start : r.length] for r in frame.itertuples()]
    )
    return PasskeyBatch(tokens, answer, frame, task.stride)


def build_retrieval_prompts(
    tok, task: RetrievalTask, n_contents: int, seed: int = 0, bos: bool = False
) -> PasskeyBatch:
    """``n_contents`` contents (cycling through ``task.depths``), each at every shift prefix
    ``0..stride-1`` (behind BOS with ``bos``): ``tokens`` [batch, pos] (prompt + answer,
    right-padded), ``answer``
    [batch, answer], and the ``frame`` (module docstring; ``prompt_id`` is the row of
    ``tokens``). The same ``seed`` gives the same prompts."""
    if not _is_int(n_contents) or n_contents < 1:
        raise ValueError(f"n_contents={n_contents!r} is invalid: allowed: an int >= 1")
    return _build(tok, task, _prepare(tok, task, bos=bos), int(n_contents), seed)


def check_task(tok, task: RetrievalTask, max_context: int | None = None, bos: bool = False) -> None:
    """Refuse, before any model work, a task that does not fit ``max_context`` (the model's
    trained context), whose needle cannot reach every phase, or whose context is too short
    for the needle, the distractors and the question. Every error is one ``ValueError`` line."""
    if max_context is not None and task.context > max_context:
        raise _bad(
            "context",
            task.context,
            f"the model was trained to {max_context} tokens; ",
            f"{MIN_CONTEXT}..{max_context}",
        )
    p = _prepare(tok, task, max_context, bos)
    # a built probe: the phases are the shift's, unless the tokenizer shifts them otherwise
    frame = _build(tok, task, p, 1, seed=0).frame
    if sorted(frame.phase) != list(range(task.stride)):
        raise _bad(
            "stride",
            task.stride,
            f"a probe prompt's needle phases {sorted(frame.phase)} are not all distinct; ",
            "a stride the tokenizer can shift",
        )


__all__ = [
    "COLUMNS",
    "TASK_KINDS",
    "RetrievalTask",
    "TEMPLATES",
    "build_retrieval_prompts",
    "check_task",
    "exact_tails",
]
