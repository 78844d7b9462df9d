"""`TerminationConfig`: how a `PreemptionCheckpointHandler` learns of, and reacts to, a
coming termination (private module; the names are `jaxdist.experimental`'s)."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["RESTART_EXIT_CODE", "TerminationConfig", "check_config", "default_exit"]

_WHERE = "jaxdist.experimental.PreemptionCheckpointHandler"

RESTART_EXIT_CODE = 42
"""The exit code of the default ``exit_fn``: "preempted, checkpoint saved, restart me"."""


def default_exit() -> None:
    sys.exit(RESTART_EXIT_CODE)


@dataclasses.dataclass(frozen=True)
class TerminationConfig:
    """How a `PreemptionCheckpointHandler` learns of, and reacts to, a coming termination.

    Args:
        termination_watcher_fn: a function returning True once a termination
            notice is available (for example by polling the platform's metadata
            server). The handler calls it from a daemon thread every
            `WATCH_INTERVAL_S` seconds; it must return quickly. Without it the
            handler treats SIGTERM as the notice.
        exit_fn: called after the checkpoint is saved. The default,
            ``sys.exit(42)``, asks for a restart (``python -m jaxdist.launch
            --max-restarts K`` restarts such a job without counting it against
            ``K``). An ``exit_fn`` that returns lets training go on; the handler
            then watches for the next notice.
        grace_period: seconds between the notice and the termination. With a
            positive value the handler saves at once, lets training go on, saves
            again shortly before the deadline (leaving the first save's duration
            plus three steps' time), and then calls ``exit_fn``. ``None`` or 0:
            save once and exit.
        save_fn: called instead of the handler's own save (which saves the
            checkpoint through its `CheckpointManager`). It runs in every process
            at the agreed step; the checkpoint's ``total_run_calls`` item is up to
            date when it runs.

    Example:
        >>> import jaxdist as jd
        >>> config = jd.experimental.TerminationConfig(grace_period=30, exit_fn=lambda: None)
        >>> config.grace_period
        30
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], Any] | None = None
    grace_period: float | None = None
    save_fn: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("termination_watcher_fn", "exit_fn", "save_fn"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"jaxdist.experimental.TerminationConfig: {name} must be a function taking "
                    f"no arguments, or None; got {type(fn).__name__} {fn!r}."
                )
        grace = self.grace_period
        if grace is not None and (isinstance(grace, bool) or not isinstance(grace, (int, float))):
            raise TypeError(
                "jaxdist.experimental.TerminationConfig: grace_period must be a number of "
                f"seconds or None, got {type(grace).__name__} {grace!r}."
            )
        if grace is not None and not (math.isfinite(grace) and grace >= 0):
            raise ValueError(
                "jaxdist.experimental.TerminationConfig: grace_period must be finite and >= 0 "
                f"(seconds from the notice to the termination), got {grace!r}."
            )


def check_config(config: Any) -> TerminationConfig:
    if config is None:
        return TerminationConfig()
    if not isinstance(config, TerminationConfig):
        raise TypeError(
            f"{_WHERE}: termination_config must be a jaxdist.experimental.TerminationConfig or "
            f"None, got {type(config).__name__}."
        )
    return config
