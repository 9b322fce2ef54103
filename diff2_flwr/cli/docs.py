"""The documentation site: its generated reference pages and ``diff2 docs`` (build it, or serve it,
offline).

The site is MkDocs with the Material theme (``mkdocs.yml`` beside ``pyproject.toml``, pages in
``docs/``). Two reference pages are not written by hand but generated while the site builds
(``scripts/docs_hooks.py``), so they cannot drift from the code:

* ``reference/configuration.md`` — every key of an experiment file from its declaration
  (:func:`~diff2_flwr.runtime.spec.setting`: type, default, help), in declaration order;
* ``reference/cli.md`` — ``diff2 --help`` and every subcommand's help, from
  :func:`~diff2_flwr.cli.build_parser`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
import tomllib
import typing
from pathlib import Path
from typing import Any

__all__ = ["REPO", "MKDOCS_YML", "GENERATED", "configuration_page", "cli_page", "missing_help",
           "run_config_drift",
           "build", "DEFAULT_PORT", "port_free", "serve_port", "docs"]

#: The clone this package was imported from (``mkdocs.yml`` and ``docs/`` sit there, not in a
#: wheel).
REPO = Path(__file__).resolve().parents[2]
MKDOCS_YML = REPO / "mkdocs.yml"
#: The class of the configuration reference's table (docs/stylesheets/extra.css styles it).
KEYS_CLASS = "config-keys"
#: Help text width of the CLI page (the terminal's would make the page depend on who built it).
_WIDTH = 100


def _field(cls: type, key: str) -> tuple[dataclasses.Field, Any, type]:
    """The dataclass field of the dotted ``key`` of ``cls``: (field, its type hint, the section
    class)."""
    head, _, rest = key.partition(".")
    hints = typing.get_type_hints(cls)
    field = {f.name: f for f in dataclasses.fields(cls)}[head]
    hint = hints[head]
    if rest:
        return _field(hint, rest)
    return field, hint, cls


def _default(field: dataclasses.Field) -> str:
    from ..runtime.config import yaml_text

    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return f"`{yaml_text(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def missing_help(cls: type | None = None) -> list[str]:
    """The settable keys of ``cls`` (default: the experiment file's) declared without help text
    (each must have one: the configuration page and the CLI's setting flags show it)."""
    from ..runtime.config import ExperimentConfig
    from ..runtime.spec import help_of, settable_keys

    cls = ExperimentConfig if cls is None else cls
    return [key for key in settable_keys(cls) if not help_of(cls, key).strip()]


def run_config_drift(pyproject: Path = REPO / "pyproject.toml") -> str:
    """"" if the Flower app's run-config keys (``[tool.flwr.app.config]`` but ``config``) are the
    experiment file's keys, in order; else what differs."""
    from ..runtime.config import config_keys

    declared = [key for key in tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
                if key != "config"]
    if declared == config_keys():
        return ""
    missing = [k for k in config_keys() if k not in declared]
    extra = [k for k in declared if k not in config_keys()]
    return f"missing {missing}, not settings {extra}" if missing or extra else "in another order"


def configuration_page() -> str:
    """The Markdown of ``reference/configuration.md``: one table row per settable key, from its
    declaration."""
    from ..runtime.config import ExperimentConfig, config_keys
    from ..runtime.spec import describe_type, help_of

    missing = missing_help()
    if missing:
        raise ValueError(
            f"settings declared without help text: {', '.join(missing)}. Give each a help text in "
            f"its setting(default, help) declaration (diff2_flwr/runtime/config_*.py).")
    stale = run_config_drift()
    if stale:
        raise ValueError(
            f"pyproject.toml's [tool.flwr.app.config] does not declare the experiment file's keys "
                         f"({stale}): run `python scripts/run_config_keys.py`")
    rows = []
    for key in config_keys():
        field, hint, _ = _field(ExperimentConfig, key)
        kind = "a name or a mapping (section)" if dataclasses.is_dataclass(hint) else describe_type(
            hint)
        rows.append(
            f"| `{key}` | {_cell(kind)} | {_cell(_default(field))} | "
            f"{_cell(help_of(ExperimentConfig, key))} |")
    return "\n".join([
        # no sections, so no table of contents: its column goes to the table
        "---",
        "hide:",
        "  - toc",
        "---",
        "",
        "# Configuration reference (generated)",
        "",
        "<!-- Generated while the site builds (diff2_flwr/cli/docs.py, from the settings' "
        "declarations in",
        "     diff2_flwr/runtime/config_*.py): do not edit; change a setting's declaration "
        "instead. -->",
        "",
        "One YAML file describes one experiment (`configs/default.yaml` is the default). Every "
        "key below is",
        "declared once, with its type, default and help, in `diff2_flwr/runtime/config_*.py`; "
        "this table is",
        "generated from those declarations each time the site builds, so it lists exactly the "
        "keys the parser",
        "accepts. Unknown keys, wrong types and invalid values are errors that name the file, the "
        "key, what was",
        "expected and what was found.",
        "",
        "Every key is also a declared run-config key of the Flower app (`[tool.flwr.app.config]` "
        "in",
        "`pyproject.toml`, default `\"\"` = as in the file), and a `--set` key of `diff2 run`:",
        "",
        "```bash",
        "diff2 run configs/default.yaml --set training.rounds=200 privacy.epsilon=8",
        "flwr run . --run-config \"training.rounds=200 privacy.epsilon=8.0 training.seed='null'\"",
        "```",
        "",
        "What each key does in more detail (and how keys interact) is in",
        "[Configuration: details](configuration-notes.md).",
        "",
        f"{len(rows)} keys, in declaration order.",
        "",
        # the table's class: no key or default of it breaks over two lines
        # (docs/stylesheets/extra.css; md_in_html reads the Markdown inside)
        f'<div class="{KEYS_CLASS}" markdown="1">',
        "",
        "| key | type | default | help |",
        "|---|---|---|---|",
        *rows,
        "",
        "</div>",
        "",
    ])


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from . import build_parser  # noqa: PLC0415 -- a cycle: this package's __init__ imports docs

    parser = build_parser()
    out = [("diff2", parser)]
    # argparse keeps its subparsers here; there is no public accessor
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += [(f"diff2 {name}", sub) for name, sub in action.choices.items()]
    return out


def cli_page() -> str:
    """The Markdown of ``reference/cli.md``: the help of ``diff2`` and of each subcommand, from the
    parser."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(_WIDTH)
    try:
        sections = [f"## `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n" for name,
                    parser in _parsers()]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join([
        "# Command line reference (generated)",
        "",
        "<!-- Generated while the site builds from diff2_flwr.cli.build_parser(): do not edit. -->",
        "",
        "The `diff2` command (installed with the package; also `python -m diff2_flwr.cli`). "
        "Commands that report",
        "a result print one JSON object on stdout; progress and errors go to stderr. This page is "
        "the parser's own",
        "help, generated each time the site builds.",
        "",
        *sections,
    ])


#: The generated pages, by their path under ``docs/``.
GENERATED = {"reference/configuration.md": configuration_page, "reference/cli.md": cli_page}


def _mkdocs() -> list[str]:
    try:
        import mkdocs  # noqa: F401
        import material  # noqa: F401
    except ImportError as err:
        raise ValueError(f"the documentation tools are not installed ({err.name} is missing): run "
                         f"`pip install -e '.[docs]'` in this clone (scripts/setup.sh installs "
                         f"them)") from None
    if not MKDOCS_YML.is_file():
        raise ValueError(
            f"{MKDOCS_YML} not found: the documentation sources are in a clone of diff2-flwr, not "
            f"in an installed wheel")
    return [sys.executable, "-m", "mkdocs"]


def build(site_dir: str | Path, *, strict: bool = True,
          config: str | Path = MKDOCS_YML) -> subprocess.CompletedProcess:
    """``mkdocs build`` of ``config`` into ``site_dir`` (``--strict``: any warning — a broken link
    or anchor, a page missing from the navigation — fails it). Returns the finished process (its
    output captured)."""
    command = [*_mkdocs(), "build", "--clean", "--config-file", str(config), "--site-dir",
               str(site_dir)]
    if strict:
        command.append("--strict")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)


#: ``diff2 docs --serve``'s port when none is asked for: not 8000, the compose SuperLink's
#: (docker-compose.yml), nor mkdocs' own default (also 8000). Taken, another free one is chosen.
DEFAULT_PORT = 8765
_HOST = "127.0.0.1"


def port_free(port: int, host: str = _HOST) -> bool:
    """Whether a server could listen on ``host:port`` now (bound as mkdocs' server binds: with
    SO_REUSEADDR, so a port left in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def serve_port(requested: int | None, host: str = _HOST) -> tuple[int, str]:
    """The port ``diff2 docs --serve`` listens on, and a note for stderr ("" when none).

    ``requested`` is ``--port`` (``None``: not given). A port given but taken is a ValueError
    saying so and what to do; none given, :data:`DEFAULT_PORT`, or a free port the system picks
    when that one is taken."""
    if requested is not None:
        if not 0 < requested < 65536:
            raise ValueError(f"--port {requested} is not a TCP port (expected 1 to 65535)")
        if not port_free(requested, host):
            raise ValueError(
                f"port {requested} on {host} is in use (--port asked for it): pass another "
                f"--port, or leave --port out to let diff2 docs choose a free one")
        return requested, ""
    if port_free(DEFAULT_PORT, host):
        return DEFAULT_PORT, ""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return port, f"port {DEFAULT_PORT} is in use: serving on the free port {port} instead"


def _fail(error: str, **report: Any) -> int:
    """Report a failure: one JSON object on stdout, one line on stderr; exit code 1."""
    print(json.dumps({"status": "failed", "error": error, **report}))
    print(f"diff2 docs: error: {error}", file=sys.stderr)
    return 1


def _serve(url: str, address: str) -> int:
    """``mkdocs serve`` of this clone's site on ``address`` (rebuilt on changes), in this process:
    a port taken meanwhile is one line, not a traceback. Its log goes to stderr."""
    from mkdocs.commands.serve import serve

    log = logging.getLogger("mkdocs")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[mkdocs] %(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        serve(config_file=str(MKDOCS_YML), dev_addr=address, livereload=True)
    except KeyboardInterrupt:
        pass
    except OSError as err:  # the port was taken between the check and mkdocs' bind
        print(f"diff2 docs: error: could not serve on {url} ({err.strerror}): run diff2 docs "
              f"--serve again (it picks a free port), or pass another --port", file=sys.stderr)
        return 1
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return 0


def docs(args: argparse.Namespace) -> int:
    """``diff2 docs``: build the site (strict) and print where it is, as one JSON object on
    stdout; ``--serve`` then serves it on 127.0.0.1 (the JSON says the URL), rebuilding on
    changes, until interrupted. Offline: nothing is fetched."""
    out = Path(args.out or REPO / "site").resolve()
    port, note = None, ""
    if args.serve:
        try:
            port, note = serve_port(args.port)
        except ValueError as err:  # a port asked for and taken: fail before the build
            return _fail(str(err))
    print(f"[diff2] building the documentation into {out} ...", file=sys.stderr)
    start = time.perf_counter()
    done = build(out)
    seconds = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return _fail("the documentation did not build (mkdocs --strict; its messages above)",
                     seconds=seconds)
    index = out / "index.html"
    report = {"status": "built", "site": str(out), "index": str(index), "seconds": seconds}
    if not args.serve:
        print(json.dumps(report))
        print(f"[diff2] built in {seconds} s: open {index.as_uri()} in a browser (search works "
              f"from the file too)", file=sys.stderr)
        return 0
    url = f"http://{_HOST}:{port}/"
    print(json.dumps({**report, "status": "serving", "url": url}), flush=True)
    if note:
        print(f"[diff2] {note}", file=sys.stderr)
    print(f"[diff2] serving on {url} (rebuilt on changes; Ctrl-C stops)", file=sys.stderr)
    return _serve(url, f"{_HOST}:{port}")
