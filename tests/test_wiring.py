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


# ------------------------------------------------------------------------- a setting's use

#: Sections whose keys may reach their use as keyword arguments (``**section``) rather than as
#: attributes: such a key is read when it is a keyword parameter of the function named.
_PASSED_AS_KEYWORDS = {"dataset.partitioner.": ("diff2_flwr.task.partitions", "partition")}
#: Where the settings are declared and parsed (a read there is not a use).
_DECLARING = ("diff2_flwr/runtime/config", "diff2_flwr/runtime/spec.py")


def _reads() -> set[str]:
    """Every attribute name read (``x.name`` in a load context) in the package and the two apps,
    outside the modules that declare and parse the settings."""
    import ast
    import pathlib

    root = pathlib.Path(api.__file__).resolve().parents[1]
    names: set[str] = set()
    for folder in ("diff2_flwr", "server", "clients"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).as_posix().startswith(_DECLARING):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    names.add(node.attr)
    return names


def _unused(keys) -> list[str]:
    """The declared keys whose leaf is never read: neither an attribute read outside the
    declarations nor a keyword parameter of the function their section is passed to."""
    import importlib

    reads = _reads()
    out = []
    for key in keys:
        leaf = key.rsplit(".", 1)[-1]
        section = next((s for s in _PASSED_AS_KEYWORDS if key.startswith(s)), None)
        used = leaf in reads
        if section is not None and not used:
            module, function = _PASSED_AS_KEYWORDS[section]
            used = leaf in inspect.signature(
                getattr(importlib.import_module(module), function)).parameters
        if not used:
            out.append(key)
    return out


def test_every_declared_setting_is_read_somewhere():
    """A setting is its declaration and its use: a declared key nothing reads (its use forgotten)
    fails here. The check is by name (a leaf such as ``seed`` is read in many places, so it proves
    little for common names); it catches a new, specifically named setting whose use was never
    written."""
    from diff2_flwr.runtime.config import config_keys

    assert _unused(config_keys()) == []


def test_the_use_check_catches_a_setting_declared_and_never_read():
    assert _unused(["privacy.pld_check", "dataset.partitioner.pld_check",
                    "privacy.epsilon", "dataset.partitioner.alpha"]) == [
        "privacy.pld_check", "dataset.partitioner.pld_check"]
