"""What `jaxdist.fit` uses of a preemption handler.

`jaxdist.experimental.PreemptionCheckpointHandler` is in a higher layer than
the training loop, so `fit` sees it through this protocol: the
`jaxdist.training.Checkpoint` callback the handler was made with (fit's save),
and a hook fit calls after every completed step, in every process, with the
global step. The hook takes the process's part in a preemption round (the
processes agree on one step through the ``jax.distributed`` key-value store);
at the agreed step it saves through the callback, waits for the write, and
calls the handler's ``exit_fn``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxdist.training.fit.checkpoints import Checkpoint

__all__ = ["PreemptionHandlerLike", "fit_checkpoint_of"]

_WHERE = "jaxdist.fit"


@runtime_checkable
class PreemptionHandlerLike(Protocol):
    """A `jaxdist.experimental.PreemptionCheckpointHandler`, as `fit` uses it."""

    fit_checkpoint: Checkpoint | None

    def fit_step_end(self, step: int) -> None: ...


def fit_checkpoint_of(handler: Any) -> Checkpoint:
    """The `Checkpoint` callback ``handler`` saves through; raises for anything else."""
    if not isinstance(handler, PreemptionHandlerLike):
        raise TypeError(
            f"{_WHERE}: preemption_handler must be a "
            "jd.experimental.PreemptionCheckpointHandler (made with fit's "
            f"jd.training.Checkpoint callback) or None, got {type(handler).__name__}."
        )
    checkpoint = handler.fit_checkpoint
    if not isinstance(checkpoint, Checkpoint):
        raise ValueError(
            f"{_WHERE}: the preemption_handler was made with a jd.checkpoint.Checkpoint or "
            "CheckpointManager of its own, which fit does not save (fit's state, data "
            "position and step are saved by its jd.training.Checkpoint callback). Make the "
            "handler with that callback: ckpt = jd.training.Checkpoint(directory, ...); "
            "handler = jd.experimental.PreemptionCheckpointHandler("
            "strategy.cluster_resolver, ckpt); jd.fit(..., callbacks=[ckpt], "
            "preemption_handler=handler, resume=True)."
        )
    return checkpoint
