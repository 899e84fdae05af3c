"""The two regimes a compression design is audited in, as exact teacher-forced forwards.

Axes: ``batch, pos`` (the prefill), ``new`` (the rows read after it), ``d_model``.

* ``trained``: every query reads the compressed history, as trained-in sparse attention does
  (NSA, MoBA, DeepSeek-V4, GLM-5.3's indexer): one ordinary forward of the compressed model.
* ``decode``: the document is prefilled with full attention into a KV cache; only the rows
  after it (the question and the answer) read the compressed cache, as decode-time KV
  compression serves (Quest, ChunkKV, SnapKV-style eviction). :func:`prefill` runs the
  uncompressed model once; the cache it returns is frozen, so the null model and any number
  of compressed settings read the same prefill (:func:`read_rows`). Each compressed layer
  computes only the new rows (``CompressedAttentionMixin._forward_cached``).

Teacher forcing is exact in both: the rows after the prefill are causal among themselves, so
one forward over all of them gives what step-by-step generation gives (tested).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import HookedTransformer
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from phasemech.core.designs import REGIMES


def check_regime(regime: str) -> str:
    if regime not in REGIMES:
        raise ValueError(f"regime={regime!r} is invalid: allowed {REGIMES}")
    return regime


@torch.inference_mode()
def prefill(
    model: HookedTransformer, tokens: Int[Tensor, "batch pos"], keep_queries: int = 0
) -> TransformerLensKeyValueCache:
    """The frozen KV cache of ``model`` (uncompressed) over ``tokens``, keeping each layer's
    last ``keep_queries`` post-RoPE queries (``evict`` observes recent queries)."""
    cfg = model.cfg
    cache = TransformerLensKeyValueCache.init_cache(cfg, cfg.device, tokens.shape[0])
    queries: dict[int, Tensor] = {}

    def keep(q: Tensor, hook) -> None:
        queries[int(hook.name.split(".")[1])] = q[:, -keep_queries:].clone()

    hooks = []
    if keep_queries:
        name = "hook_rot_q" if cfg.positional_embedding_type == "rotary" else "hook_q"
        hooks = [(f"blocks.{i}.attn.{name}", keep) for i in range(cfg.n_layers)]
    mask = torch.ones_like(tokens)
    with model.hooks(fwd_hooks=hooks):
        model(tokens, past_kv_cache=cache, attention_mask=mask, stop_at_layer=cfg.n_layers)
    for i, entry in enumerate(cache.entries):
        if i in queries:
            entry.past_queries = queries[i]
    cache.freeze()
    return cache


def needed_queries(model: HookedTransformer) -> int:
    """How many prefill queries the model's compressed layers read (0 unless ``evict``)."""
    return max((getattr(b.attn, "cached_queries", 0) for b in model.blocks), default=0)


@torch.inference_mode()
def read_rows(
    model: HookedTransformer, cache: TransformerLensKeyValueCache, tokens: Int[Tensor, "batch new"]
) -> Float[Tensor, "batch new d_model"]:
    """The residual stream after the last block at the rows after the prefill (the caller
    picks the rows it unembeds). A frozen cache is left as it was."""
    past = cache.entries[0].past_keys.shape[1]
    mask = torch.ones(tokens.shape[0], past + tokens.shape[1], dtype=torch.long)
    mask = mask.to(tokens.device)
    # TL appends the new rows' mask to the cache's own; pass the new rows' part only
    return model(
        tokens,
        past_kv_cache=cache,
        attention_mask=mask[:, past:],
        stop_at_layer=model.cfg.n_layers,
    )


__all__ = ["REGIMES", "check_regime", "needed_queries", "prefill", "read_rows"]
