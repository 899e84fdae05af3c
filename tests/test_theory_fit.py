"""Trained gated models read as the idealized model: effective pooling weights on targets, the
theory's accuracy from them, and the comparison with measured accuracy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phasemech.core.config import CompressionConfig
from phasemech.core.grid import build_geometry
from phasemech.data.tasks import MQARTask, generate, to_tensors
from phasemech.theory.dynamics import TheoryConfig
from phasemech.theory.fit import (
    compare,
    effective_weights,
    pooled_rank_test,
    theory_accuracy,
    weight_matrix,
)
from phasemech.training.config import ModelSpec, TrainConfig

TASK = MQARTask(seq_len=32, n_pairs=4, stride=4)


def _gated(offsets="aligned", design="gated", gate="scalar"):
    comp = CompressionConfig(design, stride=4, layers=(1,), offsets=offsets)
    if gate != "scalar":
        comp = CompressionConfig(design, stride=4, layers=(1,), offsets=offsets, gate=gate)
    cfg = TrainConfig(task=TASK, model=ModelSpec(n_heads=2), compression=comp)
    return cfg.build_model()


@pytest.fixture(scope="module")
def data():
    return generate(TASK, 12, seed=3, balanced=True)


@pytest.mark.parametrize("offsets, expect", [("aligned", [2, 2]), ((0, 1), [2, 3])])
def test_a_strong_slot_bias_puts_all_target_weight_on_its_phase(data, offsets, expect):
    model = _gated(offsets)
    with torch.no_grad():
        model.blocks[1].attn.W_gate.zero_()
        model.blocks[1].attn.phase_bias.zero_()
        model.blocks[1].attn.phase_bias[:, 2] = 30.0  # slot 2 of each head's own grid
    w = effective_weights(model, data, batch_size=5)  # batches that do not divide the set
    mat = weight_matrix(w)
    assert mat.shape == (2, 4)
    assert mat.argmax(1).tolist() == expect  # head 1 with offset 1: slot 2 is phase 3
    np.testing.assert_allclose(mat.max(1), 1.0, atol=1e-6)
    # with a zero gate the effective weight is the bias' softmax
    np.testing.assert_allclose(w["weight"], w["bias_weight"], atol=1e-6)
    assert (w["n"] == 12 * 4 // 4).all()  # 48 targets, phase-balanced


@pytest.mark.parametrize("offsets", [(0, 1), (1, 3)])
def test_effective_weights_match_a_brute_force_lookup_of_each_targets_block(data, offsets):
    """A random content gate makes every block different: the weight read for a target must be
    the one of the block and slot that hold its position on that head's grid."""
    model = _gated(offsets)
    torch.manual_seed(0)
    with torch.no_grad():
        model.blocks[1].attn.W_gate.normal_(0, 2.0)
        model.blocks[1].attn.phase_bias.normal_(0, 1.0)
    got = weight_matrix(effective_weights(model, data, batch_size=7))
    tokens, _, _ = to_tensors(data)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "blocks.1.attn" in n)
    w = cache["blocks.1.attn.hook_block_weights"]  # [batch, kv_head, block, slot]
    off = cache["blocks.1.attn.hook_grid_offset"]
    geo = build_geometry(off, tokens.shape[1], 4, 4, 8, "inclusive")
    want = np.zeros((2, 4))
    count = np.zeros(4)
    for b, row in enumerate(data["source_pos"]):
        for pos in row:
            count[pos % 4] += 1
            for g in range(2):
                hit = (geo.slot_pos[b, g] == pos) & geo.slot_valid[b, g]
                assert hit.sum() == 1  # one block, one slot per token (block_len == stride)
                want[g, pos % 4] += float(w[b, g][hit])
    np.testing.assert_allclose(got, want / count, atol=1e-6)


def test_channel_gates_use_the_mean_over_channels(data):
    w = effective_weights(_gated(gate="channel"), data)
    assert np.isfinite(w["weight"]).all() and (w["weight"] > 0).all()


def test_the_content_gate_moves_effective_weights_away_from_the_bias(data):
    model = _gated()
    with torch.no_grad():
        model.blocks[1].attn.phase_bias.zero_()
        model.blocks[1].attn.W_gate.normal_(0, 3.0)
    w = effective_weights(model, data)
    assert np.allclose(w["bias_weight"], 0.25)
    assert w["weight"].std() > 0.01  # the gate sees which token is the target


def test_effective_weights_refuse_designs_without_a_gate(data):
    with pytest.raises(ValueError, match="design='gated'.*'mean'"):
        effective_weights(_gated(design="mean"), data)
    with pytest.raises(ValueError, match="not gated layers"):
        effective_weights(_gated(), data, layers=[0])
    with pytest.raises(ValueError, match="layers=1 is invalid"):
        effective_weights(_gated(), data, layers=1)
    with pytest.raises(ValueError, match="source_pos"):
        effective_weights(_gated(), data.remove_columns("source_pos"))


def test_theory_accuracy_grows_with_weight_and_compare_ranks_phases():
    cfg = TheoryConfig(d=4, heads=2, n_windows=16)
    w = np.array([[0.9, 0.05, 0.03, 0.02], [0.1, 0.6, 0.2, 0.1]])
    pred = theory_accuracy(w, cfg)
    assert pred.shape == (4,)
    assert pred[0] > pred[1] > pred[2] > pred[3]
    observed = pred**2  # any increasing function: perfect rank agreement
    c = compare(w, observed, cfg)
    assert c["spearman"] == pytest.approx(1.0)
    assert c["weak_predicted"] == c["weak_observed"] == 3
    assert c["assignment"] == [0, 1]
    assert c["served_phases"] == 2
    assert c["covered_weight"] == 2  # 0.9 and 0.6 >= 0.5
    c = compare(w, observed[::-1], cfg)
    assert c["spearman"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match=r"\[head, phase\]"):
        compare(w, observed[:3], cfg)


def test_pooled_rank_test_pools_weak_single_model_evidence():
    rng = np.random.default_rng(0)
    pred = [rng.random(4) for _ in range(8)]
    agree = pooled_rank_test([(p, p + 0.01 * rng.random(4)) for p in pred], n_perm=4000)
    assert agree["mean_spearman"] > 0.9 and agree["p"] < 0.001 and agree["n_models"] == 8
    noise = pooled_rank_test([(p, rng.random(4)) for p in pred], n_perm=4000)
    assert noise["p"] > 0.05
    flat = pooled_rank_test([(pred[0], np.ones(4))])
    assert flat["n_models"] == 0 and np.isnan(flat["p"])
