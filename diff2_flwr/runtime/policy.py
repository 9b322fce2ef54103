"""A data owner's node policy: what a run may ask of this node's records, set by the node's operator
only.

Where it comes from (never from the run config, which the run submitter writes):

- a deployment: Flower's node config, ``flower-supernode --node-config "...
  policy='/etc/diff2/policy.yaml'"`` (``Context.node_config["policy"]``), which only the SuperNode's
  operator sets;
- a simulation on one's own machine: the environment variable ``DIFF2_NODE_POLICY`` of the process
  that runs the simulated nodes (``diff2 run --node-policy FILE`` sets it for the SuperLink it
  starts; before a plain ``flwr run .``, export it before the local SuperLink starts). Every
  simulated node then holds the policy.

Example (``configs/policy.yaml``)::

    name: hospital-a         # how refusals name this node (default: its partition)
    max_epsilon: 3.0         # the largest ε one run may spend here (privacy.epsilon)
    max_delta: 1.0e-5        # the largest δ one run may use (privacy.delta)
    methods: [dpgd, diff2]   # methods a run may use (gd releases unnoised means: never)
    models: [paper_mlp]      # model factories a run may call here (default: the built-in ones)
    max_rounds: 2000         # the most rounds one run may take (null: no limit)
    local_routine: true      # whether the private local routine may run on these records
    noise: [distributed]     # who may add the noise: central (the server) and/or distributed
    min_honest: 3            # distributed: the fewest honest clients (P - t) carrying the noise
    n_min: 240               # the federation's n_min, agreed out of band (null: any declared)
    allow_seeded: false      # a seeded run fixes this node's noise for whoever knows the seed
    lifetime:                # a budget over every run this node takes part in, composed by PLD
      epsilon: 10.0
      delta: 1.0e-5
      ledger: ledger.json    # the node's durable ledger (owner-only), relative to this file
      sampled_runs: refuse   # a client-sampled run: refuse (default), unamplified (charged as if
                             # this node were in every round: no trust in the server's draws) or
                             # amplified (its amplified ε: trusts the server to draw as declared)
    answers: answers.log     # each (run, round, stage) answered, once (owner-only)
    canaries:                # audit each run live from this node (diff2 audit --live FOLDER)
      count: 64              # canary records added to this node's replies (even; 0: none)
      state: canaries        # the owner-only folder of their secret seed and observations

Trust (``THREATS.md``): the policy protects this node's records against a run submitter whose run
config asks too much (ε, δ, method, model, rounds, the lifetime budget) and against a server whose
tasks disagree with the mechanism the run config declares (radius, round kind, n_min, σ3, q, b, K:
:mod:`~diff2_flwr.runtime.node_guard`). It cannot protect against an app bundle that is not ours
(the ClientApp that enforces it comes from the bundle: pin bundles with Flower's trusted entities),
nor, under central noise, against a server that sees the clipped means and leaks them, nor, where
its operator chose ``lifetime.sampled_runs: amplified``, against a server that draws a
client-sampled run's cohorts other than as declared (no node can check the draws). By default
(``refuse``) a node with a lifetime budget refuses sampled runs, so its ledger relies on nothing of
the server's; ``unamplified`` takes them without relying on the draws, charged in full at
admission as if the node were in every round (more ε: DIFF2 at q = 0.3 over 100 rounds, T = 10,
calibrated to ε 3, is charged 4.90 instead of 2.98). Whether the server adds less noise than
declared the node can check, live, with ``canaries`` (:mod:`~diff2_flwr.runtime.canary_monitor`;
the run must then use central noise, routine gd, the constant schedule and no local steps).
``noise: [distributed]`` refuses central runs: the node's message then leaves only inside SecAgg+,
with its own noise share (:mod:`diff2_flwr.fl.secagg`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .answer_log import AnswerLog
from .node_mode import simulated_node
from .config import ConfigError, ExperimentConfig, PAPER_MLP, parse_section, read_yaml, require

__all__ = ["BUILTIN_MODELS", "ENV_VAR", "NODE_CONFIG_KEY", "REFUSAL_END", "SAMPLED_RUNS",
           "CanaryPolicy", "LifetimeBudget", "refusal_in",
           "NodePolicy",
           "PolicyError", "Refused", "answer_log_of", "check_run", "load_policy", "policy_path"]

#: Node config key (``--node-config "policy='/path/policy.yaml'"``) and environment variable naming
#: the policy.
NODE_CONFIG_KEY = "policy"
ENV_VAR = "DIFF2_NODE_POLICY"

#: The models a node allows when its policy names none (and a deployment node without a policy):
#: ours only.
BUILTIN_MODELS: tuple[str, ...] = (PAPER_MLP, "diff2_flwr.task.models:TanhMLP",
                                   "diff2_flwr.task.models:DigitsCNN")
_PRIVATE_METHODS = ("dpgd", "diff2")


class PolicyError(ConfigError):
    """An invalid or unreadable policy file (the node's operator must fix it)."""


class Refused(ValueError):
    """A node refuses a run or a task: nothing was computed on its records and nothing is released.

    ``node`` names the node, ``rule`` the policy or calibration rule that failed.
    """

    def __init__(self, node: str, rule: str, detail: str, *, message: str | None = None) -> None:
        super().__init__(
            message
            or f"{node} refused: rule `{rule}`: {detail} Nothing was computed on this node's "
                         "records; the round releases nothing.")
        self.node, self.rule, self.detail = node, rule, detail


#: How every refusal's message ends (:class:`Refused`, the answer log's replay refusal).
REFUSAL_END = "releases nothing."
def refusal_in(text: str) -> str | None:
    """The first node refusal (``<node> refused: rule `<rule>`: ... releases nothing.``) quoted in
    ``text`` — a failure as Flower reports it (its reason, a traceback) — or None. The server puts
    it first and alone, so that a refusal is one line wherever the run's error is shown."""
    for line in text.splitlines():
        at = line.find(" refused: rule `")
        if at < 0:
            continue
        # the node's name: from the leftmost "node " or "every " that reaches `at` without a ": "
        # (the exception's name or Flower's words before it end with one)
        start = at
        for word in ("node ", "every "):
            found = line.rfind(word, 0, at)
            while found >= 0 and ": " not in line[found:at]:
                start = min(start, found)
                found = line.rfind(word, 0, found)
        end = line.find(REFUSAL_END, at)
        message = (line[start:end + len(REFUSAL_END)] if end >= 0 else
                   line[start:].rstrip("'>). "))
        return message.strip()
    return None


#: How a node with a lifetime budget takes a client-sampled run (``lifetime.sampled_runs``).
SAMPLED_RUNS: tuple[str, ...] = ("refuse", "unamplified", "amplified")
_SAMPLED_RUNS_EXPECTED = (
    "refuse (the default: a client-sampled run is refused), unamplified (charged as if this node "
    "were in every round: no trust in the server's cohort draws) or amplified (charged its "
    "amplified ε: trusts the server to draw the cohorts as declared)")


@dataclass(frozen=True)
class LifetimeBudget:
    """(ε, δ) over every run the node takes part in, the durable ledger that composes them, and how
    a client-sampled run is charged.

    ``sampled_runs`` (:data:`SAMPLED_RUNS`): a client-sampled run (``training.sampling``) costs its
    amplified ε only if the server draws every cohort as declared (each client with probability π,
    from the server's own entropy, independently of the data and of earlier rounds). No node can
    check the draws: a server that put this node in every round would spend up to the unamplified ε
    of the same noise (ε 4.90 where the amplified charge is 2.98, for DIFF2 at q = 0.3 over 100
    rounds, T = 10, calibrated to ε 3).

    - ``refuse`` (the default): sampled runs are refused at admission; the node's lifetime limit
      relies on nothing of the server's.
    - ``unamplified``: admitted, charged as if the node were in every round — each sampled event
      [z, π, count] as ``count`` full Gaussian rounds of z (π = 1). That bounds the node's loss
      whatever cohorts the server draws (a round the node is not asked does not touch its
      records; one it is asked is the Gaussian mechanism of multiplier z), so it relies on no
      draw, at the price of more ε. It is charged in full at admission: the node cannot know
      which rounds it will be asked, and refunding the rounds it was not asked would need a
      privacy-filter argument, not made here.
    - ``amplified``: admitted, charged its amplified ε (the run's ``SampledGaussianEvent`` s),
      which trusts the server to draw the cohorts as declared.

    Either charge is composed with the node's other runs by PLD. ``trust_server_sampling`` is the
    key's older form, read as an alias (true: ``amplified``, false: ``refuse``); a policy sets one
    of the two, not both. Once built, ``sampled_runs`` holds the mode and ``trust_server_sampling``
    is None (read into it).
    """

    epsilon: float | None = None
    delta: float | None = None
    ledger: str | None = None
    # validated below (a YAML true/false gets the list of values, not "expected a string")
    sampled_runs: object = None
    trust_server_sampling: bool | None = None

    def __post_init__(self) -> None:
        keys = ("epsilon", "delta", "ledger")
        missing = [k for k in keys if getattr(self, k) is None]
        if 0 < len(missing) < 3:
            require(False, missing[0],
                    "a value: a lifetime budget needs epsilon, delta and ledger together", None)
        if self.epsilon is not None:
            require(math.isfinite(self.epsilon) and self.epsilon > 0, "epsilon",
                    "a finite number > 0", self.epsilon)
            require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
            require(bool(self.ledger), "ledger", "the ledger file's path", self.ledger)
        given, alias = self.sampled_runs, self.trust_server_sampling
        require(given is None or alias is None, "sampled_runs",
                "only one of lifetime.sampled_runs and lifetime.trust_server_sampling (its older "
                "name: true is amplified, false is refuse): remove lifetime.trust_server_sampling",
                {"sampled_runs": given, "trust_server_sampling": alias})
        require(given is None or (isinstance(given, str) and given in SAMPLED_RUNS),
                "sampled_runs", _SAMPLED_RUNS_EXPECTED, given)
        mode = given if given is not None else "amplified" if alias else "refuse"
        if alias is None:
            require(self.enabled or mode == "refuse", "sampled_runs",
                    "refuse without a lifetime budget (epsilon, delta, ledger): it says how that "
                    "budget's ledger charges a client-sampled run; set the budget or remove the "
                    "key", given)
        else:
            require(self.enabled or mode == "refuse", "trust_server_sampling",
                    "false without a lifetime budget (epsilon, delta, ledger): it says whether "
                    "that budget's ledger may charge a client-sampled run; set the budget or "
                    "remove the key", alias)
        # the alias is read into the mode (so that dataclasses.replace builds the same budget)
        object.__setattr__(self, "sampled_runs", mode)
        object.__setattr__(self, "trust_server_sampling", None)

    @property
    def enabled(self) -> bool:
        """Whether the node keeps a lifetime budget (ε, δ and the ledger set)."""
        return self.epsilon is not None


@dataclass(frozen=True)
class CanaryPolicy:
    """B canary records this node adds to its own replies, and the folder of their secret and
    observations (:mod:`~diff2_flwr.runtime.canary_monitor`)."""

    count: int = 0
    state: str = "canaries"

    def __post_init__(self) -> None:
        require(isinstance(self.count, int) and not isinstance(self.count, bool) and self.count >= 0
                and self.count % 2 == 0, "count",
                "an even integer >= 0: canary records per reply, half + and half "
                "- (0: no canaries)", self.count)
        require(isinstance(self.state, str) and bool(self.state.strip()), "state",
                "the folder (owner-only) of the canaries' secret seed and observations", self.state)

    @property
    def enabled(self) -> bool:
        """Whether the node adds canary records to its replies (``count`` > 0)."""
        return self.count > 0


@dataclass(frozen=True)
class NodePolicy:
    """A data owner's limits (see the module). ``max_epsilon`` and ``max_delta`` are required."""

    max_epsilon: float | None = None
    max_delta: float | None = None
    methods: tuple[str, ...] = _PRIVATE_METHODS
    models: tuple[str, ...] = BUILTIN_MODELS
    max_rounds: int | None = None
    local_routine: bool = True
    noise: tuple[str, ...] = ("central", "distributed")
    min_honest: int = 1
    n_min: int | None = None
    allow_seeded: bool = False
    lifetime: LifetimeBudget = field(default_factory=LifetimeBudget)
    canaries: CanaryPolicy = field(default_factory=CanaryPolicy)
    answers: str = "answers.log"
    name: str | None = None
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        require(self.max_epsilon is not None and math.isfinite(self.max_epsilon)
                and self.max_epsilon > 0,
                "max_epsilon",
                "a finite number > 0: the largest ε per run this node accepts (required)",
                self.max_epsilon)
        require(self.max_delta is not None and 0 < self.max_delta < 1, "max_delta",
                "a number in (0, 1): the largest δ per run this node accepts (required)",
                self.max_delta)
        require(bool(self.methods) and set(self.methods) <= set(_PRIVATE_METHODS), "methods",
                f"a non-empty list of {list(_PRIVATE_METHODS)} (gd adds no noise: no policy "
                f"allows it)",
                list(self.methods))
        require(bool(self.models), "models",
                "a non-empty list of model names ('paper_mlp' or 'package.module:callable')",
                list(self.models))
        require(self.max_rounds is None or self.max_rounds >= 1, "max_rounds",
                "null or an integer >= 1", self.max_rounds)
        require(self.name is None or bool(self.name.strip()), "name", "null or a non-empty name",
                self.name)
        require(bool(self.noise) and set(self.noise) <= {"central", "distributed"}, "noise",
                "a non-empty list of 'central' (the server adds the noise: trusted) and "
                "'distributed' (each client adds a share, the server sees only the SecAgg+ sum)",
                list(self.noise))
        require(self.n_min is None or (isinstance(self.n_min, int) and self.n_min >= 1), "n_min",
                "null or an integer >= 1: the federation's n_min, agreed by the data owners (a "
                "run must declare the same privacy.n_min)", self.n_min)
        require(isinstance(self.answers, str) and bool(self.answers.strip()), "answers",
                "the file (owner-only) where the node records each (run, round, stage) it answered",
                self.answers)
        require(isinstance(self.min_honest, int) and self.min_honest >= 1, "min_honest",
                "an integer >= 1: the fewest honest clients (P - t) whose noise shares must carry "
                "a distributed run",
                self.min_honest)

    def _beside(self, value: str) -> Path:
        """A path the policy names: relative ones are relative to the policy file's folder."""
        path = Path(value).expanduser()
        if not path.is_absolute() and self.source not in ("<memory>", ""):
            path = Path(self.source).resolve().parent / path
        return path

    def canary_folder(self, partition_id: int, shared: bool) -> Path:
        """The canaries' state folder; ``shared`` (simulated nodes reading one policy): one per
        partition."""
        path = self._beside(self.canaries.state)
        return path / f"partition-{partition_id}" if shared else path

    def answers_path(self, partition_id: int, shared: bool) -> Path:
        """The node's answer log (:mod:`~diff2_flwr.runtime.answer_log`); ``shared``: one file per
        partition."""
        path = self._beside(self.answers)
        return path.with_name(
            f"{path.stem}.partition-{partition_id}{path.suffix}") if shared else path

    def ledger_path(self, partition_id: int, shared: bool) -> Path | None:
        """The node's ledger file; ``shared`` (simulated nodes reading one policy): one file per
        partition."""
        if not self.lifetime.enabled:
            return None
        path = self._beside(self.lifetime.ledger)  # type: ignore[arg-type]
        return path.with_name(
            f"{path.stem}.partition-{partition_id}{path.suffix}") if shared else path


def load_policy(path: str | os.PathLike[str]) -> NodePolicy:
    """Read and validate a policy file; errors name the file, the key, what was expected and what
    was found."""
    path = Path(path)
    data = read_yaml(path, "node policy", PolicyError)
    try:
        policy = parse_section(NodePolicy, data, str(path))
    except ConfigError as err:
        raise PolicyError(str(err), key=err.key, expected=err.expected, found=err.found) from None
    return dataclasses.replace(policy, source=str(path))


def answer_log_of(node_config: Mapping[str, Any],
                  environ: Mapping[str, str] = os.environ) -> AnswerLog | None:
    """The answer log of the node whose node config this is: its policy's ``answers`` file (one per
    partition when simulated nodes share a policy from ``$DIFF2_NODE_POLICY``); None for a node
    without a policy."""
    path = policy_path(node_config, environ)
    if path is None:
        return None
    # as NodeGuard.admit_run decides
    shared = NODE_CONFIG_KEY not in node_config and simulated_node(node_config)
    return AnswerLog(load_policy(path).answers_path(int(node_config.get("partition-id", 0)),
                                                    shared))


def policy_path(node_config: Mapping[str, Any], environ: Mapping[str,
                                                                 str] = os.environ) -> str | None:
    """The policy file this node's operator named: the node config's ``policy``, else
    ``$DIFF2_NODE_POLICY``."""
    value = node_config.get(NODE_CONFIG_KEY) or environ.get(ENV_VAR) or None
    return None if value is None else str(value)


def _run_epsilon(cfg: ExperimentConfig) -> float:
    return cfg.privacy.epsilon if cfg.private else math.inf


def check_run(policy: NodePolicy, cfg: ExperimentConfig, node: str) -> None:
    """Refuse (:class:`Refused`) a run config the policy does not allow, before any record is
    touched."""
    where = f"(policy {policy.source})"
    if cfg.method not in policy.methods:
        raise Refused(node, "methods",
                      f"the run asks method {cfg.method!r}; this node allows "
                      f"{list(policy.methods)} {where}.")
    if _run_epsilon(cfg) > policy.max_epsilon:  # type: ignore[operator]
        raise Refused(node, "max_epsilon",
                      f"the run asks ε = {cfg.privacy.epsilon:g} (privacy.epsilon); this node "
                      f"allows at most ε = {policy.max_epsilon:g} per run {where}. Ask for ε <= "
                      f"{policy.max_epsilon:g}.")
    if cfg.privacy.delta > policy.max_delta:  # type: ignore[operator]
        raise Refused(node, "max_delta",
                      f"the run asks δ = {cfg.privacy.delta:g} (privacy.delta); this node allows "
                      f"at most δ = {policy.max_delta:g} per run {where}.")
    if policy.max_rounds is not None and cfg.training.rounds > policy.max_rounds:
        raise Refused(node, "max_rounds",
                      f"the run asks {cfg.training.rounds} rounds (training.rounds); this node "
                      f"allows at most {policy.max_rounds} {where}.")
    check_model(cfg, policy.models, node, where)
    noise = cfg.privacy.noise
    if cfg.private and noise not in policy.noise:
        raise Refused(node, "noise",
                      f"the run asks privacy.noise = {noise!r}; this node allows "
                      f"{list(policy.noise)} {where}" + (
                          ": it does not trust the server with its clipped means. Ask for "
                          "privacy.noise: distributed." if noise == "central" else "."))
    if cfg.private and noise == (
        "distributed") and cfg.clients - cfg.privacy.tolerated < policy.min_honest:
        raise Refused(node, "min_honest",
                      f"the run counts on P - t = {cfg.clients} - {cfg.privacy.tolerated} = "
                      f"{cfg.clients - cfg.privacy.tolerated} honest clients (training.clients, "
                      f"privacy.tolerated); this node needs at least {policy.min_honest} {where}.")
    if cfg.local.enabled and not policy.local_routine:
        raise Refused(node, "local_routine",
                      f"the run asks the private local routine (local.steps = "
                      f"{cfg.local.steps}); this node does not allow it {where}.")
    if policy.canaries.enabled:
        _check_auditable(cfg, node, where)
    _check_sampling_trusted(policy, cfg, node, where)


def _check_sampling_trusted(policy: NodePolicy, cfg: ExperimentConfig, node: str,
                            where: str) -> None:
    """A node with a lifetime budget takes a client-sampled run only if its policy says how to
    charge it (``lifetime.sampled_runs``): ``unamplified`` (as if the node were in every round, no
    trust in the server's draws: the charge is
    :meth:`~diff2_flwr.runtime.node_ledger.Charge.without_amplification`) or ``amplified`` (holds
    only for cohorts drawn as declared, which the node cannot check); ``refuse`` (the default)
    refuses it here, before any record is read."""
    if not (cfg.private and cfg.training.sampling.enabled and policy.lifetime.enabled):
        return
    if policy.lifetime.sampled_runs in ("unamplified", "amplified"):
        return
    s = cfg.training.sampling
    rule = f"rate q = {s.rate:g}" if s.kind == "poisson" else f"size m = {s.size}"
    raise Refused(node, "lifetime.sampled_runs",
                  f"the run samples clients (training.sampling: {s.kind}, {rule}), so the "
                  f"amplified ε this node's lifetime ledger would charge holds only if the server "
                  f"draws every cohort as declared, which this node cannot check; its policy "
                  f"refuses sampled runs (lifetime.sampled_runs: refuse, the default, or "
                  f"lifetime.trust_server_sampling: false) {where}. Run without "
                  f"training.sampling, or the node's operator sets lifetime.sampled_runs: "
                  f"unamplified (trust-free: the run is charged as if this node were in every "
                  f"round, more ε) or amplified (charged its amplified ε, trusting the server's "
                  f"draws).")


def _check_auditable(cfg: ExperimentConfig, node: str, where: str) -> None:
    """A node that audits every run with canaries takes only the runs its audit reads: central
    noise, routine gd (ṽ_r = (x_(r-1) - x_r)/η from the iterates it receives), no local routine (x_r
    is then not that step)."""
    problems = []
    if cfg.privacy.distributed:
        problems.append(
            "privacy.noise: distributed (its replies leave only inside SecAgg+, without canaries)")
    if cfg.training.routine.name != "gd":
        problems.append(
            f"training.routine {cfg.training.routine.name!r} (the audit reads ṽ_r from x_(r-1) - "
            f"x_r, "
                        "which only gd makes η ṽ_r)")
    if not cfg.training.schedule.constant:
        problems.append(
            f"training.schedule {cfg.training.schedule.name!r} (the audit reads ṽ_r from x_(r-1) - "
            "x_r = η ṽ_r, which a schedule makes η·s(r) ṽ_r)")
    if cfg.local.enabled:
        problems.append(
            f"the local routine (local.steps = {cfg.local.steps}: x_r is not x_(r-1) - η ṽ_r)")
    if problems:
        raise Refused(node, "canaries",
                      f"this node audits every run with canary records {where}, and the run asks "
                      + "; ".join(
                          problems) + ". Ask for privacy.noise: central, routine gd, schedule "
                                      "constant and no local steps, or the node's operator "
                                      "removes `canaries` from its policy.")


def check_model(cfg: ExperimentConfig, allowed: tuple[str, ...], node: str, where: str) -> None:
    """Refuse a model factory the node does not list, before it is imported (importing runs its
    code)."""
    if cfg.model.name not in allowed:
        raise Refused(node, "models",
                      f"the run asks model {cfg.model.name!r} (model.name); this node allows "
                      f"{list(allowed)} {where}. A factory runs on a data owner's node only if "
                      f"its policy lists it.")
