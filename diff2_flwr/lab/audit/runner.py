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
divided by the fixed b, plus N(0, (σ3 c)² I) with c = C3‖y_1 − y_0‖ — and returns y_2, released as x_r.
The audit forces worker 0, the canary's, to be that worker (:class:`_CanaryWorkerServer`; a run draws
it uniformly, and the ledger charges every record every local phase, so this is the worst case the
analysis covers). The canary's gradient difference clips onto ±c·e, so along e the local step's
output (w_1 − ṽ_r, recovered exactly from the released x_{r−1}, ṽ_r, x_r since y_1 = x_{r−1} − ηṽ_r
and x_r = y_1 − η w_1) is (1 − q) N(0, s²) + q N(±c/b, s²): exactly dp-accounting's replace-one
Poisson-subsampled Gaussian pair, which the ledger composes. Poisson sampling makes the two
federations' outputs share the (1 − q) mass of "canary not sampled": the linear statistic loses power
and the likelihood ratio is the mixtures', added to the server rounds' (:func:`local_log_likelihood_ratio`).
The claimed ε is the run's own ledger (dp-accounting PLD, round by round) for the same calibration.

**Distributed noise** (``--noise distributed``, ``privacy.noise: distributed``): each client clips its mean as in
central mode and sends it encoded with its share of Skellam noise, of variance (zΔ₂)²/(P − t) (rotation, conditional
randomised rounding, mod 2**bits: :class:`~diff2_flwr.core.distributed.DistributedNoise`); the server sees only the
modular sum and decodes it (:meth:`~diff2_flwr.runtime.server.Diff2Server.release_sum`). Each trial runs the real
Strategy and the real clients with ``noise=`` (``fit`` -> ``encode_share``); SecAgg+'s masking is exact on these
messages (:mod:`~diff2_flwr.fl.secagg`, tested against Flower's own arithmetic in tests/test_secagg.py), so the audit
hands ``aggregate_fit`` the unmasked mean SecAgg+ would, and the server decodes it (``decode_secure_sum``). With
``--tolerated t`` the last t clients drop out of every round, so that the sum carries exactly the P − t shares the
analysis counts on (a colluder's known share is the same loss of noise). The score is the statistic above with
s_r the released round's ``noise_std`` (the std of the decoded mean's noise) and Δ_r = 2 C_r/(n k), k the survivors:
for Skellam noise it is the Gaussian-optimal test, not the exact likelihood ratio, which costs power but not
validity (any test's error rates give a lower bound). Its thresholds are :func:`threshold_grid` at the schedule's
Gaussian μ = (Σ_r 1/z_r²)^½. The claimed ε is the run's Skellam ledger for the schedule (Corollary 3.6 RDP,
composed). ``--noise-scale`` scales every client's share std (not the server's ledger or decoding).

Turning scores into a bound: for a threshold t ("guess D iff S > t"), an (ε, δ)-DP mechanism
has FPR + e^ε FNR ≥ 1 − δ and FNR + e^ε FPR ≥ 1 − δ. With one-sided Clopper–Pearson upper
bounds on FPR and FNR (each at level α/2, so both hold with probability ≥ 1 − α) this gives

    ε̂ = max(ln((1 − δ − FPR⁺)/FNR⁺), ln((1 − δ − FNR⁺)/FPR⁺), 0),

a lower bound on the true ε with confidence 1 − α. The thresholds form a grid fixed before
the trials (in units of the claimed μ) and ε̂ is the best over the grid with a Bonferroni
correction, so choosing the best threshold does not bias the interval. If ε̂ > ε claimed, the
claimed guarantee is false (at confidence 1 − α).

The tight estimate (:mod:`.gdp`): the canary is clipped onto the radius in every round and the score sums
every round's likelihood-ratio term, so the audited quantity is the whole run's guarantee, μ = (Σ_r 1/z_r²)^½, not a
part of it. For the Gaussian mechanisms (dpgd, diff2, and distributed noise as its Gaussian equivalent) the scores
are normal with one variance under D and D′ and means μ_true standard deviations apart, whatever noise the server
really adds: μ̂ = (mean_D − mean_D′)/s_pooled, with a noncentral-t interval, gives ε̂(δ) by the exact μ-GDP
conversion. A calibrated mechanism gives μ̂ ≈ μ claimed (about 100 % of the claim, where the Clopper–Pearson bound
reaches about 40 % at 10⁴ trials), and the power at the trial count is exact under the same assumption. The audit
flags a violation if either test refutes the claim: the Clopper–Pearson bound above and the μ-GDP lower bound, each
at level α/2 (α = 0.001 by default: a correct mechanism is reported as a violation at most once in a thousand
audits), the μ-GDP test only when the Gaussian checks do not reject its assumption. diff2-bvr (Poisson-subsampled
local steps: no Gaussian trade-off) has the Clopper–Pearson bound alone, at level α.

The audit is made in parts: the federations and the trials through the production path
(:mod:`.trials`), and the statistics that turn their scores into ε̂ (:mod:`.stats`: Clopper–Pearson;
:mod:`.gdp`: μ-GDP and power). This
module runs an audit and reports it; every name of the audit is importable from here.

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
from dataclasses import asdict
from typing import Callable

import numpy as np

from ...core.distributed import DistributedNoise, SkellamLedger
from ...core.privacy import Calibration, LocalCalibration, PrivacyLedger
from .gdp import gdp_audit
from .spec import LOCAL_STEPS, AuditSpec
from .stats import (_local_loss_moments, claimed_score_moments, clopper_pearson_upper, epsilon_lower_bound,
                          local_log_likelihood_ratio, local_power, score_grid, threshold_grid)
from .trials import CANARY_MARGIN, GradientCanaryShard, _CanaryWorkerServer, _workers, audit_scores, mechanism_run

__all__ = ["AuditSpec", "GradientCanaryShard", "audit_scores", "claimed_score_moments", "clopper_pearson_upper",
           "epsilon_lower_bound", "gdp_audit", "local_log_likelihood_ratio", "run_audit", "score_grid",
           "summary_line", "threshold_grid"]
# The audit's other names, defined in its parts and still importable from here (tests import the private three).
__all__ += ["CANARY_MARGIN", "LOCAL_STEPS", "_CanaryWorkerServer", "_local_loss_moments", "_workers"]


def _ledger_epsilon(spec: AuditSpec, calibration: Calibration) -> float:
    """ε of the whole schedule as a run's ledger composes it, round by round (the budget guard's number)."""
    ledger = PrivacyLedger(spec.delta)
    for r in range(1, spec.rounds + 1):
        ledger = ledger.record(*calibration.round_events((r - 1) % spec.period == 0))
    return ledger.epsilon


def run_audit(spec: AuditSpec, progress: Callable[[str], None] | None = None) -> dict:
    """Run the audit; return the JSON-able result (see the module docstring for what it means)."""
    started = time.perf_counter()
    canary_run = None
    if spec.canaries > 1:  # B canaries per run (canaries.py); the run's n and d, the same claimed μ and ε
        from .canaries import canary_runs, canary_scores, canary_spec

        canary_run = canary_spec(spec)
        calibration = canary_run.calibration()
        if spec.path == "flower":
            from .flower import flower_canary_scores

            d, d_prime = flower_canary_scores(spec, progress, calibration)
        else:
            d, d_prime = canary_scores(spec, progress, calibration)
    else:
        calibration = spec.calibration()
        d, d_prime = audit_scores(spec, progress, calibration)
    m1, m2 = calibration.restart_rounds, calibration.difference_rounds
    schedule = {"rounds": spec.rounds, "restart_every": spec.period, "restart_rounds": m1, "difference_rounds": m2,
                "z1": calibration.z1, "z2": calibration.z2, "noise_scale": spec.noise_scale}
    pooled_sd = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    scores = {"mean_d": float(np.mean(d)), "mean_d_prime": float(np.mean(d_prime)),
              "sd_d": float(np.std(d, ddof=1)), "sd_d_prime": float(np.std(d_prime, ddof=1))}
    if spec.distributed:
        noise = spec.distributed_noise()
        mu_claimed = None  # Skellam RDP, not a μ-GDP claim
        mu_gaussian = _gaussian_mu(noise)
        eps_claimed = SkellamLedger(spec.delta).record(*noise.calibration.events()).epsilon
        stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha / 2,
                                    thresholds=threshold_grid(mu_gaussian))
        gdp = gdp_audit(d, d_prime, epsilon_claimed=eps_claimed, delta=spec.delta, a=spec.alpha / 2,
                        mu_run=mu_gaussian, mu_claimed=None)
        power = gdp["power"]
        scores.update({"mu_empirical": float((np.mean(d) - np.mean(d_prime)) / pooled_sd),
                       "mu_gaussian": mu_gaussian})
        schedule.update({"z1": noise.calibration.z1, "z2": noise.calibration.z2})
        schedule["distributed"] = {"bits": noise.bits, "tolerated": noise.tolerated, "survivors": noise.threshold,
                                   "wrap": noise.wrap, "rho": noise.calibration.rho,
                                   "padded_dim": noise.calibration.padded_dim,
                                   "noise_scale": f"{spec.noise_scale} x every client's share std"}
        extra = {"epsilon_claimed_accountant": "the run's SkellamLedger (Corollary 3.6 RDP, composed; dp-accounting's "
                                               "RDP to (ε, δ))",
                 "path": "Diff2Strategy.configure_fit -> Diff2Client.fit (noise=: encode_share) -> SecAgg+'s unmasked "
                         "mean (exact) -> Diff2Strategy.aggregate_fit (decode_secure_sum -> Diff2Server.release_sum)"}
    elif calibration.local is None:
        mu_claimed = calibration.mu
        eps_claimed = calibration.epsilon_spent(m1, m2)
        stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha / 2,
                                    thresholds=threshold_grid(mu_claimed))
        gdp = gdp_audit(d, d_prime, epsilon_claimed=eps_claimed, delta=spec.delta, a=spec.alpha / 2,
                        mu_run=mu_claimed, mu_claimed=mu_claimed)
        power = gdp["power"]
        scores["mu_empirical"] = float((np.mean(d) - np.mean(d_prime)) / pooled_sd)
        extra: dict = {"path": "Diff2Strategy.configure_fit -> Diff2Client.fit -> FitRes -> "
                               "Diff2Strategy.aggregate_fit"}
        if spec.path == "flower":
            extra["path"] = ("a Flower simulation (flwr.simulation.run_simulation: InMemoryGrid, the Ray backend): "
                             "the audit's ServerApp runs the real Diff2Strategy with start_grid, the audit's "
                             "ClientApp the real Diff2Client; the messages are Flower's")
        if canary_run is not None:
            extra["canaries"] = {"per_run": spec.canaries, "runs": canary_runs(spec),
                                 "records_per_client": canary_run.samples, "dim": canary_run.dim,
                                 "independence": "exact: each canary on its own axis, Gaussian noise independent "
                                                 "across coordinates, a fixed μ per round (canaries.py)"}
    else:
        mu_claimed = None  # a subsampled mechanism has no μ-GDP trade-off curve
        eps_claimed = _ledger_epsilon(spec, calibration)
        mean, sd = claimed_score_moments(spec, calibration)
        stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha, thresholds=score_grid(mean, sd))
        gdp = None  # a subsampled mechanism has no Gaussian trade-off: the Clopper–Pearson bound alone, at level α
        power = local_power(spec, calibration, eps_claimed)
        stats["mu_lower_bound_gdp"] = stats["epsilon_lower_bound_gdp"] = None  # they assume a Gaussian trade-off
        scores.update({"mean_claimed": mean, "sd_claimed": sd})
        schedule["local"] = _local_schedule(spec, calibration.local)
        extra = _local_extra(spec, calibration, eps_claimed)
    result = {
        "epsilon_lower_bound": stats.pop("epsilon_lower_bound"),
        "epsilon_claimed": eps_claimed,
        "ratio": None,
        "violation": None,
        "trials": spec.trials,
        "runs": 2 * spec.trials if spec.canaries == 1 else extra["canaries"]["runs"],
        "delta": spec.delta,
        "confidence": 1 - spec.alpha,
        "method": spec.method,
        "noise_mode": spec.noise,
        "schedule": schedule,
        "mu_claimed": mu_claimed,
        "scores": scores,
        "gdp": gdp,
        "clopper_pearson": {"level": spec.alpha / 2 if gdp else spec.alpha,
                            "violation": None, "fraction_of_claimed_epsilon": None},
        **stats,
        "noise": "seeded (reproducible)" if spec.seed is not None else "os-entropy key per run",
        **extra,
        "spec": asdict(spec),
        "wall_time_s": time.perf_counter() - started,
    }
    result["ratio"] = result["epsilon_lower_bound"] / eps_claimed
    cp_violation = bool(result["epsilon_lower_bound"] > eps_claimed)
    result["clopper_pearson"].update(violation=cp_violation, fraction_of_claimed_epsilon=result["ratio"])
    result["violation_by"] = [name for name, hit in (("clopper_pearson", cp_violation),
                                                     ("gdp", bool(gdp and gdp["violation"]))) if hit]
    result["violation"] = bool(result["violation_by"])
    result["power"] = power
    return result


def summary_line(result: dict) -> str:
    """The audit's verdict in one line for a person: both estimates, the claim, and the power."""
    verdict = "VIOLATION" if result["violation"] else "no violation"
    how = ""
    if result.get("canaries"):
        how = f", {result['canaries']['per_run']} canaries per run, {result['canaries']['runs']} runs"
    if result["spec"].get("path") == "flower":
        how += ", through a Flower simulation"
    text = (f"diff2 audit ({result['method']}, {result['noise_mode']}, {result['trials']} trials{how}): {verdict} of "
            f"claimed ε = {result['epsilon_claimed']:.4g} (δ = {result['delta']:g}); Clopper–Pearson ε̂ >= "
            f"{result['epsilon_lower_bound']:.3g}")
    gdp = result["gdp"]
    if gdp:
        lo, hi = gdp["mu_interval"]
        e_lo, e_hi = gdp["epsilon_interval"]
        text += (f"; μ-GDP μ̂ = {gdp['mu']:.4g} [{lo:.4g}, {hi:.4g}], ε̂ = {gdp['epsilon']:.3g} [{e_lo:.3g}, "
                 f"{e_hi:.3g}] ({gdp['fraction_of_claimed_epsilon']:.0%} of the claim)"
                 + ("" if gdp["applicable"] else " NOT APPLICABLE: Gaussian checks rejected"))
    text += f"; overall confidence {result['confidence']:.2%}; power: {result['power']['statement']}"
    return text


def _gaussian_mu(noise: DistributedNoise) -> float:
    """(Σ_r 1/z_r²)^½: the μ of the schedule were its noise Gaussian of std z_r Δ₂ (rounding aside, Δ₂ is the
    record's integer sensitivity), around which the audit's thresholds are fixed."""
    cal = noise.calibration
    return math.sqrt(cal.restart_rounds / cal.z1**2 + (cal.difference_rounds / cal.z2**2 if cal.z2 else 0.0))


def _local_schedule(spec: AuditSpec, local: LocalCalibration) -> dict:
    """The local routine's part of a diff2-bvr audit's ``schedule``: its calibration and the forced worker."""
    return {"steps": local.steps, "batch_size": local.batch_size, "sampling_prob": local.sampling_prob,
            "share": local.share, "z3": local.z3, "sigma3": local.sigma3, "clip": spec.local_clip,
            "noise_scale": spec.local_noise_scale,
            "worker": "0, forced (the canary's worker; a run draws it uniformly)"}


def _local_extra(spec: AuditSpec, calibration: Calibration, eps_claimed: float) -> dict:
    """What a diff2-bvr audit's result adds: the accountant of ε claimed, the planned ε, the ε of the mechanism the
    trials ran (by the same ledger) and the path the trials took."""
    run = mechanism_run(spec, calibration)
    return {
        "epsilon_claimed_accountant": "the run's ledger: dp-accounting PLD, round by round (server Gaussian, "
                                      "then the local step's replace-one Poisson-subsampled Gaussian)",
        "epsilon_planned": calibration.planned_epsilon,
        # what the trials actually ran, by the same ledger: ε̂ must not exceed it either (the audit's own check)
        "epsilon_of_mechanism_run": eps_claimed if run is calibration else _ledger_epsilon(spec, run),
        "path": "Diff2Server.plan -> Worker.reply -> Diff2Server.release -> Worker.local_phase (worker 0) -> "
                "Diff2Server.finish_local (the in-process driver's calls)",
    }


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
