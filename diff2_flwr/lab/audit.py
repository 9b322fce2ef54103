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
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from scipy.special import ndtri
from scipy.stats import beta

from ..core.clipping import clipped_sum
from ..core.estimator import Mechanism
from ..core.gradients import Contribution
from ..core.layout import ParameterLayout
from ..core.privacy import Calibration, calibrate, gdp_epsilon
from ..core.routines import make_routine
from ..fl import protocol
from ..fl.client import Diff2Client
from ..fl.strategy import Diff2Strategy
from ..runtime.session import Diff2Server, Worker
from ..task.records import TensorRecords
from .audit_spec import AuditSpec, default_workers

__all__ = ["AuditSpec", "GradientCanaryShard", "audit_scores", "clopper_pearson_upper", "epsilon_lower_bound",
           "run_audit", "threshold_grid"]

# ------------------------------------------------------------------------- the federation

#: |canary gradient| / clipping radius is at least this (checked every round): it is always clipped.
CANARY_MARGIN = 1e6


class GradientCanaryShard:
    """A worker's records as per-sample gradient functions; drop-in for ``PerSampleGradients``.

    Benign record i has the loss ½ Σ_j a_ij x_j² + b_ij x_j on coordinates j ≥ 1 (so its
    gradient difference is a_i ⊙ (x_{r−1} − x_{r−2})); coordinate 0 is the canary axis e. With
    ``canary = ±1`` record 0 is the canary: gradient and gradient difference ``canary·K·e``,
    K = CANARY_MARGIN × the round's radius. ClippedMean is the core's (``clipped_sum``).
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
        rows = torch.from_numpy(self.rows(radius, x_current, x_previous))
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
    dummy = torch.zeros(spec.samples, 1, dtype=torch.float64)  # a Worker counts its records by its features
    return [Worker(p, GradientCanaryShard(a, b, canary if p == 0 else 0), TensorRecords(dummy, dummy[:, 0]))
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


def _seed(spec: AuditSpec, federation: int, index: int) -> int | None:
    if spec.seed is None:
        return None  # fresh OS entropy per trial, as in production
    state = np.random.SeedSequence([spec.seed, federation, index]).generate_state(2, dtype=np.uint64)
    return int(state[0]) << 64 | int(state[1])


def _chunk(spec: AuditSpec, federation: int, start: int, stop: int) -> np.ndarray:
    torch.set_num_threads(1)
    calibration = spec.calibration()
    workers = _workers(spec, +1 if federation == 1 else -1)
    return np.array([_trial(spec, calibration, workers, _seed(spec, federation, i)) for i in range(start, stop)])


def audit_scores(spec: AuditSpec, progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LR scores of ``spec.trials`` runs on D (canary +) and on D′ (canary −)."""
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
            out[fed].append((s, _chunk(spec, fed, s, e)))
            report(e - s)
    else:
        import multiprocessing

        with ProcessPoolExecutor(spec.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_chunk, spec, fed, s, e): (fed, s, e) for fed, s, e in jobs}
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


def run_audit(spec: AuditSpec, progress: Callable[[str], None] | None = None) -> dict:
    """Run the audit; return the JSON-able result (see the module docstring for what it means)."""
    started = time.perf_counter()
    calibration = spec.calibration()
    d, d_prime = audit_scores(spec, progress)
    mu_claimed = calibration.mu
    stats = epsilon_lower_bound(d, d_prime, delta=spec.delta, alpha=spec.alpha, thresholds=threshold_grid(mu_claimed))
    pooled_sd = math.sqrt((np.var(d, ddof=1) + np.var(d_prime, ddof=1)) / 2)
    m1, m2 = calibration.restart_rounds, calibration.difference_rounds
    eps_claimed = calibration.epsilon_spent(m1, m2)
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
        "schedule": {"rounds": spec.rounds, "restart_every": spec.period, "restart_rounds": m1,
                     "difference_rounds": m2, "z1": calibration.z1, "z2": calibration.z2,
                     "noise_scale": spec.noise_scale},
        "mu_claimed": mu_claimed,
        "scores": {"mean_d": float(np.mean(d)), "mean_d_prime": float(np.mean(d_prime)),
                   "sd_d": float(np.std(d, ddof=1)), "sd_d_prime": float(np.std(d_prime, ddof=1)),
                   "mu_empirical": float((np.mean(d) - np.mean(d_prime)) / pooled_sd)},
        **stats,
        "noise": "seeded (reproducible)" if spec.seed is not None else "os-entropy key per run",
        "path": "Diff2Strategy.configure_fit -> Diff2Client.fit -> FitRes -> Diff2Strategy.aggregate_fit",
        "spec": asdict(spec),
        "wall_time_s": time.perf_counter() - started,
    }
    result["ratio"] = result["epsilon_lower_bound"] / eps_claimed
    result["violation"] = result["epsilon_lower_bound"] > eps_claimed
    return result


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
