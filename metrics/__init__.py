"""Workloads oomguard sizes and runs; ``oomguard.metrics.metric`` turns a function into one
(:mod:`oomguard.metrics.function`, imported on first use: this package imports no torch)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["metric"]


def __getattr__(name: str) -> Any:
    if name == "metric":
        return importlib.import_module("oomguard.metrics.function").metric
    raise AttributeError(f"module 'oomguard.metrics' has no attribute {name!r}")
