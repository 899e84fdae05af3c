"""Module paths from before the layered tree (``phasemech.stats``, ``phasemech.train``, ...)
keep importing: each is served by the module(s) its names moved to, with a
``DeprecationWarning`` naming the new home. Nothing in phasemech itself uses them."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Any

#: old module -> the modules its public names live in now (looked up in this order)
MOVED: dict[str, tuple[str, ...]] = {
    "phasemech.validation": ("phasemech.core.validation",),
    "phasemech.io": ("phasemech.core.io",),
    "phasemech.progress": ("phasemech.core.progress",),
    "phasemech.config": ("phasemech.core.config",),
    "phasemech.grid": ("phasemech.core.grid",),
    "phasemech.phase": ("phasemech.model.phase",),
    "phasemech.pretrained": ("phasemech.model.pretrained",),
    "phasemech.readout": ("phasemech.measure.readout",),
    "phasemech.tasks": ("phasemech.data.tasks",),
    "phasemech.passkey": ("phasemech.data.passkey",),
    "phasemech.evaluate": (
        "phasemech.measure.evaluate",
        "phasemech.training.checkpoints",
        "phasemech.data.tasks",
    ),
    "phasemech.stats": ("phasemech.measure.stats",),
    "phasemech.pretrained_sweep": (
        "phasemech.measure.pretrained",
        "phasemech.experiments.pretrained",
    ),
    "phasemech.ablation": ("phasemech.interventions.ablation",),
    "phasemech.patching": ("phasemech.interventions.patching",),
    "phasemech.probes": ("phasemech.interventions.probes",),
    "phasemech.train": (
        "phasemech.training.trainer",
        "phasemech.training.config",
        "phasemech.training.checkpoints",
        "phasemech.core.grid",
        "phasemech.measure.readout",
    ),
    "phasemech.theory_fit": ("phasemech.theory.fit",),
    "phasemech.dashboard": ("phasemech.experiments.showcase.panels", "phasemech.viz.dashboard"),
    # the experiments room, one folder per study (issue 37); an old module that became its
    # study's folder (``experiments.sweep``, ``fixes``, ``audit``, ...) re-exports its names
    "phasemech.experiments.sweep_summary": ("phasemech.experiments.sweep.summary",),
    "phasemech.experiments.fixes_summary": ("phasemech.experiments.fixes.summary",),
    "phasemech.experiments.theory_summary": ("phasemech.experiments.theory_trained.summary",),
    "phasemech.experiments.interventions_summary": ("phasemech.experiments.interventions.summary",),
    "phasemech.experiments.panels": ("phasemech.experiments.showcase.panels",),
    "phasemech.experiments.audit_fixes": (
        "phasemech.experiments.audit.fixes",
        "phasemech.experiments.fixes.profiles",
        "phasemech.experiments.probe.config",
    ),
    "phasemech.experiments.audit_score": ("phasemech.experiments.probe.worker",),
    # the real-model studies' probe, worker and launcher (issue 48)
    "phasemech.experiments.audit.score": ("phasemech.experiments.probe.worker",),
    "phasemech.experiments.audit_report": ("phasemech.experiments.audit.summary",),
    "phasemech.experiments.explain_tables": (
        "phasemech.experiments.explain.tables",
        "phasemech.experiments.explain.run",
    ),
    "phasemech.experiments.explain_report": ("phasemech.experiments.explain.summary",),
    "phasemech.experiments.converged_claims": ("phasemech.experiments.claims.converged",),
    "phasemech.experiments.systems_claims": ("phasemech.experiments.claims.systems",),
    "phasemech.experiments.audit_fixes_claims": ("phasemech.experiments.claims.real_fixes",),
    "phasemech.experiments.explain_claims": ("phasemech.experiments.claims.specialisation",),
}


class MovedModule(types.ModuleType):
    """Stands in for an old module path: attribute lookups go to the new homes."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved: its names now live in {', '.join(homes)}.")
        self.__homes = homes

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for home in self.__homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"{self.__name__}.{attr}: not found in {', '.join(self.__homes)}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: Any) -> types.ModuleType:
        homes = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' / '.join(homes)}; the old path will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return MovedModule(spec.name, homes)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
