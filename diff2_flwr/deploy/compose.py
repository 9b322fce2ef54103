"""The docker-compose deployment, generated so that P is one number (``diff2 compose --clients P``).

Topology (Flower 1.42, process isolation): one ``superlink``; one ``serverapp`` SuperExec (our
image) that runs the ServerApp against the SuperLink's runtime API; per data owner i a
``supernode-i`` and a ``clientapp-i`` SuperExec (our image) that runs the ClientApp against that
SuperNode. Each ``clientapp-i`` mounts only its own shard, read-only; the ``serverapp`` mounts
only ``server.npz`` (test split, shard sizes) and the outputs folder. Containers run as UID 49999.

Exposure. Flower 1.42's SuperLink serves the Fleet API (SuperNodes), the Control API (``flwr run``,
``flwr supernode register``) and the runtime API on one port, and the open-source SuperLink
authenticates no one on the Control API: whoever reaches that port can submit an app whose
ClientApp runs next to every shard. So the port is published on one address only (default
127.0.0.1: the operator's ``flwr`` on this host; the SuperNodes reach the SuperLink over the
compose network), never on all interfaces. With TLS, SuperNode authentication is on by default:
the SuperLink runs with ``--enable-supernode-auth`` and supernode-i mounts only its own private
key (made on data owner i's machine with ``diff2 node-key``; ``diff2 certs --clients P`` makes all
of them on one machine, for tests); the operator registers the P public keys with ``flwr supernode
register``. The SuperLink's TLS key is mounted into the superlink only; the others get the CA
certificate only.

SuperExec authentication (plain and TLS): the runtime APIs (the SuperLink's, where the serverapp
SuperExec acquires the ServerApp's task; each SuperNode's, where clientapp-i acquires the
ClientApp's) accept ``AcquireTask`` only signed with a shared secret
(``--superexec-auth-secret-file``; Flower 1.42 honours it with ``--isolation process`` only). Two
trust domains, two kinds of secret: ``deploy/secrets/superlink.secret`` is mounted into superlink
and serverapp only (the operator's), ``deploy/secrets/supernode-<i>.secret`` into supernode-i and
clientapp-i only (data owner i's, made on its machine). Without the secret, whoever reaches a
runtime port could take the ServerApp's place and receive every client's exact clipped mean, or a
ClientApp's and answer in a data owner's name.

Node policy: data owner i's folder ``deploy/node-<i>`` (its ``policy.yaml``, written by data owner
i, and its lifetime ledger, written beside it by the ClientApp) is mounted into clientapp-i only, at
``/node``; supernode-i's node config names ``/node/policy.yaml``, so the ClientApp checks every run
and task against it (:mod:`diff2_flwr.runtime.policy`) before it reads the shard. Nobody but data
owner i sets it.

SecAgg+ key signatures (with node authentication): data owner i's folder also holds its SecAgg+
signing key (``secagg.key``, made on its machine) and ``federation.pub``, the P data owners' signing
public keys agreed out of band; supernode-i's node config names both (``auth-key``,
``federation-keys``), so its ClientApp signs its SecAgg+ public keys and refuses a round whose keys
are not signed by P distinct federation keys (:mod:`diff2_flwr.fl.secagg_checks`): the server cannot
invent nodes. It is a key of its own, not the SuperNode's authentication key: that one stays in
supernode-i (the ClientApp's code comes from the app bundle, which must not be able to act as the
node towards the SuperLink).
"""

from __future__ import annotations

import ipaddress
from typing import Any

import yaml

__all__ = ["render_compose", "certificate_hosts", "FLWR_VERSION", "CONTAINER_OUTPUTS",
           "SUPERLINK_PORT",
           "SECRETS_DIR", "SECRET_MOUNT", "NODE_DIR", "NODE_MOUNT", "SECAGG_KEY", "FEDERATION_KEYS"]

FLWR_VERSION = "1.42.0"
SUPERLINK_PORT = 8000
SUPERNODE_PORT = 9094
#: Where the serverapp container sees ``./deploy/outputs`` (configs/deploy.yaml writes there).
CONTAINER_OUTPUTS = "/outputs"
_CA = "./deploy/certs/ca.crt:/certs/ca.crt:ro"
#: Host folder of the SuperExec secrets (0700; each file 0600, owned by UID 49999 for the
#: containers).
SECRETS_DIR = "./deploy/secrets"
#: Where a container sees its one secret.
SECRET_MOUNT = "/secrets/superexec.secret"
#: Data owner i's own folder on its host (its node policy and lifetime ledger; owned by UID 49999,
#: 0700), and where clientapp-i sees it.
NODE_DIR = "./deploy/node-{i}"
NODE_MOUNT = "/node"
#: With node authentication: data owner i's SecAgg+ signing key pair in its own folder
#: (``secagg.key``, ``.pub``; `diff2 node-key --out deploy/node-<i> --name secagg`) and the
#: federation's signing keys, one per data owner, agreed out of band (``federation.pub``): its
#: ClientApp signs its SecAgg+ public keys and checks everyone else's.
SECAGG_KEY = "secagg"
FEDERATION_KEYS = "federation.pub"
_DEFAULT_SUPERLINK = f"superlink:{SUPERLINK_PORT}"


def _secret_volume(name: str) -> str:
    """The read-only mount of ``deploy/secrets/<name>.secret`` (superlink, supernode-<i>) at
    SECRET_MOUNT."""
    return f"{SECRETS_DIR}/{name}.secret:{SECRET_MOUNT}:ro"


_SECRET_FLAG = ["--superexec-auth-secret-file", SECRET_MOUNT]


def certificate_hosts(publish: str = "127.0.0.1", superlink: str = _DEFAULT_SUPERLINK) -> list[str]:
    """The names the SuperLink's certificate must carry: the compose service (the serverapp dials
    it), the address the SuperNodes dial, and the published address (the operator's ``flwr``)."""
    dialled = superlink.rsplit(":", 1)[0].strip("[]")
    hosts = ["superlink", dialled, publish.strip("[]")]
    return list(dict.fromkeys(hosts))


def _publish_address(publish: str) -> str:
    """The one host address the SuperLink port is published on; never all interfaces."""
    try:
        address = ipaddress.ip_address(publish.strip("[]"))
    except ValueError:
        raise ValueError(
            f"`publish`: expected the IP address of one host interface (127.0.0.1 on a single "
            f"host, the SuperLink host's address on the data owners' network otherwise). Found "
            f"{publish!r}."
                         ) from None
    if address.is_unspecified:
        raise ValueError(
            f"`publish` {publish!r} would publish the SuperLink on every interface: anyone who "
            f"reaches "
                         "it could submit code that runs next to the data owners' shards. Give "
                         "the address of the "
                         "one interface the data owners and the operator use (and allow-list "
                         "their addresses).")
    return f"[{address}]" if address.version == 6 else str(address)


def _tls(certs: bool) -> list[str]:
    return ["--root-certificates", "/certs/ca.crt"] if certs else ["--insecure"]


def render_compose(clients: int = 3, tls: bool = False, *, node_auth: bool | None = None,
                   publish: str = "127.0.0.1",
                   superlink: str = f"superlink:{SUPERLINK_PORT}") -> str:
    """The compose file for ``clients`` data owners, plain or TLS (with SuperNode authentication by
    default).

    ``publish``: the host address the SuperLink's port is published on. ``superlink``: the address
    the SuperNodes dial (on one host the compose service; in a multi-host deployment the SuperLink
    host's name).
    """
    if clients < 1:
        raise ValueError(f"`clients` must be >= 1. Found {clients}.")
    node_auth = tls if node_auth is None else node_auth
    if node_auth and not tls:
        raise ValueError(
            "SuperNode authentication needs TLS (Flower refuses `--enable-supernode-auth` on an "
                         "insecure SuperLink): add --tls or pass --no-node-auth.")
    published = f"{_publish_address(publish)}:{SUPERLINK_PORT}:{SUPERLINK_PORT}"
    link_tls = (["--ssl-ca-certfile", "/certs/ca.crt", "--ssl-certfile", "/certs/server.pem",
                 "--ssl-keyfile",
                 "/certs/server.key"] if tls else ["--insecure"])
    services: dict[str, Any] = {
        "superlink": {
            "image": f"flwr/superlink:{FLWR_VERSION}",
            "command": [*link_tls, *(["--enable-supernode-auth"] if node_auth else []),
                        "--isolation", "process", *_SECRET_FLAG, "--host", "0.0.0.0", "--port",
                        str(SUPERLINK_PORT)],
            "ports": [published],
            "volumes": [*([_CA, "./deploy/certs/server.pem:/certs/server.pem:ro",
                           "./deploy/certs/server.key:/certs/server.key:ro"] if tls else []),
                        _secret_volume("superlink")],
        },
        "serverapp": {
            "build": {"context": ".", "dockerfile": "server/Dockerfile"},
            "command": [*_tls(tls), *_SECRET_FLAG, "--runtime-api-address",
                        f"superlink:{SUPERLINK_PORT}"],
            "volumes": ["./deploy/shards/server.npz:/data/shards/server.npz:ro",
                        f"./deploy/outputs:{CONTAINER_OUTPUTS}", *([_CA] if tls else []),
                        _secret_volume("superlink")],
            "depends_on": ["superlink"],
        },
    }
    for i in range(clients):
        node: dict[str, Any] = {
            "image": f"flwr/supernode:{FLWR_VERSION}",
            "command": [*_tls(tls), *(["--auth-supernode-private-key",
                                       "/keys/supernode.key"] if node_auth else []),
                        "--superlink", superlink, "--isolation", "process", *_SECRET_FLAG,
                        "--host", "0.0.0.0", "--port", str(SUPERNODE_PORT), "--node-config",
                        f'partition-id={i} num-partitions={clients} data-path="/data/shard.npz" '
                        + (f'auth-key="{NODE_MOUNT}/{SECAGG_KEY}.key" '
                           f'federation-keys="{NODE_MOUNT}/{FEDERATION_KEYS}" '
                           if node_auth else "")
                        + f'policy="{NODE_MOUNT}/policy.yaml"'],
        }
        node["volumes"] = [*([_CA] if tls else []),
                           *([f"./deploy/certs/supernode-{i}.key:/keys/supernode.key:ro"]
                             if node_auth else []),
                           _secret_volume(f"supernode-{i}")]
        if node_auth:
            # refused until the operator has registered its public key
            node["restart"] = "on-failure"
        # multi-host: `up supernode-i` must not start a SuperLink
        if superlink == f"superlink:{SUPERLINK_PORT}":
            node["depends_on"] = ["superlink"]
        services[f"supernode-{i}"] = node
        services[f"clientapp-{i}"] = {
            "build": {"context": ".", "dockerfile": "clients/Dockerfile"},
            "command": ["--insecure", *_SECRET_FLAG, "--runtime-api-address",
                        f"supernode-{i}:{SUPERNODE_PORT}"],
            "volumes": [f"./deploy/shards/shard-{i}-of-{clients}.npz:/data/shard.npz:ro",
                        _secret_volume(f"supernode-{i}"),
                        f"{NODE_DIR.format(i=i)}:{NODE_MOUNT}"],
            "depends_on": [f"supernode-{i}"],
        }
    header = "".join(f"# {line}\n" for line in _header(clients, tls, node_auth, publish, superlink))
    return header + yaml.safe_dump({"services": services}, sort_keys=False, width=120)


def _header(clients: int, tls: bool, node_auth: bool, publish: str, superlink: str) -> list[str]:
    """The steps that come with the file: one host, or the operator's and a data owner's
    (multi-host)."""
    flags = "".join([f" --clients {clients}", " --tls" if tls else "",
                     " --no-node-auth" if tls and not node_auth else "",
                     f" --publish {publish}" if publish != "127.0.0.1" else "",
                     f" --superlink {superlink}" if superlink != _DEFAULT_SUPERLINK else ""])
    lines = [
        f"Generated by `diff2 compose{flags}`; regenerate rather than edit. Containers run as UID "
        f"49999:",
             "every secret below is a 0600 file that UID 49999 must own (`chown 49999 ...`, as "
             "root)."]
    steps = _one_host_steps if superlink == _DEFAULT_SUPERLINK else _multi_host_steps
    lines += steps(clients, tls, node_auth, publish, superlink)
    lines += [
        f"Exposure: the SuperLink port {SUPERLINK_PORT} (SuperNodes, `flwr run`, `flwr supernode "
        f"register`, the runtime",
        "API: one port, and Flower's open-source SuperLink authenticates no one who submits a "
        "run) is published on "
        f"{_publish_address(publish)} only.",
    ]
    if publish == "127.0.0.1":
        lines += ["Only this host's operator reaches it; the SuperNodes use the compose network."]
    else:
        lines += [
            f"Multi-host: allow-list (firewall) {_publish_address(publish)}:{SUPERLINK_PORT} to "
            f"the data owners' SuperNode hosts and the",
            "operator's address only; nothing else needs to be reachable (SuperNodes and "
            "ClientApps dial out).",
        ]
    return lines + [
        f"Then submit the app: `flwr run . <connection to "
        f"{_publish_address(publish)}:{SUPERLINK_PORT}> "
                    "--run-config \"config='configs/deploy.yaml'\"`."]


def _one_host_steps(clients: int, tls: bool, node_auth: bool, publish: str,
                    superlink: str) -> list[str]:
    owners = " ".join(f"supernode-{i}" for i in range(clients))
    lines = [
        "Before `docker compose up`: `diff2 shard configs/deploy.yaml --out deploy/shards` (one "
        "file per data",
        "owner), `mkdir -p deploy/outputs && chown 49999 deploy/outputs`,",
        f"`diff2 secret --out deploy/secrets superlink {owners}` (SuperExec authentication: who "
        f"may run the",
        "ServerApp and each ClientApp), `chown 49999 deploy/secrets/*.secret`; each data owner's "
        "node policy:",
        "`mkdir -p deploy/node-<i> && cp configs/policy.yaml deploy/node-<i>/` (edit its limits; "
        "its lifetime ledger",
        "is written beside it), `chown -R 49999 deploy/node-<i> && chmod 700 deploy/node-<i>`, "
        "for each i.",
    ]
    if node_auth:
        lines += [
            "SecAgg+ signing keys (distributed noise): `diff2 node-key --out deploy/node-<i> "
            "--name secagg` for each i,",
            "then `cat deploy/node-*/secagg.pub > federation.pub` and copy it to every "
            "deploy/node-<i>/ (before the chown).",
        ]
    if tls:
        hosts = "".join(f" --host {h}" for h in certificate_hosts(publish, superlink))
        lines += [
            f"TLS: `diff2 certs --out "
            f"deploy/certs{hosts}{f' --clients {clients}' if node_auth else ''}`"
                  + (" (one machine: it" if node_auth else "`,"),
                  *(["makes every data owner's node key, for tests only; across hosts see `diff2 "
                     "compose --superlink`),"]
                    if node_auth else []),
                  "then `chown 49999 deploy/certs/*.key`."]
    if node_auth:
        lines += [
            "SuperNode authentication: the SuperLink accepts only registered keys. After `up`, "
            "register each",
            f"data owner's public key: `flwr supernode register deploy/certs/supernode-<i>.pub "
            f"<connection>` for i < {clients};",
            "supernode-i mounts only its own private key and restarts until it is registered.",
        ]
    return lines


def _multi_host_steps(clients: int, tls: bool, node_auth: bool, publish: str,
                      superlink: str) -> list[str]:
    name = f"docker-compose{'.tls' if tls else ''}.yml"
    hosts = "".join(f" --host {h}" for h in certificate_hosts(publish, superlink))
    owner = [
        f"Data owner i (its own host): a clone of this repository (`build:` needs it) with this "
        f"{name} at its root;",
        *(["`diff2 node-key --out deploy/certs --name supernode-<i>`: send only supernode-<i>.pub "
           "to the operator;"]
          if node_auth else []),
        "`diff2 secret --out deploy/secrets supernode-<i>` (its own, never sent); its node "
        "policy: `mkdir -p",
        "deploy/node-<i> && cp configs/policy.yaml deploy/node-<i>/` (its limits and lifetime "
        "budget: edit them),",
        "`chown -R 49999 deploy/node-<i> && chmod 700 deploy/node-<i>`;"
        + (" its SecAgg+ signing key: `diff2 node-key --out deploy/node-<i> --name secagg` (send "
           "secagg.pub to the other data owners; every owner's secagg.pub, agreed out of band, "
           "goes into deploy/node-<i>/federation.pub);"
           if node_auth else "") + " from the operator: its shard as",
        "deploy/shards/shard-<i>-of-P.npz" + (" and deploy/certs/ca.crt" if tls
                                              else "") + "; `chown 49999 "
        + ("deploy/certs/supernode-<i>.key " if node_auth
           else "") + "deploy/secrets/supernode-<i>.secret`;",
        f"`docker compose -f {name} build --build-arg "
        f"PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu",
        f"clientapp-<i>` (CPU torch), `docker compose -f {name} up -d supernode-<i> "
        f"clientapp-<i>`.",
    ]
    pubs = " --node-pub <the supernode-<i>.pub files, i < " + f"{clients}>" if node_auth else ""
    operator = [
        "Operator (the SuperLink host; a clone of this repository too): `diff2 shard "
        "configs/deploy.yaml --out",
        "deploy/shards` (keeps server.npz; shard-<i>-of-P.npz goes to data owner i only), `mkdir "
        "-p deploy/outputs &&",
        "chown 49999 deploy/outputs`, `diff2 secret --out deploy/secrets superlink`,",
        *([f"`diff2 certs --out deploy/certs{hosts}{pubs}`",
           "(send ca.crt to every data owner),"] if tls else []),
        "`chown 49999 deploy/secrets/superlink.secret" + (" deploy/certs/server.key`," if tls
                                                          else "`,"),
        f"`docker compose -f {name} up -d --build superlink serverapp`"
        + (", then `flwr supernode register deploy/certs/supernode-<i>.pub <connection>` for each "
           "i." if node_auth
           else "."),
    ]
    return owner + operator
