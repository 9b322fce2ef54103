"""The handlers of the ``diff2`` commands of a deployment and its parties: shard, deploy-local,
certs, node-key, secret, compose, ledger, and superlink (the local SuperLink of plain ``flwr run
.``) (the parser is in :mod:`diff2_flwr.cli`).

Each takes the parsed arguments and returns the exit code; each imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..runtime.outputs import to_json

__all__ = ["certs", "compose", "deploy_local", "ledger", "node_key", "secret", "shard",
           "superlink"]


def shard(args: argparse.Namespace) -> int:
    """``diff2 shard``: write one shard file per data owner (and the server's) of the config's
    dataset into ``--out``, printing each path."""
    from ..runtime.config import load_config
    from ..deploy.shards import write_shards

    paths = write_shards(load_config(args.config), args.out)
    for path in paths:
        print(path)
    return 0


def deploy_local(args: argparse.Namespace) -> int:
    """``diff2 deploy-local``: run the config on a native loopback deployment (SuperLink and P
    SuperNodes) and print its status, median seconds per round and folders; 1 if it failed."""
    from ..deploy.native import run_local_deployment
    from ..runtime.launch import SimulationFailed

    try:
        result = run_local_deployment(args.config, tls=args.tls, node_auth=args.node_auth,
                                      resume=args.resume, rounds=args.rounds, clients=args.clients,
                                      workdir=args.workdir, node_policy=args.node_policy)
    except SimulationFailed as err:
        print(f"[diff2] deployment FAILED: {err}", file=sys.stderr)
        return 1
    per_round = sorted(result.round_seconds)[len(
        result.round_seconds) // 2] if result.round_seconds else float("nan")
    security = ("TLS, SuperNode authentication" if result.node_auth
                else "TLS, no SuperNode authentication") \
        if args.tls else "insecure, loopback only"
    print(f"[diff2] deployment run {result.launch.run_id} {result.launch.status} ({security}); "
          f"median {per_round:.1f} s/round; results in {result.launch.output_dir}; run folder "
          f"(shards, keys, logs) {result.workdir}")
    return 0


def certs(args: argparse.Namespace) -> int:
    """``diff2 certs``: a CA and a SuperLink certificate in ``--out``, the data owners' public keys
    checked and copied beside them (or, for one-machine tests, P key pairs made there)."""
    from ..deploy.certs import make_certificates

    if args.clients and args.node_pub:
        print(
            "diff2 certs: give --node-pub (the data owners' public keys) or --clients "
            "(one-machine tests: makes their private keys here), not both.", file=sys.stderr)
        return 2
    try:
        publics = _node_publics(args.node_pub or [], Path(args.out))
    except ValueError as err:
        print(f"diff2 certs: {err}", file=sys.stderr)
        return 2
    certs = make_certificates(args.out, tuple(args.host))
    print(f"CA: {certs.ca} (send it to every data owner)\nserver certificate: {certs.cert}\n"
          f"server key: {certs.key} (0600: stays on the SuperLink host)")
    for public in publics:
        print(
            f"data owner {public.stem.split('-')[-1]}: public key {public} (register: flwr "
            f"supernode register {public} <connection>)")
    return _test_node_keys(args.out, args.clients)


def _node_publics(files: list[str], out: Path) -> list[Path]:
    """The data owners' public keys checked, then copied as ``out/supernode-<i>.pub``: i from a file
    already named so (``diff2 node-key --name supernode-<i>``), else its position among the files
    given."""
    from ..deploy.certs import load_node_public_keys, node_key_names

    keys = load_node_public_keys(files)
    found = [re.fullmatch(r"supernode-(\d+)\.pub", Path(f).name) for f in files]
    indices = [int(m.group(1)) if m else i for i, m in enumerate(found)]
    if len(set(indices)) < len(indices):
        raise ValueError(f"--node-pub {' '.join(files)}: two files would both be data owner "
                         f"{max(indices, key=indices.count)}'s key. Name each supernode-<i>.pub "
                         f"after its owner's "
                         "index, or give them all in the owners' order under other names.")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, key in sorted(zip(indices, keys)):
        path = out / node_key_names(i)[1]
        path.write_bytes(key + b"\n")
        paths.append(path)
    return paths


def _test_node_keys(out: str, clients: int) -> int:
    from ..deploy.certs import make_node_keys

    if not clients:
        return 0
    print(
        f"--clients {clients}: one-machine tests only. Every data owner's private key was made "
        f"here, so whoever "
          "holds this folder can act as any data owner; across hosts each data owner runs `diff2 "
          "node-key` and "
          "sends only its .pub (`diff2 certs --node-pub`).")
    for i, key in enumerate(make_node_keys(out, clients)):
        print(
            f"data owner {i}: SuperNode private key {key.private} (0600), public key {key.public} "
              f"(register: flwr supernode register {key.public} <connection>)")
    return 0


def node_key(args: argparse.Namespace) -> int:
    """``diff2 node-key``: make a data owner's SuperNode key pair and print the public key, the one
    file that leaves the machine."""
    from ..deploy.certs import make_node_key

    key = make_node_key(args.out, args.name)
    print(
        f"private key: {key.private} (0600; it never leaves this machine: the SuperNode reads it "
        f"with --auth-supernode-private-key)\npublic key: {key.public} (send this file, and only "
        f"this one, to the SuperLink's operator, who registers "
        f"it):\n{key.public.read_text().strip()}")
    return 0


def secret(args: argparse.Namespace) -> int:
    """``diff2 secret``: one SuperExec secret file (0600) per name in ``--out``; exit code 2 for a
    name that is a path."""
    from ..runtime.secret_files import make_superexec_secret

    for name in args.names:
        if "/" in name or name in ("", ".", ".."):
            print(
                f"diff2 secret: a name, not a path, expected (superlink, supernode-0, ...). Found "
                f"{name!r}.",
                  file=sys.stderr)
            return 2
        path = make_superexec_secret(Path(args.out) / f"{name}.secret")
        print(
            f"SuperExec secret: {path} (0600; give it to {name} and the SuperExec that runs its "
            f"apps, nobody else)")
    return 0


def compose(args: argparse.Namespace) -> int:
    """``diff2 compose``: print the docker-compose.yml of P data owners (TLS and SuperNode
    authentication as asked)."""
    from ..deploy.compose import render_compose

    print(render_compose(args.clients, args.tls, node_auth=args.node_auth, publish=args.publish,
                         superlink=args.superlink), end="")
    return 0


def ledger(args: argparse.Namespace) -> int:
    """``diff2 ledger``: print a data owner's node ledger as JSON: the runs it charged, each run's ε
    and the lifetime ε spent at ``--delta``."""
    from ..runtime.node_ledger import NodeLedger

    print(json.dumps(to_json(NodeLedger(args.path).summary(args.delta))))
    return 0


def superlink(args: argparse.Namespace) -> int:
    """``diff2 superlink status|stop``: the local SuperLink plain ``flwr run .`` left running for
    an FLWR_HOME, by PID; 1 if one would not stop."""
    from ..runtime.local_superlink import (find_local_superlinks, flwr_home,
                                           stop_local_superlink)

    home = Path(args.flwr_home).expanduser() if args.flwr_home else flwr_home()
    links = find_local_superlinks(home)
    if not links:
        print(f"no local SuperLink of FLWR_HOME={home} is running (plain `flwr run .` starts one "
              f"on its first run)")
        return 0
    code = 0
    for link in links:
        if args.action == "status":
            print(f"local SuperLink of FLWR_HOME={home}: PID {link.pid}, on {link.address} "
                  f"(log {link.log_file}); stop it: diff2 superlink stop")
        elif stop_local_superlink(link):
            print(f"stopped the local SuperLink of FLWR_HOME={home} (PID {link.pid}) and its "
                  f"process group; the next `flwr run .` starts a new one")
        else:
            print(f"diff2 superlink: PID {link.pid} (the local SuperLink of FLWR_HOME={home}) is "
                  f"still running after SIGTERM and SIGKILL: it is not ours to stop (another "
                  f"user's?) or stuck in the kernel; see `ps -o pid,user,stat -p {link.pid}`.",
                  file=sys.stderr)
            code = 1
    return code
