"""``nsa`` against a naive per-query loop written from its definition (outputs and gradients),
its equivalence to dense attention when the gates leave one branch, and its hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    make_hooked,
    make_model,
    one_branch,
    raises_naming,
    randomize_compressors,
    tokens,
)

from phasemech import CompressionConfig, PhaseTransformer


def _naive_entries(attn, x, pe, mlp, o, seq):
    """Compressed entries of one KV head: block i covers [i*d + o - l, i*d + o - 1]; the mean
    of its real tokens plus the MLP over its flattened slots (missing ones zero)."""
    d, ln = attn.stride, attn.block_len
    out, spans = [], []
    for i in range(seq // d + 1):
        pos = [i * d + o - ln + j for j in range(ln)]
        real = [j for j, p in enumerate(pos) if 0 <= p < seq]
        slots = torch.zeros(ln, x.shape[-1])
        for j in real:
            slots[j] = x[pos[j]] + pe[j]
        mean = torch.stack([x[pos[j]] for j in real]).mean(0) if real else 0
        out.append(mean + mlp(slots.flatten()))
        spans.append([pos[j] for j in real])
    return torch.stack(out), spans


def _softmax(attn, scores, keep):
    if not any(keep):
        return torch.zeros_like(scores)
    s = (scores / attn.attn_scale).masked_fill(~torch.tensor(keep), float("-inf"))
    return torch.softmax(s, -1)


def _branch_kv(attn, x, branch: int):
    """A branch's own keys (rotated by TransformerLens' rotary where the model has it) and
    values, ``x @ W_branch[branch]`` per KV head: ``[pos, kv_head, d_head]``."""
    k = torch.einsum("pm,gmd->pgd", x, attn.W_K_branch[branch])
    v = torch.einsum("pm,gmd->pgd", x, attn.W_V_branch[branch])
    if attn.cfg.positional_embedding_type == "rotary":
        k = attn.apply_rotary(k[None], 0, None)[0]
    return k, v


def _naive_z(attn, x, q, k, v, o_of):
    """z [pos, head, d_head] of one sequence, every branch by its definition: the compressed
    and selection branches on their own keys and values, the window on the layer's ``k, v``.
    ``o_of(g)``: the grid offset of KV head ``g``."""
    seq, h, _ = q.shape
    g = k.shape[1]
    rep, d, ls, inclusive = h // g, attn.stride, attn.select_len, attn.visibility == "inclusive"
    (k_c, v_c), (k_s, v_s) = _branch_kv(attn, x, 0), _branch_kv(attn, x, 1)
    entries = [_naive_entries(attn, k_c[:, i], attn.pos_embed_k[i], attn.compress_k, o_of(i), seq)
               for i in range(g)]  # fmt: skip
    values = [_naive_entries(attn, v_c[:, i], attn.pos_embed_v[i], attn.compress_v, o_of(i), seq)[0]
              for i in range(g)]  # fmt: skip
    hid = x if attn.gate_hidden is None else F.silu(x @ attn.W_gate_in + attn.b_gate_in)
    gates = torch.sigmoid(torch.einsum("pm,hmc->phc", hid, attn.W_branch) + attn.b_branch)
    z = torch.zeros(seq, h, q.shape[-1])
    for t in range(seq):
        p_cmp = {}
        for hi in range(h):
            gi, o = hi // rep, o_of(hi // rep)
            k_blk, spans = entries[gi]
            vis = [bool(s) and (i * d + o - 1 <= t if inclusive else i * d + o - 1 < t)
                   for i, s in enumerate(spans)]  # fmt: skip
            p_cmp[hi] = _softmax(attn, k_blk @ q[t, hi], vis)
        for hi in range(h):
            gi, o = hi // rep, o_of(hi // rep)
            spans = entries[gi][1]
            sel = lambda p, o=o: (p - o) // ls + 1  # noqa: E731
            n_sel = -(-seq // ls) + 1
            imp = [0.0] * n_sel
            for i, span in enumerate(spans):
                for j in {sel(p) for p in span}:
                    imp[j] += sum(float(p_cmp[gi * rep + r][i].detach()) for r in range(rep))
            open_ = [sel(0) <= j <= sel(t) for j in range(n_sel)]
            forced = {j for j in (sel(0), sel(t), sel(t) - 1) if 0 <= j < n_sel and open_[j]}
            ranked = sorted((j for j in range(n_sel) if open_[j] and j not in forced),
                            key=lambda j: (imp[j], j), reverse=True)  # fmt: skip
            chosen = forced | set(ranked[: attn.top_k])
            p_slc = _softmax(attn, k_s[: t + 1, gi] @ q[t, hi],
                             [sel(p) in chosen for p in range(t + 1)])  # fmt: skip
            scores = k[: t + 1, gi] @ q[t, hi]
            newest = t if inclusive else t - 1
            latest_end = newest - (newest + 1 - o) % d
            r = min(t - attn.window + 1, latest_end + 1)
            p_win = _softmax(attn, scores, [p >= r for p in range(t + 1)])
            branches = [p_cmp[hi] @ values[gi], p_slc @ v_s[: t + 1, gi], p_win @ v[: t + 1, gi]]
            z[t, hi] = sum(gates[t, hi, c] * branches[c] for c in range(3))
    return z


CASES = {
    "plain": dict(stride=4, window=4),
    "gqa_rotary_overlap": dict(
        stride=4, block_len=8, select_len=8, window=5, rotary=True, gqa=True, offsets="per_head",
        top_k=1,
    ),
    "strict_no_window": dict(stride=3, window=0, visibility="strict", top_k=3),
    "mlp_gate": dict(stride=4, window=4, gate_hidden=6, rotary=True, gqa=True),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_nsa_equals_the_naive_loop_outputs_and_gradients(case):
    model = make_model("nsa", **CASES[case])
    randomize_compressors(model, seed=2)
    with torch.no_grad():  # gates away from 1/2, so a swapped branch would show
        model.blocks[0].attn.b_branch.copy_(torch.randn(4, 3))
        if model.blocks[0].attn.gate_hidden is not None:  # a hidden layer that matters
            model.blocks[0].attn.W_gate_in.normal_(0, 0.5)
            model.blocks[0].attn.b_gate_in.normal_()
    x_tok = tokens(batch=1, seq=22)
    _, cache = model.run_with_cache(x_tok)
    attn = model.blocks[0].attn
    rot = "rot_" if model.cfg.positional_embedding_type == "rotary" else ""
    leaves = [cache[f"blocks.0.{n}"][0].detach().clone().requires_grad_(True)
              for n in ("ln1.hook_normalized", f"attn.hook_{rot}q", f"attn.hook_{rot}k",
                        "attn.hook_v")]  # fmt: skip
    x, q, k, v = leaves
    offsets = cache["blocks.0.attn.hook_grid_offset"][0]
    geo = attn._geometry(offsets[None], 22, None)
    got, _ = attn.attend(x[None], q[None], k[None], v[None], geo)
    want = _naive_z(attn, x, q, k, v, lambda g: int(offsets[g]))
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, cache["blocks.0.attn.hook_z"], atol=1e-5, rtol=1e-4)
    proj = torch.randn_like(want)
    params = [attn.W_branch, attn.b_branch, attn.pos_embed_k, attn.W_K_branch, attn.W_V_branch,
              *attn.compress_v.parameters()]  # fmt: skip
    if attn.gate_hidden is not None:
        params += [attn.W_gate_in, attn.b_gate_in]
    g_got = torch.autograd.grad((got[0] * proj).sum(), leaves + params)
    g_want = torch.autograd.grad((want * proj).sum(), leaves + params)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("branch", "kw"), [(2, dict(window=40)), (1, dict(top_k=20))])
def test_nsa_with_one_branch_covering_the_past_is_dense_attention(branch, kw):
    """Window branch with W >= T, or selection keeping every block (its own keys and values
    set to the layer's): TransformerLens' dense attention (the rest of the model is TL's)."""
    hooked = make_hooked(rotary=True)
    model = PhaseTransformer.from_hooked(hooked, CompressionConfig("nsa", stride=4, **kw))
    one_branch(model, branch)
    with torch.no_grad():
        for block in model.blocks:
            assert not block.attn.b_K.any() and not block.attn.b_V.any()  # TL's biases start 0
            block.attn.W_K_branch[1] = block.attn.W_K
            block.attn.W_V_branch[1] = block.attn.W_V
    x = tokens(seq=30)
    torch.testing.assert_close(model(x), hooked(x), atol=1e-4, rtol=1e-4)


def test_nsa_branches_split_the_output_exactly():
    model = make_model("nsa", stride=4, window=4)
    randomize_compressors(model)
    model.set_use_token_pattern(True)
    _, cache = model.run_with_cache(tokens(seq=24))
    gates = cache["blocks.1.attn.hook_branch_gate"]  # [batch, pos, head, branch]
    parts = cache["blocks.1.attn.hook_branch_z"]  # [batch, pos, head, branch, d_head]
    torch.testing.assert_close((gates[..., None] * parts).sum(-2), cache["blocks.1.attn.hook_z"])
    sel = cache["blocks.1.attn.hook_route_selected"]
    assert sel.dtype == torch.bool and sel.shape == (2, 4, 24, 24 // 4 + 1)
    assert model.blocks[1].attn.token_pattern_exact is False


def test_nsa_selection_hook_changes_what_is_read():
    """Ablating the selection (no block kept) leaves the selection branch nothing: zero."""
    model = make_model("nsa", stride=4, window=4)
    x = tokens(seq=24)
    hook = ("blocks.0.attn.hook_route_selected", lambda s, hook: torch.zeros_like(s))
    _, cache = model.run_with_cache(x)
    with model.hooks(fwd_hooks=[hook]):
        _, ablated = model.run_with_cache(x)
    assert ablated["blocks.0.attn.hook_branch_z"][..., 1, :].abs().max() == 0
    assert cache["blocks.0.attn.hook_branch_z"][..., 1, :].abs().max() > 0


def test_nsa_config_errors_name_the_value():
    raises_naming("select_len", 6, design="nsa", stride=4, select_len=6)
    raises_naming("select_len", 8, design="mean", stride=4, select_len=8)
    raises_naming("gate_hidden", 0, design="nsa", gate_hidden=0)
    raises_naming("gate_hidden", 8, design="gated", gate_hidden=8)
    assert "gate_hidden" not in CompressionConfig("nsa").to_dict()  # old cache keys hold
    assert CompressionConfig("nsa", gate_hidden=16).to_dict()["gate_hidden"] == 16
    comp = CompressionConfig("nsa", stride=4)
    assert comp.select_len == 4 and comp.block_scope == "all" and comp.top_k == 2
    assert "select_len" not in CompressionConfig("mean").to_dict()  # old cache keys hold
    assert CompressionConfig.from_dict(comp.to_dict()) == comp


def test_nsa_refuses_a_kv_cache():
    model = make_model("nsa", stride=4, window=4)
    with pytest.raises(NotImplementedError, match="nsa"):
        model.generate(tokens(batch=1, seq=12), max_new_tokens=2, use_past_kv_cache=True,
                       stop_at_eos=False, verbose=False)  # fmt: skip


def test_nsa_mlp_gate_reads_split_qkv_input_as_the_plain_input():
    """With split QKV input the gate MLP reads each KV head's copy of the input: the same
    output as from the shared input (a gate that mixed up the copies would differ)."""
    model = make_model("nsa", stride=4, window=4, gate_hidden=6, gqa=True)
    randomize_compressors(model, seed=3)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.W_gate_in.normal_(0, 0.5)
        attn.b_gate_in.normal_()
    x = tokens(2, 20, seed=4)
    plain = model(x)
    model.set_use_split_qkv_input(True)
    torch.testing.assert_close(model(x), plain, atol=1e-5, rtol=1e-5)
    perturb = {"blocks.0.hook_k_input": lambda t, hook: t + torch.randn_like(t)}
    assert not torch.allclose(model.run_with_hooks(x, fwd_hooks=list(perturb.items())), plain)
