"""``diff2 bench``'s models section (issue 41, item 4): the models are the issue's, every side
runs, and the ratios are computed against Opacus' ghost clipping (figures are the bench's, not a
test's: here only that the section measures what it says)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diff2_flwr.lab.bench import models


def test_the_cnn_is_the_issues_and_the_transformer_takes_sequences_of_64():
    cnn = models.make_cnn()
    assert sum(p.numel() for p in cnn.parameters()) == 545_290
    assert cnn(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    encoder = models.make_transformer()
    ids = torch.randint(0, models.VOCAB, (3, models.SEQ))
    assert encoder(ids).shape == (3, 2)
    # per-sample: a sample's output does not depend on the others in its batch
    torch.testing.assert_close(encoder(ids)[:1], encoder(ids[:1]))


def test_the_ratios_set_each_diff2_path_against_opacus_ghost_clipping():
    results = {"diff2/torch_func": {"restart_samples_per_s": 50.0,
                                    "difference_samples_per_s": 20.0, "peak_mb": 600.0,
                                    "restart_peak_mb": 300.0, "rounds_peak_mb": 500.0},
               "diff2/ghost": {"restart_samples_per_s": 50.0, "difference_samples_per_s": 20.0,
                               "peak_mb": 600.0, "restart_peak_mb": None},
               "opacus/hooks": {"restart_samples_per_s": 70.0, "peak_mb": 480.0},
               "opacus/ghost": {"restart_samples_per_s": 100.0, "peak_mb": 400.0}}
    plain = {"restart_vs_opacus_ghost": 0.5, "difference_vs_opacus_ghost": 0.2,
             "peak_mb_vs_opacus_ghost": 1.5}
    assert models._ratios(results) == {
        "diff2/torch_func": {**plain, "restart_peak_mb_vs_opacus_ghost": 0.75,
                             "rounds_peak_mb_vs_opacus_ghost": 1.25},
        "diff2/ghost": plain}  # no peak of the rounds alone (the mark could not be restarted)
    assert models._ratios({"opacus/ghost": {"error": "x"}}) == {}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("opacus") is None,
                    reason="opacus (the bench extra) is not installed: pip install -e .[bench]")
def test_every_side_runs_on_both_models_in_its_own_process():
    """Slow (~30-100 s): eight fresh processes, each importing torch (and Opacus) and tracing its
    model, which no stub can stand in for: the section's point is that each side runs apart."""
    section = models.models_section(n=8, batch=4, reps=1)
    for name in ("cnn", "transformer"):
        sides = section[name]["sides"]
        assert set(sides) == {*(f"diff2/{p}" for p in models._diff2_paths()), "opacus/hooks",
                              "opacus/ghost", models.EQUAL_MEMORY}
        # at these tiny batches Opacus' working memory may be below one DIFF2 pass: then the
        # equal-memory side is refused in one line (a result), never an error
        equal = sides[models.EQUAL_MEMORY]
        ran = {s: r for s, r in sides.items() if s != models.EQUAL_MEMORY or "refused" not in r}
        assert "refused" not in equal or "training.memory_budget_mb: one sample" in equal["refused"]
        for side, result in sides.items():
            assert "error" not in result, (name, side, result)
        for side, result in ran.items():
            assert result["restart_samples_per_s"] > 0 and result["peak_mb"] >= result["setup_mb"]
        assert set(section[name]["ratios"]) == {s for s in ran if s.startswith("diff2/")}
        for side in models._diff2_paths():  # passes of Opacus' batch
            assert sides[f"diff2/{side}"]["restart_pass"] == 4
        # the equal-memory side was given what Opacus' ghost clipping took beyond its setup
        peer = sides["opacus/ghost"]
        assert sides[models.EQUAL_MEMORY]["budget_mb"] == pytest.approx(
            max(1.0, peer["peak_mb"] - peer["setup_mb"]))
        assert "refused" in equal or isinstance(equal["within_budget"], bool)
