"""analyses/d8_recipe.py: each variant changes exactly one field of the d = 8 sweep's config."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analyses"))
import d8_recipe  # noqa: E402

from phasemech.experiments.sweep.profiles import PROFILES, RunSpec, train_config  # noqa: E402


def _changed(a, b) -> dict:
    da, db = a.to_dict(), b.to_dict()
    out = {k: (da.get(k), db.get(k)) for k in da.keys() | db.keys() if da.get(k) != db.get(k)}
    if "model" in out:
        ma, mb = out.pop("model")
        out.update({f"model.{k}": (ma[k], mb[k]) for k in ma if ma[k] != mb[k]})
    return out


@pytest.mark.parametrize(
    ("variant", "change"),
    [
        ("warmup", {"prefix_warmup": (None, 2000)}),
        ("width", {"model.d_model": (64, 128)}),
        ("width_dhead16", {"model.d_model": (64, 128), "model.d_head": (None, 16)}),
        ("lr1e-3", {"lr": (3e-3, 1e-3)}),
    ],
)
def test_each_variant_changes_one_field_of_the_sweep_config(variant, change):
    base = train_config(RunSpec("mlp", 8, 2, 64, 1), PROFILES["converged_d8"])
    cfg = d8_recipe.config("mlp_h2", variant, 1, 500)
    assert _changed(dataclasses.replace(base, steps=500), cfg) == change
    assert (cfg.task.stride, cfg.compression.stride, cfg.compression.design) == (8, 8, "mlp")


def test_unknown_setting_or_variant_is_a_one_line_error():
    with pytest.raises(typer.BadParameter, match=r"variants \['deeper'\] unknown: allowed"):
        d8_recipe._choices("width,deeper", d8_recipe.VARIANTS, "variants")
    with pytest.raises(typer.BadParameter, match="settings '' unknown"):
        d8_recipe._choices("", d8_recipe.SETTINGS, "settings")


def test_runs_are_labelled_from_the_request_not_parsed_from_names():
    picked = d8_recipe.picked_runs("mlp_h2,gated_h4", "width_dhead16,lr1e-3", "0,1,0")
    assert len(picked) == 8  # a seed asked twice is one run
    assert picked["mlp_h2_width_dhead16_s1"] == ("mlp_h2", "width_dhead16", 1)

    class Job:  # the fields result_rows reads of a TrainJob
        name = "mlp_h2_width_dhead16_s1"
        train = d8_recipe.config("mlp_h2", "width_dhead16", 1, 300)

    curve = [{"step": 100, "accuracy": 0.5}, {"step": 200, "accuracy": 0.96}]
    (row,) = d8_recipe.result_rows([(Job, {"curve": curve, "heldout_accuracy": 0.97})], picked)
    assert (row["setting"], row["variant"], row["seed"], row["budget"]) == (
        "mlp_h2", "width_dhead16", 1, 300)  # fmt: skip
    assert (row["steps_to_95"], row["final_step"]) == (200, 200)


def test_bad_seeds_are_a_one_line_error():
    with pytest.raises(typer.BadParameter, match="seeds '0,x' invalid: need comma-separated"):
        d8_recipe.picked_runs("mlp_h2", "width", "0,x")
