"""Experiment configuration: one YAML file -> frozen, validated dataclasses.

Every error names the file, the key, what was expected and what was found. Unknown keys are
errors (a typo must not silently fall back to a default).

Example (``configs/default.yaml``)::

    name: default
    method: diff2             # gd | dpgd | diff2
    dataset: {name: synthetic}
    privacy: {epsilon: 3.0, delta: 1.0e-5, mode: exact, u: 1.25}
    training: {rounds: 100, restart_every: 10, clip_restart: 1.0, clip_diff: 1.0,
               learning_rate: 0.25, clients: 10, seed: null}
    output: {dir: outputs/default}
"""


from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from .config_data import PAPER_MLP, DatasetConfig, ModelConfig, PartitionerConfig
from .config_experiment import ExperimentConfig, Method
from .config_training import (AUTO_CLIENTS_DEFAULT, CLIENTS_AUTO, EvaluationConfig, LocalConfig,
                              OutputConfig, PrivacyConfig, RoutineConfig, ScheduleConfig,
                              TrainingConfig)
from .paths import resolve_config_path, resolve_node_experiment
from .spec import (ConfigError, Kwargs, argument_error, argument_names, content_free, help_of,
                   nest_arguments, parse_section, require, setting, settable_keys)
from .spec import from_arguments as _from_arguments

__all__ = [
    "ConfigError",
    "CLIENTS_AUTO",
    "AUTO_CLIENTS_DEFAULT",
    "Kwargs",
    "DatasetConfig",
    "PartitionerConfig",
    "ModelConfig",
    "PrivacyConfig",
    "RoutineConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "EvaluationConfig",
    "LocalConfig",
    "OutputConfig",
    "ExperimentConfig",
    "load_config",
    "parse_config",
    "read_yaml",
    "config_keys",
    "parse_assignment",
    "set_assignments",
    "apply_overrides",
    "run_config_overrides",
    "load_run_config",
    "yaml_text",
    "from_arguments",
    "parse_section",
    "require",
    "setting",
    "help_of",
    "argument_error",
    "PAPER_MLP",
    "Method",
    "UNSET",
    "experiment_from_arguments",
    "argument_names",
]


# --------------------------------------------------------------------------- loading

def parse_config(data: Any, source: str = "<memory>") -> ExperimentConfig:
    """Validate a parsed YAML mapping into an :class:`ExperimentConfig`."""
    return parse_section(ExperimentConfig, data, source)


def from_arguments(function: str, data: Mapping[str, Any], cls: type = ExperimentConfig,
                   renamed: Mapping[str, str] | None = None) -> Any:
    """Validate a Python API call's keyword arguments with the YAML path's checks and messages.

    ``data`` is shaped like the YAML for ``cls`` (for an experiment, ``{"method": ..., "privacy":
    {...}, "training": {...}}``; :func:`~diff2_flwr.runtime.spec.nest_arguments` shapes flat keyword
    arguments); a bad value is reported by its argument's name (the key's declared ``argument``,
    else the key without its section, or as ``renamed`` says), e.g. "diff2_flwr.make_strategy:
    argument `rounds`: expected an integer >= 1. Found 0."
    """
    return _from_arguments(function, data, cls, renamed)


class _Loader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2 floats (PyYAML, YAML 1.1, reads ``1e-5`` as a string, not a number)
    that refuses a key given twice in one mapping (PyYAML keeps the last one without a word: a file
    that says ``epsilon`` twice would leave the reader guessing which budget was spent)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"key {key!r} is given twice in one mapping (line {first} and line "
                        f"{line}); "
                        "keep one of them", key_node.start_mark)
                lines[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str | Path, what: str = "experiment",
              error: type[ConfigError] = ConfigError) -> Any:
    """Parse a YAML file (YAML 1.2 floats); an unreadable or malformed file raises ``error`` naming
    it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"Cannot read {what} file {path}: {exc.strerror or exc}.") from exc
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        tab = _tab_at(exc, text)
        if tab is not None:  # PyYAML's own words ("cannot start any token") do not say what to do
            raise error(
                f"{path}: not valid YAML: line {tab[0]}, column {tab[1]}: a tab character. YAML "
                f"indents "
                        "with spaces, not tabs: replace the tab with spaces.", line=tab[0],
                        column=tab[1]) from exc
        mark = getattr(exc, "problem_mark", None)
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        raise error(f"{path}: not valid YAML: {exc}", line=line, column=column) from exc


def _tab_at(exc: yaml.YAMLError, text: str) -> tuple[int, int] | None:
    """(line, column), both from 1, of the tab character the parser stopped at; None if it stopped
    elsewhere."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return None
    lines = text.splitlines()
    if mark.line < len(lines) and lines[mark.line][mark.column:mark.column + 1] == "\t":
        return mark.line + 1, mark.column + 1
    return None


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
    """Read and validate an experiment YAML file, with single keys overridden (``{"training.rounds":
    200}``).

    The overrides are validated like the file (unknown keys, types, ranges); errors name them.
    """
    data = read_yaml(path)
    if not overrides:
        return parse_config(data, str(path))
    shown = " ".join(f"{k}={_show(v)}" for k, v in overrides.items())
    source = f"{path} (with overrides {shown})"
    return parse_config(apply_overrides(data, overrides, source), source)


# --------------------------------------------------------------------------- overrides

def config_keys() -> list[str]:
    """Every settable key of an experiment file, dotted (``training.rounds``), in declaration
    order."""
    return settable_keys(ExperimentConfig)


def yaml_text(value: Any) -> str:
    """A value as the YAML text that reads back as it (``200``, ``1.0e-06``, ``null``, ``[a,
    b]``)."""
    return yaml.safe_dump(value, default_flow_style=True,
                          width=10**9).strip().removesuffix("...").strip()


def _show(value: Any) -> str:
    return value if isinstance(value, str) else yaml_text(value)


def _yaml_value(text: str, key: str, source: str) -> Any:
    """A value written as YAML (``200``, ``1e-5``, ``null``, ``[a, b]``, ``{k: v}``, ``text``)."""
    try:
        return yaml.load(text,
                         Loader=_Loader) if text.strip() else ""  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{source}: override {key}={text!r} is not a valid YAML value: {exc}") from None


def parse_assignment(text: str, source: str = "--set") -> tuple[str, Any]:
    """``"training.rounds=200"`` -> ``("training.rounds", 200)``; the value is read as YAML."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"{source}: expected KEY=VALUE (e.g. training.rounds=200). Found {text!r}.")
    return key, _yaml_value(value, key, source)


def set_assignments(words: Sequence[str] | None, config: str | None,
                    default: str) -> tuple[str, dict[str, Any]]:
    """The experiment file and the overrides of a command line whose ``--set`` takes several
    assignments.

    ``words`` are every ``--set``'s words in order (argparse ``action="extend", nargs="+"``),
    ``config`` the positional file or ``None``. ``--set`` swallows the file too in ``--set a=1
    CONFIG``: a last word without ``=`` is the experiment file when no other was given (any other
    such word is refused by :func:`parse_assignment`, naming it); no file at all is ``default``.
    """
    texts = list(words or ())
    if config is None and texts and "=" not in texts[-1]:
        config = texts.pop()
    return (default if config is None else config), dict(parse_assignment(text) for text in texts)


def apply_overrides(data: Any, overrides: Mapping[str, Any], source: str = "<overrides>") -> dict:
    """A copy of the parsed file with each dotted key set; a key that does not exist is refused
    here."""
    known = config_keys()
    out = copy.deepcopy(data) if isinstance(data, Mapping) else ({} if data is None else data)
    if not isinstance(out, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping of keys to values. Found {out!r}.")
    # A whole section (training.routine=adam) before its keys (training.routine.beta1=0.8), whatever
    # the order given.
    for key, value in sorted(overrides.items(), key=lambda item: item[0].count(".")):
        if key not in known:
            close = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
            close = close or difflib.get_close_matches(key, known, n=3, cutoff=0.75)
            hint = f" Did you mean {', '.join(close)}?" if close else (f" Settable keys: "
                                                                       f"{', '.join(known)}.")
            raise ConfigError(f"{source}: unknown key {key} in the overrides.{hint}")
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            section = ".".join(parts[:i + 1])
            # routine: adam -> {name: adam}
            if isinstance(node[part], str) and section in _SHORTHAND_SECTIONS:
                node[part] = {_SHORTHAND_SECTIONS[section]: node[part]}
            if not isinstance(node[part], dict):
                raise ConfigError(
                    f"{source}: `{part}` must be a mapping of keys to values. Found "
                    f"{node[part]!r}.")
            node = node[part]
        node[parts[-1]] = value
    return out


#: Sections that a plain string may stand for, and the key the string sets (``routine: adam``).
_SHORTHAND_SECTIONS = {"training.routine": RoutineConfig.SHORTHAND,
                       "training.schedule": ScheduleConfig.SHORTHAND}

#: A run-config value that leaves the file's value alone (Flower needs every key declared with a
#: default).
UNSET = ""


def run_config_overrides(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The experiment-file overrides among a Flower run config's keys (all but ``config``).

    Strings are read as YAML (so ``training.seed='null'`` or ``dataset.drop='[a, b]'`` work);
    numbers and booleans are taken as Flower typed them; ``""`` (the declared default) means "as in
    the file".
    """
    out: dict[str, Any] = {}
    for key, value in run_config.items():
        if key == "config" or value == UNSET:
            continue
        out[key] = _yaml_value(value, key, "--run-config") if isinstance(value, str) else value
    return out


def load_run_config(run_config: Mapping[str, Any], *, node_config: Mapping[str, Any] | None = None,
                    quote: bool = True) -> ExperimentConfig:
    """The experiment of a Flower run config: the file named by key ``config``, the other keys as
    overrides.

    A bad override is reported as the run-config key it is, in one line: "--run-config key
    `training.rounds`: expected an integer. Found 'five' (experiment file configs/default.yaml)."
    (the file as the run config names it, not the installed app's copy).

    ``node_config``: a data owner's node reads it (a deployment): the file only from inside the app
    bundle or the folder its node config names
    (:func:`~diff2_flwr.runtime.paths.resolve_node_experiment`). ``quote=False`` (every Flower app:
    its errors travel to other parties) reports a bad file by
    :func:`~diff2_flwr.runtime.spec.content_free` messages, which quote nothing of it: the run
    config may have named any file the process can read.
    """
    given = str(run_config.get("config", ""))
    overrides = run_config_overrides(run_config)
    path = resolve_config_path(given) if node_config is None else resolve_node_experiment(
        given, node_config)
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        # the run config's own value: no file content
        if err.key is not None and err.key in overrides:
            raise ConfigError(
                f"--run-config key `{err.key}`: expected {err.expected}. Found {err.found!r} "
                              f"(experiment file {given}).", key=err.key, expected=err.expected,
                              found=err.found) from None
        if quote:
            raise
        raise ConfigError(f"Run-config key `config`: {content_free(err, repr(given))}", key=err.key,
                          expected=err.expected) from None


def experiment_from_arguments(function: str, arguments: Mapping[str, Any],
                              **fixed: Any) -> ExperimentConfig:
    """An experiment from a Python API call's flat keyword arguments (named as
    :func:`argument_names` says, e.g. ``rounds``, ``local_share``, ``eval_every``) and ``fixed``
    keys (``method="diff2"``), validated by the one validator with the YAML path's checks, each
    error naming its argument."""
    return from_arguments(function, nest_arguments(ExperimentConfig, {**arguments, **fixed}))
