"""Skellam messages through Flower's SecAgg+ arithmetic, unchanged (diff2_flwr/fl/secagg.py).

The round below runs the client mod's and the workflow's arithmetic with Flower's own functions, in
their order (flwr/client/mod/secure_aggregation/secaggplus_mod.py `_collect_masked_vectors`,
flwr/server/workflow/ secure_aggregation/secaggplus_workflow.py `unmask_stage`): weight, quantise,
combine the weight factor, add the private and pairwise masks mod R; sum, remove the masks, extract
the factor, dequantise, offset, divide."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flwr.common.secure_aggregation.ndarrays_arithmetic import (factor_combine, factor_extract,
                                                                parameters_addition,
                                                                 parameters_mod,
                                                                 parameters_multiply,
                                                                 parameters_subtraction)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

from diff2_flwr.core import skellam as sk
from diff2_flwr.fl.secagg import (
    from_secagg, mask_stream, secagg_settings, to_secagg, use_secure_masks,
)


def _secaggplus_round(arrays: list[np.ndarray], settings,
                      prg=pseudo_rand_gen) -> tuple[np.ndarray, list[np.ndarray]]:
    """The mean SecAgg+ hands the strategy, and what the server saw of each client (its masked
    vector); ``prg`` draws the masks (Flower's ``pseudo_rand_gen`` or :func:`mask_stream`)."""
    q, c, r = settings.quantization_range, settings.clipping_range, settings.modulus_range
    p = len(arrays)
    private = [os.urandom(32) for _ in range(p)]
    pair = {(i, j): os.urandom(32) for i in range(p) for j in range(i + 1, p)}
    masked = []
    for i, array in enumerate(arrays):
        ratio = settings.max_weight / settings.max_weight  # num_examples = max_weight
        q_ratio = round(ratio * q)
        params = quantize(parameters_multiply([array], q_ratio / q), c, q)
        params = factor_combine(q_ratio, params)
        shapes = [a.shape for a in params]
        params = parameters_addition(params, prg(private[i], r, shapes))
        for j in range(p):
            if j != i:
                mask = prg(pair[min(i, j), max(i, j)], r, shapes)
                params = parameters_addition(params,
                                             mask) if i > j else parameters_subtraction(params,
                                                                                        mask)
        masked.append(parameters_mod(params, r))
    total = masked[0]
    for m in masked[1:]:
        total = parameters_addition(total, m)
    for i in range(p):
        total = parameters_subtraction(total, prg(private[i], r, [a.shape for a in total]))
    q_total, recon = factor_extract(parameters_mod(total, r))
    (vector,) = dequantize(recon, c, q)
    vector += -(p - 1) * c
    vector *= q / q_total
    return vector, [m[1] for m in masked]


@pytest.mark.parametrize("prg", [pseudo_rand_gen, mask_stream], ids=["flowers-masks", "aes-masks"])
@pytest.mark.parametrize("bits,clients", [(16, 3), (20, 10), (31, 2)])
def test_skellam_messages_pass_through_secaggplus_and_decode_to_their_modular_sum(bits, clients,
                                                                                  prg):
    rng = np.random.default_rng(bits)
    dim = 37
    code = sk.SkellamCode(dim=dim, scale=2.0 ** (bits - 12), rho=sk.rounding_bound(dim, 1e-6),
                          bits=bits, seed=1)
    vectors = [rng.normal(size=dim) for _ in range(clients)]
    messages = [sk.encode(v, code, 25.0, rng) for v in vectors]
    # the extremes of the modulus too: 0, M/2 - 1, M/2 and M - 1 (the centring's edges)
    messages[0][:4] = [0, 2 ** (bits - 1) - 1, 2 ** (bits - 1), 2**bits - 1]
    settings = secagg_settings(bits, clients)
    mean, seen = _secaggplus_round([to_secagg(m, bits) for m in messages], settings, prg)
    assert np.array_equal(from_secagg(mean, clients, bits), sk.modular_sum(messages, bits))
    # the server's view of one client is its masked vector: uniform-looking mod R, not its message
    assert not np.array_equal(seen[0] % 2**bits, messages[0])


def test_a_large_sum_of_many_clients_decodes_despite_the_float_division():
    """31 bits, 13 clients, every message near M/2 (centred near -M/2): |Σ| ≈ 13·2**30, and the
    workflow's mean times 13 is off its integer by ~2e-6 (a fixed 1e-6 tolerance refused the
    round)."""
    bits, clients = 31, 13
    rng = np.random.default_rng(0)
    messages = [rng.integers(2 ** (bits - 1), 2 ** (bits - 1) + 4, size=64) for _ in range(clients)]
    mean, _ = _secaggplus_round([to_secagg(m, bits) for m in messages],
                                secagg_settings(bits, clients), mask_stream)
    assert np.array_equal(from_secagg(mean, clients, bits), sk.modular_sum(messages, bits))
    with pytest.raises(ValueError, match="not an integer vector"):
        from_secagg(mean, clients - 1, bits)


def test_the_settings_respect_flowers_limits_and_refuse_what_would_overflow():
    s = secagg_settings(20, 10)
    assert s.clipping_range == 2**19 and s.quantization_range == 2**20 and s.max_weight == 1.0
    assert s.modulus_range >= 2 * 10 * 2**20 and bin(s.modulus_range).count("1") == 1
    with pytest.raises(ValueError, match=r"`bits` must be in \[2, 31\]"):
        secagg_settings(32, 10)
    with pytest.raises(ValueError, match="at least 2 clients"):
        secagg_settings(16, 1)
    with pytest.raises(ValueError, match=r"integers in \[0, 2\*\*8\)"):
        to_secagg(np.array([0, 256]), 8)
    with pytest.raises(ValueError, match="integers"):
        to_secagg(np.array([0.5]), 8)


def test_a_mean_over_another_number_of_contributions_is_refused():
    bits, messages = 12, [np.array([5, 4000, 17]), np.array([1, 2, 3]), np.array([4095, 0, 2048])]
    mean, _ = _secaggplus_round([to_secagg(m, bits) for m in messages], secagg_settings(bits, 3))
    assert np.array_equal(from_secagg(mean, 3, bits), sk.modular_sum(messages, bits))
    with pytest.raises(ValueError, match="not an integer vector"):
        from_secagg(mean, 2, bits)  # a survivor count the workflow did not divide by


def test_flowers_masks_keep_32_bits_of_their_seed_and_ours_keep_all_of_it():
    """flwrlabs/flower#7522: two 32-byte seeds whose 4-byte words XOR to the same value give
    Flower's generator the same masks (so 2**32 tries strip any mask); from the whole seed, ours
    differ."""
    a = bytes(range(32))
    # two words changed alike: the same XOR fold
    b = bytes([a[0] ^ 0xA5, a[1], a[2], a[3], a[4] ^ 0xA5, *a[5:]])
    shapes = [(64,), (3, 5)]
    r = 2**32
    assert all(np.array_equal(x, y) for x, y in zip(pseudo_rand_gen(a, r, shapes),
                                                    pseudo_rand_gen(b, r, shapes)))
    ours_a, ours_b = mask_stream(a, r, shapes), mask_stream(b, r, shapes)
    assert [x.shape for x in ours_a] == [(64,), (3, 5)] and all(x.dtype == np.int64 for x in ours_a)
    assert not np.array_equal(ours_a[0], ours_b[0])
    # deterministic per seed
    assert all(np.array_equal(x, y) for x, y in zip(ours_a, mask_stream(a, r, shapes)))


def test_our_masks_are_uniform_on_the_whole_range():
    r, n = 2**8, 256_000
    (values,) = mask_stream(b"k" * 32, r, [(n,)])
    counts = np.bincount(values, minlength=r)
    assert len(counts) == r and counts.min() > 0  # every residue, R - 1 included
    expected = n / r
    assert np.abs(counts - expected).max() <= 5 * np.sqrt(expected)
    (flowers,) = pseudo_rand_gen(b"k" * 32, r, [(n,)])
    assert flowers.max() == r - 2  # Flower's draws stop below R - 1
    with pytest.raises(ValueError, match="power of two"):
        mask_stream(b"k" * 32, 1000, [(3,)])


def test_use_secure_masks_installs_them_in_both_flower_modules(monkeypatch):
    import importlib

    modules = [importlib.import_module(name)
               for name in ("flwr.client.mod.secure_aggregation.secaggplus_mod",
                                                          "flwr.server.workflow.secure_aggregation.secaggplus_workflow")]
    for module in modules:
        # restored after the test
        monkeypatch.setattr(module, "pseudo_rand_gen", module.pseudo_rand_gen)
    use_secure_masks()
    assert all(module.pseudo_rand_gen is mask_stream for module in modules)
