"""The model families a local Hugging Face folder may hold, as TransformerLens converts them.

Axes: none (configs and state dicts).

A folder's ``config.json`` names its family (``model_type``). TransformerLens builds a
``HookedTransformerConfig`` from a local config for most families, keyed by architecture
(:func:`transformer_lens.loading_from_pretrained.convert_hf_model_config`); for Gemma-2,
Gemma-3 and OLMo-2 it knows only the hub's named checkpoints, and its GPT-2 entry reads a field
that ``transformers`` 5 dropped (``n_ctx``). For those four, :data:`OWN_CONFIGS` builds the same
dict from the folder's config, field for field as TransformerLens' named entries lay it out.
The weights always go through TransformerLens' own per-architecture conversion
(``get_pretrained_state_dict`` given the loaded ``transformers`` model): nothing is converted
twice, and nothing is downloaded.

TransformerLens picks some architectures by the *name* it is given (a path containing
``llama`` or ``gemma`` takes the hub's named branches), so it is given a neutral one: the
config saved alone in a temporary folder named ``model``.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

#: ``model_type`` -> the architecture TransformerLens converts
FAMILIES: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


def trained_context(hf_cfg: Any) -> int:
    """The context the model was trained for (``n_positions`` for GPT-2)."""
    n = getattr(hf_cfg, "max_position_embeddings", None) or getattr(hf_cfg, "n_positions", None)
    if not n:
        raise ValueError(f"{hf_cfg.model_type} config names no trained context")
    return int(n)


def _rope_theta(hf_cfg: Any, default: float = 10000.0) -> float:
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per-layer-type rope (Gemma-3): the global layers' base
        rope = rope["full_attention"] or {}
    return float(rope.get("rope_theta", getattr(hf_cfg, "rope_theta", default)))


def _gpt2(c: Any) -> dict:
    return {
        "d_model": c.n_embd,
        "d_head": c.n_embd // c.n_head,
        "n_heads": c.n_head,
        "d_mlp": c.n_inner or 4 * c.n_embd,
        "n_layers": c.n_layer,
        "n_ctx": c.n_positions,
        "eps": c.layer_norm_epsilon,
        "d_vocab": c.vocab_size,
        "act_fn": c.activation_function,
        "use_attn_scale": getattr(c, "scale_attn_weights", True),
        "use_local_attn": False,
        "scale_attn_by_inverse_layer_idx": c.scale_attn_by_inverse_layer_idx,
        "normalization_type": "LN",
    }


def _gemma(c: Any) -> dict:
    """Gemma-2 and Gemma-3 (text): local (sliding) and global layers, pre- and post-norms."""
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    out = {
        "d_model": c.hidden_size,
        "d_head": c.head_dim,
        "n_heads": c.num_attention_heads,
        "n_key_value_heads": c.num_key_value_heads,
        "d_mlp": c.intermediate_size,
        "n_layers": c.num_hidden_layers,
        "n_ctx": c.max_position_embeddings,
        "eps": c.rms_norm_eps,
        "d_vocab": c.vocab_size,
        "act_fn": c.hidden_activation,
        "initializer_range": c.initializer_range,
        "normalization_type": "RMS",
        "rotary_base": _rope_theta(c),
        "positional_embedding_type": "rotary",
        "use_attn_scale": True,
        "attn_scale": float(c.query_pre_attn_scalar) ** 0.5,
        "gated_mlp": True,
        "final_rms": True,
        "use_normalization_before_and_after": True,
        "attn_types": ["local" if t == "sliding_attention" else "global" for t in types],
        "use_local_attn": "sliding_attention" in types,
        "window_size": c.sliding_window,
    }
    for hf_name, tl_name in (
        ("attn_logit_softcapping", "attn_scores_soft_cap"),
        ("final_logit_softcapping", "output_logits_soft_cap"),
    ):
        if getattr(c, hf_name, None):
            out[tl_name] = float(getattr(c, hf_name))
    if c.model_type == "gemma3_text":
        out["use_qk_norm"] = True
        rope = getattr(c, "rope_parameters", None) or {}
        local = rope.get("sliding_attention") or {}
        out["rotary_base_local"] = float(local.get("rope_theta", 10000.0))
        full = rope.get("full_attention") or {}
        kind = full.get("rope_type", "default")
        if kind == "linear":  # the larger Gemma-3s: global layers' positions scaled
            out["rotary_scaling_factor"] = float(full["factor"])
        elif kind != "default":
            raise ValueError(
                f"rope_type={kind!r} is invalid for a Gemma-3 folder's global layers: "
                "allowed default or linear (TransformerLens' Gemma-3 rotary)"
            )
    return out


def _olmo2(c: Any) -> dict:
    if c.num_key_value_heads != c.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={c.num_key_value_heads} is invalid for an OLMo-2 folder: "
            "TransformerLens' OLMo-2 conversion takes full K/V heads only "
            f"({c.num_attention_heads})"
        )
    return {
        "d_model": c.hidden_size,
        "d_head": c.hidden_size // c.num_attention_heads,
        "n_heads": c.num_attention_heads,
        "d_mlp": c.intermediate_size,
        "n_layers": c.num_hidden_layers,
        "n_ctx": c.max_position_embeddings,
        "eps": c.rms_norm_eps,
        "d_vocab": c.vocab_size,
        "act_fn": c.hidden_act,
        "initializer_range": c.initializer_range,
        "normalization_type": "RMS",
        "rotary_base": _rope_theta(c, 500000.0),
        "attn_types": ["global"] * c.num_hidden_layers,
        "positional_embedding_type": "rotary",
        "gated_mlp": True,
    }


def _windows(c: Any) -> dict:
    """Which layers slide (``local``) and over how many keys, as ``transformers`` runs them:
    per ``layer_types`` where the config has them (Gemma, Qwen with ``use_sliding_window``),
    every layer for Mistral and Phi-3 with a ``sliding_window``; ``{}`` for global-only
    models. (TransformerLens' own Qwen and Phi-3 entries leave the window out.)"""
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if not window or window >= trained_context(c):  # a window that never binds is global
        return {}
    if types is None and c.model_type in ("mistral", "phi3"):
        types = ["sliding_attention"] * c.num_hidden_layers
    if not types or "sliding_attention" not in types:
        return {}
    local = ["local" if t == "sliding_attention" else "global" for t in types]
    return {"use_local_attn": True, "window_size": int(window), "attn_types": local}


#: families whose config TransformerLens cannot build from a local folder: built here
OWN_CONFIGS: dict[str, Callable[[Any], dict]] = {
    "gpt2": _gpt2,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "olmo2": _olmo2,
}


def family(hf_cfg: Any, spec: str) -> str:
    """The folder's architecture, or a one-line ``ValueError`` naming the families taken."""
    if hf_cfg.model_type not in FAMILIES:
        raise ValueError(
            f"model {spec!r} is a {hf_cfg.model_type!r} model: a local folder must hold one of "
            f"the families TransformerLens converts ({', '.join(FAMILIES)})"
        )
    return FAMILIES[hf_cfg.model_type]


@contextlib.contextmanager
def _config_dir(hf_cfg: Any) -> Iterator[str]:
    """The config alone, saved in a temporary folder named ``model`` (see the module
    docstring; a GGUF file has no ``config.json`` of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        if any(name in str(path).lower() for name in ("llama", "gemma")):
            raise ValueError(
                f"the temporary folder {tmp!r} names a model family, which TransformerLens "
                "would read as a hub name: set TMPDIR to a neutral folder"
            )
        cfg = copy.deepcopy(hf_cfg)
        if not getattr(cfg, "architectures", None):  # a config read from GGUF names none
            cfg.architectures = [FAMILIES[cfg.model_type]]
        cfg.save_pretrained(path)
        yield str(path)


def tl_config(
    hf_cfg: Any, n_ctx: int, prepend_bos: bool = False, spec: str = ""
) -> HookedTransformerConfig:
    """The ``HookedTransformerConfig`` of a ``transformers`` config, allocating ``n_ctx``
    positions, in float32 on the CPU, weights unfolded (hooks show the model as it is)."""
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    arch = family(hf_cfg, spec)
    if hf_cfg.model_type in OWN_CONFIGS:
        cfg = OWN_CONFIGS[hf_cfg.model_type](hf_cfg)
    else:
        with _config_dir(hf_cfg) as path:
            cfg = convert_hf_model_config(path)
    cfg.update(_windows(hf_cfg))
    cfg.update(
        original_architecture=arch,
        model_name=spec or hf_cfg.model_type,
        tokenizer_name=None,  # the folder's tokenizer is passed in, never fetched by name
        d_vocab=hf_cfg.vocab_size,
        n_ctx=n_ctx,
        init_weights=False,
        device="cpu",
        dtype=torch.float32,
        default_prepend_bos=prepend_bos,
    )
    cfg.pop("quantization_method", None)
    return HookedTransformerConfig.from_dict(cfg)


def tl_state_dict(cfg: HookedTransformerConfig, hf: Any) -> dict[str, torch.Tensor]:
    """A loaded ``transformers`` model's weights in TransformerLens' names, by
    TransformerLens' own conversion for ``cfg.original_architecture``."""
    from transformer_lens.loading_from_pretrained import get_pretrained_state_dict

    with _config_dir(hf.config) as path:
        return get_pretrained_state_dict(path, cfg, hf, dtype=torch.float32)


def hooked_model(hf: Any, tok: Any, n_ctx: int, spec: str = "") -> HookedTransformer:
    """A loaded ``transformers`` model of any family here as a ``HookedTransformer`` in eval
    mode (weights not folded or centred: hooks and logits are the model's own)."""
    from phasemech.model.pretrained import unfolded

    cfg = tl_config(hf.config, n_ctx, prepends_bos(tok), spec)
    return unfolded(cfg, tok, tl_state_dict(cfg, hf))


def lead_tokens(tok: Any) -> list[int]:
    """The tokens the tokenizer puts in front of any text (its BOS, where it adds one):
    prompts start with them, as the model saw text in training."""
    bare = tok.encode("a", add_special_tokens=False)
    full = tok.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return list(full[:i])
    return []


def prepends_bos(tok: Any) -> bool:
    return tok is not None and tok.bos_token_id is not None and bool(lead_tokens(tok))


__all__ = [
    "FAMILIES",
    "OWN_CONFIGS",
    "family",
    "hooked_model",
    "lead_tokens",
    "tl_config",
    "tl_state_dict",
    "trained_context",
]
