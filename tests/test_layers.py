"""The package's layers, as the tree shows them: a layer imports only the layers below it.

Every ``import`` in every module counts, including those inside functions (a lazy import is
still a dependency). ``phasemech/__init__.py`` and the old-path shim ``_legacy.py`` are exempt:
they only re-export.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "phasemech"
#: bottom to top; a module may import its own layer and the layers before it
LAYERS = (
    "core",
    "attention",
    "model",
    "data",
    "theory",
    "measure",
    "interventions",
    "training",
    "viz",
    "experiments",
    "cli",
)
#: stricter than the order: figures never reach a model (they take tables)
ONLY = {"viz": {"core", "theory", "viz"}, "attention": {"core", "attention"}}
NO_MODEL_LIBS = {"torch", "transformer_lens"}
EXEMPT = {"phasemech/__init__.py", "phasemech/_legacy.py"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "phasemech", module
    return parts[1] if len(parts) > 1 else "phasemech"


def imports(rel: Path, source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in a file."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "phasemech":  # `from phasemech import viz`: the submodules named
                out += [(node.lineno, f"phasemech.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{rel}:{node.lineno}: relative import; spell it absolutely")
    return out


def module_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if str(p.relative_to(ROOT)) not in EXEMPT)


def violations(rel: Path, source: str) -> list[str]:
    """The layering rules broken by one file (``rel``: its path from the repository root)."""
    own = rel.stem if rel.parent == Path("phasemech") else rel.parts[1]
    rank = LAYERS.index(own)
    bad = []
    for line, mod in imports(rel, source):
        top = mod.split(".")[0]
        if top == "analyses":
            bad.append(f"{rel}:{line} imports {mod}: the library never imports analyses/")
        if own in ONLY and top in NO_MODEL_LIBS and own == "viz":
            bad.append(f"{rel}:{line} imports {mod}: figures take tables, they never run a model")
        if top != "phasemech":
            continue
        other = layer_of(mod)
        if other in ("phasemech", "_legacy"):
            bad.append(f"{rel}:{line} imports {mod}: import the module that defines the name")
        elif other not in LAYERS:
            bad.append(f"{rel}:{line} imports {mod}: not a module in any layer")
        elif own in ONLY and other not in ONLY[own]:
            bad.append(f"{rel}:{line} imports {mod}: {own} imports only {sorted(ONLY[own])}")
        elif LAYERS.index(other) > rank:
            bad.append(f"{rel}:{line} imports {mod}: {other} is above {own}")
    return bad


def test_every_module_sits_in_a_layer():
    tops = {p.relative_to(PKG).parts[0].removesuffix(".py") for p in module_files()}
    assert tops <= set(LAYERS), f"modules outside the layers: {sorted(tops - set(LAYERS))}"


def test_layers_import_only_downwards():
    bad = [v for p in module_files() for v in violations(p.relative_to(ROOT), p.read_text())]
    assert not bad, "\n".join(bad)


def test_the_check_catches_what_it_forbids():
    measure = Path("phasemech/measure/planted.py")
    lazy_up = "def f():\n    from phasemech.training.trainer import train\n"
    assert violations(measure, lazy_up) == [
        f"{measure}:2 imports phasemech.training.trainer: training is above measure"
    ]
    below = "import torch\nfrom phasemech.model.phase import phase_attention\n"
    assert violations(measure, below) == []
    viz = Path("phasemech/viz/planted.py")
    runs_a_model = "import torch\nfrom phasemech.measure.stats import per_phase\n"
    assert len(violations(viz, runs_a_model)) == 2
    core = Path("phasemech/core/planted.py")
    bad = violations(core, "import analyses.report\nfrom phasemech import stats\n")
    assert [b.split(": ")[-1] for b in bad] == [
        "the library never imports analyses/",
        "not a module in any layer",
    ]


@pytest.mark.parametrize(
    "old, names",
    [
        ("phasemech.stats", ["phase_report", "compare_gaps"]),
        ("phasemech.train", ["train", "TrainConfig", "read_metrics", "reference_grid"]),
        ("phasemech.evaluate", ["evaluate", "load_trained", "balanced_test_set"]),
        ("phasemech.dashboard", ["build_dashboard", "render_dashboard"]),
    ],
)
def test_old_module_paths_still_import_with_a_warning(old, names):
    import importlib
    import sys

    import phasemech._legacy as legacy

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.") + " moved to"):
        module = importlib.import_module(old)
    homes = [importlib.import_module(h) for h in legacy.MOVED[old]]
    for name in names:
        assert getattr(module, name) is next(getattr(h, name) for h in homes if hasattr(h, name))
    with pytest.raises(AttributeError, match="not_a_name"):
        module.not_a_name  # noqa: B018


def test_analyses_scripts_import_only_the_library():
    # a script in analyses/ is a leaf: it imports phasemech and third-party packages, never a
    # sibling script (what two scripts share belongs in the library) and never edits sys.path
    scripts = sorted((ROOT / "analyses").glob("*.py"))
    siblings = {p.stem for p in scripts}
    bad = []
    for path in scripts:
        rel = path.relative_to(ROOT)
        source = path.read_text()
        if "sys.path" in source:
            bad.append(f"{rel}: edits sys.path")
        for line, mod in imports(rel, source):
            if mod.split(".")[0] in siblings | {"analyses"}:
                bad.append(f"{rel}:{line} imports {mod}: move what it shares into phasemech")
    assert not bad, "\n".join(bad)
