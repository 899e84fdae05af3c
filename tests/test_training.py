"""Gradients, learning, determinism, random offsets and grid shifts."""

from __future__ import annotations

import pytest
import torch
from conftest import DESIGNS, make_model, randomize_compressors, tokens

COMPRESSOR_PARAMS = {
    "gated": ("W_gate", "phase_bias"),
    "mlp": ("compress_k", "compress_v", "pos_embed_k", "pos_embed_v"),
    "mean": (),
    "route": (),
    "quest": (),
    "kpool": (),
    "nsa": (
        "compress_k",
        "compress_v",
        "pos_embed_k",
        "pos_embed_v",
        "W_branch",
        "b_branch",
        "W_K_branch",
        "W_V_branch",
    ),
    "dsa": ("W_iq", "W_ik", "W_iw", "W_ig", "pool_bias"),  # through the indexer's KL term
    "csa": ("P_K", "P_V", "W_z_K", "W_z_V", "B_K", "B_V", "w_K", "w_V"),
    "hca": ("P_K", "P_V", "W_z_K", "W_z_V", "B_K", "B_V", "w_K", "w_V"),
    "partition": (),
}


def _grads(model, x):
    model.train()
    model.zero_grad()
    loss = model(x, return_type="loss")
    aux = model.auxiliary_loss()  # dsa: the indexer's own objective, as the trainer adds it
    (loss if aux is None else loss + aux).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize(
    ("design", "gate"), [(d, "scalar") for d in DESIGNS] + [("gated", "channel")]
)
def test_gradients_reach_every_parameter(design, gate, gqa):
    # small window and overlapping blocks: every slot of some used block matters
    model = make_model(
        design, stride=3, block_len=4, window=2, offsets="per_head", gate=gate, gqa=gqa, rotary=True
    )
    # past the first step: the mlp's output layer starts at zero (no gradient reaches its
    # first layer until it moves)
    randomize_compressors(model)
    grads = _grads(model, tokens(2, 40))
    checked = 0
    for name, g in grads.items():
        if ".attn." not in name:
            continue
        leaf = name.split(".")[-1]
        if leaf in ("b_K", "_b_K") and design != "mlp":
            # q . (k + b_K) shifts every score of a query equally (pooling weights are
            # convex): softmax ignores it. Only the MLP compressor breaks that symmetry.
            continue
        assert g is not None, f"{name}: no gradient"
        assert g.abs().sum() > 0, f"{name}: zero gradient"
        checked += 1
    for part in COMPRESSOR_PARAMS[design]:
        names = [n for n in grads if part in n]
        assert len(names) >= model.cfg.n_layers, (part, names)
        for n in names:
            assert grads[n] is not None and grads[n].abs().sum() > 0, n
    if design == "gated":
        for layer in range(model.cfg.n_layers):
            g = grads[f"blocks.{layer}.attn.phase_bias"]
            # every KV head and every slot's bias is trained
            assert (g.abs().flatten(1).sum(-1) > 0).all()
            assert (g.abs().sum(0) > 0).all() if g.ndim == 2 else (g.abs().sum((0, 2)) > 0).all()
    assert checked >= 6 * model.cfg.n_layers


@pytest.mark.parametrize("design", ["none", *DESIGNS])
def test_adamw_lowers_loss(design):
    torch.manual_seed(0)
    model = make_model(design, stride=3, window=2, offsets="per_head")
    model.train()
    x = tokens(4, 32, seed=11)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(x, return_type="loss")
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    final = model(x, return_type="loss").item()
    assert final < losses[0] - 0.05, losses


@pytest.mark.parametrize("design", DESIGNS)
def test_same_config_same_seed_same_model(design):
    kw = dict(stride=3, block_len=5, window=1, offsets="per_head", rotary=True, gqa=True)
    a = make_model(design, **kw)
    torch.manual_seed(999)  # global RNG state between constructions must not matter
    torch.rand(10)
    b = make_model(design, **kw)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    x = tokens(2, 30)
    assert torch.equal(a(x), b(x))
    c = make_model(design, seed=1, **kw)
    assert not torch.equal(a(x), c(x))


def _offsets(model, x, layer=0, **kwargs):
    got = {}

    def grab(value, hook):
        got[hook.layer()] = value.clone()

    names = [f"blocks.{i}.attn.hook_grid_offset" for i in range(model.cfg.n_layers)]
    model.run_with_hooks(x, fwd_hooks=[(n, grab) for n in names], **kwargs)
    return got


def test_random_offsets_reproducible_and_per_sequence():
    model = make_model("mean", stride=5, offsets="random", eval_offset=2, gqa=True)
    model.train()
    x = tokens(32, 12)
    torch.manual_seed(7)
    first = _offsets(model, x)
    torch.manual_seed(7)
    again = _offsets(model, x)
    torch.manual_seed(8)
    other = _offsets(model, x)
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], other[0])
    # shared by every layer and KV head of one forward, one draw per sequence
    assert torch.equal(first[0], first[1])
    assert (first[0] == first[0][:, :1]).all()
    seq_offsets = first[0][:, 0]
    assert len(set(seq_offsets.tolist())) > 1
    assert set(seq_offsets.tolist()) <= set(range(5))
    # every training forward draws afresh
    assert not torch.equal(_offsets(model, x)[0], _offsets(model, x)[0])
    # eval mode: fixed eval_offset, no RNG consumed
    model.eval()
    state = torch.get_rng_state()
    ev = _offsets(model, x)
    assert (ev[0] == 2).all() and (ev[1] == 2).all()
    assert torch.equal(torch.get_rng_state(), state)


def test_random_offsets_change_outputs_in_training():
    model = make_model("mean", stride=4, window=0, offsets="random")
    model.train()
    x = tokens(1, 40)
    outs = set()
    for seed in range(12):
        torch.manual_seed(seed)
        outs.add(round(model(x, return_type="loss").item(), 6))
    assert len(outs) > 1


@pytest.mark.parametrize("offsets", ["aligned", "per_head", "per_layer", "random"])
@pytest.mark.parametrize("k", [0, 1, 3, 5, -2])
def test_shift_grid_moves_offsets(offsets, k):
    d = 4
    model = make_model("gated", stride=d, offsets=offsets)
    x = tokens(2, 16)
    base = _offsets(model, x)
    with model.shift_grid(k):
        shifted = _offsets(model, x)
    after = _offsets(model, x)
    for layer in base:
        assert torch.equal(shifted[layer], torch.remainder(base[layer] + k, d))
        assert torch.equal(after[layer], base[layer])  # restored on exit


def test_shift_grid_per_sequence_and_errors():
    model = make_model("mean", stride=4, offsets="per_head")
    x = tokens(3, 16)
    base = _offsets(model, x)[0]
    with model.shift_grid(torch.tensor([0, 1, 6])):
        got = _offsets(model, x)[0]
    assert torch.equal(got, torch.remainder(base + torch.tensor([0, 1, 6])[:, None], 4))
    with model.shift_grid(torch.tensor([1, 2])), pytest.raises(ValueError, match="batch of 3"):
        model(x)
    for bad in (1.5, "1", True, torch.tensor([0.5]), torch.zeros(2, 2, dtype=torch.long)):
        with pytest.raises(ValueError, match="shift"), model.shift_grid(bad):
            pass
    # shifting by a whole stride changes nothing
    y = model(x)
    with model.shift_grid(4):
        assert torch.equal(model(x), y)
    with model.shift_grid(8):
        assert torch.equal(model(x), y)
    with model.shift_grid(1):
        assert not torch.allclose(model(x), y)
