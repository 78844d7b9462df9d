"""Shared timing helpers for the benchmarks: interleaved rounds, medians, ratios."""

from __future__ import annotations

import gc
import os
import platform
import random
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
    """Seconds per call of ``fn`` over ``calls`` calls, after one untimed call (its caches
    warm again after other candidates ran) and a garbage collection (a neighbour's garbage
    is not collected on this candidate's time; collections its own calls cause are)."""
    fn()
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def sample(
    candidates: dict[str, Callable[[], object]], *, calls: int, rounds: int = 7, warmup: int = 3
) -> dict[str, list[float]]:
    """Seconds per call of each candidate in every round.

    Each round times every candidate once, in a fresh random order (seeded), so that
    neither drift of the machine nor a candidate's position in the round favours one.
    """
    for fn in candidates.values():  # compile and warm up
        for _ in range(warmup):
            fn()
    order = random.Random(0)
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    names = list(candidates)
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            samples[name].append(seconds_per_call(candidates[name], calls))
    return samples


def compare(
    candidates: dict[str, Callable[[], object]], *, calls: int, rounds: int = 7
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in interleaved rounds."""
    samples = sample(candidates, calls=calls, rounds=rounds)
    return {k: statistics.median(v) for k, v in samples.items()}


def paired_ratios(samples: dict[str, list[float]], base: str) -> dict[str, tuple[float, ...]]:
    """Per candidate: the median and quartiles of its time / ``base``'s time in the same
    round (pairing within a round cancels slow drift of a shared machine)."""
    out: dict[str, tuple[float, ...]] = {}
    for name, times in samples.items():
        ratios = [t / b for t, b in zip(times, samples[base], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out[name] = (statistics.median(ratios), q1, q3)
    return out
