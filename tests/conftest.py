"""Shared test fixtures: where the paper's datasets are (DIFF2_DATA_DIR or ../shared/data)."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run and machine (a red CI must be reproducible);
# set HYPOTHESIS_PROFILE=explore to search with fresh random examples instead (do it when changing
# the maths).
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

_SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data_dir() -> Path | None:
    env = os.environ.get("DIFF2_DATA_DIR")
    for candidate in ([Path(env)] if env else []) + [_SHARED]:
        if (candidate / "california_housing").is_dir() or (candidate / "cal_housing.csv").is_file():
            return candidate
    return None


# Ray's driver replaces `builtins.print` with its `safe_print` (ray.experimental.tqdm_ray) the first
# time it relays a worker's log line, and never puts it back. The tests that run Ray in-process (the
# Flower audit's simulations, the Ray cluster) would leave it patched for every later test of their
# xdist worker, and a module first imported after that (diff2_flwr.api is imported on first use)
# would take `safe_print` as its `progress=print` default: the tutorial's signature test failed that
# way in CI when test_api.py followed test_audit_flower.py on one worker. Every test leaves `print`
# as it found it.
_PRINT = builtins.print


@pytest.fixture(autouse=True)
def _print_is_the_builtin():
    builtins.print = _PRINT
    yield
    builtins.print = _PRINT


@pytest.fixture
def simulated_nodes(monkeypatch):
    """ClientApps called in this process count as nodes of Flower's simulation engine (as under
    `flwr run` with the simulation engine, whose Ray actor module marks its workers): a test that
    calls the real ClientApp in process stands for a simulation unless its node config says
    otherwise (data-path, policy)."""
    from diff2_flwr.runtime import node_mode

    monkeypatch.setattr(node_mode, "simulation_engine_running", lambda: True)


@pytest.fixture
def data_dir() -> Path:
    found = shared_data_dir()
    if found is None:
        pytest.skip(
            "the paper's datasets are not available (set DIFF2_DATA_DIR or put shared/ beside the "
            "clone)")
    return found


# The full suite runs in parallel processes (pytest-xdist, `--dist loadfile --no-loadscope-reorder`:
# scripts/test.sh): each test file goes whole to one worker, so a module's or class's fixture (a
# compose stack, the audit's 5,000-trial federations) is built once, and the tests that share a
# machine-wide resource, each kind in one file, run one at a time: the compose tests (Podman's
# images, networks, project names and host ports) and the Ray cluster tests. (xdist's `loadgroup`
# cannot group here: it renames `item._nodeid`, which pytest 9 no longer reads.) Every other test
# has its own FLWR_HOME, free ports and tmp_path. Files are handed out longest first (a file not
# listed comes after these, in collection order), so the short ones fill the gaps at the end.
# xdist's default would reorder the files by their number of tests, which put the compose file (7
# tests, ~20 min on one worker) last and ran CI out of its 90 minutes. Seconds of each file on one
# worker, measured in a full parallel run on 2 cores (the compose file: warm images; its cold image
# build adds ~10 min).
_FILE_SECONDS = {
    "test_compose_podman.py": 1300, "test_flower_e2e.py": 820, "test_deployment.py": 726,
    "test_audit.py": 302,
    # not from a full run: 171 s of CPU for its two audits, measured alone
    "test_audit_distributed.py": 180,
    # not from a full run: ~50 s of CPU (four 1,000-trial audits, seeded simulations)
    "test_audit_gdp.py": 60,
    # two Flower simulations (Ray) of the audit: 86 s alone, ~250 s in a full parallel run
    "test_audit_flower.py": 250,
    "test_node_policy.py": 272, "test_plain_flwr_run.py": 225, "test_api.py": 145,
    "test_node_auth.py": 139,
    "test_private_edges.py": 131, "test_cluster.py": 121, "test_own_code.py": 116,
    "test_console.py": 96,
    "test_preflight.py": 91, "test_partitions.py": 89, "test_checkpoint.py": 84,
    "test_strategy.py": 77,
    "test_csvfile.py": 63, "test_study.py": 56, "test_superexec_auth.py": 53,
    "test_node_ledger.py": 43,
    "test_study_drivers.py": 36,
}


# In-process tests of more than ~5 s on a 2-core machine (measured with `scripts/test.sh --fast
# --durations=45`): marked `slow`, so `scripts/test.sh --fast` leaves them out; the full suite runs
# them. A node id or its prefix.
_SLOW = (
    # the audit's 5,000-trial federations (a module fixture each: ~60-150 s) and its catches
    "tests/test_audit.py::test_audit_of_diff2_", "tests/test_audit.py::test_audit_scores_follow",
    "tests/test_audit.py::test_audit_of_dpgd", "tests/test_audit.py::test_audit_catches_",
    # --noise distributed: 1,500 runs per federation each, the correct run (a module fixture) and
    # the 4x catch
    "tests/test_audit_distributed.py::test_audit_of_distributed_",
    "tests/test_audit_distributed.py::test_audit_scores_",
    "tests/test_audit_distributed.py::test_audit_catches_",
    # client sampling through the real Strategy and the in-process driver against the batched engine
    "tests/test_strategy_sampling.py::test_the_strategy_asks_only_the_cohort_and_equals_the_driver",
    "tests/test_sampling_config.py::test_the_in_process_engine_samples_as_the_batched_engine_does",
    # client sampling's audits (400 and 200 trials per federation, the cohort test: ~8-35 s each)
    "tests/test_audit_sampling.py::test_a_calibrated_sampled_run_shows_no_violation",
    "tests/test_audit_sampling.py::test_the_audit_flags_noise_times_0_7",
    "tests/test_audit_sampling.py::test_a_fixed_cohort_audit_shows_no_violation",
    "tests/test_audit_sampling.py::test_the_cohort_tests_epsilon_is_the_ledgers",
    "tests/test_audit_sampling.py::test_the_canary_client_is_sampled_like_any_other",
    # the μ-GDP test on the real path, both directions (four 1,000-trial audits: ~30 s)
    "tests/test_audit_gdp.py::test_the_audit_flags_a_sqrt2_mistake",
    "tests/test_node_policy.py::test_the_lifetime_budget_refuses",
    "tests/test_node_policy.py::test_diff2_run_checks_the_policy_file",
    "tests/test_study_drivers.py::test_a_killed_driver",
    "tests/test_study_drivers.py::test_two_driver_processes",
    "tests/test_study.py::test_a_method_runs_its_own_rounds",
    "tests/test_study.py::test_two_worker_processes",
    "tests/test_study.py::test_smoke_study", "tests/test_study.py::test_summary_statistics_follow",
    "tests/test_study.py::test_a_classification_study_on_the_batch_engine",
    "tests/test_local.py::test_local_steps_make_more_progress",
    "tests/test_node_ledger.py::test_concurrent_admissions",
    "tests/test_api.py::test_the_api_is_loaded_lazily",
    "tests/test_analysis.py::test_a_family_holm_corrects",
    # two `flwr build`s, one walking the checkout
    "tests/test_own_code.py::test_flwr_run_gets_the_same_fab",
    # a fresh process (it checks which modules one imports): torch, a run, then torch._dynamo: ~10 s
    "tests/test_ghost.py::test_an_eager_run_never_imports_dynamo",
    # the preflight's `diff2 run` per mistake (~8 s each): the fast tier keeps two of them
    *(f"tests/test_preflight.py::test_each_mistake_fails_diff2_run_in_one_line_before_flower_starts[{case}]"
      for case in ("local.batch_size above n_min", "misspelt target column",
                   "CSV with a ragged row",
                   "CSV with text in a numeric column", "batch-norm model", "factory raises",
                   "factory returns a non-module", "factory module not found")),
    "tests/test_checkpoint.py::test_resumed_run_equals_an_uninterrupted_one[adam-seedNone]",
    # Variants of a claim the fast tier still checks once (3-8 s each on 2 cores, ~100 s together:
    # the tier was 3 min 50 s on 2026-12-02, over its 3 minutes). Kept fast: resume [gd-seed3] and
    # [adam-seed3], a node killed [after-rename], the local ledger on the audit's schedule,
    # skellam's divergence at μ = 0.5, 2, 20, 5000.
    *(f"tests/test_checkpoint.py::test_resumed_run_equals_an_uninterrupted_one[{case}]"
      for case in ("gd-seedNone", "adamw-seed3", "momentum-seed3", "nesterov-seed3")),
    # the older checkpoint formats
    "tests/test_checkpoint.py::test_a_format_2_checkpoint_is_still_read",
    "tests/test_checkpoint.py::test_a_checkpoint_written_by_the_earlier_fingerprint_rule",
    "tests/test_checkpoint.py::test_a_checkpoint_resumes_across_keys_that_do_not_change_the_run",
    *(f"tests/test_node_ledger.py::test_a_node_killed_while_charging_leaves_a_whole_ledger[{moment}]"
      for moment in ("before-rename", "torn-temp-file")),
    # the longer schedule (its fixture: ~5 s)
    *(f"tests/test_local_privacy.py::{name}[R10-T5-K3-q0.08]"
      for name in ("test_ledger_agrees_with_an_independent_replace_one_pld_accountant",
                   "test_either_convention_wrong_by_two_is_outside_the_tolerance",
                   "test_calibrated_schedule_ends_within_the_budget")),
    "tests/test_skellam.py::test_the_closed_form_bounds_the_exact_renyi_divergence[300.0]",
    "tests/test_study.py::test_rerun_resumes_without_computing",  # the smoke study's fixture (~8 s)
    "tests/test_study.py::test_a_method_sets_a_routine_and_its_grid_ranges",
    "tests/test_study.py::test_inprocess_engine_gives_the_same_study",
    "tests/test_study.py::test_a_run_that_diverges_on_the_per_run_path_is_reported_and_costed",
    "tests/test_digits.py::test_the_digits_config_and_study_parse_and_the_study_reports_accuracy",
    "tests/test_regime.py::test_a_real_family_gives_the_studies_own_numbers",
    "tests/test_curves.py::test_diff2_plot_draws_several_runs_side_by_side",
    # four runs
    "tests/test_config.py::test_one_set_takes_several_assignments_and_the_file_may_follow",
    "tests/test_csvfile.py::test_thousands_of_columns_load_fast",
    # a process each (Flower's CLI or `flwr build`)
    "tests/test_plain_flwr_run.py::test_without_the_variable_flowers_own_dependency_step_resolves",
    "tests/test_strategy.py::test_a_simulation_with_the_wrong_number_of_supernodes_fails_at_once",
    "tests/test_own_code.py::test_the_fab_carries_custom_and_nothing_else_of_the_users",
    # a strict build of the docs each (~8 s): the fast tier keeps the build and the broken link
    "tests/test_docs.py::test_a_broken_link_fails_the_strict_build[broken anchor]",
    "tests/test_docs.py::test_a_page_left_out_of_the_navigation_fails_the_strict_build",
    # torch.compile's first call (~20-100 s cold) and a JAX subprocess; runs only where jax is found
    "tests/test_bench.py::test_a_real_run_against_jax",
)


def _rank(item: pytest.Item) -> float:
    return -_FILE_SECONDS.get(item.path.name, 0)


# before `-m` deselects: `--fast` leaves out the `slow` tests marked here
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(_SLOW):
            item.add_marker(pytest.mark.slow)
    # stable: a file's tests stay in their order, unlisted files in collection order
    items.sort(key=_rank)
