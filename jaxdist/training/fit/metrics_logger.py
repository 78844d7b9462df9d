"""`MetricsLogger`: a `jaxdist.fit` callback writing the training's scalars for TensorBoard,
or as JSON lines.

Every ``every_n_steps`` steps it writes the step's metrics (``"step/loss"``, ...),
the steps and examples per second since the last logged step, and the learning
rate when the optimizer state holds one (``optax.inject_hyperparams``); at each
epoch's end the epoch's `History` entries under their own names (``"loss"``,
``"val_accuracy"``, ``"examples_per_second"``, ``"flops_per_step"``,
``"tflops_per_device"``, ``"mfu"``, ...). With ``tensorboardX`` installed (``pip
install jaxdist[logging]``) they are TensorBoard event files in ``logdir``;
without it, ``logdir/metrics.jsonl`` holds one JSON object per logged step, each
with its ``"step"`` (and ``"epoch"`` for an epoch's end). In a job of several
processes only process 0 writes (every process reads the logged steps' values,
in the same order).

Reading a step's metrics waits for that step (fit otherwise reads them one step
late), so a logged step costs one device sync; ``every_n_steps`` bounds that.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Literal

import jax

from jaxdist.training.fit.callbacks import Callback

__all__ = ["MetricsLogger"]

_WHERE = "jaxdist.training.MetricsLogger"
JSONL = "metrics.jsonl"


def _tensorboardx() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def learning_rate(state: tuple[Any, ...]) -> float | None:
    """The learning rate in the state's optimizer state (an ``optax.inject_hyperparams``
    optimizer's ``hyperparams["learning_rate"]``), or None."""
    for s in state:
        opt_state = getattr(s, "opt_state", None)
        if opt_state is None:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            if "learning_rate" in jax.tree_util.keystr(path):
                return float(jax.device_get(leaf))
    return None


class MetricsLogger(Callback):
    """Writes fit's scalars to ``logdir`` for TensorBoard (or as JSON lines).

    Args:
        logdir: the directory to write to (made if missing).
        every_n_steps: log the step's metrics every this many steps (``None``:
            only the epochs' ends).
        backend: ``"auto"``: TensorBoard event files when ``tensorboardX`` is
            installed, else ``metrics.jsonl``; ``"tensorboard"`` or
            ``"jsonl"`` to choose.

    Attributes:
        backend: the backend in use, ``"tensorboard"`` or ``"jsonl"``.

    Example:
        >>> import jaxdist as jd
        >>> logger = jd.training.MetricsLogger("logs", every_n_steps=50)
        >>> logger.every_n_steps
        50
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        every_n_steps: int | None = 100,
        backend: Literal["auto", "tensorboard", "jsonl"] = "auto",
    ) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):  # fmt: skip
            raise ValueError(
                f"{_WHERE}: every_n_steps must be an int >= 1 or None (only epoch ends), got "
                f"{every_n_steps!r}."
            )
        writer = _tensorboardx()
        if backend == "auto":
            backend = "tensorboard" if writer is not None else "jsonl"
        elif backend == "tensorboard" and writer is None:
            raise ImportError(
                f"{_WHERE}: backend='tensorboard' writes with tensorboardX, which is not "
                "installed: pip install 'jaxdist[logging]' (or backend='jsonl')."
            )
        elif backend not in ("tensorboard", "jsonl"):
            raise ValueError(
                f"{_WHERE}: backend must be 'auto', 'tensorboard' or 'jsonl', got {backend!r}."
            )
        self.logdir = os.fspath(logdir)
        self.every_n_steps = every_n_steps
        self.backend = backend
        self._writer: Any = None
        self._file: Any = None
        self._last: tuple[int, float] | None = None  # (step, time) of the last logged step

    def _active(self) -> bool:
        return jax.process_index() == 0

    def _write(self, step: int, values: Mapping[str, float], extra: Mapping[str, int]) -> None:
        if self.backend == "tensorboard":
            if self._writer is None:
                self._writer = _tensorboardx()(self.logdir)
            for tag, v in values.items():
                self._writer.add_scalar(tag, v, step)
            return
        if self._file is None:
            os.makedirs(self.logdir, exist_ok=True)
            self._file = open(os.path.join(self.logdir, JSONL), "a", encoding="utf-8")  # noqa: SIM115
        row: dict[str, Any] = {"step": step, **extra}
        row.update({k: (v if math.isfinite(v) else str(v)) for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")

    def on_train_begin(self, logs: dict[str, float]) -> None:
        self._last = (self.loop.step, time.perf_counter())

    def on_step_end(self, step: int, logs: Mapping[str, float]) -> None:
        if self.every_n_steps is None or step % self.every_n_steps:
            return
        # Every process reads the step's metrics (and the learning rate) at the same step:
        # reading a value of a multi-process array can be a collective program, which
        # the processes must run in the same order. Only process 0 writes.
        values = {f"step/{k}": float(v) for k, v in logs.items()}  # waits for the step
        lr = learning_rate(self.loop.state)
        if not self._active():
            return
        now = time.perf_counter()
        if self._last is not None and step > self._last[0]:
            steps_per_s = (step - self._last[0]) / max(now - self._last[1], 1e-9)
            values["step/steps_per_second"] = steps_per_s
            rows = getattr(logs, "rows", 0)
            if rows:
                values["step/examples_per_second"] = rows * steps_per_s
        if lr is not None:
            values["step/learning_rate"] = lr
        self._last = (step, now)
        self._write(step, values, {})

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if not self._active():
            return
        history = self.loop.record.history
        values = dict(logs)
        if history is not None:
            values.update({k: v[-1] for k, v in history.history.items() if v})
        self._write(self.loop.step, values, {"epoch": epoch})
        self._flush()
        self._last = (self.loop.step, time.perf_counter())  # evaluation is not a step

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None
