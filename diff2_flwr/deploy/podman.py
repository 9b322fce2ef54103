"""``docker-compose.yml`` / ``docker-compose.tls.yml`` brought up for real, with Podman and
podman-compose.

A machine without a Docker engine (ours) runs the compose files with Podman: podman-compose reads
them unchanged, and ``server/Dockerfile`` / ``clients/Dockerfile`` are built with ``podman build``.
Where Docker Hub is out of reach, stand-ins for Flower's images (``flwr/base``, ``flwr/superlink``,
``flwr/supernode``, ``flwr/superexec``, ``flwr/serverapp``, ``flwr/clientapp`` 1.42.0) are built
locally from ``scripts/standin/Containerfile`` on a Debian 12 base made with debootstrap (same user,
UID 49999, working directory, ENV and entrypoints as the official ones) and tagged with the official
names. Where the official images are present (pulled), they are used and nothing is built.

Builds see the host's pip configuration: ``pip config list`` is written into the build's
``/etc/pip.conf`` and every local path it names (file indexes, wheel folders, the CA bundle, a
constraints file) is mounted read-only at the same place, with the host's network.

:class:`ComposeStack` runs one compose project: it prepares ``deploy/`` the way the compose file's
header says (shards, outputs owned by UID 49999, certificates and node keys for TLS), builds, brings
the stack up, registers the SuperNode keys (TLS), submits runs with ``flwr run`` to 127.0.0.1:8000,
and brings everything down again, also on failure. ``python -m diff2_flwr.deploy.podman`` exposes it
(``images``: build the stand-ins; ``run``: the whole deployment of a config; ``down``)::

    python -m diff2_flwr.deploy.podman run [--tls] [--resume] [--set KEY=VALUE ...] [CONFIG]

``--set`` works as in ``diff2 run``: one ``--set`` takes several assignments (``--set
training.rounds=40 privacy.epsilon=8``), repeating it works too, and in ``--set a=1 CONFIG`` the
last word without ``=`` is CONFIG when no other was given. CONFIG and the overrides are checked
before any image is built or pulled.

Running podman itself (its environment, errors, image names) is in :mod:`.containers`; the
project's files and its ``deploy/`` folder in :mod:`.compose_folder`; the command line's parser in
:mod:`.podman_cli`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.config import load_config, yaml_text
from ..runtime.launch import (
    CONNECTION,
    LaunchResult,
    SimulationFailed,
    tool,
    flwr_env,
    flwr_run,
    run_config_arg,
)
from ..runtime.paths import APP_DIR
from .compose import FLWR_VERSION, SUPERLINK_PORT
from .compose_folder import ComposeFolder
from .containers import (CONTAINERS_CONF, FIND_FILES_PROBE, STANDIN_DIR, PodmanError, copy_project,
                         image_exists, image_label, official_name, podman, podman_compose_tool,
                         podman_env, port_free, run_tool)
from .native import list_nodes, register_node
from .podman_cli import build_parser, run_request

__all__ = ["CONTAINERS_CONF", "ComposeStack", "ImageReport", "PodmanError", "STANDIN_DIR",
           "STANDIN_TARGETS",
           "copy_project", "ensure_images", "podman_env", "unavailable_reason"]

#: Stage names in scripts/standin/Containerfile = the official image names flwr/<target>.
STANDIN_TARGETS = ("base", "superlink", "supernode", "superexec", "serverapp", "clientapp")
#: The images the compose files and our Dockerfiles name.
NEEDED = ("superlink", "supernode", "superexec")
DEBIAN_BASE = "localhost/diff2-debian:bookworm"
DEFAULT_PROJECT = "diff2-compose"


def unavailable_reason() -> str | None:
    """Why the compose files cannot be brought up here, or None when they can."""
    if shutil.which("podman") is None:
        return ("podman is not installed (`apt-get install podman runc`; .ci/run installs it when "
                "it can)")
    if podman_compose_tool() is None:
        return (f"podman-compose is not installed next to {sys.executable} or on PATH "
                "(`pip install podman-compose`; .ci/run installs it when it can)")
    if os.geteuid() != 0:
        return ("the compose test runs rootful Podman (as root); rootless Podman is not set up or "
                "tested here")
    info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=120, check=False)
    if info.returncode != 0:
        return (f"`podman info` fails (CONTAINERS_CONF={podman_env()['CONTAINERS_CONF']}): "
                f"{info.stderr.strip()[-500:]}")
    missing = [name for name in NEEDED if not image_exists(official_name(name))]
    if missing and shutil.which("debootstrap") is None:
        return (
            f"images {', '.join(official_name(m) for m in missing)} are missing and debootstrap, "
            f"needed to "
                "build their stand-ins, is not installed (`apt-get install debootstrap`)")
    return None



# ---------------------------------------------------------------- the host's pip configuration in a
# build

def _pip_settings() -> dict[str, str]:
    """``pip config list`` of this interpreter as {key: value}; environment variables win over
    files."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                          text=True, timeout=120)
    files, env = {}, {}
    for line in done.stdout.splitlines():
        match = re.match(r"^(:env:|[a-z]+)\.([A-Za-z0-9_-]+)='(.*)'$", line.strip())
        if match:
            (env if match.group(1) == ":env:" else files)[match.group(2)] = match.group(3)
    return {**files, **env}


def pip_build_args(scratch: Path) -> list[str]:
    """``podman build`` options that give a build the host's pip configuration, network and local
    indexes."""
    settings = _pip_settings()
    mounts: list[str] = []
    for key, value in settings.items():
        for token in value.split():
            path = token[len("file://"):] if token.startswith("file://") else token
            if not path.startswith("/") or not Path(path).exists():
                continue
            if key.endswith("index-url") and Path(path).name == "simple":
                path = str(Path(path).parent)  # a local index's pages link to files beside simple/
            if path not in mounts:
                mounts.append(path)
    scratch.mkdir(parents=True, exist_ok=True)
    conf = scratch / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    args = ["--network", "host", "--volume", f"{conf}:/etc/pip.conf:ro"]
    for path in mounts:
        args += ["--volume", f"{path}:{path}:ro"]
    return args


# ---------------------------------------------------------------- stand-in images

@dataclass(frozen=True)
class ImageReport:
    """Where the Flower images came from, how long :func:`ensure_images` took, and each build
    step's seconds."""

    source: str  # "official" (present, not ours), "standin" (present and current) or "built"
    seconds: float
    steps: dict[str, float]


def debian_mirror() -> str:
    """The Debian mirror apt uses on this host (deb822 or one-line sources), else deb.debian.org."""
    apt = Path("/etc/apt")
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]:
        if not path.is_file() or path.suffix not in (".list", ".sources", ""):
            continue
        text = path.read_text(errors="replace")
        for match in re.finditer(r"^\s*(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+/debian)/?\s*$",
                                 text, re.M):
            return match.group(1)
        for match in re.finditer(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s+bookworm\b", text,
                                 re.M):
            return match.group(1)
    return "http://deb.debian.org/debian"


def _make_debian_base(log: Callable[[str], None]) -> None:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise PodmanError(
            "debootstrap is not installed: `apt-get install debootstrap` (needed to make the local "
                          f"Debian base {DEBIAN_BASE} of the stand-in images).")
    mirror = debian_mirror()
    with tempfile.TemporaryDirectory(prefix="diff2-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        log(f"[diff2] debootstrap bookworm from {mirror} (a minimal Debian 12 with Python 3.11; "
            f"~1 minute)")
        run_tool([debootstrap, "--variant=minbase",
                  "--include=python3,python3-venv,ca-certificates", "bookworm", str(root), mirror],
                  timeout=1800)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(["podman", "import", "-", DEBIAN_BASE], stdin=tar.stdout,
                                      env=podman_env(), capture_output=True, text=True,
                                      timeout=1800)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        if imported.returncode != 0:
            raise PodmanError(f"`podman import - {DEBIAN_BASE}` failed: {imported.stderr[-2000:]}")


def ensure_images(*, force: bool = False, log: Callable[[str], None] = print) -> ImageReport:
    """The images the compose files name: the official ones if present, else our stand-ins (built
    when missing or when scripts/standin/Containerfile changed since they were built; all of them
    with ``force``)."""
    started = time.perf_counter()
    containerfile = STANDIN_DIR / "Containerfile"
    digest = hashlib.sha256(containerfile.read_bytes()).hexdigest()[:16]
    present = {t: image_exists(official_name(t)) for t in NEEDED}
    ours = {t: image_label(official_name(t), "diff2.standin.containerfile") for t in NEEDED}
    if not force and all(present.values()) and not any(ours.values()):
        return ImageReport("official", time.perf_counter() - started, {})
    if not force and all(present.values()) and all(v == digest for v in ours.values()):
        return ImageReport("standin", time.perf_counter() - started, {})
    steps: dict[str, float] = {}
    if force or not image_exists(DEBIAN_BASE):
        t0 = time.perf_counter()
        _make_debian_base(log)
        steps["debian_base"] = time.perf_counter() - t0
        log(f"[diff2] {DEBIAN_BASE} made in {steps['debian_base']:.0f} s")
    with tempfile.TemporaryDirectory(prefix="diff2-standin-") as scratch:
        build = pip_build_args(Path(scratch))
        for target in STANDIN_TARGETS:
            t0 = time.perf_counter()
            log(f"[diff2] building stand-in {official_name(target)}")
            podman("build", "--pull=never", "--target", target, "--build-arg",
                   f"BASE_IMAGE={DEBIAN_BASE}",
                   "--build-arg", f"FLWR_VERSION={FLWR_VERSION}", "--label",
                   f"diff2.standin.containerfile={digest}", *build, "-f", str(containerfile), "-t",
                   official_name(target), str(STANDIN_DIR), timeout=1800)
            steps[target] = time.perf_counter() - t0
            log(f"[diff2] {official_name(target)} built in {steps[target]:.0f} s")
    return ImageReport("built", time.perf_counter() - started, steps)


# ---------------------------------------------------------------- one compose project


class ComposeStack(ComposeFolder):
    """One compose project (plain or TLS) in ``project_dir``, driven through podman-compose; its
    files and ``deploy/`` folder as in :class:`~.compose_folder.ComposeFolder`.

    Use as a context manager: leaving it brings the project down (containers, network), also on
    failure.
    """

    def __init__(self, project_dir: str | os.PathLike[str], *, tls: bool,
                 project: str = DEFAULT_PROJECT, log: Callable[[str], None] = print) -> None:
        super().__init__(project_dir, tls=tls)
        self.project, self.log = project, log
        self.node_ids: dict[int, int] = {}
        self._tool = podman_compose_tool()
        if self._tool is None:
            raise PodmanError(unavailable_reason() or "podman-compose not found")
        self._scratch = Path(tempfile.mkdtemp(prefix="diff2-compose-build-"))

    # -- plumbing
    def compose(self, *args: str, timeout: float = 600,
                check: bool = True) -> subprocess.CompletedProcess:
        """``podman-compose ARGS`` on this project (with ``check``, a failure raises)."""
        return run_tool([self._tool, "--no-ansi", "-p", self.project, "-f", self.file, *args],
                        cwd=self.dir, timeout=timeout, check=check)

    def container(self, service: str) -> str:
        """``service``'s container name, as podman-compose names it (``<project>_<service>_1``)."""
        return f"{self.project}_{service}_1"  # podman-compose's naming: <project>_<service>_<index>

    def exec(self, service: str, argv: list[str], *, check: bool = False, timeout: float = 300
             ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``service``'s container (output captured)."""
        return podman("exec", self.container(service), *argv, check=check, timeout=timeout)

    def logs(self, service: str) -> str:
        """``service``'s log so far, stdout then stderr (podman's error if it has no container)."""
        done = podman("logs", self.container(service), check=False, timeout=120)
        return done.stdout + done.stderr

    def kill(self, service: str) -> None:
        """Kill ``service``'s container at once (SIGKILL, no grace)."""
        podman("kill", self.container(service), timeout=120)

    def stop(self, service: str, grace_s: int = 10) -> None:
        """Stop ``service``'s container: SIGTERM, SIGKILL after ``grace_s`` seconds."""
        podman("stop", "-t", str(grace_s), self.container(service), timeout=120)

    def start(self, service: str) -> None:
        """Start ``service``'s stopped container again."""
        podman("start", self.container(service), timeout=120)

    def state(self, service: str) -> str:
        """``service``'s container state (``running``, ``exited``, ...), or ``absent``."""
        done = podman("inspect", "--format", "{{.State.Status}}", self.container(service),
                      check=False, timeout=60)
        return done.stdout.strip() if done.returncode == 0 else "absent"

    # -- lifecycle
    def build(self) -> float:
        """Build the serverapp image first (the clientapp builds then hit its layer cache), then the
        rest."""
        started = time.perf_counter()
        args = shlex.join(["--pull=never", *pip_build_args(self._scratch)])
        self.compose("--podman-build-args", args, "build", "serverapp", timeout=3600)
        self.compose("--podman-build-args", args, "build", timeout=3600)
        return time.perf_counter() - started

    def up(self, timeout_s: float = 300) -> float:
        """``up -d``, then wait until the SuperLink answers and all P SuperNodes are connected (TLS:
        after registering their public keys). A leftover project of the same name is brought down
        first."""
        started = time.perf_counter()
        self.down(quiet=True)
        if not port_free(SUPERLINK_PORT):
            raise PodmanError(
                f"127.0.0.1:{SUPERLINK_PORT} is in use: the compose files publish the SuperLink "
                f"there. Stop what listens on it (`ss -ltnp 'sport = :{SUPERLINK_PORT}'`) and try "
                f"again.")
        self.compose("up", "-d", "--no-build", timeout=600)
        deadline = time.monotonic() + timeout_s
        self._wait_health(deadline)
        if self.node_auth:
            keys = sorted(self.certs.glob("supernode-*.pub"),
                          key=lambda p: int(p.stem.split("-")[1]))
            env = flwr_env(self.home)
            self.node_ids = {i: register_node(key, env, i) for i, key in enumerate(keys)}
        self._wait_nodes(deadline)
        return time.perf_counter() - started

    def _wait_health(self, deadline: float) -> None:
        scheme = "https" if self.tls else "http"
        context = ssl.create_default_context(cafile=str(
            self.certs / "ca.crt")) if self.tls else None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{SUPERLINK_PORT}/health",
                                            timeout=2, context=context) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.state("superlink") not in ("running", "created", "configured"):
                break
            time.sleep(1)
        raise PodmanError(
            f"the superlink container did not become healthy ({self.state('superlink')}); its "
            f"log:\n"
                          + self.logs("superlink")[-3000:])

    def _wait_nodes(self, deadline: float) -> None:
        """Every SuperNode connected: its node id known (registered keys, or the id it logs) and
        online."""
        while time.monotonic() < deadline:
            if not self.node_auth:
                for i in range(self.clients):
                    found = re.findall(r"SuperNode ID: (\d+)", self.logs(f"supernode-{i}"))
                    if found:
                        self.node_ids[i] = int(found[-1])
            if len(self.node_ids) == self.clients:
                if not self.node_auth:
                    return
                online = {int(n["node-id"]) for n in self.nodes() if n.get("status") == "online"}
                if set(self.node_ids.values()) <= online:
                    return
            time.sleep(2)
        raise PodmanError(
            f"not all {self.clients} SuperNodes connected in time (known: {self.node_ids}); "
                          "supernode-0's log:\n" + self.logs("supernode-0")[-3000:])

    def down(self, quiet: bool = False) -> None:
        """``down`` (3 s grace), then remove whatever of the project is left, by id (containers,
        network)."""
        self.compose("down", "-t", "3", timeout=300, check=False)
        label = f"label=io.podman.compose.project={self.project}"
        left = podman("ps", "-a", "-q", "--filter", label, check=False, timeout=60).stdout.split()
        if left:
            podman("rm", "-f", "-t", "0", *left, check=False, timeout=120)
        for network in podman("network", "ls", "-q", "--filter", label, check=False,
                              timeout=60).stdout.split():
            podman("network", "rm", "-f", network, check=False, timeout=60)
        if not quiet:
            self.log(f"[diff2] compose project {self.project} is down")

    def __enter__(self) -> ComposeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)

    # -- runs
    def run(self, config: str = "configs/deploy.yaml", set_keys: Mapping[str, Any] | None = None, *,
            on_line: Callable[[str], None] | None = None, echo: bool = False,
            timeout_s: float = 1800
            ) -> LaunchResult:
        """``flwr run <app> <connection to 127.0.0.1:8000> --stream`` with ``config`` (a path inside
        the app) and ``set_keys``; raise :class:`SimulationFailed` unless the run completed.
        ``output_dir`` is the host path."""
        overrides: dict[str, Any] = {"config": config, **{k: yaml_text(v) for k,
                                                          v in (set_keys or {}).items()}}
        result = flwr_run(APP_DIR, flwr_env(self.home), ["--run-config", run_config_arg(overrides)],
                          timeout_s=timeout_s, echo=echo, on_line=on_line)
        return LaunchResult(result.run_id, result.status, result.details, result.log,
                            self.host_path(result.output_dir))

    def nodes(self) -> list[dict]:
        """``flwr supernode ls``: the SuperLink's nodes."""
        return list_nodes(flwr_env(self.home))

    def stop_run(self, run_id: int) -> None:
        """``flwr stop RUN_ID``: the SuperLink stops that run (whatever the command answers)."""
        subprocess.run([tool("flwr"), "stop", str(run_id), CONNECTION], env=flwr_env(self.home),
                       capture_output=True, text=True, timeout=120)

    def find_files_with_content(self, service: str, files: Iterable[Path]) -> dict[str, list[str]]:
        """Every path inside ``service``'s container whose bytes equal one of ``files`` (by size,
        then SHA-256), as {file name: [container paths]}; /proc, /sys and /dev are skipped."""
        wanted = {hashlib.sha256(Path(f).read_bytes()).hexdigest(): Path(f).name for f in files}
        sizes = sorted({Path(f).stat().st_size for f in files})
        done = self.exec(service, ["python3", "-c", FIND_FILES_PROBE, json.dumps(wanted),
                                   json.dumps(sizes)],
                         check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])


def run_compose_deployment(config: str, *, tls: bool, set_keys: Mapping[str, Any] | None = None,
                           project_dir: Path = APP_DIR, resume: bool = False, echo: bool = True,
                           log: Callable[[str], None] = print) -> LaunchResult:
    """The whole deployment of ``config`` (a path inside the app, e.g. configs/deploy.yaml) with the
    committed compose file, in ``project_dir``'s ``deploy/``: images, shards, (certificates), build,
    up, (register), ``flwr run``, down. A checkpoint left in deploy/outputs is removed first unless
    ``resume``."""
    reason = unavailable_reason()
    if reason:
        raise PodmanError(f"cannot bring the compose files up here: {reason}")
    report = ensure_images(log=log)
    log(f"[diff2] Flower images: {report.source} ({report.seconds:.0f} s)")
    with ComposeStack(project_dir, tls=tls, log=log) as stack:
        stack.prepare(Path(project_dir) / config, set_keys)
        # the ServerApp of a deployment needs P
        if load_config(Path(project_dir) / config, set_keys).clients_auto:
            set_keys = {**(set_keys or {}), "training.clients": stack.clients}
        if not resume:
            stack.fresh()
        log(f"[diff2] built the app images in {stack.build():.0f} s")
        log(f"[diff2] {stack.file} is up in {stack.up():.0f} s: SuperNodes {stack.node_ids}")
        return stack.run(config, set_keys, echo=echo)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n")[0]).parse_args(argv)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.command == "images":
            reason = unavailable_reason()
            if reason and not reason.startswith("images "):
                raise PodmanError(reason)
            report = ensure_images(force=args.force, log=log)
            print(json.dumps({"source": report.source, "seconds": round(report.seconds, 1),
                              "steps": {k: round(v, 1) for k, v in report.steps.items()}}))
        elif args.command == "run":
            try:
                config, overrides = run_request(args)
            # refused before anything started: one line, in diff2 run's words
            except ValueError as err:
                print(f"[diff2] FAILED: {' '.join(str(err).split())}", file=sys.stderr)
                return 2
            result = run_compose_deployment(config, tls=args.tls, set_keys=overrides,
                                            resume=args.resume, log=log)
            print(json.dumps({"run_id": result.run_id, "status": result.status,
                              "output_dir": str(result.output_dir) if result.output_dir else None}))
        else:
            for tls in (False, True):
                with ComposeStack(APP_DIR, tls=tls, log=log):
                    pass
    except (PodmanError, SimulationFailed, ValueError) as err:
        print(f"[diff2] FAILED: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
