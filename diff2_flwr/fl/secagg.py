"""DIFF2's integer messages through Flower's SecAgg+ unchanged (``privacy.noise: distributed``,
issue 23).

Flower's ``secaggplus_mod`` turns each float parameter into an integer before masking it: it
multiplies by the client's weight ``round(num_examples / max_weight · q) / q``, clips to [-c, c],
maps to [0, q] by ``(x + c) · q / (2c)`` with stochastic rounding, and masks modulo R. Its workflow
unmasks the sum and inverts the map, dividing by the summed weights. With

* every client's weight 1 (``num_examples == max_weight``): the multiplier is exactly 1.0;
* c = M/2 and q = M (``M = 2**bits``, the Skellam code's modulus): the map is ``x + M/2``, exact in
  float64;
* each message centred into [-M/2, M/2) before it is handed over: nothing is clipped, and the
  stochastic rounding of an integer is that integer (Flower draws it from NumPy's global generator,
  which then decides nothing);
* R >= P·M: neither the masked sum nor the summed weights wrap around R,

the workflow hands the strategy the mean of the centred messages, exactly up to one float division,
and :func:`from_secagg` recovers the integer sum modulo M from it. Flower's quantiser casts to
int32, so M <= 2**31.

Flower 1.42's own mask generator, ``pseudo_rand_gen``, folds each 32-byte mask seed (a private seed
or an ECDH shared key) to 32 bits by XOR and expands it with MT19937, drawing from [0, R - 1)
(flwrlabs/flower#7522, open): a server that tries the 2**32 seeds of one mask can strip it.
:func:`mask_stream` draws the masks from the whole seed with AES-256-CTR, uniform on [0, R);
:func:`use_secure_masks` installs it in both Flower modules that draw masks (the client mod and the
server workflow), which must then both run it, and refuses a Flower whose internals differ from the
ones it patches.

Against a server that lies (issue 38), :func:`secure_sum_mod` checks each request before Flower's
mod answers it (:mod:`.secagg_checks`): the unmask lists, the signatures of the public keys (with
node authentication), and, in the node's answer log, that no (run, round) is unmasked twice.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ..core.skellam import centre
from ..runtime.policy import answer_log_of, refusal_in
from .secagg_checks import (MASKING_MODULES, SIGNATURES, SIGNED_KEYS, SecAggRefused,
                            check_flower_masking, check_unmask, node_keys, sign_public_keys,
                            verify_public_keys)

# Flower is imported inside the functions that use it: they run only under SecAgg+ (distributed
# noise), and this module, which fl/protocol.py imports, loads no Flower otherwise.

__all__ = ["SecAggSettings", "secagg_settings", "to_secagg", "from_secagg", "mask_stream",
           "use_secure_masks",
           "secure_sum_mod", "check_setup", "run_secure"]

#: Flower's quantiser casts to int32: x + M/2 must stay below 2**31.
MAX_BITS = 31


@dataclass(frozen=True)
class SecAggSettings:
    """The quantisation settings of Flower's ``SecAggPlusWorkflow`` that pass integers mod 2**bits
    unchanged."""

    clipping_range: float
    quantization_range: int
    modulus_range: int
    max_weight: float = 1.0


def secagg_settings(bits: int, clients: int) -> SecAggSettings:
    """Settings for P = ``clients`` messages of ``bits`` bits (M = 2**bits): c = M/2, q = M, R the
    smallest power of two >= 2·P·M (the masked sum of P values below M and the P weights of q each
    stay below R).

    Raises:
        ValueError: ``bits`` above 31 (Flower's int32 quantiser) or below 2, or fewer than 2
            clients.
    """
    if not 2 <= bits <= MAX_BITS:
        raise ValueError(
            f"`bits` must be in [2, {MAX_BITS}] for Flower's SecAgg+ (its quantiser casts to "
            f"int32). Found {bits}.")
    if clients < 2:
        raise ValueError(f"secure aggregation needs at least 2 clients. Found {clients}.")
    modulus = 1 << bits
    return SecAggSettings(clipping_range=modulus / 2, quantization_range=modulus,
                          modulus_range=1 << (2 * clients * modulus - 1).bit_length())


def to_secagg(message: np.ndarray, bits: int) -> np.ndarray:
    """A client's Skellam message (integers in [0, M)) as the float64 array the SecAgg+ mod
    quantises: centred to [-M/2, M/2) so that nothing is clipped."""
    message = np.asarray(message)
    modulus = 1 << bits
    if message.dtype.kind not in "iu" or message.min(initial=0) < 0 or message.max(
        initial=0) >= modulus:
        raise ValueError(
            f"a message must hold integers in [0, 2**{bits}). Found dtype {message.dtype}, range "
                         f"[{message.min(initial=0)}, {message.max(initial=0)}].")
    return centre(message, bits).astype(np.float64)


def from_secagg(mean: np.ndarray, clients: int, bits: int) -> np.ndarray:
    """The integer sum mod 2**bits of the ``clients`` messages whose mean SecAgg+ returned.

    Raises:
        ValueError: the mean times P is not an integer vector (the count of contributions
            differs from ``clients``, or a value was not sent through :func:`to_secagg` with these
            settings): nothing can be decoded from it.
    """
    total = np.asarray(mean, dtype=np.float64) * clients
    rounded = np.rint(total)
    # the workflow's mean is fl(S · fl(1/P)) of the exact integer sum S: times P it is within ~3
    # ulps of S, which exceeds any fixed tolerance once |S| nears 2**32 (31 bits and a dozen
    # clients)
    tolerance = 1e-6 + 8 * np.finfo(np.float64).eps * np.abs(total)
    if not np.all(np.isfinite(total)) or np.any(np.abs(total - rounded) > tolerance):
        raise ValueError(
            f"SecAgg+ returned a vector whose mean times the {clients} contributions is not an "
            f"integer "
                         f"vector (off by up to "
                         f"{np.max(np.abs(total - rounded), initial=0.0):.3g}): the number "
                         "of contributions or the quantisation settings are not the ones the "
                         "messages were made for.")
    return np.mod(rounded.astype(np.int64), 1 << bits)


_MASK_DOMAIN = b"diff2-flwr secagg+ mask v1"


def mask_stream(seed: bytes, num_range: int,
                dimensions_list: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """SecAgg+ masks (``pseudo_rand_gen``'s signature): int64 arrays of the given shapes, uniform on
    [0, R).

    The key is SHA-256 of the whole seed (domain-separated); the stream is AES-256-CTR from a zero
    counter, 8 bytes per entry, of which the low log2(R) bits are kept (R a power of two: no modulo
    bias).

    Raises:
        ValueError: R is not a power of two in [2, 2**62].
    """
    if num_range < 2 or num_range > 1 << 62 or num_range & (num_range - 1):
        raise ValueError(
            f"`num_range` must be a power of two in [2, 2**62] (SecAgg+'s modulus). Found "
            f"{num_range}.")
    key = hashlib.sha256(_MASK_DOMAIN + bytes(seed)).digest()
    sizes = [math.prod(shape) for shape in dimensions_list]
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    raw = np.frombuffer(encryptor.update(bytes(8 * sum(sizes))), dtype="<u8")
    values = (raw & np.uint64(num_range - 1)).astype(np.int64)
    out, start = [], 0
    for shape, size in zip(dimensions_list, sizes):
        out.append(values[start:start + size].reshape(shape))
        start += size
    return out


def use_secure_masks() -> None:
    """Make Flower's SecAgg+ client mod and server workflow draw their masks with
    :func:`mask_stream` (idempotent). Both sides of a run must call it: the server unmasks with the
    masks the clients added.

    Fails closed (:func:`~.secagg_checks.check_flower_masking`, once per process): a Flower other
    than 1.42.x, a module without the global, a mask-drawing function that no longer reads it, or
    masks that differ from :func:`mask_stream`'s in a known-answer test refuse the run rather than
    fall back to Flower's masks.

    Raises:
        RuntimeError: a check failed; nothing is patched that the run could use.
    """
    check_flower_masking(mask_stream)
    # again on every call: whoever reset the global since the (cached) check gets ours back
    for name in MASKING_MODULES:
        importlib.import_module(name).pseudo_rand_gen = mask_stream


def check_setup(configs: Mapping[str, Any], *, clients: int, tolerated: int, bits: int) -> None:
    """A data owner's check of the server's SecAgg+ set-up message against its own run config: all P
    clients sampled, every client a share holder, the reconstruction threshold at least P - t (so
    that the server and t colluders cannot unmask one client), and the quantisation that passes its
    message unchanged.

    Raises:
        ValueError: naming the setting, the value the server sent and the value this node expects.
    """
    from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: PLC0415 -- Flower internals, only under SecAgg+

    want = secagg_settings(bits, clients)
    expected = {Key.SAMPLE_NUMBER: clients, Key.SHARE_NUMBER: clients,
                Key.CLIPPING_RANGE: want.clipping_range, Key.TARGET_RANGE: want.quantization_range,
                Key.MOD_RANGE: want.modulus_range, Key.MAX_WEIGHT: want.max_weight}
    for key, value in expected.items():
        if configs.get(key) != value:
            raise ValueError(
                f"SecAgg+ set-up: `{key}` is {configs.get(key)!r}, this node's run config needs "
                f"{value!r} (P = {clients}, privacy.bits = {bits}): it sends no message under "
                f"other settings.")
    threshold = configs.get(Key.THRESHOLD)
    if not isinstance(threshold, int) or threshold < clients - tolerated:
        raise ValueError(
            f"SecAgg+ set-up: the reconstruction threshold is {threshold!r}, below P - t = "
                         f"{clients - tolerated} (privacy.tolerated = {tolerated}): fewer clients "
                         f"than the noise needs "
                         "could unmask the sum. This node sends no message.")


def secure_sum_mod(settings: Callable[[Any], tuple[int, int, int] | None], *,
                   round_key: str) -> Callable:
    """A ClientApp mod: where ``settings(context)`` gives (P, t, bits) (the run uses distributed
    noise) every training message must be a SecAgg+ message, run through Flower's ``secaggplus_mod``
    with :func:`mask_stream`'s masks; a training message outside SecAgg+ is refused, so the worker's
    message never leaves unmasked. Where ``settings`` gives None (central noise) messages pass
    through.

    Before Flower answers, against a server that may lie (:mod:`.secagg_checks`):

    * set-up: the settings (:func:`check_setup`); the reply signed with the node config's
      ``auth-key``;
    * share-keys: with node config ``federation-keys``, every listed node's signed public keys
      (:func:`~.secagg_checks.verify_public_keys`; without it the server can still invent nodes);
    * masking: the round (the fit config's ``round_key``, :data:`~diff2_flwr.fl.protocol.ROUND`)
      remembered in the node's state;
    * unmask: the active and dead lists (:func:`~.secagg_checks.check_unmask`), then (run, round,
      "unmask") claimed in the node's answer log (its policy's ``answers``): a replayed round is
      refused, also after a restart.
    """
    def mod(msg: Any, ctxt: Any, call_next: Callable) -> Any:
        from flwr.app import ConfigRecord  # noqa: PLC0415 -- Flower, only under SecAgg+
        from flwr.app.message_type import MessageType  # noqa: PLC0415 -- Flower, only under SecAgg+
        from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: PLC0415 -- Flower internals, only under SecAgg+
            RECORD_KEY_CONFIGS, Key, Stage,
        )

        found = settings(ctxt)
        if found is None or msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, ctxt)
        clients, tolerated, bits = found
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is None or Key.STAGE not in configs:
            raise ValueError(
                "privacy.noise is distributed: this node answers training messages only inside "
                "Flower's SecAgg+ (the ServerApp must run SecAggPlusWorkflow); it sends nothing "
                "in the clear.")
        use_secure_masks()
        stage, keys = configs[Key.STAGE], node_keys(ctxt.node_config)
        if stage == Stage.SETUP:
            check_setup(configs, clients=clients, tolerated=tolerated, bits=bits)
            # a new round: none remembered
            ctxt.state.config_records[_ROUND_STATE] = ConfigRecord({})
            return _signed(_flower_mod()(msg, ctxt, call_next), keys, ctxt)
        if stage == Stage.SHARE_KEYS and keys.federation is not None:
            verify_public_keys(configs, msg.content.config_records.get(SIGNATURES),
                               run_id=int(ctxt.run_id), federation=keys.federation)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            _remember_round(msg, ctxt, round_key)
        elif stage == Stage.UNMASK:
            _check_and_claim_unmask(configs, ctxt, clients=clients, tolerated=tolerated)
        return _flower_mod()(msg, ctxt, call_next)

    return mod


def _flower_mod() -> Callable:
    """Flower's ``secaggplus_mod``, looked up in its module (the one :func:`use_secure_masks`
    checked and patched)."""
    return importlib.import_module(MASKING_MODULES[0]).secaggplus_mod


#: This mod's own record in the node's state (``ctxt.state``): the round of the current SecAgg+
#: round.
_ROUND_STATE = "diff2.secagg.round"

#: Where Flower's compat layer keeps the FitIns config (``recorddict_compat.fitins_to_recorddict``:
#: "fitins.config").
_FIT_CONFIG = "fitins.config"


def _signed(reply: Any, keys: Any, ctxt: Any) -> Any:
    """The set-up reply with this node's signature of its fresh public keys, where it has an
    ``auth-key``."""
    from flwr.app import ConfigRecord  # noqa: PLC0415 -- Flower, only under SecAgg+
    from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: PLC0415 -- Flower internals, only under SecAgg+
        RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key,
    )

    if keys.signer is None or reply.has_error():
        return reply
    out = reply.content.config_records[RECORD_KEY_CONFIGS]
    reply.content.config_records[SIGNED_KEYS] = ConfigRecord(sign_public_keys(
        keys, run_id=int(ctxt.run_id),
        node_id=int(ctxt.state.config_records[RECORD_KEY_STATE]["nid"]), pk1=out[Key.PUBLIC_KEY_1],
        pk2=out[Key.PUBLIC_KEY_2]))
    return reply


def _remember_round(msg: Any, ctxt: Any, round_key: str) -> None:
    """The round this masking request is for, kept for the unmask request (which carries none)."""
    from flwr.app import ConfigRecord  # noqa: PLC0415 -- Flower, only under SecAgg+

    config = msg.content.config_records.get(_FIT_CONFIG) or {}
    round_ = config.get(round_key)
    if isinstance(round_, int) and not isinstance(round_, bool) and round_ >= 1:
        ctxt.state.config_records[_ROUND_STATE] = ConfigRecord({"round": round_})


def _check_and_claim_unmask(configs: Any, ctxt: Any, *, clients: int, tolerated: int) -> None:
    """The unmask request against what the node knows, then this (run, round) claimed once in its
    answer log."""
    from flwr.app import ConfigRecord  # noqa: PLC0415 -- Flower, only under SecAgg+
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE  # noqa: PLC0415 -- Flower internals, only under SecAgg+

    check_unmask(configs, ctxt.state.config_records.get(RECORD_KEY_STATE),
                 node_id=int(ctxt.node_id), clients=clients, tolerated=tolerated)
    remembered = ctxt.state.config_records.get(_ROUND_STATE) or {}
    ctxt.state.config_records[_ROUND_STATE] = ConfigRecord({})  # one unmask per masking request
    log = answer_log_of(ctxt.node_config)
    if log is None:
        # a node without a policy keeps no record (whether such a node may run is decided elsewhere)
        return
    if "round" not in remembered:
        raise SecAggRefused("unmask", "round",
                            "this node's state holds no masking request of this round (the server "
                            "skipped it, or it came to another process); expected the masking "
                            "stage first, its fit config carrying the round.")
    log.claim(str(ctxt.run_id), int(remembered["round"]), "unmask", node=f"node {ctxt.node_id}")


def _secagg_workflow() -> type:
    """Flower's SecAgg+ fit workflow, telling the strategy when a round ended (released or halted),
    and relaying each node's signature of its public keys (set-up reply) with those keys (share-keys
    request)."""
    from flwr.server.workflow import SecAggPlusWorkflow  # noqa: PLC0415 -- Flower internals, only under SecAgg+
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD  # noqa: PLC0415 -- Flower internals, only under SecAgg+
    from flwr.server.workflow.constant import Key as WorkflowKey  # noqa: PLC0415 -- Flower internals, only under SecAgg+

    class Diff2SecAggPlus(SecAggPlusWorkflow):
        def __call__(self, grid: Any, context: Any) -> None:
            # node id -> [signer, signature], this round's
            self._signed: dict[int, list[bytes]] = {}
            self._refusals: list[str] = []  # the nodes' refusals in this round's replies
            super().__call__(grid, context)
            round_ = int(context.state.config_records[MAIN_CONFIGS_RECORD][
                WorkflowKey.CURRENT_ROUND])
            context.strategy.secure_round_ended(round_, tuple(self._refusals))

        def _relay(self, collect: bool | None) -> Any:
            return lambda grid: _SignatureRelay(grid, self._signed, collect=collect,
                                                refusals=self._refusals)

        def setup_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return super().setup_stage(self._relay(True)(grid), context, state)

        def share_keys_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return super().share_keys_stage(self._relay(False)(grid), context, state)

        def collect_masked_vectors_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return super().collect_masked_vectors_stage(self._relay(None)(grid), context, state)

        def unmask_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return super().unmask_stage(self._relay(None)(grid), context, state)

    return Diff2SecAggPlus


class _SignatureRelay:
    """The grid as Flower's stages see it: set-up replies' signatures collected, share-keys requests
    given the signatures of the nodes they list (in a record of their own: Flower checks only its
    SecAgg+ record), and every stage's error replies read for a node's refusal (``refusals``).
    ``collect`` None: a stage that carries no signatures."""

    def __init__(self, grid: Any, signed: dict[int, list[bytes]], *, collect: bool | None,
                 refusals: list[str]) -> None:
        self._grid, self._signed, self._collect = grid, signed, collect
        self._refusals = refusals

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        from flwr.app import ConfigRecord  # noqa: PLC0415 -- Flower, only under SecAgg+
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: PLC0415 -- Flower internals, only under SecAgg+

        messages = list(messages)
        if self._collect is False:
            for msg in messages:
                listed = [k for k in msg.content.config_records[RECORD_KEY_CONFIGS]
                          if k != Key.STAGE]
                relayed = {k: self._signed[int(k)] for k in listed if int(k) in self._signed}
                if relayed:
                    msg.content.config_records[SIGNATURES] = ConfigRecord(relayed)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            refusal = refusal_in(reply.error.reason) if reply.has_error() else None
            if refusal is not None and refusal not in self._refusals:
                self._refusals.append(refusal)
        if self._collect:
            for reply in replies:
                record = None if reply.has_error() else reply.content.config_records.get(
                    SIGNED_KEYS)
                if record is not None and {"signer", "signature"} <= set(record):
                    self._signed[reply.metadata.src_node_id] = [record["signer"],
                                                                record["signature"]]
        return replies


def run_secure(grid: Any, context: Any, strategy: Any, config: Any) -> None:
    """``privacy.noise: distributed``: what a ServerApp's ``main`` calls to run ``strategy``'s
    rounds through Flower's SecAgg+ (``DefaultWorkflow`` with ``SecAggPlusWorkflow``, the strategy
    in a ``LegacyContext``). Every client is a share holder, the reconstruction threshold is P - t,
    and the quantisation passes the clients' integer messages unchanged (:func:`secagg_settings`);
    masks come from :func:`mask_stream`. ``config``: Flower's ``ServerConfig`` (its ``num_rounds`` =
    ``strategy.num_rounds``; its ``round_timeout`` bounds each SecAgg+ stage)."""
    from flwr.server.compat import LegacyContext  # noqa: PLC0415 -- Flower internals, only under SecAgg+
    from flwr.server.workflow import DefaultWorkflow  # noqa: PLC0415 -- Flower internals, only under SecAgg+

    noise = strategy.server.distributed
    if noise is None:
        raise ValueError(
            "run_secure needs a strategy with distributed noise (privacy.noise: distributed, or "
            "make_strategy(noise='distributed')); a central-noise strategy runs with start_grid.")
    use_secure_masks()
    q = secagg_settings(noise.bits, noise.clients)
    fit = _secagg_workflow()(num_shares=1.0,
                             reconstruction_threshold=noise.threshold / noise.clients,
                             clipping_range=q.clipping_range,
                             quantization_range=q.quantization_range, modulus_range=q.modulus_range,
                             max_weight=q.max_weight, timeout=config.round_timeout)
    strategy.server.journal.say(
        f"[diff2] distributed noise: each of the P = {noise.clients} clients adds a Skellam "
        f"share; the server sees only the SecAgg+ sum (threshold P - t = {noise.threshold}, "
        f"{noise.bits} bits per coordinate)")
    DefaultWorkflow(fit_workflow=fit)(grid, LegacyContext(context=context, config=config,
                                                          strategy=strategy))
