"""The package's layers, as the tree shows them: a layer imports only the layers below it, and
no module imports one that imports it back (no import cycle, inside a layer either).

Every ``import`` in every module counts, including those inside functions and under
``TYPE_CHECKING`` (a lazy import is still a dependency). ``phasemech/__init__.py`` and the
old-path shim ``_legacy.py`` are exempt from the layer order: they only re-export.

Private means private: no file in ``phasemech/``, ``bench/``, ``analyses/`` or ``tests/`` imports
a ``_name`` from another phasemech module (a private module such as ``_legacy`` is no name).
"""

import ast
from itertools import pairwise
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


def module_name(rel: Path) -> str:
    """``phasemech/a/b.py`` -> ``phasemech.a.b``; a package's ``__init__.py`` is the package."""
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """``module -> {module it imports: line}`` among ``sources`` (module name -> source).

    Every import counts (inside functions too); ``from pkg import sub`` names the submodule
    ``pkg.sub`` where one exists, else the package (``from pkg import name``). Importing a
    submodule runs its package's ``__init__`` too, but that is no edge: a package may re-export
    its own modules."""
    graph: dict[str, dict[str, int]] = {}
    for mod, source in sources.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in sources else node.module for t in subs]
            else:
                continue
            for target in targets:
                if target in sources and target != mod:
                    edges.setdefault(target, node.lineno)
        graph[mod] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per import cycle (per strongly connected group of modules), as a path through
    it with the line of each import: ``a:3 -> b:10 -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_path(graph, group) for group in groups]


def _cycle_path(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """The shortest way from the group's first module back to it, inside the group."""
    start, inside = group[0], set(group)
    came: dict[str, str] = {}  # module -> the module it was first reached from
    frontier = [start]
    while start not in came:
        reached = []
        for v in frontier:
            for w in graph[v]:
                if w in inside and w not in came:
                    came[w] = v
                    reached.append(w)
        frontier = reached
    path = [start, came[start]]
    while path[-1] != start:
        path.append(came[path[-1]])
    path.reverse()
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in pairwise(path)) + f" -> {start}"


def test_no_import_cycles():
    sources = {module_name(p.relative_to(ROOT)): p.read_text() for p in sorted(PKG.rglob("*.py"))}
    cycles = import_cycles(import_graph(sources))
    assert not cycles, "import cycles (move the shared piece to the lower module):\n" + "\n".join(
        cycles
    )


def test_the_cycle_check_catches_lazy_and_package_cycles():
    planted = {
        "phasemech.a": "from phasemech.b import f\n",
        "phasemech.b": "def f():\n    from phasemech.a import g\n",  # lazy: still a cycle
        "phasemech.p": "from phasemech.p.q import h\n",  # a package re-exporting its module
        "phasemech.p.q": "import numpy\n",
        "phasemech.r": "from phasemech.p import q\n",  # the submodule, not the package
    }
    assert import_cycles(import_graph(planted)) == ["phasemech.a:1 -> phasemech.b:2 -> phasemech.a"]
    planted["phasemech.p.q"] = "from phasemech.p import h\n"  # the package's name: a cycle
    assert (
        import_cycles(import_graph(planted))[1] == "phasemech.p:1 -> phasemech.p.q:1 -> phasemech.p"
    )


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


#: every folder whose files may import phasemech: a private name stays private in all of them
SCANNED = ("phasemech", "bench", "analyses", "tests")


def is_private(name: str) -> bool:
    """``_x``: one leading underscore, not a dunder (``__version__`` is public)."""
    return name.startswith("_") and not name.startswith("__")


def private_imports(rel: Path, source: str, modules: set[str]) -> list[str]:
    """Every ``_name`` a file imports from another phasemech module, ``file:line`` first.

    ``modules``: the dotted names of phasemech's modules and packages. A private *module*
    (``from phasemech import _legacy``) is no name, so it is not counted; a module's import of
    its own name is no crossing either. Lazy imports (inside functions) count."""
    own = module_name(rel) if rel.parts[0] == "phasemech" else None
    found = []  # (line, name, module); ast.walk reaches lazy imports last, so sort by line
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module.split(".")[0] != "phasemech" or node.module == own:
            continue
        found += [(node.lineno, a.name, node.module) for a in node.names
                  if is_private(a.name) and f"{node.module}.{a.name}" not in modules]  # fmt: skip
    return [
        f"{rel}:{line} imports {name} from {module}: make it public there (or move it to where "
        "it is used)"
        for line, name, module in sorted(found)
    ]


def package_modules() -> set[str]:
    return {module_name(p.relative_to(ROOT)) for p in PKG.rglob("*.py")}


def test_no_file_imports_another_modules_private_name():
    modules = package_modules()
    bad = [
        v
        for folder in SCANNED
        for p in sorted((ROOT / folder).rglob("*.py"))
        for v in private_imports(p.relative_to(ROOT), p.read_text(), modules)
    ]
    assert not bad, f"{len(bad)} private names imported across modules:\n" + "\n".join(bad)


def test_the_private_check_catches_a_private_import():
    modules = {"phasemech", "phasemech._legacy", "phasemech.a", "phasemech.p", "phasemech.p._sub"}
    test = Path("tests/test_planted.py")
    planted = (
        "from phasemech.a import _helper, public, __version__\n"
        "def f():\n"
        "    from phasemech import _hidden\n"  # lazy, and from the package: still a crossing
        "from phasemech import _legacy\n"  # a private module is no name
        "from phasemech.p import _sub\n"
        "from elsewhere import _theirs\n"  # not phasemech's to police
    )
    assert private_imports(test, planted, modules) == [
        f"{test}:1 imports _helper from phasemech.a: make it public there (or move it to where "
        "it is used)",
        f"{test}:3 imports _hidden from phasemech: make it public there (or move it to where it "
        "is used)",
    ]
    assert private_imports(test, "from phasemech.a import public, __version__\n", modules) == []
    own = Path("phasemech/a.py")  # a module importing its own private name crosses nothing
    assert private_imports(own, "def f():\n    from phasemech.a import _helper\n", modules) == []


@pytest.mark.parametrize(
    "old, names",
    [
        ("phasemech.stats", ["phase_report", "compare_gaps"]),
        ("phasemech.train", ["train", "TrainConfig", "read_metrics", "reference_grid"]),
        ("phasemech.evaluate", ["evaluate", "load_trained", "balanced_test_set"]),
        ("phasemech.dashboard", ["build_dashboard", "render_dashboard"]),
        ("phasemech.experiments.sweep_summary", ["summary_markdown", "matched_gaps"]),
        ("phasemech.experiments.fixes_summary", ["summary_markdown", "budget_markdown"]),
        ("phasemech.experiments.audit_fixes", ["fix_table", "VARIANTS", "GOAL_REDUCTION"]),
        ("phasemech.experiments.panels", ["PanelConfig", "build_dashboard"]),
        ("phasemech.experiments.converged_claims", ["converged_claim_lines", "TABLES"]),
        ("phasemech.experiments.explain_claims", ["real_model_lines"]),
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
