"""What `jd.fit`'s speed figures cost: fit with them vs the same fit without them, in one
process.

Both sides run the same `jd.train_step` program over the same data with
``jd.fit``; the baseline is fit with its speed meter left out (patched here, in
the benchmark only: fit then records examples/s as before and nothing else).
The figures read no value from the device: the FLOP count comes from the
compiled step's cost analysis, read once per fit call after the first step
(lowering the step again finds the compiled program in JAX's caches), and the
rates from the times fit already takes. Cases:

- ``digits``: the digits demo's CNN, one epoch of its training set per call
  (global batch 64 over 8 replicas), as ``benchmarks/digits.py`` runs it;
- ``mlp``: the benchmark MLP 784-1024-1024-10, adamw, global batch 512 over 8
  replicas, 10 steps per call.

Prints, per case, the paired ratio (time with the figures / time without,
median and quartiles over interleaved rounds), the one-off cost of the FLOP
count per fit call, and the figures fit reported.

Usage: python benchmarks/fit_metrics.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import _harness
import numpy as np
import optax
from flax import nnx
from train_step import BATCH as MLP_BATCH  # the benchmark MLP
from train_step import MLP
from train_step import SIZES as MLP_SIZES

import jaxdist as jd
from jaxdist.examples import digits
from jaxdist.training.fit.meter import FitMeter

# The module of `jd.fit` (``jaxdist.training.fit`` the attribute is the function).
fit_module = importlib.import_module("jaxdist.training.fit.fit")

MLP_STEPS = 10
DIGITS_BATCH = 64


@contextlib.contextmanager
def _without_meter() -> Iterator[None]:
    """fit without its speed meter: the baseline (same program, same loop otherwise)."""
    original = fit_module.FitMeter
    fit_module.FitMeter = lambda *a, **k: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        fit_module.FitMeter = original  # type: ignore[misc]


def _mlp_case(strategy: jd.Strategy) -> tuple[Callable[..., Any], dict[str, Any]]:
    with strategy.scope():
        model = MLP(MLP_SIZES, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):  # type: ignore[no-untyped-def]
        x, y = batch

        def loss_fn(m):  # type: ignore[no-untyped-def]
            ce = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
            return jd.compute_average_loss(ce)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return {"loss": ctx.all_reduce("sum", loss)}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(MLP_BATCH * MLP_STEPS, MLP_SIZES[0])).astype(np.float32)
    y = rng.integers(0, 10, size=(MLP_BATCH * MLP_STEPS,)).astype(np.int32)
    data = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=MLP_BATCH))

    def run(**kwargs: Any) -> Any:
        return jd.fit(step, model, opt, data=data, progress=False, verbose=False, **kwargs)

    return run, {"step": step, "state": (model, opt), "batch": next(iter(data))}


def _digits_case(strategy: jd.Strategy) -> tuple[Callable[..., Any], dict[str, Any]]:
    x_train, y_train, _, _ = digits.load_digits()
    full = len(x_train) // DIGITS_BATCH * DIGITS_BATCH
    data = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x_train[:full], y_train[:full], batch_size=DIGITS_BATCH)
    )
    with strategy.scope():
        model = digits.CNN(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=1e-4), wrt=nnx.Param)
    step, _ = digits.build_steps(strategy)

    def run(**kwargs: Any) -> Any:
        return jd.fit(step, model, opt, data=data, progress=False, verbose=False, **kwargs)

    return run, {"step": step, "state": (model, opt), "batch": next(iter(data))}


def _flop_count_seconds(strategy: jd.Strategy, parts: dict[str, Any], calls: int = 5) -> float:
    """The one-off cost per fit call: reading the compiled step's FLOPs (median seconds)."""
    times = []
    for _ in range(calls):
        meter = FitMeter(
            strategy, flops_per_step=None, peak_flops_per_device=None, tokens_per_example=None
        )
        start = time.perf_counter()
        meter.measure(parts["step"], parts["state"], parts["batch"])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _arithmetic_seconds(strategy: jd.Strategy, calls: int = 20_000) -> tuple[float, float]:
    """Seconds per call of the epoch's figures (`FitMeter.rates`, once per epoch and per
    bar redraw) and of the loop's per-step check (is the FLOP count still to be read?)."""
    meter = FitMeter(strategy, flops_per_step=1e9, peak_flops_per_device=1e12, tokens_per_example=8)
    start = time.perf_counter()
    for _ in range(calls):
        meter.rates(100, 6400, 1.5)
    rates = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls):
        if meter is not None and not meter.measured:
            pass
    return rates, (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    strategy = jd.MirroredStrategy()
    print(_harness.describe_machine())
    rates, check = _arithmetic_seconds(strategy)
    print(
        f"the figures' arithmetic: {rates * 1e6:.1f} us per epoch (and per bar redraw), "
        f"{check * 1e9:.0f} ns per step"
    )
    for name, make in (("digits", _digits_case), ("mlp", _mlp_case)):
        run, parts = make(strategy)

        def without(run: Callable[..., Any] = run) -> None:
            with _without_meter():
                run()

        samples = _harness.sample(
            {"with figures": run, "without": without}, calls=1, rounds=args.rounds
        )
        ratio, q1, q3 = _harness.paired_ratios(samples, "without")["with figures"]
        history = run()
        h = history.history
        per_fit = _flop_count_seconds(strategy, parts)
        seconds = statistics.median(samples["without"])
        print(
            f"{name}: one fit call {seconds * 1e3:.1f} ms without the figures; with them "
            f"{ratio:.3f}x (quartiles {q1:.3f}-{q3:.3f}); the FLOP count costs "
            f"{per_fit * 1e3:.1f} ms once per fit call ({per_fit / seconds:.1%} of this call)"
        )
        mfu = h.get("mfu")
        print(
            f"  fit reported: {h['examples_per_second'][-1]:,.0f} examples/s, "
            f"{h['flops_per_step'][-1]:.4g} FLOPs/step, "
            f"{h['tflops_per_device'][-1]:.4g} TFLOP/s/device, "
            + (f"MFU {mfu[-1]:.1%}" if mfu else "no MFU (no known dense peak for this device)")
        )


if __name__ == "__main__":
    _harness.setup_devices(8)
    main()
