"""The design registry (``core.designs.TRAITS``) against what each design does, the one list
parser and ``--layers`` grammar, and the real-model studies' one set of options.

Every trait that a model can show is checked on a tiny model of the design: ``learned`` (the
compressed layer adds parameters), ``serves_from_cache`` (the decode regime runs or refuses),
``top_k`` and ``sink`` (the config takes the field or refuses it), ``selecting`` (the layer has a
selection to hook). A registry row that disagrees with its design fails here."""

from __future__ import annotations

import pytest
import torch
import typer
from conftest import make_hooked, randomize_compressors, tokens

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.core import designs as d
from phasemech.model.decode import prefill, read_rows

torch.set_num_threads(1)
COMPRESSED = [x for x in d.DESIGNS if x != "none"]


def _model(design: str, **kw):
    tl = make_hooked(rotary=True, n_layers=1, attn_only=True)
    fields = dict(stride=4, window=4) | kw
    if d.traits(design).top_k:
        fields.setdefault("top_k", 1)
    return tl, PhaseTransformer.from_hooked(tl, CompressionConfig(design, **fields)).eval()


def test_every_group_is_a_view_of_the_registry():
    assert tuple(d.TRAITS) == d.DESIGNS
    assert d.SELECTING_DESIGNS == tuple(x for x in d.DESIGNS if d.TRAITS[x].selecting)
    assert d.SINK_DESIGNS == d.designs_where(sink=True)
    assert set(d.SINK_DESIGNS) <= set(d.TOP_K_DESIGNS)  # a sink is a ranked budget's share
    assert d.POST_HOC_DESIGNS == ("mean", "route", "evict", "quest", "kpool", "partition")
    assert set(d.CACHE_DESIGNS) >= set(d.POST_HOC_DESIGNS)  # post hoc: served from a cache
    assert d.TRAITS["dsa"].regimes == ("trained",) and d.TRAITS["route"].regimes == d.REGIMES
    with pytest.raises(ValueError, match="unknown traits \\['fast'\\]"):
        d.designs_where(fast=True)
    with pytest.raises(ValueError, match="design='moba' is invalid"):
        d.traits("moba")


@pytest.mark.parametrize("design", COMPRESSED)
def test_learned_means_the_layer_adds_parameters(design):
    tl, model = _model(design)
    extra = set(dict(model.named_parameters())) - set(dict(tl.named_parameters()))
    assert bool(extra) == d.traits(design).learned, sorted(extra)


@pytest.mark.parametrize("design", COMPRESSED)
def test_serves_from_cache_means_the_decode_regime_is_exact(design, monkeypatch):
    """One layer: the dense prefill's keys are the compressed model's own, so a design a cache
    serves gives its full forward's rows exactly; a design the registry says a cache cannot
    serve, forced to read one anyway, fails or gives other rows (it reads what a cache drops)."""
    tl, model = _model(design, **({"obs_window": 2} if design == "evict" else {}))
    randomize_compressors(model)
    x = tokens(1, 24, seed=0)
    with torch.inference_mode():
        want = model(x, stop_at_layer=1)[:, 16:]
    cache = prefill(tl, x[:, :16], keep_queries=8)
    if d.traits(design).serves_from_cache:
        torch.testing.assert_close(read_rows(model, cache, x[:, 16:]), want, atol=1e-5, rtol=0)
        return
    with pytest.raises(NotImplementedError, match="cannot read a KV cache"):
        read_rows(model, cache, x[:, 16:])
    monkeypatch.setattr(type(model.blocks[0].attn), "serves_from_cache", True)
    try:
        got = read_rows(model, prefill(tl, x[:, :16], keep_queries=8), x[:, 16:])
    except Exception:  # noqa: BLE001 - cannot read a cache at all: as the registry says
        return
    assert not torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("design", COMPRESSED)
def test_top_k_and_sink_traits_are_what_the_config_takes(design):
    t = d.traits(design)
    for field, takes in (("top_k", t.top_k), ("sink_tokens", t.sink)):
        kw = {field: 1} | ({"top_k": 1} if t.top_k and field == "sink_tokens" else {})
        if takes:
            CompressionConfig(design, stride=4, window=4, **kw)
        else:
            with pytest.raises(ValueError, match=field):
                CompressionConfig(design, stride=4, window=4, **kw)


def test_the_list_parser_and_the_layers_grammar():
    from phasemech.cli.base import parse_ints, parse_layers, split_list

    assert split_list(" a, b ,,c") == ("a", "b", "c") and split_list(None) is None
    assert split_list("0.1,0.5", "--depths", float) == (0.1, 0.5)
    assert parse_ints("2-5,7", "--context") == (2, 3, 4, 5, 7)
    named = {"global": (0, 2), "local": (1,), "all": (0, 1, 2)}.__getitem__
    assert parse_layers("1,3-4") == (1, 3, 4) and parse_layers(None) is None
    assert parse_layers(" local ", named) == (1,) and parse_layers("all", named) == (0, 1, 2)
    for bad, flag, match in (("x", "--layers", "--layers 'x' is invalid: expected ints"),
                             ("2-", "--layers", "ranges like 2-29"),
                             ("global", "--layers", "need a model")):  # fmt: skip
        with pytest.raises(ValueError, match=match) as err:
            parse_layers(bad, flag=flag)
        assert "\n" not in str(err.value)


def _options(name: str) -> set[str]:
    from phasemech.cli import app

    command = typer.main.get_command(app).commands[name]
    return {p.name for p in command.params}  # options only: the commands take no argument


def test_audit_and_explain_share_every_probe_and_run_option():
    """The options are defined once: each command adds only its own beside them, so every
    audited setting (the sink included) can be explained with the same flags."""
    from phasemech.cli.probe import PROBE_OPTIONS, RUN_OPTIONS

    shared = set(PROBE_OPTIONS) | set(RUN_OPTIONS)
    audit, explain = _options("audit"), _options("explain")
    assert shared <= audit and shared <= explain and "sink_tokens" in shared
    assert audit - shared == {"fix", "attention_groups"}
    assert explain - shared == {"contrast_phases", "analyses", "top_heads", "group_sizes"}


def test_explain_parses_the_audits_flags_into_the_same_probe(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import phasemech.experiments.audit.study as audit_study
    import phasemech.experiments.explain.run as explain_run
    from phasemech.cli import app

    seen = {}

    def fake(name):
        def run(cfg, out, **kw):
            seen[name] = cfg
            out.mkdir(parents=True, exist_ok=True)
            (out / "summary.md").write_text("ok")
            return {"wall_s": 0.0}

        return run

    monkeypatch.setattr(audit_study, "run_audit", fake("audit"))
    monkeypatch.setattr(explain_run, "run_explain", fake("explain"))
    flags = ["--design", "evict", "--top-k", "2", "--sink-tokens", "4", "--layers", "2-29",
             "--context", "2048", "--contents", "8", "--offsets", "per_head", "-o"]  # fmt: skip
    for name in ("audit", "explain"):
        res = CliRunner().invoke(app, [name, *flags, str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    assert seen["audit"].probe == seen["explain"].probe
    assert seen["explain"].probe.layers == tuple(range(2, 30))
    bad = CliRunner().invoke(app, ["audit", *flags[:7], "2-x", "-o", str(tmp_path)],
                             env={"COLUMNS": "500"})  # fmt: skip
    lines = [ln for ln in bad.output.splitlines() if ln.strip()]
    assert bad.exit_code == 1 and len(lines) == 1 and "--layers '2-x' is invalid" in lines[0]
