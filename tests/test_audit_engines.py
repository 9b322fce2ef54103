"""`diff2 audit --engines` (diff2_flwr/lab/audit/engines.py): the per-sample gradient engines
attacked with small real models and adversarial records through `make_worker` and
`Worker.contribute`, at restart and difference rounds, in float64 and float32. The regime passes on
both engines with every clipped record at its bound (not vacuous), and it reports a finding when an
engine under-clips: a norm halved, a layer left out of the norm, a difference norm taken as
|‖g₁‖ − ‖g₂‖| (computed from the gradients' large terms) on either engine."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from diff2_flwr.cli import main
from diff2_flwr.core import ghost_layers, ghost_parts, gradients
from diff2_flwr.core.clipping import NORM_RTOL, ClippedSum, clip_factors, clipped_sum, row_norms
from diff2_flwr.lab.audit import engines
from diff2_flwr.lab.audit.engine_models import MODELS, weighted_half_squared_error
from diff2_flwr.lab.audit.engines import ATTACKS, ROUNDS, engine_audit
from diff2_flwr.lab.audit.spec import ENGINE_DTYPES, ENGINES, WORKER_ENGINES, EngineAuditSpec
from diff2_flwr.runtime.workers import make_worker

BOUND = 1 + NORM_RTOL

#: Two attacks whose gradients are far above the radius at every round: fast, and clipped.
FAST = ("target 1e8", "input x1e8")


def _passes(result: dict, models: tuple[str, ...], dtypes: tuple[str, ...] = ENGINE_DTYPES
            ) -> None:
    """No finding and no refusal of the worker's engines; a realised sensitivity within the claim
    for every model, round, engine and dtype; and every clipped record at the bound (the audit is
    tight)."""
    assert not result["violation"] and result["findings"] == [], result["findings"][:3]
    assert [r for r in result["refusals"] if r["engine"] in WORKER_ENGINES] == []
    table = result["table"]
    assert set(models) <= set(table)
    for model in models:
        assert set(table[model]) == set(ROUNDS), model
        for round_name, by in table[model].items():
            assert set(by) == {f"{e} {d}" for e in WORKER_ENGINES for d in dtypes}, (model,
                                                                                     round_name)
            assert all(0 <= value <= BOUND for value in by.values()), (model, round_name, by)
            # some engine clipped the record onto the bound (float32 may lose a tiny difference
            # whole: a residual of 1e8 moves by less than its ulp)
            assert max(by.values()) >= 1 - 1e-9, (model, round_name, by)
    for engine in WORKER_ENGINES:
        assert set(result["sensitivity"][engine]) == set(dtypes)
        assert all(v <= BOUND for v in result["sensitivity"][engine].values())
        assert all(v <= BOUND for v in result["contribution"][engine].values())
    tight = result["tight"]
    assert tight["clipped_cases"] > 0 and 1 - 1e-9 <= tight["sensitivity_min"]
    assert tight["sensitivity_max"] <= BOUND


def test_the_regime_passes_on_both_engines_for_every_model_and_round(monkeypatch):
    """Every model kind (each ghost rule, and the torch.func fallback), every round kind, both
    engines and dtypes, on the two attacks that clip at every round: realised <= 2C, at 2C."""
    calls = []
    bound = ghost_parts.gram_error_bound

    def spy(*args):
        calls.append(args)
        return bound(*args)

    monkeypatch.setattr(ghost_parts, "gram_error_bound", spy)
    result = engine_audit(EngineAuditSpec(engines=WORKER_ENGINES, attacks=FAST))
    _passes(result, tuple(MODELS))
    assert set(result["table"]) == set(MODELS) and result["not_applicable"] == []
    assert calls, "the ghost engine's Gram form (and its safeguard) never ran"
    rules = {rule for model in result["coverage"].values() for rule in
             model["ghost_rules"].values()}
    assert rules == {"linear", "conv", "embedding", "norm"}
    assert {"act.weight", "mha.in_proj_weight"} <= set(result["coverage"]["fallback"]["fallback"])
    assert result["coverage"]["linear"]["fallback"] == []
    assert set(result["agreement"]) == set(ENGINE_DTYPES)


@pytest.mark.slow
def test_the_default_regime_passes_with_every_attack():
    """Slow (~15 s on 2 cores): the whole default regime, 832 cases of the worker's engines (every
    model, engine, dtype, round and default attack: tiny and huge weights, infinite inputs, NaN
    targets, padding) and the batched engine's 210 (tests/test_audit_batch_engine.py checks them)
    is what `diff2 audit --engines` runs and what this checks; the fast test above keeps two
    attacks."""
    result = engine_audit(EngineAuditSpec())
    _passes(result, tuple(MODELS))
    assert result["cases"] == 832 + 210 and result["overflow"]["cases"] > 0
    assert result["spec"]["seed"] == 0 and result["spec"]["attacks"] is None


def test_the_neighbours_are_the_worst_case_and_the_null_record_is_zero():
    """D′'s attacked record has exactly −z's gradient (bit for bit, so a clipped z moves the sum
    by exactly 2C), and D⁰'s exactly 0 (so n·(mean(D) − mean(D⁰)) is z's own contribution)."""
    kind = MODELS["sequence"]
    model = kind.model(0)
    shards = engines._shards(kind, kind.records(np.random.default_rng(3), 5), ("target 1e8",))
    for dtype in ENGINE_DTYPES:
        rows = {}
        for key in ("null", ("target 1e8", "D"), ("target 1e8", "D′")):
            w = make_worker(model=model, loss=weighted_half_squared_error, data=shards[key],
                            partition_id=0, dtype=dtype, gradients="torch_func")
            params = dict(model.named_parameters())
            x = w.gradients.layout.flatten([params[n].detach().numpy()
                                            for n in w.gradients.layout.names])
            rows[key] = w.gradients.per_sample(x, w.features, w.targets)
        d, d_prime = rows["target 1e8", "D"], rows["target 1e8", "D′"]
        assert torch.equal(d[-1], -d_prime[-1]) and torch.equal(d[:-1], d_prime[:-1])
        assert not bool(rows["null"][-1].any()) and d[-1].norm() > 1e6
    # the "near, last coordinate" round moves the head's bias alone (the residual, not the features)
    assert {list(dict(k.model(0).named_parameters()))[-1] for k in MODELS.values()} == {
        "head.bias"}


def _halved_difference_norms(monkeypatch):
    parts = ghost_layers.GhostGradients._parts

    def broken(self, current, previous, x, y):
        got = parts(self, current, previous, x, y)
        return got if previous is None else [dataclasses.replace(p, norms=p.norms / 2)
                                             for p in got]

    monkeypatch.setattr(ghost_layers.GhostGradients, "_parts", broken)


def _one_layer_left_out(monkeypatch):
    """The last part (the torch.func fallback's parameters) left out of difference norms."""
    parts = ghost_layers.GhostGradients._parts

    def broken(self, current, previous, x, y):
        got = parts(self, current, previous, x, y)
        if previous is None:
            return got
        return got[:-1] + [dataclasses.replace(got[-1], norms=torch.zeros_like(got[-1].norms))]

    monkeypatch.setattr(ghost_layers.GhostGradients, "_parts", broken)


def _norm_of_difference_from_norms(monkeypatch):
    """torch_func clipping g₁ − g₂ by |‖g₁‖ − ‖g₂‖| (<= ‖g₁ − g₂‖: under-clips)."""
    def broken(self, x_current, current, previous, xc, yc, radius):
        rows = self._flat(self._per_sample(current, xc, yc), xc.shape[0]).to(torch.float64)
        if previous is None:
            return clipped_sum(rows, radius)
        prev = self._flat(self._per_sample(previous, xc, yc), xc.shape[0]).to(torch.float64)
        norms = (row_norms(rows) - row_norms(prev)).abs()
        c = clip_factors(norms, radius)
        return ClippedSum(((rows - prev) * c[:, None]).sum(0), len(rows),
                          int((norms > radius).sum()))

    monkeypatch.setattr(gradients.PerSampleGradients, "_chunk_sum", broken)


def _ghost_norm_of_difference_from_norms(monkeypatch):
    """The ghost engine taking each layer's |‖g₁‖ − ‖g₂‖| (its norms at each iterate alone) for
    the layer's ‖g₁ − g₂‖: computed from the gradients' large terms, never above the truth."""
    parts = ghost_layers.GhostGradients._parts

    def broken(self, current, previous, x, y):
        got = parts(self, current, previous, x, y)
        if previous is None:
            return got
        at_1, at_2 = parts(self, current, None, x, y), parts(self, previous, None, x, y)
        return [dataclasses.replace(p, norms=(a.norms - b.norms).abs())
                for p, a, b in zip(got, at_1, at_2)]

    monkeypatch.setattr(ghost_layers.GhostGradients, "_parts", broken)


@pytest.mark.parametrize("breakage,engine,model,dtype", [
    (_halved_difference_norms, "ghost", "linear", "float64"),
    (_one_layer_left_out, "ghost", "fallback", "float32"),
    (_norm_of_difference_from_norms, "torch_func", "linear", "float64"),
    (_ghost_norm_of_difference_from_norms, "ghost", "embedding", "float32"),
], ids=["ghost norms halved", "ghost leaves a layer out", "torch_func |g1|-|g2|",
        "ghost |g1|-|g2|"])
def test_the_audit_finds_an_engine_that_under_clips(breakage, engine, model, dtype, monkeypatch):
    """Teeth: each broken engine releases a record's difference above the radius; the audit
    reports it as a finding (realised sensitivity above 2C), at difference rounds only."""
    breakage(monkeypatch)
    result = engine_audit(EngineAuditSpec(engines=(engine,), models=(model,), dtypes=(dtype,)))
    assert result["violation"] and result["refusals"] == []
    found = result["findings"]
    assert {f["round"] for f in found} <= set(ROUNDS) - {"restart"}
    assert any(f["check"] == "sensitivity" and f["ratio"] > BOUND for f in found)


def test_the_gram_safeguard_alone_keeps_large_terms_from_under_clipping(monkeypatch):
    """The ghost engine's Gram form on [B₁; −B₂], [Ã₁; Ã₂] (terms of the gradients' size, not the
    small differences) with its safeguard kept: every value not provably accurate is materialised,
    so near-cancellation under-clips nothing."""
    monkeypatch.setattr(ghost_parts, "_small_differences", lambda terms: terms)
    result = engine_audit(EngineAuditSpec(engines=("ghost",), models=("linear", "sequence"),
                                          attacks=FAST + ("benign",)))
    assert not result["violation"] and result["refusals"] == []
    assert result["tight"]["clipped_cases"] > 0


def test_an_engine_its_own_check_refuses_is_reported_as_a_refusal(monkeypatch):
    """Ghost norms halved at restarts too: the engine's first-call check refuses the model
    (nothing released); the audit lists the refusals instead of measuring nothing silently."""
    parts = ghost_layers.GhostGradients._parts
    monkeypatch.setattr(ghost_layers.GhostGradients, "_parts",
                        lambda self, *a: [dataclasses.replace(p, norms=p.norms / 2)
                                          for p in parts(self, *a)])
    result = engine_audit(EngineAuditSpec(engines=("ghost",), models=("linear",),
                                          dtypes=("float64",), attacks=("benign",)))
    assert not result["violation"] and len(result["refusals"]) == result["cases"] == 4
    assert "GhostUnsupported" in result["refusals"][0]["error"]
    assert "4 refusal(s)" in engines.engine_summary_line(result)


def test_a_radius_below_the_floor_is_refused_by_every_engine_not_released():
    """Found by this regime: with C/n subnormal (radius 1e-322) the clipping rounded a record's
    contribution to 5x C; every path now refuses a radius below core.clipping.RADIUS_FLOOR."""
    result = engine_audit(EngineAuditSpec(engines=WORKER_ENGINES, models=("linear",),
                                          dtypes=("float64",), attacks=("radius x1e-322",)))
    assert not result["violation"]
    refused = {(r["engine"], r["round"]) for r in result["refusals"]
               if "is below 1.18e-271" in r["error"] and r["error"].endswith("releases nothing.")}
    assert {e for e, _ in refused} == set(WORKER_ENGINES) and {k for _, k in refused} >= {
        "restart", "difference"}


def test_the_cli_prints_one_json_object_and_exits_3_on_a_finding(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(engines, "MODELS", {"linear": MODELS["linear"]})
    rc = main(["audit", "--engines", "ghost", "--samples", "6", "--out", str(tmp_path / "e.json")])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 0 and out["regime"] == "engines" and not out["violation"]
    assert out["spec"] == {**out["spec"], "engines": ["ghost"], "samples": 6, "seed": 0}
    assert json.loads((tmp_path / "e.json").read_text()) == out
    assert "[engines] linear" in captured.err and "no violation" in captured.err
    _halved_difference_norms(monkeypatch)
    rc = main(["audit", "--engines", "--quiet", "--seed", "4"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 3 and out["violation"] and out["spec"]["engines"] == list(ENGINES)
    assert out["spec"]["seed"] == 4 and "VIOLATION" in captured.err
    assert "[engines]" not in captured.err


@pytest.mark.parametrize("changes,message", [
    ({"samples": 2}, r"`--samples` must be an integer >= 3 \(the attacked record"),
    ({"engines": ("opacus",)}, r"`--engines` must be a non-empty tuple of \('torch_func', "),
    ({"clip_diff": 0.0}, r"`--clip-diff` must be a finite number > 0\. Found 0\.0\."),
    ({"seed": -1}, r"`--seed` must be an integer >= 0\. Found -1\."),
])
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineAuditSpec(**changes)


def test_unknown_models_and_attacks_are_refused_with_the_known_names(capsys):
    with pytest.raises(ValueError, match=r"`models` must be names of \['attention', "):
        engine_audit(EngineAuditSpec(models=("mlp",)))
    with pytest.raises(ValueError, match=r"`attacks` must be names of .*'target nan'"):
        engine_audit(EngineAuditSpec(attacks=("sql injection",)))
    with pytest.raises(SystemExit):
        main(["audit", "--engines", "opacus"])
    assert "invalid choice: 'opacus'" in capsys.readouterr().err
    assert set(ATTACKS) > set(engines.DEFAULT_ATTACKS)
