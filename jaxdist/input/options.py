"""`InputContext`, `InputOptions`, `InputReplicationMode`, `AutoShardPolicy`."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["AutoShardPolicy", "InputContext", "InputOptions", "InputReplicationMode"]


class InputReplicationMode(enum.Enum):
    """How `distribute_datasets_from_function` creates input pipelines.

    ``PER_WORKER``: one pipeline per process; its consecutive elements feed
    that process's replicas in turn. ``PER_REPLICA``: one pipeline per replica.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class AutoShardPolicy(enum.Enum):
    """How `experimental_distribute_dataset` splits input between processes.

    ``AUTO`` is ``DATA`` for the sources jaxdist accepts. ``DATA``: every process
    reads each global batch and keeps the rows of its own replicas. ``OFF``:
    every process's batch is its own share (the global batch is the processes'
    batches side by side). ``FILE`` needs a file-level split that only the
    source can make: use `distribute_datasets_from_function` and shard files
    with ``input_context.input_pipeline_id``.
    """

    AUTO = "AUTO"
    DATA = "DATA"
    FILE = "FILE"
    OFF = "OFF"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed datasets.

    Attributes:
        experimental_fetch_to_device: place batches on the replicas' devices,
            ahead of the step; False yields host NumPy arrays (single process
            only). None is the default, True, as in TF.
        experimental_replication_mode: see `InputReplicationMode`.
        experimental_per_replica_buffer_size: batches placed on the devices
            ahead of the one being consumed (default 1); 0 turns prefetching
            to the devices off, as in TF: each batch is placed when it is
            asked for. A general source (a generator, grain, tf.data) also
            runs in a background thread that queues up to ``max(4, buffer
            size)`` host batches; together these bound what a stalled
            iterator holds.
        experimental_auto_shard_policy: see `AutoShardPolicy`.
        partial_batches: what to do with a last batch smaller than the others:
            ``"pad"`` (default: pad and mask, never lose rows), ``"drop"``, or
            ``"error"``.
    """

    experimental_fetch_to_device: bool | None = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_per_replica_buffer_size: int = 1
    experimental_auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    partial_batches: str = "pad"

    def __post_init__(self) -> None:
        if self.experimental_fetch_to_device is None:  # TF's default
            object.__setattr__(self, "experimental_fetch_to_device", True)
        if not isinstance(self.experimental_fetch_to_device, bool):
            raise TypeError(
                "InputOptions(experimental_fetch_to_device="
                f"{self.experimental_fetch_to_device!r}): expected True, False or None (the "
                "default, True)."
            )
        if (
            not isinstance(self.experimental_per_replica_buffer_size, int)
            or isinstance(self.experimental_per_replica_buffer_size, bool)
            or self.experimental_per_replica_buffer_size < 0
        ):
            raise ValueError(
                "InputOptions(experimental_per_replica_buffer_size="
                f"{self.experimental_per_replica_buffer_size!r}): must be an int >= 0 (the "
                "batches prefetched onto the devices; 0 turns prefetching off)."
            )
        if self.partial_batches not in ("pad", "drop", "error"):
            raise ValueError(
                f"InputOptions(partial_batches={self.partial_batches!r}): use 'pad', 'drop' "
                "or 'error'."
            )
        if not isinstance(self.experimental_replication_mode, InputReplicationMode):
            raise TypeError(
                "InputOptions(experimental_replication_mode=...): expected an InputReplicationMode."
            )
        if not isinstance(self.experimental_auto_shard_policy, AutoShardPolicy):
            raise TypeError(
                "InputOptions(experimental_auto_shard_policy=...): expected an "
                "AutoShardPolicy (jaxdist.experimental.AutoShardPolicy)."
            )


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What ``dataset_fn`` is told about the input pipeline it builds.

    Example:
        >>> import jaxdist as jd
        >>> jd.InputContext(num_input_pipelines=2, input_pipeline_id=1,
        ...                 num_replicas_in_sync=8).get_per_replica_batch_size(512)
        64
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"InputContext: input_pipeline_id={self.input_pipeline_id} is outside "
                f"[0, num_input_pipelines={self.num_input_pipelines})."
            )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; raises ``ValueError`` if it
        does not divide evenly."""
        n = self.num_replicas_in_sync
        if global_batch_size % n:
            raise ValueError(
                f"InputContext.get_per_replica_batch_size: the global batch size "
                f"{global_batch_size} is not divisible by num_replicas_in_sync {n}; use a "
                f"multiple of {n} (for example {(global_batch_size // n + 1) * n})."
            )
        return global_batch_size // n
