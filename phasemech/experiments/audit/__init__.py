"""``phasemech audit``: does a compression design's retrieval depend on the needle's phase, on a
real model, at long context, in the regime the design serves?

Axes: ``setting`` (``null``: the uncompressed model; then one per design), ``phase``, ``depth``,
``layer``, ``head``; prompts are rows of tidy frames.

An audit is one :class:`AuditConfig`: a probe (:class:`~phasemech.experiments.probe.config.
ProbeConfig`, shared by every real-model study: a model, one or more designs, each a post-hoc
:class:`~phasemech.core.config.CompressionConfig` on the model's own weights, a regime
(``trained``: every query reads the compressed history; ``decode``: a full-attention prefill of
the document, then the question and answer read the compressed cache,
:mod:`phasemech.model.decode`), contexts and a retrieval task whose prompts put every content
at every phase at every depth, :mod:`phasemech.data.retrieval`). The null and every design
score the SAME prompts (paired). Prompts run in chunks as jobs on the experiment launcher
(embedded Ray, or a cluster by ``address``), cached by config under ``OUT/jobs``: a rerun (or
one with other statistics sizes) computes nothing, a killed one resumes; other prompts,
designs or grids are a new audit. In the decode regime one prefill serves the null and every
design. :mod:`phasemech.experiments.audit.summary` turns the scored prompts into the
audit's tables, ``summary.md`` and ``audit.html``.

One folder, one study (the old module path still imports these names):

- ``config``: :class:`AuditConfig` (what one audit is) and what an audit may take;
- ``jobs``: :class:`AuditJob` (a chunk of prompts on the launcher, scored by the real-model
  worker, :mod:`phasemech.experiments.probe.worker`);
- ``study``: :data:`AUDIT` (the experiment: ``phasemech run audit``) and :func:`run_audit`
  (check, run the jobs through the launcher, write the report);
- ``fixes``: the grid variants of a design and their tables against the aligned baseline;
- ``summary``: the report: tidy tables, ``summary.md``, ``summary.json`` and ``audit.html``.
"""

from phasemech.experiments.audit.config import AUDIT_DESIGNS, AUDIT_OFFSETS, HOSTS, AuditConfig
from phasemech.experiments.audit.jobs import AuditJob, audit_jobs
from phasemech.experiments.audit.study import AUDIT, check_audit, run_audit

__all__ = [
    "AUDIT",
    "AUDIT_DESIGNS",
    "AUDIT_OFFSETS",
    "AuditConfig",
    "AuditJob",
    "HOSTS",
    "audit_jobs",
    "check_audit",
    "run_audit",
]
