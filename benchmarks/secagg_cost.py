"""What `privacy.noise: distributed` costs against central noise: bytes per client per round and
seconds per round (prints one JSON object; progress on stderr).

    .venv/bin/python benchmarks/secagg_cost.py [--config configs/default.yaml] [--clients 10]
    [--rounds 5]
                                               [--skip-simulation] [--skip-deployment]

Bytes: one round of the config, built in this process. Central noise: the client's reply is its
clipped mean (float64, one array per layer). Distributed noise: the four stages of Flower 1.42's
SecAgg+ run client by client with Flower's own stage functions (``secaggplus_mod._setup``,
``_share_keys``, ``_collect_masked_vectors``, ``_unmask``) on the real ``Diff2Client`` reply, the
settings of ``secagg_settings`` and the AES masks of ``use_secure_masks``; the masks are checked to
cancel (the unmasked sum is the clients' modular sum). For each message two figures: ``payload``
(the arrays as ``ndarray_to_bytes`` and the bytes values: keys, ciphertexts, shares) and ``objects``
(the bytes of every object Flower 1.42 stores and pushes for the message: the ``Message`` itself
with its metadata, its ``RecordDict``, records and arrays, each ``deflate()``d; without gRPC, HTTP/2
and TLS framing and the object tree of ids). Uploads are what a client sends; downloads what it
receives (the model travels in both modes).

Seconds: the same config, central and distributed, as a Flower simulation (``run_simulation``) and
as a native loopback deployment with TLS and SuperNode authentication (``run_local_deployment``):
the seconds between consecutive rows of metrics.jsonl (round 1's includes the first ClientApp
start), and the whole run's wall time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import (
    Code, FitIns, FitRes, Status, bytes_to_ndarray, ndarray_to_bytes, ndarrays_to_parameters,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.task_identity import TaskIdentity

from diff2_flwr.core.skellam import modular_sum
from diff2_flwr.deploy.native import run_local_deployment
from diff2_flwr.fl import protocol
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.fl.secagg import from_secagg, mask_stream, secagg_settings, use_secure_masks
from diff2_flwr.runtime.config import load_config, parse_config
from diff2_flwr.runtime.driver import secure_sum
from diff2_flwr.runtime.launch import run_simulation
from diff2_flwr.runtime.paths import resolve_config_path
from diff2_flwr.runtime.session import build_server, build_worker


def log(text: str) -> None:
    """One progress line on stderr."""
    print(f"[secagg_cost] {text}", file=sys.stderr, flush=True)


def write_config(config: str, noise: str, clients: int, rounds: int, folder: Path) -> Path:
    """``config`` with privacy.noise, P, R set and its outputs in ``folder`` (a file: the launchers
    take a path)."""
    data = load_config(resolve_config_path(config)).to_dict()
    data["privacy"]["noise"] = noise
    data["training"].update(clients=clients, rounds=rounds)
    data["training"]["restart_every"] = min(data["training"]["restart_every"], rounds)
    data["output"].update(dir=str(folder / f"out-{noise}"), checkpoint=None)
    parse_config(data, config)  # validated before anything runs
    path = folder / f"{noise}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def objects_bytes(content, *, reply_to=None, dst: int = 0) -> int:
    """The bytes of every object Flower stores and pushes for a message with ``content``
    (deflated)."""
    if reply_to is not None:
        msg = Message(content, reply_to=reply_to)
    else:
        msg = Message(content=content, dst_node_id=dst, message_type=MessageType.TRAIN,
                      group_id="1")
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


def payload(values) -> int:
    """Bytes of record values: arrays as sent (``ndarray_to_bytes``, Flower's ``Array.data``), bytes
    and strings their length, each number 8."""
    total = 0
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, (bytes, str)):
                total += len(item.encode() if isinstance(item, str) else item)
            elif isinstance(item, np.ndarray):
                total += len(ndarray_to_bytes(item))
            elif hasattr(item, "data") and isinstance(item.data, bytes):  # flwr Array
                total += len(item.data)
            else:
                total += 8
    return total


def content_payload(content) -> int:
    """:func:`payload` of every record of a ``RecordDict``."""
    records = [*content.config_records.values(), *content.array_records.values(),
               *content.metric_records.values()]
    return sum(payload(r.values()) for r in records)


def a_round(path: Path, r: int):
    """Round ``r`` of ``path`` in this process (the rounds before it released by the in-process
    driver's code): the server, the fit instruction (arrays, config) and every client."""
    cfg = load_config(path)
    server = build_server(cfg, record=False, progress=None)
    workers = [build_worker(cfg, p) for p in range(cfg.clients)]
    for _ in range(r - 1):
        plan = server.plan()
        if server.distributed is not None:
            server.release_sum(secure_sum(server, plan, workers, cfg.training.seed), cfg.clients)
        else:
            server.release([w.reply(plan) for w in workers])
    plan = server.plan()
    arrays, config = protocol.encode_task(plan, server.layout, server.n_min)
    noise = (lambda n_min, dim: cfg.distributed_noise(n_min,
                                                      dim)) if cfg.privacy.distributed else None
    clients = [Diff2Client(w, None, noise=noise, seed=cfg.training.seed) for w in workers]
    return cfg, server, plan, arrays, config, clients


def fit_messages(arrays, config, client):
    """The FitIns content the server sends and the client's FitRes content (Flower's compat
    conversions)."""
    fitins = FitIns(ndarrays_to_parameters(arrays), dict(config))
    out, n, metrics = client.fit(arrays, dict(config))
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(out), n, metrics)
    return compat.fitins_to_recorddict(fitins, True), fitres, out


def central_bytes(path: Path, r: int) -> dict:
    """Round ``r`` of ``path`` with central noise, per client: the bytes of its FitRes upload (its
    clipped mean) and of its FitIns download, as payload and as Flower's objects."""
    cfg, server, plan, arrays, config, clients = a_round(path, r)
    down, fitres, out = fit_messages(arrays, config, clients[0])
    request = Message(content=down, dst_node_id=1, message_type=MessageType.TRAIN, group_id="1")
    up = compat.fitres_to_recorddict(fitres, False)
    return {"round": plan.round, "kind": plan.kind, "dim": server.layout.dim,
            "clients": cfg.clients,
            "upload": {"payload": content_payload(up), "objects": objects_bytes(up,
                                                                                reply_to=request),
                       "what": "FitRes: the clipped mean (float64, one array per layer), "
                               "partition id and round"},
            "download": {"payload": content_payload(down), "objects": objects_bytes(down, dst=1),
                         "what": "FitIns: x_(r-1) (and x_(r-2) on a difference round), the "
                                 "round's config"},
            "round_trips": 1}


def distributed_bytes(path: Path, r: int) -> dict:
    """One SecAgg+ round of ``path`` with Flower's own client stage functions, per client (the
    average over the P clients, which differ only in their node ids' varint lengths)."""
    # by module path: the package re-exports the function under the module's name
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    use_secure_masks()
    cfg, server, plan, arrays, config, clients = a_round(path, r)
    noise = server.distributed
    P, q = cfg.clients, secagg_settings(noise.bits, cfg.clients)
    rng = random.Random(0)
    nids = [rng.getrandbits(63) for _ in range(P)]  # Flower's node ids are random 64-bit integers
    states = {nid: mod.SecAggPlusState(nid=nid) for nid in nids}
    up = {stage: [] for stage in Stage.all()}
    down = {stage: [] for stage in Stage.all()}

    def stage(nid, name, configs: dict, content: RecordDict | None = None, reply=None):
        """The server's message of stage ``name`` to ``nid`` and the client's reply (stage
        function's output)."""
        content = content if content is not None else RecordDict()
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({Key.STAGE: name, **configs})
        request = Message(content=content, dst_node_id=nid, message_type=MessageType.TRAIN,
                          group_id="1")
        down[name].append((content_payload(content), objects_bytes(content, dst=nid)))
        out = reply(ConfigRecord(configs)) if callable(reply) else reply
        res, body = out if isinstance(out, tuple) else (out, RecordDict())
        body.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(dict(res))
        up[name].append((content_payload(body), objects_bytes(body, reply_to=request)))
        return res

    setup = {Key.SAMPLE_NUMBER: P, Key.SHARE_NUMBER: P, Key.THRESHOLD: noise.threshold,
             Key.CLIPPING_RANGE: q.clipping_range, Key.TARGET_RANGE: q.quantization_range,
             Key.MOD_RANGE: q.modulus_range, Key.MAX_WEIGHT: q.max_weight}
    keys = {nid: stage(nid, Stage.SETUP, setup, reply=lambda c,
                       s=states[nid]: mod._setup(s, c)) for nid in nids}
    public = {str(n): [keys[n][Key.PUBLIC_KEY_1], keys[n][Key.PUBLIC_KEY_2]] for n in nids}
    forward = {nid: ([], []) for nid in nids}
    for nid in nids:
        res = stage(nid, Stage.SHARE_KEYS, public, reply=lambda c,
                    s=states[nid]: mod._share_keys(s, c))
        for dst, ciphertext in zip(res[Key.DESTINATION_LIST], res[Key.CIPHERTEXT_LIST]):
            forward[dst][0].append(ciphertext)
            forward[dst][1].append(nid)
    masked, messages = [], []
    for nid, client in zip(nids, clients):
        content, fitres, out = fit_messages(arrays, config, client)
        messages.append(out)

        def collect(c, s=states[nid], fitres=fitres):
            res = mod._collect_masked_vectors(s, c, fitres.num_examples, fitres.parameters)
            body = compat.fitres_to_recorddict(fitres, keep_input=True)
            # what secaggplus_mod does: the arrays leave only masked
            for record in body.array_records.values():
                record.clear()
            return res, body

        res = stage(nid, Stage.COLLECT_MASKED_VECTORS,
                    {Key.CIPHERTEXT_LIST: forward[nid][0], Key.SOURCE_LIST: forward[nid][1]},
                    content, collect)
        masked.append([bytes_to_ndarray(b) for b in res[Key.MASKED_PARAMETERS]])
        stage(nid, Stage.UNMASK, {Key.ACTIVE_NODE_ID_LIST: nids, Key.DEAD_NODE_ID_LIST: []},
              reply=lambda c, s=states[nid]: mod._unmask(s, c))
    # the masks cancel: the sum less every client's private mask is the clients' modular sum
    shapes = [a.shape for a in masked[0]]
    total = [sum(m[i] for m in masked) for i in range(len(shapes))]
    for nid in nids:
        total = [t - pm for t, pm in zip(total, mask_stream(states[nid].rd_seed, q.modulus_range,
                                                            shapes))]
    total = [np.mod(t, q.modulus_range) for t in total]
    assert int(total[0][0]) == P * q.quantization_range, "the weights' sum"
    # each coordinate was quantised to x + M/2 (c = M/2, q = M): the mean of the centred messages
    mean = (total[1] - P * q.quantization_range // 2).astype(np.float64) / P
    expected = modular_sum([np.mod(np.rint(m[0]).astype(np.int64),
                                   1 << noise.bits) for m in messages], noise.bits)
    assert np.array_equal(from_secagg(mean, P, noise.bits),
                          expected), "the unmasked sum is not the modular sum"

    def per_client(table):
        return {stage: {"payload": statistics.fmean(p for p, _ in rows),
                        "objects": statistics.fmean(o for _, o in rows)}
                for stage, rows in table.items()}

    ups, downs = per_client(up), per_client(down)
    vector = masked[0][1]
    return {"round": plan.round, "kind": plan.kind, "dim": server.layout.dim, "clients": P,
            "padded_dim": vector.size,
            "bits": noise.bits, "modulus_range": q.modulus_range, "masked_dtype": str(vector.dtype),
            "masked_vector_bytes": len(ndarray_to_bytes(vector)),
            "weight_array_bytes": len(ndarray_to_bytes(masked[0][0])),
            "public_key_bytes": len(keys[nids[0]][Key.PUBLIC_KEY_1]),
            "ciphertext_bytes": len(forward[nids[0]][0][0]), "ciphertexts_per_client": P - 1,
            "upload": {**ups, "total": _sum(ups)}, "download": {**downs, "total": _sum(downs)},
            "round_trips": 4,
            "masks_cancel": True}


def _sum(stages: dict) -> dict:
    return {k: sum(v[k] for v in stages.values()) for k in ("payload", "objects")}


def seconds(rows_path: Path) -> list[float]:
    """Seconds between consecutive rows of a run's metrics.jsonl (``elapsed_s``): one per round."""
    elapsed = [json.loads(line)["elapsed_s"] for line in rows_path.read_text().splitlines()]
    return [b - a for a, b in zip(elapsed, elapsed[1:])]


def timed(kind: str, noise: str, path: Path, folder: Path) -> dict:
    """Run ``path`` as a Flower simulation or (``kind`` "deployment") a native loopback deployment
    with TLS; its status, wall seconds and seconds per round."""
    log(f"{kind}, {noise} noise ...")
    started = time.perf_counter()
    if kind == "simulation":
        result = run_simulation(str(path), echo=False, cwd=folder)
    else:
        result = run_local_deployment(path, tls=True, workdir=folder / f"deploy-{noise}",
                                      echo=False).launch
    wall = time.perf_counter() - started
    per_round = seconds(result.output_dir / "metrics.jsonl")
    log(f"{kind}, {noise}: {wall:.1f} s, rounds {[round(s, 2) for s in per_round]}")
    return {"status": result.status, "wall_s": wall, "round_s": per_round,
            "mean_round_s": statistics.fmean(per_round),
            "median_round_s": statistics.median(per_round),
            "mean_round_s_after_first": statistics.fmean(per_round[1:]) if len(per_round) > 1
            else None}


def main() -> None:
    """Bytes of one round (a restart, then a difference round when R > 1) and, unless skipped, the
    seconds of a simulation and a deployment, central against distributed; printed as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-simulation", action="store_true")
    parser.add_argument("--skip-deployment", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    with tempfile.TemporaryDirectory(prefix="secagg-cost-") as tmp:
        folder = Path(tmp)
        os.environ.setdefault("FLWR_HOME", str(folder / "flwr-home"))
        paths = {noise: write_config(args.config, noise, args.clients, args.rounds, folder)
                 for noise in ("central", "distributed")}
        log("bytes of one round ...")
        # a run id as Flower draws them (Message metadata)
        TaskIdentity.run_id = random.Random(1).getrandbits(63)
        TaskIdentity.node_id = 1  # the sender of the server's messages (Flower's SUPERLINK_NODE_ID)
        TaskIdentity.task_id = random.Random(2).getrandbits(63)
        sizes = {}
        # a restart round, then (restart_every > 1) a difference round
        for r in (1, 2) if args.rounds > 1 else (1,):
            central, distributed = central_bytes(paths["central"],
                                                 r), distributed_bytes(paths["distributed"], r)
            sizes[f"round_{r}_{central['kind']}"] = {
                "central": central, "distributed": distributed,
                "upload_ratio_objects": distributed["upload"]["total"]["objects"] / central[
                    "upload"]["objects"],
                "download_ratio_objects": distributed["download"]["total"]["objects"] / central[
                    "download"]["objects"]}
        report = {"config": args.config, "clients": args.clients, "rounds": args.rounds,
                  "bytes_per_client_per_round": sizes, "seconds": {}}
        kinds = [k for k, skip in (("simulation", args.skip_simulation), ("deployment",
                                                                          args.skip_deployment))
                 if not skip]
        for kind in kinds:
            report["seconds"][kind] = {noise: timed(kind, noise, paths[noise], folder)
                                       for noise in ("central", "distributed")}
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
