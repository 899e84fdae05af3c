"""Validation of CompressionConfig / PhaseTransformerConfig / model inputs, and phase_of."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import D_VOCAB, N_CTX, make_config, make_model
from conftest import raises_naming as _raises

from phasemech import CompressionConfig, phase_of
from phasemech.core.config import DEFAULT_TOP_K


@pytest.mark.parametrize("stride", [0, -1, 2.0, "4", True, None])
def test_bad_stride(stride):
    _raises("stride", stride, design="mean", stride=stride)


@pytest.mark.parametrize(("stride", "block_len"), [(4, 3), (4, 1), (3, 0), (4, 5.0), (2, "3")])
def test_bad_block_len(stride, block_len):
    msg = _raises("block_len", block_len, design="mean", stride=stride, block_len=block_len)
    assert f"stride ({stride})" in msg


@pytest.mark.parametrize("window", [-1, -10, 2.5, "8"])
def test_bad_window(window):
    _raises("window", window, design="mean", window=window)


@pytest.mark.parametrize("visibility", ["Inclusive", "loose", "", None])
def test_bad_visibility(visibility):
    _raises("visibility", visibility, design="mean", visibility=visibility)


@pytest.mark.parametrize("design", ["Mean", "max", "", None, "moba"])
def test_bad_design(design):
    _raises("design", design, design=design)


@pytest.mark.parametrize(
    ("stride", "offsets"),
    [(4, 4), (4, -1), (4, (0, 4)), (3, ((0, 1), (2, 3))), (2, (5,)), (4, torch.tensor([0, 7]))],
)
def test_offsets_out_of_range(stride, offsets):
    with pytest.raises(ValueError) as info:
        CompressionConfig("mean", stride=stride, offsets=offsets)
    msg = str(info.value)
    assert "offsets" in msg and f"stride={stride}" in msg, msg


@pytest.mark.parametrize(
    "offsets", ["random_per_head", "Aligned", "", (), ((0, 1), (1,)), (0.5,), [[0], 1]]
)
def test_bad_offsets_mode(offsets):
    with pytest.raises(ValueError) as info:
        CompressionConfig("mean", stride=4, offsets=offsets)
    msg = str(info.value)
    assert "offsets" in msg
    assert repr(offsets) in msg or str(offsets) in msg, msg


@pytest.mark.parametrize("design", ["none", "mean", "gated", "mlp"])
def test_top_k_needs_route(design):
    msg = _raises("top_k", 2, design=design, top_k=2)
    assert design in msg


@pytest.mark.parametrize("top_k", [0, -3, 1.5])
def test_route_bad_top_k(top_k):
    _raises("top_k", top_k, design="route", top_k=top_k)


@pytest.mark.parametrize("design", ["none", "mean", "mlp", "route"])
def test_channel_gate_needs_gated(design):
    msg = _raises("gate", "channel", design=design, gate="channel")
    assert design in msg


def test_bad_gate_name():
    _raises("gate", "vector", design="gated", gate="vector")


@pytest.mark.parametrize("offsets", ["aligned", "per_layer", "per_head", 1, (0, 1)])
def test_eval_offset_needs_random(offsets):
    msg = _raises("eval_offset", 1, design="mean", stride=4, offsets=offsets, eval_offset=1)
    assert "random" in msg


@pytest.mark.parametrize("eval_offset", [4, -1, 1.0])
def test_eval_offset_range(eval_offset):
    _raises(
        "eval_offset",
        eval_offset,
        design="mean",
        stride=4,
        offsets="random",
        eval_offset=eval_offset,
    )


@pytest.mark.parametrize("layers", [(0, 0), (1, 2, 1), (-1,), (0, -2), (), (0.0,)])
def test_bad_layers(layers):
    _raises("layers", layers, design="mean", layers=layers)


def test_defaults_resolve():
    c = CompressionConfig("mean", stride=5)
    assert (c.block_len, c.window, c.top_k, c.offsets, c.layers) == (5, 10, None, "aligned", None)
    r = CompressionConfig("route", stride=3)
    assert r.top_k == DEFAULT_TOP_K == 2
    assert r.block_len == 3 and r.window == 6
    assert CompressionConfig("mean", stride=4, window=0).window == 0
    assert CompressionConfig("mean", stride=2, layers=[1, 0]).layers == (0, 1)
    n = CompressionConfig("none")
    assert not n.enabled and n.compressed_layers(3) == []
    assert CompressionConfig("mean", layers=(1,)).compressed_layers(3) == [1]


def test_numpy_ints_accepted():
    c = CompressionConfig("mean", stride=np.int64(4), block_len=np.int32(6), window=np.int64(0))
    assert (c.stride, c.block_len, c.window) == (4, 6, 0)
    assert all(type(x) is int for x in (c.stride, c.block_len, c.window))


def test_explicit_offsets_tensor_become_tuples():
    c = CompressionConfig("mean", stride=4, offsets=torch.tensor([0, 3]))
    assert c.offsets == (0, 3) and all(type(o) is int for o in c.offsets)
    c2 = CompressionConfig("mean", stride=4, offsets=torch.tensor([[0, 1], [2, 3]]))
    assert c2.offsets == ((0, 1), (2, 3))
    c3 = CompressionConfig("mean", stride=4, offsets=np.array([1, 2]))
    assert c3.offsets == (1, 2)
    assert CompressionConfig("mean", stride=4, offsets=torch.tensor(2)).offsets == 2
    assert CompressionConfig("mean", stride=4, offsets=[[1, 0], [0, 1]]).offsets == (
        (1, 0),
        (0, 1),
    )
    hash(c2)  # frozen config stays hashable


def test_dict_roundtrip():
    c = CompressionConfig(
        "route",
        stride=3,
        block_len=5,
        window=0,
        offsets=((0, 1), (2, 0)),
        layers=(0, 1),
        top_k=3,
        visibility="strict",
    )
    assert CompressionConfig.from_dict(c.to_dict()) == c
    import json

    assert CompressionConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_base_offsets():
    c = CompressionConfig("mean", stride=4, offsets="per_head")
    assert c.base_offsets(2, 4).tolist() == [[0, 1, 2, 3]] * 2
    c = CompressionConfig("mean", stride=4, offsets="per_layer", layers=(1, 2))
    assert c.base_offsets(3, 2).tolist() == [[0, 0], [0, 0], [2, 2]]
    # both staggers summed mod d: layer 2 (offset 2) + head 1 of 2 (offset 2) wraps to 0
    c = CompressionConfig("mean", stride=4, offsets="per_layer_head", layers=(1, 2))
    assert c.base_offsets(3, 2).tolist() == [[0, 2], [0, 2], [2, 0]]
    c = CompressionConfig("mean", stride=4, offsets=3)
    assert (c.base_offsets(2, 2) == 3).all()
    c = CompressionConfig("mean", stride=4, offsets=((0, 1), (2, 3)))
    assert c.base_offsets(2, 2).tolist() == [[0, 1], [2, 3]]


# ----------------------------------------------------------------- PhaseTransformerConfig
def test_layers_beyond_n_layers():
    with pytest.raises(ValueError, match=r"layers=\(0, 2\).*\[2\]"):
        make_config(CompressionConfig("mean", layers=(0, 2)), n_layers=2)


@pytest.mark.parametrize(
    "offsets", [(0, 1, 2), ((0, 1),), ((0, 1, 2), (0, 1, 2)), ((0,), (1,)), (0, 1, 2, 3, 0)]
)
def test_explicit_offsets_wrong_shape(offsets):
    comp = CompressionConfig("mean", stride=4, offsets=offsets)
    with pytest.raises(ValueError, match=re.escape(str(np.shape(offsets)))) as info:
        make_config(comp, n_layers=2, n_heads=4, gqa=True)  # 2 kv heads
    assert "offsets" in str(info.value)


def test_explicit_offsets_right_shape():
    make_config(CompressionConfig("mean", stride=4, offsets=(0, 3)), n_layers=2, gqa=True)
    make_config(CompressionConfig("mean", stride=4, offsets=((0, 3), (1, 2))), gqa=True)
    make_config(CompressionConfig("mean", stride=4, offsets=(0, 1, 2, 3)), n_heads=4)


def test_compression_dict_accepted_and_bad_type_rejected():
    cfg = make_config(CompressionConfig("gated", stride=3).to_dict())
    assert cfg.compression == CompressionConfig("gated", stride=3)
    with pytest.raises(ValueError, match="compression"):
        make_config("mean")


@pytest.mark.parametrize(
    ("comp", "n_ctx", "pattern"),
    [
        (CompressionConfig("mean", stride=8, window=2), 6, r"stride=8.*n_ctx=6.*no chunk"),
        (CompressionConfig("route", stride=8, window=0), 7, r"stride=8.*n_ctx=7"),
        # strict: the chunk closing at the last position is never visible to a later query
        (CompressionConfig("mean", stride=16, window=0, visibility="strict"), 16, "no chunk"),
        (CompressionConfig("mean", stride=4, window=16), 16, r"window=16.*n_ctx=16.*raw window"),
        (CompressionConfig("evict", stride=2, window=40), 24, r"window=40.*n_ctx=24"),
        (CompressionConfig("gated", stride=4), 8, r"window=8.*n_ctx=8"),  # default 2*stride
        # the last query has blocks ending 3 and 7 to rank: top_k = 2 keeps every one
        (CompressionConfig("route", stride=4, window=8), 16, r"top_k=2.*at most 2 block"),
        (CompressionConfig("route", stride=4, window=12, top_k=1), 16, r"smaller window"),
        (
            CompressionConfig("evict", stride=4, window=4, top_k=3),
            16,
            r"top_k=3.*allowed top_k < 3",
        ),
    ],
)
def test_compression_that_cannot_act_is_refused(comp, n_ctx, pattern):
    """Such a model would silently be the dense one: refused at construction."""
    with pytest.raises(ValueError, match=pattern):
        make_config(comp, n_ctx=n_ctx)


@pytest.mark.parametrize(
    "comp",
    [
        CompressionConfig("mean", stride=4, window=15),
        CompressionConfig("mean", stride=16, window=0),  # inclusive: query 15 reads its chunk
        CompressionConfig("mean", stride=4, window=16, block_scope="all"),
        CompressionConfig("mean", stride=15, window=0, visibility="strict"),
        CompressionConfig("mean", stride=20, window=0, offsets=(0, 0, 0, 5)),  # a partial chunk
        CompressionConfig("mean", stride=20, window=0, offsets="random", eval_offset=6),
        CompressionConfig("route", stride=4, window=8, top_k=1),
        CompressionConfig("evict", stride=4, window=4, top_k=2),
    ],
    ids=str,
)
def test_compression_guard_is_tight(comp):
    """Just inside the guard the compressed model really differs from the dense one."""
    x = torch.randint(0, D_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    dense = make_model("none", n_ctx=16)
    model = make_model(compression=comp, n_ctx=16)
    model.load_state_dict(dense.state_dict(), strict=False)
    assert not torch.allclose(model(x), dense(x), atol=1e-4)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"attention_dir": "bidirectional"}, "attention_dir"),
        ({"positional_embedding_type": "alibi"}, "positional_embedding_type"),
    ],
)
def test_unsupported_tl_options(extra, field):
    with pytest.raises(ValueError, match=field):
        make_config(CompressionConfig("mean"), **extra)
    make_config(CompressionConfig("none"), **extra)  # dense models keep TL's options


# ----------------------------------------------------------------- model inputs
@pytest.fixture(scope="module")
def model():
    return make_model("mean", stride=3)


def _no_forward(model, monkeypatch):
    """Fail if any attention layer runs: validation must come before work."""

    def boom(*a, **k):
        raise AssertionError("attention ran before validation")

    for block in model.blocks:
        monkeypatch.setattr(block.attn, "forward", boom)


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        (torch.zeros(1, N_CTX + 1, dtype=torch.long), f"n_ctx={N_CTX}"),
        (torch.zeros(1, 5), "dtype"),
        (torch.zeros(1, 5, dtype=torch.bool), "dtype"),
        (torch.full((1, 5), D_VOCAB), f"{D_VOCAB - 1}"),
        (torch.full((1, 5), -1), "-1"),
        (torch.zeros(1, 2, 5, dtype=torch.long), r"\(1, 2, 5\)"),
        (torch.zeros(0, 5, dtype=torch.long), r"\(0, 5\).*at least one sequence"),
        (torch.zeros(2, 0, dtype=torch.long), r"\(2, 0\).*one position"),
    ],
)
def test_bad_tokens_raise_before_work(model, monkeypatch, bad, pattern):
    _no_forward(model, monkeypatch)
    with pytest.raises(ValueError, match=pattern):
        model(bad)
    with pytest.raises(ValueError, match=pattern):
        model.run_with_cache(bad)


@pytest.mark.parametrize(
    ("mask", "pattern"),
    [
        (torch.ones(2, 5), "float32.*0/1"),
        (torch.full((2, 5), 2), r"\[2\].*0 and 1"),
        (torch.tensor([[1, 1, -1, 1, 1]] * 2), r"\[-1\]"),
        (torch.ones(2, 4, dtype=torch.long), r"\(2, 4\).*\(2, 5\)"),
        ([[1] * 5] * 2, "list"),
        (torch.tensor(1), r"shape \(\)"),
    ],
)
def test_bad_attention_mask_raises_before_work(model, monkeypatch, mask, pattern):
    _no_forward(model, monkeypatch)
    x = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=pattern):
        model(x, attention_mask=mask)


def test_good_attention_masks(model):
    x = torch.randint(0, D_VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    ints = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]])
    torch.testing.assert_close(model(x, attention_mask=ints), model(x, attention_mask=ints.bool()))
    assert model(x[0], attention_mask=ints[:1]).shape == (1, 6, D_VOCAB)
    with pytest.raises(ValueError, match=r"shape \(6,\): expected \(1, 6\)"):
        model(x[0], attention_mask=ints[0])  # 1-D tokens run as [1, pos]


def test_good_tokens_1d_and_full_context(model):
    assert model(torch.zeros(N_CTX, dtype=torch.long)).shape == (1, N_CTX, D_VOCAB)
    assert model(torch.full((2, 3), D_VOCAB - 1)).shape == (2, 3, D_VOCAB)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(use_attention_sinks=True), "use_attention_sinks"),
        (dict(use_logn_attn=True), "use_logn_attn"),
    ],
)
def test_tl_features_the_compressed_forward_does_not_reproduce_are_rejected(kwargs, name):
    # refused at config construction, before any model is built
    with pytest.raises(ValueError, match=name):
        make_config(CompressionConfig("mean"), **kwargs)
    make_config(CompressionConfig("none"), **kwargs)  # dense models keep them


def test_sliding_window_layers_compress_with_the_designs_that_compose():
    local = dict(use_local_attn=True, window_size=4, attn_types=["global", "local"])
    make_config(CompressionConfig("mean"), **local)
    make_config(CompressionConfig("route"), **local)
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] use local .*global layers \[0\]"):
        make_config(CompressionConfig("evict"), **local)
    make_config(CompressionConfig("evict", layers=(0,)), **local)


def test_layers_and_compression_dict_errors_are_value_errors():
    with pytest.raises(ValueError, match="layers"):
        CompressionConfig("mean", layers=1)
    with pytest.raises(ValueError, match="foo"):
        make_config({"design": "mean", "foo": 1})
    with pytest.raises(ValueError, match="design"):
        make_config({"stride": 2})
    with pytest.raises(ValueError, match="block_scope"):
        CompressionConfig("mean", block_scope="some")


# ----------------------------------------------------------------- phase_of
def test_phase_of_ints():
    assert [phase_of(j, 4) for j in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [phase_of(j, 4, 1) for j in range(5)] == [3, 0, 1, 2, 3]
    assert phase_of(-1, 4) == 3 and phase_of(-5, 4, 2) == 1
    assert phase_of(np.int64(7), 3) == 1
    assert type(phase_of(np.int64(7), 3)) is int
    assert phase_of(5, 1) == 0


def test_phase_of_numpy_and_torch():
    pos = np.arange(-6, 7)
    np.testing.assert_array_equal(phase_of(pos, 4, 1), np.mod(pos - 1, 4))
    assert phase_of(pos, 4).min() >= 0
    tpos = torch.arange(-6, 7)
    assert torch.equal(phase_of(tpos, 4, 1), torch.remainder(tpos - 1, 4))
    # broadcasting positions against per-head offsets
    out = phase_of(torch.arange(8)[None, :], 4, torch.tensor([[0], [1], [3]]))
    assert out.shape == (3, 8)
    assert out[2].tolist() == [1, 2, 3, 0, 1, 2, 3, 0]
    outn = phase_of(np.arange(8)[None, :], 4, np.array([[0], [2]]))
    assert outn[1].tolist() == [2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("stride", [0, -2, 2.0, True, "4", None])
def test_phase_of_bad_stride(stride):
    with pytest.raises(ValueError, match="stride"):
        phase_of(3, stride)


@pytest.mark.parametrize("pos", [1.5, torch.tensor([1.0]), np.array([0.5]), "3", True])
def test_phase_of_bad_pos(pos):
    with pytest.raises(ValueError, match="pos"):
        phase_of(pos, 4)
