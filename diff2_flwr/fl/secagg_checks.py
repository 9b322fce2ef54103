"""A data owner's checks on a SecAgg+ server that may lie, and on the Flower internals
:mod:`.secagg` patches.

Flower 1.42's SecAgg+ client answers whatever the server asks. Three things a malicious server
(ServerApp or SuperLink operator) can then do, and what this module lets a node check before it
answers (issue 38, items 4-5):

* **Unmask a single node.** ``_unmask`` hands out the share of a node's private mask seed for each
  node the server lists as active and the share of its secret key for each node listed as dead. A
  node in both lists has both secrets revealed, hence its own masked message. :func:`check_unmask`
  refuses overlapping or duplicated lists, ids that were not among this round's public keys, this
  node listed as dead, and fewer than P - t active nodes. The same trick split across nodes (X
  listed active to some, dead to others) needs 2·threshold honest shares, more than P when the
  threshold P - t exceeds P/2: no node-local check can see it below that.
* **Invent nodes (sybils).** The server relays the public keys unauthenticated: it can add nodes
  whose keys it holds, until the honest node is alone among them. With node authentication on, each
  node signs its SecAgg+ public keys with its SuperNode authentication key
  (:func:`sign_public_keys`) and checks every listed node's signature against the federation's
  registered keys (:func:`verify_public_keys`): the server can list only nodes that hold registered
  keys, one node id per key. Without node keys the server can still invent nodes.
* **Silently weaker masks.** :func:`check_flower_masking` refuses a Flower whose internals are not
  the ones :func:`~.secagg.use_secure_masks` was written for: its version, the patched global, the
  functions that read it, and a known-answer test of the masks Flower's client code actually draws.

What no check here stops: a server that shows different nodes different models, or an app bundle
that is not ours.

References:
    Bell et al. (2020), "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", Sec. 3-4
    (the consistency of the dropout sets; a PKI against sybils in the malicious model). Issue 38,
    items 4 and 5.
"""

from __future__ import annotations

import functools
import importlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    Encoding, PublicFormat, load_ssh_private_key, load_ssh_public_key,
)

# Flower is imported inside the functions that use it: they run only under SecAgg+ (distributed
# noise), and this module, which fl/protocol.py imports through fl/secagg.py, loads no Flower
# otherwise.

__all__ = ["AUTH_KEY", "FEDERATION_KEYS", "CHECKED_FLOWER", "MASKING_MODULES", "SIGNATURES",
           "SIGNED_KEYS",
           "NodeKeys", "SecAggRefused", "check_flower_masking", "check_unmask", "node_keys",
           "sign_public_keys",
           "verify_public_keys"]

#: Node config keys (set by the node's operator, never by the run): this node's SuperNode
#: authentication private key (the file of ``flower-supernode --auth-supernode-private-key``) and
#: the federation's registered public keys.
AUTH_KEY = "auth-key"
FEDERATION_KEYS = "federation-keys"

#: ConfigRecords beside Flower's own (so that Flower's ``check_configs`` never sees them): a node's
#: signature in its set-up reply, and every listed node's signature in the server's share-keys
#: request.
SIGNED_KEYS = "diff2.secagg.signed-keys"
SIGNATURES = "diff2.secagg.signatures"

#: The Flower releases whose SecAgg+ internals these checks and :func:`~.secagg.use_secure_masks`
#: were read against.
CHECKED_FLOWER = "1.42."

#: The modules of Flower that draw SecAgg+ masks (each imports ``pseudo_rand_gen`` by name).
MASKING_MODULES = ("flwr.client.mod.secure_aggregation.secaggplus_mod",
                   "flwr.server.workflow.secure_aggregation.secaggplus_workflow")

_SIGN_DOMAIN = b"diff2-flwr secagg+ public keys v1\x00"


class SecAggRefused(ValueError):
    """A SecAgg+ request this node does not answer: ``stage`` and ``rule`` name the check that
    failed."""

    def __init__(self, stage: str, rule: str, detail: str) -> None:
        self.stage, self.rule = stage, rule
        super().__init__(
            f"SecAgg+ {stage} refused (rule `{rule}`): {detail} This node answers nothing.")


# --------------------------------------------------------------------------------------------------
# unmask

def check_unmask(configs: Mapping[str, Any], state: Mapping[str, Any] | None, *, node_id: int,
                 clients: int, tolerated: int) -> None:
    """The server's unmask request against what this node knows of the round.

    Args:
        configs: the request's SecAgg+ ConfigRecord (Flower's ``active_nids`` and ``dead_nids``).
        state: Flower's saved SecAgg+ state of this node
            (``ctxt.state.config_records[RECORD_KEY_STATE]``); its ``public_keys_dict`` keys are the
            nodes listed at this round's share-keys stage.
        node_id: this node's id in the protocol (Flower's ``state.nid``).
        clients: P, the clients the run's noise is split over.
        tolerated: t, the dropouts the run tolerates.

    Raises:
        SecAggRefused: a rule failed (``duplicate``, ``overlap``, ``unknown``, ``self``,
            ``threshold``).
    """
    from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: PLC0415 -- Flower internals, only under SecAgg+

    active, dead = list(configs.get(Key.ACTIVE_NODE_ID_LIST,
                                    [])), list(configs.get(Key.DEAD_NODE_ID_LIST, []))
    for name, ids in (("active", active), ("dead", dead)):
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise SecAggRefused("unmask", "duplicate",
                                f"the server lists nodes {repeated} more than once as {name}; "
                                "expected each node once.")
    both = sorted(set(active) & set(dead))
    if both:
        raise SecAggRefused("unmask", "overlap",
                            f"the server lists nodes {both} as both active and dead; expected "
                            "disjoint lists (both shares of one node reveal its own masked "
                            "message).")
    known = set((state or {}).get("public_keys_dict:K", []))
    unknown = sorted(set(active + dead) - known)
    if unknown:
        raise SecAggRefused("unmask", "unknown",
                            f"the server lists nodes {unknown} that were not among this round's "
                            f"{len(known)} public keys (share-keys stage); expected only those "
                            f"nodes.")
    if node_id not in active:
        raise SecAggRefused("unmask", "self",
                            f"the server does not list this node ({node_id}) as active, although "
                            "it sent its masked vector; expected it among the active nodes.")
    if len(active) < clients - tolerated:
        raise SecAggRefused("unmask", "threshold",
                            f"the server lists {len(active)} active nodes; expected at least "
                            f"P - t = {clients} - {tolerated} = {clients - tolerated} (the noise "
                            f"shares the privacy "
                            "analysis counts on).")


# --------------------------------------------------------------------------------------------------
# node keys

@dataclass(frozen=True)
class NodeKeys:
    """What this node's operator configured for signing SecAgg+ public keys.

    Attributes:
        signer: this node's authentication private key (an ``EllipticCurvePrivateKey``), or None
            (no ``auth-key``).
        public: its public key, OpenSSH-encoded without comment (b"" without ``signer``).
        federation: the registered public keys, OpenSSH-encoded without comment, or None (no
            ``federation-keys``: peers' keys are not checked).
    """

    signer: Any = None
    public: bytes = b""
    federation: frozenset[bytes] | None = None


def node_keys(node_config: Mapping[str, Any]) -> NodeKeys:
    """This node's signing key and the federation's keys, read from the node config only (never the
    run config).

    Raises:
        ValueError: a key file cannot be read or is not an OpenSSH EC key; ``federation-keys``
            without ``auth-key``; this node's own key not registered. No message quotes a file's
            content.
    """
    signer = public = None
    if node_config.get(AUTH_KEY):
        signer = _private_key(str(node_config[AUTH_KEY]))
        public = _openssh(signer.public_key())
    federation = None
    if node_config.get(FEDERATION_KEYS):
        federation = _federation(str(node_config[FEDERATION_KEYS]))
        if signer is None:
            raise ValueError(
                f"Node config `{FEDERATION_KEYS}` is set but `{AUTH_KEY}` is not: a node that "
                f"checks its "
                             "peers' SecAgg+ signatures must sign its own keys. Set `auth-key` to "
                             "this node's "
                             "SuperNode private key (the file of --auth-supernode-private-key).")
        if public not in federation:
            raise ValueError(
                f"Node config `{AUTH_KEY}`: this node's public key is not among the "
                f"{len(federation)} "
                             f"keys of `{FEDERATION_KEYS}`; its peers would refuse its SecAgg+ "
                             f"keys. Add its .pub line to "
                             "the federation's list (the SuperLink's registered keys).")
    return NodeKeys(signer, public or b"", federation)


def sign_public_keys(keys: NodeKeys, *, run_id: int, node_id: int, pk1: bytes,
                     pk2: bytes) -> dict[str, bytes]:
    """This node's signed set-up reply record: ECDSA (SHA-384) over (domain, run id, node id, pk1,
    pk2)."""
    signature = keys.signer.sign(_signed_bytes(run_id, node_id, pk1, pk2),
                                 ec.ECDSA(hashes.SHA384()))
    return {"signer": keys.public, "signature": signature}


def verify_public_keys(configs: Mapping[str, Any], signatures: Mapping[str, Any] | None, *,
                       run_id: int, federation: frozenset[bytes]) -> None:
    """Every node the server lists at share-keys must have signed its (run id, node id, pk1, pk2)
    with a registered key, each node id with a key of its own.

    Args:
        configs: the share-keys request's SecAgg+ ConfigRecord: ``{str(node id): [pk1, pk2]}``
            (and the stage).
        signatures: the server's relayed record ``{str(node id): [signer, signature]}``, or None.
        run_id: this run's id (``ctxt.run_id``).
        federation: the registered public keys (:class:`NodeKeys`).

    Raises:
        SecAggRefused: rule ``format``, ``signature`` (missing or invalid), ``registered`` or
            ``distinct``.
    """
    from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: PLC0415 -- Flower internals, only under SecAgg+

    signatures = signatures or {}
    owners: dict[bytes, int] = {}
    for name, value in configs.items():
        if name == Key.STAGE:
            continue
        if not name.isdigit():
            raise SecAggRefused("share-keys", "format",
                                f"the server lists a node named {name[:40]!r}; expected "
                                "node ids (decimal integers) only.")
        entry = signatures.get(name)
        if not isinstance(entry,
                          list) or len(entry) != 2 or not all(isinstance(b, bytes) for b in entry):
            raise SecAggRefused("share-keys", "signature",
                                f"node {name}'s public keys carry no signature (the server "
                                f"relayed {len(signatures)} for {len(configs) - 1} nodes); "
                                f"expected each listed node's keys signed with a key of node "
                                f"config `{FEDERATION_KEYS}`.")
        signer, signature = entry
        if signer not in federation:
            raise SecAggRefused("share-keys", "registered",
                                f"node {name}'s keys are signed with a key that is not "
                                f"among the {len(federation)} of node config `{FEDERATION_KEYS}`; "
                                f"expected a "
                                "registered node's key (an unregistered one may be a node the "
                                "server invented).")
        if owners.setdefault(signer, int(name)) != int(name):
            raise SecAggRefused("share-keys", "distinct",
                                f"nodes {owners[signer]} and {name} are signed with the "
                                "same registered key; expected one node id per key (one data "
                                "owner, one node).")
        try:
            load_ssh_public_key(signer).verify(signature, _signed_bytes(run_id, int(name), *value),
                                               ec.ECDSA(hashes.SHA384()))
        except (InvalidSignature, UnsupportedAlgorithm, ValueError, TypeError):
            raise SecAggRefused("share-keys", "signature",
                                f"node {name}'s signature does not verify for run "
                                f"{run_id}, node {name} and the public keys listed; expected the "
                                f"registered key's "
                                "signature of exactly these.") from None


def _signed_bytes(run_id: int, node_id: int, pk1: bytes, pk2: bytes) -> bytes:
    """Length-prefixed, so that no two (run, node, pk1, pk2) share an encoding."""
    return (_SIGN_DOMAIN + struct.pack(">QQ", run_id, node_id) + struct.pack(">I", len(pk1)) + pk1
            + struct.pack(">I", len(pk2)) + pk2)


def _openssh(public_key: Any) -> bytes:
    return public_key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise ValueError(
            f"Node config `{key}`: the file cannot be read ({type(err).__name__}, errno "
            f"{err.errno}); "
            "fix the path or its permissions (the ClientApp's user must read it).") from None


def _private_key(path: str) -> Any:
    try:
        key = load_ssh_private_key(_read(path, AUTH_KEY), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        key = None  # the parser's message may quote the file: never repeated
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(
            f"Node config `{AUTH_KEY}`: expected an unencrypted OpenSSH EC private key (the "
            f"SuperNode's "
                         "authentication key, as `diff2 node-key` writes it). Found another kind "
                         "of file.")
    return key


def _federation(path: str) -> frozenset[bytes]:
    keys = set()
    for number, line in enumerate(_read(path, FEDERATION_KEYS).splitlines(), 1):
        if not line.strip() or line.lstrip().startswith(b"#"):
            continue
        try:
            key = load_ssh_public_key(line.strip())
        except (ValueError, TypeError, UnsupportedAlgorithm):
            key = None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ValueError(
                f"Node config `{FEDERATION_KEYS}`, line {number}: expected an OpenSSH EC public "
                f"key (one "
                             "registered node's .pub line). Found another kind of line; fix the "
                             "list.")
        keys.add(_openssh(key))
    if not keys:
        raise ValueError(
            f"Node config `{FEDERATION_KEYS}`: the file lists no public key; expected the "
            f"federation's "
                         "registered node keys, one OpenSSH line each.")
    return frozenset(keys)


# --------------------------------------------------------------------------------------------------
# Flower

@functools.lru_cache(maxsize=None)
def check_flower_masking(mask: Callable[[bytes, int, Sequence[tuple[int, ...]]],
                                        list[np.ndarray]]) -> None:
    """Refuse a Flower whose SecAgg+ internals differ from those :func:`~.secagg.use_secure_masks`
    patches, then install ``mask`` and check the masks Flower's client code draws with it (once per
    process and ``mask``).

    Checks: the version (:data:`CHECKED_FLOWER`); each of :data:`MASKING_MODULES` has
    ``pseudo_rand_gen``; the functions that draw masks (the client's ``_collect_masked_vectors``,
    the workflow's ``unmask_stage``) read that module global; a known-answer test of
    ``_collect_masked_vectors`` on a crafted state (private and pairwise masks) against the masked
    vector computed independently with ``mask``. The server's unmasking is checked statically only
    (running its ``unmask_stage`` needs the ServerApp's runtime identity).

    Raises:
        RuntimeError: naming what was found and what to do; the run is refused.
    """
    import flwr  # noqa: PLC0415 -- Flower, only under SecAgg+

    found = str(getattr(flwr, "__version__", "unknown"))
    if not found.startswith(CHECKED_FLOWER):
        raise RuntimeError(
            f"Flower {found} is installed; diff2-flwr's SecAgg+ masks and checks were read "
            f"against Flower {CHECKED_FLOWER}x only (they patch Flower internals). Install "
            f"flwr=={CHECKED_FLOWER}* or check secagg_checks.py against this release first.")
    modules = [importlib.import_module(name) for name in MASKING_MODULES]
    client, server = modules
    readers = (getattr(client, "_collect_masked_vectors", None),
               getattr(getattr(server, "SecAggPlusWorkflow", None), "unmask_stage", None))
    for name, module, reader in zip(MASKING_MODULES, modules, readers):
        code = getattr(reader, "__code__", None)
        # the global must exist and be what the drawing function looks up at call time, in that
        # module's namespace
        if not hasattr(module, "pseudo_rand_gen") or code is None \
                or "pseudo_rand_gen" not in code.co_names or reader.__globals__ is not vars(module):
            raise RuntimeError(
                f"Flower's {name} no longer draws its SecAgg+ masks from its module global "
                               "`pseudo_rand_gen`: patching it would leave Flower's 32-bit-seeded "
                               "masks in place. "
                               f"Refusing the run; check secagg_checks.py against Flower {found}.")
    for module in modules:
        module.pseudo_rand_gen = mask
    _known_answer(client, mask)


def _known_answer(client: Any, mask: Callable) -> None:
    """Flower's ``_collect_masked_vectors`` on node 2 with one peer (node 1) against the same sum
    done here."""
    from flwr.common import bytes_to_ndarray, ndarrays_to_parameters  # noqa: PLC0415 -- Flower, only under SecAgg+
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (  # noqa: PLC0415 -- Flower internals, only under SecAgg+
        encrypt, generate_shared_key,
    )
    from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: PLC0415 -- Flower internals, only under SecAgg+
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat  # noqa: PLC0415 -- Flower internals, only under SecAgg+
    from flwr.supercore.primitives.asymmetric import (  # noqa: PLC0415 -- Flower internals, only under SecAgg+
        generate_key_pairs, private_key_to_bytes, public_key_to_bytes,
    )

    (sk1, pk1), (sk2, pk2), (peer_sk1, peer_pk1), (peer_sk2,
                                                   peer_pk2) = (generate_key_pairs()
                                                                for _ in range(4))
    mod_range, target, seed = 1 << 20, 1 << 8, bytes(range(32))
    ciphertext = encrypt(generate_shared_key(peer_sk2, pk2), share_keys_plaintext_concat(1, 2, b"s",
                                                                                         b"s"))
    as_bytes = {"sk1": private_key_to_bytes(sk1), "pk1": public_key_to_bytes(pk1),
                "sk2": private_key_to_bytes(sk2),
                "pk2": public_key_to_bytes(pk2)}
    state = client.SecAggPlusState(
        nid=2, threshold=2, clipping_range=target / 2, target_range=target, mod_range=mod_range,
        max_weight=1.0, rd_seed=seed, **as_bytes, ss2_dict={1: generate_shared_key(sk2, peer_pk2)},
        rd_seed_share_dict={}, sk1_share_dict={},
        public_keys_dict={1: (public_key_to_bytes(peer_pk1), public_key_to_bytes(peer_pk2)),
                                             2: (as_bytes["pk1"], as_bytes["pk2"])})
    # quantised exactly to x + 128 (rounding an integer draws nothing)
    vector = np.array([-128.0, 0.0, 5.0, 127.0])
    # Flower's stochastic rounding draws from NumPy's global generator: left as found
    saved = np.random.get_state()
    try:
        res = client._collect_masked_vectors(state, {Key.CIPHERTEXT_LIST: [ciphertext],
                                                     Key.SOURCE_LIST: [1]}, 1,
                                             ndarrays_to_parameters([vector]))
    finally:
        np.random.set_state(saved)
    drawn = [bytes_to_ndarray(b) for b in res[Key.MASKED_PARAMETERS]]
    plain = [np.array([target]), (vector + target / 2).astype(np.int64)]
    shapes = [a.shape for a in plain]
    pair = mask(generate_shared_key(sk1, peer_pk1), mod_range, shapes)  # node 2 > node 1: added
    expected = [np.mod(p + m + q, mod_range) for p, m, q in zip(plain, mask(seed, mod_range,
                                                                            shapes), pair)]
    if len(drawn) != 2 or not all(np.array_equal(d, e) for d, e in zip(drawn, expected)):
        raise RuntimeError(
            "Known-answer test of the SecAgg+ masks failed: Flower's _collect_masked_vectors, with "
                           f"`pseudo_rand_gen` set to {getattr(mask, '__name__', mask)!r}, masks "
                           f"a crafted vector "
                           "differently from the same sum done with that generator; the server "
                           "could not unmask, or "
                           "weaker masks are drawn. Refusing the run; check secagg_checks.py "
                           "against this Flower.")
