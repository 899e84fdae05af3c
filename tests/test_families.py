"""Every family a local folder may hold: a tiny random ``transformers`` model saved with a small
tokenizer into a temporary folder (no network), then described, loaded and compared with
``transformers``' own logits, and compressed with a grid that cannot act on a short input."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from phasemech import CompressionConfig, PhaseTransformer  # noqa: E402
from phasemech.core.config import layer_types  # noqa: E402
from phasemech.model.families import FAMILIES, lead_tokens  # noqa: E402
from phasemech.model.sources import describe, load, tokenizer  # noqa: E402

torch.set_num_threads(1)
VOCAB = 320
N_POS = 256
COMMON = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=N_POS,
    vocab_size=VOCAB,
)


def _configs() -> dict[str, object]:
    t = transformers
    kv = dict(num_key_value_heads=2)
    return {
        "gpt2": t.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=N_POS, vocab_size=VOCAB),
        "gpt_neox": t.GPTNeoXConfig(**COMMON, rotary_pct=0.25),  # partial rotary (Pythia)
        "llama": t.LlamaConfig(**COMMON, **kv),
        "mistral": t.MistralConfig(**COMMON, **kv, sliding_window=8),  # every layer slides
        "qwen2": t.Qwen2Config(  # the layers from max_window_layers on slide
            **COMMON, **kv, use_sliding_window=True, sliding_window=8, max_window_layers=1
        ),
        "qwen3": t.Qwen3Config(**COMMON, **kv, head_dim=16),  # QK-norm
        "gemma2": t.Gemma2Config(**COMMON, **kv, head_dim=16, sliding_window=8),
        "gemma3_text": t.Gemma3TextConfig(
            **COMMON,
            **kv,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),  # fmt: skip
        "phi3": t.Phi3Config(**COMMON, num_key_value_heads=4, pad_token_id=0, sliding_window=8),
        "olmo2": t.Olmo2Config(**COMMON, num_key_value_heads=4),
    }


def _tokenizer(bos: bool):
    """A byte-level BPE of a few hundred tokens, trained here (every text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["The pass code for Anna is 4127. What is the pass code?"] * 8, trainer)
    if bos:  # as Gemma's and Llama's tokenizers do
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>"
    )


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    """``(model_type, folder, the transformers model)`` for each family."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    cfg = _configs()[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(path)
    _tokenizer(bos=kind.startswith(("gemma", "llama"))).save_pretrained(path)
    return kind, path, hf


def test_every_family_is_tested():
    assert set(_configs()) == set(FAMILIES)


#: layer types as transformers runs them (its masks), per family with a sliding window
SLIDING = {
    "mistral": ("local", "local"),
    "qwen2": ("global", "local"),
    "gemma2": ("local", "global"),
    "gemma3_text": ("local", "global"),
    "phi3": ("local", "local"),
}


def test_describe_reads_the_folder(folder):
    kind, path, hf = folder
    src = describe(str(path))
    assert (src.kind, src.max_context, src.n_layers) == ("folder", N_POS, 2)
    assert src.architecture == FAMILIES[kind]
    assert src.positional == ("standard" if kind == "gpt2" else "rotary")
    assert src.layer_types == SLIDING.get(kind, ("global", "global"))
    assert src.layers("all") == (0, 1)
    if kind not in SLIDING:
        with pytest.raises(ValueError, match="has no local layers"):
            src.layers("local")


def test_loads_to_the_transformers_logits(folder):
    kind, path, hf = folder
    src = describe(str(path))
    model = load(src, n_ctx=64)
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-4, rtol=0)
    # the BOS convention is the folder tokenizer's: Gemma and Llama prompts start with BOS
    bos = kind.startswith(("gemma", "llama"))
    tok = tokenizer(src)
    assert lead_tokens(tok) == ([tok.bos_token_id] if bos else [])
    assert model.cfg.default_prepend_bos == bos == src.prepend_bos
    # the audit's fast dense path (SDPA) keeps every layer's own mask: sliding windows too
    from phasemech.model.fast import linear_layout, use_eval_sdpa

    use_eval_sdpa(model)
    linear_layout(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-4, rtol=0)


def _global_layers(model) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(layer_types(model.cfg)) if t == "global")


def test_prompts_start_as_the_tokenizer_starts_text(folder):
    """BOS-adding tokenizers (Gemma, Llama) lead every prompt with BOS; the needle still
    takes every phase, the last prompt of a group is exactly the context, and the answer
    appears verbatim at the needle."""
    from phasemech.data.retrieval import RetrievalTask, build_retrieval_prompts

    kind, path, hf = folder
    src = describe(str(path))
    # the audit worker's tokenizer: TransformerLens' copy, which itself adds BOS to any text
    tok = load(src, n_ctx=64).tokenizer
    task = RetrievalTask(context=96)
    batch = build_retrieval_prompts(tok, task, n_contents=2, bos=src.prepend_bos)
    f = batch.frame
    lead = [tok.bos_token_id] if kind.startswith(("gemma", "llama")) else []
    for r in f.itertuples():
        ids = batch.tokens[r.prompt_id].tolist()
        assert ids[: len(lead)] == lead and ids[len(lead)] != tok.bos_token_id
        n = batch.answer.shape[1]
        assert ids[r.needle_pos : r.needle_pos + n] == batch.answer[r.prompt_id].tolist()
    assert sorted(f[f.group_id == 0].phase) == [0, 1, 2, 3]
    assert f.length.max() == 96


@pytest.mark.parametrize("design", ["route", "mean", "evict"])
def test_compression_that_cannot_act_changes_nothing(folder, design):
    """A raw window longer than the input: the compressed model is the model, every layer
    (a sliding-window layer composes its window with the grid) or, for a design that does
    not compose with one (``evict``), the global layers, its sliding-window ones refused."""
    kind, path, hf = folder
    model = load(describe(str(path)), n_ctx=64)
    layers = _global_layers(model) if design == "evict" else None
    extra = {"obs_window": 2} if design == "evict" else {}
    if layers == ():  # every layer slides (Mistral, Phi-3): evict has nothing to compress
        with pytest.raises(ValueError, match="use local"):
            PhaseTransformer.from_hooked(model, CompressionConfig(design, window=48, **extra))
        return
    comp = CompressionConfig(design, stride=4, window=48, layers=layers, **extra)
    compressed = PhaseTransformer.from_hooked(model, comp).eval()
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(compressed(x), model(x), atol=1e-5, rtol=0)
    if layers is not None and len(layers) < model.cfg.n_layers:
        with pytest.raises(ValueError, match="use local"):
            PhaseTransformer.from_hooked(model, dataclasses.replace(comp, layers=None))


def test_causal_under_compression(folder):
    """A grid that acts (window 4 on 40 tokens): a token changes nothing before it."""
    kind, path, hf = folder
    model = load(describe(str(path)), n_ctx=64)
    comp = CompressionConfig("route", stride=4, window=4, top_k=1)
    compressed = PhaseTransformer.from_hooked(model, comp).eval()
    x = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[0, 25] = (x[0, 25] + 1) % VOCAB
    with torch.no_grad():
        a, b = compressed(x), compressed(y)
        assert not torch.allclose(a, model(x), atol=1e-4)  # compression acts
    torch.testing.assert_close(a[:, :25], b[:, :25], atol=0, rtol=0)
    assert not torch.allclose(a[:, 25:], b[:, 25:])


@pytest.fixture(scope="module")
def one_ray():
    """One embedded Ray for the module's audits (starting Ray costs seconds)."""
    from phasemech.experiments.ray_connect import ray_connected

    with ray_connected(None, 1):
        yield


def test_audit_end_to_end(folder, one_ray, tmp_path, monkeypatch):
    """``phasemech audit --model DIR`` at a short context: the pipeline, not the accuracy (a
    random model retrieves nothing). Every layer compressed (``--layers all``; ``mean`` and
    ``route`` compose a sliding window), the tokenizer's BOS leading every prompt."""
    import functools

    import pandas as pd
    from typer.testing import CliRunner

    import phasemech.experiments.audit.study as audit_study
    from phasemech.cli import app

    # no progress board: an actor, a fresh process importing phasemech for every launch, costs
    # several times these audits on 2 cores (a real board runs in test_launcher.py's
    # interrupted launch and in the figures pipeline)
    run_audit = functools.partial(audit_study.run_audit, progress=False)
    monkeypatch.setattr(audit_study, "run_audit", run_audit)
    kind, path, hf = folder
    out = tmp_path / "audit"
    args = ["audit", "--model", str(path), "--design", "route,mean", "--context", "96"]
    args += ["--contents", "1", "--layers", "all", "--window", "8", "-o", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    t = pd.read_parquet(out / "targets.parquet")
    assert sorted(t.setting.unique()) == ["mean_d4_w8", "null", "route_d4_w8_k8"]
    assert sorted(t.phase.unique()) == [0, 1, 2, 3]
    summary = (out / "summary.md").read_text()
    assert str(path) in summary or path.name in summary
