"""Experiments as data and one launcher for them on Ray (see ``docs/experiments.md``).

The engine sits here (``experiment``, ``jobs``, ``launcher``, ``ray_connect``, ``lr_search``,
``configs``: the registry); each study is one folder (``sweep``, ``fixes``, ``theory_trained``,
``interventions``, ``head_attention``, ``pretrained``, ``showcase``, ``audit``, ``explain``:
its profiles or config, jobs, summary and study) and ``claims`` is the claims report, one module
per claim (``docs/layout.md``).
"""

from phasemech.experiments.configs import EXPERIMENTS, experiment
from phasemech.experiments.experiment import Experiment, Profile, run_experiment
from phasemech.experiments.jobs import Job, TrainJob
from phasemech.experiments.launcher import Failure, Launch, launch

__all__ = [
    "EXPERIMENTS",
    "Experiment",
    "Failure",
    "Job",
    "Launch",
    "Profile",
    "TrainJob",
    "experiment",
    "launch",
    "run_experiment",
]
