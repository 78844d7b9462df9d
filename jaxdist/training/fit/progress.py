"""How `jaxdist.fit` measures and shows its progress: step metrics, epoch means, the bar.

A step's metrics are read to the host one step late (`StepLogs`), so the
device runs ahead of the loop; `MetricReader` turns each into a float (a
replicated value as it is, a `PerReplica` one averaged over the replicas'
real rows) and finds the batch's real rows, and `EpochMean` weights the
batches by them.

The bar (tqdm, ``pip install tqdm``) shows the epoch, step/total, the
epoch's running metrics and its speed (examples, steps and tokens per second,
TFLOP/s per device and MFU, as far as known); it is redrawn at most ten
times a second, so it costs nothing per step. Without a bar, `Progress`
prints one line per epoch when ``verbose``, or nothing.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import jax
import numpy as np

from jaxdist.training.fit.state_io import host_array
from jaxdist.training.fit.throughput import Throughput
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica

__all__ = [
    "EpochMean",
    "MetricReader",
    "Progress",
    "StepLogs",
    "as_metrics",
    "format_logs",
    "format_speed",
    "want_bar",
]

_WHERE = "jaxdist.fit"

_REDRAW_S = 0.1
_FALLBACK_SIZE = (100, 24)  # (columns, lines) when the terminal does not tell its own


def want_bar(progress: bool | str, stream: TextIO, where: str) -> bool:
    """Whether to draw a bar: ``True``/``False`` as given, ``"auto"`` when ``stream`` is a
    terminal (and tqdm is installed)."""
    if progress == "auto":
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty()) and _tqdm() is not None
    if not isinstance(progress, bool):
        raise ValueError(
            f"{where}: progress must be True (always draw a bar), False (never) or 'auto' (a "
            f"bar when stdout is a terminal), got {progress!r}."
        )
    if progress and _tqdm() is None:
        raise ImportError(
            f"{where}: progress=True draws its bar with tqdm, which is not installed: "
            "pip install tqdm (or pass progress='auto' or False)."
        )
    return progress


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is installed wherever the tests run
        return None
    return tqdm


def _sized_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that reports its size. A pseudo terminal may report
    0 x 0 (CI runners, ``script``): tqdm then hides its bar, so `Progress` gives it a
    fixed size instead."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


def _number(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4f}"


def format_logs(logs: Mapping[str, float]) -> str:
    """``"loss 0.1234  accuracy 0.9876"``: metrics in a compact, stable format."""
    return "  ".join(f"{k} {_number(v)}" for k, v in logs.items())


def format_speed(examples_per_s: float, speed: Throughput | None) -> str:
    """``"5,120 examples/s  10.0 steps/s  0.012 TFLOP/s/device  MFU 41.2%"``: the figures
    that are known (tokens/s with ``tokens_per_example``, TFLOP/s with a FLOP count, MFU
    with a peak too)."""
    parts = [f"{examples_per_s:,.0f} examples/s"]
    if speed is not None:
        parts.append(f"{speed.steps_per_second:,.2f} steps/s")
        if speed.tokens_per_second is not None:
            parts.append(f"{speed.tokens_per_second:,.0f} tokens/s")
        if speed.tflops_per_device is not None:
            parts.append(f"{speed.tflops_per_device:.4g} TFLOP/s/device")
        if speed.mfu is not None:
            parts.append(f"MFU {100 * speed.mfu:.3g}%")
    return "  ".join(parts)


class Progress:
    """Shows a `fit` run: a bar per epoch, or one line per epoch, or nothing."""

    def __init__(
        self, *, bar: bool, verbose: bool, epochs: int | None, stream: TextIO | None = None
    ) -> None:
        self.bar = bar
        self.verbose = verbose
        self.epochs = epochs
        self.stream = stream if stream is not None else sys.stdout
        self._bar: Any = None
        self._last_draw = 0.0
        self._shown = 0

    def _title(self, epoch: int) -> str:
        return f"epoch {epoch + 1}" + (f"/{self.epochs}" if self.epochs is not None else "")

    def epoch_begin(self, epoch: int, total_steps: int | None) -> None:
        """Starts the epoch's bar (``total_steps`` None when not known in advance)."""
        if not self.bar:
            return
        tqdm = _tqdm()
        sized = _sized_terminal(self.stream)
        self._bar = tqdm(
            total=total_steps,
            desc=self._title(epoch),
            unit="step",
            file=self.stream,
            dynamic_ncols=sized,  # follow the terminal's width
            ncols=None if sized else _FALLBACK_SIZE[0],
            nrows=None if sized else _FALLBACK_SIZE[1],
            leave=True,
            mininterval=_REDRAW_S,
        )
        self._shown = 0
        self._last_draw = time.perf_counter()

    def step(
        self,
        steps_done: int,
        running: Mapping[str, float],
        examples_per_s: float,
        speed: Throughput | None = None,
    ) -> None:
        """Advances the bar to ``steps_done`` steps of this epoch (redrawn at most every 0.1 s)."""
        if self._bar is None:
            return
        now = time.perf_counter()
        if now - self._last_draw < _REDRAW_S:
            return
        self._last_draw = now
        self._bar.set_postfix_str(self._postfix(running, examples_per_s, speed), refresh=False)
        self._bar.update(steps_done - self._shown)
        self._shown = steps_done

    def _postfix(
        self, logs: Mapping[str, float], examples_per_s: float, speed: Throughput | None
    ) -> str:
        return f"{format_logs(logs)}  {format_speed(examples_per_s, speed)}"

    def epoch_end(
        self,
        epoch: int,
        steps_done: int,
        logs: Mapping[str, float],
        examples_per_s: float,
        seconds: float,
        speed: Throughput | None = None,
    ) -> None:
        """Completes the epoch's bar with its final metrics, or prints the epoch's line."""
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(logs, examples_per_s, speed), refresh=False)
            self._bar.update(steps_done - self._shown)
            self._bar.close()
            self._bar = None
        elif self.verbose:
            print(
                f"{self._title(epoch)}  {steps_done} steps  {seconds:.1f}s  "
                f"{format_speed(examples_per_s, speed)}  {format_logs(logs)}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        """Closes an unfinished bar (training stopped in the middle of an epoch)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# Step and epoch metrics ---------------------------------------------------------------


def as_metrics(out: Any, what: str) -> dict[str, Any]:
    """A step's metrics output as a dict of name to value."""
    if out is None:
        return {}
    if isinstance(out, Mapping):
        bad = [k for k, v in out.items() if not isinstance(k, str) or isinstance(v, Mapping)]
        if bad:
            raise TypeError(
                f"{_WHERE}: the {what} returned metrics {sorted(map(str, out))} with a "
                f"non-string name or a nested dict at {bad[0]!r}; return a flat dict of "
                "name -> scalar, e.g. {'loss': loss, 'accuracy': acc}."
            )
        return dict(out)
    if isinstance(out, (jax.Array, np.ndarray, np.generic, int, float, DistributedValues)):
        return {"loss": out}
    raise TypeError(
        f"{_WHERE}: the {what} returned a {type(out).__name__}; metrics must be a dict of "
        "name -> value (a single value is taken as 'loss'). A step with functional state "
        "returns (new_state, metrics); one over NNX objects returns only the metrics."
    )


class MetricReader:
    """Turns a step's metrics into host floats, batch by batch (caching valid counts)."""

    def __init__(self) -> None:
        self._valid: Any = None
        self._counts: np.ndarray | None = None

    def counts(self, valid: Any) -> np.ndarray:
        if valid is not self._valid:  # full batches share one counts array
            self._valid, self._counts = valid, host_array(valid).astype(np.int64)
        assert self._counts is not None
        return self._counts

    def rows(self, batch: Any) -> tuple[int, np.ndarray | None]:
        """The batch's real rows, and its per-replica counts when it carries them."""
        leaves = jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, PerReplica))
        for x in leaves:
            if isinstance(x, PerReplica) and x.valid is not None:
                counts = self.counts(x.valid)
                return int(counts.sum()), counts
        for x in leaves:  # no padding: every row is real
            if isinstance(x, PerReplica):
                shape = np.shape(x.array)  # (replicas, rows per replica, ...)
                return (shape[0] * shape[1] if len(shape) > 1 else shape[0]), None
            if np.ndim(x):
                return np.shape(x)[0], None
        return 1, None

    def value(self, name: str, v: Any, counts: np.ndarray | None, what: str) -> float:
        if isinstance(v, PerReplica):
            a = host_array(v.array).astype(np.float64)
            if a.ndim >= 2 and v.valid is not None:  # per-example values: real rows only
                real = np.arange(a.shape[1])[None, :] < self.counts(v.valid)[:, None]
                picked = a[real]
                return float(picked.mean()) if picked.size else float("nan")
            if a.ndim == 1 and counts is not None and len(counts) == len(a):
                keep = counts > 0  # replicas without real rows have no value
                return float(np.sum(a[keep] * counts[keep]) / np.sum(counts[keep]))
            return float(a.mean())
        a = np.asarray(host_array(v.array if isinstance(v, Mirrored) else v))
        if a.size != 1:
            raise ValueError(
                f"{_WHERE}: metric {name!r} of the {what} is an array of shape {a.shape}, the "
                "same on every replica; a metric must be a scalar (e.g. ctx.all_reduce('sum', "
                "jd.compute_average_loss(per_example))), or a per-replica value (PerReplica, "
                "e.g. per-example values) that fit averages over the real rows."
            )
        return float(a.reshape(()))


class StepLogs(Mapping[str, float]):
    """One step's metrics, read to the host on first access (so reading can lag the step)."""

    def __init__(self, raw: dict[str, Any], batch: Any, reader: MetricReader, what: str) -> None:
        self._raw = raw
        self._batch = batch
        self._reader = reader
        self._what = what
        self._values: dict[str, float] | None = None
        self.rows = 0

    def read(self) -> dict[str, float]:
        if self._values is None:
            self.rows, counts = self._reader.rows(self._batch)
            self._values = {
                k: self._reader.value(k, v, counts, self._what) for k, v in self._raw.items()
            }
            self._raw = {}
            self._batch = None
        return self._values

    def __getitem__(self, key: str) -> float:
        return self.read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values if self._values is not None else self._raw)

    def __len__(self) -> int:
        return len(self._values if self._values is not None else self._raw)


class EpochMean:
    """Row-weighted running means of an epoch's metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.rows = 0

    def add(self, logs: StepLogs) -> None:
        values = logs.read()
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * logs.rows
        self.rows += logs.rows

    def result(self, prefix: str = "") -> dict[str, float]:
        rows = max(self.rows, 1)
        return {prefix + k: s / rows for k, s in self.sums.items()}
