"""An empirical privacy audit of the real server path: try to break our own (ε, δ) guarantee.

Two neighbouring federations D and D′ differ in one record (replace-one) of worker 0: a
*gradient canary* whose per-sample gradient, and per-sample gradient difference, is a huge
vector +K·e in D and −K·e in D′ (e = the first coordinate axis). Clipping pulls both onto the
clipping radius of the round, so the two federations' averaged contributions differ by exactly
the sensitivity 2·C_r/(n·P) along e on every round, restarts and difference rounds alike: the
worst case of the DP analysis. All other records are benign quadratic losses that do not touch
e, known to the auditor (white box).

Each trial runs a whole schedule (e.g. R = 10 with T = 5: restarts and difference rounds)
through the production code: the real :class:`~diff2_flwr.fl.strategy.Diff2Strategy`
(``configure_fit`` -> the real :class:`~diff2_flwr.fl.client.Diff2Client` per worker, whose
ClippedMean is the core's -> ``FitRes`` on the wire -> ``aggregate_fit`` -> checks, average,
noise from a fresh key, ledger, budget guard). The adversary sees what the server releases
(ṽ_r, and the radius each round announces) and scores the trial with the likelihood-ratio
statistic of D against D′,

    S = Σ_r (Δ_r / s_r²) ⟨ṽ_r − ṽ_{r−1}·[difference round], e⟩,   Δ_r = 2 C_r/(n P),  s_r = σ_r C_r,

the Neyman–Pearson optimal test for the claimed noise (σ_r from the published calibration).
For a μ-GDP mechanism S ~ N(±μ²/2, μ²).

**DIFF2 with its private local routine** (``--method diff2-bvr``, BVR-L-SGD with K = 2): after ṽ_r
the server hands x_{r−1} and ṽ_r to one worker, which takes one private local step — each record
sampled independently with probability q = b/n (Poisson), the clipped gradient differences summed,
divided by the fixed b, plus N(0, (σ3 c)² I) with c = C3‖y_1 − y_0‖ — and returns y_2, released as
x_r. The audit forces worker 0, the canary's, to be that worker (:class:`_CanaryWorkerServer`; a run
draws it uniformly, and the ledger charges every record every local phase, so this is the worst case
the analysis covers). The canary's gradient difference clips onto ±c·e, so along e the local step's
output (w_1 − ṽ_r, recovered exactly from the released x_{r−1}, ṽ_r, x_r since y_1 = x_{r−1} − ηṽ_r
and x_r = y_1 − η w_1) is (1 − q) N(0, s²) + q N(±c/b, s²): exactly dp-accounting's replace-one
Poisson-subsampled Gaussian pair, which the ledger composes. Poisson sampling makes the two
federations' outputs share the (1 − q) mass of "canary not sampled": the linear statistic loses
power and the likelihood ratio is the mixtures', added to the server rounds'
(:func:`local_log_likelihood_ratio`). The claimed ε is the run's own ledger (dp-accounting PLD,
round by round) for the same calibration.

**Distributed noise** (``--noise distributed``, ``privacy.noise: distributed``): each client clips
its mean as in central mode and sends it encoded with its share of Skellam noise, of variance
(zΔ₂)²/(P − t) (rotation, conditional randomised rounding, mod 2**bits:
:class:`~diff2_flwr.core.distributed.DistributedNoise`); the server sees only the modular sum and
decodes it (:meth:`~diff2_flwr.runtime.server.Diff2Server.release_sum`). Each trial runs the real
Strategy and the real clients with ``noise=`` (``fit`` -> ``encode_share``); SecAgg+'s masking is
exact on these messages (:mod:`~diff2_flwr.fl.secagg`, tested against Flower's own arithmetic in
tests/test_secagg.py), so the audit hands ``aggregate_fit`` the unmasked mean SecAgg+ would, and the
server decodes it (``decode_secure_sum``). With ``--tolerated t`` the last t clients drop out of
every round, so that the sum carries exactly the P − t shares the analysis counts on (a colluder's
known share is the same loss of noise). The score is the statistic above with s_r the released
round's ``noise_std`` (the std of the decoded mean's noise) and Δ_r = 2 C_r/(n k), k the survivors:
for Skellam noise it is the Gaussian-optimal test, not the exact likelihood ratio, which costs power
but not validity (any test's error rates give a lower bound). Its thresholds are
:func:`threshold_grid` at the schedule's Gaussian μ = (Σ_r 1/z_r²)^½. The claimed ε is the run's
Skellam ledger for the schedule (Corollary 3.6 RDP, composed). ``--noise-scale`` scales every
client's share std (not the server's ledger or decoding).

**Client sampling** (``--sampling poisson|fixed``, ``training.sampling``): each round the server
draws a fresh cohort from the trial's own key (Poisson with rate q, or m of the P clients), only the
cohort computes, the sum is divided by E|S| and σ_r C_r noise is added: the mechanism a sampled run
claims, run through the real Strategy (``configure_fit`` asks each node its partition once,
``get_properties``, then only the cohort; an empty cohort is released without Flower) and the real
clients. Worker 0, the canary's client, is drawn like any other (probability π = q or m/P), never
forced: forcing it would audit another mechanism. The claim is the run's ledger (PLD of
:class:`~diff2_flwr.core.accounting.SampledGaussianEvent`: π·Gaussian + (1 − π)·no loss). Its worst
case is a client whose other records move the output far from where it is without the client, so the
output reveals whether it was drawn: worker 0's other n − 1 records have gradient and gradient
difference +K·e (``push``), clip onto +C_r·e, and put the drawn round's output along e at c ± Δ/2
with c = (n − 1)/(2 z_r) noise std (0 when worker 0 is absent). Two tests, each at level α/2: the
Clopper–Pearson bound on the exact LR of what is released, Σ_r ln of the mixtures (1 − π)·N(0, s²) +
π·N(c ± Δ/2, s²) (:func:`~.stats.mixture_log_likelihood_ratio`; thresholds around the claimed
score's moments); and the cohort test (:func:`~.gdp.cohort_gdp_audit`): given the public cohorts the
drawn rounds are Gaussian, ρ = the ratio of their μ's to the claimed ones has an exact noncentral-t
interval, and ε(δ) at ρ is the exact binomial mixture of μ-GDP. Beside them, the ε dp-accounting's
REPLACE_ONE Poisson-subsampled Gaussian would have claimed (:func:`naive_poisson_epsilon`) and
whether each lower bound exceeds it.

Turning scores into a bound: for a threshold t ("guess D iff S > t"), an (ε, δ)-DP mechanism
has FPR + e^ε FNR ≥ 1 − δ and FNR + e^ε FPR ≥ 1 − δ. With one-sided Clopper–Pearson upper
bounds on FPR and FNR (each at level α/2, so both hold with probability ≥ 1 − α) this gives

    ε̂ = max(ln((1 − δ − FPR⁺)/FNR⁺), ln((1 − δ − FNR⁺)/FPR⁺), 0),

a lower bound on the true ε with confidence 1 − α. The thresholds form a grid fixed before
the trials (in units of the claimed μ) and ε̂ is the best over the grid with a Bonferroni
correction, so choosing the best threshold does not bias the interval. If ε̂ > ε claimed, the
claimed guarantee is false (at confidence 1 − α).

The tight estimate (:mod:`.gdp`): the canary is clipped onto the radius in every round and the score
sums every round's likelihood-ratio term, so the audited quantity is the whole run's guarantee, μ =
(Σ_r 1/z_r²)^½, not a part of it. For the Gaussian mechanisms (dpgd, diff2, and distributed noise as
its Gaussian equivalent) the scores are normal with one variance under D and D′ and means μ_true
standard deviations apart, whatever noise the server really adds: μ̂ = (mean_D − mean_D′)/s_pooled,
with a noncentral-t interval, gives ε̂(δ) by the exact μ-GDP conversion. A calibrated mechanism
gives μ̂ ≈ μ claimed (about 100 % of the claim, where the Clopper–Pearson bound reaches about 40 %
at 10⁴ trials), and the power at the trial count is exact under the same assumption. The audit flags
a violation if either test refutes the claim: the Clopper–Pearson bound above and the μ-GDP lower
bound, each at level α/2 (α = 0.001 by default: a correct mechanism is reported as a violation at
most once in a thousand audits), the μ-GDP test only when the Gaussian checks do not reject its
assumption. diff2-bvr (Poisson-subsampled local steps: no Gaussian trade-off) has the
Clopper–Pearson bound alone, at level α.

The audit is made in parts: the federations and the trials through the production path
(:mod:`.trials`), and the statistics that turn their scores into ε̂ (:mod:`.stats`: Clopper–Pearson;
:mod:`.gdp`: μ-GDP and power). This module runs an audit and reports it, through one small object
per regime (central, distributed, local, sampled: its calibration, its trials' scores, its claim and
tests); every name of the audit is importable from here.

References:
    Jagielski, Ullman & Oprea (2020), "Auditing Differentially Private Machine Learning".
    Nasr, Song, Thakurta, Papernot & Carlini (2021), "Adversary Instantiation: Lower Bounds
    for Differentially Private Machine Learning" (gradient canaries, white-box auditing).
    Nasr et al. (2023), "Tight Auditing of Differentially Private Machine Learning" (GDP-based ε).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ...core.distributed import DistributedNoise, SkellamLedger
from ...core.privacy import Calibration, LocalCalibration, PrivacyLedger
from .canaries import canary_runs, canary_scores, canary_spec
from .flower import flower_canary_scores
from .gdp import cohort_gdp_audit, gdp_audit
from .spec import LOCAL_STEPS, AuditSpec
from .stats import (_local_loss_moments, claimed_score_moments, clopper_pearson_upper,
                    epsilon_lower_bound, local_log_likelihood_ratio, local_power,
                    mixture_log_likelihood_ratio, sampled_offsets, sampled_score_moments,
                    score_grid, threshold_grid)
from .trials import (CANARY_MARGIN, GradientCanaryShard, _CanaryWorkerServer, _workers,
                     audit_scores, mechanism_run)

__all__ = ["AuditSpec", "GradientCanaryShard", "audit_scores", "claimed_score_moments",
           "clopper_pearson_upper", "epsilon_lower_bound", "gdp_audit",
           "local_log_likelihood_ratio", "mixture_log_likelihood_ratio", "naive_poisson_epsilon",
           "run_audit", "score_grid", "summary_line", "threshold_grid"]
# The audit's other names, defined in its parts and still importable from here (tests import the
# private three).
__all__ += ["CANARY_MARGIN", "LOCAL_STEPS", "_CanaryWorkerServer", "_local_loss_moments",
            "_workers"]

Progress = Callable[[str], None] | None
Scores = tuple[np.ndarray, np.ndarray]

#: The path the central trials take, by ``--path``.
_CENTRAL_PATHS = {
    "in-process": "Diff2Strategy.configure_fit -> Diff2Client.fit -> FitRes -> "
                  "Diff2Strategy.aggregate_fit",
    "flower": "a Flower simulation (flwr.simulation.run_simulation: InMemoryGrid, the Ray "
              "backend): the audit's ServerApp runs the real Diff2Strategy with start_grid, the "
              "audit's ClientApp the real Diff2Client; the messages are Flower's",
}


def _ledger_epsilon(spec: AuditSpec, calibration: Calibration) -> float:
    """ε of the whole schedule as a run's ledger composes it, round by round (the budget guard's
    number)."""
    ledger = PrivacyLedger(spec.delta)
    for r in range(1, spec.rounds + 1):
        ledger = ledger.record(*calibration.round_events((r - 1) % spec.period == 0))
    return ledger.epsilon


@dataclass
class _Findings:
    """What differs by regime in an audit's result: the claim, the tests and the regime's keys."""

    epsilon_claimed: float
    mu_claimed: float | None
    stats: dict  # epsilon_lower_bound's: the Clopper–Pearson ε̂ and its thresholds
    gdp: dict | None  # the μ-GDP test; None without a Gaussian trade-off
    power: dict
    scores: dict = field(default_factory=dict)  # after the scores' moments
    schedule: dict = field(default_factory=dict)  # over the common schedule (z's), then its own
    extra: dict = field(default_factory=dict)  # the result's keys after "noise"


@dataclass(frozen=True)
class _Regime:
    """One regime of the audit: its claimed calibration, its trials' scores and its findings (the
    distributed and local regimes run the trials of :func:`~.trials.audit_scores`)."""

    spec: AuditSpec

    def calibration(self) -> Calibration:
        """The calibration the trials run and the schedule reports."""
        return self.spec.calibration()

    def scores(self, calibration: Calibration, progress: Progress) -> Scores:
        """The LR scores of the trials on D and on D′."""
        return audit_scores(self.spec, progress, calibration)

    def findings(self, calibration: Calibration, d: np.ndarray, d_prime: np.ndarray) -> _Findings:
        """The claim and the tests of the scores."""
        raise NotImplementedError


@dataclass(frozen=True)
class _Central(_Regime):
    """dpgd and diff2 with the server's Gaussian noise: a μ-GDP claim, tested by Clopper–Pearson
    and μ-GDP; one run per trial, or B canaries per run (in-process or through Flower)."""

    run: AuditSpec  # the spec of one run: ``spec``, or with B canaries canary_spec's (its n, d)

    def calibration(self) -> Calibration:
        """The run's calibration (with B canaries, its n and d: the same claimed μ and ε)."""
        return self.run.calibration()

    def scores(self, calibration: Calibration, progress: Progress) -> Scores:
        """One run per trial, or B canaries per run in this process or in a Flower simulation."""
        if self.spec.canaries == 1:
            return audit_scores(self.spec, progress, calibration)
        if self.spec.path == "flower":
            return flower_canary_scores(self.spec, progress, calibration)
        return canary_scores(self.spec, progress, calibration)

    def findings(self, calibration: Calibration, d: np.ndarray, d_prime: np.ndarray) -> _Findings:
        """The claimed μ and its ε, both tests at level α/2."""
        mu = calibration.mu
        eps = calibration.epsilon_spent(calibration.restart_rounds, calibration.difference_rounds)
        stats, gdp = _gaussian_tests(self.spec, d, d_prime, eps, mu, mu)
        return _Findings(eps, mu, stats, gdp, gdp["power"],
                         scores={"mu_empirical": _mu_empirical(d, d_prime)}, extra=self._extra())

    def _extra(self) -> dict:
        extra: dict = {"path": _CENTRAL_PATHS[self.spec.path]}
        if self.spec.canaries > 1:
            extra["canaries"] = {
                "per_run": self.spec.canaries, "runs": canary_runs(self.spec),
                "records_per_client": self.run.samples, "dim": self.run.dim,
                "independence": "exact: each canary on its own axis, Gaussian noise independent "
                                "across coordinates, a fixed μ per round (canaries.py)"}
        return extra


@dataclass(frozen=True)
class _Distributed(_Regime):
    """``privacy.noise: distributed``: the Skellam ledger's ε, no μ-GDP claim; tested by
    Clopper–Pearson and μ-GDP around the schedule's Gaussian μ, at level α/2."""

    def findings(self, calibration: Calibration, d: np.ndarray, d_prime: np.ndarray) -> _Findings:
        """The Skellam ledger's ε, the tests around the Gaussian μ, the secure sum's settings."""
        spec = self.spec
        noise = spec.distributed_noise()
        mu = _gaussian_mu(noise)
        eps = SkellamLedger(spec.delta).record(*noise.calibration.events()).epsilon
        stats, gdp = _gaussian_tests(spec, d, d_prime, eps, mu, None)
        return _Findings(eps, None, stats, gdp, gdp["power"],
                         scores={"mu_empirical": _mu_empirical(d, d_prime), "mu_gaussian": mu},
                         schedule=_distributed_schedule(spec, noise), extra=_distributed_extra())


@dataclass(frozen=True)
class _Local(_Regime):
    """diff2-bvr: the ledger's ε (PLD), no Gaussian trade-off: the Clopper–Pearson bound alone, at
    level α, on thresholds around the claimed score's moments; the power simulated."""

    def findings(self, calibration: Calibration, d: np.ndarray, d_prime: np.ndarray) -> _Findings:
        """The ledger's ε, the Clopper–Pearson test, the local routine's calibration."""
        spec = self.spec
        eps = _ledger_epsilon(spec, calibration)
        mean, sd = claimed_score_moments(spec, calibration)
        stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha,
                                    thresholds=score_grid(mean, sd))
        power = local_power(spec, calibration, eps)
        # they assume a Gaussian trade-off
        stats["mu_lower_bound_gdp"] = stats["epsilon_lower_bound_gdp"] = None
        return _Findings(eps, None, stats, None, power,
                         scores={"mean_claimed": mean, "sd_claimed": sd},
                         schedule={"local": _local_schedule(spec, calibration.local)},
                         extra=_local_extra(spec, calibration, eps))


def naive_poisson_epsilon(spec: AuditSpec, calibration: Calibration) -> float:
    """ε of the same schedule by dp-accounting's ``REPLACE_ONE`` Poisson-subsampled Gaussian
    composition: what a record-level subsampling analysis would have claimed (not a valid bound for
    client sampling: :class:`~diff2_flwr.core.accounting.SampledGaussianEvent`).

    Each round is ``PoissonSampledDpEvent(π, GaussianDpEvent(2z))``: under ``REPLACE_ONE`` the
    accountant reads ``GaussianDpEvent(m)`` as one record moving the sum from −1 to +1 with noise
    std m (tests/test_local_privacy.py pins the reading), and our z is std over the whole move.
    """
    from dp_accounting import NeighboringRelation, dp_event  # noqa: PLC0415 -- dp-accounting: ~2 s import, on first use
    from dp_accounting.pld import pld_privacy_accountant  # noqa: PLC0415 -- see above

    from ...core.accounting import PLD_DISCRETIZATION  # noqa: PLC0415 -- with dp-accounting

    accountant = pld_privacy_accountant.PLDAccountant(
        NeighboringRelation.REPLACE_ONE, value_discretization_interval=PLD_DISCRETIZATION)
    pi = calibration.sampling_prob
    for z, count in ((calibration.z1, calibration.restart_rounds),
                     (calibration.z2, calibration.difference_rounds)):
        if count:
            assert z is not None
            accountant.compose(dp_event.PoissonSampledDpEvent(pi, dp_event.GaussianDpEvent(2 * z)),
                               count)
    return float(accountant.get_epsilon(spec.delta))


@dataclass(frozen=True)
class _Sampled(_Regime):
    """dpgd and diff2 with client sampling: the ledger's ε (PLD of the π-mixtures); the
    Clopper–Pearson bound on the mixture LR scores and the cohort test, each at level α/2; beside
    them the ε the naive REPLACE_ONE Poisson accounting would claim."""

    def findings(self, calibration: Calibration, d: np.ndarray, d_prime: np.ndarray) -> _Findings:
        """The ledger's ε, both tests, the naive ε and whether the bounds exceed it."""
        spec = self.spec
        eps = _ledger_epsilon(spec, calibration)
        mean, sd = sampled_score_moments(spec, calibration)
        stats = epsilon_lower_bound(d[:, 0], d_prime[:, 0], delta=spec.delta, alpha=spec.alpha / 2,
                                    thresholds=score_grid(mean, sd))
        stats["mu_lower_bound_gdp"] = stats["epsilon_lower_bound_gdp"] = None
        schedule = (calibration.restart_rounds, calibration.z1, calibration.difference_rounds,
                    calibration.z2, calibration.sampling_prob)
        cohort = cohort_gdp_audit(d[:, 1:], d_prime[:, 1:], epsilon_claimed=eps, delta=spec.delta,
                                  a=spec.alpha / 2, schedule=schedule, rounds=spec.rounds)
        naive = naive_poisson_epsilon(spec, calibration)
        return _Findings(eps, None, stats, cohort, cohort["power"],
                         scores={"mean_claimed": mean, "sd_claimed": sd},
                         schedule={"sampling": _sampling_schedule(spec, calibration)},
                         extra=_sampled_extra(stats["epsilon_lower_bound"], cohort, naive))


def _sampling_schedule(spec: AuditSpec, calibration: Calibration) -> dict:
    """A sampled audit's cohort rule and how far the canary client's records put it (in noise
    std)."""
    sampling = calibration.sampling
    assert sampling is not None
    offsets = {kind: sampled_offsets(z, spec.samples)[0]
               for kind, z in (("restart", calibration.z1), ("difference", calibration.z2)) if z}
    return {"kind": sampling.kind, "rate": sampling.rate, "size": sampling.size,
            "probability": calibration.sampling_prob,
            "expected_cohort": sampling.expected_cohort(spec.clients),
            "canary_client_offset_in_noise_std": offsets,
            "cohort": "drawn by the server from each trial's own key; worker 0 (the canary's "
                      "client) is drawn like any other, never forced"}


def _sampled_extra(cp_bound: float, cohort: dict, naive: float) -> dict:
    """What a sampled audit adds: the accountant of ε claimed, the naive ε, and whether each test's
    lower bound exceeds it."""
    cohort_bound = cohort["epsilon_interval"][0] if cohort["applicable"] else None
    return {
        "epsilon_claimed_accountant": "the run's ledger: dp-accounting PLD of the client-sampled "
                                      "rounds (SampledGaussianEvent: π·Gaussian + (1 − π)·no "
                                      "loss), round by round",
        "epsilon_naive_poisson": naive,
        "epsilon_naive_poisson_accountant": "dp-accounting PLDAccountant(REPLACE_ONE), "
                                            "PoissonSampledDpEvent(π, GaussianDpEvent(2z)) per "
                                            "round: record-level subsampling, not valid here",
        "naive_refuted": {"clopper_pearson": bool(cp_bound > naive),
                          "cohort": bool(cohort_bound is not None and cohort_bound > naive),
                          "clopper_pearson_bound": cp_bound, "cohort_bound": cohort_bound},
        "path": "Diff2Strategy.configure_fit (the server's cohort; get_properties once per node) "
                "-> Diff2Client.fit (the cohort only) -> FitRes -> Diff2Strategy.aggregate_fit",
    }


def _regime(spec: AuditSpec) -> _Regime:
    """The regime ``spec`` audits."""
    if spec.sampled:
        return _Sampled(spec)
    if spec.distributed:
        return _Distributed(spec)
    if spec.local:
        return _Local(spec)
    return _Central(spec, canary_spec(spec) if spec.canaries > 1 else spec)


def run_audit(spec: AuditSpec, progress: Progress = None) -> dict:
    """Run the audit; return the JSON-able result (see the module docstring for what it means)."""
    started = time.perf_counter()
    regime = _regime(spec)
    calibration = regime.calibration()
    d, d_prime = regime.scores(calibration, progress)
    found = regime.findings(calibration, d, d_prime)
    result = _result(spec, calibration, (d, d_prime), found)
    result["wall_time_s"] = time.perf_counter() - started
    return _verdict(result, found)


def _result(spec: AuditSpec, calibration: Calibration, scores: Scores, found: _Findings) -> dict:
    """The result's keys in their order, before the verdict."""
    stats = dict(found.stats)
    return {
        "epsilon_lower_bound": stats.pop("epsilon_lower_bound"),
        "epsilon_claimed": found.epsilon_claimed,
        "ratio": None,
        "violation": None,
        "trials": spec.trials,
        "runs": 2 * spec.trials if spec.canaries == 1 else found.extra["canaries"]["runs"],
        "delta": spec.delta,
        "confidence": 1 - spec.alpha,
        "method": spec.method,
        "noise_mode": spec.noise,
        "schedule": {**_schedule(spec, calibration), **found.schedule},
        "mu_claimed": found.mu_claimed,
        "scores": {**_moments(*(s if s.ndim == 1 else s[:, 0] for s in scores)), **found.scores},
        "gdp": found.gdp,
        "clopper_pearson": {"level": spec.alpha / 2 if found.gdp else spec.alpha,
                            "violation": None, "fraction_of_claimed_epsilon": None},
        **stats,
        "noise": "seeded (reproducible)" if spec.seed is not None else "os-entropy key per run",
        **found.extra,
        "spec": asdict(spec),
    }


def _verdict(result: dict, found: _Findings) -> dict:
    """``result`` with the ratio, each test's verdict, the overall one, and the power."""
    result["ratio"] = result["epsilon_lower_bound"] / found.epsilon_claimed
    cp_violation = bool(result["epsilon_lower_bound"] > found.epsilon_claimed)
    result["clopper_pearson"].update(violation=cp_violation,
                                     fraction_of_claimed_epsilon=result["ratio"])
    gdp_violation = bool(found.gdp and found.gdp["violation"])
    result["violation_by"] = [name for name, hit in (("clopper_pearson", cp_violation),
                                                     ("gdp", gdp_violation)) if hit]
    result["violation"] = bool(result["violation_by"])
    result["power"] = found.power
    return result


def _schedule(spec: AuditSpec, calibration: Calibration) -> dict:
    """The schedule every regime reports (the distributed one replaces the z's)."""
    return {"rounds": spec.rounds, "restart_every": spec.period,
            "restart_rounds": calibration.restart_rounds,
            "difference_rounds": calibration.difference_rounds, "z1": calibration.z1,
            "z2": calibration.z2, "noise_scale": spec.noise_scale}


def _moments(d: np.ndarray, d_prime: np.ndarray) -> dict:
    """The scores' means and standard deviations on D and D′."""
    return {"mean_d": float(np.mean(d)), "mean_d_prime": float(np.mean(d_prime)),
            "sd_d": float(np.std(d, ddof=1)), "sd_d_prime": float(np.std(d_prime, ddof=1))}


def _mu_empirical(d: np.ndarray, d_prime: np.ndarray) -> float:
    """(mean_D − mean_D′) / s_pooled: the scores' μ if they are Gaussian."""
    pooled_sd = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    return float((np.mean(d) - np.mean(d_prime)) / pooled_sd)


def _gaussian_tests(spec: AuditSpec, d: np.ndarray, d_prime: np.ndarray, eps: float,
                    mu_run: float, mu_claimed: float | None) -> tuple[dict, dict]:
    """Both tests of a Gaussian mechanism, each at level α/2: Clopper–Pearson on thresholds around
    ``mu_run``, and μ-GDP."""
    stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha / 2,
                                thresholds=threshold_grid(mu_run))
    gdp = gdp_audit(d, d_prime, epsilon_claimed=eps, delta=spec.delta, a=spec.alpha / 2,
                    mu_run=mu_run, mu_claimed=mu_claimed)
    return stats, gdp


def _distributed_schedule(spec: AuditSpec, noise: DistributedNoise) -> dict:
    """A distributed-noise audit's schedule: the Skellam calibration's z's and the secure sum."""
    return {"z1": noise.calibration.z1, "z2": noise.calibration.z2,
            "distributed": {"bits": noise.bits, "tolerated": noise.tolerated,
                            "survivors": noise.threshold, "wrap": noise.wrap,
                            "rho": noise.calibration.rho,
                            "padded_dim": noise.calibration.padded_dim,
                            "noise_scale": f"{spec.noise_scale} x every client's share std"}}


def _distributed_extra() -> dict:
    """What a distributed-noise audit's result adds: the accountant of ε claimed and the path."""
    return {"epsilon_claimed_accountant": "the run's SkellamLedger (Corollary 3.6 RDP, composed; "
                                          "dp-accounting's RDP to (ε, δ))",
            "path": "Diff2Strategy.configure_fit -> Diff2Client.fit (noise=: encode_share) -> "
                    "SecAgg+'s unmasked mean (exact) -> Diff2Strategy.aggregate_fit "
                    "(decode_secure_sum -> Diff2Server.release_sum)"}


def summary_line(result: dict) -> str:
    """The audit's verdict in one line for a person: both estimates, the claim, and the power."""
    verdict = "VIOLATION" if result["violation"] else "no violation"
    how = ""
    if result.get("canaries"):
        canaries = result["canaries"]
        how = f", {canaries['per_run']} canaries per run, {canaries['runs']} runs"
    if result["spec"].get("path") == "flower":
        how += ", through a Flower simulation"
    text = (f"diff2 audit ({result['method']}, {result['noise_mode']}, {result['trials']} "
            f"trials{how}): {verdict} of claimed ε = {result['epsilon_claimed']:.4g} (δ = "
            f"{result['delta']:g}); Clopper–Pearson ε̂ >= {result['epsilon_lower_bound']:.3g}")
    gdp = result["gdp"]
    if gdp and gdp.get("test") == "cohort":
        lo, hi = gdp["mu_interval"]
        e_lo, e_hi = gdp["epsilon_interval"]
        text += (f"; cohort test ρ̂ = {gdp['mu']:.4g} [{lo:.4g}, {hi:.4g}] of the claimed μ's, "
                 f"ε̂ = {gdp['epsilon']:.3g} [{e_lo:.3g}, {e_hi:.3g}] "
                 f"({gdp['fraction_of_claimed_epsilon']:.0%} of the claim)"
                 + ("" if gdp["applicable"] else " NOT APPLICABLE: Gaussian checks rejected")
                 + f"; naive REPLACE_ONE Poisson ε = {result['epsilon_naive_poisson']:.3g}")
    elif gdp:
        lo, hi = gdp["mu_interval"]
        e_lo, e_hi = gdp["epsilon_interval"]
        text += (f"; μ-GDP μ̂ = {gdp['mu']:.4g} [{lo:.4g}, {hi:.4g}], ε̂ = {gdp['epsilon']:.3g} "
                 f"[{e_lo:.3g}, {e_hi:.3g}] ({gdp['fraction_of_claimed_epsilon']:.0%} of the "
                 "claim)"
                 + ("" if gdp["applicable"] else " NOT APPLICABLE: Gaussian checks rejected"))
    text += (f"; overall confidence {result['confidence']:.2%}; power: "
             f"{result['power']['statement']}")
    return text


def _gaussian_mu(noise: DistributedNoise) -> float:
    """(Σ_r 1/z_r²)^½: the μ of the schedule were its noise Gaussian of std z_r Δ₂ (rounding aside,
    Δ₂ is the record's integer sensitivity), around which the audit's thresholds are fixed."""
    cal = noise.calibration
    return math.sqrt(cal.restart_rounds / cal.z1**2
                     + (cal.difference_rounds / cal.z2**2 if cal.z2 else 0.0))


def _local_schedule(spec: AuditSpec, local: LocalCalibration) -> dict:
    """The local routine's part of a diff2-bvr audit's ``schedule``: its calibration and the forced
    worker."""
    return {"steps": local.steps, "batch_size": local.batch_size,
            "sampling_prob": local.sampling_prob, "share": local.share, "z3": local.z3,
            "sigma3": local.sigma3, "clip": spec.local_clip, "noise_scale": spec.local_noise_scale,
            "worker": "0, forced (the canary's worker; a run draws it uniformly)"}


def _local_extra(spec: AuditSpec, calibration: Calibration, eps_claimed: float) -> dict:
    """What a diff2-bvr audit's result adds: the accountant of ε claimed, the planned ε, the ε of
    the mechanism the trials ran (by the same ledger) and the path the trials took."""
    run = mechanism_run(spec, calibration)
    return {
        "epsilon_claimed_accountant": "the run's ledger: dp-accounting PLD, round by round (server "
                                      "Gaussian, then the local step's replace-one "
                                      "Poisson-subsampled Gaussian)",
        "epsilon_planned": calibration.planned_epsilon,
        # what the trials actually ran, by the same ledger: ε̂ must not exceed it either (the
        # audit's own check)
        "epsilon_of_mechanism_run": (eps_claimed if run is calibration
                                     else _ledger_epsilon(spec, run)),
        "path": "Diff2Server.plan -> Worker.reply -> Diff2Server.release -> Worker.local_phase "
                "(worker 0) -> Diff2Server.finish_local (the in-process driver's calls)",
    }


def stderr_progress(message: str) -> None:
    """A progress line on stderr (``diff2 audit`` without ``--quiet``)."""
    print(message, file=sys.stderr, flush=True)
