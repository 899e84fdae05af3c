"""``make figures`` end to end at its tiny profile, and the dashboard in a real browser.

The tiny pipeline (two 30-step models) runs once per session; the dashboard tests reuse its
trained runs and cached panels.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from browser import CHROMIUM, browser, cell_xy, page_data
from typer.testing import CliRunner

from phasemech.cli import app
from phasemech.experiments.showcase.panels import (
    PanelConfig,
    collect_panels,
    find_runs,
    model_panel,
    panel_dir,
)
from phasemech.viz.dashboard import example_target, render_dashboard

ROOT = Path(__file__).resolve().parents[1]
FIGURES = (
    "accuracy_by_phase_d4",
    "accuracy_by_phase_polar_d4",
    "head_phase_attention",
    "ablation_effects",
    "patching_grid",
    "specialization",
    "training_dynamics",
    "attention_pattern",
)
RESULTS = ROOT / "analyses" / "results"
# the theory's curves always; the recorded analyses' figures when their results are committed
ANALYSIS_FIGURES = ["theory_plateau"] + [
    name
    for name, results in (
        ("theory_vs_trained", ["theory_trained_default.json", "theory_trained_converged.json"]),
        ("fixes_by_phase", ["fixes_default.json", "fixes_long.json", "fixes_converged.json"]),
    )
    if any((RESULTS / r).is_file() for r in results)
]
TINY_PANEL = PanelConfig(sequences=64, n_boot=50, n_perm=50)  # the tiny profile's


def script(name: str) -> typer.Typer:
    """``analyses/NAME.py`` as ``python analyses/NAME.py`` runs it (``typer.run(main)``), to
    invoke in this process: no interpreter start and no second import of phasemech."""
    spec = importlib.util.spec_from_file_location(f"analyses_{name}", ROOT / f"analyses/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    command = typer.Typer(add_completion=False)
    command.command()(module.main)
    return command


def invoke(name: str, args: list[str]) -> str:
    res = CliRunner().invoke(script(name), args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


#: ``python analyses/figures.py ARGS`` without the launcher's progress board: the board is an
#: actor, a fresh process that imports phasemech at every stage's launch, seconds each on 2
#: cores where the tiny jobs take less (a real board: test_launcher.py's interrupted launch)
NO_BOARD = """
import functools, importlib, runpy, sys
experiment = importlib.import_module("phasemech.experiments.experiment")  # the module
experiment.run_experiment = functools.partial(experiment.run_experiment, progress=False)
sys.argv = sys.argv[1:]  # the script and its arguments, as the script itself sees them
sys.path[0] = str(__import__("pathlib").Path(sys.argv[0]).parent)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def make_figures(runs: Path, out: Path, *flags: str, here: bool = False) -> str:
    """``make figures`` at the tiny profile: the figures, then the claims report beside OUT.
    The figures script runs in a process of its own, as ``make figures`` runs it but without
    the progress board (:data:`NO_BOARD`) and with one CPU for its embedded Ray (the jobs are
    tiny, each Ray worker imports torch), or with ``here`` in this process (a rerun that
    launches nothing); the report always here."""
    args = ["--profile", "tiny", *flags, "--runs", str(runs), "--out", str(out)]
    if here:
        stdout = invoke("figures", args)
    else:
        cmd = [sys.executable, "-c", NO_BOARD, str(ROOT / "analyses/figures.py"), *args]
        done = subprocess.run(
            [*cmd, "--num-cpus", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        stdout = done.stdout
    args = ["--showcase", str(runs / "figures_tiny" / "showcase")]
    args += ["--captions", str(out / "captions.json"), "--out", str(out.parent / "REPORT.md")]
    return stdout + invoke("report", args)


def run_of(folder: Path, name: str) -> Path:
    """A trained model's run folder inside an experiment's folder."""
    return next(r for r in find_runs(folder) if r.name == name)


@pytest.fixture(scope="session")
def tiny_figures(tmp_path_factory):
    """``(the tiny figures experiment's folder, figures folder, stdout)`` of one tiny run."""
    tmp = tmp_path_factory.mktemp("figures_pipeline")
    out, runs = tmp / "figures", tmp / "runs"
    stdout = make_figures(runs, out)
    return runs / "figures_tiny", out, stdout


def test_tiny_profile_writes_every_figure_and_an_index(tiny_figures):
    sweep, out, stdout = tiny_figures
    # the launcher ran every stage: 2 models, their panels, the theory, the showcase patching
    assert "figures (tiny): 6 jobs run, 0 cached" in " ".join(stdout.split())
    index = (out / "index.html").read_text()
    captions = json.loads((out / "captions.json").read_text())
    names = [f["name"] for f in captions["figures"]]
    assert names == [*FIGURES, *ANALYSIS_FIGURES, "dashboard"]
    for f in captions["figures"]:
        page = out / f["html"]
        assert page.is_file() and f'href="{f["html"]}"' in index
        assert f["caption"] and re.search(r"\d\.\d{2}", f["caption"]), f["name"]
        if f["name"] != "dashboard":  # plotly.js beside the pages: they work offline
            assert 'src="plotly.min.js"' in page.read_text()
    assert (out / "plotly.min.js").is_file()
    if CHROMIUM.exists():
        for name in [*FIGURES, *ANALYSIS_FIGURES, "dashboard"]:
            png = out / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
            assert f'src="{name}.png"' in index
    # the numbers in a caption are the table's: accuracy of the tiny gated model at phase 0
    table = __import__("pandas").read_parquet(sweep / "showcase" / "per_phase.parquet")
    gated = table[(table.design == "gated") & (table.grid == 4)].sort_values("phase")
    first = captions["figures"][0]["caption"]
    assert f"gated d=4 H=2: {gated.overall.iloc[0]:.3f} overall" in first


def test_tiny_profile_writes_the_claims_report(tiny_figures):
    sweep, out, stdout = tiny_figures
    text = (out.parent / "REPORT.md").read_text()
    heads = re.findall(r"^## (\d)\. ", text, flags=re.M)
    assert heads == ["1", "2", "3", "4", "5", "6", "7", "8"]
    assert text.count("Verdict") == 8
    # every figure link resolves, relative to the report
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (out.parent / link).is_file(), link
    # a number of the report is the table's: the dense control's debiased gap
    table = __import__("pandas").read_parquet(sweep / "showcase" / "per_phase.parquet")
    dense = table[(table.design == "none") & (table.grid == 4)].iloc[0]
    assert f"debiased gap {dense.debiased_gap:.3f} [" in text
    assert "their numbers vary by machine" in text  # and no verdict reads them
    assert "REPORT.md" in stdout


def test_tiny_profile_reuses_its_cache(tiny_figures, tmp_path):
    sweep, _, _ = tiny_figures
    runs = tmp_path / "runs"
    shutil.copytree(sweep, runs / sweep.name)
    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*.safetensors")}
    stamps |= {p: p.stat().st_mtime_ns for p in runs.rglob("panel.json")}
    stdout = make_figures(runs, tmp_path / "fig", "--no-png", here=True)
    assert "figures (tiny): 0 jobs run, 6 cached" in " ".join(stdout.split())
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert not list((tmp_path / "fig").glob("*.png"))


# ------------------------------------------------------------------------------- dashboard


def test_panel_numbers_come_from_the_library(tiny_figures):
    from phasemech.data.tasks import balanced_test_set
    from phasemech.interventions.ablation import AblationResult
    from phasemech.measure.evaluate import evaluate
    from phasemech.training.checkpoints import load_trained

    sweep, _, _ = tiny_figures
    run = run_of(sweep, "gated_d4_h2_T32_s0")
    panel = model_panel(run, TINY_PANEL)  # cached by the pipeline run
    model, cfg, _ = load_trained(run)
    ev = evaluate(model, balanced_test_set(cfg.task, 64, 777), n_boot=50, n_perm=50)
    assert panel["summary"]["accuracy"] == pytest.approx(ev.report.accuracy, abs=1e-4)
    assert [p["accuracy"] for p in panel["summary"]["per_phase"]] == pytest.approx(
        ev.report.per_phase["accuracy"].tolist(), abs=1e-4
    )
    effects = AblationResult.load(panel_dir(run, TINY_PANEL) / "ablate").tensor(
        "accuracy", "head", "zero"
    )
    for h in panel["heads"]:
        assert h["effect"] == pytest.approx(effects[h["layer"], h["head"]].tolist(), abs=1e-4)
        assert h["label"] == f"L{h['layer']}H{h['head']}"
    ex = panel["example"]
    # the examples' needles cover every phase; causal: no query attends to a later key
    phases = {(n - ex["grid_offset"]) % 4 for e in ex["examples"] for n, _ in e["targets"]}
    assert phases == {0, 1, 2, 3}
    for e in ex["examples"]:
        pattern = e["patterns"][1][0]
        assert len(pattern) == len(e["tokens"]) == 32
        assert all(n < q for n, q in e["targets"])
        assert all(v == 0 for q, row in enumerate(pattern) for k, v in enumerate(row) if k > q)
    i, needle, query = example_target(panel, 2)
    assert (needle % 4 == 2) and [needle, query] in ex["examples"][i]["targets"]


def test_panel_cache_is_keyed_by_config(tiny_figures, tmp_path, monkeypatch):
    sweep, _, _ = tiny_figures
    run = tmp_path / "run"
    shutil.copytree(run_of(sweep, "none_d4_h2_T32_s0"), run)
    import phasemech.interventions.ablation as ablation

    calls = []
    real = ablation.ablate
    monkeypatch.setattr(ablation, "ablate", lambda *a, **k: calls.append(1) or real(*a, **k))
    model_panel(run, TINY_PANEL)
    assert calls == []  # the pipeline's panel is reused
    other = PanelConfig(sequences=32, n_boot=20, n_perm=20)
    p = model_panel(run, other)
    assert calls == [1] and p["summary"]["n"] < 64 * 8
    model_panel(run, other)
    assert calls == [1]


def test_bad_input_is_named(tmp_path, tiny_figures):
    sweep, _, _ = tiny_figures
    with pytest.raises(FileNotFoundError, match="holds no trained run"):
        find_runs(tmp_path)
    with pytest.raises(ValueError, match=r"models \['nope'\] are not runs"):
        collect_panels(sweep, TINY_PANEL, models=["nope"])
    with pytest.raises(ValueError, match="sequences=0 is invalid"):
        PanelConfig(sequences=0)
    with pytest.raises(ValueError, match="multiple of the task stride"):
        model_panel(run_of(sweep, "none_d4_h2_T32_s0"), PanelConfig(sequences=66))
    with pytest.raises(ValueError, match="no panels"):
        render_dashboard([])
    panels = collect_panels(sweep, TINY_PANEL)
    with pytest.raises(ValueError, match="initial='nope' is not one of"):
        render_dashboard(panels, initial="nope")
    res = CliRunner().invoke(app, ["dashboard", str(tmp_path), "-o", str(tmp_path / "d.html")])
    assert res.exit_code == 1 and "holds no trained run" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["dashboard", str(sweep), "-o", str(tmp_path / "d.txt")])
    assert res.exit_code == 1 and "is an .html file" in " ".join(res.output.split())


def test_dashboard_file_is_self_contained(tiny_figures, tmp_path):
    sweep, _, _ = tiny_figures
    out = tmp_path / "dash.html"
    res = CliRunner().invoke(
        app,
        [
            "dashboard",
            str(sweep),
            "-o",
            str(out),
            "--sequences",
            "32",
            "--n-boot",
            "20",
            "--n-perm",
            "20",
        ],
    )
    assert res.exit_code == 0, res.output
    page = out.read_text()
    # plotly.js inlined, no script or stylesheet loaded from anywhere
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    assert js[1000:3000] in page and js[-2000:] in page
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page
    data = page_data(page)
    assert [m["name"] for m in data["models"]] == [r.name for r in find_runs(sweep)]
    # the CLI's settings differ from the pipeline's: their own cache folder, none overwritten
    runs = find_runs(sweep)
    assert all((panel_dir(r, TINY_PANEL) / "panel.json").is_file() for r in runs)
    assert all((r / "dashboard" / "n32_data777_boot20_perm20_seed0").is_dir() for r in runs)
    pipeline = page_data((tiny_figures[1] / "dashboard.html").read_text())
    assert data["models"][0]["summary"]["n"] < pipeline["models"][0]["summary"]["n"]
    # a name holding "</script>" or "<!--" cannot end or confuse the data block
    evil = dict(data["models"][0], name="</script><!--<script>x")
    block = render_dashboard([evil]).split('id="phasemech-data">')[1].split("</script>")[0]
    assert page_data(f'id="phasemech-data">{block}</script>')["models"][0]["name"] == evil["name"]


def test_dashboard_in_a_real_browser(tiny_figures, tmp_path):
    _, out, _ = tiny_figures
    page_path = out / "dashboard.html"
    captions = json.loads((out / "captions.json").read_text())["figures"]
    showcase = captions[-1]["caption"].split("Opens on ")[1].split(":")[0]
    data = page_data(page_path.read_text())
    with browser(page_path, "#heatmap .main-svg", 1300) as (page, errors):
        model = data["models"][int(page.input_value("#model"))]
        assert model["name"] == showcase  # opens on the pipeline's showcase model
        before = page.text_content("#head-title")
        start = page.evaluate("window.phasemechDashboard.state.h")
        target = (start + 1) % len(model["heads"])  # a head other than the one shown
        head = model["heads"][target]
        x, y = cell_xy(page, "heatmap", target, 2)
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        page.wait_for_function(
            "label => document.getElementById('head-title').textContent.endsWith(label)",
            arg=head["label"],
        )
        title = page.text_content("#head-title")
        table = page.inner_text("#head-numbers")
        assert title != before and title == f"{model['name']} · {head['label']}"
        rows = [r.split("\t") for r in table.strip().splitlines()[1 : 1 + model["phase_stride"]]]
        for ph, cells in enumerate(rows):
            fmt = _js_fixed3
            assert cells[1] == fmt(head["mass"][ph]) and cells[2] == fmt(head["effect"][ph])
        # the clicked column's phase is highlighted in the strip, the table and the slider
        assert page.input_value("#phase") == "2"
        assert page.get_attribute('#summary .phase[data-phase="2"]', "class").endswith("hl")
        assert page.get_attribute('#head-numbers tr[data-phase="2"]', "class") == "hl"
        # the phase slider moves the highlight everywhere
        page.fill("#phase", "1")
        page.dispatch_event("#phase", "input")
        assert page.text_content("#phase-label") == "1"
        assert page.get_attribute('#head-numbers tr[data-phase="1"]', "class") == "hl"
        # another model: the strip follows
        page.select_option("#design", "none")
        page.wait_for_function("document.getElementById('summary').textContent.includes('none_')")
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert errors == []
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def _fake_panel(name: str, design: str, d: int, seq: int = 16) -> dict:
    """A panel with undefined (None) numbers where real ones can be missing."""
    heads = []
    for layer in range(2):
        for h in range(2):
            effect = [round(0.01 * (p + h), 4) for p in range(d)]
            effect[1] = None  # a phase with no target
            heads.append(
                dict(
                    layer=layer,
                    head=h,
                    label=f"L{layer}H{h}",
                    compressed=layer == 1,
                    mass=[0.1] * d,
                    mass_n=[5] * d,
                    effect=effect,
                    effect_lo=[None] * d,
                    effect_hi=[None] * d,
                    effect_n=[5] * d,
                    effect_range=0.01 * d,
                    overall=0.0,
                    si=None,
                    p_holm=None,
                    served_phase=None,
                )
            )
    eye = [[1.0 if k == q else 0.0 for k in range(seq)] for q in range(seq)]
    return dict(
        name=name,
        design=design,
        stride=d,
        window=None,
        compressed_layers=[1],
        n_layers=2,
        n_heads=2,
        seq_len=seq,
        seed=0,
        trained_steps=None,
        phase_stride=d,
        grid_offset=0,
        grid_note="a test grid",
        summary=dict(
            accuracy=0.5,
            n=10,
            raw_gap=None,
            debiased_gap=None,
            gap_lo=None,
            gap_hi=None,
            p_perm=None,
            per_phase=[dict(phase=p, accuracy=None, lo=None, hi=None, n=0) for p in range(d)],
        ),
        heads=heads,
        example=dict(
            grid_offset=0,
            stride=d,
            examples=[
                dict(tokens=list(range(seq)), targets=[[2, seq - 1]], patterns=[[eye, eye]] * 2)
            ],
        ),
    )


def test_dashboard_switches_strides_and_shows_missing_numbers(tmp_path):
    page_path = tmp_path / "fake.html"
    panels = [_fake_panel("a<b>_d4", "mean", 4), _fake_panel("c_d8", "route", 8)]
    page_path.write_text(render_dashboard(panels, "fake <title>", initial="c_d8"))
    with browser(page_path, "#heatmap .main-svg", 1300) as (page, errors):
        assert page.input_value("#design") == "route" and page.get_attribute("#phase", "max") == "7"
        page.fill("#phase", "6")
        page.dispatch_event("#phase", "input")
        # to the d=4 model: the slider range follows and the out-of-range phase is cleared
        page.select_option("#design", "mean")
        page.wait_for_function("document.getElementById('phase').max === '3'")
        assert page.input_value("#phase") == "-1" and page.text_content("#phase-label") == "all"
        assert "a<b>_d4" in page.text_content("#summary")  # shown as text, not markup
        x, y = cell_xy(page, "heatmap", 3, 1)
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        page.wait_for_function("document.getElementById('head-title').textContent.endsWith('L1H1')")
        cells = page.inner_text('#head-numbers tr[data-phase="1"]').split("\t")
        assert cells[2] == "–" and cells[3] == "[–, –]"
        assert "debiased phase gap –" in page.text_content("#summary")
    assert errors == []


def _js_fixed3(v: float | None) -> str:
    """``v.toFixed(3)`` as the browser writes it: ties away from zero on the exact binary
    value (Python's format rounds ties to even: -0.0625 gives -0.062, the browser -0.063)."""
    if v is None:
        return "–"
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(v).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))
