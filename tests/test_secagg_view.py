"""What the server sees of one client under ``privacy.noise: distributed`` (issue 23): its masked
vector, which is uniform on [0, R) whatever the client's message, and nothing else that depends on
the message; while the sum of the messages decodes exactly, also when a client drops after sending
its key shares.

How: Flower's own SecAgg+ runs in-process. The server side is Flower's ``SecAggPlusWorkflow``
itself, built as the ServerApp builds it (``server/server_app.py`` ``run_secure``:
``num_shares=1.0``, threshold (P - t)/P and :func:`~diff2_flwr.fl.secagg.secagg_settings`); it does
its own forwarding (set-up config, public keys, encrypted shares, unmask requests) and its own
unmasking, through a grid (:class:`_Grid`) that serialises every message to Flower's protobuf wire
format and back, delivers it to the client's mod stack and records every reply: the server's whole
view. The client side is the ClientApp's mod, :func:`~diff2_flwr.fl.secagg.secure_sum_mod`, around
Flower's ``secaggplus_mod``, with the worker's reply from
:func:`~diff2_flwr.fl.protocol.encode_share`. Masks come from
:func:`~diff2_flwr.fl.secagg.mask_stream` (``secure_sum_mod`` installs it in both Flower modules).

It asserts:

1. exactness: the sum unmasked from the recorded transcript (re-done here as ``unmask_stage`` does
   it, from the masked vectors and the Shamir shares the server received) is Σ messages mod M, and
   the strategy's input, decoded by :func:`~diff2_flwr.fl.protocol.decode_secure_sum`
   (:func:`~diff2_flwr.fl.secagg.from_secagg`), too;
2. the server's view of one client: its masked vector over many fresh protocol runs and many
   coordinates passes a chi-square test of uniformity on [0, R) for messages at both ends of the
   range and for a real Skellam encoding, and a two-sample (homogeneity) chi-square test does not
   tell the messages apart; everything else the client sends (public keys, ciphertexts of shares,
   the FitRes's metrics and num_examples, its unmask-stage shares) is byte-for-byte the same
   whatever its message (the client forked at the masking stage with identical keys), and is
   produced before or without the message (the ClientApp runs only at the masking stage);
3. the tests have teeth: with the masks set to zero the same uniformity and two-sample tests reject;
4. P = 5, threshold 3: a client that drops after sending its shares has its pairwise masks rebuilt
   from the shares of its secret key and the sum of the 4 survivors decodes exactly.

Statistics: every chi-square test is at α = 1e-6, the tail taken by the Wilson-Hilferty
approximation (accurate to a few per cent in the statistic at these degrees of freedom), bucketing
[0, R) into 256 equal buckets with >= 100 expected per bucket. The statistical tests draw the
clients' key material (the ECDH key pairs, the private mask seeds) from a seeded generator instead
of OS randomness, so their outcome is fixed (the masks are a function of that key material alone);
the exactness and dropout tests use Flower's own OS-random key generation.

What it cannot show: that AES-CTR masks are computationally indistinguishable from uniform (a
statistical test only checks the marginal distribution of these draws); anything about an actively
malicious server (one that lies about dropouts to obtain both a client's private-seed shares and its
secret-key shares, forges public keys, or colludes with clients; SecAgg+ resists the first only with
threshold > P/2 and consistency checks Flower 1.42 does not run), or about a server that re-runs
rounds to average the noise away; nor side channels (timing, message sizes, which are the same for
every message here anyway).
"""

from __future__ import annotations

import copy
import importlib
import math
import types

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import (
    Code, FitIns, FitRes, Status, bytes_to_ndarray, ndarrays_to_parameters, parameters_to_ndarrays,
)
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage,
)
from flwr.common.serde import message_from_proto, message_to_proto, recorddict_to_proto
from flwr.compat.common import recorddict_compat as compat
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from diff2_flwr.core import skellam as sk
from diff2_flwr.fl import protocol, secagg
from diff2_flwr.fl.secagg import from_secagg, mask_stream, secagg_settings, secure_sum_mod

# by module path: the packages re-export functions of the same names as these modules
client_module = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
server_module = importlib.import_module(
    "flwr.server.workflow.secure_aggregation.secaggplus_workflow")

ALPHA = 1e-6
BUCKETS = 256


@pytest.fixture(autouse=True)
def _restore_flower_masks(monkeypatch):
    """``secure_sum_mod`` installs our masks in Flower's modules (process-wide): put Flower's back
    afterwards."""
    for module in (client_module, server_module):
        monkeypatch.setattr(module, "pseudo_rand_gen", module.pseudo_rand_gen)
    # the ServerApp process's identity, which Flower's runtime sets before the workflow makes its
    # messages
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


# ------------------------------------------------------------------------------ the protocol,
# in-process

class _Proxy:
    """What the workflow uses of a ClientProxy: its node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Strategy:
    """The strategy's two calls in ``SecAggPlusWorkflow``: every client sampled; the results
    kept."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids, self.results, self.failures = node_ids, None, None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Proxy(nid), FitIns(parameters, {"round": server_round})) for nid in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = results, failures
        return (results[0][1].parameters if results else None), {}


class _Node:
    """One SuperNode: its context (the mod's state lives there), the ClientApp's mod stack and its
    message."""

    def __init__(self, node_id: int, partition_id: int, message: np.ndarray, clients: int,
                 tolerated: int, bits: int) -> None:
        self.node_id, self.partition_id = node_id, partition_id
        self.message, self.bits = message, bits
        self.context = Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(),
                               run_config={})
        self.mod = secure_sum_mod(lambda ctxt: (clients, tolerated, bits), round_key=protocol.ROUND)
        self.app_calls: list[str] = []  # the SecAgg+ stage of each call of the ClientApp

    def handle(self, msg: Message, context: Context | None = None,
               message: np.ndarray | None = None) -> Message:
        stage = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
        message = self.message if message is None else message

        # the worker's reply (clients/client_app.py)
        def client_app(msg: Message, ctxt: Context) -> Message:
            self.app_calls.append(stage)
            fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
            task = protocol.WorkerTask(int(fitins.config["round"]), 0.0, np.zeros(1), None, 1)
            arrays, num_examples, metrics = protocol.encode_share(task, message, self.partition_id,
                                                                  self.bits)
            fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), num_examples,
                            metrics)
            return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)

        return self.mod(msg, self.context if context is None else context, client_app)


def _wire(msg: Message) -> bytes:
    return message_to_proto(msg).SerializeToString()


def _unwire(data: bytes) -> Message:
    return message_from_proto(ProtoMessage.FromString(data))


class _Grid:
    """``send_and_receive`` over Flower's wire format, delivering to in-process nodes; ``view``
    records every reply the server received, by stage and node (the server's whole view of the
    clients).

    ``drop``: node id -> the stage from which that node sends nothing. ``fork``: (node id, other
    message): at the masking stage that node's state is copied and the same request answered a
    second time from the copy with the other message (the reply kept in ``forked``, not sent); the
    copy answers the unmask request too."""

    def __init__(self, nodes: dict[int, _Node], drop: dict[int, str] | None = None,
                 fork: tuple[int, np.ndarray] | None = None) -> None:
        self.nodes, self.drop, self.fork = nodes, drop or {}, fork
        self.view: dict[str, dict[int, Message]] = {stage: {} for stage in Stage.all()}
        self.requests: dict[str, dict[int, Message]] = {stage: {} for stage in Stage.all()}
        self.forked: dict[str, Message] = {}
        self.fork_context: Context | None = None

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        stages = Stage.all()
        for msg in messages:
            data = _wire(msg)
            nid = msg.metadata.dst_node_id
            stage = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            self.requests[stage][nid] = _unwire(data)
            if nid in self.drop and stages.index(stage) >= stages.index(self.drop[nid]):
                continue  # gone: no reply
            node = self.nodes[nid]
            if self.fork is not None and self.fork[
                0] == nid and stage == Stage.COLLECT_MASKED_VECTORS:
                self.fork_context = copy.deepcopy(node.context)
                self.forked[stage] = _unwire(_wire(node.handle(_unwire(data), self.fork_context,
                                                               self.fork[1])))
            elif self.fork_context is not None and self.fork[0] == nid and stage == Stage.UNMASK:
                self.forked[stage] = _unwire(_wire(node.handle(_unwire(data), self.fork_context)))
            reply = _unwire(_wire(node.handle(_unwire(data))))
            self.view[stage][nid] = reply
            replies.append(reply)
        return replies


def _run(messages: list[np.ndarray], *, bits: int, tolerated: int, drop=None,
         fork=None) -> tuple[_Grid, _Strategy]:
    """One round of SecAgg+ over the clients' messages (client i: node id 1001 + 7i, partition i),
    with the workflow the ServerApp builds."""
    clients = len(messages)
    nodes = {1001 + 7 * i: _Node(1001 + 7 * i, i, m, clients, tolerated, bits) for i,
             m in enumerate(messages)}
    grid = _Grid(nodes, drop={list(nodes)[i]: stage for i, stage in (drop or {}).items()},
                 fork=None if fork is None else (list(nodes)[fork[0]], fork[1]))
    strategy = _Strategy(list(nodes))
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                    run_config={}),
                            strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: 1})
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([np.zeros(3)]), keep_input=True)
    q = secagg_settings(bits, clients)
    workflow = SecAggPlusWorkflow(num_shares=1.0,
                                  reconstruction_threshold=(clients - tolerated) / clients,
                                  clipping_range=q.clipping_range,
                                  quantization_range=q.quantization_range,
                                  modulus_range=q.modulus_range, max_weight=q.max_weight)
    workflow(grid, context)
    return grid, strategy


def _masked(reply: Message) -> list[np.ndarray]:
    """A client's masked vector as the server received it: [masked weight factor, masked
    message]."""
    return [bytes_to_ndarray(b)
            for b in reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]


def _unmask_transcript(grid: _Grid, modulus_range: int) -> tuple[int, np.ndarray, int]:
    """The sum the server's view yields, unmasked as ``unmask_stage`` does it: (the summed weight
    factor, the summed quantised messages, the number of survivors)."""
    survivors = sorted(grid.view[Stage.COLLECT_MASKED_VECTORS])
    sampled = sorted(grid.view[Stage.SETUP])
    total = None
    for nid in survivors:
        vec = _masked(grid.view[Stage.COLLECT_MASKED_VECTORS][nid])
        total = vec if total is None else [a + b for a, b in zip(total, vec)]
    total = [np.mod(a, modulus_range) for a in total]
    shapes = [a.shape for a in total]
    shares: dict[int, list[bytes]] = {nid: [] for nid in sampled}
    for reply in grid.view[Stage.UNMASK].values():
        res = reply.content.config_records[RECORD_KEY_CONFIGS]
        for owner, share in zip(res[Key.NODE_ID_LIST], res[Key.SHARE_LIST], strict=True):
            shares[owner].append(share)
    public_keys = {nid: grid.view[Stage.SETUP][nid].content.config_records[RECORD_KEY_CONFIGS][
        Key.PUBLIC_KEY_1]
                   for nid in sampled}
    for nid, share_list in shares.items():
        secret = combine_shares(share_list)
        if nid in survivors:  # its private mask seed
            total = [a - m for a, m in zip(total, mask_stream(secret, modulus_range, shapes))]
        else:  # its secret key 1: the pairwise masks it added to the survivors' sum
            for other in sampled:
                if other == nid:
                    continue
                key = generate_shared_key(bytes_to_private_key(secret),
                                          bytes_to_public_key(public_keys[other]))
                mask = mask_stream(key, modulus_range, shapes)
                total = [a + m if nid > other else a - m for a, m in zip(total, mask)]
    factor, summed = [np.mod(a, modulus_range) for a in total]
    return int(factor[0]), summed, len(survivors)


def _decode_strategy_input(strategy: _Strategy, clients: int, bits: int) -> tuple[np.ndarray, int]:
    results = [(str(proxy.node_id), parameters_to_ndarrays(fitres.parameters), fitres.metrics)
               for proxy, fitres in strategy.results]
    return protocol.decode_secure_sum(results, 1, clients, bits)


def _encoded(dim: int, bits: int, seed: int) -> np.ndarray:
    """A real client message: a data vector's Skellam encoding (rounded rotation plus noise, mod
    M)."""
    rng = np.random.default_rng(seed)
    code = sk.SkellamCode(dim=dim, scale=2.0 ** (bits - 8), rho=sk.rounding_bound(dim, 1e-6),
                          bits=bits, seed=seed)
    return sk.encode(rng.normal(size=dim), code, 25.0, rng)


# ------------------------------------------------------------------------------ 1. exactness

@pytest.mark.parametrize("bits", [16, 31])
def test_the_workflow_and_the_transcript_unmask_the_exact_modular_sum(bits):
    clients, dim = 3, 64
    m = 1 << bits
    messages = [_encoded(dim, bits, seed) for seed in (1, 2, 3)]
    messages[0][:4] = [0, m // 2 - 1, m // 2, m - 1]  # the centring's edges
    messages[1][:4] = m - 1
    grid, strategy = _run(messages, bits=bits, tolerated=1)
    expected = sk.modular_sum(messages, bits)
    r = secagg_settings(bits, clients).modulus_range
    factor, summed, survivors = _unmask_transcript(grid, r)
    assert survivors == clients and factor == clients * m  # every weight 1: q_ratio = q = M each
    # Σ (centred m_i + M/2) < P·M <= R: no wrap; minus P·M/2 it is Σ centred m_i ≡ Σ m_i (mod M)
    assert np.array_equal(np.mod(summed - clients * (m // 2), m), expected)
    total, count = _decode_strategy_input(strategy, clients, bits)
    assert count == clients and np.array_equal(total, expected)
    mean = parameters_to_ndarrays(strategy.results[0][1].parameters)[0]
    assert np.array_equal(from_secagg(mean, clients, bits), expected)
    assert not strategy.failures


# ------------------------------------------------------------------------------ 2-3. the server's
# view of one client

def _seed_key_material(monkeypatch, seed: int) -> None:
    """The clients' ECDH key pairs and private mask seeds from a seeded generator (the masks are a
    function of these alone), so that the statistical tests are reproducible."""
    rng = np.random.default_rng(seed)

    def generate_key_pairs():
        # in [1, 2**383) below P-384's group order
        scalar = (int.from_bytes(rng.bytes(48), "big") >> 1) | 1
        private = ec.derive_private_key(scalar, ec.SECP384R1())
        return private, private.public_key()

    monkeypatch.setattr(client_module, "generate_key_pairs", generate_key_pairs)
    monkeypatch.setattr(client_module, "os", types.SimpleNamespace(urandom=lambda n: rng.bytes(n)))


def _zero_masks(monkeypatch) -> None:
    """Masking broken: every mask zero (``secure_sum_mod`` installs ``secagg.mask_stream`` at each
    call)."""
    def zeros(seed, num_range, dimensions_list):
        return [np.zeros(shape, dtype=np.int64) for shape in dimensions_list]

    monkeypatch.setattr(secagg, "mask_stream", zeros)


def _chi2_threshold(df: int, alpha: float = ALPHA) -> float:
    """The upper-α quantile of χ²(df) by Wilson-Hilferty."""
    z = _normal_upper_quantile(alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _normal_upper_quantile(alpha: float) -> float:
    lo, hi = 0.0, 40.0
    for _ in range(200):  # bisection on the normal tail, erfc(z / √2) / 2 = α
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid / math.sqrt(2)) / 2 > alpha else (lo, mid)
    return lo


def _bucket_counts(values: np.ndarray, modulus_range: int) -> np.ndarray:
    assert values.min() >= 0 and values.max() < modulus_range
    return np.bincount(values // (modulus_range // BUCKETS), minlength=BUCKETS)


def _uniformity(counts: np.ndarray) -> float:
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


def _homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample χ² of equal-size samples' bucket counts: (statistic, degrees of freedom)."""
    assert a.sum() == b.sum()
    used = (a + b) > 0
    return float(((a[used] - b[used]) ** 2 / (a[used] + b[used])).sum()), int(used.sum()) - 1


BITS, DIM, RUNS = 16, 8192, 5  # 40 960 coordinates per message: 160 expected per bucket


def _views(bits: int, runs: int) -> tuple[dict[str, np.ndarray], int, int]:
    """Client 0's masked message over ``runs`` fresh protocol runs, for each of three messages (the
    other two clients' messages real encodings): {name: all its masked coordinates}, R and M."""
    m = 1 << bits
    own = {"lowest": np.full(DIM, m // 2),  # centred -M/2: quantised to 0
           "highest": np.full(DIM, m // 2 - 1),  # centred M/2 - 1: quantised to M - 1
           "encoded": _encoded(DIM, bits, 7)}
    views = {}
    for name, message in own.items():
        seen = []
        for run in range(runs):
            grid, strategy = _run([message, _encoded(DIM, bits, 100 + run), _encoded(DIM, bits,
                                                                                     200 + run)],
                                  bits=bits, tolerated=1)
            # the round completed (and decoded: see the exactness test)
            assert strategy.results is not None
            factor, masked = _masked(grid.view[Stage.COLLECT_MASKED_VECTORS][1001])
            seen.append(masked)
        views[name] = np.concatenate(seen)
    return views, secagg_settings(bits, 3).modulus_range, m


def test_one_clients_masked_vector_is_uniform_on_zero_to_r_whatever_its_message(monkeypatch):
    _seed_key_material(monkeypatch, 2023)
    views, r, _ = _views(BITS, RUNS)
    threshold = _chi2_threshold(BUCKETS - 1)
    counts = {name: _bucket_counts(v, r) for name, v in views.items()}
    for name, c in counts.items():
        assert _uniformity(c) < threshold, name
    for a, b in (("lowest", "highest"), ("lowest", "encoded"), ("highest", "encoded")):
        stat, df = _homogeneity(counts[a], counts[b])
        assert stat < _chi2_threshold(df), (a, b)
    # the masked coordinates use all of [0, R), not [0, M) nor a shifted copy of the message
    assert all(v.max() >= r - r // 64 and v.min() < r // 64 for v in views.values())


def test_without_masks_the_same_tests_tell_the_messages_apart(monkeypatch):
    """The negative control: masking broken (zero masks), the server's view is the quantised message
    itself; the same uniformity and two-sample tests reject at the same α, so the test above would
    fail if masking broke."""
    _seed_key_material(monkeypatch, 2023)
    _zero_masks(monkeypatch)
    views, r, m = _views(BITS, RUNS)
    assert np.array_equal(views["lowest"],
                          np.zeros(DIM * RUNS)) and np.all(views["highest"] == m - 1)
    threshold = _chi2_threshold(BUCKETS - 1)
    counts = {name: _bucket_counts(v, r) for name, v in views.items()}
    for name, c in counts.items():
        assert _uniformity(c) > threshold, name
    for a, b in (("lowest", "highest"), ("lowest", "encoded"), ("highest", "encoded")):
        stat, df = _homogeneity(counts[a], counts[b])
        assert stat > _chi2_threshold(max(df, 1)), (a, b)


def test_nothing_else_the_client_sends_depends_on_its_message():
    """Client 0 forked at the masking stage (same keys, same shares): one copy sends the lowest
    message, the other a real encoding. Their replies differ in the masked vector only, by the
    difference of the quantised messages mod R (the same masks); their unmask-stage replies are
    identical; the public keys and the ciphertexts of shares were sent before the ClientApp ran at
    all."""
    bits, dim = 16, 256
    m = 1 << bits
    lowest, encoded = np.full(dim, m // 2), _encoded(dim, bits, 11)
    grid, strategy = _run([lowest, _encoded(dim, bits, 12), _encoded(dim, bits, 13)], bits=bits,
                          tolerated=1, fork=(0, encoded))
    r = secagg_settings(bits, 3).modulus_range
    assert strategy.results is not None
    # the worker's message exists only from the masking stage on
    for nid, node in grid.nodes.items():
        # 1001: forked
        assert node.app_calls == [Stage.COLLECT_MASKED_VECTORS] * (2 if nid == 1001 else 1)
    # set-up and share-keys replies: keys and ciphertexts only, made before any message
    setup = grid.view[Stage.SETUP][1001]
    assert set(setup.content.config_records[RECORD_KEY_CONFIGS]) == {Key.PUBLIC_KEY_1,
                                                                     Key.PUBLIC_KEY_2}
    shares = grid.view[Stage.SHARE_KEYS][1001].content.config_records[RECORD_KEY_CONFIGS]
    assert set(shares) == {Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST}
    for stage in (Stage.SETUP, Stage.SHARE_KEYS):
        content = grid.view[stage][1001].content
        assert not content.array_records and not content.metric_records and list(
            content.config_records) == [
            RECORD_KEY_CONFIGS]
    # the masking stage: everything but the masked vector byte-identical
    sent, other = grid.view[Stage.COLLECT_MASKED_VECTORS][1001], grid.forked[
        Stage.COLLECT_MASKED_VECTORS]
    # the mod clears the parameters' record (left empty)
    for content in (sent.content, other.content):
        assert all(len(record) == 0 for record in content.array_records.values())
    # what the FitRes says in the clear: weight 1, partition, round
    for content in (sent.content, other.content):
        fitres = compat.recorddict_to_fitres(content, keep_input=True)
        assert fitres.num_examples == 1 and fitres.metrics == {protocol.PARTITION_ID: 0,
                                                               protocol.ECHO_ROUND: 1}
    strip = [RecordDict(dict(x.content.items())) for x in (sent, other)]
    for rd in strip:
        rd.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
            {k: v for k,
             v in rd.config_records[RECORD_KEY_CONFIGS].items() if k != Key.MASKED_PARAMETERS})
    assert strip[0].config_records.keys() == strip[1].config_records.keys()
    assert recorddict_to_proto(strip[0]).SerializeToString(deterministic=True) == \
        recorddict_to_proto(strip[1]).SerializeToString(deterministic=True)
    (f_sent, v_sent), (f_other, v_other) = _masked(sent), _masked(other)
    assert np.array_equal(f_sent, f_other)  # the weight factor: the same, masked alike
    q_low, q_enc = sk.centre(lowest, bits) + m // 2, sk.centre(encoded, bits) + m // 2
    assert np.array_equal(np.mod(v_sent - v_other, r), np.mod(q_low - q_enc, r))
    assert not np.array_equal(v_sent, v_other)
    # the client's saved state, hence its unmask-stage reply, does not depend on the message
    unmask = [x.content.config_records[RECORD_KEY_CONFIGS] for x in (grid.view[Stage.UNMASK][1001],
                                                                     grid.forked[Stage.UNMASK])]
    assert dict(unmask[0]) == dict(unmask[1]) and unmask[0][Key.SHARE_LIST]
    states = [ctxt.state.config_records[RECORD_KEY_STATE] for ctxt in (grid.nodes[1001].context,
                                                                       grid.fork_context)]
    assert dict(states[0]) == dict(states[1])


# ------------------------------------------------------------------------------ 4. a dropout

def test_a_client_dropping_after_its_shares_leaves_the_exact_sum_of_the_survivors():
    bits, dim, clients, tolerated = 20, 128, 5, 2
    messages = [_encoded(dim, bits, 30 + i) for i in range(clients)]
    grid, strategy = _run(messages, bits=bits, tolerated=tolerated,
                          drop={2: Stage.COLLECT_MASKED_VECTORS})
    dropped = 1001 + 7 * 2
    assert dropped in grid.view[Stage.SHARE_KEYS] and dropped not in grid.view[
        Stage.COLLECT_MASKED_VECTORS]
    setup = grid.requests[Stage.SETUP][1001].content.config_records[RECORD_KEY_CONFIGS]
    assert setup[Key.THRESHOLD] == clients - tolerated and setup[Key.SHARE_NUMBER] == clients
    # the survivors reveal the dropped client's secret-key shares
    for reply in grid.view[Stage.UNMASK].values():
        request_dead = grid.requests[Stage.UNMASK][
            reply.metadata.src_node_id].content.config_records[
            RECORD_KEY_CONFIGS][Key.DEAD_NODE_ID_LIST]
        assert list(request_dead) == [dropped]
    survivors = [msg for i, msg in enumerate(messages) if i != 2]
    expected = sk.modular_sum(survivors, bits)
    m, r = 1 << bits, secagg_settings(bits, clients).modulus_range
    factor, summed, count = _unmask_transcript(grid, r)
    assert count == 4 and factor == 4 * m
    assert np.array_equal(np.mod(summed - 4 * (m // 2), m), expected)
    total, survived = _decode_strategy_input(strategy, clients, bits)
    assert survived == 4 and np.array_equal(total, expected)
    # the dropped message is not in it
    assert not np.array_equal(total, sk.modular_sum(messages, bits))
