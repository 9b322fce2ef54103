"""Model factories that are mistakes, for tests/test_preflight.py (named in configs as
``preflight_models:<name>``; the tests put this folder on PYTHONPATH)."""

from __future__ import annotations

import torch


def not_a_module(in_features: int, out_features: int) -> dict:
    return {"weight": [[0.0] * in_features] * out_features}


def raises(in_features: int, out_features: int) -> torch.nn.Module:
    raise RuntimeError("this factory fails on purpose")


def with_batch_norm(in_features: int, out_features: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(in_features, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Linear(4, out_features))


def wrong_width(in_features: int, out_features: int) -> torch.nn.Module:
    """Ignores in_features: its forward cannot take the data's features."""
    return torch.nn.Linear(in_features + 3, out_features)
