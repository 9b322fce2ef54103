"""Memory that never runs out (issue 41, item 2): measured pass footprints, chunks sized from a
budget, one-line refusals before round 1, the auto budget and dtype, re-formed rows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import diff2_flwr
from diff2_flwr.core import ghost_parts, memory
from diff2_flwr.core.ghost_layers import GhostGradients
from diff2_flwr.core.gradients import PerSampleGradients
from diff2_flwr.core.memory import Budget, Footprint, MemoryRefusal, measure_footprint, peak_bytes
from diff2_flwr.fl.client import Diff2Client
from diff2_flwr.runtime import memory_budget
from diff2_flwr.runtime.config import parse_config
from diff2_flwr.runtime.policy import REFUSAL_END, Refused, refusal_in
from diff2_flwr.runtime.session import PreflightError, preflight
from diff2_flwr.runtime.workers import make_worker
from diff2_flwr.task.losses import cross_entropy
from diff2_flwr.task.models import PaperMLP, TanhMLP

MB = 2**20


# ------------------------------------------------------------------------------ measuring a pass

def test_peak_bytes_is_the_most_that_was_live_at_once():
    def work():
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(4 * MB, dtype=torch.uint8)  # b + c = 6 MiB live: the peak
        del b, c
        return torch.empty(MB, dtype=torch.uint8)

    out, peak = peak_bytes(work)
    assert peak == 6 * MB and out.numel() == MB


def test_peak_bytes_counts_saved_tensors_until_backward_and_no_views():
    x = torch.randn(256, 1024, dtype=torch.float64, requires_grad=True)  # 2 MiB, held before
    assert peak_bytes(lambda: (x.t(), x[:10], x.view(-1)))[1] == 0  # views allocate nothing

    def forward_only():
        y = x.exp()  # saved for backward: kept alive by the graph, not by a name
        return y.sin().sum()

    loss, held = peak_bytes(forward_only)
    assert held >= 2 * 2 * MB  # exp's result (saved) and sin's, both 2 MiB, were live at once
    _, during_backward = peak_bytes(loss.backward)
    assert during_backward >= 2 * MB  # the gradient of x at least


def test_a_footprint_is_a_line_fitted_at_two_probes_with_the_margin():
    def run(m: int):
        fixed = torch.empty(3 * MB, dtype=torch.uint8)
        rows = torch.empty(m * MB // 2, dtype=torch.uint8)
        return fixed, rows

    fp = measure_footprint(run, available=100)
    assert fp.per_sample == pytest.approx(memory.MARGIN * MB / 2, rel=1e-6)
    assert fp.fixed == pytest.approx(memory.MARGIN * 3 * MB, rel=1e-6)
    one = measure_footprint(run, available=1)  # one record: all of it is per sample
    assert one.fixed == 0 and one.per_sample == pytest.approx(memory.MARGIN * 3.5 * MB, rel=1e-6)


def _two_phases(m: int):
    """A pass whose peak small probes mis-read: a fixed buffer that grows a little per sample,
    freed, then much per sample (peak max(8 + m/10, m/2) MiB: the first phase's up to m = 20)."""
    buffer = torch.empty(8 * MB + m * MB // 10, dtype=torch.uint8)
    del buffer
    return torch.empty(m * MB // 2, dtype=torch.uint8)


def _two_phases_peak(m: int) -> int:
    return max(8 * MB + m * MB // 10, m * MB // 2)


def test_passes_are_probed_doubling_so_a_peak_small_probes_miss_keeps_the_budget():
    budget = 100 * MB
    # the line of the small probes alone sees the first phase and would take passes of 256 or
    # more, which need 128 MiB or more before the margin
    small = measure_footprint(_two_phases, available=4096)
    assert small.chunk_for(budget, 1024) >= 256
    assert memory.MARGIN * _two_phases_peak(small.chunk_for(budget, 1024)) > budget
    probed = []

    def run(m: int):
        probed.append(m)
        return _two_phases(m)

    fp = measure_footprint(run, available=4096, budget=budget, at_most=1024)
    chunk = fp.chunk_for(budget, 1024)
    assert probed == [2, 2, 4, 16, 32, 64]  # warm-up, probes; 128 was predicted over the budget
    assert fp.limit == 64 and chunk == 64
    assert memory.MARGIN * _two_phases_peak(chunk) <= budget
    assert max(_two_phases_peak(m) for m in probed) <= budget  # no probe went over it here
    assert fp.chunk_for(10 * budget, 1024) == 64  # beyond the last probe the line is not trusted


def test_a_probe_that_holds_every_record_bounds_no_pass():
    fp = measure_footprint(_two_phases, available=40, budget=10**4 * MB, at_most=1024)
    assert fp.limit is None  # no pass on these 40 records is larger than the probe of all 40
    assert fp.chunk_for(10**4 * MB, 1024) == 1024


def test_the_chunk_is_the_largest_power_of_two_that_fits_or_zero():
    fp = Footprint(fixed=10, per_sample=3)
    assert fp.chunk_for(10 + 3 * 1024, 1024) == 1024  # everything fits: the most
    assert fp.chunk_for(10 + 3 * 100, 1024) == 64  # 100 fit: a power of two below
    assert fp.chunk_for(10 + 3 * 100 + 2, 1024) == 64  # a little more budget, the same chunk
    assert fp.chunk_for(13, 1024) == 1
    assert fp.chunk_for(12, 1024) == 0  # not even one sample
    assert Footprint(5, 0).chunk_for(5, 1024) == 1024


# ------------------------------------------------------------------ engines keep within the budget

def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _records(n: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _flat(model: nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])


@pytest.mark.parametrize("engine", [PerSampleGradients, GhostGradients])
@pytest.mark.parametrize("difference", [False, True])
def test_a_planned_pass_keeps_within_its_budget(engine, difference):
    model = _cnn()
    x, y = _records()
    x1 = _flat(model)
    x2 = x1 + 1e-3 * np.random.default_rng(0).standard_normal(x1.size)
    probe = engine(copy.deepcopy(model), cross_entropy, dtype=torch.float32)
    fp = probe.measure_footprints(x1, x[:4], y[:4])[difference]
    budget = Budget(fp.bytes_for(12), "test")  # room for 12 samples: passes of 8
    grads = engine(copy.deepcopy(model), cross_entropy, dtype=torch.float32, budget=budget,
                   fit_chunk=True)
    previous = x2 if difference else None
    got, peak = peak_bytes(lambda: grads.clipped_mean(x1, x, y, 1.0, previous))
    assert grads.passes[difference] == 8
    assert peak <= budget.bytes
    # the same ClippedMean as one pass over the whole shard, to float64 rounding
    whole = engine(copy.deepcopy(model), cross_entropy, dtype=torch.float32, chunk_size=64)
    want = whole.clipped_mean(x1, x, y, 1.0, previous)
    assert got.num_clipped == want.num_clipped
    assert np.abs(got.mean - want.mean).max() <= 1e-12 * np.abs(want.mean).max()


def test_a_small_model_takes_the_old_chunk_and_the_same_bits():
    model = TanhMLP(in_features=5, out_features=1)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(300, 5, generator=g, dtype=torch.float64),
            torch.randn(300, generator=g, dtype=torch.float64))
    auto = make_worker(model=model, loss="half_squared_error", data=data, partition_id=0,
                       dtype="float64")
    fixed = make_worker(model=model, loss="half_squared_error", data=data, partition_id=0,
                        dtype="float64", chunk_size=1024)
    assert auto.gradients.passes == {False: 1024, True: 1024}
    x1 = _flat(model)
    for previous in (None, x1 * 0.99):
        a, b = auto.contribute(0.5, x1, previous), fixed.contribute(0.5, x1, previous)
        np.testing.assert_array_equal(a.mean, b.mean)


# ----------------------------------------------------------------------- refused before round 1

@pytest.mark.parametrize("gradients", ["torch_func", "ghost"])
def test_a_model_whose_one_sample_does_not_fit_is_refused_in_one_line(gradients):
    x, y = _records(16)
    with pytest.raises(Refused) as caught:  # make_client: a node's refusal (one line in Flower)
        diff2_flwr.make_client(model=_cnn(), loss="cross_entropy", data=(x, y), partition_id=0,
                               gradients=gradients, memory_budget_mb=0.01)
    message = str(caught.value)
    assert "\n" not in message and message.endswith(REFUSAL_END)
    assert refusal_in(f"ClientApp raised: {message}") == message
    assert message.startswith("node of partition 0 refused: rule `training.memory_budget_mb`: "
                              "training.memory_budget_mb: one sample of a restart round needs ")
    lighter = ("a smaller model" if gradients == "ghost" else
               "training.gradients: ghost or a smaller model")
    assert (f"(training.gradients {gradients}, float32, 16,788 parameters), more than the budget "
            "of 10.2 KiB (training.memory_budget_mb = 0.01); raise training.memory_budget_mb, "
            f"or take {lighter}. Nothing was computed") in message


def test_a_fixed_chunk_that_does_not_fit_is_refused_naming_the_chunk_that_would():
    x, y = _records(16)
    probe = PerSampleGradients(_cnn(), cross_entropy, dtype=torch.float32)
    fp = probe.measure_footprints(_flat(_cnn()), x[:4], y[:4])
    budget = min(f.bytes_for(5) for f in fp.values())  # a restart round (planned first) fits < 16
    fits = fp[False].chunk_for(budget, 16)
    assert 1 <= fits <= 4
    with pytest.raises(MemoryRefusal, match=r"^training.chunk_size 16: a pass of a restart round "
                                            r"needs .* more than the budget .*set "
                                            r"training.chunk_size: auto \(the most that fits: "
                                            rf"{fits}\) or raise training.memory_budget_mb.$"):
        make_worker(model=_cnn(), loss="cross_entropy", data=(x, y), partition_id=0,
                    chunk_size=16, memory_budget_mb=budget / MB, gradients="torch_func")


def test_the_yaml_preflight_refuses_a_model_that_cannot_fit_before_flower_starts():
    cfg = parse_config({"name": "too-big", "method": "diff2",
                        "dataset": {"name": "synthetic", "num_samples": 200},
                        "privacy": {"epsilon": 3.0, "delta": 1e-5},
                        "model": {"name": "diff2_flwr.task.models:TanhMLP",
                                  "kwargs": {"hidden": 64}},
                        "training": {"clients": 2, "rounds": 2, "restart_every": 2,
                                     "memory_budget_mb": 1e-4}})
    with pytest.raises(PreflightError) as caught:
        preflight(cfg)
    message = str(caught.value)
    assert "\n" not in message
    assert ": training.memory_budget_mb: one sample of a restart " in message


def test_a_client_app_worker_that_cannot_fit_is_a_node_refusal():
    def build():
        raise MemoryRefusal("training.memory_budget_mb: one sample of a restart round needs 9 GiB")

    client = Diff2Client(build)
    with pytest.raises(Refused) as caught:
        client.worker  # noqa: B018 -- building the worker is what is refused
    assert caught.value.rule == "training.memory_budget_mb"
    assert str(caught.value).endswith(REFUSAL_END) and "needs 9 GiB" in str(caught.value)


# --------------------------------------------------------------------------- the auto settings

def test_auto_budget_is_half_the_machine_over_its_workers_capped_by_what_is_available(
        monkeypatch):
    monkeypatch.setattr(memory_budget, "machine_memory", lambda: (16 * 2**30, 15 * 2**30))
    monkeypatch.setattr(memory_budget, "co_located_workers", lambda: 1)
    assert memory_budget.resolve_budget("auto").bytes == 8 * 2**30
    monkeypatch.setattr(memory_budget, "co_located_workers", lambda: 4)
    budget = memory_budget.resolve_budget("auto")
    assert budget.bytes == 2 * 2**30 and "shared by 4 workers" in budget.source
    monkeypatch.setattr(memory_budget, "co_located_workers", lambda: 1)
    monkeypatch.setattr(memory_budget, "machine_memory", lambda: (16 * 2**30, 5 * 2**30))
    short = memory_budget.resolve_budget("auto")  # memory is short: what is available decides
    assert short.bytes == int(0.8 * 5 * 2**30) and "available now" in short.source
    assert memory_budget.resolve_budget(300).bytes == 300 * MB


def test_a_containers_cgroup_limit_is_the_machines_memory(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    limit.write_text(f"{3 * 2**30}\n")
    monkeypatch.setattr(memory_budget, "CGROUP_FILES", (str(tmp_path / "absent"), str(limit)))
    total, available = memory_budget.machine_memory()
    assert total == 3 * 2**30 and available <= total
    limit.write_text("max\n")  # no limit: the machine's RAM
    assert memory_budget.machine_memory()[0] > 0


def test_auto_dtype_is_float64_for_the_paper_mlp_and_float32_for_other_models():
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randn(8, dtype=torch.float64)
    paper = make_worker(model=PaperMLP(5, 4, 1, init_seed=0), loss="half_squared_error",
                        data=(x, y), partition_id=0, gradients="torch_func")
    other = make_worker(model=TanhMLP(in_features=5, out_features=1), loss="half_squared_error",
                        data=(x, y), partition_id=0)
    assert paper.gradients.dtype == torch.float64 and other.gradients.dtype == torch.float32


# ------------------------------------------------------------------------------ re-formed rows

def test_re_formed_rows_in_many_blocks_equal_torch_func(monkeypatch):
    monkeypatch.setattr(ghost_parts, "REFORM_BLOCK", 64)  # a few samples per block
    monkeypatch.setattr(ghost_parts, "GRAM_COST", 10**9)  # every matrix layer re-formed
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)).double()
    x = torch.randn(23, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (23,))
    ghost = GhostGradients(copy.deepcopy(model), cross_entropy)
    ref = PerSampleGradients(copy.deepcopy(model), cross_entropy)
    x1 = _flat(model)
    x2 = x1 + 0.05 * np.random.default_rng(0).standard_normal(x1.size)
    for previous in (None, x2):
        want = ref.clipped_mean(x1, x, y, 0.3, previous)
        got = ghost.clipped_mean(x1, x, y, 0.3, previous)
        assert got.num_clipped == want.num_clipped > 0
        assert np.abs(got.mean - want.mean).max() <= 1e-10 * np.abs(want.mean).max()


def test_a_re_formed_part_holds_its_norms_only_until_its_sums():
    rows = torch.randn(64, 1000, dtype=torch.float64)
    with memory._Allocations() as allocations:
        part = ghost_parts.reformed_part(lambda samples: [rows[samples] * 1.0], 64, [("w", 1000)])
        held = allocations.live
    assert held == 64 * 8  # the norms: the float64 block buffer went with the pass
    want = (rows * 0.5).sum(0)
    assert torch.allclose(part.sums(torch.full((64,), 0.5, dtype=torch.float64))["w"], want)


def test_a_convolutions_patches_are_unfolded_block_by_block(monkeypatch):
    """A materialised convolution unfolds the patches of one block at a time: forming its part and
    its sums never holds the patches of the whole pass (one iterate's: 64 samples x 256 positions
    x 27 numbers, 1.7 MiB in float32)."""
    monkeypatch.setattr(ghost_parts, "REFORM_BLOCK", 2**16)  # a few samples per block
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    n = 64
    calls = []
    for _ in range(2):  # two iterates' inputs and output gradients, as the hooks record them
        calls.append([(torch.randn(n, 3, 16, 16), torch.randn(n, 8, 16, 16))])
    names = {"weight": "w", "bias": "b"}
    patches = n * 256 * 27 * 4

    def form_and_sum():
        part = ghost_parts.matrix_part(conv, names, calls[0], calls[1], n)
        part.sums(torch.ones(n, dtype=torch.float64))
        return part

    part, peak = peak_bytes(form_and_sum)
    assert peak < patches / 2
    # the norms are those of the per-sample differences, formed directly
    per_sample = [torch.func.vmap(lambda a, b: torch.func.grad(
        lambda w: (nn.functional.conv2d(a[None], w, padding=1) * b[None]).sum())(conv.weight))(
        a, b) for a, b in (calls[0][0], calls[1][0])]
    weight = (per_sample[0] - per_sample[1]).reshape(n, -1).double()
    bias = (calls[0][0][1].sum((2, 3)) - calls[1][0][1].sum((2, 3))).double()
    want = torch.cat([weight, bias], dim=1).norm(dim=1)
    assert torch.allclose(part.norms, want, rtol=1e-5)


def test_a_row_re_formed_larger_than_its_norm_is_scaled_to_keep_its_bound():
    rows = torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=torch.float64)
    calls = []

    def form(samples: slice) -> list[torch.Tensor]:  # the second forming comes out 2x larger
        calls.append(samples)
        return [rows[samples] * (2.0 if len(calls) > 1 else 1.0)]

    part = ghost_parts.reformed_part(form, 2, [("w", 2)])
    assert part.norms.tolist() == [5.0, 1.0]
    c = torch.tensor([0.2, 1.0], dtype=torch.float64)  # clipped to 1 and unclipped, by pass 1
    total = part.sums(c)["w"]
    # each re-formed row is scaled back to the norm its factor was made from
    assert torch.allclose(total, 0.2 * rows[0] + rows[1])


def test_a_half_imported_ray_counts_as_no_ray(monkeypatch):
    """Flower's simulation has Ray in sys.modules while it is still being imported (no
    is_initialized yet): the budget must not fail the run's pre-flight on it."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    assert memory_budget.co_located_workers() == 1
    assert memory_budget.resolve_budget("auto").bytes > 0
