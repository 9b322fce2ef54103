"""Run the Flower app as a local simulation with ``flwr run``, cleaning up after itself.

``flwr run .`` alone reuses (or starts and leaves behind) a shared local SuperLink, and exits
0 even when the run failed. This launcher instead starts a private SuperLink on free loopback
ports with a temporary ``FLWR_HOME``, runs ``flwr run <app> <connection> --stream`` with
``num-supernodes`` = the config's P, reads the run's final status back, and always stops the
SuperLink it started, by PID.

The SuperLink runs with ``--isolation process`` and a fresh SuperExec secret
(``--superexec-auth-secret-file``, 0600 in the private ``FLWR_HOME``), and the launcher starts the
one ``flower-superexec`` that may take the simulation's task: any other local process that reaches
the loopback port is refused instead of taking the run (Flower 1.42 ignores the secret in subprocess
isolation, where it spawns its own SuperExec).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .app_stage import stage_app
from .config import AUTO_CLIENTS_DEFAULT, load_config, yaml_text
from .console import RunConsole, verbose_from_env
from .paths import APP_DIR, resolve_config_path
from .secret_files import make_superexec_secret

__all__ = ["CONNECTION", "LaunchResult", "SimulationDiverged", "SimulationFailed", "flwr_env",
           "flwr_run", "free_ports",
           "run_config_arg", "run_simulation", "start", "stop_process", "tool", "wait_healthy",
           "write_connection"]

#: The name of the one SuperLink connection in a private ``$FLWR_HOME/config.toml``
#: (:func:`write_connection`).
CONNECTION = "diff2-local"


class SimulationFailed(RuntimeError):
    """``flwr run`` did not complete the run; the message carries Flower's status details."""


@dataclass(frozen=True)
class LaunchResult:
    """How a ``flwr run`` ended: its run id, final status (``flwr ls``'s, e.g.
    ``finished:completed``), Flower's status details, the streamed log, and the output folder the
    ServerApp announced in it (None if none)."""

    run_id: int
    status: str
    details: str
    log: str
    output_dir: Path | None


class SimulationDiverged(SimulationFailed):
    """The run stopped because the optimisation diverged (its summary says ``status: diverged``):
    a training failure, not a privacy one. ``result`` locates its metrics; ``diverged_at`` is the
    round."""

    def __init__(self, message: str, result: LaunchResult, diverged_at: int) -> None:
        super().__init__(message)
        self.result, self.diverged_at = result, diverged_at


def _diverged_at(output_dir: Path | None) -> int | None:
    """The round at which the run in ``output_dir`` diverged, per its summary.json, else None."""
    try:
        summary = json.loads((output_dir / "summary.json").read_text()) if output_dir else {}
    except (OSError, ValueError):
        return None
    return summary.get("diverged_at") if summary.get("status") == "diverged" else None


def _toml(value: str | int | float) -> str:
    if isinstance(value, str):
        if "'" in value:
            raise ValueError(f"Run-config values cannot contain a single quote. Found {value!r}.")
        return f"'{value}'"
    return repr(value)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago, all probed at once, then released
    (two separate probes may be handed the same port — a SuperLink given one port for its API and
    its health server then fails to bind).

    They are drawn below the kernel's ephemeral range (``ip_local_port_range``, 32768–60999 on
    Linux): between this probe and the server's own bind, a port of that range can be taken by any
    outgoing connection on the machine as its source port (a SuperNode of a deployment test once
    failed to bind that way while other tests ran). Below it only an explicit bind can take a port.
    Where that range is unknown, or no port below it can be bound, the kernel picks (port 0).
    """
    low, high = _UNASSIGNED_FROM, _ephemeral_low()
    chooser = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        tries = 0
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = chooser.randrange(low, high) if high - low > 4 * n and tries < 50 * n else 0
            tries += 1
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


#: The lowest port ``free_ports`` draws (above the registered ports of common local services).
_UNASSIGNED_FROM = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), or ``_UNASSIGNED_FROM`` where it is
    unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _UNASSIGNED_FROM


def tool(name: str) -> str:
    """The path of Flower's command ``name``: beside this Python (its venv) first, else on PATH."""
    local = Path(sys.executable).with_name(name)
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(
            f"`{name}` not found next to {sys.executable} or on PATH: is flwr installed?")
    return found


def wait_healthy(port: int, process: subprocess.Popen, log_path: Path, timeout_s: float = 60,
                  ca_file: Path | None = None) -> None:
    """Return once the SuperLink answers ``/health`` on 127.0.0.1:``port`` (HTTPS verified with
    ``ca_file``); raise :class:`SimulationFailed` with its log if ``process`` exits or after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    scheme = "https" if ca_file else "http"
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SimulationFailed(
                f"flower-superlink exited with code {process.returncode}; log: {log_path}\n"
                                   + log_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/health", timeout=0.5,
                                        context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SimulationFailed(
        f"flower-superlink did not become healthy within {timeout_s:.0f} s; log: {log_path}")


def stop_process(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop ``process`` (started as a process-group leader: ``start``) and every process of its
    group.

    SIGTERM to the group, SIGKILL after ``grace_s``. The group's other members (the SuperExec, the
    run's ``flwr-simulation``) can outlive its leader: one that is hung never runs its SIGTERM
    handler (a bench's ``flwr-simulation`` stuck with its GIL held stayed behind as an orphan that
    way), so they too get SIGKILL when they are still there ``grace_s`` after the leader.
    """
    group = process.pid
    if process.poll() is None:
        try:
            os.killpg(group, signal.SIGTERM)
            process.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            _kill_group(group)
            process.wait(timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill_group(group)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (not ours): nothing we can stop
        return False
    return True


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def flwr_env(home: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Flower commands: our venv first on PATH, FLWR_HOME, no runtime installs."""
    bin_dir = str(Path(sys.executable).parent)  # the SuperLink spawns flower-superexec from PATH
    return {**os.environ, **(env or {}), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1"}


def write_connection(home: Path, port: int, root_certificates: Path | None = None) -> None:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection, the default."""
    tls = (f'root-certificates = "{root_certificates}"\n' if root_certificates
           else "insecure = true\n")
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = '
        f'"127.0.0.1:{port}"\n{tls}'
    )


def start(cmd: list[str], log_path: Path, env: dict[str, str],
          cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen:
    """Start a long-running Flower component in its own process group, logging to ``log_path``."""
    with log_path.open("w") as log:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def flwr_run(app_dir: Path, run_env: dict[str, str], extra: list[str], *, cwd=None,
             timeout_s: float = 3600, echo: bool = True, on_line=None,
             console: RunConsole | None = None) -> LaunchResult:
    """``flwr run <app> <connection> --stream ...``, then the run's final status from ``flwr ls``.

    With ``echo`` the stream goes to ``console`` (default: a :class:`RunConsole` on stderr that
    drops Flower's INFO chatter unless ``DIFF2_VERBOSE=1``); ``on_line`` sees every raw line. Flower
    builds the FAB from a staged copy of the app's shippable files
    (:func:`~diff2_flwr.runtime.app_stage.stage_app`: the same FAB without walking the checkout's
    ``.venv``).
    """
    staging = Path(tempfile.mkdtemp(prefix="diff2-flwr-app-"))
    try:
        return _flwr_run(stage_app(app_dir, staging / "diff2-flwr"), run_env, extra, cwd=cwd,
                         timeout_s=timeout_s, echo=echo, on_line=on_line, console=console)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _flwr_run(app_dir: Path, run_env: dict[str, str], extra: list[str], *, cwd, timeout_s: float,
              echo: bool, on_line, console: RunConsole | None) -> LaunchResult:
    run_cmd = [tool("flwr"), "run", str(app_dir), CONNECTION, "--stream", *extra]
    own_console = echo and console is None
    if own_console:
        console = RunConsole(verbose=verbose_from_env())
    if not echo:
        console = None
    if console is not None:
        console.feed(f"[diff2] {' '.join(run_cmd)}")
    lines: list[str] = []
    proc = subprocess.Popen(run_cmd, cwd=cwd, env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if console is not None:
                console.feed(line)
            if on_line is not None:
                on_line(line)
            if time.monotonic() > deadline:
                raise SimulationFailed(f"`flwr run` exceeded {timeout_s:.0f} s.")
        proc.wait(timeout=60)
    finally:
        stop_process(proc)
        if own_console:
            console.close()
    output = "".join(lines)
    match = re.search(r"Successfully started run (\d+)", output)
    if proc.returncode != 0 or not match:
        raise SimulationFailed(
            f"`flwr run` exited with code {proc.returncode} before starting a "
            f"run:\n{output[-3000:]}")
    run_id = int(match.group(1))
    listing = subprocess.run([tool("flwr"), "ls", CONNECTION, "--run-id", str(run_id), "--format",
                              "json"],
                             env=run_env, capture_output=True, text=True, timeout=60)
    try:
        info = json.loads(listing.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        raise SimulationFailed(
            f"Cannot read the status of run {run_id}: {listing.stdout}{listing.stderr}") from None
    found = re.search(r"writing per-round metrics and summary to (\S+)", output)
    result = LaunchResult(run_id, info.get("status", "?"), info.get("status-details", ""), output,
                          Path(found.group(1)) if found else None)
    if result.status != "finished:completed":
        diverged_at = _diverged_at(result.output_dir)
        if diverged_at is not None:
            raise SimulationDiverged(
                f"Run {run_id} diverged at round {diverged_at} (ended as {result.status}); "
                                     f"metrics in {result.output_dir}.", result, diverged_at)
        raise SimulationFailed(f"Run {run_id} ended as {result.status}: {result.details}")
    return result


def run_simulation(  # noqa: PLR0913 -- the launcher's options, keyword-only (CLI, lab, tests)
    config: str | None = "configs/default.yaml",
    *,
    app_dir: str | os.PathLike[str] = APP_DIR,
    cwd: str | os.PathLike[str] | None = None,
    timeout_s: float = 3600,
    echo: bool = True,
    env: dict[str, str] | None = None,
    clients: int | None = None,
    run_config: dict[str, str | int | float] | None = None,
    set_keys: Mapping[str, Any] | None = None,
    console: RunConsole | None = None,
) -> LaunchResult:
    """Run ``config`` through ``flwr run`` on a private local SuperLink; raise if the run did not
    complete.

    Relative output paths in the config resolve against ``cwd`` (default: the current directory).
    ``set_keys`` overrides single keys of the experiment file (``{"training.rounds": 200}``): they
    travel as Flower run-config keys, so the ServerApp and every ClientApp apply the same ones. For
    another Flower app (``config=None``), give ``clients`` and its ``run_config`` overrides. A
    config with ``training.clients: auto`` runs with ``clients`` SuperNodes (default
    :data:`AUTO_CLIENTS_DEFAULT`). With ``echo``, the run's log goes to ``console`` (default: a
    filtering :class:`RunConsole` on stderr).
    """
    app_dir = Path(app_dir).resolve()
    overrides = dict(run_config or {})
    if config is not None:
        config_path = resolve_config_path(config, app_dir)
        cfg = load_config(config_path, set_keys)  # validated here, before anything starts
        # this launcher starts the SuperNodes: P is their number, and every app is told it
        if cfg.clients_auto:
            clients = clients or AUTO_CLIENTS_DEFAULT
            set_keys = {**(set_keys or {}), "training.clients": clients}
        else:
            clients = cfg.clients
        overrides["config"] = str(config_path)
        overrides.update({k: yaml_text(v) for k, v in (set_keys or {}).items()})
    if clients is None:
        raise ValueError("run_simulation needs `clients` when no experiment config is given.")
    home = Path(tempfile.mkdtemp(prefix="diff2-flwr-home-"))
    port, health = free_ports(2)
    write_connection(home, port)
    run_env = flwr_env(home, env)
    log_path = home / "superlink.log"
    secret = str(make_superexec_secret(home / "secrets" / "superlink.secret"))
    superlink = start([tool("flower-superlink"), "--insecure", "--simulation", "--isolation",
                       "process",
                       "--superexec-auth-secret-file", secret, "--host", "127.0.0.1", "--port",
                       str(port),
                       "--health-server-address", f"127.0.0.1:{health}"], log_path, run_env, cwd)
    superexec = None
    try:
        wait_healthy(port, superlink, log_path)
        superexec = start([tool("flower-superexec"), "--insecure", "--superexec-auth-secret-file",
                           secret,
                           "--runtime-api-address", f"127.0.0.1:{port}", "--parent-pid",
                           str(superlink.pid)],
                          # --parent-pid: it exits with the SuperLink
                          home / "superexec.log", run_env, cwd)
        extra = ["--federation-config", f"num-supernodes={clients}"]
        if overrides:
            extra += ["--run-config", run_config_arg(overrides)]
        return flwr_run(app_dir, run_env, extra, cwd=cwd, timeout_s=timeout_s, echo=echo,
                        console=console)
    finally:
        if superexec is not None:
            stop_process(superexec)
        stop_process(superlink)
        shutil.rmtree(home, ignore_errors=True)


def run_config_arg(overrides: dict[str, str | int | float]) -> str:
    """``overrides`` as the value of ``flwr run --run-config``: ``key=value`` pairs, strings
    TOML-quoted (a value holding a single quote is refused)."""
    return " ".join(f"{k}={_toml(v)}" for k, v in overrides.items())
