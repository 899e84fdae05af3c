"""The cache keys of real-model runs recorded before the probe config existed: an audit's and
an explanation's jobs keep their keys (computed on the code before the change), so a rerun of a
recorded run reads its cache; a field added later is left out of the key at its default."""

from __future__ import annotations

import dataclasses

import pytest

from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.jobs import audit_jobs
from phasemech.experiments.explain.config import ExplainConfig
from phasemech.experiments.explain.jobs import explain_jobs
from phasemech.experiments.probe.config import LATER_FIELDS, ProbeConfig

SINK = dict(designs=("route", "evict"), top_k=2, sink_tokens=4, contexts=(512, 2048), contents=10)


@pytest.mark.parametrize(
    "cfg, key",
    [
        (AuditConfig(), "fea83294edc7e703"),
        (AuditConfig.of(**SINK, variants=("aligned", "per_head")), "60c37bfc47ddba46"),
    ],
)
def test_audit_keys_are_those_recorded(cfg, key):
    assert audit_jobs(cfg)[0].key == key


@pytest.mark.parametrize(
    "cfg, key",
    [
        (ExplainConfig(), "b0822da6f6cfba12"),
        (ExplainConfig.of(design="evict", top_k=2, offsets="per_head", context=2048, contents=8),
         "f9949669937c5961"),
    ],
)  # fmt: skip
def test_explain_keys_are_those_recorded(cfg, key):
    assert explain_jobs(cfg, "observe", [0, 1, 2])[0].key == key


def test_a_later_field_leaves_the_key_at_its_default_and_changes_it_otherwise():
    base = ProbeConfig()
    for name in LATER_FIELDS:
        assert name not in base.to_dict()
    with_sink = dataclasses.replace(base, sink_tokens=4)
    assert with_sink.to_dict()["sink_tokens"] == 4
    assert audit_jobs(AuditConfig(with_sink))[0].key != audit_jobs(AuditConfig(base))[0].key
    assert ProbeConfig(sink_tokens=0) == base  # no sink is the default, not a new key
