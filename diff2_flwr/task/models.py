"""Models. The paper's MLP: one hidden layer of 10 softplus units; or any ``torch.nn.Module``
from a factory named by import path.

Every parameter (weights and biases) of the paper MLP's layer with fan-in w_in is initialised
uniformly in [-1/sqrt(w_in), 1/sqrt(w_in)], from an explicit generator so that x_0 is
reproducible. A factory's model is initialised by the factory itself, under torch's generator
seeded with ``init_seed`` (and restored afterwards), with float64 as torch's default dtype:
x_0 is then reproducible too.

References:
    Murata & Suzuki (2023), Section 6 (experimental setting); DIFF2.md, "Model".
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..core.ghost import MLP

__all__ = ["DigitsCNN", "PaperMLP", "TanhMLP", "build_model", "load_factory", "mlp_shape"]


class PaperMLP(nn.Module):
    """in_features -> hidden (softplus) -> out_features."""

    def __init__(self, in_features: int, hidden: int = 10, out_features: int = 1, *,
                 init_seed: int = 0) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, out_features)
        gen = torch.Generator().manual_seed(init_seed)
        with torch.no_grad():
            for layer in (self.hidden, self.out):
                bound = 1 / math.sqrt(layer.in_features)
                for p in (layer.weight, layer.bias):
                    p.copy_(torch.rand(p.shape, generator=gen,
                                       dtype=torch.float64).mul(2 * bound).sub(bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Outputs [n, out_features] of inputs [n, in_features]."""
        return self.out(nn.functional.softplus(self.hidden(x)))


class TanhMLP(nn.Module):
    """in_features -> hidden -> hidden (tanh) -> out_features: a model beyond the paper's, for
    ``model: {name: "diff2_flwr.task.models:TanhMLP", kwargs: {hidden: 16}}``. Torch's default
    initialisation (seeded by ``model.init_seed``)."""

    def __init__(self, *, in_features: int, out_features: int, hidden: int = 16) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(),
                                    nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden,
                                                                                    out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Outputs [n, out_features] of inputs [n, in_features]."""
        return self.layers(x)


class DigitsCNN(nn.Module):
    """A small CNN for 8×8 grey images given as flat rows of 64 pixels (``dataset.name: digits``):
    conv 3×3 (``channels`` maps, padding 1) -> tanh -> 2×2 average pool -> linear to
    ``out_features``.

    No batch-norm (it would mix the samples of a batch, which per-sample clipping forbids). With the
    default 8 channels it has 8·9 + 8 + 8·16·10 + 10 = 1,370 parameters. Torch's default
    initialisation (seeded by ``model.init_seed``). Use as ``model: {name:
    "diff2_flwr.task.models:DigitsCNN", kwargs: {channels: 8}}``.
    """

    def __init__(self, *, in_features: int = 64, out_features: int = 10, channels: int = 8,
                 side: int = 8) -> None:
        super().__init__()
        if in_features != side * side:
            raise ValueError(
                f"DigitsCNN reads {side}×{side} images as rows of {side * side} pixels, but the "
                f"data has {in_features} features. Use it with dataset.name: digits (or set "
                f"kwargs.side).")
        if side % 2:
            raise ValueError(
                f"DigitsCNN pools 2×2: the image side must be even. Found side = {side}.")
        if channels < 1:
            raise ValueError(f"DigitsCNN needs channels >= 1. Found {channels}.")
        self.side = side
        self.conv = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.out = nn.Linear(channels * (side // 2) ** 2, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores [n, out_features] of images given as rows [n, side²]."""
        h = self.pool(torch.tanh(self.conv(x.reshape(-1, 1, self.side, self.side))))
        return self.out(h.flatten(1))


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _where_modules_live(module_name: str, attribute: str, missing: str) -> str:
    """What to do when the factory's own module is not found. Under `flwr run` the ServerApp and the
    ClientApps import from the app folder as shipped in the FAB (what ``fab-include`` lists) and
    from their own environment."""
    if module_name.startswith("custom.") and missing != "custom":
        return (
            f"The app's custom/ folder has no {module_name[len('custom.'):].replace('.', '/')}.py "
            f"(Flower also "
                "leaves files named test_*.py or *_test.py out of the FAB): check the file's name "
                "and the path.")
    leaf = module_name.rpartition(".")[2]
    return (
        "`flwr run` imports only what its FAB ships (the app folder's files listed by fab-include "
        "in "
            "pyproject.toml) and packages installed on the nodes, never PYTHONPATH: put the "
            "module in the app's "
            f"custom/ folder (e.g. custom/{leaf}.py, named 'custom.{leaf}:{attribute}') or in a "
            f"folder added to "
            "fab-include, or install its package into every node's environment (where the "
            "ServerApp and the "
            "ClientApps run); or fix the path.")


def _not_found(key: str, path: str, err: ModuleNotFoundError) -> ValueError:
    """The factory's module itself missing, or present but importing a package that is not
    installed."""
    module_name, _, attribute = path.partition(":")
    missing = err.name or module_name
    found = f"{type(err).__name__}: {_one_line(err)}"
    if module_name == missing or module_name.startswith(missing + "."):
        return ValueError(
            f"key `{key}`: cannot import module {module_name!r} of the model factory {path!r} "
                          f"({found}). {_where_modules_live(module_name, attribute, missing)}")
    return ValueError(
        f"key `{key}`: module {module_name!r} of the model factory {path!r} imports {missing!r}, "
        f"which "
                      f"is not installed ({found}). Install it into every node's environment "
                      f"(where the ServerApp and "
                      "the ClientApps run), or drop that import.")


def load_factory(path: str, *, key: str = "model.name") -> Callable[..., Any]:
    """The callable named by ``"package.module:attribute"``; an error naming ``key`` if it cannot be
    found.

    A module that is not found gets an error saying where it must live for `flwr run`: the app's
    ``custom/`` folder, a folder in ``fab-include``, or a package installed where the apps run.
    """
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise _not_found(key, path, err) from err
    except Exception as err:  # noqa: BLE001 (the user's module failed while being imported: a SyntaxError, ...)
        raise ValueError(
            f"key `{key}`: importing module {module_name!r} of the model factory {path!r} raised "
                         f"{type(err).__name__}: {_one_line(err)}. Fix that module.") from err
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"key `{key}`: module {module_name!r} has no attribute {attribute!r} (the model "
                f"factory {path!r}). Name a function or class defined there.")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(
            f"key `{key}`: {path!r} is a {type(target).__name__}, not a callable that builds a "
            f"model.")
    return target


def _call_factory(path: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> nn.Module:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        raise ValueError(
            f"key `model.kwargs`: the model factory {path!r} is called as factory(in_features=..., "
                         f"out_features=..., **model.kwargs) with {sorted(kwargs)}, which it does "
                         f"not accept ({err}). "
                         "Give it these keyword parameters, or change model.kwargs.") from None
    except ValueError:  # no signature (a builtin): let the call itself tell
        pass
    try:
        model = factory(**kwargs)
    except Exception as err:  # noqa: BLE001 (the user's factory: whatever it raises is the user's to fix)
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(
            f"key `model.name`: the model factory {path!r} raised {type(err).__name__}: "
            f"{_one_line(err)} (called as factory({shown})). Fix the factory or model.kwargs."
        ) from err
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"key `model.name`: the model factory {path!r} returned a {type(model).__name__}, not "
            f"a "
                         "torch.nn.Module.")
    return model


def build_model(name: str, *, in_features: int, out_features: int, hidden: int = 10,
                init_seed: int = 0, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """The paper MLP (``name`` "paper_mlp") or the model of the factory ``name``
    ("package.module:callable"), called as ``factory(in_features=..., out_features=..., **kwargs)``;
    float64 parameters (x_0)."""
    if name == "paper_mlp":
        return PaperMLP(in_features, hidden, out_features, init_seed=init_seed).double()
    factory = load_factory(name)
    arguments = {"in_features": in_features, "out_features": out_features, **dict(kwargs or {})}
    default_dtype = torch.get_default_dtype()
    # x_0 from init_seed; the caller's global generator untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        # initial values drawn in float64, whatever the compute dtype
        torch.set_default_dtype(torch.float64)
        try:
            model = _call_factory(name, factory, arguments)
        finally:
            torch.set_default_dtype(default_dtype)
    return model.double()


def _activation_name(module: nn.Module) -> str | None:
    if type(module) is nn.Softplus:
        return "softplus" if module.beta == 1 and module.threshold == 20 else None
    return {nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.ReLU: "relu",
            nn.Identity: "identity"}.get(type(module))


def _sequential_shape(seq: nn.Sequential) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """(widths, activations) of Linear, activation, Linear, ..., Linear; None for anything else."""
    sizes: list[int] = []
    activations: list[str] = []
    expect_linear = True
    for module in seq:
        if expect_linear:
            if type(module) is not nn.Linear or module.bias is None or (
                sizes and module.in_features != sizes[-1]):
                return None
            sizes += [module.in_features,
                      module.out_features] if not sizes else [module.out_features]
        else:
            name = _activation_name(module)
            if name is None:
                return None
            activations.append(name)
        expect_linear = not expect_linear
    if not sizes or expect_linear:  # empty, or ends with an activation
        return None
    return tuple(sizes), tuple(activations)


def mlp_shape(model: nn.Module, loss: str) -> MLP | None:
    """The :class:`~diff2_flwr.core.ghost.MLP` that computes exactly ``model`` (its closed forms
    then apply), or None.

    Known shapes only, since a module's ``forward`` may do anything: :class:`PaperMLP`,
    :class:`TanhMLP`, and a plain ``nn.Sequential`` of ``nn.Linear`` layers (with biases) separated
    by one of ``nn.Softplus`` (beta 1, threshold 20), ``nn.Tanh``, ``nn.Sigmoid``, ``nn.ReLU``,
    ``nn.Identity``. Every parameter must be trainable and the loss ``half_squared_error`` (one
    output) or ``cross_entropy`` (>= 2 outputs).
    """
    if not all(p.requires_grad for p in model.parameters()) or any(True for _ in model.buffers()):
        return None
    if type(model) is PaperMLP:
        shape = ((model.hidden.in_features, model.hidden.out_features, model.out.out_features),
                 ("softplus",))
    elif type(model) is TanhMLP:
        shape = _sequential_shape(model.layers)
    elif type(model) is nn.Sequential:
        shape = _sequential_shape(model)
    else:
        return None
    if shape is None:
        return None
    try:
        return MLP(shape[0], shape[1], loss)
    except ValueError:  # e.g. a loss without closed form, or cross-entropy on one output
        return None
