"""``phasemech audit``: bad input fails in one line before any forward; scoring in both regimes
matches plain forwards (the end-to-end audit on the launcher is ``tests/test_probe.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.study import check_audit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(designs=("gated",)), "designs=\\('gated',\\) is invalid"),
        (dict(designs=()), "designs=\\(\\) is invalid"),
        (dict(regime="prefill"), "regime='prefill' is invalid"),
        (dict(task="qa"), "task='qa' is invalid"),
        (dict(contexts=(32,)), "contexts=\\(32,\\) is invalid"),
        (dict(contents=0), "contents=0 is invalid"),
        (dict(offsets="staggered"), "offsets='staggered' is invalid"),
        (dict(task="passkey", distractors=2), "distractors=2 is invalid"),
        (dict(designs=("kpool",), block_len=8), "block_len=8 is invalid"),
    ],
)
def test_config_refuses_bad_input(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        AuditConfig.of(**kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(contexts=(9000,)), ValueError, "trained to 8192 tokens; allowed 64..8192"),
        (dict(layers=(2, 40)), ValueError, "has 30 layers; allowed 0..29"),
        (dict(model="no-such-model"), ValueError, "model 'no-such-model' is unknown"),
        (dict(model="/nonexistent/x.gguf"), ValueError, "does not exist"),
        (dict(model="gpt2"), (ConnectionError, ValueError), "gpt2"),
    ],
)
def test_check_refuses_before_any_forward(kw, exc, match):
    """(``gpt2`` needs the hub: unreachable here, refused in seconds; where a hub is reachable
    it passes the model check and fails on its context, 1024 < 9000, not tested here.)"""
    if kw.get("model") == "gpt2":
        kw = dict(kw, contexts=(9000,))
    with pytest.raises(exc, match=match) as err:
        check_audit(AuditConfig.of(**kw))
    assert "\n" not in str(err.value)


def test_cli_bad_input_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "phasemech.cli", "audit", "--design", "gated", "-o", str(tmp_path)]
    env = dict(os.environ, COLUMNS="500")  # rich wraps at the terminal width
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert res.returncode == 1
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and "designs=('gated',) is invalid" in lines[0]


@pytest.fixture(scope="module")
def smollm():
    from phasemech.model.pretrained import load_pretrained

    return load_pretrained("smollm2-135m", n_ctx=256)


@pytest.mark.parametrize("regime", ["trained", "decode"])
def test_score_prompt_matches_plain_forwards(smollm, regime):
    """The scorer's verdict for the null equals a plain full forward's argmax (both regimes
    share the null's numbers: a dense prefill + cached rows is the dense forward)."""
    from phasemech.data.retrieval import RetrievalTask, build_retrieval_prompts
    from phasemech.experiments.probe.worker import score_prompt
    from phasemech.model.decode import prefill, read_rows

    a = AuditConfig.of(
        designs=("route",), contexts=(128,), regime=regime, layers=tuple(range(2, 30))
    )
    batch = build_retrieval_prompts(smollm.tokenizer, RetrievalTask(context=128), 1, seed=0)
    comp = PhaseTransformerFrom(smollm, a)
    rows, heads = score_prompt(smollm, [("null", smollm), ("route", comp)], batch, 2, regime, True)
    info = batch.frame.iloc[2]
    start, n = int(info.answer_start), batch.answer.shape[1]
    x = batch.tokens[2:3, : start + n - 1]
    qs = int(info.question_start)
    with torch.inference_mode():
        logits = smollm(x)[0, start - 1 :]
        if regime == "trained":  # route runs the whole prompt
            routed = comp(x)[0, start - 1 :]
        else:  # route reads the dense prefill's cache from the question on
            resid = read_rows(comp, prefill(smollm, x[:, :qs]), x[:, qs:])
            routed = comp.unembed(comp.ln_final(resid))[0, start - 1 - qs :]
    for row, lg, name in ((rows[0], logits, "null"), (rows[1], routed, "route")):
        assert row["setting"] == name
        assert row["correct"] == bool((lg.argmax(-1) == batch.answer[2]).all())
        lp = lg.log_softmax(-1).gather(-1, batch.answer[2][:, None]).sum()
        assert row["logprob"] == pytest.approx(float(lp), abs=1e-3)
    assert {r["setting"] for r in rows} == {"null", "route"}
    h = pd.DataFrame(heads)
    assert len(h) == 2 * 30 * 9 and h.mass.between(0, 1).all()
    # the null's per-head attention is the dense pattern from the answer row onto the needle
    with torch.inference_mode():
        _, cache = smollm.run_with_cache(batch.tokens[2:3, : start + n - 1],
                                         names_filter="blocks.5.attn.hook_pattern")  # fmt: skip
    ref = cache["blocks.5.attn.hook_pattern"][0, :, start - 1, int(info.needle_pos)]
    got = h[(h.setting == "null") & (h.layer == 5)].sort_values("head").mass.to_numpy()
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float32), ref.float(), atol=1e-5, rtol=0
    )


def PhaseTransformerFrom(base, a: AuditConfig):  # noqa: N802
    from phasemech.model.transformer import PhaseTransformer

    return PhaseTransformer.from_hooked(base, a.compression(a.probe.designs[0])).eval()


def test_audit_table_collects_summaries(tmp_path):
    """``analyses/audit_table.py`` turns audit folders into one markdown table."""
    row = dict(context=512, setting="route_d4_w16_k8", accuracy=0.5, acc_by_phase=[1, 0, 1, 0],
               debiased_gap=0.9, gap_lo=0.8, gap_hi=1.0, p_cochran=0.001, n=8)  # fmt: skip
    for regime in ("decode", "trained"):
        folder = tmp_path / regime
        folder.mkdir()
        summary = dict(config=dict(regime=regime), wall_s=10.0, worker_s=15.0, rows=[row])
        (folder / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "table.md"
    cmd = [sys.executable, str(ROOT / "analyses/audit_table.py"), str(tmp_path / "decode"),
           str(tmp_path / "trained"), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, timeout=120)
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| decode | 512 | route_d4_w16_k8 | 0.500 |")
    assert "1.00 / 0.00 / 1.00 / 0.00" in lines[3] and "0.900 [0.800, 1.000]" in lines[3]
    res = subprocess.run(cmd[:2] + [str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert res.returncode == 2 and "no summary.json" in res.stderr
