"""Client sampling (the cohort draw, the unbiased normalisation) and its privacy accounting.

The accounting is checked against an independent, exact reference: each round a record's client is
in the cohort with probability π, independently across rounds, and given the number k1 (k2) of
restart (difference) rounds it took part in, the composition is exactly a Gaussian mechanism with
μ² = k1/z1² + k2/z2² (Dong, Roth & Su 2019, Cor. 3.3). So the tight dominating pair of the whole
schedule has

    δ(ε) = Σ_{k1,k2} Bin(k1; m1, π) Bin(k2; m2, π) · [Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)],

computed here with scipy alone (no dp-accounting PLD, no project code).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import integrate, optimize, special, stats

from diff2_flwr.core.accounting import (
    SAMPLED_STEPS,
    GaussianEvent,
    LocalEvent,
    SampledGaussianEvent,
    counts_pld_epsilon,
    event_key,
    gaussian_pld,
    sampled_gaussian_pld,
)
from diff2_flwr.core.aggregation import RoundRejected
from diff2_flwr.core.calibration import (
    SAMPLING_MARGIN,
    calibrate,
    gdp_epsilon,
    gdp_mu_of_multipliers,
    schedule_cross_check,
)
from diff2_flwr.core.privacy import PldMemo, PrivacyLedger, RunEvents
from diff2_flwr.core.sampling import (
    Sampling,
    aggregate_scale,
    draw_cohort,
    sampled_sum,
)

DELTA = 1e-5


def rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def within_binomial(count: np.ndarray, n: int, p: float, sds: float = 5.0) -> bool:
    """Every count within ``sds`` binomial standard deviations of n p (5 sd: a false alarm per
    count has probability < 6e-7)."""
    return bool(np.all(np.abs(count - n * p) <= sds * math.sqrt(n * p * (1 - p))))


# ---------------------------------------------------------------------------------------------
# The cohort draw
# ---------------------------------------------------------------------------------------------

def test_probability_and_expected_cohort():
    assert Sampling("poisson", rate=0.25).probability(40) == 0.25
    assert Sampling("poisson", rate=0.25).expected_cohort(40) == 10.0
    assert Sampling("fixed", size=6).probability(40) == 6 / 40
    assert Sampling("fixed", size=6).expected_cohort(40) == 6.0
    assert aggregate_scale(None, 40) == 1 / 40
    assert aggregate_scale(Sampling("poisson", rate=0.25), 40) == 1 / 10
    assert aggregate_scale(Sampling("fixed", size=6), 40) == 1 / 6


def test_poisson_inclusions_are_independent_with_probability_q():
    clients, q, draws = 16, 0.3, 20_000
    g = rng(11)
    member = np.zeros((draws, clients), dtype=bool)
    for i in range(draws):
        cohort = draw_cohort(Sampling("poisson", rate=q), clients, g)
        assert cohort.dtype == np.int64 and np.all(np.diff(cohort) > 0)
        member[i, cohort] = True
    assert within_binomial(member.sum(axis=0), draws, q)
    # Independence: every pair together with probability q² (a fixed-size draw has m(m-1)/(P(P-1))).
    pairs = member.T.astype(np.int64) @ member.astype(np.int64)
    off = pairs[~np.eye(clients, dtype=bool)]
    assert within_binomial(off, draws, q * q)
    sizes = member.sum(axis=1)
    assert abs(sizes.var() / (clients * q * (1 - q)) - 1) < 0.05  # Binomial(P, q) variance


def test_fixed_cohort_has_exactly_m_distinct_clients_uniformly():
    clients, m, draws = 12, 4, 20_000
    g = rng(12)
    member = np.zeros((draws, clients), dtype=bool)
    for i in range(draws):
        cohort = draw_cohort(Sampling("fixed", size=m), clients, g)
        assert cohort.shape == (m,) and np.all(np.diff(cohort) > 0)
        assert 0 <= cohort[0] and cohort[-1] < clients
        member[i, cohort] = True
    assert within_binomial(member.sum(axis=0), draws, m / clients)
    pairs = member.T.astype(np.int64) @ member.astype(np.int64)
    off = pairs[~np.eye(clients, dtype=bool)]
    assert within_binomial(off, draws, m * (m - 1) / (clients * (clients - 1)))


def test_poisson_cohort_can_be_empty():
    clients, q, draws = 5, 0.2, 4_000
    g = rng(13)
    cohorts = [draw_cohort(Sampling("poisson", rate=q), clients, g) for _ in range(draws)]
    empty = sum(c.size == 0 for c in cohorts)
    assert within_binomial(np.array([empty]), draws, (1 - q) ** clients)  # 0.8⁵ = 0.33
    assert next(c for c in cohorts if c.size == 0).shape == (0,)


def test_rate_one_and_full_size_take_everyone():
    g = rng(14)
    for _ in range(50):
        assert draw_cohort(Sampling("poisson", rate=1.0), 7, g).tolist() == list(range(7))
        assert draw_cohort(Sampling("fixed", size=7), 7, g).tolist() == list(range(7))


def test_draw_uses_only_the_generator_given():
    np.random.seed(5)
    before = np.random.get_state()[1].copy()
    a = [draw_cohort(Sampling("poisson", rate=0.5), 30, g).tolist() for g in (rng(3), rng(3))]
    b = draw_cohort(Sampling("poisson", rate=0.5), 30, rng(4)).tolist()
    assert a[0] == a[1] != b
    assert np.array_equal(np.random.get_state()[1], before)
    with pytest.raises(TypeError,
                       match=r"`rng` must be a numpy.random.Generator.*Found RandomState"):
        draw_cohort(Sampling("poisson", rate=0.5), 30, np.random.RandomState(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["poisson", "fixed"])
def test_normalised_sum_is_unbiased(kind):
    """Mean over 20,000 seeded draws within 5 standard errors (predicted by the variance formula of
    the module docstring) of the full average; the per-coordinate variance within 6 % of the
    formula. Dividing by the realised cohort size instead is biased (Poisson: an empty cohort gives
    0) and the same test rejects it."""
    clients, draws = 10, 20_000
    a = rng(21).normal(loc=[1.0, -2.0, 0.5], scale=1.0, size=(clients, 3))
    full = a.mean(axis=0)
    sampling = Sampling("poisson", rate=0.25) if kind == "poisson" else Sampling("fixed", size=3)
    g = rng(22)
    est, realised = np.empty((draws, 3)), np.empty((draws, 3))
    for i in range(draws):
        cohort = draw_cohort(sampling, clients, g)
        est[i] = sampled_sum(sampling, clients, cohort, a[cohort])
        realised[i] = a[cohort].mean(axis=0) if cohort.size else 0.0
    if kind == "poisson":
        q = sampling.rate
        var = (1 - q) / (q * clients**2) * (a**2).sum(axis=0)
    else:
        m = sampling.size
        var = (1 - m / clients) / m * a.var(axis=0, ddof=1)
    se = np.sqrt(var / draws)
    assert np.all(np.abs(est.mean(axis=0) - full) <= 5 * se)
    assert np.all(np.abs(est.var(axis=0) / var - 1) < 0.06)
    if kind == "poisson":
        assert np.any(np.abs(realised.mean(axis=0) - full) > 5 * se)


def test_sampled_sum_without_sampling_is_the_plain_mean_and_empty_gives_zeros():
    a = np.arange(12.0).reshape(4, 3)
    assert np.array_equal(sampled_sum(None, 4, np.arange(4), a), a.sum(axis=0) / 4)
    empty = sampled_sum(Sampling("poisson", rate=0.5), 4, np.array([], dtype=np.int64),
                        np.zeros((0, 3)))
    assert empty.shape == (3,) and not empty.any()


# ---------------------------------------------------------------------------------------------
# The event and its PLD
# ---------------------------------------------------------------------------------------------

def test_event_keys_of_the_three_kinds_never_collide():
    z = 3.0
    keys = {event_key(GaussianEvent(z, "restart")), event_key(SampledGaussianEvent(z, 1.0,
                                                                                   "restart")),
            event_key(LocalEvent(z, 1.0, 1))}
    assert len(keys) == 3
    assert event_key(SampledGaussianEvent(z, 0.5, "difference")) == (z, 0.5, SAMPLED_STEPS)
    counts = ((event_key(SampledGaussianEvent(z, 0.5, "restart")), 2),)
    assert counts_pld_epsilon(DELTA, counts) < counts_pld_epsilon(DELTA, (((z, 1.0, 0), 2),))


def test_sampled_pld_is_pi_times_the_gaussian():
    z, q = 1.5, 0.2
    gauss, mixed = gaussian_pld(z), sampled_gaussian_pld(z, q)
    for eps in (0.0, 0.5, 1.0, 2.0):
        assert mixed.get_delta_for_epsilon(eps) == pytest.approx(
            q * gauss.get_delta_for_epsilon(eps), rel=1e-12)
    assert sampled_gaussian_pld(z, 1.0) is gauss


def _delta_two_mixtures(b: float, q: float, z: float, eps: float) -> float:
    """The hockey-stick divergence, both directions, of a record whose client sits ``b`` away from
    the cohort without it: (1-q) N(0, z²) + q N(b, z²) vs (1-q) N(0, z²) + q N(b+1, z²) (the record
    moves the sum by the replace-one sensitivity 1), by numerical integration."""
    def dens(x: float, shift: float) -> float:
        return (1 - q) * stats.norm.pdf(x, 0, z) + q * stats.norm.pdf(x, shift, z)
    out = 0.0
    for s, t in ((b, b + 1), (b + 1, b)):
        f = lambda x, s=s, t=t: max(dens(x, s) - math.exp(eps) * dens(x, t), 0.0)  # noqa: E731
        out = max(out, integrate.quad(f, -15 * z, b + 1 + 15 * z, points=[0, b, b + 1],
                                      limit=400, epsabs=1e-14)[0])
    return out


def test_client_sampling_is_not_record_level_poisson_sampling():
    """Why the event is a mixture and not dp-accounting's REPLACE_ONE PoissonSampled Gaussian.

    A client's other records put its whole contribution b far from the cohort without it; then the
    true δ(ε) of one round is π δ_z(ε) (the output tells whether the client was drawn), which the
    mixture PLD matches and the REPLACE_ONE Poisson pair (one record's radius around the absent
    output) underestimates by more than ten times, whether its sensitivity is read as the radius
    (multiplier 2z) or as the diameter (multiplier z).
    """
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution as plds

    q, z, eps = 0.1, 1.0, 1.0
    truth = _delta_two_mixtures(8.0, q, z, eps)
    ours = sampled_gaussian_pld(z, q).get_delta_for_epsilon(eps)
    assert truth == pytest.approx(q * gaussian_pld(z).get_delta_for_epsilon(eps), rel=1e-3)
    assert truth <= ours * (1 + 1e-9)
    for std in (2 * z, z):
        poisson = plds.from_gaussian_mechanism(
            standard_deviation=std, sensitivity=1.0, sampling_prob=q,
            neighboring_relation=NeighboringRelation.REPLACE_ONE).get_delta_for_epsilon(eps)
        assert poisson < truth / 10
    # With the absent output midway between the two (record-level sampling: b = -1/2) the pair is
    # exactly dp-accounting's REPLACE_ONE one (radius 1/2, multiplier 2z), to the quadrature's
    # accuracy: the case the local routine's LocalEvent is.
    assert _delta_two_mixtures(-0.5, q, z, eps) == pytest.approx(plds.from_gaussian_mechanism(
        standard_deviation=2 * z, sensitivity=1.0, sampling_prob=q,
        neighboring_relation=NeighboringRelation.REPLACE_ONE).get_delta_for_epsilon(eps), rel=1e-5)


def exact_epsilon(delta: float, m1: int, z1: float, m2: int, z2: float | None,
                  pi: float) -> float:
    """The exact ε of the schedule (module docstring), binomial terms below 1e-22 dropped (their
    total changes δ by < 1e-18)."""
    def support(m: int) -> tuple[np.ndarray, np.ndarray]:
        if m == 0:
            return np.array([0]), np.array([1.0])
        k = np.arange(m + 1)
        w = stats.binom.pmf(k, m, pi)
        return k[w > 1e-22], w[w > 1e-22]

    (k1, w1), (k2, w2) = support(m1), support(m2)
    mu2 = k1[:, None] / z1**2 + (k2[None, :] / z2**2 if m2 else 0.0)
    weight = (w1[:, None] * w2[None, :])[mu2 > 0]
    mu = np.sqrt(mu2[mu2 > 0])

    def excess(eps: float) -> float:
        gauss = (special.ndtr(-eps / mu + mu / 2)
                 - np.exp(eps + special.log_ndtr(-eps / mu - mu / 2)))
        return float(np.sum(weight * np.maximum(gauss, 0.0))) - delta

    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-13, rtol=1e-13)


def test_exact_reference_agrees_with_dp_accounting_on_a_gaussian():
    """The reference's Gaussian term is dp-accounting's analytic Gaussian (π = 1, one kind)."""
    from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

    assert exact_epsilon(DELTA, 1, 2.0, 0, None, 1.0) == pytest.approx(
        get_epsilon_gaussian(2.0, DELTA), rel=1e-9)
    assert exact_epsilon(DELTA, 9, 6.0, 0, None, 1.0) == pytest.approx(
        get_epsilon_gaussian(2.0, DELTA), rel=1e-9)


SCHEDULES = [  # (rounds, T, P, n_min, sampling)
    pytest.param(2000, 20, 10, 1651, Sampling("poisson", rate=0.1), id="poisson-q0.1-R2000"),
    pytest.param(120, 10, 50, 100, Sampling("fixed", size=5), id="fixed-5-of-50"),
    pytest.param(300, 1, 100, 40, Sampling("poisson", rate=0.02), id="dpgd-q0.02"),
]


@pytest.mark.parametrize(("rounds", "restart_every", "clients", "n_min", "sampling"), SCHEDULES)
def test_independent_check_of_a_calibrated_schedule(rounds, restart_every, clients, n_min,
                                                    sampling):
    """(i) The calibrated schedule's ε (dp-accounting PLD of the mixture events) equals the exact
    binomial-mixture ε to 1e-6 (relative; the PLD is pessimistic, so never below), is within the
    target, and the ledger holding the planned events reports the same number by counts.
    dp-accounting's REPLACE_ONE PoissonSampled composition of the same multipliers stays far below
    the exact value: it would under-charge."""
    from dp_accounting import NeighboringRelation, dp_event
    from dp_accounting.pld import pld_privacy_accountant

    epsilon = 2.0
    cal = calibrate(epsilon=epsilon, delta=DELTA, rounds=rounds, restart_every=restart_every,
                    u=1.25, n_min=n_min, clients=clients, sampling=sampling)
    pi = cal.sampling_prob
    exact = exact_epsilon(DELTA, cal.restart_rounds, cal.z1, cal.difference_rounds, cal.z2, pi)
    planned = cal.planned_epsilon
    assert planned == pytest.approx(exact, rel=1e-6)
    assert exact - 1e-12 <= planned <= epsilon * (1 - SAMPLING_MARGIN)
    events = cal.round_events(True) * cal.restart_rounds
    if cal.difference_rounds:
        events += cal.round_events(False) * cal.difference_rounds
    assert PrivacyLedger(DELTA, events).epsilon_pld_by_counts == planned

    acc = pld_privacy_accountant.PLDAccountant(NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-4)
    for z, m in ((cal.z1, cal.restart_rounds), (cal.z2, cal.difference_rounds)):
        if m:
            acc.compose(dp_event.PoissonSampledDpEvent(pi, dp_event.GaussianDpEvent(z)), m)
    assert acc.get_epsilon(DELTA) < 0.6 * exact


def test_rate_one_reproduces_the_full_batch_calibration_and_smaller_rates_less_noise():
    """(ii) q = 1: the same z's as the closed-form calibration up to the margin (the PLD run is
    aimed at ε (1 - 0.005): z within +1 %, its exact GDP ε within 1 % below ε). Smaller q: smaller
    z (amplification), but larger σ (the sum is divided by qP): about σ_full / sqrt(q)."""
    base = dict(epsilon=3.0, delta=DELTA, rounds=2000, restart_every=20, u=1.25, n_min=1651,
                clients=10)
    full = calibrate(**base)
    one = calibrate(**base, sampling=Sampling("poisson", rate=1.0))
    assert 1.0 < one.z1 / full.z1 < 1.01 and 1.0 < one.z2 / full.z2 < 1.01
    assert one.z2 / one.z1 == pytest.approx(full.z2 / full.z1, rel=1e-12)  # the split kept
    assert one.sigma1 / full.sigma1 == pytest.approx(one.z1 / full.z1, rel=1e-12)
    exact_gdp = gdp_epsilon(gdp_mu_of_multipliers(one.restart_rounds, one.z1,
                                                  one.difference_rounds, one.z2), DELTA)
    assert 0.99 * 3.0 < exact_gdp <= one.planned_epsilon <= 3.0
    everyone = calibrate(**base, sampling=Sampling("fixed", size=10))
    assert (everyone.z1, everyone.z2) == (one.z1, one.z2)

    previous = one
    for q in (0.5, 0.1, 0.02):
        cal = calibrate(**base, sampling=Sampling("poisson", rate=q))
        assert cal.z1 < previous.z1 and cal.z2 < previous.z2
        assert cal.sigma1 > previous.sigma1
        assert cal.z2 / cal.z1 == pytest.approx(full.z2 / full.z1, rel=1e-12)
        assert cal.sigma1 == pytest.approx(2 * cal.z1 / (1651 * q * 10), rel=1e-12)
        previous = cal
    assert 0.1 < previous.z1 / full.z1 < 0.3  # q = 0.02: linear amplification, z ≈ sqrt(q) z_full


def test_charged_ledger_ends_within_epsilon_and_the_guard_refuses_one_more_round():
    """(iii) The rounds charged one by one through the server's budget guard (runtime.server_core
    .charge: the ledger's own PLD, composed in release order): every round passes, the last ledger
    is within ε and near it (the calibration is not wasteful), the same number as the plan by counts
    to 1e-6; one more restart round is refused with check 'budget'."""
    from diff2_flwr.runtime.server_core import charge

    epsilon, rounds, restart_every = 2.0, 120, 10
    cal = calibrate(epsilon=epsilon, delta=DELTA, rounds=rounds, restart_every=restart_every,
                    u=1.25, n_min=100, clients=50, sampling=Sampling("poisson", rate=0.1))
    spec = SimpleNamespace(distributed=None, calibration=cal)
    ledger = PrivacyLedger(DELTA)
    for r in range(1, rounds + 1):
        plan = SimpleNamespace(round=r, restart=(r - 1) % restart_every == 0)
        ledger = charge(spec, SimpleNamespace(ledger=ledger), plan)  # type: ignore[arg-type]
    assert len(ledger.events) == rounds and not ledger.exact and math.isnan(ledger.mu)
    assert all(isinstance(e, SampledGaussianEvent) and e.sampling_prob == 0.1
               for e in ledger.events)
    assert sum(e.kind == "restart" for e in ledger.events) == cal.restart_rounds
    assert ledger.epsilon == ledger.epsilon_pld
    assert epsilon * (1 - 2 * SAMPLING_MARGIN) < ledger.epsilon <= epsilon
    assert ledger.epsilon == pytest.approx(cal.planned_epsilon, rel=1e-6)
    assert ledger.pld_epsilon(PldMemo()) == ledger.epsilon  # the memo changes no value
    assert ledger.epsilon_rdp > ledger.epsilon  # RDP: unamplified, looser
    with pytest.raises(RoundRejected, match=r"check 'budget' failed.*above the target ε = 2"):
        charge(spec, SimpleNamespace(ledger=ledger),  # type: ignore[arg-type]
               SimpleNamespace(round=rounds + 1, restart=True))


def test_without_sampling_nothing_changes():
    base = dict(epsilon=3.0, delta=DELTA, rounds=2000, restart_every=20, u=1.25, n_min=1651,
                clients=10)
    cal = calibrate(**base)
    assert cal == calibrate(**base, sampling=None)
    assert (round(cal.z1, 2), round(cal.z2, 1)) == (15.55, 135.5)  # DIFF2.md's reference figures
    assert "sampling" not in cal.as_dict() and cal.sampling_prob == 1.0
    assert cal.round_events(True) == (GaussianEvent(cal.z1, "restart"),)
    assert PrivacyLedger(DELTA, cal.round_events(True)).exact


def test_sampled_calibration_as_data():
    assert type(Sampling("fixed", size=np.int64(5)).size) is int
    assert type(Sampling("poisson", rate=1).rate) is float
    cal = calibrate(epsilon=2.0, delta=DELTA, rounds=120, restart_every=10, u=1.25, n_min=100,
                    clients=50, sampling=Sampling("fixed", size=np.int64(5)))
    data = cal.as_dict()
    json.dumps(data, allow_nan=False)
    assert data["mu"] is None and math.isnan(cal.mu)
    assert data["sampling"]["probability"] == 0.1 and data["sampling"]["expected_cohort"] == 5.0
    assert data["epsilon_spent_at_end"] == cal.planned_epsilon
    assert cal.epsilon_spent(0, 0) == 0.0
    assert cal.epsilon_spent(cal.restart_rounds, 0) < cal.planned_epsilon


# ---------------------------------------------------------------------------------------------
# (iv) Every refusal
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(kind="bernoulli", rate=0.1), r"`sampling.kind` must be one of \('poisson', 'fixed'\). "
                                        r"Found 'bernoulli'"),
    (dict(kind="poisson"), r"`sampling.rate` \(q\) must be a number in \(0, 1\].*Found None"),
    (dict(kind="poisson", rate=0.0), r"`sampling.rate`.*Found 0.0"),
    (dict(kind="poisson", rate=1.5), r"`sampling.rate`.*Found 1.5"),
    (dict(kind="poisson", rate=math.nan), r"`sampling.rate`.*Found nan"),
    (dict(kind="poisson", rate=True), r"`sampling.rate`.*Found True"),
    (dict(kind="poisson", rate=0.1, size=3),
     r"`sampling.size` is for kind 'fixed'.*Found size = 3"),
    (dict(kind="fixed"), r"`sampling.size` \(m\) must be an integer >= 1.*Found None"),
    (dict(kind="fixed", size=0), r"`sampling.size` \(m\).*Found 0"),
    (dict(kind="fixed", size=2.0), r"`sampling.size` \(m\).*Found 2.0"),
    (dict(kind="fixed", size=2, rate=0.1), r"`sampling.rate` is for kind 'poisson'.*Found rate = "
                                           r"0.1"),
])
def test_sampling_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_cohort_and_scale_refusals():
    with pytest.raises(ValueError, match=r"`sampling.size` \(m\) must be at most the number of "
                                         r"clients P = 4. Found 5"):
        Sampling("fixed", size=5).probability(4)
    with pytest.raises(ValueError, match=r"`clients` \(P.*\) must be an integer >= 1. Found 0"):
        draw_cohort(Sampling("poisson", rate=0.5), 0, rng(0))
    with pytest.raises(ValueError, match=r"`clients`.*Found 2.5"):
        aggregate_scale(None, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"one row per sampled client: expected shape \(2, d\)\. "
                                         r"Found \(3, 4\)"):
        sampled_sum(None, 3, np.array([0, 1]), np.zeros((3, 4)))


@pytest.mark.parametrize(("z", "q", "match"), [
    (-1.0, 0.5, r"`noise_multiplier` must be a finite number >= 0. Found -1.0"),
    (math.inf, 0.5, r"`noise_multiplier`.*Found inf"),
    (1.0, 0.0, r"`sampling_prob` \(the probability .*\) must be in \(0, 1\]. Found 0.0"),
    (1.0, 1.2, r"`sampling_prob`.*Found 1.2"),
])
def test_event_refuses(z, q, match):
    with pytest.raises(ValueError, match=match):
        SampledGaussianEvent(z, q, "restart")


def test_calibrate_refusals():
    base = dict(epsilon=2.0, delta=DELTA, rounds=120, restart_every=10, u=1.25, n_min=100,
                clients=50)
    with pytest.raises(ValueError, match=r"`mode` 'rdp' cannot be combined with `sampling`.*use "
                                         r"mode 'exact'"):
        calibrate(**base, mode="rdp", sampling=Sampling("poisson", rate=0.1))
    with pytest.raises(ValueError, match=r"`local_steps` \(3\) cannot be combined with "
                                         r"`sampling`"):
        calibrate(**base, local_steps=3, local_batch_size=8, local_share=0.2,
                  sampling=Sampling("poisson", rate=0.1))
    with pytest.raises(ValueError, match=r"`sampling` must be a Sampling .* Found float: 0.1"):
        calibrate(**base, sampling=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`sampling.size` \(m\) must be at most the number of "
                                         r"clients P = 50. Found 60"):
        calibrate(**base, sampling=Sampling("fixed", size=60))
    with pytest.raises(ValueError, match=r"π = 1e-08 a record's client is in any of the 20 rounds "
                                         r"with probability 2e-07 <= δ = 1e-05"):
        calibrate(**{**base, "rounds": 20}, sampling=Sampling("poisson", rate=1e-8))
    cal = calibrate(**base, sampling=Sampling("poisson", rate=0.1))
    # a node's charge holds the sampled rounds (tests/test_run_events.py), never full-batch ones
    assert RunEvents.from_calibration(cal).gaussian == ()
    with pytest.raises(ValueError, match=r"schedule_cross_check composes full-batch "
                                         r"GaussianDpEvents.*planned_epsilon"):
        schedule_cross_check(cal)
