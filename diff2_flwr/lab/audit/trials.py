"""The audit's trials: the neighbouring federations D and D′, and runs of the schedule through the
real server path.

A trial (:func:`_trial`, :func:`_trial_local` for DIFF2 with its private local routine,
:func:`_trial_distributed` for distributed noise, or :func:`_trial_sampled` for client sampling)
runs the whole schedule through the production code and returns the likelihood-ratio score of what
the server released; :func:`audit_scores` runs ``spec.trials`` of them on each federation, in worker
processes if asked. The canary, the score and why they are the worst case: :mod:`.audit`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
from flwr.common import (Code, FitRes, GetPropertiesIns, GetPropertiesRes, Status,
                         ndarrays_to_parameters, parameters_to_ndarrays)

from ...core.clipping import clipped_sum
from ...core.distributed import DistributedNoise
from ...core.estimator import Mechanism, difference_radius
from ...core.gradients import Contribution
from ...core.layout import ParameterLayout
from ...core.local import LocalMechanism
from ...core.privacy import Calibration
from ...core.routines import make_routine
from ...core.skellam import SkellamCode
from ...fl import protocol
from ...fl.client import Diff2Client
from ...fl.strategy import Diff2Strategy
from ...runtime.session import Diff2Server, Worker
from ...runtime.server_core import ServerSpec
from ...task.records import TensorRecords
from .pool import run_chunks
from .spec import LOCAL_STEPS, AuditSpec
from .stats import local_log_likelihood_ratio, mixture_log_likelihood_ratio, sampled_offsets

__all__ = ["CANARY_MARGIN", "GradientCanaryShard", "Scorer", "audit_scores", "audited_server",
           "mechanism_run", "run_chunks", "worker_noise"]

# ----------------------------------------------------------------------------------- the federation

#: |canary gradient| / clipping radius is at least this (checked every round): it is always clipped.
CANARY_MARGIN = 1e6


class GradientCanaryShard:
    """A worker's records as per-sample gradient functions; drop-in for ``PerSampleGradients``.

    Benign record i has the loss ½ Σ_j a_ij x_j² + b_ij x_j on its benign coordinates (so its
    gradient difference is a_i ⊙ (x_{r−1} − x_{r−2})); the first B coordinates are canary axes. With
    ``canary = ±1`` record 0 is the canary on axis e_0: gradient and gradient difference
    ``canary·K·e_0``, K = CANARY_MARGIN × the round's radius; ``canary = 0``: no canary. With an
    array of signs s_0..s_(B−1) (:mod:`.canaries`: many canaries in one run) record k is the canary
    s_k·K·e_k. ClippedMean is the core's (``clipped_sum``). The features passed in carry each
    record's index (column 0), so a minibatch of the local steps holds exactly the records it names:
    a canary only when its record was sampled. With ``push`` (the sampled audit's canary client)
    every other record's gradient and gradient difference is +K·e_0, so that all of them clip onto
    +radius·e_0: the client's contribution sits (n − 1)·radius/n from where the round is without it.
    """

    def __init__(self, a: np.ndarray, b: np.ndarray, canary: int | np.ndarray,
                 push: bool = False) -> None:
        signs = np.asarray(canary, dtype=np.int64).reshape(-1)
        if signs.size == 1 and signs[0] == 0:
            signs = signs[:0]
        # a worker without canary still leaves axis 0 (the audit's e) alone
        axes = max(1, signs.size)
        if (a.shape != b.shape or a.ndim != 2 or np.any(a[:, :axes] != 0)
                or np.any(b[:, :axes] != 0)):
            raise ValueError("benign records must be [n, d] arrays with zero canary coordinates")
        if signs.size > min(a.shape) or np.any(np.abs(signs) != 1):
            raise ValueError(f"canary signs must be +1 or -1, at most one per record and axis; "
                             f"found {signs.size} for {a.shape[0]} records of dimension "
                             f"{a.shape[1]}")
        if push and signs.size != 1:
            raise ValueError("push needs exactly one canary (on axis 0)")
        self.a, self.b, self.signs, self.push = a, b, signs, push
        self.canary = int(signs[0]) if signs.size == 1 else (0 if signs.size == 0 else None)
        self.layout = ParameterLayout(("w",), ((a.shape[1],),))
        self.dtype = torch.float64

    def rows(self, radius: float, x_current: np.ndarray,
             x_previous: np.ndarray | None) -> np.ndarray:
        """Every record's per-sample gradient (``x_previous`` None) or gradient difference at the
        iterate, the canaries' scaled past the round's ``radius``."""
        if x_previous is None:
            rows = self.a * x_current + self.b
        else:
            rows = self.a * (x_current - x_previous)
        if self.push:
            rows[1:] = 0.0
            rows[1:, 0] = CANARY_MARGIN * max(radius, 1.0)
        if self.signs.size:
            k = np.arange(self.signs.size)
            rows[k] = 0.0
            rows[k, k] = self.signs * (CANARY_MARGIN * max(radius, 1.0))
        return rows

    def clipped_mean(self, x_current: np.ndarray, features: torch.Tensor, targets: torch.Tensor,
                     radius: float, x_previous: np.ndarray | None = None) -> Contribution:
        """The clipped mean of the records ``features`` names (column 0), as
        ``PerSampleGradients.clipped_mean``: the core's ``clipped_sum``."""
        index = features[:, 0].to(torch.int64).numpy()
        rows = torch.from_numpy(self.rows(radius, x_current, x_previous)[index])
        part = clipped_sum(rows, radius)
        return Contribution(mean=(part.total / part.count).numpy(), num_samples=part.count,
                            num_clipped=part.clipped)


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
    return [Worker(p, GradientCanaryShard(a, b, canary if p == 0 else 0,
                                          push=spec.sampled and p == 0), records)
            for p, (a, b) in enumerate(_benign(spec))]


# ---------------------------------------------------------------------------------------- one trial

class _Proxy:
    """Stands in for a ``ClientProxy``: the strategy reads only ``cid``."""

    def __init__(self, cid: str) -> None:
        self.cid = cid


class _PartitionProxy(_Proxy):
    """A ``ClientProxy`` whose node answers ``get_properties`` as the real client does (client
    sampling: the strategy asks each node once which partition it holds)."""

    def __init__(self, cid: str, client: Diff2Client) -> None:
        super().__init__(cid)
        self.client = client

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None,
                       group_id: int | None) -> GetPropertiesRes:
        return GetPropertiesRes(status=Status(Code.OK, ""),
                                properties=self.client.get_properties(dict(ins.config)))


class _Manager:
    """Stands in for a ``ClientManager`` with all P workers connected."""

    def __init__(self, proxies: dict[str, _Proxy]) -> None:
        self.proxies = proxies

    def wait_for(self, num_clients: int, timeout: int) -> bool:
        return len(self.proxies) >= num_clients

    def all(self) -> dict[str, _Proxy]:
        return self.proxies


def audited_server(spec: AuditSpec, calibration: Calibration, layout: ParameterLayout,
                   seed: int | None) -> Diff2Server:
    """The production server of one audited run: the calibrated mechanism (its noise times
    ``spec.noise_scale``)."""
    mechanism = Mechanism(
        restart_every=spec.period, clip_restart=spec.clip_restart, clip_diff=spec.clip_diff,
        sigma_restart=calibration.sigma1 * spec.noise_scale,
        sigma_diff=(calibration.sigma2 or 0.0) * spec.noise_scale,
    )
    # A mechanism broken on purpose (noise_scale != 1) is not the calibrated one: the server
    # refuses to account it as such, so it runs unaccounted (the audit's bound uses `claimed`).
    server = _server_spec(spec, mechanism, layout,
                          calibration=calibration if spec.noise_scale == 1.0 else None,
                          sampling=spec.client_sampling())
    return Diff2Server(server, x0=np.zeros(layout.dim), seed=seed)


def _server_spec(spec: AuditSpec, mechanism: Mechanism, layout: ParameterLayout,
                 **regime: Any) -> ServerSpec:
    """The audited server's spec: ``mechanism`` with GD at the audit's step, over its rounds,
    clients and records; ``regime``: its calibration, and its local routine or distributed noise."""
    return ServerSpec(mechanism=mechanism,
                      routine=make_routine("gd", learning_rate=spec.learning_rate),
                      layout=layout, rounds=spec.rounds, clients=spec.clients,
                      n_min=spec.samples, **regime)


class Scorer:
    """The adversary's likelihood-ratio scores of one run along its first ``axes`` coordinates (one
    per canary), round by round from what the server announces (kind, radius) and releases (ṽ_r),
    against the claimed noise."""

    def __init__(self, spec: AuditSpec, calibration: Calibration, dim: int, axes: int = 1) -> None:
        self.claimed = {True: calibration.sigma1, False: calibration.sigma2}
        self.sensitivity_per_radius = 2.0 / (spec.samples * spec.clients)
        self.axes, self.rounds = axes, 0
        self.score, self.v_prev = np.zeros(axes), np.zeros(dim)

    def add(self, restart: bool, radius: float, v: np.ndarray) -> None:
        """Score one released round: its kind and radius as announced, and the released ṽ_r."""
        self.rounds += 1
        if radius >= CANARY_MARGIN:
            raise RuntimeError(f"round {self.rounds}: radius {radius:g} too large for the canary "
                               "to be clipped")
        increment = v if restart else v - self.v_prev
        if radius > 0:  # radius 0: nothing depends on the data, nothing to score
            s = self.claimed[restart] * radius
            self.score += self.sensitivity_per_radius * radius / s**2 * increment[:self.axes]
        self.v_prev = v


def _trial(spec: AuditSpec, calibration: Calibration, workers: Sequence[Worker], seed: int | None,
           axes: int = 1) -> np.ndarray:
    """One run of the schedule through the real Strategy; the LR scores of what it released along
    the first ``axes`` coordinates (one per canary: :mod:`.canaries`; one canary, on e_0, by
    default)."""
    layout = workers[0].gradients.layout
    server = audited_server(spec, calibration, layout, seed)
    strategy = Diff2Strategy(server=server)
    proxies = {f"node-{1000 + p}": _Proxy(f"node-{1000 + p}") for p in range(spec.clients)}
    manager = _Manager(proxies)
    clients = {cid: Diff2Client(w) for cid, w in zip(proxies, workers)}
    scorer = Scorer(spec, calibration, layout.dim, axes)
    for rnd in range(1, spec.rounds + 1):
        instructions = strategy.configure_fit(rnd, None, manager)  # type: ignore[arg-type]
        strategy.aggregate_fit(rnd, _fit_all(clients, instructions), [])
        # what the adversary sees: the announced radius and kind, and the released ṽ_r
        config = instructions[0][1].config
        scorer.add(config[protocol.KIND] == "restart", float(config[protocol.RADIUS]),
                   server.state.v)
    if server.state.round != spec.rounds:  # pragma: no cover - release() raises before this
        raise RuntimeError("the audited run stopped early")
    return scorer.score


def _fit_all(clients: dict[str, Diff2Client],
             instructions: list) -> list[tuple[_Proxy, FitRes]]:
    """Each asked client's real ``fit``, as the ``FitRes`` Flower would deliver."""
    results = []
    for proxy, ins in instructions:
        arrays, n, metrics = clients[proxy.cid].fit(parameters_to_ndarrays(ins.parameters),
                                                    ins.config)
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n,
                                      metrics)))
    return results


def _trial_sampled(spec: AuditSpec, calibration: Calibration, workers: Sequence[Worker],
                   seed: int | None) -> np.ndarray:
    """One client-sampled run of the schedule through the real Strategy; its scores (mixture LR
    score, G, μ_S²).

    ``configure_fit`` (the server draws round r's cohort from the trial's key; the strategy asks
    each node its partition once, ``get_properties``, and only the cohort; an empty cohort is
    released without Flower) -> each drawn :class:`Diff2Client`'s ``fit`` -> ``aggregate_fit``. The
    canary's client (worker 0) is drawn like any other. The adversary reads the released round row
    (kind, radius, cohort: public) and ṽ_r; with w_r the increment along e in units of the claimed
    std s_r = σ_r C_r, and (centre, half) = ((n − 1)/(2z_r), 1/(2z_r)):

    - the mixture LR score Σ_r ln p_D(w_r)/p_D′(w_r) of what is released
      (:func:`~.stats.mixture_log_likelihood_ratio`), for the Clopper–Pearson test;
    - over the rounds whose cohort holds worker 0, G = Σ (w_r − centre)/z_r and μ_S² = Σ 1/z_r², for
      the cohort test (:func:`~.gdp.cohort_gdp_audit`).
    """
    layout = workers[0].gradients.layout
    server = audited_server(spec, calibration, layout, seed)
    strategy = Diff2Strategy(server=server)
    clients = {f"node-{1000 + p}": Diff2Client(w) for p, w in enumerate(workers)}
    manager = _Manager({cid: _PartitionProxy(cid, c) for cid, c in clients.items()})
    claimed = {True: (calibration.z1, calibration.sigma1),
               False: (calibration.z2, calibration.sigma2)}
    pi = calibration.sampling_prob
    score = g = mu2 = 0.0
    v_prev = np.zeros(layout.dim)
    for rnd in range(1, spec.rounds + 1):
        instructions = strategy.configure_fit(rnd, None, manager)  # type: ignore[arg-type]
        if instructions:  # else: nobody drawn, the strategy released the round itself
            strategy.aggregate_fit(rnd, _fit_all(clients, instructions), [])
        row = server.history[-1]
        if row["round"] != rnd:  # pragma: no cover - release() raises before this
            raise RuntimeError(f"round {rnd}: the released row is not this round's")
        restart, radius, v = row["kind"] == "restart", float(row["radius"]), server.state.v
        if radius >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: radius {radius:g} too large for the canary to be "
                               "clipped")
        increment = v if restart else v - v_prev
        v_prev = v
        if radius <= 0:  # nothing depends on the data, nothing to score
            continue
        z, sigma = claimed[restart]
        assert z is not None and sigma is not None
        w = float(increment[0]) / (sigma * radius)
        centre, half = sampled_offsets(z, spec.samples)
        score += float(mixture_log_likelihood_ratio(w, pi, centre, half))
        if 0 in row["cohort"]:
            g, mu2 = g + (w - centre) / z, mu2 + 1 / z**2
    if server.state.round != spec.rounds:  # pragma: no cover - release() raises before this
        raise RuntimeError("the audited run stopped early")
    return np.array([score, g, mu2])


class _CanaryWorkerServer(Diff2Server):
    """The production server with one change: worker 0, which holds the canary, runs every local
    phase.

    A run draws p_r uniformly (:meth:`Diff2Server.local_worker`); its ledger charges every record
    every local phase whichever worker ran it, so forcing the canary's worker is the worst case the
    accounting covers. Only the audit builds this class; no config or API argument reaches it.
    """

    def local_worker(self, r: int) -> int:
        return 0


def mechanism_run(spec: AuditSpec, claimed: Calibration) -> Calibration:
    """What the trials of a diff2-bvr audit run: the claimed calibration, or with noise scaled on
    purpose an honest description of the broken mechanism (its own z's and σ's, so the server's
    ledger accounts it truly) with no budget (ε = inf), so that the production budget guard lets it
    run."""
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
    """One run of DIFF2 with its local routine through the runtime's server and workers; the LR
    score.

    The calls are the in-process driver's: ``plan`` -> each worker's ``reply`` -> ``release`` (ṽ_r,
    and the local task for worker 0) -> ``local_phase`` -> ``finish_local`` (x_r). The adversary
    reads the released ṽ_r and x_r and the announced radius, and scores them against the claimed
    noise.
    """
    assert claimed.local is not None and run.local is not None
    mechanism = Mechanism(restart_every=spec.period, clip_restart=spec.clip_restart,
                          clip_diff=spec.clip_diff, sigma_restart=run.sigma1,
                          sigma_diff=run.sigma2 or 0.0)
    local = LocalMechanism(steps=LOCAL_STEPS, batch_size=spec.local_batch_size,
                           learning_rate=spec.learning_rate, clip=spec.local_clip,
                           sigma=run.local.sigma3)
    server = _CanaryWorkerServer(
        _server_spec(spec, mechanism, workers[0].gradients.layout, calibration=run, local=local),
        x0=np.zeros(spec.dim), seed=seed)
    claimed_sigma = {True: claimed.sigma1, False: claimed.sigma2}
    sensitivity_per_radius = 2.0 / (spec.samples * spec.clients)
    q, z3, eta = claimed.local.sampling_prob, claimed.local.z3, spec.learning_rate
    score, v_prev, x_prev = 0.0, np.zeros(spec.dim), server.state.x
    for rnd in range(1, spec.rounds + 1):
        plan = server.plan()
        task = server.release([w.reply(plan) for w in workers])
        if task.partition_id != 0:  # pragma: no cover - the override above
            raise RuntimeError(f"round {rnd}: the local phase went to worker {task.partition_id}, "
                               "not the canary's")
        release = server.finish_local(workers[0].local_phase(task))
        v, x = release.v, release.x
        # the server's round: the announced radius and the released ṽ_r
        if plan.radius >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: radius {plan.radius:g} too large for the canary to "
                               "be clipped")
        if plan.radius > 0:
            s = claimed_sigma[plan.restart] * plan.radius
            score += (sensitivity_per_radius * plan.radius / s**2
                      * float((v if plan.restart else v - v_prev)[0]))
        # the local step, from x_(r-1), ṽ_r and x_r: y_1 = x_(r-1) - η ṽ_r, x_r = y_1 - η w_1
        y1 = x_prev - eta * v
        c = difference_radius(spec.local_clip, y1, x_prev)
        if c >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: local radius {c:g} too large for the canary to be "
                               "clipped")
        if c > 0:
            output = (y1 - x) / eta - v  # (1/b) Σ_(sampled) clipped differences + noise
            score += float(local_log_likelihood_ratio(output[0] / (c / spec.local_batch_size), q,
                                                      z3))
        v_prev, x_prev = v, x
    if server.state.round != spec.rounds:  # pragma: no cover - release() raises before this
        raise RuntimeError("the audited run stopped early")
    return score


# -------------------------------------------------------------------------------- distributed noise

@dataclass(frozen=True)
class _ScaledShares(DistributedNoise):
    """The run's distributed noise with every client's share of the variance multiplied by
    ``noise_scale``²: a mechanism broken on purpose, for the workers only (the server decodes and
    accounts with the run's settings).

    The round's code (scale, rounding bound, rotation) is the run's own, so that the server decodes
    what the workers encoded; only :meth:`share_variance`, the noise each client adds, differs. Only
    the audit builds this class; no config or API argument reaches it.
    """

    noise_scale: float = 1.0

    @functools.cached_property
    def run_noise(self) -> DistributedNoise:
        return DistributedNoise(**{f.name: getattr(self, f.name) for f in fields(DistributedNoise)})

    def code(self, r: int, restart: bool, radius: float) -> SkellamCode:
        return self.run_noise.code(r, restart, radius)

    def share_variance(self, code: SkellamCode, restart: bool, radius: float) -> float:
        return self.run_noise.share_variance(code, restart, radius) * self.noise_scale**2


def worker_noise(spec: AuditSpec, noise: DistributedNoise) -> DistributedNoise:
    """The distributed noise the audited clients add: the run's, or with ``spec.noise_scale`` != 1
    each share's std scaled (:class:`_ScaledShares`)."""
    if spec.noise_scale == 1.0:
        return noise
    return _ScaledShares(**{f.name: getattr(noise, f.name) for f in fields(DistributedNoise)},
                         noise_scale=spec.noise_scale)


def _secure_sum_results(results: list[tuple[_Proxy, FitRes]]) -> list[tuple[_Proxy, FitRes]]:
    """What Flower's SecAgg+ workflow hands ``aggregate_fit``: each survivor's FitRes (its metrics)
    with its parameters replaced by the unmasked mean of the survivors' centred messages (``Σ_p
    to_secagg(m_p) / k``).

    The masks cancel exactly and the quantisation is the identity on these messages
    (:mod:`~diff2_flwr.fl.secagg`; tests/test_secagg.py runs Flower's own arithmetic), so the audit
    forms the mean directly instead of masking.
    """
    arrays = [parameters_to_ndarrays(res.parameters) for _, res in results]
    mean = [np.sum([a[i] for a in arrays], axis=0) / len(arrays) for i in range(len(arrays[0]))]
    unmasked = ndarrays_to_parameters(mean)
    return [(proxy, FitRes(res.status, unmasked, res.num_examples, res.metrics))
            for proxy, res in results]


def _trial_distributed(spec: AuditSpec, noise: DistributedNoise, shares: DistributedNoise,
                       workers: Sequence[Worker], seed: int | None) -> float:
    """One run of the schedule under distributed noise through the real Strategy and clients; the LR
    score.

    ``configure_fit`` -> each surviving :class:`Diff2Client`'s ``fit`` with ``noise=`` (its clipped
    mean encoded with its Skellam share: ``encode_share``) -> SecAgg+'s unmasked mean
    (:func:`_secure_sum_results`) -> ``aggregate_fit`` (``decode_secure_sum`` ->
    :meth:`Diff2Server.release_sum`: decode, Skellam ledger, budget guard). The last
    ``spec.tolerated`` clients (never worker 0) drop out every round. ``shares``: the noise the
    clients add (:func:`worker_noise`); the server has the run's ``noise``.

    The adversary reads the announced radius and the released ṽ_r and round row (its ``noise_std``,
    the std of the decoded mean's noise, and the survivors k) and scores S = Σ_r (Δ_r / s_r²) ⟨ṽ_r −
    ṽ_{r−1}·[difference], e⟩ with Δ_r = 2 C_r/(n_min k) and s_r = ``noise_std``: the central audit's
    statistic. The decoded noise is Skellam (plus the rounding errors), not Gaussian, so this is the
    Gaussian-optimal linear test rather than the exact Neyman–Pearson one; any fixed test's error
    rates bound ε from below, so the bound stays valid (and the Skellam of variance (zΔ₂)² >> 1 is
    close to the Gaussian: little power is lost).
    """
    # the server adds none: the clients' shares are the noise
    mechanism = Mechanism(restart_every=spec.period, clip_restart=spec.clip_restart,
                          clip_diff=spec.clip_diff, sigma_restart=0.0, sigma_diff=0.0)
    server = Diff2Server(
        _server_spec(spec, mechanism, workers[0].gradients.layout, calibration=None,
                     distributed=noise),
        x0=np.zeros(spec.dim), seed=seed)
    strategy = Diff2Strategy(server=server)
    proxies = {f"node-{1000 + p}": _Proxy(f"node-{1000 + p}") for p in range(spec.clients)}
    manager = _Manager(proxies)

    # as the ClientApp rebuilds them from the run config
    def settings(n_min: int, dim: int) -> DistributedNoise:
        if (n_min, dim) != (shares.n_min, shares.dim):
            raise RuntimeError(f"the task's n_min, dim = {n_min}, {dim}; the audit's are "
                               f"{shares.n_min}, {shares.dim}")
        return shares

    clients = {cid: Diff2Client(w, noise=settings, seed=seed) for cid, w in zip(proxies, workers)}
    dropped = set(list(proxies)[spec.clients - spec.tolerated:])
    score, v_prev = 0.0, np.zeros(spec.dim)
    for rnd in range(1, spec.rounds + 1):
        instructions = strategy.configure_fit(rnd, None, manager)  # type: ignore[arg-type]
        results, failures = [], []
        for proxy, ins in instructions:
            if proxy.cid in dropped:
                failures.append(ConnectionError(f"{proxy.cid} dropped out (the audit's t = "
                                                f"{spec.tolerated})"))
                continue
            arrays, n, metrics = clients[proxy.cid].fit(parameters_to_ndarrays(ins.parameters),
                                                        ins.config)
            results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n,
                                          metrics)))
        strategy.aggregate_fit(rnd, _secure_sum_results(results),  # type: ignore[arg-type]
                               failures)
        row = server.history[-1]
        config = instructions[0][1].config
        restart, radius = config[protocol.KIND] == "restart", float(config[protocol.RADIUS])
        # release_sum raises before this
        if row["round"] != rnd or row["radius"] != radius:  # pragma: no cover
            raise RuntimeError(f"round {rnd}: the released row is not this round's")
        if radius >= CANARY_MARGIN:
            raise RuntimeError(f"round {rnd}: radius {radius:g} too large for the canary to be "
                               "clipped")
        v = server.state.v
        increment = v if restart else v - v_prev
        if radius > 0:  # radius 0: nothing depends on the data, nothing to score
            sensitivity, s = 2.0 * radius / (spec.samples * row["survivors"]), row["noise_std"]
            score += sensitivity / s**2 * float(increment[0])
        v_prev = v
    if server.state.round != spec.rounds:  # pragma: no cover - release_sum() raises before this
        raise RuntimeError("the audited run stopped early")
    return score


def _seed(spec: AuditSpec, federation: int, index: int) -> int | None:
    if spec.seed is None:
        return None  # fresh OS entropy per trial, as in production
    state = np.random.SeedSequence([spec.seed, federation, index]).generate_state(
        2, dtype=np.uint64)
    return int(state[0]) << 64 | int(state[1])


def _chunk(spec: AuditSpec, claimed: Calibration, run: Calibration, federation: int, start: int,
           stop: int, noise: DistributedNoise | None = None) -> np.ndarray:
    torch.set_num_threads(1)
    workers = _workers(spec, +1 if federation == 1 else -1)
    if noise is not None:
        shares = worker_noise(spec, noise)
        return np.array([_trial_distributed(spec, noise, shares, workers,
                                            _seed(spec, federation, i))
                         for i in range(start, stop)])
    if spec.sampled:
        return np.array([_trial_sampled(spec, claimed, workers, _seed(spec, federation, i))
                         for i in range(start, stop)])
    if spec.local:
        return np.array([_trial_local(spec, claimed, run, workers, _seed(spec, federation, i))
                         for i in range(start, stop)])
    return np.array([_trial(spec, claimed, workers, _seed(spec, federation, i))[0]
                     for i in range(start, stop)])


def audit_scores(spec: AuditSpec, progress: Callable[[str], None] | None = None,
                 calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LR scores of ``spec.trials`` runs on D (canary +) and on D′ (canary −); ``calibration``: the
    spec's, if already computed (the local routine's PLD calibration is slow; the worker processes
    receive it)."""
    claimed = calibration if calibration is not None else spec.calibration()
    run = mechanism_run(spec, claimed) if spec.local else claimed
    noise = spec.distributed_noise() if spec.distributed else None
    chunk = max(1, min(500, spec.trials // (4 * spec.workers)))
    jobs = [(fed, s, min(s + chunk, spec.trials), noise) for s in range(0, spec.trials, chunk)
            for fed in (1, 0)]
    started, done = time.perf_counter(), 0

    def report(job: tuple) -> None:
        nonlocal done
        done += job[2] - job[1]
        if progress:
            elapsed = time.perf_counter() - started
            eta = elapsed / done * (2 * spec.trials - done)
            progress(f"[audit] {done}/{2 * spec.trials} runs, {done / elapsed:.0f} runs/s, ETA "
                     f"{eta:.0f} s")

    results = run_chunks(functools.partial(_chunk, spec, claimed, run), jobs, spec.workers, report)
    d, d_prime = (np.concatenate([a for job, a in zip(jobs, results) if job[0] == f])
                  for f in (1, 0))
    return d, d_prime
