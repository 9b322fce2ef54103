"""`diff2 audit`'s settings and its regimes (issue 39, item 3): the settings it shares with a run
are the run's declarations (help, default unless the audit's differs on purpose, type, checks),
and `run_audit` takes one object per regime."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from diff2_flwr.lab.audit import runner
from diff2_flwr.lab.audit.canaries import canary_spec
from diff2_flwr.lab.audit.spec import WRAP, AuditSpec
from diff2_flwr.runtime import config_training
from diff2_flwr.runtime.config_privacy import LocalConfig, PrivacyConfig
from diff2_flwr.runtime.spec import require

#: The audit's field -> the run's setting it is (section, key).
SHARED = {"epsilon": (PrivacyConfig, "epsilon"), "delta": (PrivacyConfig, "delta"),
          "u": (PrivacyConfig, "u"), "noise": (PrivacyConfig, "noise"),
          "bits": (PrivacyConfig, "bits"), "tolerated": (PrivacyConfig, "tolerated"),
          "local_batch_size": (LocalConfig, "batch_size"), "local_share": (LocalConfig, "share"),
          "local_clip": (LocalConfig, "clip")}

#: The audit's defaults that differ from a run's on purpose (n = 16 records, a share that leaves
#: the one local step most of the budget).
AUDIT_DEFAULTS = {"local_batch_size": 8, "local_share": 0.98}


def test_the_shared_settings_are_the_runs_declarations():
    fields = {f.name: f for f in dataclasses.fields(AuditSpec)}
    hints = typing.get_type_hints(AuditSpec)
    shared = {name for name, f in fields.items() if "section" in f.metadata}
    assert shared == set(SHARED)
    for name, (section, key) in SHARED.items():
        declared = {f.name: f for f in dataclasses.fields(section)}[key]
        field = fields[name]
        assert (field.metadata["section"], field.metadata["key"]) == (section, key)
        assert field.metadata["help"].startswith(declared.metadata["help"])
        assert field.default == AUDIT_DEFAULTS.get(name, declared.default)
        assert hints[name] == typing.get_type_hints(section)[key]
    assert WRAP == PrivacyConfig().wrap
    # the run's sections are the same classes wherever the runtime names them
    assert config_training.PrivacyConfig is PrivacyConfig
    assert config_training.LocalConfig is LocalConfig


@pytest.mark.parametrize("changes,message", [
    ({"bits": 1}, r"`--bits` must be an integer in \[2, 31\] \(Flower's SecAgg\+ quantiser"),
    ({"bits": 20.5}, r"`--bits` must be an integer\. Found 20\.5\."),
    ({"local_clip": 0.0}, r"`--local-clip` must be a finite number > 0\. Found 0\.0\."),
    ({"local_batch_size": 0}, r"`--local-batch-size` must be an integer >= 1\. Found 0\."),
    ({"noise": "secure"}, r"`--noise` must be one of 'central', 'distributed'\."),
])
def test_the_runs_checks_are_the_audits(changes, message):
    with pytest.raises(ValueError, match=message):
        AuditSpec(**{"trials": 100, **changes})


def test_a_check_added_to_the_runs_section_applies_to_the_audit(monkeypatch):
    """The audit has no copy of the run's checks: a stricter one reaches it unchanged."""
    checks = PrivacyConfig.__post_init__

    def stricter(self):
        checks(self)
        require(self.bits >= 16, "bits", "at least 16", self.bits)

    monkeypatch.setattr(PrivacyConfig, "__post_init__", stricter)
    with pytest.raises(ValueError, match=r"`--bits` must be at least 16\. Found 12\."):
        AuditSpec(trials=100, bits=12)
    AuditSpec(trials=100, bits=16)


@pytest.mark.parametrize("changes,regime", [
    ({}, runner._Central), ({"method": "dpgd"}, runner._Central),
    ({"canaries": 4}, runner._Central), ({"noise": "distributed"}, runner._Distributed),
    ({"method": "diff2-bvr", "rounds": 4, "restart_every": 2}, runner._Local),
])
def test_one_object_per_regime(changes, regime):
    spec = AuditSpec(trials=100, **changes)
    chosen = runner._regime(spec)
    assert type(chosen) is regime and chosen.spec is spec
    if regime is runner._Central:  # a run of B canaries has its own n and d
        assert chosen.run == (canary_spec(spec) if spec.canaries > 1 else spec)
