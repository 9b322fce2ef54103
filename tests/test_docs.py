"""The documentation site (issue 25): it builds with warnings as errors, a broken link fails that
build, the configuration and command line references are generated from the code, and the README
stays short.

The strict build is `mkdocs build --strict` with mkdocs.yml's `validation:` (a broken link or
anchor, a page left out of the navigation, a docstring mkdocstrings cannot read: each is a warning,
hence an error). The tutorials' commands are run by other tests: docs/about.md lists which.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from diff2_flwr.cli import docs, main
from diff2_flwr.runtime.config import config_keys
from diff2_flwr.runtime.spec import setting

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


# ------------------------------------------------------------------------------ the strict build

def test_diff2_docs_builds_the_site_strict_and_says_where(tmp_path, capsys):
    out = tmp_path / "site"
    assert main(["docs", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # one JSON object on stdout; progress on stderr
    assert report["status"] == "built" and Path(report["index"]) == out / "index.html"
    assert "building the documentation" in captured.err
    config_page = (out / "reference" / "configuration.html").read_text()
    assert all(f"<code>{key}</code>" in config_page for key in config_keys())
    cli_page = (out / "reference" / "cli.html").read_text()
    assert "diff2 docs" in cli_page and "diff2 audit" in cli_page
    # from the docstrings
    assert "make_strategy" in (out / "reference" / "python-api.html").read_text()


def _copy(tmp_path: Path) -> Path:
    """A copy of the site's sources (mkdocs.yml, docs/, the hooks) to break; its mkdocs.yml."""
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "docs_hooks.py", tmp_path / "scripts")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    return tmp_path / "mkdocs.yml"


BREAKS = {
    "broken link": ("index.md", "(tutorials/first-run.md)", "(tutorials/no-such-page.md)",
                    "no-such-page.md"),
    "broken anchor": ("index.md", "(explanation/privacy.md)",
                      "(explanation/privacy.md#no-such-section)",
                      "no-such-section"),
}


@pytest.mark.parametrize("case", BREAKS)
def test_a_broken_link_fails_the_strict_build(tmp_path, case):
    page, good, bad, named = BREAKS[case]
    config = _copy(tmp_path)
    path = tmp_path / "docs" / page
    assert good in path.read_text()
    path.write_text(path.read_text().replace(good, bad, 1))
    done = docs.build(tmp_path / "site", config=config)
    assert done.returncode != 0 and named in done.stderr, done.stderr[-2000:]


def test_a_page_left_out_of_the_navigation_fails_the_strict_build(tmp_path):
    config = _copy(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# A page nobody links\n")
    done = docs.build(tmp_path / "site", config=config)
    assert done.returncode != 0 and "orphan.md" in done.stderr, done.stderr[-2000:]


# ------------------------------------------------------------------------------ the generated
# references

def test_every_setting_is_declared_with_help_text():
    assert docs.missing_help() == [], ("give each setting a help text in its setting(default, "
                                       "help) declaration")


@dataclasses.dataclass(frozen=True)
class _Section:
    documented: int = setting(1, "a key with its help")
    bare: int = setting(2)  # a setting added without help text


@dataclasses.dataclass(frozen=True)
class _Experiment:
    name: str = setting("x", "the name")
    section: _Section = setting(factory=_Section, help="a section")


def test_a_setting_without_help_text_is_caught_and_fails_the_page(monkeypatch):
    assert docs.missing_help(_Experiment) == ["section.bare"]
    monkeypatch.setattr(docs, "missing_help", lambda cls=None: ["section.bare"])
    with pytest.raises(ValueError, match="settings declared without help text: section.bare"):
        docs.configuration_page()


def test_run_config_keys_out_of_date_fail_the_page(tmp_path, monkeypatch):
    assert docs.run_config_drift() == ""
    stale = tmp_path / "pyproject.toml"
    stale.write_text((ROOT / "pyproject.toml").read_text().replace('"output.checkpoint" = ""\n',
                                                                   ""))
    assert docs.run_config_drift(stale) == "missing ['output.checkpoint'], not settings []"
    monkeypatch.setattr(docs, "run_config_drift",
                        lambda: "missing ['output.checkpoint'], not settings []")
    with pytest.raises(ValueError, match="run `python scripts/run_config_keys.py`"):
        docs.configuration_page()


def test_the_configuration_page_is_every_key_with_its_declaration():
    page = docs.configuration_page()
    rows = re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)
    assert rows == config_keys()
    assert "| `privacy.epsilon` | a number | `3.0` | the target ε of the whole run |" in page


def test_the_command_line_page_has_every_command():
    page = docs.cli_page()
    commands = [name for name, _ in docs._parsers()]
    assert {"diff2", "diff2 run", "diff2 docs", "diff2 audit", "diff2 shard"} <= set(commands)
    assert all(f"## `{name}`" in page for name in commands)


def test_generated_pages_are_not_committed():
    assert not [path for path in docs.GENERATED if (DOCS / path).exists()]


def test_the_details_page_names_only_real_keys():
    """The hand-written details (the README's old table) may not name a key the parser does not
    have."""
    keys = set(config_keys())
    text = (DOCS / "reference" / "configuration-notes.md").read_text()
    named = 0
    for cell in re.findall(r"^\| (`[^|]+`) \|", text, flags=re.M):
        first, *rest = re.findall(r"`([^`]+)`", cell)
        section = first.rpartition(".")[0]
        for key in [first, *(r if "." in r else f"{section}.{r}" for r in rest)]:
            assert key in keys, (f"configuration-notes.md names `{key}`, which is not a key of "
                                 f"the experiment file")
            named += 1
    assert named >= len(keys) - 5  # it is the whole table, not a few lines of it


# ------------------------------------------------------------------------------ the README

def test_the_readme_is_short_and_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).is_file() for link in links), [l for l in links
                                                                      if not (ROOT / l).is_file()]
    # the two commands a user runs, as CI runs the second (.ci/run -> scripts/test.sh)
    assert "./scripts/run.sh" in readme and "./scripts/test.sh" in readme
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_docs_extra_is_installed_by_setup():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(dep.startswith("mkdocs-material") for dep in extras["docs"])
    installed = re.search(r'-e "\$root\[([a-z,]+)\]"', (ROOT / "scripts" / "setup.sh").read_text())
    assert installed and "docs" in installed.group(1).split(",")


# ------------------------------------------------------------------------------ the tutorials'
# commands

#: Each kind of command a tutorial shows -> the tests that run it (file::function; a class's test as
#: file::Class::function). A command a tutorial adds must be listed here with its test, or the test
#: below fails.
RUN_BY = {
    "./scripts/run.sh": [
        "tests/test_console.py::test_diff2_run_console_through_flower_is_short_and_ends_with_the_summary",
                         # run.sh = setup.sh + diff2 run
                         "tests/test_flower_e2e.py::test_california_housing_simulation"],
    "./scripts/test.sh": [".ci/run"],  # CI runs it on a clean clone
    "./scripts/setup.sh": [".ci/run"],  # scripts/test.sh runs it first
    "source .venv/bin/activate": [
        "tests/test_plain_flwr_run.py::test_activating_the_venv_turns_flowers_per_run_install_off_and_deactivate_restores_the_shell"],
    "flwr run . --stream": [
        "tests/test_plain_flwr_run.py::test_plain_flwr_run_completes_with_p_the_simulations_supernodes",
                            "tests/test_own_code.py::test_flwr_run_imports_a_factory_from_custom_without_pythonpath"],
    "flwr run . compose": [
        "tests/test_compose_podman.py::TestPlainCompose::test_a_run_completes_and_equals_the_in_process_driver"],
    "flwr run . <connection>": [
        "tests/test_compose_podman.py::TestTlsCompose::test_a_tls_run_with_registered_node_keys_"
                                "equals_the_in_process_driver"],
    "flwr supernode register": [
        "tests/test_node_auth.py::test_only_registered_supernodes_join_and_the_run_completes_"
                                "with_them"],
    "diff2 superlink": [
        "tests/test_local_superlink.py::test_diff2_superlink_stops_the_local_superlink_by_its_pid_"
        "and_nothing_else"],
    "diff2 shard": ["tests/test_shards.py::test_cli_shard"],
    "diff2 secret": [
        "tests/test_superexec_auth.py::test_every_private_file_the_cli_writes_is_owner_only_under_umask_022"],
    "diff2 node-key": [
        "tests/test_node_auth.py::test_operator_takes_data_owners_public_keys_and_refuses_anything_else"],
    "diff2 certs": [
        "tests/test_node_auth.py::test_operator_takes_data_owners_public_keys_and_refuses_anything_else"],
    "diff2 compose": [
        "tests/test_compose.py::test_multi_host_file_names_the_right_certificate_hosts_and_each_side_s_steps"],
    # with Podman, where it and root are available
    "docker compose": [
        "tests/test_deploy_tutorial.py::test_the_data_owners_services_come_up_and_read_their_files",
        "tests/test_compose_podman.py::TestPlainCompose::test_a_run_completes_and_equals_the_in_"
        "process_driver",
        "tests/test_compose_podman.py::TestTlsCompose::test_a_tls_run_with_registered_node_keys_"
        "equals_the_in_process_driver"],
}
#: Shell steps around the commands (files, ownership, variables), not commands of this project
#: (the deployment tutorial's are typed by tests/test_deploy_tutorial.py).
SHELL = ("mkdir ", "sudo chown ", "cp ", "cat ", "git clone ", "export ")


def _tutorial_commands() -> list[tuple[str, str]]:
    found = []
    for page in sorted((DOCS / "tutorials").glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            # a continued line is one command
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip().removeprefix(".venv/bin/")
                if command and not command.startswith("#"):
                    found.append((page.name, command))
    return found


def test_every_tutorial_command_is_run_by_a_named_test():
    commands = _tutorial_commands()
    assert len(commands) > 20
    for page, command in commands:
        if command.startswith("for ") and "; do " in command:
            command = command.split("; do ", 1)[1]
        if command.startswith(SHELL):
            continue
        kinds = [kind for kind in RUN_BY if command.startswith(kind)]
        assert kinds, f"{page}: `{command}` is run by no test listed in RUN_BY (tests/test_docs.py)"


@pytest.mark.parametrize("test", sorted({t for tests in RUN_BY.values() for t in tests}))
def test_the_tests_named_for_the_tutorials_exist(test):
    path, *names = test.split("::")
    text = (ROOT / path).read_text()
    if not names:
        assert "scripts/test.sh" in text
        return
    *classes, function = names
    assert all(f"class {c}" in text for c in classes) and f"def {function}(" in text, test
