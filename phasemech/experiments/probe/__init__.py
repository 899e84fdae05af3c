"""The real-model study family's shared parts: what a study probes (``config``:
:class:`~phasemech.experiments.probe.config.ProbeConfig`, the one constructor of each design's
compression, the KV budget) and the worker that scores its prompts (``worker``: the model
loaded once per worker process, the answer-onto-needle hooks, prompt scoring, the checks before
any forward). ``audit``, ``explain`` and the studies after them contain the config and import
the worker; this folder is no study of its own.
"""

from phasemech.experiments.probe.config import PROBE_DESIGNS, ProbeConfig, kv_budget

__all__ = ["PROBE_DESIGNS", "ProbeConfig", "kv_budget"]
