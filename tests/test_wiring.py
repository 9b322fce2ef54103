"""One wiring (issue 39, item 1): a setting reaches the server core from its declaration alone.

The server is built from an experiment in one place (``ServerSpec.of``), and the spec carries the
validated experiment itself (``spec.settings``): a new setting is its declaration and its use. The
tests add a throw-away setting to the declarations and find it in the core from the YAML file,
``--set`` and the Flower run config; the Python API's keyword arguments are checked against the
declarations both ways, so a setting the API forgot fails.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml

from diff2_flwr import api
from diff2_flwr.runtime import config_experiment
from diff2_flwr.runtime.config import load_config, load_run_config, parse_config
from diff2_flwr.runtime.config_training import TrainingConfig
from diff2_flwr.runtime.server_core import ServerSpec
from diff2_flwr.runtime.session import build_server
from diff2_flwr.runtime.spec import argument_names, setting

BASE = {"name": "wiring", "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 400},
        "training": {"rounds": 4, "restart_every": 2, "clients": 2, "seed": 1},
        "evaluation": {"train_metrics": False, "test_metrics": False}}


@dataclasses.dataclass(frozen=True)
class _TrainingWithNewSetting(TrainingConfig):
    """The declarations with one setting more, as a developer would add it (declaration only)."""

    pld_check: bool = setting(True, "a throw-away setting of this test")


@pytest.fixture
def new_setting(monkeypatch):
    """``training.pld_check`` declared: the experiment's `training` section is the extended one."""
    monkeypatch.setattr(config_experiment, "TrainingConfig", _TrainingWithNewSetting)
    fields = {f.name: f for f in dataclasses.fields(config_experiment.ExperimentConfig)}
    monkeypatch.setattr(fields["training"], "default_factory", _TrainingWithNewSetting)
    return "training.pld_check"


def _arrived(cfg) -> bool:
    """What the server core sees of the setting."""
    server = build_server(cfg, record=False, progress=None)
    return server.spec.settings.training.pld_check


def test_a_new_setting_reaches_the_core_from_yaml_set_and_the_run_config(new_setting, tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({**BASE, "training": {**BASE["training"], "pld_check": False}}))
    assert _arrived(load_config(path)) is False  # the file
    path.write_text(yaml.safe_dump(BASE))
    assert _arrived(load_config(path)) is True  # its default
    assert _arrived(load_config(path, {new_setting: False})) is False  # --set
    # --run-config
    assert _arrived(load_run_config({"config": str(path), new_setting: "false"})) is False
    # the Python API: the setting is not an argument yet, and the check of both ways says so
    assert _settings_without_argument() == [new_setting]


def test_the_spec_is_built_in_one_place_from_the_experiment():
    cfg = parse_config(BASE, "e.yaml")
    server = build_server(cfg, record=False, progress=None)
    spec = server.spec
    assert spec.settings.training == cfg.training and spec.settings.privacy.n_min == server.n_min
    again = ServerSpec.of(spec.settings, layout=spec.layout, n_min=spec.n_min)
    assert again == spec  # nothing else decides what the server is
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rounds = 9  # type: ignore[misc]
    with pytest.raises(AttributeError):
        server.rounds = 9  # no pass-through setter makes the frozen spec mutable


def _settings_without_argument() -> list[str]:
    """Declared settings that are neither a make_strategy argument nor listed in
    ``api.NOT_ARGUMENTS``."""
    params = set(inspect.signature(api.make_strategy).parameters) - api._NOT_SETTINGS
    excluded = api.NOT_ARGUMENTS
    return sorted(key for key,
                  argument in argument_names(config_experiment.ExperimentConfig).items()
                  if argument not in params and key not in excluded
                  and not any(p.endswith(".") and key.startswith(p) for p in excluded))


def test_make_strategys_arguments_are_the_declared_settings_both_ways():
    names = argument_names(config_experiment.ExperimentConfig)
    params = set(inspect.signature(api.make_strategy).parameters) - api._NOT_SETTINGS
    assert _settings_without_argument() == []
    assert sorted(params - set(names.values())) == []  # every argument is a declared setting
    listed = [k for k in api.NOT_ARGUMENTS if not (k in names or any(n.startswith(k) for n in names
                                                                     if k.endswith(".")))]
    assert listed == []  # the exclusions name declared settings only


def test_the_batch_engine_sends_a_setting_it_does_not_honour_to_the_per_run_path(new_setting,
                                                                                 monkeypatch):
    """Issue 39, item 2 (the batch engine's part): a run that sets a setting the batched engine does
    not honour — one declared later, or evaluation.clip_stats — is not batched (where it would be
    ignored) but run on the per-run path, which honours every setting."""
    from types import SimpleNamespace

    from diff2_flwr.lab.study import plan as study_plan

    monkeypatch.setattr(study_plan, "batchable", lambda study, cfg: True)
    plain = parse_config(BASE, "e.yaml")
    new = parse_config({**BASE, "training": {**BASE["training"], "pld_check": False}}, "e.yaml")
    clip = parse_config({**BASE, "evaluation": {**BASE["evaluation"], "clip_stats": True}},
                        "e.yaml")
    assert study_plan.batch_ignores(plain) == []
    assert study_plan.batch_ignores(new) == [new_setting]
    assert study_plan.batch_ignores(clip) == ["evaluation.clip_stats"]
    jobs = [study_plan.Job(f"run-{i}", None, {}, 3.0, i, cfg) for i, cfg in enumerate([plain, plain,
                                                                                       new, clip])]
    units = study_plan.plan_units(SimpleNamespace(engine="batch", batch_size=8, workers=1), jobs)
    engine = {j.run_id: u.engine for u in units for j in u.jobs}
    assert engine == {"run-0": "batch", "run-1": "batch", "run-2": "inprocess",
                      "run-3": "inprocess"}
