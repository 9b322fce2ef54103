"""The parts of diff2_flwr/deploy/podman.py that need no Podman: what a build gets of the host's pip
configuration, the Debian mirror, the project copy, and the reasons for skipping the compose
test."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from diff2_flwr.deploy import podman


def test_a_build_gets_the_hosts_pip_configuration_and_every_local_path_it_names(tmp_path,
                                                                                monkeypatch):
    index, wheels, cert = tmp_path / "pypi" / "simple", tmp_path / "wheels", tmp_path / "ca.crt"
    index.mkdir(parents=True)
    wheels.mkdir()
    cert.write_text("x")
    monkeypatch.setattr(podman, "_pip_settings", lambda: {
        "extra-index-url": f"file://{index} https://example.org/simple", "find-links": str(wheels),
        "cert": str(cert), "default-timeout": "180", "constraint": str(tmp_path / "missing.txt")})
    args = podman.pip_build_args(tmp_path / "scratch")
    assert args[:2] == ["--network", "host"]
    volumes = [args[i + 1] for i, a in enumerate(args) if a == "--volume"]
    assert volumes[0] == f"{tmp_path / 'scratch' / 'pip.conf'}:/etc/pip.conf:ro"
    # a local index is mounted from its root (its pages link to ../../files/...), the rest as named;
    # remote URLs and paths that do not exist are not mounted
    assert volumes[1:] == [f"{index.parent}:{index.parent}:ro", f"{wheels}:{wheels}:ro",
                           f"{cert}:{cert}:ro"]
    conf = (tmp_path / "scratch" / "pip.conf").read_text()
    assert conf.startswith(
        "[global]\n") and f"find-links = {wheels}\n" in conf and "default-timeout = 180\n" in conf
    assert shlex.split(shlex.join(args)) == args  # survives podman-compose's --podman-build-args


def test_pip_settings_read_pip_config_list_with_the_environment_winning(monkeypatch):
    import subprocess

    listing = (
        ":env:.find-links='/env/wheels'\nglobal.find-links='/file/wheels'\nglobal.cert='/etc/ca.crt'\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0,
                                                                                       listing, ""))
    assert podman._pip_settings() == {"find-links": "/env/wheels", "cert": "/etc/ca.crt"}


def test_the_debian_mirror_is_read_from_apt_sources(tmp_path, monkeypatch):
    assert podman.debian_mirror().startswith("http")
    sources = tmp_path / "apt" / "sources.list.d"
    sources.mkdir(parents=True)
    (sources / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n")
    original = Path

    def fake_path(value="", *rest):
        return original(str(tmp_path / "apt")) if value == "/etc/apt" else original(value, *rest)

    monkeypatch.setattr(podman, "Path", fake_path)
    assert podman.debian_mirror() == "http://mirror.example/debian"


def test_the_project_copy_holds_the_build_context_without_caches(tmp_path):
    dest = podman.copy_project(tmp_path / "copy")
    for name in ("docker-compose.yml", "docker-compose.tls.yml", ".dockerignore", "pyproject.toml",
                 "README.md",
                 "server/Dockerfile", "clients/Dockerfile", "configs/deploy.yaml",
                 "diff2_flwr/__init__.py"):
        assert (dest / name).is_file(), name
    assert not list(dest.rglob("__pycache__")) and not (dest / ".venv").exists()


def test_the_compose_test_says_why_it_is_skipped(monkeypatch):
    monkeypatch.setattr(podman.shutil, "which", lambda name: None)
    assert "podman is not installed" in podman.unavailable_reason()
    monkeypatch.setattr(podman.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(podman, "podman_compose_tool", lambda: None)
    assert "podman-compose is not installed" in podman.unavailable_reason()
    monkeypatch.setattr(podman, "podman_compose_tool", lambda: "/usr/bin/podman-compose")
    monkeypatch.setattr(podman.os, "geteuid", lambda: 1000)
    assert "rootful Podman" in podman.unavailable_reason()


def test_podman_uses_this_projects_containers_conf_unless_one_is_set(monkeypatch):
    monkeypatch.delenv("CONTAINERS_CONF", raising=False)
    assert podman.podman_env()["CONTAINERS_CONF"] == str(podman.CONTAINERS_CONF)
    assert 'runtime = "runc"' in podman.CONTAINERS_CONF.read_text()
    monkeypatch.setenv("CONTAINERS_CONF", "/etc/mine.conf")
    assert podman.podman_env()["CONTAINERS_CONF"] == "/etc/mine.conf"


@pytest.mark.parametrize("target,entrypoint", [("superlink", "flower-superlink"),
                                               ("supernode", "flower-supernode"),
                                               ("superexec", "flower-superexec"),
                                               ("serverapp", "flwr-serverapp"), ("clientapp",
                                                                                 "flwr-clientapp")])
def test_the_standin_images_have_flowers_entrypoints_user_and_workdir(target, entrypoint):
    text = (podman.STANDIN_DIR / "Containerfile").read_text()
    stage = text.split(f"FROM base AS {target}\n", 1)[1].split("\n\n", 1)[0]
    assert stage.strip() == f'ENTRYPOINT ["{entrypoint}"]'
    base = text.split("FROM ${BASE_IMAGE} AS base\n", 1)[1].split("\n\n", 1)[0]
    assert "--uid 49999 app" in base and "WORKDIR /app\nUSER app\nENV HOME=/app" in base
    assert "PATH=/python/venv/bin:$PATH" in base and "chown -R app:app /app /python/venv" in base
    assert set(podman.STANDIN_TARGETS) == {"base", "superlink", "supernode", "superexec",
                                           "serverapp", "clientapp"}


def _podman_run(argv, monkeypatch, capsys):
    """``python -m diff2_flwr.deploy.podman run ARGV`` with the deployment replaced: its exit code,
    what it would have deployed (CONFIG and the overrides; None when refused) and its last line on
    stderr. Nothing of Podman runs."""
    from diff2_flwr.runtime.launch import LaunchResult

    deployed = []

    def deploy(config, *, tls, set_keys, resume, log):
        deployed.append((config, set_keys))
        return LaunchResult(run_id=1, status="completed", details="", log="", output_dir=None)

    monkeypatch.setattr(podman, "run_compose_deployment", deploy)
    code = podman._main(["run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, (deployed[0] if deployed else None), (err[-1] if err else "")


@pytest.mark.parametrize("argv,config,overrides", [
    (["--set", "training.rounds=10", "name=both"], "configs/deploy.yaml", {"training.rounds": 10,
                                                                           "name": "both"}),
    (["--set", "training.rounds=10", "--set", "name=both"], "configs/deploy.yaml",
     {"training.rounds": 10, "name": "both"}),
    (["--set", "training.rounds=10", "configs/deploy.yaml"], "configs/deploy.yaml",
     {"training.rounds": 10}),
    (["--tls", "--set", "training.rounds=10", "privacy.epsilon=8", "configs/default.yaml"],
     "configs/default.yaml", {"training.rounds": 10, "privacy.epsilon": 8}),
    (["configs/default.yaml", "--set", "name=x"], "configs/default.yaml", {"name": "x"}),
], ids=["one-set-two-keys", "set-repeated", "file-after-set", "other-file-after-set", "file-first"])
def test_one_set_takes_several_assignments_and_the_file_may_follow(argv, config, overrides,
                                                                   monkeypatch, capsys):
    """The compose deployment's ``--set`` reads as ``diff2 run``'s (tests/test_config.py)."""
    assert _podman_run(argv, monkeypatch, capsys) == (0, (config, overrides), "")


@pytest.mark.parametrize("argv,message", [
    (["--set", "rounds=4"], "unknown key rounds in the overrides. Did you mean training.rounds?"),
    (["--set", "training.rounds=10", "rounds", "name=x"],
     "--set: expected KEY=VALUE (e.g. training.rounds=200). Found 'rounds'."),
    (["configs/deploy.yaml", "--set", "training.rounds=10", "configs/default.yaml"],
     "--set: expected KEY=VALUE (e.g. training.rounds=200). Found 'configs/default.yaml'."),
], ids=["unknown-key", "malformed", "second-file"])
def test_a_bad_set_is_refused_before_podman_in_diff2_runs_words(argv, message, monkeypatch, capsys):
    from diff2_flwr.cli import main

    code, deployed, line = _podman_run(argv, monkeypatch, capsys)
    assert (code, deployed) == (2,
                                None) and line.startswith("[diff2] FAILED: ") and line.endswith(
                                    message)
    config = [] if argv[0] == "configs/deploy.yaml" else ["configs/deploy.yaml"]
    assert main(["run", *config, "--engine", "inprocess", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line.replace("[diff2] FAILED: ",
                                                                            "diff2 run: error: ")
