"""save / load round trips, and clear errors for broken or mismatched folders."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DESIGNS, make_model, randomize_compressors, tokens

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.model.transformer import CONFIG_FILE, WEIGHTS_FILE

ROUND_TRIP = {
    "plain": dict(stride=3, window=2),
    "rotary_gqa": dict(
        stride=4,
        block_len=6,
        window=0,
        offsets=((0, 2), (1, 3)),
        rotary=True,
        gqa=True,
        visibility="strict",
    ),
    "mlp_blocks_random": dict(
        stride=3, offsets="random", eval_offset=1, attn_only=False, layers=(1,)
    ),
}


@pytest.mark.parametrize("case", ROUND_TRIP)
@pytest.mark.parametrize("design", ["none", *DESIGNS])
def test_save_load_identical(tmp_path, design, case):
    kw = dict(ROUND_TRIP[case])
    if design == "none":
        kw = {k: v for k, v in kw.items() if k in ("rotary", "gqa", "attn_only")}
    model = make_model(design, **kw)
    randomize_compressors(model, seed=4)
    with torch.no_grad():  # make sure the weights saved are not just the seeded init
        model.blocks[0].attn.W_Q.add_(0.1)
    model.set_use_token_pattern(True)
    out = model.save(tmp_path / "m")
    assert (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).is_file()
    assert not list(out.glob("*.tmp"))
    loaded = PhaseTransformer.load(out).eval()
    assert loaded.cfg.compression == model.cfg.compression
    assert loaded.cfg.use_token_pattern is True
    assert loaded.cfg.dtype == model.cfg.dtype
    x = tokens(2, 30)
    torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert [type(b.attn) for b in loaded.blocks] == [type(b.attn) for b in model.blocks]
    # saving again over the same folder works (atomic replace)
    model.save(out)
    torch.testing.assert_close(PhaseTransformer.load(out).eval()(x), model(x), atol=0, rtol=0)


@pytest.fixture
def saved(tmp_path):
    model = make_model("gated", stride=3)
    return model.save(tmp_path / "gated"), model


def test_missing_files(tmp_path, saved):
    path, _ = saved
    with pytest.raises(FileNotFoundError, match="config.json"):
        PhaseTransformer.load(tmp_path / "nowhere")
    (path / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_FILE):
        PhaseTransformer.load(path)


@pytest.mark.parametrize(
    "payload", [b"", b"not safetensors at all", b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":1}']
)
def test_corrupt_weights(saved, payload):
    path, _ = saved
    (path / WEIGHTS_FILE).write_bytes(payload)
    with pytest.raises(ValueError, match=WEIGHTS_FILE):
        PhaseTransformer.load(path)


def test_truncated_weights(saved):
    path, _ = saved
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=WEIGHTS_FILE):
        PhaseTransformer.load(path)


@pytest.mark.parametrize(
    "text", ["", "{", "not json", "[1, 2]", "null", '"a string"', '{"n_layers": 2']
)
def test_corrupt_config_text(saved, text):
    path, _ = saved
    (path / CONFIG_FILE).write_text(text)
    with pytest.raises(ValueError, match=CONFIG_FILE):
        PhaseTransformer.load(path)


@pytest.mark.parametrize(
    "edit",
    [
        {"compression": {"design": "mean", "stride": 0}},
        {"compression": {"design": "fancy"}},
        {"compression": "gated"},
        {"no_such_field": 1},
        {"dtype": "float77"},
        {"n_layers": "two"},
    ],
)
def test_invalid_config_values(saved, edit):
    path, _ = saved
    raw = json.loads((path / CONFIG_FILE).read_text())
    raw.update(edit)
    (path / CONFIG_FILE).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=CONFIG_FILE):
        PhaseTransformer.load(path)


@pytest.mark.parametrize("other", ["mean", "mlp", "route", "none"])
def test_checkpoint_of_another_design(tmp_path, saved, other):
    """A config.json of another design next to gated weights: clear ValueError."""
    path, _ = saved
    make_model(other, stride=3).save(tmp_path / "other")
    (path / CONFIG_FILE).write_text((tmp_path / "other" / CONFIG_FILE).read_text())
    with pytest.raises(ValueError, match="does not match"):
        PhaseTransformer.load(path)


def test_checkpoint_of_another_shape(tmp_path, saved):
    path, _ = saved
    make_model("gated", stride=3, block_len=5).save(tmp_path / "other")  # phase_bias [g, 5]
    (path / CONFIG_FILE).write_text((tmp_path / "other" / CONFIG_FILE).read_text())
    with pytest.raises(ValueError, match="does not match"):
        PhaseTransformer.load(path)


def test_from_hooked_rejects_bad_compression():
    from conftest import make_hooked

    with pytest.raises(ValueError, match="compression"):
        PhaseTransformer.from_hooked(make_hooked(), {"design": "mean"})
    m = PhaseTransformer.from_hooked(make_hooked(), CompressionConfig("mean"))
    assert m.cfg.init_weights is True
