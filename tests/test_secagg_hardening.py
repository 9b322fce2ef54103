"""SecAgg+ against a server that lies, and fail-closed on Flower's internals (issue 38, items 4 and
5).

The harness of ``test_secagg_view.py``: Flower's own workflow (here ours,
``secagg._secagg_workflow``, which relays the signatures) runs in-process against the real ClientApp
mod (``secure_sum_mod`` around Flower's ``secaggplus_mod``), every message through Flower's wire
format. A hostile server is that grid rewriting a request before it is delivered
(:class:`_Hostile`): what a ServerApp or SuperLink operator can send. A refusal is the mod's
exception, which Flower would turn into an error reply: the node answered nothing.

What it cannot show: the split of one node's secrets across nodes (listed active to some, dead to
others), which no node alone can see (the threshold P - t > P/2 is what stops it); a server that
shows different nodes different models; anything with fewer node keys than sybils (without
``federation-keys`` the server can still invent nodes).
"""

from __future__ import annotations

import importlib
import types

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen as flowers_masks
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.supercore.task_identity import TaskIdentity
from test_secagg_view import _encoded, _Grid, _Node, _Proxy

from diff2_flwr.core import skellam as sk
from diff2_flwr.deploy.certs import make_node_key
from diff2_flwr.fl import protocol, secagg, secagg_checks
from diff2_flwr.fl.secagg import secagg_settings, use_secure_masks
from diff2_flwr.fl.secagg_checks import (
    AUTH_KEY, FEDERATION_KEYS, SIGNATURES, SIGNED_KEYS, SecAggRefused,
)
from diff2_flwr.runtime.answer_log import AnswerLog, Replayed

client_module = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
server_module = importlib.import_module(
    "flwr.server.workflow.secure_aggregation.secaggplus_workflow")

RUN, BITS, DIM = 1, 16, 16


@pytest.fixture(autouse=True)
def _flower_as_found(monkeypatch):
    """Flower's masks back after each test, the ServerApp's runtime identity set, and the
    once-per-process check of Flower's internals forgotten (each test sees it run on the Flower it
    patched)."""
    for module in (client_module, server_module):
        monkeypatch.setattr(module, "pseudo_rand_gen", module.pseudo_rand_gen)
    for name, value in (("_task_id", 1), ("_run_id", RUN), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    secagg_checks.check_flower_masking.cache_clear()
    yield
    secagg_checks.check_flower_masking.cache_clear()


# ------------------------------------------------------------------------------ harness

class _Server:
    """The strategy's calls in the workflow: every node sampled with the round in its fit config (as
    the real strategy's ``protocol.ROUND``, unless ``with_round`` is False), the results kept, the
    round's end noted."""

    def __init__(self, node_ids: list[int], with_round: bool = True) -> None:
        self.node_ids, self.with_round = node_ids, with_round
        self.results, self.failures, self.ended = None, None, []

    def configure_fit(self, server_round, parameters, client_manager):
        config = {"round": server_round} | ({protocol.ROUND: server_round} if self.with_round
                                            else {})
        return [(_Proxy(nid), FitIns(parameters, dict(config))) for nid in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = results, failures
        return None, {}

    def secure_round_ended(self, round_, refusals=()):
        self.ended.append(round_)


class _Hostile(_Grid):
    """The grid with a server that may rewrite any request: ``tamper(stage, msg)`` before it is
    delivered."""

    def __init__(self, nodes, tamper=None) -> None:
        super().__init__(nodes)
        self.tamper = tamper

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for msg in messages:
            if self.tamper is not None:
                self.tamper(msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE], msg)
        return super().send_and_receive(messages, timeout=timeout)


def _nodes(messages, node_configs, *, tolerated: int = 1) -> dict[int, _Node]:
    """Client i: node id 1001 + 7i, partition i, with its operator's node config (a fresh process
    state)."""
    nodes = {}
    for i, (message, node_config) in enumerate(zip(messages, node_configs)):
        node = _Node(1001 + 7 * i, i, message, len(messages), tolerated, BITS)
        node.context = Context(run_id=RUN, node_id=node.node_id, node_config=dict(node_config),
                               state=RecordDict(), run_config={})
        nodes[node.node_id] = node
    return nodes


def _round(nodes, *, round_: int = 1, tolerated: int = 1, tamper=None, workflow=None,
           with_round: bool = True, grid: _Hostile | None = None):
    """One SecAgg+ round of the workflow the ServerApp builds (``run_secure``'s settings) over
    ``nodes``."""
    clients = len(nodes)
    grid, strategy = grid or _Hostile(nodes, tamper), _Server(list(nodes), with_round)
    context = LegacyContext(Context(run_id=RUN, node_id=0, node_config={}, state=RecordDict(),
                                    run_config={}),
                            strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({
        WorkflowKey.CURRENT_ROUND: round_})
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([np.zeros(3)]), keep_input=True)
    q = secagg_settings(BITS, clients)
    workflow = workflow or secagg._secagg_workflow()
    workflow(num_shares=1.0, reconstruction_threshold=(clients - tolerated) / clients,
             clipping_range=q.clipping_range, quantization_range=q.quantization_range,
             modulus_range=q.modulus_range, max_weight=q.max_weight)(grid, context)
    return grid, strategy


def _messages(count: int, seed: int = 40) -> list[np.ndarray]:
    return [_encoded(DIM, BITS, seed + i) for i in range(count)]


def _assert_exact(strategy, messages, round_: int = 1) -> None:
    results = [(str(proxy.node_id), parameters_to_ndarrays(fitres.parameters), fitres.metrics)
               for proxy, fitres in strategy.results]
    total, count = protocol.decode_secure_sum(results, round_, len(messages), BITS)
    assert count == len(messages) and np.array_equal(total, sk.modular_sum(messages, BITS))


def _policies(tmp_path, count: int) -> list[dict]:
    """One data owner's policy (and so answer log, ``answers.log`` beside it) per node."""
    configs = []
    for i in range(count):
        folder = tmp_path / f"owner-{i}"
        folder.mkdir()
        (folder / "policy.yaml").write_text("max_epsilon: 10.0\nmax_delta: 1.0e-5\n")
        configs.append({"policy": str(folder / "policy.yaml")})
    return configs


def _keys(tmp_path, count: int, *, registered: int | None = None) -> list[dict]:
    """Node configs with node keys: every node an ``auth-key``; the first ``registered`` (default
    all) listed in the federation's file, and only those check signatures (``federation-keys``)."""
    registered = count if registered is None else registered
    pairs = [make_node_key(tmp_path / "keys", f"node-{i}") for i in range(count)]
    federation = tmp_path / "federation.pub"
    federation.write_bytes(b"# the federation's registered SuperNode keys\n" +
                           b"".join(p.public.read_bytes() for p in pairs[:registered]))
    return [{AUTH_KEY: str(p.private)} | ({FEDERATION_KEYS: str(federation)} if i < registered
                                          else {})
            for i, p in enumerate(pairs)]


def _unmask_request(stage, msg):
    return msg.content.config_records[RECORD_KEY_CONFIGS] if stage == Stage.UNMASK else None


# ------------------------------------------------------------------------------ unmask lists

# another node both active and dead: its seed share and its key share
def _overlap(configs, me, others):
    configs[Key.DEAD_NODE_ID_LIST] = [others[0]]


def _duplicate(configs, me, others):
    configs[Key.ACTIVE_NODE_ID_LIST] = list(configs[Key.ACTIVE_NODE_ID_LIST]) + [others[0]]


def _unknown(configs, me, others):  # a node that was not among this round's public keys
    configs[Key.DEAD_NODE_ID_LIST] = [424242]


# this node's own secret-key share, although its masked vector was received
def _self_dead(configs, me, others):
    configs[Key.ACTIVE_NODE_ID_LIST] = list(others)
    configs[Key.DEAD_NODE_ID_LIST] = [me]


def _too_few(configs, me, others):  # P = 5, t = 1: P - t = 4 active needed
    configs[Key.ACTIVE_NODE_ID_LIST] = [me] + list(others[:2])


@pytest.mark.parametrize("lie,rule", [(_overlap, "overlap"), (_duplicate, "duplicate"), (_unknown,
                                                                                         "unknown"),
                                      (_self_dead, "self"), (_too_few, "threshold")])
def test_an_unmask_request_that_lies_about_the_dropouts_is_refused(lie, rule):
    messages = _messages(5)
    nodes = _nodes(messages, [{}] * 5)

    def tamper(stage, msg):
        configs = _unmask_request(stage, msg)
        if configs is not None:
            me = msg.metadata.dst_node_id
            lie(configs, me, [nid for nid in nodes if nid != me])

    grid = _Hostile(nodes, tamper)
    with pytest.raises(SecAggRefused,
                       match=rf"unmask refused \(rule `{rule}`\).*answers nothing") as refused:
        _round(nodes, grid=grid, tolerated=1)
    assert refused.value.rule == rule and "\n" not in str(refused.value)
    (asked,) = grid.requests[Stage.UNMASK]  # the first node asked refused: no share left it
    assert grid.view[Stage.UNMASK] == {}
    # Flower's mod never ran its unmask stage on it: its SecAgg+ state is still at the masking stage
    assert nodes[asked].context.state.config_records[RECORD_KEY_STATE][
        "current_stage"] == Stage.COLLECT_MASKED_VECTORS


def test_an_honest_round_with_dropout_lists_as_flower_sends_them_decodes_exactly():
    """The same checks pass Flower's own lists (no dropout): the round completes and decodes to the
    exact sum."""
    messages = _messages(5)
    grid, strategy = _round(_nodes(messages, [{}] * 5))
    assert len(grid.view[Stage.UNMASK]) == 5 and strategy.ended == [1]
    _assert_exact(strategy, messages)


# ------------------------------------------------------------------------------ replay

def test_a_replayed_round_is_refused_at_unmask_also_from_a_fresh_process_state(tmp_path):
    messages = _messages(3)
    configs = _policies(tmp_path, 3)
    nodes = _nodes(messages, configs)
    _, strategy = _round(nodes, round_=4)
    _assert_exact(strategy, messages, 4)
    for i in range(3):  # each owner's own record: (run, round, "unmask") once
        assert set(AnswerLog(tmp_path / f"owner-{i}" / "answers.log").answered()) == {(str(RUN), 4,
                                                                                       "unmask")}
    with pytest.raises(Replayed, match=r"rule `replay`.*round 4 \(unmask\) of run 1"):
        _round(nodes, round_=4)  # the same processes asked again
    with pytest.raises(Replayed, match=r"rule `replay`.*round 4 \(unmask\) of run 1"):
        # restarted processes: new state, the same answer logs
        _round(_nodes(messages, configs), round_=4)
    _, strategy = _round(_nodes(messages, configs), round_=5)  # the next round is answered
    _assert_exact(strategy, messages, 5)


def test_with_an_answer_log_an_unmask_for_no_known_round_is_refused(tmp_path):
    """The unmask request carries no round: a node that keeps a log refuses one whose masking
    request named none."""
    with pytest.raises(SecAggRefused, match=r"rule `round`"):
        _round(_nodes(_messages(3), _policies(tmp_path, 3)), with_round=False)
    assert not any((tmp_path / f"owner-{i}" / "answers.log").exists() for i in range(3))


# ------------------------------------------------------------------------------ signed public keys

def test_an_honest_signed_round_completes_and_decodes_exactly(tmp_path):
    messages = _messages(3)
    grid, strategy = _round(_nodes(messages, _keys(tmp_path, 3)))
    _assert_exact(strategy, messages)
    # each node signed; the server relayed every signature
    for nid, reply in grid.view[Stage.SETUP].items():
        assert set(reply.content.config_records[SIGNED_KEYS]) == {"signer", "signature"}
        relayed = grid.requests[Stage.SHARE_KEYS][nid].content.config_records[SIGNATURES]
        assert set(relayed) == {str(n) for n in grid.nodes}


def _flip_signature(of_index: int):
    def tamper(stage, msg):
        if stage == Stage.SHARE_KEYS:
            record = msg.content.config_records[SIGNATURES]
            name = sorted(record)[of_index]
            signer, signature = record[name]
            record[name] = [signer, signature[:-1] + bytes([signature[-1] ^ 1])]
    return tamper


def _swap_public_key(stage, msg):  # the server puts a key of its own in place of another node's
    if stage == Stage.SHARE_KEYS:
        configs = msg.content.config_records[RECORD_KEY_CONFIGS]
        other = next(k for k in configs if k not in (Key.STAGE, str(msg.metadata.dst_node_id)))
        from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

        configs[other] = [public_key_to_bytes(generate_key_pairs()[1]), configs[other][1]]


@pytest.mark.parametrize("tamper,rule", [(_flip_signature(0), "signature"), (_swap_public_key,
                                                                             "signature")],
                         ids=["forged-signature", "substituted-key"])
def test_a_forged_signature_or_a_substituted_key_is_refused(tmp_path, tamper, rule):
    with pytest.raises(SecAggRefused,
                       match=rf"share-keys refused \(rule `{rule}`\).*answers nothing"):
        _round(_nodes(_messages(3), _keys(tmp_path, 3)), tamper=tamper)


def test_a_server_that_relays_no_signatures_is_refused(tmp_path):
    """Flower's own workflow (no relay): the nodes see unsigned keys, as from a server that invented
    them."""
    with pytest.raises(SecAggRefused,
                       match=r"rule `signature`\): node \d+'s public keys carry no signature"):
        _round(_nodes(_messages(3), _keys(tmp_path, 3)), workflow=SecAggPlusWorkflow)


def test_a_node_signing_with_an_unregistered_key_is_refused(tmp_path):
    """A sybil: the server runs a fourth node with a key of its own (signed, but not in the
    federation's list)."""
    with pytest.raises(SecAggRefused, match=r"rule `registered`"):
        _round(_nodes(_messages(4), _keys(tmp_path, 4, registered=3)))


def test_an_unsigned_sybil_is_refused(tmp_path):
    configs = _keys(tmp_path, 3) + [{}]  # the invented node has no key at all
    with pytest.raises(SecAggRefused,
                       match=r"rule `signature`\): node 1022's public keys carry no signature"):
        _round(_nodes(_messages(4), configs))


def test_two_node_ids_signed_with_one_key_are_refused(tmp_path):
    configs = _keys(tmp_path, 3)
    # one data owner, two node ids
    configs[2] = dict(configs[2], **{AUTH_KEY: configs[0][AUTH_KEY]})
    with pytest.raises(SecAggRefused,
                       match=r"rule `distinct`\): nodes \d+ and \d+ are signed with the same"):
        _round(_nodes(_messages(3), configs))


def test_without_federation_keys_nothing_is_checked_and_the_round_completes():
    """The documented residue: no node keys, no signatures; the round runs as Flower's (a sybil is
    not seen)."""
    messages = _messages(3)
    grid, strategy = _round(_nodes(messages, [{}] * 3))
    _assert_exact(strategy, messages)
    assert all(SIGNED_KEYS not in reply.content.config_records
               for reply in grid.view[Stage.SETUP].values())


def test_node_key_configuration_errors_name_the_key_and_never_the_content(tmp_path):
    configs = _keys(tmp_path, 2)
    with pytest.raises(ValueError, match=r"`federation-keys` is set but `auth-key` is not"):
        secagg_checks.node_keys({FEDERATION_KEYS: configs[0][FEDERATION_KEYS]})
    stranger = make_node_key(tmp_path / "other", "stranger")
    with pytest.raises(ValueError, match=r"this node's public key is not among the 2 keys"):
        secagg_checks.node_keys({AUTH_KEY: str(stranger.private),
                                 FEDERATION_KEYS: configs[0][FEDERATION_KEYS]})
    secret = tmp_path / "not-a-key"
    secret.write_text("SECRET-TOKEN-1234 this file is not a key\n")
    for key in (AUTH_KEY, FEDERATION_KEYS):
        with pytest.raises(ValueError) as err:
            secagg_checks.node_keys({AUTH_KEY: str(secret)} if key == AUTH_KEY else
                                    {AUTH_KEY: configs[0][AUTH_KEY], FEDERATION_KEYS: str(secret)})
        assert f"`{key}`" in str(err.value) and "SECRET-TOKEN" not in str(err.value)
        # the error reaches the server: not even the node's paths
        assert str(secret) not in str(err.value)


# ------------------------------------------------------------------------------ Flower's internals

def _wrapped(function):
    """``function`` behind a wrapper in its own module's namespace: the same masks, but the code
    that now runs in that module no longer looks up the global we patch (as if a release had moved
    the drawing elsewhere)."""
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return types.FunctionType(wrapper.__code__, function.__globals__, function.__name__, None,
                              wrapper.__closure__)


def test_a_flower_release_other_than_the_checked_one_is_refused_before_any_answer(monkeypatch):
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    nodes = _nodes(_messages(3), [{}] * 3)
    with pytest.raises(RuntimeError,
                       match=r"Flower 1\.43\.0 is installed.*1\.42\.x only.*flwr==1\.42\.\*"):
        _round(nodes)
    with pytest.raises(RuntimeError, match=r"Flower 1\.43\.0 is installed"):
        use_secure_masks()  # the server side (run_secure) calls it too


@pytest.mark.parametrize("break_it", ["client-reader", "server-reader", "no-global",
                                      "snapshot-globals"])
def test_a_flower_that_no_longer_reads_the_patched_global_is_refused(monkeypatch, break_it):
    if break_it == "client-reader":
        monkeypatch.setattr(client_module, "_collect_masked_vectors",
                            _wrapped(client_module._collect_masked_vectors))
    elif break_it == "server-reader":
        monkeypatch.setattr(server_module.SecAggPlusWorkflow, "unmask_stage",
                            _wrapped(server_module.SecAggPlusWorkflow.unmask_stage))
    elif break_it == "no-global":
        monkeypatch.delattr(server_module, "pseudo_rand_gen")
    # the same code, bound to a copy of the module's namespace: it would keep drawing Flower's masks
    else:
        original = client_module._collect_masked_vectors
        monkeypatch.setattr(client_module, "_collect_masked_vectors",
                            types.FunctionType(original.__code__, dict(vars(client_module)),
                                               original.__name__))
    with pytest.raises(RuntimeError,
                       match=r"no longer draws its SecAgg\+ masks from its module global"):
        use_secure_masks()


def test_masks_that_differ_from_the_generators_are_refused_by_the_known_answer_test(monkeypatch):
    """A generator whose masks the server could not recompute (here: fresh randomness at every call)
    fails the known-answer test of Flower's client code, at the mod's first message."""
    rng = np.random.default_rng(3)
    monkeypatch.setattr(secagg, "mask_stream", lambda seed, r,
                        shapes: [rng.integers(0, r, s) for s in shapes])
    nodes = _nodes(_messages(3), [{}] * 3)
    with pytest.raises(RuntimeError, match=r"Known-answer test of the SecAgg\+ masks failed"):
        _round(nodes)


def test_the_known_answer_test_sees_flowers_own_masks_and_leaves_numpys_generator_as_it_was():
    """Flower's 32-bit-seeded masks pass the test only against themselves: checked against AES masks
    they fail."""
    np.random.seed(5)
    before = np.random.get_state()[1].copy()
    # Flower draws with its own generator: agrees
    secagg_checks._known_answer(client_module, flowers_masks)
    with pytest.raises(RuntimeError, match="Known-answer"):
        # the module still holds Flower's
        secagg_checks._known_answer(client_module, secagg.mask_stream)
    assert np.array_equal(np.random.get_state()[1], before)


def test_the_check_of_flowers_internals_runs_once_per_process(monkeypatch):
    calls = []
    real = secagg_checks._known_answer
    monkeypatch.setattr(secagg_checks, "_known_answer", lambda *a: calls.append(1) or real(*a))
    use_secure_masks()
    use_secure_masks()
    assert calls == [1]
    assert client_module.pseudo_rand_gen is secagg.mask_stream is server_module.pseudo_rand_gen


def test_the_compose_files_signing_keys_are_what_the_node_reads(tmp_path):
    """docker-compose.tls.yml names /node/secagg.key and /node/federation.pub; the files `diff2
    node-key --name secagg` and the podman stack write there are what node_keys reads: every owner's
    key in the federation."""
    from diff2_flwr.deploy.certs import make_node_key
    from diff2_flwr.deploy.compose import FEDERATION_KEYS, SECAGG_KEY

    owners = [tmp_path / f"node-{i}" for i in range(3)]
    keys = [make_node_key(folder, SECAGG_KEY) for folder in owners]
    federation = b"".join(k.public.read_bytes().rstrip(b"\n") + b"\n" for k in keys)
    for folder in owners:
        (folder / FEDERATION_KEYS).write_bytes(federation)
    read = [secagg_checks.node_keys({"auth-key": str(folder / f"{SECAGG_KEY}.key"),
                                     "federation-keys": str(folder / FEDERATION_KEYS)})
                                     for folder in owners]
    assert all(len(r.federation) == 3 and r.public in r.federation for r in read)
    assert len({r.public for r in read}) == 3
