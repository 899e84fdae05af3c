"""The README's quick start runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python quick start"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    assert "L1H3" in printed  # the head-by-phase table
    assert tuple(namespace["pa"].tensor.shape) == (2, 4, 4)


def test_readme_training_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    code = blocks[1]
    assert "steps=8000" in code and "balanced_test_set(cfg.task)" in code
    # the same code at toy size: few steps, a small test set
    code = code.replace("steps=8000", "steps=2, eval_every=1, eval_sequences=16")
    code = code.replace("balanced_test_set(cfg.task)", "balanced_test_set(cfg.task, 16)")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    assert "stride 4:" in capsys.readouterr().out
    assert (tmp_path / "runs/gated_d4/eval/report.json").is_file()


def test_readme_interventions_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    train_code = blocks[1].replace("steps=8000", "steps=2, eval_every=1, eval_sequences=16")
    train_code = train_code.replace(
        "balanced_test_set(cfg.task)", "balanced_test_set(cfg.task, 16)"
    )
    code = blocks[2]
    assert "balanced_test_set(cfg.task, 1024)" in code and "n_pairs=256" in code
    # the same code at toy size
    code = code.replace("balanced_test_set(cfg.task, 1024)", "balanced_test_set(cfg.task, 16)")
    code = code.replace("n_pairs=256", "n_pairs=8").replace("range(256)", "range(16)")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(train_code, str(README), "exec"), namespace)  # noqa: S102
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    assert "resid_pre.1" in capsys.readouterr().out  # the probe table was printed
    assert "served_phase" in namespace["ab"].specialization().columns
    assert namespace["exact"].tensor().shape == (2, 64, 2)  # layer, pos, head
    assert set(namespace["probe"].frame.label) == {"phase", "pos_mod_d"}


def test_the_command_table_lists_every_command():
    """The front page's command table names every command of the ``phasemech`` app, and every
    experiment of the registry that ``phasemech run`` takes."""
    import typer

    from phasemech.cli import app
    from phasemech.experiments import EXPERIMENTS

    text = README.read_text()
    table = text[text.index("## Command line") : text.index("## Documentation")]
    named = set(re.findall(r"`phasemech ([a-z-]+)", table))
    commands = set(typer.main.get_command(app).commands)
    assert commands - named == set(), f"commands missing from the README table: {commands - named}"
    run = next(line for line in table.splitlines() if "phasemech run EXPERIMENT" in line)
    assert all(f"`{name}`" in run for name in EXPERIMENTS), run
