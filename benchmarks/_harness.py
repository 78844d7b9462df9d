"""Shared timing helpers for the benchmarks: interleaved rounds, medians, ratios."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax


def setup_devices(n: int = 8) -> None:
    """Simulates ``n`` CPU devices when no accelerator is present (call before JAX starts)."""
    jax.config.update("jax_num_cpu_devices", n)


def describe_machine() -> str:
    dev = jax.devices()[0]
    return (
        f"{len(jax.devices())} x {dev.device_kind} ({dev.platform}), {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, jax {jax.__version__}"
    )


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare(
    candidates: dict[str, Callable[[], object]], *, calls: int, rounds: int = 7
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in interleaved rounds."""
    for fn in candidates.values():  # compile and warm up
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            samples[name].append(seconds_per_call(fn, calls))
    return {k: statistics.median(v) for k, v in samples.items()}
