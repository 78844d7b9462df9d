"""`jd.fit`'s speed figures: model FLOPs per step against the MLP formula, the dense peak
table, MFU, tokens per second, and the overrides.

References: the model FLOPs of a dense MLP step, 2·in·out per example per layer forward
and 3x that with the backward pass, summed over the global batch (within 10%: XLA
skips the input's gradient and adds elementwise work); MFU and TFLOP/s per device
recomputed from the other recorded figures (rtol 1e-9).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.training.fit.throughput import (
    DENSE_PEAK_FLOPS,
    compiled_flops,
    peak_flops_per_device,
    throughput,
)

from _helpers import TanhMLP, mse_step, strategy_params

SIZES = (64, 256, 256, 16)
BATCH = 64


def _setup(strategy: jd.Strategy) -> tuple[Any, TanhMLP, nnx.Optimizer, Any]:
    with strategy.scope():
        model = TanhMLP(SIZES, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BATCH, SIZES[0])).astype(np.float32)
    y = rng.normal(size=(2 * BATCH, SIZES[-1])).astype(np.float32)
    data = jd.data.from_arrays(x, y, batch_size=BATCH)
    return mse_step(strategy), model, opt, data


def _formula() -> float:
    """Model FLOPs of one global step: 2·in·out per example per layer, x3 with backward."""
    return 3 * sum(2 * a * b * BATCH for a, b in itertools.pairwise(SIZES))


@pytest.mark.parametrize("make", strategy_params("one_device", "mirrored8"))
def test_flops_per_step_is_the_global_model_flops(make: Any) -> None:
    """Read from the compiled step's cost analysis (one device's program) times the
    devices: the whole global batch's FLOPs, on one device or eight."""
    strategy = make()
    step, model, opt, data = _setup(strategy)
    history = jd.fit(step, model, opt, data=data, epochs=2, verbose=False)
    flops = history.history["flops_per_step"]
    assert len(flops) == 2 and flops[0] == flops[1]
    np.testing.assert_allclose(flops[0], _formula(), rtol=0.1)
    assert "mfu" not in history.history  # a CPU has no known peak
    # Achieved TFLOP/s per device: FLOPs per step x steps/s / devices (all batches full).
    steps_per_s = np.array(history.history["examples_per_second"]) / BATCH
    devices = strategy.num_replicas_in_sync
    np.testing.assert_allclose(
        history.history["tflops_per_device"], flops[0] * steps_per_s / devices / 1e12, rtol=1e-9
    )
    assert history.history["examples_per_second"] == history.examples_per_second


def test_compiled_flops_counts_one_devices_program(mirrored8: jd.MirroredStrategy) -> None:
    """The cost analysis of a program over 8 devices is one device's share: an eighth of
    the one-device program's (within 10%: the replicated update is counted per device)."""
    step8, model8, opt8, data8 = _setup(mirrored8)
    batch8 = next(iter(mirrored8.experimental_distribute_dataset(data8)))
    per_device = step8.lower(model8, opt8, batch8).compile().cost_analysis()["flops"]
    np.testing.assert_allclose(per_device * 8, _formula(), rtol=0.1)
    np.testing.assert_allclose(
        compiled_flops(step8.lower(model8, opt8, batch8).compile(), 8), per_device * 8
    )


def test_mfu_from_a_given_peak_and_printed(capsys: pytest.CaptureFixture[str]) -> None:
    strategy = jd.MirroredStrategy(["cpu:0", "cpu:1"])
    step, model, opt, data = _setup(strategy)
    history = jd.fit(step, model, opt, data=data, peak_flops_per_device=1e9)
    h = history.history
    np.testing.assert_allclose(h["mfu"], np.array(h["tflops_per_device"]) * 1e12 / 1e9, rtol=1e-9)
    out = capsys.readouterr().out
    assert "examples/s" in out and "steps/s" in out and "TFLOP/s/device" in out
    assert f"MFU {100 * h['mfu'][0]:.3g}%" in out


def test_given_flops_per_step_and_tokens_per_example() -> None:
    strategy = jd.OneDeviceStrategy("cpu:0")
    step, model, opt, data = _setup(strategy)
    history = jd.fit(
        step, model, opt, data=data, epochs=2, verbose=False, flops_per_step=2e9,
        tokens_per_example=128, peak_flops_per_device=4e12,
    )  # fmt: skip
    h = history.history
    assert h["flops_per_step"] == [2e9, 2e9]
    np.testing.assert_allclose(h["tokens_per_second"], np.array(h["examples_per_second"]) * 128)
    steps_per_s = np.array(h["examples_per_second"]) / BATCH
    np.testing.assert_allclose(h["tflops_per_device"], 2e9 * steps_per_s / 1e12, rtol=1e-9)
    np.testing.assert_allclose(h["mfu"], 2e9 * steps_per_s / 4e12, rtol=1e-9)


def test_a_plain_callable_step_has_throughput_without_flops() -> None:
    strategy = jd.OneDeviceStrategy("cpu:0")
    step, model, opt, data = _setup(strategy)
    history = jd.fit(
        lambda m, o, b: step(m, o, b), model, opt, data=data, verbose=False, strategy=strategy
    )
    assert set(history.history) == {"loss", "examples_per_second"}


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5e", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("NVIDIA H100 PCIe", None),  # not the SXM part: give peak_flops_per_device
        ("TPU v4 lite", None),
        ("cpu", None),
    ],
)
def test_dense_peak_table(kind: str, peak: float | None) -> None:
    assert peak_flops_per_device(kind) == peak


def test_the_peaks_are_dense_not_sparse() -> None:
    """The table's values are the data sheets' dense bf16 figures (half the "with
    sparsity" ones), e.g. H100 SXM 989 TFLOP/s, not 1979."""
    assert sorted(set(DENSE_PEAK_FLOPS.values())) == [
        197e12, 275e12, 312e12, 459e12, 918e12, 989e12
    ]  # fmt: skip
    assert peak_flops_per_device() is None  # the tests' CPU devices


def test_throughput_arithmetic() -> None:
    t = throughput(
        steps=10, examples=640, seconds=4.0, num_devices=4, flops_per_step=8e12,
        peak_flops_per_device=10e12, tokens_per_example=3,
    )  # fmt: skip
    assert t.steps_per_second == 2.5 and t.examples_per_second == 160.0
    assert t.tokens_per_second == 480.0
    assert t.tflops_per_device == 5.0 and t.mfu == 0.5
    assert t.as_logs() == {
        "examples_per_second": 160.0, "tokens_per_second": 480.0, "flops_per_step": 8e12,
        "tflops_per_device": 5.0, "mfu": 0.5,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"flops_per_step": 0}, ValueError, r"jaxdist.fit: flops_per_step must be > 0, got 0"),
        ({"peak_flops_per_device": -1e12}, ValueError, r"peak_flops_per_device must be > 0"),
        ({"tokens_per_example": 1.5}, TypeError, r"tokens_per_example must be a positive int"),
        ({"flops_per_step": "6N"}, TypeError, r"flops_per_step must be a positive float"),
    ],
)
def test_bad_speed_arguments(kwargs: dict[str, Any], error: type, message: str) -> None:
    strategy = jd.OneDeviceStrategy("cpu:0")
    step, model, opt, data = _setup(strategy)
    with pytest.raises(error, match=message):
        jd.fit(step, model, opt, data=data, verbose=False, **kwargs)
