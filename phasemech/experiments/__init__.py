"""Experiments as data and one launcher for them on Ray (see ``docs/experiments.md``)."""

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
