"""Devices: ``resolve_device`` refuses what it cannot use, an explicit ``device="cpu"`` changes no
number, and (where a CUDA device is present) the tiny pipeline on it agrees with the CPU's to
float tolerance.

The pipeline: train a 2-layer gated model a few steps, evaluate it, ablate every component it has,
patch (fast and hook-based engines, attribution), probe, read phase attention and effective
pooling weights, and score passkey-style answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from phasemech import CompressionConfig
from phasemech.core.device import model_device, resolve_device
from phasemech.data.passkey import PasskeyBatch, score
from phasemech.data.tasks import MQARTask, generate, to_tensors
from phasemech.experiments.showcase.panels import PanelConfig, model_panel
from phasemech.interventions.ablation import ablate
from phasemech.interventions.attribution import attribution_patch
from phasemech.interventions.contrasts import make_contrast
from phasemech.interventions.patching import patch_sites
from phasemech.interventions.patching_fast import patch_heads
from phasemech.interventions.probes import phase_probe
from phasemech.measure.evaluate import evaluate
from phasemech.measure.pretrained import Scorer, Setting, SweepConfig, run_sweep
from phasemech.model.phase import phase_attention
from phasemech.model.pretrained import load_pretrained
from phasemech.theory.fit import effective_weights
from phasemech.training.checkpoints import load_trained, read_metrics
from phasemech.training.config import ModelSpec, TrainConfig
from phasemech.training.trainer import train

TASK = MQARTask(vocab_size=32, seq_len=32, n_pairs=4, stride=4)
CFG = TrainConfig(
    task=TASK,
    model=ModelSpec(n_layers=2, d_model=32, n_heads=2),
    compression=CompressionConfig("gated", stride=4, window=8, layers=(1,)),
    steps=6,
    batch_size=8,
    eval_every=3,
    eval_sequences=16,
    warmup_steps=2,
    seed=3,
)
NO_CUDA = "no CUDA device on this machine: the CUDA path is checked where one is present"


# ------------------------------------------------------------------------- resolve_device


def test_resolve_device_accepts_auto_and_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "gpu", "", 0])
def test_resolve_device_refuses_a_bad_name_in_one_line(bad):
    with pytest.raises(ValueError) as info:
        resolve_device(bad)
    msg = str(info.value)
    assert f"device={bad!r}" in msg and "\n" not in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: 'cuda' is valid here")
@pytest.mark.parametrize("absent", ["cuda", "cuda:0", torch.device("cuda")])
def test_resolve_device_refuses_cuda_where_there_is_none(absent):
    with pytest.raises(ValueError) as info:
        resolve_device(absent)
    msg = str(info.value)
    assert repr(str(absent)) in msg and "not available" in msg and "\n" not in msg, msg


def test_loaders_check_the_device_before_loading(tmp_path):
    """A bad device is refused before any model is read (none of these names exists)."""
    with pytest.raises(ValueError, match="device='tpu'"):
        load_pretrained("no-such-model", device="tpu")
    with pytest.raises(ValueError, match="device='tpu'"):
        Scorer(model_name="no-such-model", device="tpu")
    with pytest.raises(ValueError, match="device='tpu'"):
        run_sweep([Setting("null")], SweepConfig(model="no-such-model"), device="tpu")
    with pytest.raises(ValueError, match="device='tpu'"):
        model_panel(tmp_path, device="tpu")


# ------------------------------------------------------------------------------ pipeline


@pytest.fixture(scope="module")
def data():
    return generate(TASK, 16, seed=0, balanced=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained with ``device="cpu"`` stated."""
    folder = tmp_path_factory.mktemp("device") / "run"
    train(CFG, folder, progress=False, device="cpu")
    return folder


def pipeline(model, ds) -> dict[str, pd.DataFrame | np.ndarray]:
    """Every model-running entry point on one model; results as frames and arrays."""
    out: dict[str, pd.DataFrame | np.ndarray] = {}
    ev = evaluate(model, ds, n_boot=20, n_perm=20)
    out["targets"], out["per_phase"] = ev.targets, ev.report.per_phase
    abl = ablate(model, ds, components=("head", "blocks", "phase_bias"), n_boot=20, seed=1)
    out["ablation"], out["effects"] = abl.targets, abl.effects
    answer = make_contrast(ds, "answer", stride=4, n_pairs=8, seed=2)
    grid = make_contrast(ds, "grid", stride=4, n_pairs=8, shift=1, seed=2)
    out["heads_by_pos"] = patch_heads(model, answer, by_pos=True).values
    out["heads_grid"] = patch_heads(model, grid, metric="logprob").values
    out["sites_z"] = patch_sites(model, grid, site="z", metric="logprob", by_pos=True).values
    out["sites_kv"] = patch_sites(model, answer, site="kv_block").values
    out["attribution"] = attribution_patch(model, answer, batch_size=5).values
    tokens, query_pos, _ = to_tensors(ds)
    out["probe"] = phase_probe(model, tokens, cv=2, max_rows=256).frame
    source = torch.tensor(ds["source_pos"])
    out["attention"] = phase_attention(model, tokens, query_pos=query_pos, key_pos=source).frame
    out["weights"] = effective_weights(model, ds, batch_size=5)
    frame = pd.DataFrame({"answer_start": np.full(len(tokens), 24)})
    batch = PasskeyBatch(tokens, tokens[:, 24:27], frame, 4)
    out["passkey"] = score(model, batch, batch_size=5)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], pd.DataFrame):
            pd.testing.assert_frame_equal(a[k], b[k], check_exact=True, obj=k)
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_explicit_cpu_changes_no_number(run, data, tmp_path):
    default_run = tmp_path / "default"
    train(CFG, default_run, progress=False)  # no device argument
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(default_run)] == [
        {k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(run)
    ]
    stated, _, _ = load_trained(run, device="cpu")
    default, _, _ = load_trained(default_run)
    assert model_device(stated) == model_device(default) == torch.device("cpu")
    for (name, p), q in zip(
        stated.state_dict().items(), default.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    assert_same(pipeline(stated, data), pipeline(default, data))
    tiny = PanelConfig(sequences=16, n_boot=20, n_perm=20)
    panel = model_panel(run, tiny, force=True, device="cpu")
    assert model_panel(run, tiny, force=True) == panel
    assert len(panel["heads"]) == 4 and len(panel["summary"]["per_phase"]) == 4


# ------------------------------------------------------------------------------- CUDA


TIE = 1e-3  # a margin this small may flip its argmax between devices


def frame_close(a: pd.DataFrame, b: pd.DataFrame, name: str, atol: float = 1e-4) -> None:
    """Float columns to float tolerance, every other column equal."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b), name
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=atol, err_msg=f"{name}.{col}")
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"{name}.{col}")


def answers_agree(a: np.ndarray, b: np.ndarray, margin: np.ndarray, name: str) -> bool:
    """0/1 answers equal wherever the margin is no near tie; whether all of them agree."""
    sure = np.abs(margin) > TIE
    np.testing.assert_array_equal(a[sure], b[sure], err_msg=name)
    return bool((a == b).all())


def assert_close(cpu: dict, gpu: dict) -> None:
    """The pipeline on two devices: floats to float tolerance; argmax answers equal away from
    near ties (statistics of those answers compared when every answer agrees); probe
    accuracies within a few rows (the classifier is refitted on features that differ in their
    last bits)."""
    assert cpu.keys() == gpu.keys()
    a, b = cpu["targets"], gpu["targets"]
    same = answers_agree(a.correct.to_numpy(), b.correct.to_numpy(), a.margin.to_numpy(), "correct")
    frame_close(a.drop(columns="correct"), b.drop(columns="correct"), "targets")
    if same:
        frame_close(cpu["per_phase"], gpu["per_phase"], "per_phase")
    a, b = cpu["ablation"], gpu["ablation"]
    same = all(  # a list: every column is checked, not only up to the first that differs
        [
            answers_agree(a[c].to_numpy(), b[c].to_numpy(), a[d].to_numpy(), c)
            for c, d in (("accuracy", "logit_diff"), ("accuracy_base", "logit_diff_base"))
        ]
    )
    frame_close(
        a.drop(columns=["accuracy", "accuracy_base"]),
        b.drop(columns=["accuracy", "accuracy_base"]),
        "ablation",
    )
    a, b = cpu["effects"], gpu["effects"]
    keep = (a.metric != "accuracy").to_numpy() | same
    frame_close(a[keep], b[keep], "effects")
    for k in ("heads_by_pos", "heads_grid", "sites_z", "sites_kv", "attribution"):
        np.testing.assert_allclose(cpu[k], gpu[k], rtol=1e-4, atol=1e-4, err_msg=k)
    a, b = cpu["probe"], gpu["probe"]
    scores = ["accuracy", "std", "p_value"]
    frame_close(a.drop(columns=scores), b.drop(columns=scores), "probe")
    frame_close(a[scores], b[scores], "probe", atol=0.1)
    frame_close(cpu["attention"], gpu["attention"], "attention")
    frame_close(cpu["weights"], gpu["weights"], "weights")
    answers = ["correct", "first_correct"]
    frame_close(
        cpu["passkey"].drop(columns=answers), gpu["passkey"].drop(columns=answers), "passkey"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_pipeline_matches_cpu(run, data, tmp_path):
    # the same weights on both devices
    cpu, _, _ = load_trained(run, device="cpu")
    gpu, _, _ = load_trained(run, device="cuda")
    assert model_device(gpu).type == "cuda"
    assert_close(pipeline(cpu, data), pipeline(gpu, data))
    # training on the GPU: the same data and initial weights, losses within float drift
    gpu_run = tmp_path / "gpu"
    train(CFG, gpu_run, progress=False, device="cuda")
    got = [r["eval_loss"] for r in read_metrics(gpu_run)]
    want = [r["eval_loss"] for r in read_metrics(run)]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    gpu_trained, _, _ = load_trained(gpu_run)  # checkpoints hold CPU tensors
    assert model_device(gpu_trained) == torch.device("cpu")
    tiny = PanelConfig(sequences=16, n_boot=20, n_perm=20)
    on_cpu = model_panel(run, tiny, force=True)
    on_gpu = model_panel(run, tiny, force=True, device="cuda")
    assert on_gpu["key"] == on_cpu["key"]

    def masses(panel: dict) -> np.ndarray:  # rounded to 4 decimals; None where undefined
        return np.array([[np.nan if x is None else x for x in h["mass"]] for h in panel["heads"]])

    np.testing.assert_allclose(masses(on_gpu), masses(on_cpu), atol=2e-4)
