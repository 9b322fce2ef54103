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

Turning scores into a bound: for a threshold t ("guess D iff S > t"), an (ε, δ)-DP mechanism
has FPR + e^ε FNR ≥ 1 − δ and FNR + e^ε FPR ≥ 1 − δ. With one-sided Clopper–Pearson upper
bounds on FPR and FNR (each at level α/2, so both hold with probability ≥ 1 − α) this gives

    ε̂ = max(ln((1 − δ − FPR⁺)/FNR⁺), ln((1 − δ − FNR⁺)/FPR⁺), 0),

a lower bound on the true ε with confidence 1 − α. The thresholds form a grid fixed before
the trials (in units of the claimed μ) and ε̂ is the best over the grid with a Bonferroni
correction, so choosing the best threshold does not bias the interval. If ε̂ > ε claimed, the
claimed guarantee is false (at confidence 1 − α).

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
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from typing import Callable, Sequence

import numpy as np
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from scipy.special import ndtri
from scipy.stats import beta

from ..core.clipping import clipped_sum
from ..core.estimator import Mechanism, difference_radius
from ..core.gradients import Contribution
from ..core.layout import ParameterLayout
from ..core.local import LocalMechanism
from ..core.privacy import Calibration, PrivacyLedger, gdp_epsilon
from ..core.routines import make_routine
from ..fl import protocol
from ..fl.client import Diff2Client
from ..fl.strategy import Diff2Strategy
from ..runtime.session import Diff2Server, Worker
from ..task.records import TensorRecords
from .audit_spec import LOCAL_STEPS, AuditSpec

__all__ = ["AuditSpec", "GradientCanaryShard", "audit_scores", "claimed_score_moments", "clopper_pearson_upper",
           "epsilon_lower_bound", "local_log_likelihood_ratio", "run_audit", "score_grid", "threshold_grid"]

# ------------------------------------------------------------------------- the federation

#: |canary gradient| / clipping radius is at least this (checked every round): it is always clipped.
CANARY_MARGIN = 1e6


class GradientCanaryShard:
    """A worker's records as per-sample gradient functions; drop-in for ``PerSampleGradients``.

    Benign record i has the loss ½ Σ_j a_ij x_j² + b_ij x_j on coordinates j ≥ 1 (so its
    gradient difference is a_i ⊙ (x_{r−1} − x_{r−2})); coordinate 0 is the canary axis e. With
    ``canary = ±1`` record 0 is the canary: gradient and gradient difference ``canary·K·e``,
    K = CANARY_MARGIN × the round's radius. ClippedMean is the core's (``clipped_sum``). The
    features passed in carry each record's index (column 0), so a minibatch of the local steps
    holds exactly the records it names: the canary only when record 0 was sampled.
    """

    def __init__(self, a: np.ndarray, b: np.ndarray, canary: int) -> None:
        if a.shape != b.shape or a.ndim != 2 or np.any(a[:, 0] != 0) or np.any(b[:, 0] != 0):
            raise ValueError("benign records must be [n, d] arrays with a zero canary coordinate")
        self.a, self.b, self.canary = a, b, canary
        self.layout = ParameterLayout(("w",), ((a.shape[1],),))
        self.dtype = torch.float64

    def rows(self, radius: float, x_current: np.ndarray, x_previous: np.ndarray | None) -> np.ndarray:
        if x_previous is None:
            rows = self.a * x_current + self.b
        else:
            rows = self.a * (x_current - x_previous)
        if self.canary:
            rows[0] = 0.0
            rows[0, 0] = self.canary * CANARY_MARGIN * max(radius, 1.0)
        return rows

    def clipped_mean(self, x_current: np.ndarray, features: torch.Tensor, targets: torch.Tensor, radius: float,
                     x_previous: np.ndarray | None = None) -> Contribution:
        index = features[:, 0].to(torch.int64).numpy()
        rows = torch.from_numpy(self.rows(radius, x_current, x_previous)[index])
        part = clipped_sum(rows, radius)
        return Contribution(mean=(part.total / part.count).numpy(), num_samples=part.count, num_clipped=part.clipped)


def _benign(spec: AuditSpec) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed benign records (the same in D and D′, known to the auditor)."""
    rng = np.random.default_rng(20230723)  # data, not noise: fixed on purpose
    out = []
    for _ in range(spec.clients):
        a = rng.uniform(0.5, 2.0, (spec.samples, spec.dim))
        b = rng.normal(0.0, 1.0, (spec.samples, spec.dim))
        a[:, 0] = b[:, 0] = 0.0
        out.append((a, b))
    return out


def _workers(spec: AuditSpec, canary: int) -> list[Worker]:
    index = torch.arange(spec.samples, dtype=torch.float64)[:, None]  # record i's only feature is i
    records = TensorRecords(index, torch.zeros(spec.samples, dtype=torch.float64))
    return [Worker(p, GradientCanaryShard(a, b, canary if p == 0 else 0), records)
            for p, (a, b) in enumerate(_benign(spec))]


# ------------------------------------------------------------------------- one trial

class _Proxy:
    """Stands in for a ``ClientProxy``: the strategy reads only ``cid``."""

    def __init__(self, cid: str) -> None:
        self.cid = cid


class _Manager:
    """Stands in for a ``ClientManager`` with all P workers connected."""

    def __init__(self, proxies: dict[str, _Proxy]) -> None:
        self.proxies = proxies

    def wait_for(self, num_clients: int, timeout: int) -> bool:
        return len(self.proxies) >= num_clients

    def all(self) -> dict[str, _Proxy]:
        return self.proxies


def _trial(spec: AuditSpec, calibration: Calibration, workers: Sequence[Worker], seed: int | None) -> float:
    """One run of the schedule through the real Strategy; the LR score of what it released."""
    mechanism = Mechanism(
        restart_every=spec.period, clip_restart=spec.clip_restart, clip_diff=spec.clip_diff,
        sigma_restart=calibration.sigma1 * spec.noise_scale,
        sigma_diff=(calibration.sigma2 or 0.0) * spec.noise_scale,
    )
    layout = workers[0].gradients.layout
    server = Diff2Server(mechanism=mechanism, routine=make_routine("gd", learning_rate=spec.learning_rate),
                         layout=layout, x0=np.zeros(spec.dim), rounds=spec.rounds, clients=spec.clients,
                         n_min=spec.samples, seed=seed, progress=None,
                         # A mechanism broken on purpose (noise_scale != 1) is not the calibrated one: the server
                         # refuses to account it as such, so it runs unaccounted (the audit's bound uses `claimed`).
                         calibration=calibration if spec.noise_scale == 1.0 else None)
    strategy = Diff2Strategy(server=server)
    proxies = {f"node-{1000 + p}": _Proxy(f"node-{1000 + p}") for p in range(spec.clients)}
    manager = _Manager(proxies)
    clients = {cid: Diff2Client(w) for cid, w in zip(proxies, workers)}
    claimed = {True: calibration.sigma1, False: calibration.sigma2}
    sensitivity_per_radius = 2.0 / (spec.samples * spec.clients)
    score, v_prev = 0.0, np.zeros(spec.dim)
    for rnd in range(1, spec.rounds + 1):
        instructions = strategy.configure_fit(rnd, None, manager)  # type: ignore[arg-type]
        results = []
        for proxy, ins in instructions:
            arrays, n, metrics = clients[proxy.cid].fit(parameters_to_ndarrays(ins.parameters), ins.config)
            results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)))
        strategy.aggregate_fit(rnd, results, [])
        # what the adversary sees: the announced radius and kind, and the released ṽ_r
        config = instructions[0][1].config
        restart, radius = config[protocol.KIND] == "restart", float(config[protocol.RADIUS])
        if radius >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: radius {radius:g} too large for the canary to be clipped")
        v = server.state.v
        increment = v if restart else v - v_prev
        if radius > 0:  # radius 0: nothing depends on the data, nothing to score
            s = claimed[restart] * radius
            score += sensitivity_per_radius * radius / s**2 * float(increment[0])
        v_prev = v
    if server.state.round != spec.rounds:  # pragma: no cover - release() raises before this
        raise RuntimeError("the audited run stopped early")
    return score


class _CanaryWorkerServer(Diff2Server):
    """The production server with one change: worker 0, which holds the canary, runs every local phase.

    A run draws p_r uniformly (:meth:`Diff2Server.local_worker`); its ledger charges every record every local
    phase whichever worker ran it, so forcing the canary's worker is the worst case the accounting covers.
    Only the audit builds this class; no config or API argument reaches it.
    """

    def local_worker(self, r: int) -> int:
        return 0


def local_log_likelihood_ratio(t: np.ndarray | float, q: float, z: float) -> np.ndarray:
    """ln p_D(t) / p_D′(t) of one local step's output along e, in units of the canary's term Δ = c/b.

    Under D the canary adds +1 when sampled (probability q), under D′ −1; the noise is N(0, z²) with z the
    claimed z3 = σ3·b. Dividing both mixtures by the density of N(0, z²) at t:

        ln((1 − q) + q·exp((2t − 1)/(2z²))) − ln((1 − q) + q·exp((−2t − 1)/(2z²)));

    for q = 1 this is the Gaussian 2t/z².

    References:
        dp-accounting, ``privacy_loss_mechanism.AdditiveNoisePrivacyLoss`` (REPLACE, sub-sampled: the same pair).
    """
    t = np.asarray(t, dtype=np.float64)
    keep = -math.inf if q >= 1 else math.log1p(-q)
    log_q, two_z2 = math.log(q), 2 * z * z
    return np.logaddexp(keep, log_q + (2 * t - 1) / two_z2) - np.logaddexp(keep, log_q + (-2 * t - 1) / two_z2)


def _local_loss_moments(q: float, z: float, nodes: int = 201) -> tuple[float, float]:
    """Mean and variance under D of :func:`local_log_likelihood_ratio` (Gauss–Hermite over each mixture part)."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    first = second = 0.0
    for centre, weight in ((0.0, 1 - q), (1.0, q)):
        if weight > 0:
            loss = local_log_likelihood_ratio(centre + z * x, q, z)
            first += weight * float(w @ loss)
            second += weight * float(w @ loss**2)
    return first, second - first**2


def claimed_score_moments(spec: AuditSpec, calibration: Calibration) -> tuple[float, float]:
    """Mean and standard deviation under D of the audit's score if the mechanism is the claimed one.

    The score is a sum of independent log-likelihood ratios (given the announced radii): per server round a
    Gaussian one, N(1/(2z²), 1/z²), and per local step :func:`local_log_likelihood_ratio`'s.
    """
    mean = variance = 0.0
    for r in range(1, spec.rounds + 1):
        z = calibration.z1 if (r - 1) % spec.period == 0 else calibration.z2
        assert z is not None
        mean, variance = mean + 1 / (2 * z * z), variance + 1 / (z * z)
        if calibration.local is not None:
            m, v = _local_loss_moments(calibration.local.sampling_prob, calibration.local.z3)
            mean, variance = mean + (LOCAL_STEPS - 1) * m, variance + (LOCAL_STEPS - 1) * v
    return mean, math.sqrt(variance)


def _mechanism_run(spec: AuditSpec, claimed: Calibration) -> Calibration:
    """What the trials of a diff2-bvr audit run: the claimed calibration, or with noise scaled on purpose an honest
    description of the broken mechanism (its own z's and σ's, so the server's ledger accounts it truly) with no
    budget (ε = inf), so that the production budget guard lets it run."""
    if spec.noise_scale == 1.0 and spec.local_noise_scale == 1.0:
        return claimed
    assert claimed.local is not None
    s, ls = spec.noise_scale, spec.local_noise_scale
    local = replace(claimed.local, z3=claimed.local.z3 * ls, sigma3=claimed.local.sigma3 * ls)
    return replace(claimed, epsilon=math.inf, z1=claimed.z1 * s, sigma1=claimed.sigma1 * s,
                   z2=None if claimed.z2 is None else claimed.z2 * s,
                   sigma2=None if claimed.sigma2 is None else claimed.sigma2 * s, local=local)


def _trial_local(spec: AuditSpec, claimed: Calibration, run: Calibration, workers: Sequence[Worker],
                 seed: int | None) -> float:
    """One run of DIFF2 with its local routine through the runtime's server and workers; the LR score.

    The calls are the in-process driver's: ``plan`` -> each worker's ``reply`` -> ``release`` (ṽ_r, and the
    local task for worker 0) -> ``local_phase`` -> ``finish_local`` (x_r). The adversary reads the released
    ṽ_r and x_r and the announced radius, and scores them against the claimed noise.
    """
    assert claimed.local is not None and run.local is not None
    mechanism = Mechanism(restart_every=spec.period, clip_restart=spec.clip_restart, clip_diff=spec.clip_diff,
                          sigma_restart=run.sigma1, sigma_diff=run.sigma2 or 0.0)
    local = LocalMechanism(steps=LOCAL_STEPS, batch_size=spec.local_batch_size, learning_rate=spec.learning_rate,
                           clip=spec.local_clip, sigma=run.local.sigma3)
    server = _CanaryWorkerServer(mechanism=mechanism, routine=make_routine("gd", learning_rate=spec.learning_rate),
                                 layout=workers[0].gradients.layout, x0=np.zeros(spec.dim), rounds=spec.rounds,
                                 clients=spec.clients, n_min=spec.samples, seed=seed, progress=None, calibration=run,
                                 local=local)
    claimed_sigma = {True: claimed.sigma1, False: claimed.sigma2}
    sensitivity_per_radius = 2.0 / (spec.samples * spec.clients)
    q, z3, eta = claimed.local.sampling_prob, claimed.local.z3, spec.learning_rate
    score, v_prev, x_prev = 0.0, np.zeros(spec.dim), server.state.x
    for rnd in range(1, spec.rounds + 1):
        plan = server.plan()
        task = server.release([w.reply(plan) for w in workers])
        if task.partition_id != 0:  # pragma: no cover - the override above
            raise RuntimeError(f"round {rnd}: the local phase went to worker {task.partition_id}, not the canary's")
        release = server.finish_local(workers[0].local_phase(task))
        v, x = release.v, release.x
        # the server's round: the announced radius and the released ṽ_r
        if plan.radius >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: radius {plan.radius:g} too large for the canary to be clipped")
        if plan.radius > 0:
            s = claimed_sigma[plan.restart] * plan.radius
            score += sensitivity_per_radius * plan.radius / s**2 * float((v if plan.restart else v - v_prev)[0])
        # the local step, from x_(r-1), ṽ_r and x_r: y_1 = x_(r-1) - η ṽ_r, x_r = y_1 - η w_1
        y1 = x_prev - eta * v
        c = difference_radius(spec.local_clip, y1, x_prev)
        if c >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: local radius {c:g} too large for the canary to be clipped")
        if c > 0:
            output = (y1 - x) / eta - v  # (1/b) Σ_(sampled) clipped differences + noise
            score += float(local_log_likelihood_ratio(output[0] / (c / spec.local_batch_size), q, z3))
        v_prev, x_prev = v, x
    if server.state.round != spec.rounds:  # pragma: no cover - release() raises before this
        raise RuntimeError("the audited run stopped early")
    return score


def _seed(spec: AuditSpec, federation: int, index: int) -> int | None:
    if spec.seed is None:
        return None  # fresh OS entropy per trial, as in production
    state = np.random.SeedSequence([spec.seed, federation, index]).generate_state(2, dtype=np.uint64)
    return int(state[0]) << 64 | int(state[1])


def _chunk(spec: AuditSpec, claimed: Calibration, run: Calibration, federation: int, start: int,
           stop: int) -> np.ndarray:
    torch.set_num_threads(1)
    workers = _workers(spec, +1 if federation == 1 else -1)
    if spec.local:
        return np.array([_trial_local(spec, claimed, run, workers, _seed(spec, federation, i))
                         for i in range(start, stop)])
    return np.array([_trial(spec, claimed, workers, _seed(spec, federation, i)) for i in range(start, stop)])


def audit_scores(spec: AuditSpec, progress: Callable[[str], None] | None = None,
                 calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LR scores of ``spec.trials`` runs on D (canary +) and on D′ (canary −); ``calibration``: the spec's, if
    already computed (the local routine's PLD calibration is slow; the worker processes receive it)."""
    claimed = calibration if calibration is not None else spec.calibration()
    run = _mechanism_run(spec, claimed) if spec.local else claimed
    chunk = max(1, min(500, spec.trials // (4 * spec.workers)))
    jobs = [(fed, s, min(s + chunk, spec.trials)) for s in range(0, spec.trials, chunk) for fed in (1, 0)]
    out: dict[int, list[tuple[int, np.ndarray]]] = {1: [], 0: []}
    started, done = time.perf_counter(), 0

    def report(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            elapsed = time.perf_counter() - started
            eta = elapsed / done * (2 * spec.trials - done)
            progress(f"[audit] {done}/{2 * spec.trials} runs, {done / elapsed:.0f} runs/s, ETA {eta:.0f} s")

    if spec.workers == 1:
        for fed, s, e in jobs:
            out[fed].append((s, _chunk(spec, claimed, run, fed, s, e)))
            report(e - s)
    else:
        import multiprocessing

        with ProcessPoolExecutor(spec.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_chunk, spec, claimed, run, fed, s, e): (fed, s, e) for fed, s, e in jobs}
            for future in as_completed(futures):  # progress as chunks finish; results re-ordered below
                fed, s, e = futures[future]
                out[fed].append((s, future.result()))
                report(e - s)
    d, d_prime = (np.concatenate([a for _, a in sorted(out[f], key=lambda t: t[0])]) for f in (1, 0))
    return d, d_prime


# ------------------------------------------------------------------------- statistics

def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided (1 − alpha) Clopper–Pearson upper bound on a rate with k successes in n trials."""
    k = np.asarray(k)
    return np.where(k >= n, 1.0, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)))


def _bounds(d: np.ndarray, d_prime: np.ndarray, thresholds: np.ndarray, alpha: float, delta: float) -> dict:
    """ε lower bounds (and their counts) at each threshold; "guess D iff score > t"."""
    d_sorted, p_sorted = np.sort(d), np.sort(d_prime)
    fn = np.searchsorted(d_sorted, thresholds, side="right")  # D scored <= t: missed
    fp = len(p_sorted) - np.searchsorted(p_sorted, thresholds, side="right")  # D′ scored > t
    fnr_hi = clopper_pearson_upper(fn, len(d), alpha / 2)
    fpr_hi = clopper_pearson_upper(fp, len(d_prime), alpha / 2)
    return {"epsilon": _epsilon_of_rates(fpr_hi, fnr_hi, delta), "fn": fn, "fp": fp, "fnr_hi": fnr_hi, "fpr_hi": fpr_hi}


def _epsilon_of_rates(fpr: np.ndarray | float, fnr: np.ndarray | float, delta: float) -> np.ndarray:
    """The smallest ε that (ε, δ)-DP allows for a test with these error rates (0 if none is implied):
    max(ln((1 − δ − FPR)/FNR), ln((1 − δ − FNR)/FPR), 0)."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.clip(1 - delta - fpr, 0, None) / fnr)
        two = np.log(np.clip(1 - delta - fnr, 0, None) / fpr)
    return np.maximum(np.nan_to_num(np.maximum(one, two), nan=0.0, neginf=0.0, posinf=np.inf), 0.0)


def score_grid(mean: float, sd: float, points: int = 65) -> np.ndarray:
    """Thresholds fixed before any trial runs: mean + sd·k/4, k = −32..32, with the claimed score's mean and
    standard deviation under D (:func:`claimed_score_moments`); :func:`threshold_grid` for a μ-GDP claim."""
    half = (points - 1) // 2
    return mean + sd * np.arange(-half, half + 1) / 4


def threshold_grid(mu_claimed: float, points: int = 65) -> np.ndarray:
    """Thresholds fixed before any trial runs: μ²/2 + μ·k/4, k = −32..32, in the claimed score units.

    Under the claim the scores are N(±μ²/2, μ²); a mechanism with less noise than claimed keeps
    the means and shrinks the spread, so the grid covers both. Fixing it in advance (rather than
    picking the best threshold on the data) keeps the Clopper–Pearson intervals honest; the
    Bonferroni correction pays for taking the best of ``points`` thresholds.
    """
    half = (points - 1) // 2
    return mu_claimed**2 / 2 + mu_claimed * np.arange(-half, half + 1) / 4


def epsilon_lower_bound(d: np.ndarray, d_prime: np.ndarray, *, delta: float, thresholds: np.ndarray,
                        alpha: float = 0.05) -> dict:
    """ε̂ with confidence 1 − alpha from scores on D and D′: the best of the fixed ``thresholds``, each
    bound at level alpha/len(thresholds) (Bonferroni), so the maximum is a valid lower bound."""
    per_threshold = alpha / len(thresholds)
    bounds = _bounds(d, d_prime, thresholds, per_threshold, delta)
    k = int(np.argmax(bounds["epsilon"]))
    fn, fp = int(bounds["fn"][k]), int(bounds["fp"][k])
    fnr, fpr = fn / len(d), fp / len(d_prime)
    point = float(_epsilon_of_rates(fpr, fnr, delta))
    # Assuming a Gaussian trade-off curve (μ-GDP, as Nasr et al. 2023): μ ≥ Φ⁻¹(1 − FPR⁺) − Φ⁻¹(FNR⁺).
    fpr_hi, fnr_hi = float(bounds["fpr_hi"][k]), float(bounds["fnr_hi"][k])
    mu_lower = max(0.0, float(ndtri(1 - fpr_hi) - ndtri(fnr_hi))) if fpr_hi < 1 and fnr_hi < 1 else 0.0
    return {
        "epsilon_lower_bound": float(bounds["epsilon"][k]),
        "threshold": float(thresholds[k]),
        "thresholds_tried": len(thresholds),
        "false_negatives": fn, "false_positives": fp,
        "fnr": fnr, "fpr": fpr, "fnr_upper": fnr_hi, "fpr_upper": fpr_hi,
        "epsilon_point_estimate": point,
        "mu_lower_bound_gdp": mu_lower,
        "epsilon_lower_bound_gdp": gdp_epsilon(mu_lower, delta) if mu_lower > 0 else 0.0,
    }


def _ledger_epsilon(spec: AuditSpec, calibration: Calibration) -> float:
    """ε of the whole schedule as a run's ledger composes it, round by round (the budget guard's number)."""
    ledger = PrivacyLedger(spec.delta)
    for r in range(1, spec.rounds + 1):
        ledger = ledger.record(*calibration.round_events((r - 1) % spec.period == 0))
    return ledger.epsilon


def run_audit(spec: AuditSpec, progress: Callable[[str], None] | None = None) -> dict:
    """Run the audit; return the JSON-able result (see the module docstring for what it means)."""
    started = time.perf_counter()
    calibration = spec.calibration()
    d, d_prime = audit_scores(spec, progress, calibration)
    m1, m2 = calibration.restart_rounds, calibration.difference_rounds
    schedule = {"rounds": spec.rounds, "restart_every": spec.period, "restart_rounds": m1, "difference_rounds": m2,
                "z1": calibration.z1, "z2": calibration.z2, "noise_scale": spec.noise_scale}
    pooled_sd = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    scores = {"mean_d": float(np.mean(d)), "mean_d_prime": float(np.mean(d_prime)),
              "sd_d": float(np.std(d, ddof=1)), "sd_d_prime": float(np.std(d_prime, ddof=1))}
    if calibration.local is None:
        mu_claimed = calibration.mu
        eps_claimed = calibration.epsilon_spent(m1, m2)
        stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha,
                                    thresholds=threshold_grid(mu_claimed))
        scores["mu_empirical"] = float((np.mean(d) - np.mean(d_prime)) / pooled_sd)
        extra: dict = {"path": "Diff2Strategy.configure_fit -> Diff2Client.fit -> FitRes -> "
                               "Diff2Strategy.aggregate_fit"}
    else:
        mu_claimed = None  # a subsampled mechanism has no μ-GDP trade-off curve
        eps_claimed = _ledger_epsilon(spec, calibration)
        mean, sd = claimed_score_moments(spec, calibration)
        stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha, thresholds=score_grid(mean, sd))
        stats["mu_lower_bound_gdp"] = stats["epsilon_lower_bound_gdp"] = None  # they assume a Gaussian trade-off
        scores.update({"mean_claimed": mean, "sd_claimed": sd})
        local = calibration.local
        schedule["local"] = {"steps": local.steps, "batch_size": local.batch_size, "sampling_prob": local.sampling_prob,
                             "share": local.share, "z3": local.z3, "sigma3": local.sigma3, "clip": spec.local_clip,
                             "noise_scale": spec.local_noise_scale,
                             "worker": "0, forced (the canary's worker; a run draws it uniformly)"}
        run = _mechanism_run(spec, calibration)
        extra = {
            "epsilon_claimed_accountant": "the run's ledger: dp-accounting PLD, round by round (server Gaussian, "
                                          "then the local step's replace-one Poisson-subsampled Gaussian)",
            "epsilon_planned": calibration.planned_epsilon,
            # what the trials actually ran, by the same ledger: ε̂ must not exceed it either (the audit's own check)
            "epsilon_of_mechanism_run": eps_claimed if run is calibration else _ledger_epsilon(spec, run),
            "path": "Diff2Server.plan -> Worker.reply -> Diff2Server.release -> Worker.local_phase (worker 0) -> "
                    "Diff2Server.finish_local (the in-process driver's calls)",
        }
    result = {
        "epsilon_lower_bound": stats.pop("epsilon_lower_bound"),
        "epsilon_claimed": eps_claimed,
        "ratio": None,
        "violation": None,
        "trials": spec.trials,
        "runs": 2 * spec.trials,
        "delta": spec.delta,
        "confidence": 1 - spec.alpha,
        "method": spec.method,
        "schedule": schedule,
        "mu_claimed": mu_claimed,
        "scores": scores,
        **stats,
        "noise": "seeded (reproducible)" if spec.seed is not None else "os-entropy key per run",
        **extra,
        "spec": asdict(spec),
        "wall_time_s": time.perf_counter() - started,
    }
    result["ratio"] = result["epsilon_lower_bound"] / eps_claimed
    result["violation"] = result["epsilon_lower_bound"] > eps_claimed
    return result


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
