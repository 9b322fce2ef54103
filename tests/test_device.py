"""A client's per-sample work on a chosen device (issue 41, item 3): ``training.device`` /
``make_client(device=...)``, checked where the worker is built; every tensor the engines make
follows the device they were given; on CUDA where torch sees one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import diff2_flwr
from diff2_flwr.core.device import resolve_device
from diff2_flwr.runtime.config import ConfigError, TrainingConfig
from diff2_flwr.runtime.spec import Invalid

from test_ghost_layers import CASES, setup

CUDA = torch.cuda.is_available()
NO_CUDA = (f"torch sees no CUDA device here (torch {torch.__version__}, CUDA build: "
           f"{torch.version.cuda or 'no'}): the GPU path is exercised on a machine with one")


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "gpu", ""])
def test_a_device_setting_that_is_no_device_is_refused(bad):
    with pytest.raises(Invalid, match=r"^key `device`: expected cpu, cuda, cuda:N or auto\. "):
        TrainingConfig(device=bad)


@pytest.mark.skipif(CUDA, reason="this machine has a GPU: a cuda device is not refused here")
def test_a_gpu_asked_for_where_there_is_none_is_refused_in_one_line():
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with pytest.raises(ConfigError) as caught:
        diff2_flwr.make_client(model=nn.Linear(3, 2), loss="cross_entropy", data=(x, y),
                               partition_id=0, device="cuda")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("diff2_flwr.make_client: argument `device`: expected a device "
                              "torch sees on this machine. Found \"device 'cuda' was asked for, "
                              "but torch sees 0 CUDA device(s)")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("name", [n for n in CASES if n != "tied_weights"])
def test_every_tensor_the_engines_make_follows_their_device(name):
    """Under a default device of "meta", any tensor made without the engine's device (a
    ``torch.zeros(n)``) is a meta tensor, and the first op that meets a real one fails: the engines
    given the CPU explicitly must not make one (what a CUDA run needs, checked without a GPU)."""
    ghost, ref, x, y, x1, x2 = setup(name)
    want = {}
    for engine in (ghost, ref):
        for previous in (None, x2):
            want[type(engine), previous is None] = engine.clipped_mean(x1, x, y, 0.5, previous)
    for engine in (ghost, ref):
        with torch.device("meta"):
            for previous in (None, x2):
                got = engine.clipped_mean(x1, x, y, 0.5, previous)
                np.testing.assert_array_equal(got.mean, want[type(engine), previous is None].mean)


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("gradients", ["torch_func", "ghost"])
def test_a_client_on_cuda_computes_the_cpu_clipped_mean(gradients):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3))
    x, y = torch.randn(40, 3, 8, 8), torch.randint(0, 3, (40,))
    cpu = diff2_flwr.make_client(model=model, loss="cross_entropy", data=(x, y), partition_id=0,
                                 gradients=gradients)
    gpu = diff2_flwr.make_client(model=model, loss="cross_entropy", data=(x, y), partition_id=0,
                                 gradients=gradients, device="cuda")
    assert all(p.is_cuda for p in gpu.worker.gradients.model.parameters())
    x1 = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
    for previous in (None, x1 + 1e-2):
        a = cpu.worker.contribute(0.5, x1, previous)
        b = gpu.worker.contribute(0.5, x1, previous)
        assert a.num_clipped == b.num_clipped
        # float32 kernels differ between devices: agreement to float32 rounding
        assert np.abs(a.mean - b.mean).max() <= 1e-4 * np.abs(a.mean).max()
