"""How `jaxdist.fit` measures its speed: the step's model FLOPs (once) and each epoch's
throughput, from the times the loop already takes (private).

No device sync is added: the FLOP count comes from the compiled step's cost
analysis, read once after the first step (the program is compiled by then, so
this finds it in JAX's caches), and the rates from the epoch's wall time and
real rows, which the loop measures anyway. See
`jaxdist.training.fit.throughput` for what the figures mean.
"""

from __future__ import annotations

import time
from typing import Any

from jaxdist.strategies.base import Strategy
from jaxdist.training.fit.throughput import (
    Throughput,
    compiled_flops,
    peak_flops_per_device,
    throughput,
)
from jaxdist.training.step.train_step import TrainStep

__all__ = ["FitMeter"]

_WHERE = "jaxdist.fit"


def _positive(name: str, value: Any, kind: type) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise TypeError(f"{_WHERE}: {name} must be a positive {kind.__name__}, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{_WHERE}: {name} must be > 0, got {value!r}.")


class FitMeter:
    """The speed figures of one `fit` call (private).

    Args:
        strategy: the strategy the steps run on (its mesh's devices count).
        flops_per_step: fit's override of the model FLOPs of one global step.
        peak_flops_per_device: fit's override of the device's dense peak.
        tokens_per_example: tokens in one example (its sequence length), for
            tokens per second.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        flops_per_step: float | None,
        peak_flops_per_device: float | None,
        tokens_per_example: int | None,
    ) -> None:
        _positive("flops_per_step", flops_per_step, float)
        _positive("peak_flops_per_device", peak_flops_per_device, float)
        _positive("tokens_per_example", tokens_per_example, int)
        self.num_devices = int(strategy.mesh.size)
        self.central = strategy.parameter_placed
        self.flops_per_step = None if flops_per_step is None else float(flops_per_step)
        self.peak = (
            float(peak_flops_per_device)
            if peak_flops_per_device is not None
            else peak_flops_per_device_of(strategy)
        )
        self.tokens_per_example = tokens_per_example
        self.measured = flops_per_step is not None  # nothing left to find

    def measure(self, step: Any, state: tuple[Any, ...], batch: Any) -> float:
        """Reads the step's model FLOPs from its compiled program, once (after its first
        call, for ``state`` and ``batch`` of that call's structure); returns the seconds
        spent, for the loop to leave out of its timing. Only a `jaxdist.train_step` run
        one step per call, not donating its batch, on a strategy without central
        storage has a program to read here; otherwise give ``flops_per_step``."""
        if self.measured:
            return 0.0
        self.measured = True
        if (
            not isinstance(step, TrainStep)
            or step.options.donate_argnums is not None  # the batch may be gone
            or self.central  # TrainStep.lower does not place the central copy
        ):
            return 0.0
        start = time.perf_counter()
        compiled = step.lower(*state, batch).compile()
        self.flops_per_step = compiled_flops(compiled, self.num_devices)
        return time.perf_counter() - start

    def rates(self, steps: int, examples: int, seconds: float) -> Throughput:
        """The speed of ``steps`` steps over ``examples`` real rows in ``seconds``."""
        return throughput(
            steps=steps,
            examples=examples,
            seconds=seconds,
            num_devices=self.num_devices,
            flops_per_step=self.flops_per_step,
            peak_flops_per_device=self.peak,
            tokens_per_example=self.tokens_per_example,
        )


def peak_flops_per_device_of(strategy: Strategy) -> float | None:
    """The dense peak of the strategy's first device (None when unknown)."""
    return peak_flops_per_device(strategy.mesh.devices.flat[0])
