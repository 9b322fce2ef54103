"""The server and workers without transport: the whole stack against plain full-batch GD, outputs,
CLI."""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
import torch

from diff2_flwr.cli import main
from diff2_flwr.core.aggregation import Reply
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.session import build_server, build_worker, initial_parameters, load_data
from diff2_flwr.task.losses import half_squared_error
from diff2_flwr.task.models import PaperMLP


def config(**training):
    return parse_config({
        "name": "t", "method": training.pop("method", "diff2"),
        "dataset": {"name": "synthetic", "num_samples": 600, "num_features": 4},
        "training": {"rounds": 8, "restart_every": 3, "learning_rate": 0.1, "clients": 4, "seed": 5,
                     **training},
    })


def with_clip_stats(cfg, on=True):
    """``cfg`` with ``evaluation.clip_stats`` (the rows then carry clip_fraction)."""
    return parse_config({**cfg.to_dict(), "evaluation": {**cfg.to_dict()["evaluation"],
                                                         "clip_stats": on}})


def drive(cfg, server):
    while not server.done:
        plan = server.plan()
        replies = []
        for p in range(cfg.training.clients):
            c = build_worker(cfg, p).contribute(plan.radius, plan.x_current, plan.x_previous)
            replies.append(Reply(f"p{p}", p, server.layout.split(c.mean), c.num_samples,
                                 c.num_clipped))
        server.release(replies)
    return server


def test_method_gd_through_the_whole_stack_is_full_batch_gd():
    """σ = 0, no clipping, T = 1: x_r = x_{r-1} - η (1/P) Σ_p ∇f_p(x_{r-1}), checked with plain
    autograd."""
    cfg = with_clip_stats(config(method="gd", restart_every=None))
    server = drive(cfg, build_server(cfg, record=False, progress=None))
    data = load_data(cfg)
    model = PaperMLP(4, 10).double()
    x = torch.tensor(initial_parameters(cfg, data))
    shards = [tuple(torch.as_tensor(a) for a in data.shard(p)) for p in range(4)]
    for _ in range(8):
        torch.nn.utils.vector_to_parameters(x, model.parameters())
        model.zero_grad()
        loss = sum(half_squared_error(model(xs), ys).mean() for xs, ys in shards) / 4
        loss.backward()
        x = x - 0.1 * torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters())
    np.testing.assert_allclose(server.state.x, x.numpy(), rtol=1e-12, atol=1e-14)
    assert server.history[-1]["noise_std"] == 0 and server.history[-1]["clip_fraction"] == 0


def test_outputs_and_ledger(tmp_path):
    cfg = with_clip_stats(config())
    server = drive(cfg, build_server(cfg, output_root=tmp_path, progress=None))
    run_dir = next(tmp_path.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["round"] for r in rows] == list(range(9))
    assert [r["kind"] for r in rows[1:]] == ["restart", "difference",
                                             "difference"] * 2 + ["restart", "difference"]
    assert all({"train_loss", "grad_norm_sq", "test_loss", "noise_std", "clip_fraction",
                "epsilon_spent"} <= set(r)
               for r in rows[1:])
    assert summary["status"] == "completed"
    # our exact μ-GDP composition, cross-checked by dp-accounting's PLD accountant in the summary
    # (within 1 %)
    assert summary["privacy"]["epsilon_spent"] == pytest.approx(3.0, rel=1e-9)
    assert summary["privacy"]["epsilon_pld"] == pytest.approx(summary["privacy"]["epsilon_spent"],
                                                              rel=0.01)
    assert summary["privacy"]["epsilon_rdp"] >= summary["privacy"]["epsilon_pld"]  # RDP is looser
    for row in rows[1:]:  # every round's output carries the independent accountants too
        assert row["epsilon_pld"] == pytest.approx(row["epsilon_spent"], rel=0.01)
        assert row["epsilon_rdp"] >= row["epsilon_spent"]
    assert rows[-1]["epsilon_pld"] == summary["privacy"]["epsilon_pld"]
    assert summary["privacy"]["n_min"] == 120  # 480 train samples over 4 shards
    cal = summary["privacy"]["calibration"]
    # noise std used = σ · radius, on both kinds of rounds
    assert rows[1]["noise_std"] == pytest.approx(cal["sigma1"] * rows[1]["radius"], rel=1e-12)
    assert rows[2]["noise_std"] == pytest.approx(cal["sigma2"] * rows[2]["radius"], rel=1e-12)
    assert server.epsilon_spent == summary["privacy"]["epsilon_spent"]


def test_declared_n_min_above_the_data_is_refused():
    cfg = parse_config({"dataset": {"name": "synthetic", "num_samples": 600}, "method": "dpgd",
                        "privacy": {"n_min": 1000}, "training": {"clients": 4}})
    with pytest.raises(ValueError, match=r"privacy.n_min.*1000.*smallest shard has 120"):
        build_server(cfg, record=False, progress=None)


def test_cli_noise_prints_the_calibration(capsys):
    assert main(["noise", "--epsilon", "3", "--delta", "1e-5", "--rounds", "2000",
                 "--restart-every", "20",
                 "--u", "1.25", "--clients", "10", "--n-min", "1651", "--mode", "exact"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["z1"] == pytest.approx(15.55, abs=0.005) and out["z2"] == pytest.approx(135.5,
                                                                                       abs=0.05)
    assert out["sigma1"] == pytest.approx(2 * out["z1"] / (1651 * 10), rel=1e-12)
    # the independent accountants agree with the closed form on the whole schedule
    acc = out["accountants"]
    assert acc["epsilon_exact_gdp"] == pytest.approx(3.0, rel=1e-9)
    assert acc["epsilon_pld"] == pytest.approx(3.0,
                                               rel=0.01) and acc["epsilon_rdp"] > acc["epsilon_pld"]
    assert main(["noise", "--epsilon", "3", "--delta", "1e-5", "--rounds", "2000", "--clients",
                 "10",
                 "--n-min", "1651"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["z2"] is None and out["sigma2"] is None and out["z1"] == pytest.approx(62.19,
                                                                                      abs=0.005)


def test_cli_noise_reports_bad_input(capsys):
    assert main(["noise", "--epsilon", "0", "--delta", "1e-5", "--rounds", "10", "--clients", "2",
                 "--n-min", "5"]) == 2
    assert "`epsilon` must be a finite number > 0. Found 0.0." in capsys.readouterr().err


def test_budget_guard_refuses_a_round_past_the_target():
    """A server asked to run more rounds than its calibration covers stops before exceeding ε."""
    from diff2_flwr.core.aggregation import RoundRejected

    cfg = config(rounds=6)
    server = build_server(cfg, record=False, progress=None)
    # as if the noise had been calibrated for a 4-round schedule: each round costs more, 4 rounds
    # spend all of ε
    server.spec = dataclasses.replace(server.spec,
                                      calibration=config(rounds=4).calibration(server.n_min))
    with pytest.raises(RoundRejected,
                       match=r"Round 5 released nothing: check 'budget' failed.*above the target "
                             r"ε = 3 by"):
        drive(cfg, server)
    assert server.state.round == 4 and server.epsilon_spent == pytest.approx(3.0, rel=1e-9)


def test_budget_guard_also_listens_to_the_pld_accountant(monkeypatch):
    """If the independent PLD accountant says a round would exceed the target (beyond its 1 %
    discretisation), the round is refused even though the closed form says it fits."""
    from diff2_flwr.core import privacy
    from diff2_flwr.core.aggregation import RoundRejected

    cfg = config(rounds=6)
    server = build_server(cfg, record=False, progress=None)
    # the plan's bound (its PLD composed by counts, what a round within the plan is checked against)
    # says it overspends, so each round falls back to the ledger's own PLD, which says so from round
    # 3 on
    for name in ("epsilon_pld", "epsilon_pld_by_counts"):
        real = getattr(privacy.PrivacyLedger, name).fget
        monkeypatch.setattr(privacy.PrivacyLedger, name,
                            property(lambda self,
                                     real=real: real(self) * (1.5 if len(self.events) >= 3
                                                              else 1.0)))
    with pytest.raises(RoundRejected,
                       match=r"Round 3 released nothing: check 'budget' failed.*dp-accounting PLD "
                                            r"accountant\) to [0-9.]+, above the target ε = 3"):
        drive(cfg, server)
    assert server.state.round == 2 and len(server.ledger.events) == 2


def test_the_budget_guard_bounds_rounds_within_the_plan_by_the_plans_pld(monkeypatch):
    """Within the calibrated schedule a round is checked against the whole plan's PLD (composed by
    counts, once): no round composes the ledger's PLD; the rows carry it where the run evaluates and
    at the end, equal to the ledger's PLD at that round."""
    from diff2_flwr.core import privacy

    cfg = config(rounds=8)
    cfg = parse_config({**cfg.to_dict(), "evaluation": {**cfg.to_dict()["evaluation"], "every": 3}})
    composed = []
    real = privacy.PrivacyLedger.epsilon_pld.fget
    monkeypatch.setattr(privacy.PrivacyLedger, "epsilon_pld",
                        property(lambda self: composed.append(len(self.events)) or real(self)))
    server = drive(cfg, build_server(cfg, record=False, progress=None))
    assert composed and set(composed) <= {3, 6,
                                          8}, f"the ledger's PLD was composed at {composed} events"
    rows = server.history
    with_pld = [r["round"] for r in rows if "epsilon_pld" in r]
    assert with_pld == [3, 6, 8]
    events = server.ledger.events
    for r in rows[1:]:
        if "epsilon_pld" in r:
            assert r["epsilon_pld"] == privacy.PrivacyLedger(server.ledger.delta,
                                                             events[:r["round"]]).epsilon_pld
            assert list(r).index("epsilon_pld") == list(r).index("epsilon_spent") + 1
    plan = privacy.PrivacyLedger(server.ledger.delta, events)
    assert plan.epsilon_pld_by_counts == pytest.approx(plan.epsilon_pld, rel=1e-6)
    assert plan.epsilon_pld_by_counts == pytest.approx(3.0, rel=0.01)


def test_a_schedule_planned_past_the_target_does_not_start(monkeypatch):
    from diff2_flwr.core import privacy

    cfg = config(rounds=6)
    real = privacy.Calibration.epsilon_spent
    monkeypatch.setattr(privacy.Calibration, "epsilon_spent", lambda self, m1, m2: real(self, m1,
                                                                                        m2) * 1.01)
    with pytest.raises(ValueError,
                       match=r"planned schedule would spend ε = 3.03, above the target "
                             r"privacy.epsilon = 3 by 0.03"):
        build_server(cfg, record=False, progress=None)


def test_train_metrics_and_a_large_delta_are_announced_loudly():
    messages = []
    build_server(config(), record=False, progress=messages.append)
    assert any("train_loss and grad_norm_sq" in m and "NOT covered by ε" in m for m in messages)
    assert not any("privacy.delta" in m for m in messages)
    quiet = parse_config({**config().to_dict(), "evaluation": {"train_metrics": False}})
    messages.clear()
    build_server(quiet, record=False, progress=messages.append)
    assert not any("train_metrics" in m for m in messages)
    # 480 training records: 1/n ≈ 0.0021
    loose = parse_config({**config().to_dict(), "privacy": {"delta": 0.01}})
    messages.clear()
    server = build_server(loose, record=False, progress=messages.append)
    assert any("privacy.delta = 0.01 is not below 1/n = 0.00208" in m for m in messages)
    assert any("privacy.delta" in w for w in server.run_info["warnings"])


def test_noise_key_comes_from_os_entropy_per_run_and_a_seed_is_flagged(tmp_path):
    """No seed: a fresh 128-bit key per run from OS entropy, said on the console and in the summary,
    and never written to the outputs. A seed: a warning that the noise is reproducible by anyone who
    knows it."""
    lines: list[str] = []
    unseeded = config(seed=None)
    servers = [build_server(unseeded, output_root=tmp_path / str(i),
                            progress=lines.append) for i in range(2)]
    assert servers[0].state.noise_key != servers[1].state.noise_key  # re-seeded per run
    assert not servers[0].state.noise_seeded and servers[0].state.noise_key.bit_length() > 64
    assert any("noise key drawn from OS entropy" in line for line in lines)
    assert not any("WARNING: training.seed" in line for line in lines)
    for server in servers:
        drive(unseeded, server)
        run_dir = next((tmp_path / str(servers.index(server))).iterdir())
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["privacy"]["noise_key"] == "os-entropy"
        for f in run_dir.iterdir():  # the key is a secret: no output file holds it
            assert str(server.state.noise_key) not in f.read_bytes().decode("latin-1")
    assert not np.array_equal(servers[0].state.x, servers[1].state.x)

    lines.clear()
    seeded = build_server(config(seed=5), record=False, progress=lines.append)
    assert seeded.state.noise_seeded and seeded.summary()["privacy"]["noise_key"].startswith(
        "seed (reproducible")
    warning = ("WARNING: training.seed is set, so the noise is reproducible by anyone who knows "
               "the seed")
    assert any(warning in line for line in lines)


def released(tmp_path, cfg):
    """Run ``cfg`` recording into ``tmp_path``: (metrics rows, summary.json text, console lines,
    history)."""
    lines: list[str] = []
    server = drive(cfg, build_server(cfg, output_root=tmp_path, progress=lines.append))
    run_dir = server.recorder.directory
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, (run_dir / "summary.json").read_text(), lines, server.history


def test_clip_statistics_are_withheld_by_default(tmp_path):
    """The clip counts are data-dependent and not covered by ε: by default no released file or line
    carries them."""
    rows, summary, lines, history = released(tmp_path, config(seed=None))
    assert len(rows) == 9 and all("clip_fraction" not in r for r in rows + history)
    assert "clip_fraction" not in summary and json.loads(summary)["config"]["evaluation"][
        "clip_stats"] is False
    assert any(line.startswith("[diff2] round 8/8") for line in lines)
    assert not any("clip_fraction" in line or "clip_stats" in line or "clipped" in line
                   for line in lines)
    assert not any("clip_stats" in w or "clip_fraction" in w
                   for w in json.loads(summary).get("warnings", []))


def test_clip_statistics_are_released_only_when_opted_in_and_then_warned(tmp_path):
    rows, summary, lines, history = released(tmp_path, with_clip_stats(config(seed=None)))
    assert all(0 <= r["clip_fraction"] <= 1 for r in rows[1:]) and "clip_fraction" not in rows[0]
    assert [r["clip_fraction"] for r in rows[1:]] == [r["clip_fraction"] for r in history[1:]]
    warning = "[diff2] WARNING: evaluation.clip_stats is on: each round's clip_fraction"
    assert any(line.startswith(warning) and "NOT covered by ε" in line for line in lines)
    assert any(line.startswith("[diff2] round 1/8") and "clip_fraction=" in line for line in lines)
    assert any(w.startswith("evaluation.clip_stats is on") for w in json.loads(summary)["warnings"])


def test_a_seeded_run_says_in_its_summary_that_the_seed_is_the_noise_key():
    summary = build_server(config(seed=5), record=False, progress=None).summary()
    assert any("The seed is the noise key" in w for w in summary["warnings"])
    assert not any("seed" in w for w in build_server(config(seed=None), record=False, progress=None)
                   .summary().get("warnings", []))
