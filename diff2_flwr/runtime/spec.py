"""One declaration per setting: the validator every settings section goes through.

A section is a frozen dataclass; each field is declared once with :func:`setting` (its default, its
help text and, where the Python API names it differently, its argument's name), its type by the
annotation and its range checks in ``__post_init__`` with :func:`require`. From that declaration
come the YAML parsing (:func:`parse_section`), the Python API's validation (:func:`from_arguments`,
:func:`nest_arguments`), the dotted keys of ``--set`` and Flower's run config
(:func:`settable_keys`) and the help of each key (:func:`help_of`). Every error has one shape:
"SOURCE: key `KEY`: expected EXPECTED. Found FOUND."
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Callable, Literal, Mapping

__all__ = ["ConfigError", "Kwargs", "Invalid", "require", "setting", "help_of", "settable_keys",
           "argument_names",
           "nest_arguments", "parse_section", "from_arguments", "argument_error", "describe_type",
           "type_ok",
           "setting_names", "add_setting_flags", "key_error", "content_free", "is_int",
           "run_identity", "ArgumentSource", "key_namer"]


class ConfigError(ValueError):
    """An invalid experiment file; the message names file, key, expectation and finding.

    For one key's bad value, ``key``, ``expected`` and ``found`` hold the parts of the message; for
    a file that is not valid YAML, ``line`` and ``column`` (from 1) where the parser stopped.
    :func:`content_free` builds from them a message that quotes nothing of the file.
    """

    def __init__(self, message: str, *, key: str | None = None, expected: str | None = None,
                 found: Any = None, line: int | None = None, column: int | None = None) -> None:
        super().__init__(message)
        self.key, self.expected, self.found = key, expected, found
        self.line, self.column = line, column


def content_free(err: Exception, source: str) -> str:
    """What is wrong with the file ``source`` without one byte of its content: the key and what was
    expected, or the line and column where it stopped being YAML, or only that it is not a valid
    file. Every message that leaves the party who owns the file (an app's error relayed to the
    server, a run's log) is built this way: an error that quoted values or lines would send the
    content of whatever file a run config named."""
    if isinstance(err, ConfigError) and err.key is not None and err.expected is not None:
        return f"{source}: key `{err.key}`: expected {err.expected} (the value found is not shown)."
    if isinstance(err, ConfigError) and err.line is not None:
        return (f"{source}: not valid YAML at line {err.line}, column {err.column} (the line is "
                f"not shown).")
    if isinstance(err, OSError) or isinstance(err.__cause__, OSError):
        cause = err if isinstance(err, OSError) else err.__cause__
        return (f"{source}: cannot be read "
                f"({getattr(cause, 'strerror', None) or type(cause).__name__}).")
    return (
        f"{source}: not a valid experiment file (its content is not shown); validate it where it "
        f"is yours "
            "(`diff2 noise FILE` reads and checks it).")


def key_error(source: str, key: str, expected: str, found: Any) -> ConfigError:
    """The one shape of a bad value: "SOURCE: key `KEY`: expected EXPECTED. Found FOUND."."""
    return ConfigError(f"{source}: key `{key}`: expected {expected}. Found {found!r}.", key=key,
                       expected=expected, found=found)


def argument_error(function: str, argument: str, expected: str, found: Any) -> ConfigError:
    """The same shape for a Python API call's argument: "FUNCTION: argument `NAME`: expected ....
    Found ...."."""
    return ConfigError(f"{function}: argument `{argument}`: expected {expected}. Found {found!r}.",
                       key=argument, expected=expected, found=found)


class Invalid(ValueError):
    """One field's bad value, raised by a section's checks; :func:`parse_section` adds the source
    and the prefix."""

    def __init__(self, key: str, expected: str, found: Any) -> None:
        super().__init__(f"key `{key}`: expected {expected}. Found {found!r}.")
        self.key, self.expected, self.found = key, expected, found


def require(ok: bool, key: str, expected: str, found: Any) -> None:
    """A section's field check: raise :class:`Invalid` (key, what was expected, what was found)
    unless ``ok``."""
    if not ok:
        raise Invalid(key, expected, found)


def setting(default: Any = dataclasses.MISSING, help: str = "", *,
            factory: Callable[[], Any] | None = None, argument: str | None = None,
            **extra: Any) -> Any:
    """A field's declaration: its default (or ``factory``), its help text, and the Python API
    argument that sets it when that is not the field's own name (``argument="eval_every"`` for
    ``evaluation.every``); ``extra`` holds what one consumer alone needs (``cli_default``: a CLI
    flag's default computed when the parser is built; ``identifies=False``: the key does not change
    what a run computes or spends, so a checkpoint resumes across a change of it; ``before=VALUE``:
    the key came later, and VALUE reproduces the runs made before it existed — see
    :func:`run_identity`)."""
    metadata = {"help": help, **({"argument": argument} if argument else {}), **extra}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _fields(cls: type) -> list[dataclasses.Field]:
    """The fields a file may give: not ``source``, nor one marked ``metadata={"derived": True}``
    (a value the section computes from other keys)."""
    return [f for f in dataclasses.fields(cls)
            if f.name != "source" and not f.metadata.get("derived")]


def _section(cls: type, name: str) -> type | None:
    hint = typing.get_type_hints(cls)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def settable_keys(cls: type, prefix: str = "") -> list[str]:
    """Every settable key of ``cls``, dotted (``training.rounds``), in declaration order; a section
    that a plain string stands for (``SHORTHAND``: ``training.routine=adam``) is settable whole
    too."""
    out: list[str] = []
    for f in _fields(cls):
        sub = _section(cls, f.name)
        if sub is None:
            out.append(prefix + f.name)
            continue
        if getattr(sub, "SHORTHAND", None):
            out.append(prefix + f.name)
        out += settable_keys(sub, f"{prefix}{f.name}.")
    return out


def help_of(cls: type, key: str) -> str:
    """The help text declared for the dotted ``key`` of ``cls`` ("" if none)."""
    head, _, rest = key.partition(".")
    f = {f.name: f for f in _fields(cls)}[head]
    sub = _section(cls, head)
    return help_of(sub, rest) if rest and sub is not None else f.metadata.get("help", "")


def argument_names(cls: type, prefix: str = "", parent: str = "") -> dict[str, str]:
    """Dotted key -> the Python API argument that sets it: the field's name, or its declared
    ``argument``; keys of a shorthand section are named under the section's argument
    (``routine.beta1``)."""
    out: dict[str, str] = {}
    for f in _fields(cls):
        name = f.metadata.get("argument", f.name)
        sub = _section(cls, f.name)
        if sub is not None and not getattr(sub, "SHORTHAND", None):
            out.update(argument_names(sub, f"{prefix}{f.name}."))
            continue
        out[prefix + f.name] = f"{parent}{name}"
        if sub is not None:
            out.update(argument_names(sub, f"{prefix}{f.name}.", f"{name}."))
    return out


def nest_arguments(cls: type, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A Python API call's keyword arguments (named by :func:`argument_names`) shaped as ``cls``'s
    YAML.

    An argument named like several keys sets the shallowest (``seed``: ``training.seed``, not
    ``dataset.partitioner.seed``); two at the same depth make it ambiguous. An argument that sets no
    key, or an ambiguous one, is refused (a programming error of the caller, not a user's)."""
    by_argument: dict[str, list[str]] = {}
    for key, argument in argument_names(cls).items():
        if "." not in argument:
            by_argument.setdefault(argument, []).append(key)
    data: dict[str, Any] = {}
    for argument, value in arguments.items():
        keys = sorted(by_argument.get(argument, ()), key=lambda k: k.count("."))
        if not keys or (len(keys) > 1 and keys[0].count(".") == keys[1].count(".")):
            raise TypeError(
                f"argument {argument!r} sets {'no' if not keys else 'more than one'} key of "
                            f"{cls.__name__} ({', '.join(keys) or 'none'})")
        *sections, last = keys[0].split(".")
        node = data
        for part in sections:
            node = node.setdefault(part, {})
        node[last] = value
    return data


def run_identity(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a section's plain values (``to_dict()``) that identifies a run: what a
    checkpoint's and a shard file's fingerprint hash. Every declared key is kept except those
    declared ``identifies=False`` and those still at their declared ``before`` value (a key added
    later, at the value that reproduces earlier runs: the files written before it existed still
    match); sections recursively; undeclared keys (a factory's kwargs) whole. So a new key is one
    declaration: at its ``before`` value it leaves every fingerprint as it was."""
    declared = {f.name: f for f in _fields(cls)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        f = declared.get(key)
        if f is not None and (f.metadata.get("identifies", True) is False
                              or ("before" in f.metadata and value == f.metadata["before"])):
            continue
        sub = _section(cls, key) if f is not None else None
        out[key] = run_identity(sub, value) if sub is not None and isinstance(value,
                                                                              Mapping) else value
    return out


class Kwargs(tuple):
    """Keyword arguments from YAML as a hashable value: ``(name, value)`` pairs, sorted by name;
    nested mappings become :class:`Kwargs` and lists tuples (a config is frozen and hashable)."""

    def __new__(cls, pairs: Any = ()) -> "Kwargs":
        """``pairs`` (a mapping, or ``(name, value)`` pairs) frozen and sorted by name."""
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        return super().__new__(cls, sorted((str(k), _frozen(v)) for k, v in items))

    def as_dict(self) -> dict[str, Any]:
        """Plain Python values (mappings as dicts, sequences as lists), as YAML gave them."""
        return {k: _thawed(v) for k, v in self}


def _frozen(value: Any) -> Any:
    if isinstance(value, Kwargs):
        return value
    if isinstance(value, Mapping):
        return Kwargs(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, Kwargs):
        return value.as_dict()
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


def is_int(v: Any) -> bool:
    """Whether ``v`` is an integer: ``True`` and ``False`` are not (although bools are ints)."""
    return isinstance(v, int) and not isinstance(v, bool)


def type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Check ``value`` against a field's type hint; return (ok, value converted)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(hint)
        if value is None:
            return type(None) in args, None
        for arg in args:
            if arg is not type(None):
                ok, conv = type_ok(value, arg)
                if ok:
                    return True, conv
        return False, value
    if origin is Literal:
        return value in typing.get_args(hint), value
    if hint is Kwargs:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return False, value
        return True, Kwargs(value)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, list) or not all(type_ok(v, item)[0] for v in value):
            return False, value
        return True, tuple(value)
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return is_int(value), value
    if hint is float:
        if is_int(value):
            return True, float(value)
        return isinstance(value, float), value
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def describe_type(hint: Any) -> str:
    """A field's type hint in an error message's words (``an integer``, ``null or a number``)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        args = typing.get_args(hint)
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join("null" if a is type(None) else describe_type(a)
                           for a in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {describe_type(typing.get_args(hint)[0]).replace('a ', '')}s"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            Kwargs: "a mapping of names to values"}.get(hint, str(hint))


def _expand_shorthand(cls: type, value: Any) -> Any:
    """A section that has a shorthand (``routine: adam``) given as a plain string: ``{name:
    adam}``."""
    key = getattr(cls, "SHORTHAND", None)
    return {key: value} if key is not None and isinstance(value, str) else value


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: `{where}` must be a mapping of keys to values. Found {_kind(data)}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in _fields(cls)]
    unknown = sorted(set(map(str, data)) - set(names))
    moved = [k for k in unknown if k in getattr(cls, "MOVED", {})]
    if moved:  # a key that lives elsewhere now: say where (MOVED: old name -> its dotted key)
        raise ConfigError(
            f"{source}: key `{prefix}{moved[0]}` has moved to `{cls.MOVED[moved[0]]}` (the same "
            "setting): write it there.", key=prefix + moved[0],
            expected=f"{cls.MOVED[moved[0]]} instead", found=data[moved[0]])
    if unknown:
        raise ConfigError(
            f"{source}: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(prefix + k for k in unknown)}. Allowed in {where}: {', '.join(names)}."
        )
    kwargs: dict[str, Any] = {}
    for name in names:
        if name not in data:
            continue
        hint, value = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, _expand_shorthand(hint, value), f"{prefix}{name}.", source)
            continue
        ok, converted = type_ok(value, hint)
        if not ok:
            raise key_error(source, f"{prefix}{name}", describe_type(hint), value)
        kwargs[name] = converted
    if "source" in {f.name for f in dataclasses.fields(cls)}:  # the experiment remembers its file
        kwargs["source"] = source
    try:
        return cls(**kwargs)
    except Invalid as err:
        key = err.key if "." in err.key else prefix + err.key
        raise key_error(source, key, err.expected, err.found) from None


def _kind(value: Any) -> str:
    """What a value is, without its content (a file's top level may be anything the run config
    pointed at)."""
    return {str: "a text", int: "a number", float: "a number", bool: "true/false",
            list: "a list"}.get(
        type(value), type(value).__name__)


def parse_section(cls: type, data: Any, source: str) -> Any:
    """Validate a mapping into the frozen dataclass ``cls`` with the experiment file's checks and
    messages (unknown keys, types, each field's :func:`require`); the experiment file, a node
    policy, an audit."""
    return _build(cls, data, "", source)


def from_arguments(function: str, data: Mapping[str, Any], cls: type,
                   renamed: Mapping[str, str] | None = None) -> Any:
    """Validate a Python API call's keyword arguments with the YAML path's checks and messages.

    ``data`` is shaped like the YAML for ``cls`` (for the experiment, ``{"method": ..., "privacy":
    {...}, "training": {...}}``; :func:`nest_arguments` shapes flat arguments); a bad value is
    reported by its argument's name (:func:`argument_names`, or as ``renamed`` says), e.g.
    "diff2_flwr.make_strategy: argument `rounds`: expected an integer >= 1. Found 0."
    """
    try:
        return _build(cls, data, "", ArgumentSource(function))
    except ConfigError as err:
        if err.key is None:
            raise
        names = {**argument_names(cls), **(renamed or {})}
        raise argument_error(function, names.get(err.key, err.key.rpartition(".")[2]), err.expected,
                             err.found) from None


class ArgumentSource(str):
    """The ``source`` of settings given as a Python API call's keyword arguments: the function's
    name (``"diff2_flwr.make_strategy"``), which it prints as. A section validated by
    :func:`from_arguments` remembers it, so that a message about a setting, long after the call,
    names it as that caller wrote it (:func:`key_namer`): ``learning_rate=``, not the experiment
    file's ``training.learning_rate``."""

    __slots__ = ()


def key_namer(cls: type, source: str | None) -> Callable[[str], str]:
    """How the user who gave the settings of ``cls`` from ``source`` names a dotted key: its Python
    API argument with ``=`` (``learning_rate=``, as :func:`argument_names` declares it) when
    ``source`` is an :class:`ArgumentSource`, else the key itself (``training.learning_rate``: the
    experiment file, ``--set``, the run config, or no source known).

    Args:
        cls: the settings' section (the experiment).
        source: where the settings came from (the section's ``source``), or None.

    Returns:
        ``name(key) -> str`` for the dotted keys of ``cls`` (a key :func:`argument_names` does not
        list stays dotted). Name with it only settings the function takes as arguments.
    """
    if not isinstance(source, ArgumentSource):
        return str
    arguments = argument_names(cls)
    return lambda key: f"{arguments[key]}=" if key in arguments else key


def setting_names(cls: type) -> list[str]:
    """The names of ``cls``'s settings, in declaration order."""
    return [f.name for f in _fields(cls)]


def add_setting_flags(parser: Any, cls: type) -> None:
    """One ``--flag`` per field of the flat section ``cls`` (an ``argparse`` parser): the field's
    name with dashes, its type (a ``Literal``'s values as choices), its default (``cli_default()``
    if declared: a default that depends on the machine) and its help text, with the default appended
    unless the text already says it."""
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint)
                if a is not type(None)] if _is_union(hint) else [hint]
        kind = args[0] if len(args) == 1 else str
        options: dict[str, Any] = {"type": kind}
        if typing.get_origin(kind) is Literal:
            options = {"choices": typing.get_args(kind)}
        default = f.metadata["cli_default"]() if "cli_default" in f.metadata else f.default
        text = f.metadata.get("help", "")
        if "default" not in text:
            text += " (default %(default)s)"
        parser.add_argument(f"--{f.name.replace('_', '-')}", default=default, help=text, **options)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType",
                                                             None))
