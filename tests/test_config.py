"""Tests for diff2_flwr.runtime.config: loading, validation and the derived mechanism."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from diff2_flwr.runtime.config import ConfigError, ExperimentConfig, load_config

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def _default_dict() -> dict[str, Any]:
    """configs/default.yaml with P = 10, as `diff2 run` resolves its ``training.clients: auto``."""
    data = yaml.safe_load(DEFAULT_YAML.read_text())
    assert data["training"]["clients"] == "auto"
    data["training"]["clients"] = 10
    return data


def _write(tmp_path: Path, data: Any, name: str = "exp.yaml") -> Path:
    """Dump ``data`` as YAML into tmp_path and return the file's path."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


_DELETE = object()  # marks a key to remove in _variant


def _variant(tmp_path: Path, top: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Path:
    """The default config with top-level and per-section overrides (value None deletes a key)."""
    data = copy.deepcopy(_default_dict())
    for mapping, overrides in [(data, top or {})] + [(data.setdefault(s, {}), o) for s,
                                                     o in sections.items()]:
        for key, value in overrides.items():
            if value is _DELETE:
                mapping.pop(key, None)
            else:
                mapping[key] = value
    return _write(tmp_path, data)



def _msg(path: Path, key: str, found: str) -> str:
    """A regex requiring the file, the key and the found value in the message, in that order."""
    return rf"{re.escape(str(path))}.*{re.escape(key)}.*Found {found}"


# --------------------------------------------------------------------------- the default file

def test_default_yaml_loads_with_its_values() -> None:
    """configs/default.yaml loads; values come from the file, not dataclass defaults."""
    cfg = load_config(DEFAULT_YAML)
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.method == "diff2"
    assert cfg.restart_every == 10
    assert cfg.training.rounds == 100
    assert cfg.training.clip_diff == 3.0  # the dataclass default is 1.0
    assert cfg.training.learning_rate == 0.2  # the dataclass default is 0.25
    assert cfg.privacy.delta == 1e-5 and cfg.privacy.u == 1.25
    assert cfg.dataset.name == "synthetic" and cfg.dataset.num_samples == 10000
    assert cfg.training.seed is None
    assert cfg.source == str(DEFAULT_YAML)
    assert cfg.private


def test_the_default_leaves_p_to_the_federation_and_says_so_where_a_number_is_needed() -> None:
    """configs/default.yaml says `clients: auto`: P is resolved by whoever runs it (with_clients),
    re-checked with that P; a number asked of an unresolved config is a ConfigError naming the key
    and what resolves it."""
    cfg = load_config(DEFAULT_YAML)
    assert cfg.clients_auto and cfg.training.clients == "auto"
    with pytest.raises(ConfigError,
                       match=r"key `training.clients`: expected the number of clients P here\. "
                             r"Found 'auto', which only a federation resolves \(a Flower "
                             r"simulation: its SuperNodes; `diff2 run`: 10, or --set "
                             r"training.clients=N\)"):
        cfg.calibration(N_MIN)
    two = cfg.with_clients(2)
    assert two.clients == 2 and not two.clients_auto and two.source == cfg.source
    assert two.calibration(N_MIN).clients == 2 and two.calibration(N_MIN) != cfg.with_clients(
        10).calibration(N_MIN)
    assert two == load_config(DEFAULT_YAML, {"training.clients": 2})  # as if the file said 2


def test_a_resolved_p_is_checked_like_a_declared_one(tmp_path: Path) -> None:
    """The checks that need P run when auto is resolved, naming where the number came from."""
    path = _variant(tmp_path, dataset={"train_samples": 100, "partitioner": {"name": "iid",
                                                                             "min_samples": 20}},
                    training={"clients": "auto"})
    cfg = load_config(path)  # no P yet: nothing to check against
    assert cfg.with_clients(5).clients == 5
    with pytest.raises(ConfigError,
                       match=re.escape(f"{path} (P = 6: the simulation's SuperNodes): key "
                                                    "`dataset.train_samples`: expected at least "
                                                    "training.clients × "
                                                    "dataset.partitioner.min_samples = 6 × 20 = "
                                                    "120 records")):
        cfg.with_clients(6, "the simulation's SuperNodes")
    with pytest.raises(ConfigError,
                       match=r"key `training.clients`: expected an integer >= 1, or auto"):
        cfg.with_clients(0)


def test_config_is_frozen() -> None:
    """Assigning to the config or a section raises FrozenInstanceError."""
    cfg = load_config(DEFAULT_YAML)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.method = "gd"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.rounds = 5  # type: ignore[misc]
    assert cfg.method == "diff2" and cfg.training.rounds == 100


def test_int_given_for_float_is_accepted_and_converted(tmp_path: Path) -> None:
    """An integer where a number is expected is fine and becomes a float."""
    cfg = load_config(_variant(tmp_path, privacy={"epsilon": 2}))
    assert cfg.privacy.epsilon == 2.0 and isinstance(cfg.privacy.epsilon, float)


# --------------------------------------------------------------------------- unknown keys and types

def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = _variant(tmp_path, top={"epsilonn": 3.0})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*unknown key epsilonn\b"):
        load_config(path)


def test_unknown_key_in_section_is_qualified(tmp_path: Path) -> None:
    """A typo inside a section is reported as section.key."""
    path = _variant(tmp_path, training={"roundz": 10})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*training\.roundz") as info:
        load_config(path)
    assert "Allowed in training" in str(info.value) and "rounds" in str(info.value)


@pytest.mark.parametrize(
    ("section", "key", "value", "expected", "found"),
    [
        ("training", "learning_rate", "fast", "a number", "'fast'"),
        ("training", "rounds", "10", "an integer", "'10'"),
        ("training", "rounds", 10.0, "an integer", r"10\.0"),
        ("training", "rounds", 2.5, "an integer", r"2\.5"),
        ("training", "clients", True, "an integer or 'auto'", "True"),
        ("privacy", "epsilon", False, "a number", "False"),
        ("training", "seed", "abc", "an integer or null", "'abc'"),
        ("privacy", "mode", "approx", "one of 'exact', 'rdp'", "'approx'"),
    ],
)
def test_wrong_type_names_file_key_expected_and_found(
    tmp_path: Path, section: str, key: str, value: Any, expected: str, found: str
) -> None:
    path = _variant(tmp_path, **{section: {key: value}})
    pattern = (rf"{re.escape(str(path))}: key `{section}\.{key}`: expected "
               rf"{re.escape(expected)}\. Found {found}\.")
    with pytest.raises(ConfigError, match=pattern):
        load_config(path)


def test_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = _variant(tmp_path, top={"training": [1, 2]})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*`training` must be a mapping"):
        load_config(path)


# --------------------------------------------------------------------------- value checks

@pytest.mark.parametrize("epsilon", [0, -1.0])
def test_epsilon_must_be_positive(tmp_path: Path, epsilon: float) -> None:
    path = _variant(tmp_path, privacy={"epsilon": epsilon})
    with pytest.raises(ConfigError, match=_msg(path, "privacy.epsilon",
                                               re.escape(repr(float(epsilon))))):
        load_config(path)


@pytest.mark.parametrize("delta", [0, 1, 1.5])
def test_delta_must_be_in_open_unit_interval(tmp_path: Path, delta: float) -> None:
    path = _variant(tmp_path, privacy={"delta": delta})
    with pytest.raises(ConfigError, match=_msg(path, "privacy.delta",
                                               re.escape(repr(float(delta))))):
        load_config(path)


def test_delta_inside_interval_is_accepted(tmp_path: Path) -> None:
    assert load_config(_variant(tmp_path, privacy={"delta": 0.5})).privacy.delta == 0.5


def test_restart_every_must_be_at_least_one(tmp_path: Path) -> None:
    path = _variant(tmp_path, training={"restart_every": 0})
    with pytest.raises(ConfigError, match=_msg(path, "training.restart_every", "0")):
        load_config(path)


@pytest.mark.parametrize("u", [1.0, 0.5])
def test_diff2_needs_u_above_one_when_restart_every_above_one(tmp_path: Path, u: float) -> None:
    path = _variant(tmp_path, privacy={"u": u})
    with pytest.raises(ConfigError, match=_msg(path, "privacy.u", re.escape(repr(u)))):
        load_config(path)


def test_u_one_is_fine_for_dpgd(tmp_path: Path) -> None:
    """DP-GD has no difference rounds, so u is irrelevant."""
    path = _variant(tmp_path, top={"method": "dpgd"}, privacy={"u": 1.0},
                    training={"restart_every": _DELETE})
    cfg = load_config(path)
    assert cfg.method == "dpgd" and cfg.restart_every == 1 and cfg.privacy.u == 1.0


def test_restart_every_may_not_exceed_rounds(tmp_path: Path) -> None:
    path = _variant(tmp_path, training={"rounds": 20, "restart_every": 21})
    with pytest.raises(ConfigError, match=_msg(path, "training.restart_every", "21")) as info:
        load_config(path)
    assert "training.rounds = 20" in str(info.value)


def test_restart_every_equal_to_rounds_is_accepted(tmp_path: Path) -> None:
    cfg = load_config(_variant(tmp_path, training={"rounds": 20, "restart_every": 20}))
    assert cfg.restart_every == 20


def test_dpgd_rejects_restart_every_above_one(tmp_path: Path) -> None:
    path = _variant(tmp_path, top={"method": "dpgd"}, training={"restart_every": 5})
    with pytest.raises(ConfigError, match=_msg(path, "training.restart_every", "5")) as info:
        load_config(path)
    assert "dpgd" in str(info.value)


def test_dpgd_accepts_restart_every_one(tmp_path: Path) -> None:
    cfg = load_config(_variant(tmp_path, top={"method": "dpgd"}, training={"restart_every": 1}))
    assert cfg.restart_every == 1


def test_diff2_requires_restart_every(tmp_path: Path) -> None:
    path = _variant(tmp_path, training={"restart_every": _DELETE})
    with pytest.raises(ConfigError, match=_msg(path, "training.restart_every", "None")) as info:
        load_config(path)
    assert "diff2" in str(info.value)


@pytest.mark.parametrize("method", ["diff2", "dpgd"])
@pytest.mark.parametrize("key", ["clip_restart", "clip_diff"])
def test_private_method_rejects_infinite_clip(tmp_path: Path, method: str, key: str) -> None:
    training: dict[str, Any] = {key: math.inf}
    if method == "dpgd":
        training["restart_every"] = _DELETE
    path = _variant(tmp_path, top={"method": method}, training=training)
    with pytest.raises(ConfigError, match=_msg(path, f"training.{key}", "inf")):
        load_config(path)


def test_gd_accepts_infinite_clip(tmp_path: Path) -> None:
    """Non-private gd may disable clipping with .inf (written as a YAML literal)."""
    path = tmp_path / "gd.yaml"
    path.write_text("method: gd\ntraining:\n  rounds: 5\n  clip_restart: .inf\n  clip_diff: .inf\n")
    cfg = load_config(path)
    assert cfg.method == "gd" and not cfg.private
    assert math.isinf(cfg.training.clip_restart) and math.isinf(cfg.training.clip_diff)


# --------------------------------------------------------------------------- file-level errors

def test_malformed_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("a: [1, 2")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("text, line, column", [
    ("training:\n\trounds: 5\n", 2, 1),
    ("training:\n  rounds: 5\n  \tseed: 1\n", 3, 3),
    ("name:\tfoo\n", 1, 6),
])
def test_a_tab_says_yaml_indents_with_spaces(tmp_path: Path, text: str, line: int,
                                             column: int) -> None:
    """PyYAML says only "found character '\\t' that cannot start any token": we say where, and what
    to do."""
    path = tmp_path / "tabbed.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: not valid YAML: line {line}, column {column}: a tab character. YAML "
                                 "indents with spaces, not tabs: replace the tab with spaces.")


def test_a_tab_in_a_study_file_says_the_same(tmp_path: Path) -> None:
    from diff2_flwr.lab.study.runner import StudyError, load_study

    path = tmp_path / "study.yaml"
    path.write_text("name: s\nmethods:\n\t- name: GD\n")
    with pytest.raises(StudyError,
                       match=r"study.yaml: not valid YAML: line 3, column 1: a tab character\. "
                             r"YAML indents with spaces, not tabs"):
        load_study(path)


@pytest.mark.parametrize("text, key, first, second", [
    ("privacy:\n  epsilon: 3\n  delta: 1.0e-5\n  epsilon: 8\ntraining:\n  restart_every: 2\n",
     "epsilon", 2, 4),
    ("training: {rounds: 3, rounds: 5, restart_every: 2}\n", "rounds", 1, 1),
    ("name: a\nmethod: dpgd\nname: b\n", "name", 1, 3),
])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path, text: str, key: str,
                                                      first: int, second: int) -> None:
    """PyYAML would keep the last value silently: which ε was spent would be a guess."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError,
                       match=rf"{re.escape(str(path))}: not valid YAML: key '{key}' is given twice "
                       rf"in one mapping \(line {first} and line {second}\)"):
        load_config(path)


def test_the_same_key_in_two_mappings_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("name: a\ndataset: {name: synthetic}\ntraining: {restart_every: 2}\n")
    assert load_config(path).dataset.name == "synthetic"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "does_not_exist.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path)


def test_top_level_list_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"method": "gd"}])
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}.*top level.*mapping"):
        load_config(path)


# --------------------------------------------------------------------------- calibration ->
# mechanism

N_MIN = 800


def test_mechanism_for_gd_is_unclipped_and_noiseless(tmp_path: Path) -> None:
    cfg = load_config(_variant(tmp_path, top={"method": "gd"}, training={"restart_every": _DELETE}))
    cal = cfg.calibration(N_MIN)
    assert cal is None
    mech = cfg.mechanism(cal)
    assert mech.restart_every == 1
    assert math.isinf(mech.clip_restart) and math.isinf(mech.clip_diff)
    assert mech.sigma_restart == 0.0 and mech.sigma_diff == 0.0


def test_mechanism_for_dpgd(tmp_path: Path) -> None:
    """DP-GD: T = 1, all R rounds are restarts, σ1 from the calibration, no σ2."""
    cfg = load_config(_variant(tmp_path, top={"method": "dpgd"},
                               training={"restart_every": _DELETE}))
    cal = cfg.calibration(N_MIN)
    assert cal is not None
    assert cal.restart_every == 1 and cal.restart_rounds == 100 and cal.difference_rounds == 0
    assert cal.n_min == N_MIN and cal.clients == 10 and cal.epsilon == 3.0
    mech = cfg.mechanism(cal)
    assert mech.restart_every == 1
    assert mech.sigma_restart == cal.sigma1 > 0
    assert mech.sigma_diff == 0.0
    assert mech.clip_restart == 1.0 and mech.clip_diff == 3.0


def test_mechanism_for_diff2(tmp_path: Path) -> None:
    """DIFF2: T and both σ come from the calibration; clips from the file."""
    cfg = load_config(DEFAULT_YAML).with_clients(10)
    cal = cfg.calibration(N_MIN)
    assert cal is not None
    assert cal.restart_every == 10 and cal.restart_rounds == 10 and cal.difference_rounds == 90
    mech = cfg.mechanism(cal)
    assert mech.restart_every == 10
    assert cal.sigma2 is not None and cal.sigma2 > 0
    assert mech.sigma_restart == cal.sigma1 > 0
    assert mech.sigma_diff == cal.sigma2
    assert mech.clip_restart == 1.0 and mech.clip_diff == 3.0


def test_calibration_depends_on_n_min() -> None:
    """Larger shards need less noise per unit radius."""
    cfg = load_config(DEFAULT_YAML).with_clients(10)
    small, large = cfg.calibration(N_MIN), cfg.calibration(4 * N_MIN)
    assert small is not None and large is not None
    assert large.sigma1 < small.sigma1 and large.sigma2 < small.sigma2


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    """YAML 1.1 (PyYAML) would read `1e-5` as a string; users write it that way."""
    path = tmp_path / "exp.yaml"
    path.write_text(
        "method: dpgd\nprivacy: {epsilon: 3, delta: 1e-5}\ntraining: {learning_rate: 5E-1}\n")
    cfg = load_config(path)
    assert cfg.privacy.delta == 1e-5 and cfg.training.learning_rate == 0.5
    path.write_text('privacy: {delta: "1e-5"}\n')  # a quoted string stays a string, and is refused
    with pytest.raises(ConfigError, match=r"privacy.delta.*expected a number. Found '1e-5'"):
        load_config(path)


def test_to_dict_round_trips_through_yaml():
    import yaml

    from diff2_flwr.runtime.config import parse_config

    cfg = parse_config({"method": "dpgd", "dataset": {"name": "csv", "path": "d.csv", "target": "y",
                                                      "drop": ["a", "b"],
                                                      "task": "regression"}})
    again = parse_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg


# --------------------------------------------------------------------------- overrides (--set,
# --run-config)

def test_every_config_key_is_a_declared_flower_run_config_key() -> None:
    """Flower refuses run-config keys the app does not declare: the declared list must follow the
    config."""
    import tomllib

    from diff2_flwr.runtime.config import config_keys

    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    app_config = declared["tool"]["flwr"]["app"]["config"]
    assert [k for k in app_config
            if k != "config"] == config_keys(), "run scripts/run_config_keys.py"
    assert all(app_config[k] == "" for k in config_keys())


def test_the_run_config_list_is_the_generators_output() -> None:
    import runpy

    generator = runpy.run_path(str(Path(__file__).resolve().parents[
        1] / "scripts" / "run_config_keys.py"))
    assert generator["main"]([
        "--check"]) == 0, ("pyproject.toml's run-config list is stale: run "
                           "scripts/run_config_keys.py")


def test_every_settable_key_has_help_text() -> None:
    """The declaration is the documentation's source: each key says what it means."""
    from diff2_flwr.runtime.config import ExperimentConfig, config_keys, help_of

    missing = [key for key in config_keys() if len(help_of(ExperimentConfig, key).strip()) < 3]
    assert not missing, f"keys without help text: {missing}"


def test_the_python_apis_setting_arguments_are_declared_keys() -> None:
    """make_strategy's keyword arguments (but x_0, callables and where the run writes) are settings:
    each one sets the key its declaration names, and an error about it names the argument."""
    import inspect

    import diff2_flwr
    from diff2_flwr.api import _NOT_SETTINGS
    from diff2_flwr.runtime.config import ExperimentConfig, argument_names
    from diff2_flwr.runtime.spec import nest_arguments

    def key_of(data: dict, prefix: str = "") -> str:
        ((name, value),) = data.items()
        return key_of(value, f"{prefix}{name}.") if isinstance(value, dict) else prefix + name

    names = argument_names(ExperimentConfig)
    settings = [p for p in inspect.signature(diff2_flwr.make_strategy).parameters
                if p not in _NOT_SETTINGS]
    assert len(settings) >= 20
    for argument in settings:
        assert names[key_of(nest_arguments(ExperimentConfig, {argument: 0}))] == argument
    assert {"local.share": "local_share", "evaluation.every": "eval_every", "training.seed": "seed",
            "training.routine.beta1": "routine.beta1"}.items() <= names.items()
    with pytest.raises(TypeError, match="argument 'wait_for_clients_s' sets no key"):
        nest_arguments(ExperimentConfig, {"wait_for_clients_s": 300})


def test_overrides_change_single_keys_and_are_validated_like_the_file(tmp_path: Path) -> None:
    from diff2_flwr.runtime.config import parse_assignment

    path = tmp_path / "base.yaml"
    path.write_text(
        "name: base\ntraining: {rounds: 10, restart_every: 5, seed: 3}\nprivacy: {epsilon: 3.0}\n")
    cfg = load_config(path, dict(map(parse_assignment, ["training.rounds=20", "privacy.epsilon=8",
                                                        "training.seed=null",
                                                        "privacy.delta=1e-6"])))
    assert (cfg.training.rounds, cfg.privacy.epsilon, cfg.training.seed,
            cfg.privacy.delta) == (20, 8.0, None, 1e-6)
    assert cfg.training.restart_every == 5 and cfg.name == "base"  # the rest as in the file
    assert "with overrides training.rounds=20" in cfg.source
    unknown = r"unknown key rounds in the overrides. Did you mean training.rounds\?"
    with pytest.raises(ConfigError, match=unknown):
        load_config(path, {"rounds": 3})
    with pytest.raises(ConfigError,
                       match=r"unknown key training.roundz in the overrides. Did you mean "
                             r"training.rounds"):
        load_config(path, {"training.roundz": 3})
    with pytest.raises(ConfigError,
                       match=r"with overrides training.rounds=4\): key `training.restart_every`: "
                                          r"expected at most training.rounds = 4"):
        load_config(path, {"training.rounds": 4})
    with pytest.raises(ConfigError,
                       match=r"key `privacy.epsilon`: expected a finite number > 0. Found -1"):
        load_config(path, {"privacy.epsilon": -1})
    with pytest.raises(ConfigError,
                       match=r"--set: expected KEY=VALUE \(e.g. training.rounds=200\). Found "
                             r"'rounds'"):
        parse_assignment("rounds")


def test_run_config_overrides_read_flower_values() -> None:
    from diff2_flwr.runtime.config import run_config_overrides, yaml_text

    got = run_config_overrides({"config": "configs/default.yaml", "training.rounds": "",
                                "training.seed": "null",
                                "privacy.epsilon": 8.0, "dataset.drop": "[a, b]", "name": "mine",
                                "training.clip_diff": ".inf"})
    assert got == {"training.seed": None, "privacy.epsilon": 8.0, "dataset.drop": ["a", "b"],
                   "name": "mine",
                   "training.clip_diff": math.inf}
    for value in (200, 1e-6, None, ["a", "b"], "abc", True, math.inf, "null"):
        assert run_config_overrides({"k": yaml_text(value)}) == {"k": value}


def test_diff2_run_set_overrides_the_file(tmp_path: Path, capsys) -> None:
    from diff2_flwr.cli import main

    path = tmp_path / "tiny.yaml"
    path.write_text(
        f"name: tiny\ndataset: {{name: synthetic, num_samples: 300}}\ntraining: {{rounds: 9, "
        f"restart_every: 3, clients: 2, seed: 1}}\noutput: {{dir: {tmp_path / 'out'}}}\n")
    assert main(["run", str(path), "--engine", "inprocess", "--set", "training.rounds=4", "--set",
                 "name=over"]) == 0
    (run_dir,) = (tmp_path / "out").iterdir()
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert run_dir.name.startswith("over-") and summary["rounds_released"] == 4
    assert summary["config"]["training"]["rounds"] == 4
    assert main(["run", str(path), "--engine", "inprocess", "--set", "training.rounds=0"]) == 2
    assert "key `training.rounds`: expected an integer >= 1. Found 0" in capsys.readouterr().err


def test_one_set_takes_several_assignments_and_the_file_may_follow(tmp_path: Path, capsys) -> None:
    """``--set a=1 b=2`` sets both (with a repeated ``--set`` too); ``--set a=1 CONFIG`` still reads
    CONFIG; a word without ``=`` elsewhere is refused naming it."""
    import json

    from diff2_flwr.cli import main

    path = tmp_path / "tiny.yaml"
    path.write_text(
        f"name: tiny\ndataset: {{name: synthetic, num_samples: 300}}\ntraining: {{rounds: 9, "
        f"restart_every: 3, clients: 2, seed: 1}}\noutput: {{dir: {tmp_path / 'out'}}}\n")
    assert main(["run", str(path), "--engine", "inprocess", "--set", "training.rounds=4",
                 "name=both",
                 "--set", "training.restart_every=2"]) == 0
    assert main(["run", "--engine", "inprocess", "--set", "training.rounds=3", "name=after",
                 str(path)]) == 0
    runs = {d.name.split("-")[0]: json.loads((d / "summary.json").read_text())
            for d in (tmp_path / "out").iterdir()}
    assert runs["both"]["rounds_released"] == 4 and runs["both"]["config"]["training"][
        "restart_every"] == 2
    assert runs["after"]["rounds_released"] == 3 and runs["after"]["config_file"].startswith(
        f"{path} (with overrides")
    capsys.readouterr()
    assert main(["run", str(path), "--engine", "inprocess", "--set", "training.rounds=4", "rounds",
                 "name=x"]) == 2
    expected = "--set: expected KEY=VALUE (e.g. training.rounds=200). Found 'rounds'."
    assert expected in capsys.readouterr().err


# --------------------------------------------------------------------------- training.routine

def test_routine_is_a_name_or_a_mapping_and_builds_the_core_routine(tmp_path: Path) -> None:
    from diff2_flwr.core.routines import GD, Adam, Momentum

    cfg = load_config(_variant(tmp_path, training={"routine": "gd"}))
    assert cfg.training.routine.build(cfg.training.learning_rate) == GD(cfg.training.learning_rate)
    # as files have always said it (checkpoint fingerprints)
    assert cfg.to_dict()["training"]["routine"] == "gd"
    cfg = load_config(_variant(tmp_path, training={"routine": {"name": "adam", "beta1": 0.8,
                                                               "eps": 1e-6},
                                                   "learning_rate": 0.01}))
    # beta2, weight_decay: defaults
    assert cfg.training.routine.build(0.01) == Adam(0.01, beta1=0.8, eps=1e-6)
    assert cfg.to_dict()["training"]["routine"] == {"name": "adam", "beta1": 0.8, "eps": 1e-6}
    cfg = load_config(_variant(tmp_path, training={"routine": {"name": "momentum", "momentum": 0}}))
    assert cfg.training.routine.build(0.5) == Momentum(0.5, momentum=0.0)
    assert load_config(_variant(tmp_path,
                                training=_default_dict()["training"])).training.routine.name == "gd"


def test_routine_round_trips_through_yaml() -> None:
    from diff2_flwr.runtime.config import parse_config

    for routine in ("gd", "nesterov", {"name": "adamw", "weight_decay": 0.0, "beta2": 0.99}):
        cfg = parse_config({"training": {"restart_every": 2, "routine": routine}})
        assert parse_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("routine, key, expected, found", [
    ("sgd", "training.routine.name", "one of 'gd', 'momentum', 'nesterov', 'adam', 'adamw'",
     "'sgd'"),
    ({"name": "momentum", "beta1": 0.9}, "training.routine.beta1",
     r"nothing for routine momentum \(its keys: momentum\)", "0.9"),
    ({"name": "gd", "momentum": 0.9}, "training.routine.momentum",
     r"nothing for routine gd \(its keys: none \(its step is training.learning_rate\)\)", "0.9"),
    ({"name": "adam", "beta1": 1.0}, "training.routine.beta1", r"a number in \[0, 1\)", "1.0"),
    ({"name": "adam", "eps": 0}, "training.routine.eps", "a finite number > 0", "0.0"),
    ({"name": "adamw", "weight_decay": -0.1}, "training.routine.weight_decay",
     "a finite number >= 0", "-0.1"),
    ({"name": "nesterov", "momentum": "high"}, "training.routine.momentum", "a number or null",
     "'high'"),
    # its kind: no value quoted
    (3, "training.routine", "must be a mapping of keys to values", "a number"),
])
def test_bad_routines_are_refused_naming_key_expectation_and_finding(tmp_path: Path, routine, key,
                                                                     expected, found) -> None:
    path = _variant(tmp_path, training={"routine": routine})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and key.rpartition(".")[
        2] in message and f"Found {found}" in message
    assert re.search(expected, message), message
    if routine != 3:
        assert f"key `{key}`: expected" in message


def test_an_unknown_routine_key_names_the_allowed_ones(tmp_path: Path) -> None:
    path = _variant(tmp_path, training={"routine": {"name": "adam", "beta3": 0.5}})
    with pytest.raises(ConfigError,
                       match=r"unknown key training.routine.beta3. Allowed in training.routine: "
                             r"name, momentum, beta1, beta2, eps, weight_decay"):
        load_config(path)


def test_routine_keys_can_be_overridden_one_by_one(tmp_path: Path) -> None:
    from diff2_flwr.runtime.config import config_keys, run_config_overrides

    assert {"training.routine", "training.routine.name",
            "training.routine.beta1"} <= set(config_keys())
    path = _variant(tmp_path)  # routine absent from the file: gd
    cfg = load_config(path, {"training.routine.name": "adam", "training.routine.beta2": 0.99})
    assert cfg.training.routine.params() == {"beta2": 0.99} and cfg.training.routine.name == "adam"
    # the shorthand, then one of its keys
    path = _variant(tmp_path, training={"routine": "momentum"})
    assert load_config(path,
                       {"training.routine.momentum": 0.5}).training.routine.params() == {
                           "momentum": 0.5}
    # the whole routine and one key: the whole first, whatever the order given
    cfg = load_config(path, {"training.routine.beta1": 0.7, "training.routine": "adamw"})
    assert (cfg.training.routine.name, cfg.training.routine.params()) == ("adamw", {"beta1": 0.7})
    refused = r"key `training.routine.beta1`: expected nothing for routine momentum"
    with pytest.raises(ConfigError, match=refused):
        load_config(path, {"training.routine.beta1": 0.7})
    # as Flower hands them over (strings read as YAML)
    got = run_config_overrides({"training.routine.name": "nesterov",
                                "training.routine.momentum": 0.8,
                                "training.routine.beta1": ""})
    assert load_config(path, got).training.routine.build(0.1).momentum == 0.8


def test_diff2_run_set_routine(tmp_path: Path) -> None:
    import json

    from diff2_flwr.cli import main

    path = tmp_path / "tiny.yaml"
    path.write_text(
        f"name: tiny\ndataset: {{name: synthetic, num_samples: 300}}\ntraining: {{rounds: 3, "
        f"restart_every: 3, clients: 2, seed: 1}}\noutput: {{dir: {tmp_path / 'out'}}}\n")
    assert main(["run", str(path), "--engine", "inprocess", "--set", "training.routine.name=adam",
                 "--set", "training.routine.beta1=0.5", "--set",
                 "training.learning_rate=0.01"]) == 0
    (run_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["config"]["training"]["routine"] == {"name": "adam", "beta1": 0.5}
    assert summary["routine"] == {"name": "adam", "learning_rate": 0.01, "beta1": 0.5,
                                  "beta2": 0.999, "eps": 1e-8,
                                  "weight_decay": 0.0}
