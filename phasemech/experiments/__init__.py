"""Experiments as lists of jobs, run by one launcher on Ray (embedded locally or on a cluster).

``experiment(name, profile)`` builds the jobs; ``launch(jobs, results)`` runs what is not cached.
"""

from phasemech.experiments.configs import EXPERIMENTS, experiment
from phasemech.experiments.jobs import Job, TrainJob
from phasemech.experiments.launcher import Failure, Launch, launch

__all__ = ["EXPERIMENTS", "Failure", "Job", "Launch", "TrainJob", "experiment", "launch"]
