"""The experiment: one frozen, validated value of every section (see
:mod:`diff2_flwr.runtime.spec`), the checks across sections, and what the runtime derives from it
(P, T, the calibration, the mechanism)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.distributed import DistributedNoise, distributed_noise
from ..core.estimator import Mechanism
from ..core.local import LocalMechanism
from ..core.privacy import Calibration, calibrate
from .config_data import DatasetConfig, ModelConfig
from .config_training import (AUTO_CLIENTS_DEFAULT, CLIENTS_AUTO, EvaluationConfig, LocalConfig,
                              OutputConfig, PrivacyConfig, TrainingConfig)
from .spec import ConfigError, Invalid, Kwargs, key_error, require, setting

__all__ = ["ExperimentConfig", "Method"]

Method = Literal["gd", "dpgd", "diff2"]


@dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: dataset, model, method, privacy budget and training schedule."""

    name: str = setting("experiment", "prefix of the run folder (no path separators)",
                        identifies=False)
    method: Method = setting("diff2",
                             "gd (no privacy: no clipping, no noise, T = 1), dpgd (T = 1), diff2")
    dataset: DatasetConfig = setting(factory=DatasetConfig, help="the data and how it is sharded")
    model: ModelConfig = setting(factory=ModelConfig, help="the model and its per-sample loss")
    privacy: PrivacyConfig = setting(factory=PrivacyConfig,
                                     help="the target (ε, δ) and its accounting")
    training: TrainingConfig = setting(factory=TrainingConfig,
                                       help="the schedule, clipping, routine and clients")
    local: LocalConfig = setting(factory=LocalConfig,
                                 help="DIFF2's private BVR-L-SGD local routine")
    evaluation: EvaluationConfig = setting(factory=EvaluationConfig,
                                           help="what is measured on each released x_r",
                                           identifies=False)
    output: OutputConfig = setting(factory=OutputConfig, help="where the run writes",
                                   identifies=False)
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        require(bool(self.name) and "/" not in self.name and "\\" not in self.name, "name",
                "a non-empty string without path separators (the run folder's prefix)", self.name)
        d = self.dataset
        # said by the loss, or required: a column of 0s and 1s may be either
        if d.name == "csv" and d.task is None:
            require(self.model.loss != "auto", "dataset.task",
                    "regression or classification for dataset csv (or model.loss: cross_entropy, "
                    "which means classification; half_squared_error, regression)", None)
            if self.model.loss == "cross_entropy":
                object.__setattr__(self, "dataset", dataclasses.replace(d, task="classification"))
        t = self.training
        if self.method == "diff2":
            require(t.restart_every is not None, "training.restart_every",
                    "an integer T >= 1 for method diff2", None)
        elif t.restart_every not in (None, 1):
            raise Invalid(
                "training.restart_every",
                f"1 or null for method {self.method} (T = 1; use method diff2 for T > 1)",
                t.restart_every,
            )
        require(self.restart_every <= t.rounds, "training.restart_every",
                 f"at most training.rounds = {t.rounds} (T > R never restarts)", t.restart_every)
        if t.clients != CLIENTS_AUTO:  # else checked when a federation resolves P (with_clients)
            self._check_clients(t.clients)
        if self.dataset.shards:
            require(not self.evaluation.train_metrics, "evaluation.train_metrics",
                     "false with dataset.shards (in a deployment the server holds no training "
                     "data)",
                     self.evaluation.train_metrics)
        if self.loss == "half_squared_error":
            require(self.dataset.task_kind == "regression", "model.loss",
                     f"cross_entropy (or auto) for the classification dataset {self.dataset.name}",
                     self.model.loss)
        # one output per class: a regression target is no class index
        if self.loss == "cross_entropy":
            csv = " (or dataset.task: classification)" if self.dataset.name == "csv" else ""
            require(self.dataset.task_kind == "classification", "model.loss",
                    f"half_squared_error (or auto) for the regression dataset "
                    f"{self.dataset.name}{csv}", self.model.loss)
        if t.gradients == "closed_form":
            require(self.model.is_paper_mlp and self.loss == "half_squared_error",
                    "training.gradients",
                     "'auto' or 'torch_func' unless model.name is paper_mlp with loss "
                     "half_squared_error (the closed form is for that model)", t.gradients)
        if self.local.enabled:
            require(self.method == "diff2", "local.steps",
                    "0 unless method is diff2 (the local routine is DIFF2's)",
                     self.local.steps)
            require(self.privacy.mode == "exact", "privacy.mode",
                     "exact with local.steps > 0 (the local routine is calibrated with "
                     "dp-accounting's PLD)",
                     self.privacy.mode)
            require(t.routine.name == "gd", "training.routine",
                     "gd with local.steps > 0 (the local routine computes x_r itself: its y_1 = "
                     "x_(r-1) - η ṽ_r is the GD step)", t.routine.name)
            require(t.schedule.constant, "training.schedule",
                    "constant with local.steps > 0 (the chosen worker takes x_r's local steps with "
                    "η = training.learning_rate, which its node checks against the run config: "
                    "no schedule reaches them)", t.schedule.to_yaml())
            require(self.output.checkpoint is None, "output.checkpoint",
                     "null with local.steps > 0 (checkpoints of the local routine are not "
                     "supported yet)",
                     self.output.checkpoint)
        if t.sampling.enabled:
            self._check_sampling()
        if self.privacy.distributed:
            self._check_distributed()
        if not t.schedule.constant:
            last = t.learning_rate * t.schedule.build().factor(t.rounds, t.rounds)
            require(last > 0, "training.schedule",
                    f"a schedule whose step η·s(r) stays > 0 over the R = {t.rounds} rounds (its "
                    f"last, η·s(R), underflows to {last!r}: decay less, or less often)",
                    t.schedule.to_yaml())
        if self.private:
            for key in ("clip_restart", "clip_diff"):
                v = getattr(t, key)
                require(math.isfinite(v), f"training.{key}",
                        f"a finite radius for private method {self.method}", v)
            if self.restart_every > 1:
                u = self.privacy.u
                require(math.isfinite(u) and u > 1, "privacy.u",
                        "a finite number > 1 when restart_every > 1 "
                         "(the paper uses 1.25)", u)

    def _check_sampling(self) -> None:
        """What ``training.sampling`` does not combine with (yet), with the reason."""
        kind = self.training.sampling.kind
        require(not self.local.enabled, "local.steps",
                f"0 with training.sampling ({kind}): the local routine's worker and steps are "
                "not accounted for a sampled cohort", self.local.steps)
        require(not self.privacy.distributed, "privacy.noise",
                f"central with training.sampling ({kind}): the Skellam shares are calibrated for "
                "all P clients, and a sampled cohort would carry less noise than the ledger "
                "charges", self.privacy.noise)
        require(not self.private or self.privacy.mode == "exact", "privacy.mode",
                f"exact with training.sampling ({kind}): client-sampled rounds are calibrated "
                "with dp-accounting's PLD (no zCDP closed form)", self.privacy.mode)

    def _check_distributed(self) -> None:
        """What ``privacy.noise: distributed`` does not support (yet), with the reason."""
        require(self.private, "privacy.noise",
                f"central for method {self.method} (no noise to distribute)", self.privacy.noise)
        require(not self.local.enabled, "local.steps",
                "0 with privacy.noise: distributed (the local phase's y_K is one worker's output, "
                "sent to the server in the clear with noise drawn from a seed the server may "
                "send: no secure sum hides it)",
                self.local.steps)
        require(not self.evaluation.clip_stats, "evaluation.clip_stats",
                "false with privacy.noise: distributed (the server sees no client's clip count)",
                self.evaluation.clip_stats)

    def _check_clients(self, clients: int) -> None:
        """The checks that depend on P."""
        size = self.training.sampling.size
        if self.training.sampling.kind == "fixed":
            require(size <= clients, "training.sampling.size",
                    f"at most the P = {clients} clients (training.clients)", size)
        tolerated = self.privacy.tolerated
        if self.privacy.distributed:
            require(clients >= 2 and 2 * tolerated < clients, "privacy.tolerated",
                    f"an integer t with 2t < P = {clients} (the P - t survivors SecAgg+ needs to "
                    f"unmask must outnumber "
                    "the t colluders; P >= 2)", tolerated)
        part, sizes = self.dataset.partitioner, self.dataset.partitioner.sizes
        if part.name == "pathological" and self.dataset.task_kind == "regression":
            bins = part.num_bins(clients)
            require(part.classes_per_client <= bins, "dataset.partitioner.classes_per_client",
                     f"at most the {bins} target bins of dataset {self.dataset.name} "
                     f"(dataset.partitioner.bins{'' if part.bins else ', null: one per client'})",
                     part.classes_per_client)
        if part.name == "size":
            require(len(sizes) == clients, "dataset.partitioner.sizes",
                     f"one size per client: training.clients = {clients} sizes", list(sizes))
        need = clients * part.min_samples
        if self.dataset.train_samples is not None:
            require(self.dataset.train_samples >= need, "dataset.train_samples",
                     f"at least training.clients × dataset.partitioner.min_samples = {clients} × "
                     f"{part.min_samples} = {need} records (every client needs "
                     f"{part.min_samples}); keep more "
                     "records or use fewer clients", self.dataset.train_samples)

    @property
    def clients_auto(self) -> bool:
        """Whether P is ``auto``: the SuperNodes of the federation that runs the config (see
        :data:`CLIENTS_AUTO`)."""
        return self.training.clients == CLIENTS_AUTO

    @property
    def clients(self) -> int:
        """P. A config with ``training.clients: auto`` has none until a federation resolves it
        (:meth:`with_clients`): asking for it then is an error that says so."""
        if self.clients_auto:
            raise ConfigError(
                f"{self.source}: key `training.clients`: expected the number of clients P here. "
                f"Found 'auto', which "
                "only a federation resolves (a Flower simulation: its SuperNodes; `diff2 run`: "
                f"{AUTO_CLIENTS_DEFAULT}, or --set training.clients=N). Set training.clients to "
                f"the number of data "
                "owners.", key="training.clients", expected="the number of clients P",
                found=CLIENTS_AUTO)
        return int(self.training.clients)

    def with_clients(self, clients: int, origin: str = "") -> ExperimentConfig:
        """This config with P = ``clients`` (how ``training.clients: auto`` is resolved; also a
        fixed P), checked again with that P; ``origin`` says where the number came from in an error
        (e.g. "the simulation's SuperNodes")."""
        try:
            return dataclasses.replace(self, training=dataclasses.replace(self.training,
                                                                          clients=clients))
        except Invalid as err:
            because = f" (P = {clients}: {origin})" if origin else ""
            raise key_error(self.source + because,
                            err.key if "." in err.key else f"training.{err.key}",
                             err.expected, err.found) from None

    @property
    def private(self) -> bool:
        """Whether the run is differentially private (any method but ``gd``)."""
        return self.method != "gd"

    @property
    def loss(self) -> str:
        """The loss: the configured one, or by task (½-squared error / cross-entropy)."""
        if self.model.loss != "auto":
            return self.model.loss
        return "cross_entropy" if self.dataset.task_kind == "classification" else (
            "half_squared_error")

    @property
    def closed_form_gradients(self) -> bool:
        """Whether workers use the closed-form (ghost clipping) path rather than generic
        torch.func."""
        if self.training.gradients == "auto":
            return self.model.is_paper_mlp and self.loss == "half_squared_error"
        return self.training.gradients == "closed_form"

    @property
    def restart_every(self) -> int:
        """T: 1 for gd and dpgd, the configured value for diff2."""
        return 1 if self.method != "diff2" else int(self.training.restart_every or 1)

    def calibration(self, n_min: int) -> Calibration | None:
        """The central noise calibration for shards of at least ``n_min`` samples (None for gd and
        for distributed noise: :meth:`distributed_noise`)."""
        if not self.private or self.privacy.distributed:
            return None
        p = self.privacy
        return calibrate(
            epsilon=p.epsilon, delta=p.delta, rounds=self.training.rounds,
            restart_every=self.restart_every, u=p.u, n_min=n_min, clients=self.clients, mode=p.mode,
            **({"local_steps": self.local.steps, "local_batch_size": self.local.batch_size,
                "local_share": self.local.share} if self.local.enabled else {}),
            **({"sampling": self.training.sampling.build()}
               if self.training.sampling.enabled else {}),
        )

    def distributed_noise(self, n_min: int, dim: int) -> DistributedNoise:
        """The public settings of ``privacy.noise: distributed`` for shards of at least ``n_min``
        records and a model of ``dim`` parameters: the Skellam calibration for (ε, δ), the bits, t,
        the wrap-around bound."""
        p = self.privacy
        return distributed_noise(epsilon=p.epsilon, delta=p.delta, rounds=self.training.rounds,
                                 restart_every=self.restart_every, u=p.u, dim=dim, bits=p.bits,
                                 clients=self.clients, tolerated=p.tolerated, n_min=n_min,
                                 wrap=p.wrap)

    def mechanism(self, calibration: Calibration | None) -> Mechanism:
        """T, C1, C2, σ1, σ2 for the estimator: no clipping and no noise for gd; clipping and no
        server noise with distributed noise (the clients add it)."""
        t = self.training
        if self.private and self.privacy.distributed:
            return Mechanism(self.restart_every, t.clip_restart, t.clip_diff, 0.0, 0.0)
        if calibration is None:
            return Mechanism(self.restart_every, math.inf, math.inf, 0.0, 0.0)
        return Mechanism(self.restart_every, t.clip_restart, t.clip_diff,
                         calibration.sigma1, calibration.sigma2 or 0.0)

    def local_mechanism(self, calibration: Calibration | None) -> LocalMechanism | None:
        """K, b, η, C3, σ3 of the local routine (None when it is off)."""
        if not self.local.enabled or calibration is None or calibration.local is None:
            return None
        loc = self.local
        return LocalMechanism(loc.steps, loc.batch_size, self.training.learning_rate, loc.clip,
                              calibration.local.sigma3)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON data (lists, not tuples) that :func:`parse_config` turns back into this
        config."""
        def plain(value: Any) -> Any:
            if isinstance(value, Kwargs):
                return value.as_dict()
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        out = plain(dataclasses.asdict(self))
        out.pop("source")
        out["training"]["routine"] = self.training.routine.to_yaml()
        out["training"]["schedule"] = self.training.schedule.to_yaml()
        return out
