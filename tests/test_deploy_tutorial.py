"""docs/tutorials/deployment.md's own commands build a complete ``deploy/`` (issue 40, item 3).

The tutorial's ``bash`` blocks are read from the page and typed, line by line, into a scratch
clone of the repository (``.venv`` linked to this one, as ``scripts/setup.sh`` would leave it): the
one-host steps, and the multi-host steps of the operator and of data owner 1, with the exchange
between them (``received/``) done the way the tutorial says (the operator's compose file, ``ca.crt``
and shard; the other owners' public keys, made here). Then every path the compose file names for the
services of that host — bind-mount sources, the build's Dockerfile, every file a command line or a
node config reads inside a container — must exist on the host, and a data owner's ``deploy/`` must
hold exactly the files the tutorial lists. A step dropped from the page (the node policy's, say)
fails here.

What cannot run here is left out and said: ``git clone`` and ``./scripts/setup.sh`` (the scratch
clone stands for them), ``flwr`` (no SuperLink), ``docker compose`` (with Podman and root, the last
test builds data owner 1's image and brings its two services up from the same folder: marker
``compose``), and ``sudo`` lines without root.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from diff2_flwr.deploy.certs import make_node_key
from diff2_flwr.deploy.containers import copy_project
from diff2_flwr.fl.secagg_checks import node_keys
from diff2_flwr.runtime.config import load_config
from diff2_flwr.runtime.policy import check_run, load_policy

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorials" / "deployment.md"
VENV = Path(sys.executable).parent.parent
ROOTED = os.geteuid() == 0
#: Lines that cannot run here (see the module's docstring); everything else is typed as written.
NOT_HERE = ("git clone ", "./scripts/setup.sh", "docker compose ", "flwr ",
            "for i in 0 1 2; do flwr ")
OWNER = 1  # the tutorial's data owner, of P = 3


def section(heading: str) -> str:
    """The tutorial's text from ``## heading`` to the next ``## ``."""
    text = TUTORIAL.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def bash_lines(text: str) -> list[str]:
    """The commands of ``text``'s ``bash`` blocks, a continued line joined, comments kept (markers),
    trailing comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                line = re.sub(r"\s+#\s.*$", "", line)
            if line:
                lines.append(line)
    return lines


def clone(where: Path) -> Path:
    """A clone after ``./scripts/setup.sh``: the project's files, ``.venv`` (this one, linked)."""
    copy_project(where)
    (where / ".venv").symlink_to(VENV)
    return where


def type_lines(lines: list[str], cwd: Path) -> list[str]:
    """Run each line in a fresh bash in ``cwd`` (umask 022, no venv on PATH); the lines skipped."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLWR_", "DIFF2_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if Path(p) != VENV / "bin")
    skipped = []
    for line in lines:
        if line.startswith("#") or line.startswith(NOT_HERE):
            skipped.append(line)
            continue
        # `a && sudo b`: as root b runs without sudo; otherwise b is left out
        parts = [part.removeprefix("sudo ") for part in line.split(" && ")
                 if ROOTED or not part.startswith("sudo ")]
        if not parts:
            skipped.append(line)
            continue
        typed = " && ".join(parts)
        done = subprocess.run(["bash", "-c", f"umask 022 && {typed}"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"tutorial line failed in {cwd}:\n{line}\n{done.stderr}"
    return skipped


# ---------------------------------------------------------------- what a compose file reads


def mounts(service: dict) -> dict[str, str]:
    """``{container path: host path}`` of a service's bind mounts (``./x:/y[:ro]``)."""
    found = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        found[container] = host
    return found


def on_host(container_path: str, table: dict[str, str]) -> str | None:
    """The host path a container path reads through ``table``'s mounts, or None (not mounted)."""
    for inside, host in sorted(table.items(), key=lambda item: -len(item[0])):
        if container_path == inside or container_path.startswith(inside.rstrip("/") + "/"):
            return host + container_path[len(inside):]
    return None


def node_config(command: list[str]) -> dict[str, str]:
    """A SuperNode's ``--node-config "k=v k2=\\"v2\\""`` as a dict."""
    if "--node-config" not in command:
        return {}
    text = command[command.index("--node-config") + 1]
    return {k: v.strip('"') for k, v in (item.split("=", 1) for item in shlex.split(text))}


def paths_read(compose: dict, services: list[str]) -> dict[str, str]:
    """``{what reads it: host path}`` for everything ``services`` read from the host: mount
    sources, Dockerfiles, and each absolute path on a command line or in a node config (a node
    config's files are read by the SuperNode's ClientApp, in ``clientapp-<i>``)."""
    found = {}
    for name in services:
        service = compose["services"][name]
        table = mounts(service)
        for inside, host in table.items():
            found[f"{name} mount {inside}"] = host
        build = service.get("build")
        if build:
            found[f"{name} build"] = str(Path(build["context"]) / build["dockerfile"])
        for token in service.get("command", []):
            if token.startswith("/"):
                found[f"{name} {token}"] = on_host(token, table)
        app = name.replace("supernode-", "clientapp-")
        for key, value in node_config(service.get("command", [])).items():
            if value.startswith("/"):
                found[f"{name} node config {key}"] = on_host(
                    value, mounts(compose["services"][app]))
    return found


def missing(project: Path, compose_file: str, services: list[str]) -> list[str]:
    """What ``services`` of the compose file read and ``project`` lacks (or nothing mounts)."""
    compose = yaml.safe_load((project / compose_file).read_text())
    read = paths_read(compose, services)
    # never an empty check: each SuperNode's node policy is among what is read
    assert all(f"{s} node config policy" in read for s in services if s.startswith("supernode-"))
    return [f"{what}: {host}" for what, host in read.items()
            if host is None or not (project / host).exists()]


def listed_files(text: str) -> set[str]:
    """The paths of the ``text`` block in ``text`` (the tutorial's list of a data owner's files)."""
    (block,) = re.findall(r"```text\n(.*?)```", text, flags=re.S)
    return {line.split()[0] for line in block.splitlines() if line.strip()}


def files_under(folder: Path, relative_to: Path) -> set[str]:
    return {str(p.relative_to(relative_to)) for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- one host


def test_the_one_host_steps_make_every_file_docker_compose_yml_reads(tmp_path):
    project = clone(tmp_path / "host")
    type_lines(bash_lines(section("On one host")), project)
    services = list(yaml.safe_load((project / "docker-compose.yml").read_text())["services"])
    assert missing(project, "docker-compose.yml", services) == []
    for i in range(3):  # each data owner's policy, which its ClientApp loads
        assert load_policy(project / "deploy" / f"node-{i}" / "policy.yaml").max_epsilon == 3.0
        if ROOTED:
            assert (project / "deploy" / f"node-{i}").stat().st_uid == 49999


# ---------------------------------------------------------------- several hosts


@pytest.fixture(scope="module")
def owner(tmp_path_factory) -> Path:
    """Data owner 1's clone after the tutorial's steps, the operator's with them (``received/``)."""
    tmp = tmp_path_factory.mktemp("tutorial")
    operator, own = clone(tmp / "operator-host"), clone(tmp / "owner-host")
    type_lines(bash_lines(section("On several hosts")), operator)  # the compose file
    (own / "received").mkdir()
    (own / "received" / "docker-compose.tls.yml").write_bytes(
        (operator / "docker-compose.tls.yml").read_bytes())
    steps = bash_lines(section("As a data owner"))
    sent = next(i for i, line in enumerate(steps) if line.startswith("# send"))
    type_lines(steps[:sent], own)  # keys, secret, node folder: before anything comes back
    others = {j: tmp / f"owner-{j}" for j in range(3) if j != OWNER}
    (operator / "received").mkdir()
    (operator / "received" / f"supernode-{OWNER}.pub").write_bytes(
        (own / "deploy" / "certs" / f"supernode-{OWNER}.pub").read_bytes())
    for j, folder in others.items():
        made = make_node_key(folder, f"supernode-{j}")
        (operator / "received" / made.public.name).write_bytes(made.public.read_bytes())
        secagg = make_node_key(folder / "node", "secagg")
        (own / "received" / f"secagg-{j}.pub").write_bytes(secagg.public.read_bytes())
    type_lines(bash_lines(section("As the operator")), operator)
    for path in ("certs/ca.crt", f"shards/shard-{OWNER}-of-3.npz"):
        source = operator / "deploy" / path
        (own / "received" / source.name).write_bytes(source.read_bytes())
    type_lines(steps[sent:], own)
    return own


def test_a_data_owners_steps_make_every_file_its_services_read(owner):
    assert missing(owner, "docker-compose.tls.yml", [f"supernode-{OWNER}",
                                                     f"clientapp-{OWNER}"]) == []


def test_a_data_owners_deploy_folder_holds_exactly_the_files_the_tutorial_lists(owner):
    assert files_under(owner / "deploy", owner) == listed_files(section("As a data owner"))


def test_the_data_owners_node_reads_its_policy_and_keys_as_its_clientapp_would(owner):
    node = owner / "deploy" / f"node-{OWNER}"
    policy = load_policy(node / "policy.yaml")
    # the run the operator submits (configs/deploy.yaml) is one this starter policy admits
    check_run(policy, load_config(owner / "configs" / "deploy.yaml"), f"data owner {OWNER}")
    keys = node_keys({"auth-key": str(node / "secagg.key"),
                      "federation-keys": str(node / "federation.pub")})
    assert len(keys.federation) == 3 and keys.public in keys.federation
    modes = {p: p.stat().st_mode & 0o777 for p in (
        node, node / "secagg.key", owner / "deploy" / "certs" / f"supernode-{OWNER}.key",
        owner / "deploy" / "secrets" / f"supernode-{OWNER}.secret")}
    assert set(modes.values()) <= {0o700, 0o600}, modes
    if ROOTED:  # the containers' user owns what it reads owner-only or writes
        assert {p.stat().st_uid for p in modes} | {(node / "policy.yaml").stat().st_uid} == {49999}


# ---------------------------------------------------------------- brought up (Podman, root)


@pytest.mark.compose
@pytest.mark.deployment
def test_the_data_owners_services_come_up_and_read_their_files(owner):
    """`docker compose ... build clientapp-1` and `up -d supernode-1 clientapp-1` with Podman in the
    folder the tutorial's steps made; inside clientapp-1 (UID 49999) the node policy, the SecAgg+
    keys, the shard and the secret are read the way the ClientApp reads them. (No SuperLink answers
    at sl.example.org here: supernode-1 keeps retrying it, which changes nothing of this.)"""
    from diff2_flwr.deploy.podman import (ComposeStack, ensure_images,  # noqa: PLC0415 -- Podman tests only
                                          pip_build_args, unavailable_reason)

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"compose test skipped: {reason}")
    ensure_images(log=print)
    project = "diff2-owner-tutorial"  # one name: a rerun replaces its image instead of adding one
    app, node = f"clientapp-{OWNER}", f"supernode-{OWNER}"
    with ComposeStack(owner, tls=True, project=project, log=print) as stack:
        # the tutorial's --build-arg names the public CPU-torch index; here the host's pip config
        args = shlex.join(["--pull=never", *pip_build_args(owner.parent / "build-scratch")])
        stack.compose("--podman-build-args", args, "build", app, timeout=3600)
        stack.compose("up", "-d", "--no-build", node, app, timeout=600)
        deadline = time.monotonic() + 120
        while stack.state(app) != "running" and time.monotonic() < deadline:
            time.sleep(1)
        assert stack.state(app) == "running", stack.logs(app)[-3000:]
        probe = stack.exec(app, ["python3", "-c", READ_PROBE], check=False)
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert json.loads(probe.stdout.strip().splitlines()[-1]) == {
            "uid": 49999, "policy": "data-owner-example", "federation": 3, "shard": True,
            "secret": 64}


#: Run in clientapp-1 as ``python3 -c``: what its ClientApp reads, read the same way.
READ_PROBE = """
import json, os
import numpy as np
from diff2_flwr.fl.secagg_checks import node_keys
from diff2_flwr.runtime.policy import load_policy
keys = node_keys({"auth-key": "/node/secagg.key", "federation-keys": "/node/federation.pub"})
with np.load("/data/shard.npz") as shard:
    has = len(shard.files) > 0
print(json.dumps({"uid": os.getuid(), "policy": load_policy("/node/policy.yaml").name,
                  "federation": len(keys.federation), "shard": has,
                  "secret": len(open("/secrets/superexec.secret").read().strip())}))
"""
