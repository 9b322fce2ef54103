"""`diff2 audit --engines batch batch_f32sums` (diff2_flwr/lab/audit/engines.py): the batched engine
(lab/backend.py) attacked through its own round API, float64 sums and float32 accumulation. The
regime passes on the default attacks with every clipped restart at its bound (float32
accumulation: at C / (1 + ρ)); and it has teeth: without the radius shrink the crafted float32
window moves a client sum beyond 2C, a backend that does not clip is caught by the contribution
check, an overflow not reported is caught, and the exact decision sees one ulp past the bound."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from diff2_flwr.cli import main
from diff2_flwr.core import fused
from diff2_flwr.core.clipping import NORM_RTOL
from diff2_flwr.lab import backend
from diff2_flwr.lab.audit import engines
from diff2_flwr.lab.audit.engine_models import (
    BATCH_MODELS, WINDOW_MARGIN, float32_window, mlp_outputs, mlp_rows,
)
from diff2_flwr.lab.audit.engines import BATCH_ROUNDS, BESIDE, engine_audit
from diff2_flwr.lab.audit.spec import BATCH_ENGINES, EngineAuditSpec

#: The batched engine's engine and dtype pairs that run (float32 accumulation: float32 only).
RUNS = {"batch float64", "batch float32", "batch_f32sums float32"}
RESTARTS = ("restart", BESIDE)


@pytest.fixture(autouse=True, scope="module")
def _kernel() -> None:
    if fused.load() is None:
        pytest.skip("no C++ compiler here: the fused kernel (float32 accumulation) cannot be built")


def _shrunk(n: int = 65, products: bool = False) -> float:
    """C' / C of float32 accumulation for clients of n samples (``products``: W_1's sums by block
    products, the 118-feature model: a record in two partials)."""
    return 1 / (1 + fused.accumulation_error(n, products=products))


def test_the_batched_engine_passes_every_default_attack():
    """Both models (lanes, block products), both accumulations, every round and default attack: no
    finding; float32 accumulation in float64 listed as not applicable; the one refusal is float32
    accumulation's of an infinite input where W_1's sums are products; every clipped restart at the
    bound (float64 sums) or at C / (1 + ρ) (float32 accumulation: the shrink, and no more)."""
    result = engine_audit(EngineAuditSpec(engines=BATCH_ENGINES))
    assert not result["violation"] and result["findings"] == []
    assert [(s["engine"], s["dtype"]) for s in result["not_applicable"]] == [("batch_f32sums",
                                                                             "float64")]
    assert {(r["model"], r["engine"], r["dtype"], r["attack"]) for r in result["refusals"]} == {
        ("paper_mlp_118", "batch_f32sums", "float32", "input inf")}
    assert all("fused.product_rows" in r["error"] for r in result["refusals"])
    assert set(result["table"]) == set(BATCH_MODELS)
    for model, by_round in result["table"].items():
        assert set(by_round) == set(BATCH_ROUNDS)
        for name, by in by_round.items():
            assert set(by) == RUNS, (model, name)
            assert by["batch_f32sums float32"] <= _shrunk(
                products=model == "paper_mlp_118") * (1 + 1e-5), (model, name)
    tight = result["tight_batch"]
    assert set(tight) == RUNS and all(t["clipped_restarts"] >= 8 for t in tight.values())
    for key in ("batch float64", "batch float32"):
        assert 1 - 1e-12 <= tight[key]["sensitivity_min"] <= tight[key]["sensitivity_max"] <= 1
    f32 = tight["batch_f32sums float32"]
    assert _shrunk(products=True) * (1 - 1e-6) <= f32["sensitivity_min"]
    assert f32["sensitivity_max"] <= _shrunk() * (1 + 1e-6)
    assert result["contribution"]["batch_f32sums"]["float32"] < 1
    assert result["contribution"]["batch"]["float64"] <= 1 + NORM_RTOL
    paths = {m: c["backend"] for m, c in result["coverage"].items()}
    assert "forward: kernel" in paths["paper_mlp_8"]["batch float32"]
    assert "the kernel's lanes" in paths["paper_mlp_8"]["batch_f32sums float32"]
    assert "forward: torch" in paths["paper_mlp_118"]["batch float32"]
    assert "float32 block products" in paths["paper_mlp_118"]["batch_f32sums float32"]
    assert result["overflow"]["cases"] >= 2 * 5 * 5  # input inf and target nan, flagged
    assert "batch_f32sums float64 not applicable" in engines.engine_summary_line(result)


def test_the_float32_window_is_built_as_claimed():
    """f ≡ 0 at its iterate (in float64, exactly), every record the same, its norm C (1 − 2^-22),
    the attacked one closing a window: index 63 of a product block (118 features) or lane 15's
    64th sample (8 features); its neighbour, reflected through f, is its exact antipode."""
    for name, n in (("paper_mlp_8", 1024), ("paper_mlp_118", 64)):
        kind = BATCH_MODELS[name]
        window = float32_window(kind, 3.0)
        assert window.features.shape == (n, kind.features)
        assert np.all(window.features == window.features[0])
        assert np.all(window.targets == window.targets[0])
        mlp = kind.mlp()
        assert np.all(mlp_outputs(mlp, window.iterate, window.features) == 0.0)
        assert np.float32(window.targets[0]) == window.targets[0]
        row = mlp_rows(mlp, window.iterate, window.features[:1], window.targets[:1])[0]
        assert abs(np.linalg.norm(row) / (3.0 * (1 - WINDOW_MARGIN)) - 1) < 1e-9
        anti = mlp_rows(mlp, window.iterate, window.features[:1], -window.targets[:1])[0]
        assert np.array_equal(anti, -row)


def test_the_float32_window_sits_at_its_bounds():
    """The window at the restarts: unclipped in float64 sums (its norm, 1 − 2^-22 of C, to 1e-9),
    and clipped at C / (1 + ρ) with float32 accumulation, within the window's rounding."""
    result = engine_audit(EngineAuditSpec(engines=BATCH_ENGINES, attacks=("float32 window",)))
    assert not result["violation"] and result["refusals"] == []
    for model, by_round in result["table"].items():
        for name in RESTARTS:
            by = by_round[name]
            for key in ("batch float64", "batch float32"):
                assert abs(by[key] - (1 - WINDOW_MARGIN)) < 1e-9, (model, name, key)
            n = 1024 if model == "paper_mlp_8" else 64
            shrunk = _shrunk(n, products=model == "paper_mlp_118")
            assert abs(by["batch_f32sums float32"] / shrunk - 1) < 5e-6, (model, name)


@pytest.mark.parametrize("shrink", [True, False], ids=["shrink", "no shrink"])
def test_without_the_shrink_the_float32_window_exceeds_2C(monkeypatch, shrink):
    """Teeth. Float32 accumulation clipping at C itself (ρ = 0: the radius not shrunk): the crafted
    window's float32 partial rounds up with z and down with its antipode, and the client sum moves
    by 2C (1 + 2.4e-6) > 2C — a sensitivity finding (and a contribution one, above C) at both
    restarts on both models (lanes and block products), decided exactly at bound 1. With the shrink
    (the code as it is) nothing."""
    if not shrink:
        monkeypatch.setattr(fused, "accumulation_error", lambda n, *a, **k: 0.0)
    result = engine_audit(EngineAuditSpec(engines=("batch_f32sums",), dtypes=("float32",),
                                          attacks=("float32 window",)))
    if shrink:
        assert not result["violation"] and result["findings"] == []
        return
    found = {(f["model"], f["round"], f["check"]): f for f in result["findings"]}
    for model in BATCH_MODELS:
        for name in RESTARTS:
            for check in ("sensitivity", "contribution"):
                f = found[model, name, check]
                assert f["bound"] == 1.0 and 1 + 1e-6 < f["ratio"] < 1 + 1e-5, f
    assert result["violation"] and "VIOLATION" in engines.engine_summary_line(result)


def test_a_backend_that_does_not_clip_is_caught_by_the_contribution_check(monkeypatch):
    """Teeth. The kernel called with every radius x1e6 (clipping skipped inside the backend): the
    attacked record's contribution is far above C — a contribution finding for every accumulation
    and dtype, at every round (the sensitivity too)."""
    for name, index in (("forward_sums", 9), ("clipped_sums", 5)):  # the radius argument

        def unclipped(*args, _original=getattr(fused, name), _index=index, **kwargs):
            args = list(args)
            if "radius" in kwargs:
                kwargs["radius"] = kwargs["radius"] * 1e6
            else:
                args[_index] = args[_index] * 1e6
            return _original(*args, **kwargs)

        monkeypatch.setattr(fused, name, unclipped)
    result = engine_audit(EngineAuditSpec(engines=BATCH_ENGINES, attacks=("target 1e8",)))
    contributions = [f for f in result["findings"] if f["check"] == "contribution"]
    assert {f"{f['engine']} {f['dtype']}" for f in contributions} == RUNS
    assert {f["round"] for f in contributions} == set(BATCH_ROUNDS) - {"near, last coordinate"}
    assert all(f["ratio"] > 10 for f in contributions)


def test_an_overflow_not_reported_is_a_finding(monkeypatch):
    """Teeth. A backend that drops its overflow flags: the NaN target's client is not flagged and
    its NaN sum would be released — both are findings."""
    original = backend.FusedBackend.round

    def silent(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out._replace(overflow=out.overflow & False)

    monkeypatch.setattr(backend.FusedBackend, "round", silent)
    result = engine_audit(EngineAuditSpec(engines=("batch",), dtypes=("float64",),
                                          models=("paper_mlp_8",), attacks=("target nan",)))
    checks = {f["check"] for f in result["findings"]}
    assert checks == {"non-finite record not reported as an overflow", "non-finite sum released"}


def test_the_exact_decision_sees_one_ulp_past_the_bound():
    """‖(1.5, 2)‖ = 2.5 exactly; one ulp more in the first entry and the float64 norm still reads
    2.5 — the rational arithmetic says it exceeds."""
    zero = np.zeros(2)
    assert engines._measured(np.array([1.5, 2.0]), zero, 2.5, Fraction(1)) == (1.0, False)
    ratio, exceeds = engines._measured(np.array([math.nextafter(1.5, 2.0), 2.0]), zero, 2.5,
                                       Fraction(1))
    assert ratio == 1.0 and exceeds
    assert engines._measured(np.array([1.5, 2.0]), zero, 2.5, 1 + Fraction(NORM_RTOL)) == (1.0,
                                                                                           False)


def test_the_neighbour_is_the_reflection_through_the_output():
    """D′'s attacked record is z with its target reflected through f(x₁): its gradient at x₁ is
    −z's (to the rounding of f); D⁰ is the benign records alone; the filler is D with z benign."""
    kind = BATCH_MODELS["paper_mlp_8"]
    mlp, x1 = kind.mlp(), kind.iterate(0)
    benign = kind.records(np.random.default_rng(1), 65)
    x1_, shards = engines._batch_shards(kind, mlp, "target 1e8", benign, x1, 1.0)
    assert x1_ is x1 and len(shards[0][1]) == len(shards[1][1]) == 65 == len(shards[2][1]) + 1
    z = [mlp_rows(mlp, x1, s[0][-1:], s[1][-1:])[0] for s in shards[:2]]
    np.testing.assert_allclose(z[1], -z[0], rtol=1e-12)
    assert np.array_equal(shards[2][0], benign[0][:-1]) and shards[3] is benign


def test_models_must_fit_the_engines_attacked():
    with pytest.raises(ValueError, match=r"`models` must name, for each engine attacked, models "
                                         r"it runs: .*Found \['paper_mlp_8'\] for engines "
                                         r"\['ghost'\]"):
        engine_audit(EngineAuditSpec(engines=("ghost",), models=("paper_mlp_8",)))
    with pytest.raises(ValueError, match=r"Found \['linear'\] for engines \['ghost', 'batch'\]"):
        engine_audit(EngineAuditSpec(engines=("ghost", "batch"), models=("linear",)))


def test_the_cli_runs_the_batched_engine(capsys):
    rc = main(["audit", "--engines", "batch_f32sums", "batch", "--quiet", "--samples", "3"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 0 and not out["violation"] and out["spec"]["engines"] == ["batch_f32sums", "batch"]
    assert out["not_applicable"][0]["engine"] == "batch_f32sums"
    assert set(out["table"]) == set(BATCH_MODELS)
    assert "batch_f32sums float64 not applicable" in captured.err


def test_a_radius_below_the_floor_is_refused_by_the_backend_itself():
    """The non-default attack `radius x1e-322` (C/n subnormal): both sums modes refuse it in the
    backend (before, float64 sums took it and released 1.2 C), and nothing is a finding."""
    out = engine_audit(EngineAuditSpec(engines=BATCH_ENGINES, dtypes=("float32", "float64"),
                                       models=("paper_mlp_8",), attacks=("radius x1e-322",)))
    assert out["violation"] is False and out["findings"] == []
    refused = [r for r in out["refusals"] if r["attack"] == "radius x1e-322"]
    assert {(r["engine"], r["dtype"]) for r in refused} == {("batch", "float64"),
                                                             ("batch", "float32"),
                                                             ("batch_f32sums", "float32")}
    assert all("below" in r["error"] and "releases nothing" in r["error"] for r in refused)


@pytest.mark.parametrize("bad", [1e-300, -1.0, math.nan])
def test_both_backends_refuse_a_bad_radius_for_any_run(bad):
    import torch

    from diff2_flwr.lab.sweep import batch_model
    from diff2_flwr.task.data import PreparedData

    rng = np.random.default_rng(0)
    data = PreparedData(name="t", x_train=rng.normal(size=(40, 3)), y_train=rng.normal(size=40),
                        x_test=rng.normal(size=(4, 3)), y_test=rng.normal(size=4),
                        shard_bounds=((0, 20), (20, 40)), target_scale=1.0, task="regression",
                        classes=())
    mlp, x0 = batch_model(data)
    x = torch.as_tensor(np.stack([x0, x0]))
    radius = torch.tensor([0.0, bad], dtype=torch.float64)  # run 0 parked (0 is taken)
    every = torch.ones(2, dtype=torch.bool)
    for make in (backend.TorchBackend, lambda *a: backend.choose_backend(*a)):
        b = make(mlp, backend.Batch(data, torch.float64), 2)
        with pytest.raises(ValueError, match=r"run 1's radius .* NaN, negative or below"):
            b.round(x, every, radius, train=False)
        b.round(x, every, torch.tensor([0.0, math.inf], dtype=torch.float64), train=False)
