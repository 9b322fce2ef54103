"""The distributed Skellam mechanism's pieces (diff2_flwr/core/skellam.py), each against an
independent reference: the rotation against scipy's Hadamard matrix, the noise against scipy's
Skellam distribution, the closed-form Rényi bound against the exact divergence computed from the
Skellam probability mass function (modified Bessel functions, mpmath in the far tails), the RDP ->
(ε, δ) conversion against dp-accounting, and the sum's decoding and the wrap-around bound against
simulation. Fixed seeds throughout."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from scipy.linalg import hadamard
from scipy.special import ive, logsumexp

from diff2_flwr.core import skellam as sk


# ------------------------------------------------------------------------------ rotation

def test_rotation_is_the_signed_hadamard_matrix_orthonormal_linear_and_inverted():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 101))
    signs = sk.rotation_signs(7, 101)
    assert signs.shape == (128,) and set(np.unique(signs)) == {-1.0, 1.0}
    padded = np.zeros((3, 128))
    padded[:, :101] = x
    reference = padded * signs @ hadamard(128).T / math.sqrt(128)
    np.testing.assert_allclose(sk.rotate(x, signs), reference, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(sk.rotate(x, signs), axis=1),
                               np.linalg.norm(x, axis=1), rtol=1e-13)
    np.testing.assert_allclose(sk.unrotate(sk.rotate(x, signs), signs, 101), x, rtol=0, atol=1e-13)
    np.testing.assert_allclose(sk.rotate(x.sum(0), signs), sk.rotate(x, signs).sum(0), rtol=0,
                               atol=1e-12)
    # the seed is public and the same everywhere; another seed, other signs
    assert np.array_equal(signs, sk.rotation_signs(7,
                                                   101)) and not np.array_equal(
                                                       signs, sk.rotation_signs(8, 101))
    assert sk.padded_dim(1) == 1 and sk.padded_dim(128) == 128 and sk.padded_dim(129) == 256


# ------------------------------------------------------------------------------ rounding

def test_conditional_rounding_is_unbiased_and_never_beyond_rho():
    rng = np.random.default_rng(1)
    y = rng.normal(scale=30, size=64)
    rho = sk.rounding_bound(64, 1e-3)
    draws = np.stack([sk.conditional_round(y, rho, rng) for _ in range(4000)])
    assert draws.dtype == np.int64 and np.all(np.abs(draws - y) < 1)
    assert np.linalg.norm(draws - y, axis=1).max() <= rho
    frac = y - np.floor(y)
    se = np.sqrt(frac * (1 - frac) / len(draws)) + 1e-12
    # unbiased per coordinate (the cut at ρ is rare)
    assert np.all(np.abs(draws.mean(0) - y) <= 5 * se + 1e-9)
    with pytest.raises(RuntimeError, match="rounding_bound"):
        sk.conditional_round(np.full(64, 0.5), 0.5, rng)  # ‖e‖ = 4 for every draw


def test_rounding_bound_is_exceeded_at_most_beta_of_the_time():
    rng = np.random.default_rng(2)
    beta = 0.01
    # fractions where the error norm varies most (0.5 gives ‖e‖ = sqrt(D)/2 exactly), and random
    # ones
    for y in (np.full(256, 0.79), rng.random(256) * 10, np.where(np.arange(256) % 2, 0.21, 0.5)):
        frac = y - np.floor(y)
        errors = np.linalg.norm(np.floor(y) + (rng.random((20000, 256)) < frac) - y, axis=1)
        assert (errors > sk.rounding_bound(256, beta)).mean() <= beta
        # not vacuous
        assert np.quantile(errors, 0.999) <= sk.rounding_bound(256, beta) <= 2 * np.sqrt(256 / 4)


# ------------------------------------------------------------------------------ noise

def test_skellam_noise_is_the_skellam_distribution_and_shares_add_up():
    rng = np.random.default_rng(3)
    variance, n = 6.0, 200_000
    draws = sk.skellam_noise(n, variance, rng)
    assert draws.dtype == np.int64
    ks = np.arange(-8, 9)
    observed = np.array([(draws == k).sum() for k in ks])
    expected = stats.skellam.pmf(ks, variance / 2, variance / 2) * n
    assert np.all(np.abs(observed - expected) <= 5 * np.sqrt(expected))
    # 10 clients' shares of variance 6 sum to one Skellam of variance 60
    total = sum(sk.skellam_noise(n, variance, rng) for _ in range(10))
    assert total.var() == pytest.approx(60.0, rel=5 * math.sqrt(2 / n))
    assert np.array_equal(sk.skellam_noise(5, 0.0, rng), np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="variance"):
        sk.skellam_noise(5, -1.0, rng)


# ------------------------------------------------------------------------------ encode, sum, decode

def _clients(rng, p: int, dim: int, norm: float) -> list[np.ndarray]:
    vectors = rng.normal(size=(p, dim))
    return [norm * v / np.linalg.norm(v) for v in vectors]


def test_without_noise_the_decoded_sum_is_the_true_sum_within_the_rounding_bound():
    rng = np.random.default_rng(4)
    xs = _clients(rng, 5, 101, 1.0)
    code = sk.SkellamCode(dim=101, scale=1000.0, rho=sk.rounding_bound(101, 1e-6), bits=24, seed=11)
    total = sk.modular_sum([sk.encode(x, code, 0.0, rng) for x in xs], code.bits)
    assert total.min() >= 0 and total.max() < 2**24
    error = np.linalg.norm(sk.decode(total, code) - sum(xs))
    assert error <= 5 * code.rho / code.scale  # each client's rounding within ρ, in integer units
    assert error > 0  # and rounding did happen


def test_with_noise_the_decoded_sum_carries_exactly_the_shares_variance():
    rng = np.random.default_rng(5)
    p, dim, trials = 4, 30, 600
    code = sk.SkellamCode(dim=dim, scale=50.0, rho=sk.rounding_bound(dim, 1e-6), bits=20, seed=12)
    xs = _clients(rng, p, dim, 2.0)
    share = 9.0  # per client and coordinate, integer units
    errors = np.stack([sk.decode(sk.modular_sum([sk.encode(x, code, share, rng) for x in xs], 20),
                                 code) - sum(xs)
                       for _ in range(trials)])
    # the noise in integer units is Skellam(p·share) per rotated coordinate; after unrotating and
    # unscaling, each of the dim coordinates has variance (p·share + rounding's) / scale²: rounding
    # adds at most p/4
    per_coordinate = errors.var(axis=0).mean() * code.scale**2
    se = math.sqrt(2 / (trials * dim))  # relative SE of a variance estimated from trials·dim draws
    assert p * share * (1 - 5 * se) <= per_coordinate <= (p * share + p / 4) * (1 + 5 * se)


def test_encode_refuses_a_vector_of_the_wrong_shape_and_codes_refuse_bad_parameters():
    code = sk.SkellamCode(dim=4, scale=10.0, rho=2.0, bits=16, seed=0)
    with pytest.raises(ValueError, match="4 finite numbers"):
        sk.encode(np.ones(5), code, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="4 finite numbers"):
        sk.encode(np.array([1.0, np.nan, 0, 0]), code, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="`bits` must be in"):
        sk.SkellamCode(dim=4, scale=10.0, rho=2.0, bits=63, seed=0)
    with pytest.raises(ValueError, match="`scale`"):
        sk.SkellamCode(dim=4, scale=0.0, rho=2.0, bits=16, seed=0)


# ------------------------------------------------------------------------------ privacy

def _log_pmf(mu: float, ks: np.ndarray) -> np.ndarray:
    """log P(Skellam = k) for the symmetric Skellam of variance mu: e^{-mu} I_|k|(mu) (Bessel),
    mpmath where float underflows (the far tails, which decide the Rényi divergence of large
    orders)."""
    import mpmath

    scaled = ive(np.abs(ks), mu)
    with np.errstate(divide="ignore"):
        out = np.log(scaled)
    mpmath.mp.dps = 40
    for i in np.flatnonzero(scaled < 1e-280):
        out[i] = float(mpmath.log(mpmath.besseli(int(abs(ks[i])), mu)) - mu)
    return out


def _exact_rdp_1d(order: int, shift: int, mu: float) -> float:
    """D_α(Sk + shift ‖ Sk) summed over the integers (truncated where the terms are below 1e-40 of
    the sum)."""
    # the terms peak near order·shift
    half = order * abs(shift) + int(15 * math.sqrt(mu)) + 8 * order + 40
    ks = np.arange(-half, half + 1)
    terms = order * _log_pmf(mu, ks - shift) + (1 - order) * _log_pmf(mu, ks)
    total = logsumexp(terms)
    assert max(terms[0],
               terms[-1]) < total - 40 * math.log(10), "the sum is not converged at its ends"
    return float(total / (order - 1))


@pytest.mark.parametrize("mu", [0.5, 2.0, 20.0, 300.0, 5000.0])
def test_the_closed_form_bounds_the_exact_renyi_divergence(mu):
    """Corollary 3.6 against the exact divergence: for a shift vector v the coordinates are
    independent, so D_α = Σ_i D_α(Sk + v_i ‖ Sk) exactly; the bound with Δ₁ = ‖v‖₁, Δ₂ = ‖v‖₂ must
    be above it, for concentrated shifts (one coordinate) and spread ones (many ±1s, where
    discreteness costs most). Where the variance is large against the shift, the bound is close to
    the truth (it is not vacuous)."""
    cache: dict[tuple[int, int], float] = {}

    def exact(order: int, v: list[int]) -> float:
        for s in set(np.abs(v)):
            if (order, s) not in cache:
                cache[order, s] = _exact_rdp_1d(order, int(s), mu) if s else 0.0
        return sum(cache[order, abs(s)] for s in v)

    for order in (2, 3, 8, 32, 64):
        for v in ([1], [3], [10], [1] * 9, [2, -1, 1, 1]):
            l1, l2 = float(np.abs(v).sum()), float(np.linalg.norm(v))
            bound, truth = sk.skellam_rdp(order, l1, l2, mu), exact(order, v)
            assert truth <= bound * (1 + 1e-9), (order, v, truth, bound)
            if mu >= 20 * l2 * l2 and order <= 8:
                assert bound <= 1.15 * truth, (order, v, truth, bound)


def test_the_bound_tends_to_the_gaussians_for_large_variance():
    for order in (2, 16, 64):
        gaussian = order * 9.0 / (2 * 1e6)
        assert sk.skellam_rdp(order, 3.0, 3.0, 1e6) == pytest.approx(gaussian, rel=1e-4)
    with pytest.raises(ValueError, match="integer > 1"):
        sk.skellam_rdp(1.5, 1.0, 1.0, 1.0)
    assert sk.skellam_rdp(2, 1.0, 1.0, 0.0) == math.inf


@pytest.mark.parametrize("z,steps,delta", [(1.0, 1, 1e-5), (5.0, 100, 1e-5), (0.7, 20, 1e-6)])
def test_rdp_to_epsilon_is_dp_accountings_conversion(z, steps, delta):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(sk.RDP_ORDERS))
    accountant.compose(dp_event.GaussianDpEvent(z), steps)
    ours = sk.rdp_to_epsilon([steps * a / (2 * z * z) for a in sk.RDP_ORDERS], sk.RDP_ORDERS, delta)
    assert ours == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)


def test_the_sensitivity_pays_for_rounding_which_can_exceed_the_scaled_record_change():
    """Neighbouring vectors y, y + d (‖d‖ = record_l2): their integer encodings differ by more than
    scale·‖d‖ in some draws (so Δ₂ without 2ρ would be wrong), and never by more than Δ₂."""
    rng = np.random.default_rng(6)
    code = sk.SkellamCode(dim=60, scale=40.0, rho=sk.rounding_bound(60, 1e-6), bits=30, seed=3)
    record = 0.05
    y = rng.normal(size=60)
    d = rng.normal(size=60)
    d *= record / np.linalg.norm(d)
    signs = sk.rotation_signs(code.seed, code.dim)
    a, b = sk.rotate(code.scale * y, signs), sk.rotate(code.scale * (y + d), signs)
    gaps = [np.linalg.norm(sk.conditional_round(a, code.rho,
                                                rng) - sk.conditional_round(b, code.rho, rng))
            for _ in range(2000)]
    l1, l2 = sk.sensitivity(record, code)
    assert max(gaps) <= l2 and max(gaps) > code.scale * record
    assert l2 == pytest.approx(code.scale * record + 2 * code.rho) and l1 <= l2 * l2


# ------------------------------------------------------------------------------ the modulus

def test_the_chosen_scale_does_not_wrap_and_a_finer_one_does():
    rng = np.random.default_rng(7)
    p, dim, bits, z, record = 6, 101, 16, 2.0, 0.01
    rho = sk.rounding_bound(dim, 1e-6)
    code = sk.choose_scale(dim, bits, sum_l2=p * 1.0, clients=p, noise_multiplier=z,
                           record_l2=record, rho=rho, wrap=1e-6, seed=5)

    def worst_error(c: sk.SkellamCode) -> float:
        share = (z * sk.sensitivity(record, c)[1]) ** 2 / p
        x = np.zeros(dim)
        x[0] = 1.0  # every client's vector aligned: the sum's norm is the bound p·1
        worst = 0.0
        for _ in range(40):
            total = sk.modular_sum([sk.encode(x, c, share, rng) for _ in range(p)], bits)
            worst = max(worst, float(np.abs(sk.decode(total, c) - p * x).max()))
        return worst

    assert sk.wrap_probability(code, p * 1.0, p, (z * sk.sensitivity(record, code)[1]) ** 2) <= 1e-6
    fine = worst_error(code)
    # no wrap: the error is the noise's (a wrap is an error of the order M / scale)
    assert fine < 0.5
    coarse = sk.SkellamCode(dim, code.scale * 8, rho, bits, 5)
    # 8x finer grid: the sum overflows the modulus and decodes to garbage
    assert worst_error(coarse) > p / 2


def test_too_few_bits_are_refused_saying_how_many_would_do():
    with pytest.raises(ValueError, match=r"`bits` = 8 cannot hold .* Use at least \d+ bits"):
        sk.choose_scale(1000, 8, sum_l2=20.0, clients=20, noise_multiplier=5.0, record_l2=0.001,
                        rho=sk.rounding_bound(1000, 1e-6), wrap=1e-9, seed=1)
