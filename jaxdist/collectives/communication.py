"""Communication options: how a strategy's collectives are structured and batched.

`CommunicationOptions` is tf.distribute's ``tf.distribute.experimental``
record of the same name: ``bytes_per_pack``, ``timeout_seconds`` and
``implementation``. In jaxdist each field maps onto something real, or says
plainly that it does not:

- ``implementation`` picks the *collective structure* jaxdist emits
  (`jaxdist.collectives.cross_device_ops.cross_device_ops_for`): ``AUTO`` and ``NCCL``
  one all-reduce per buffer
  (`NcclAllReduce`); ``RING`` a reduce-scatter followed by an all-gather
  (`HierarchicalCopyAllReduce`, which over a ``("host", "local")`` replica
  axis reduces inside each process before crossing processes). XLA, not
  jaxdist, picks the wire algorithm of each collective (ring, tree, NCCL,
  gloo, ICI): on GPUs both structures run on NCCL, on CPUs on gloo.
- ``bytes_per_pack > 0`` concatenates small same-dtype tensors into buffers of
  at least that many bytes, in leaf order (as TF's ``group_by_size`` packs),
  and reduces one buffer per collective. ``0`` leaves batching to XLA, whose
  combiner already merges the per-tensor all-reduces of one step.
- ``timeout_seconds`` bounds each step of a multi-process
  `MultiWorkerMirroredStrategy`: a watchdog thread in each process ends the
  job when a step does not complete within that time, naming the step and
  the processes that did not reach it (on every backend; on CPU, XLA's
  ``--xla_cpu_collective_timeout_seconds`` is also set, 10 s later, as a
  backstop). ``None`` means the default: the launcher's ``--collective-timeout``
  / ``JAXDIST_COLLECTIVE_TIMEOUT`` if set, else 1200 s; ``0`` means no timeout.
  Either way, while a step waits each process prints a line every 60 s
  naming it and the processes that have not arrived. Other strategies and
  per-call options carry the value without enforcing it.

`CollectiveHints` is TF's deprecated spelling; it warns and returns a
`CommunicationOptions`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
]


class CommunicationImplementation(enum.Enum):
    """Which collective structure a multi-worker strategy uses (TF's names).

    ``AUTO``: jaxdist's default, one all-reduce per buffer (as ``NCCL``).
    ``RING``: a reduce-scatter then an all-gather (the two phases of a ring
    all-reduce), hierarchical over a two-level replica axis. ``NCCL``: one
    all-reduce per buffer. XLA chooses the transport and wire algorithm in
    every case.

    Example:
        >>> import jaxdist as jd
        >>> jd.experimental.CommunicationImplementation.from_any("ring").name
        'RING'
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def from_any(cls, value: Any, *, where: str = "jaxdist") -> CommunicationImplementation:
        """Returns ``value`` (a member, or its name in any case) as a member."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        error = ValueError if isinstance(value, str) else TypeError
        raise error(
            f"{where}: unknown implementation {value!r}. Use one of jaxdist.experimental."
            "CommunicationImplementation.AUTO, RING, NCCL, or their names as strings "
            "(case-insensitive), e.g. implementation='ring'."
        )


def _check_bytes_per_pack(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: bytes_per_pack must be an int (bytes per packed buffer; 0 leaves "
            f"batching to XLA), got {type(value).__name__} ({value!r}). For 4 MiB packs write "
            "bytes_per_pack=4 * 1024 * 1024."
        )
    if value < 0:
        raise ValueError(
            f"{where}: bytes_per_pack must be >= 0 (bytes per packed buffer; 0 leaves batching "
            f"to XLA), got {value!r}. For 4 MiB packs write bytes_per_pack=4 * 1024 * 1024."
        )
    return int(value)


def _check_timeout(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: timeout_seconds must be None or a number of seconds, got "
            f"{type(value).__name__} ({value!r}). Write timeout_seconds=30 (0: no timeout)."
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: timeout_seconds must be None or a finite number of seconds >= 0 "
            f"(0 disables the timeout, as in TF), got {value!r}."
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-replica collectives, as ``tf.distribute.experimental``'s.

    Pass them to a multi-worker strategy (its default for every all-reduce),
    to a `CrossDeviceOps` (``NcclAllReduce(options=...)``), or per call
    (``CrossDeviceOps.all_reduce(..., options=...)``, ``extended.reduce_to``);
    per-call options override the defaults field by field (`merge`).

    Attributes:
        bytes_per_pack: ``0`` (default) reduces each tensor on its own and lets
            XLA's combiner batch them; ``> 0`` concatenates same-dtype tensors,
            in order, into buffers of at least this many bytes and reduces one
            buffer per collective.
        timeout_seconds: ``None`` (the default, 1200 s in a multi-process job) or
            seconds (``0``: no limit). Given to a
            multi-process `MultiWorkerMirroredStrategy`, how long a step may
            take before its watchdog ends the job, naming the processes that
            did not reach it (see the module docstring); elsewhere carried,
            not enforced. A dead process is caught by `jax.distributed`'s
            heartbeat in any case (``jaxdist.initialize(heartbeat_timeout_seconds=)``).
        implementation: a `CommunicationImplementation` (or its name): the
            collective structure, see `jaxdist.collectives.cross_device_ops.cross_device_ops_for`.

    Example:
        >>> import jaxdist as jd
        >>> opts = jd.experimental.CommunicationOptions(bytes_per_pack=1024, implementation="ring")
        >>> opts.implementation.name, opts.merge(
        ...     jd.experimental.CommunicationOptions(timeout_seconds=30)
        ... ).timeout_seconds
        ('RING', 30.0)
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        where = "CommunicationOptions"
        set_ = object.__setattr__
        set_(self, "bytes_per_pack", _check_bytes_per_pack(self.bytes_per_pack, where))
        set_(self, "timeout_seconds", _check_timeout(self.timeout_seconds, where))
        set_(
            self,
            "implementation",
            CommunicationImplementation.from_any(self.implementation, where=where),
        )

    def merge(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """These options overridden by the non-default fields of ``options`` (TF's rule).

        Args:
            options: per-call options, or ``None`` (no change).

        Returns:
            A new `CommunicationOptions`.
        """
        if options is None:
            return self
        if not isinstance(options, CommunicationOptions):
            raise TypeError(
                "CommunicationOptions.merge: options must be a jaxdist.experimental."
                f"CommunicationOptions or None, got {type(options).__name__}."
            )
        return CommunicationOptions(
            bytes_per_pack=options.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=(
                self.timeout_seconds if options.timeout_seconds is None else options.timeout_seconds
            ),
            implementation=(
                self.implementation
                if options.implementation is CommunicationImplementation.AUTO
                else options.implementation
            ),
        )


def CollectiveHints(
    bytes_per_pack: int = 0, timeout_seconds: float | None = None
) -> CommunicationOptions:
    """Deprecated (as in TF): returns ``CommunicationOptions(bytes_per_pack, timeout_seconds)``.

    Example:
        >>> import warnings, jaxdist as jd
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     jd.experimental.CollectiveHints(bytes_per_pack=64).bytes_per_pack
        64
    """
    warnings.warn(
        "jaxdist.experimental.CollectiveHints is deprecated, as in TF; use "
        "jaxdist.experimental.CommunicationOptions(bytes_per_pack=..., timeout_seconds=...) "
        "instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    return CommunicationOptions(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)


def resolve_options(
    options: Any, where: str, *, experimental_hints: Any = None
) -> CommunicationOptions | None:
    """Checks a per-call ``options`` argument (and TF's deprecated ``experimental_hints``).

    Returns ``None`` when neither is given (private helper).
    """
    if experimental_hints is not None:
        if options is not None:
            raise ValueError(
                f"{where}: got both options and experimental_hints; experimental_hints is the "
                "deprecated name of options (as in TF). Pass options only."
            )
        warnings.warn(
            f"{where}: experimental_hints is deprecated, as in TF; pass options="
            "jaxdist.experimental.CommunicationOptions(...) instead.",
            DeprecationWarning,
            stacklevel=3,
        )
        options, name = experimental_hints, "experimental_hints"
    else:
        name = "options"
    if options is None or isinstance(options, CommunicationOptions):
        return options
    raise TypeError(
        f"{where}: {name} must be a jaxdist.experimental.CommunicationOptions or None, got "
        f"{type(options).__name__} ({options!r:.60}). Write "
        "options=jd.experimental.CommunicationOptions(bytes_per_pack=...)."
    )


def group_by_size(sizes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """Groups consecutive items into packs of at least ``bytes_per_pack`` bytes (private).

    Items are taken in order; a new pack starts once the current one holds
    ``bytes_per_pack`` bytes or more, so packs are few and large (only the last
    may be smaller). ``bytes_per_pack == 0``: one pack per item.

    Args:
        sizes: the size of each item, in bytes.
        bytes_per_pack: the target pack size.

    Returns:
        Lists of item indices, one list per pack, in order.

    Example:
        >>> group_by_size([4, 4, 4, 4, 4], 8)
        [[0, 1], [2, 3], [4]]
    """
    if bytes_per_pack <= 0:
        return [[i] for i in range(len(sizes))]
    packs: list[list[int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if not packs or filled >= bytes_per_pack:
            packs.append([])
            filled = 0
        packs[-1].append(i)
        filled += size
    return packs
