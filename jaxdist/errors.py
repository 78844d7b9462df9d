"""jaxdist's typed errors: each one subclasses the builtin it is raised as, so code that
catches ``ValueError`` or ``RuntimeError`` keeps working, and code that wants one cause
catches its own class.

Example:
    >>> import jaxdist as jd
    >>> issubclass(jd.errors.ReplicaDivergenceError, ValueError)
    True
"""

from __future__ import annotations

__all__ = [
    "CheckpointVerificationError",
    "DonatedArgumentError",
    "OutOfRangeError",
    "ReplicaDivergenceError",
    "StrategyMixingError",
]


class DonatedArgumentError(RuntimeError):
    """An argument holds buffers that an earlier call donated (a deleted array).

    Raised by `jaxdist.train_step`'s steps and by `Strategy.run` / `Strategy.function`
    with donation, before the program runs: pass the values the earlier call returned.
    """


class CheckpointVerificationError(ValueError):
    """A checkpoint does not match its checksum manifest, or the manifest is missing or
    damaged: nothing was restored (`jaxdist.checkpoint.restore` with ``verify=True``)."""


class StrategyMixingError(RuntimeError):
    """A second, different strategy was asked for while one is in effect (entering its
    ``scope()``, or `jaxdist.experimental_set_strategy`)."""


class ReplicaDivergenceError(ValueError):
    """Values that must be the same on every replica came back different: parameters or
    optimizer state after a train step updated them from per-replica values, or the
    update of a mirrored variable with aggregation ``NONE``."""


class OutOfRangeError(StopIteration):
    """The data ran out: ``get_next()`` of a distributed iterator at its end (TF's
    ``tf.errors.OutOfRangeError``). A ``StopIteration``, so ``except StopIteration``
    catches it too; ``next(iterator)`` and ``for`` loops end as usual."""
