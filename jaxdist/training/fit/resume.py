"""What a `jaxdist.fit` checkpoint holds besides the state, and host snapshots of it.

A checkpoint written by `jaxdist.training.Checkpoint` is a
`jaxdist.checkpoint.Checkpoint` of these items:

- ``state_0``, ``state_1``, ...: the state arguments of `fit`, in order (NNX
  objects as NNX items, restored in place; functional states as pytrees);
- ``data``: the training iterator's position (`DistributedIterator.get_state`)
  after the batches of the completed steps, or None when it is not known;
- ``loop``: the loop's position (`LoopRecord.state`): the global step, the
  epoch, how far the epoch got, the epoch's running metric sums and the
  `History` so far.

`LoopRecord` is kept up to date by `fit` as it runs (a few attribute writes
per step); `snapshot` copies an item to the host so that the next training
step (which donates its input buffers) cannot change what is being written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist.checkpoint import to_saveable
from jaxdist.training.step.nnx import is_nnx_node, nnx_module

__all__ = [
    "DATA",
    "LOOP",
    "Frozen",
    "LoopRecord",
    "Sink",
    "item_name",
    "parse_loop_state",
    "snapshot",
]

DATA = "data"
LOOP = "loop"
FORMAT = "jaxdist.fit"
VERSION = 1


def item_name(index: int) -> str:
    """The checkpoint item of state argument ``index``."""
    return f"state_{index}"


class Frozen:
    """A position captured at save time: `get_state` returns it (an iterator-kind item)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def get_state(self) -> Any:
        return self._state

    def set_state(self, state: Any) -> None:
        raise TypeError("a saved snapshot of a position cannot be restored into")


class Sink:
    """Receives a position on restore (an iterator-kind item); `state` holds it."""

    def __init__(self) -> None:
        self.state: Any = None

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state


def snapshot(item: Any) -> Any:
    """A host copy of a state argument, of the same kind: an NNX object becomes an NNX object
    of the same graph holding NumPy arrays; a pytree becomes its `to_saveable` tree."""
    if is_nnx_node(item):
        nnx = nnx_module()
        assert nnx is not None
        graphdef, state = nnx.split(item)
        return nnx.merge(graphdef, to_saveable(state))
    return to_saveable(item)


class LoopRecord:
    """The position of a running `fit` loop beyond its step and epoch (private).

    Attributes:
        data: the training iterator's state after the completed steps' batches.
        epoch_steps: steps done in the current epoch.
        epoch_ended: the current epoch's end (evaluation, history, ``on_epoch_end``)
            has run.
        mean: the epoch's `EpochMean`; ``pending`` the last step's logs, not yet in it.
        history: the run's `History`.
    """

    def __init__(self) -> None:
        self.data: Any = None
        self.epoch_steps = 0
        self.epoch_ended = False
        self.mean: Any = None
        self.pending: Any = None
        self.history: Any = None

    def state(self, step: int, epoch: int, data_done: bool) -> dict[str, Any]:
        """The JSON-able record of the loop at ``step`` (reads the pending metrics)."""
        sums: dict[str, float] = {}
        rows = 0
        if self.mean is not None:
            sums, rows = dict(self.mean.sums), int(self.mean.rows)
        if self.pending is not None:
            for k, v in self.pending.read().items():
                sums[k] = sums.get(k, 0.0) + v * self.pending.rows
            rows += self.pending.rows
        history: dict[str, Any] = {"history": {}, "epochs": [], "examples_per_second": []}
        if self.history is not None:
            history = {
                "history": {k: list(v) for k, v in self.history.history.items()},
                "epochs": list(self.history.epochs),
                "examples_per_second": list(self.history.examples_per_second),
            }
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": int(step),
            "epoch": int(epoch),
            "epoch_steps": int(self.epoch_steps),
            "data_done": bool(data_done),
            "epoch_ended": bool(self.epoch_ended),
            "metric_sums": {k: _json_float(v) for k, v in sums.items()},
            "metric_rows": rows,
            "history": {
                "history": {k: [_json_float(x) for x in v] for k, v in history["history"].items()},
                "epochs": [int(e) for e in history["epochs"]],
                "examples_per_second": [_json_float(x) for x in history["examples_per_second"]],
            },
        }


def _json_float(x: float) -> Any:
    """A float for JSON: finite ones as they are (exact), others as strings."""
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _float(x: Any) -> float:
    return float(x)  # float("nan"), float("inf") read the strings back


def parse_loop_state(where: str, path: str, state: Any) -> dict[str, Any]:
    """Checks a `LoopRecord.state` read back from a checkpoint; returns it with floats."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise ValueError(
            f"{where}: the checkpoint in {path} has no record of a jaxdist.fit loop (item "
            f"{LOOP!r} is {str(state)[:80]}); it was not written by jaxdist.training.Checkpoint."
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"{where}: the checkpoint in {path} records its fit loop in version "
            f"{state.get('version')!r}; this jaxdist reads version {VERSION}."
        )
    try:
        history = state["history"]
        return {
            "step": int(state["step"]),
            "epoch": int(state["epoch"]),
            "epoch_steps": int(state["epoch_steps"]),
            "data_done": bool(state["data_done"]),
            "epoch_ended": bool(state["epoch_ended"]),
            "metric_sums": {str(k): _float(v) for k, v in state["metric_sums"].items()},
            "metric_rows": int(state["metric_rows"]),
            "history": {str(k): [_float(x) for x in v] for k, v in history["history"].items()},
            "epochs": [int(e) for e in history["epochs"]],
            "examples_per_second": [_float(x) for x in history["examples_per_second"]],
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"{where}: the fit loop's record in the checkpoint in {path} is incomplete "
            f"({type(e).__name__}: {e})."
        ) from None
