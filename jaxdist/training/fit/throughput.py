"""How fast training runs: model FLOPs of a compiled step, chips' dense peaks, and MFU.

The figures `jaxdist.fit` reports per epoch (and benchmarks print) come from
here; the module needs nothing above JAX, so a benchmark or a hand-written
loop can use it too.

Model FLOPs per step are read from XLA's cost analysis of the compiled step
(`compiled_flops`). What it counts: the floating-point operations of the
optimised HLO program, an ``f32``/``bf16`` multiply-add counting 2, a dot of
``(m, k) x (k, n)`` counting ``2*m*k*n``, elementwise ops one per element; it
counts what the program does, so a gradient that is never used (the input's)
is not counted, and a rematerialised forward is counted twice (that is
hardware FLOPs, not model FLOPs: pass ``flops_per_step=`` then). For a
program partitioned over several devices (``shard_map``, a sharded ``jit``)
XLA compiles one per-device program, and its cost analysis is that of one
device: `compiled_flops` multiplies by the program's device count to give the
global figure. Work every device repeats (a replicated optimizer update) is
then counted once per device; for a model whose matmuls dominate, this is
small.

MFU (model FLOPs utilisation) is achieved model FLOP/s per device divided by
the device's dense peak (`peak_flops_per_device`): the bf16 dense peak of a
GPU's tensor cores or a TPU's matrix units, never the 2x "with sparsity"
figure of data sheets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

__all__ = [
    "DENSE_PEAK_FLOPS",
    "Throughput",
    "compiled_flops",
    "peak_flops_per_device",
    "throughput",
]

# Dense bf16 peak FLOP/s per chip, by the name JAX reports as ``device.device_kind``
# (matched case-insensitively, first match wins). Data-sheet figures without sparsity.
DENSE_PEAK_FLOPS: Mapping[str, float] = {
    r"h100 80gb hbm3|h100 sxm": 989e12,  # H100 SXM ("NVIDIA H100 80GB HBM3")
    r"\bh200\b": 989e12,  # H200: the H100 SXM's compute, more memory ("NVIDIA H200")
    r"\ba100\b": 312e12,  # A100 SXM and PCIe ("NVIDIA A100-SXM4-80GB")
    r"^tpu v4$": 275e12,  # TPU v4
    r"^tpu v5 ?lite$|^tpu v5e$": 197e12,  # TPU v5e (JAX: "TPU v5 lite")
    r"^tpu v5p?$": 459e12,  # TPU v5p (JAX: "TPU v5")
    r"^tpu v6 ?lite$|^tpu v6e$": 918e12,  # TPU v6e, Trillium (JAX: "TPU v6 lite")
}


def peak_flops_per_device(device: Any = None) -> float | None:
    """The dense bf16 peak FLOP/s of ``device`` (default: ``jax.devices()[0]``), or None
    when it is not in `DENSE_PEAK_FLOPS` (CPUs, unknown chips).

    ``device`` may also be a ``device_kind`` string.

    Example:
        >>> from jaxdist.training.fit.throughput import peak_flops_per_device
        >>> peak_flops_per_device("TPU v5 lite")
        197000000000000.0
        >>> peak_flops_per_device("cpu") is None
        True
    """
    if device is None:
        device = jax.devices()[0]
    kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
    kind = kind.strip().lower()
    for pattern, peak in DENSE_PEAK_FLOPS.items():
        if re.search(pattern, kind):
            return peak
    return None


def compiled_flops(compiled: Any, num_devices: int) -> float | None:
    """Model FLOPs of one call of a compiled program, all devices together: its cost
    analysis's ``"flops"`` (one device's program) times ``num_devices`` (the devices the
    program runs on). None when the backend gives no figure.

    Args:
        compiled: ``jax.jit(f).lower(...).compile()``, or the ``.compile()`` of a
            `jaxdist.train_step`'s ``lower(...)``.
        num_devices: the devices the program is partitioned over.
    """
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # a backend without cost analysis: no figure
        return None
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not isinstance(analysis, Mapping):
        return None
    flops = analysis.get("flops")
    if flops is None or flops <= 0:
        return None
    return float(flops) * num_devices


class Throughput(NamedTuple):
    """One interval's training speed (see `throughput`)."""

    steps_per_second: float
    examples_per_second: float
    tokens_per_second: float | None
    flops_per_step: float | None
    tflops_per_device: float | None
    mfu: float | None

    def as_logs(self) -> dict[str, float]:
        """The figures as `History` keys: ``examples_per_second``, ``tokens_per_second``
        (with ``tokens_per_example``), ``flops_per_step`` and ``tflops_per_device`` (with
        a FLOP count) and ``mfu`` (with a peak too); absent figures are left out."""
        logs = {"examples_per_second": self.examples_per_second}
        optional = {
            "tokens_per_second": self.tokens_per_second,
            "flops_per_step": self.flops_per_step,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
        }
        logs.update({k: v for k, v in optional.items() if v is not None})
        return logs


def throughput(
    *,
    steps: int,
    examples: int,
    seconds: float,
    num_devices: int,
    flops_per_step: float | None = None,
    peak_flops_per_device: float | None = None,
    tokens_per_example: int | None = None,
) -> Throughput:
    """The speed of ``steps`` steps over ``examples`` real rows in ``seconds``.

    Achieved TFLOP/s per device is ``flops_per_step * steps / seconds / num_devices
    / 1e12``, and MFU that over the peak (both need ``flops_per_step``; MFU also
    ``peak_flops_per_device``).

    Example:
        >>> from jaxdist.training.fit.throughput import throughput
        >>> t = throughput(steps=10, examples=5120, seconds=2.0, num_devices=8,
        ...                flops_per_step=4e12, peak_flops_per_device=5e12)
        >>> t.examples_per_second, t.tflops_per_device, t.mfu
        (2560.0, 2.5, 0.5)
    """
    seconds = max(seconds, 1e-9)
    steps_per_second = steps / seconds
    tflops = mfu = None
    if flops_per_step is not None:
        achieved = flops_per_step * steps_per_second / num_devices
        tflops = achieved / 1e12
        if peak_flops_per_device is not None:
            mfu = achieved / peak_flops_per_device
    tokens = None if tokens_per_example is None else examples * tokens_per_example / seconds
    return Throughput(steps_per_second, examples / seconds, tokens, flops_per_step, tflops, mfu)
