"""Shared tiny-model factories. Everything here is small enough for a 2-core CPU."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from threadpoolctl import threadpool_limits

from phasemech import CompressionConfig, PhaseTransformer, PhaseTransformerConfig
from phasemech.core.config import DESIGNS as ALL_DESIGNS
from phasemech.model.transformer import quiet_tl_deprecation

# one CPU thread per process (the suite runs a process per core): torch and BLAS here, and
# through the environment in every process a test starts (scripts, Ray workers)
torch.set_num_threads(1)
threadpool_limits(1)
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

#: every compressed design (``evict`` has its own tests: its observation scores are slow here)
DESIGNS = tuple(d for d in ALL_DESIGNS if d not in ("none", "evict"))
EXACT_DESIGNS = ("mean", "gated", "route", "quest", "kpool", "dsa", "partition")
D_VOCAB = 37
N_CTX = 48


def tl_fields(
    *,
    n_layers: int = 2,
    d_model: int = 32,
    n_heads: int = 4,
    d_head: int = 8,
    n_ctx: int = N_CTX,
    d_vocab: int = D_VOCAB,
    attn_only: bool = True,
    rotary: bool = False,
    gqa: bool = False,
    seed: int = 0,
    **extra,
) -> dict:
    """Keyword arguments of a tiny ``HookedTransformerConfig``."""
    fields = dict(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_head,
        n_ctx=n_ctx,
        d_vocab=d_vocab,
        attn_only=attn_only,
        act_fn=None if attn_only else "gelu",
        d_mlp=None if attn_only else 2 * d_model,
        seed=seed,
        normalization_type="LN",
        device="cpu",  # the tested default: the CPU even where CUDA is present
    )
    if rotary:
        fields.update(positional_embedding_type="rotary", rotary_dim=d_head)
    if gqa:
        fields.update(n_key_value_heads=2)
    fields.update(extra)
    return fields


def make_config(compression: CompressionConfig | None = None, **kw) -> PhaseTransformerConfig:
    comp = compression if compression is not None else CompressionConfig("none")
    return PhaseTransformerConfig(**tl_fields(**kw), compression=comp)


def make_model(
    design: str = "mean", compression: CompressionConfig | None = None, **kw
) -> PhaseTransformer:
    """A tiny ``PhaseTransformer`` in eval mode. ``kw``: ``tl_fields`` options, or
    ``CompressionConfig`` fields when no ``compression`` is given."""
    comp_keys = {f.name for f in dataclasses.fields(CompressionConfig)} - {"design"}
    comp_kw = {k: kw.pop(k) for k in list(kw) if k in comp_keys}
    if design in ("kpool", "dsa", "hca"):  # disjoint pools: a shared overlap does not apply
        comp_kw.pop("block_len", None)
    if design == "csa" and "block_len" in comp_kw:  # a whole number of projection series
        d = comp_kw.get("stride", 4)
        comp_kw["block_len"] = -(-comp_kw["block_len"] // d) * d
    if compression is None:
        compression = CompressionConfig(design, **comp_kw)
    elif comp_kw:
        raise TypeError("give either compression= or its fields, not both")
    with quiet_tl_deprecation():
        model = PhaseTransformer(make_config(compression, **kw))
    model.eval()
    return model


def make_hooked(**kw):
    """A plain TransformerLens ``HookedTransformer`` with the same tiny config."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    with quiet_tl_deprecation():
        model = HookedTransformer(HookedTransformerConfig(**tl_fields(**kw)))
    model.eval()
    return model


#: parameters that start at zero or small (pooling starts as the mean): randomised in tests
GATE_PARAMS = ("phase_bias", "W_gate", "W_branch", "b_branch", "pool_bias", "W_z_", "B_K", "B_V")


def randomize_compressors(model: PhaseTransformer, seed: int = 0, scale: float = 0.5) -> None:
    """Give compressor parameters non-trivial values (gated and mlp start at mean pooling)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in GATE_PARAMS):
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            elif name.endswith((".P_K", ".P_V")):  # csa/hca series projections start at I
                p.add_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
            elif ".compress_" in name and ".2." in name:  # mlp starts as the block mean
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)


def full_window_scope(design: str) -> dict:
    """``csa``/``hca`` read their blocks inside the window too by default (DeepSeek-V4): the
    scope under which a window covering the sequence leaves the model dense."""
    return {"block_scope": "outside_window"} if design in ("csa", "hca") else {}


def one_branch(model: PhaseTransformer, branch: int) -> None:
    """``nsa``: gates of ~1 on ``branch`` (0 cmp, 1 slc, 2 win) and ~0 on the others, at every
    compressed layer and head (sigmoid(100) is 1 in float32)."""
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block.attn, "b_branch"):
                block.attn.W_branch.zero_()
                block.attn.b_branch.fill_(-100.0)
                block.attn.b_branch[:, branch] = 100.0


def tokens(batch: int = 2, seq: int = 24, seed: int = 0, d_vocab: int = D_VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, d_vocab, (batch, seq), generator=gen)


@pytest.fixture
def toks() -> torch.Tensor:
    return tokens()


@pytest.fixture(scope="module")
def embedded_ray():
    """One embedded Ray for a module's launches, started as the launcher starts its own (token
    authentication with a session token, a small object store), with one CPU: a launch finds
    Ray up and uses it as it is, so every test of the module reuses the same warm worker.
    Starting Ray, then importing torch and phasemech in a fresh worker, costs more than a tiny
    profile's jobs on 2 cores; the worker sets one torch thread per job."""
    from phasemech.experiments.ray_connect import ray_connected

    with ray_connected(None, 1):
        yield


def raises_naming(field: str, value, **kwargs) -> str:
    """``CompressionConfig(**kwargs)`` raises a ValueError naming ``field`` and ``value``."""
    with pytest.raises(ValueError) as info:
        CompressionConfig(**kwargs)
    msg = str(info.value)
    assert field in msg, msg
    assert repr(value) in msg or str(value) in msg, msg
    return msg
