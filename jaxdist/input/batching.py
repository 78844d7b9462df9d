"""Turning host batches into per-replica device batches.

`Batcher` checks each batch (array leaves, one batch size), splits a global
batch into per-replica rows (replica ``r`` of a full batch gets rows
``[r*b, (r+1)*b)``; a partial batch of ``B'`` rows is split as tf.distribute
does, ``ceil(B'/N)`` rows per replica in order), pads every replica to the
established per-replica size ``b`` so the step never recompiles, records the
valid-row counts, and places each leaf straight into the sharded layout.

`Layout` says which replicas this process feeds: in a job of several
processes each one provides only its own replicas' rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._dtypes import numeric
from jaxdist._jax_compat import place_host_arrays
from jaxdist._protocols import StrategyLike
from jaxdist.input.options import AutoShardPolicy, InputOptions
from jaxdist.values.distributed import DistributedValues, PerReplica
from jaxdist.values.distributed import unflatten_per_replica as _per_replica

HostBatch = tuple[list[np.ndarray], np.ndarray]

_flatten = jax.tree_util.tree_flatten


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which replicas this process feeds (private).

    Attributes:
        n: the number of replicas in sync.
        local: the replicas whose rows this process provides, ascending.
        num_processes: how many processes the strategy's devices span (the
            number of input pipelines of `InputReplicationMode.PER_WORKER`).
        process_rank: this process's position among them (its pipeline id).
    """

    n: int
    local: tuple[int, ...]
    num_processes: int
    process_rank: int

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def replica_layout(
    strategy: StrategyLike,
    *,
    process_index: int | None = None,
    process_of: Callable[[jax.Device], int] | None = None,
) -> Layout:
    """The `Layout` of ``strategy`` as seen from one process.

    Args:
        strategy: the strategy whose replicas are fed.
        process_index: the process to look from (default: this one).
        process_of: a device's process (default: ``device.process_index``);
            tests pass their own to simulate a job of several processes.

    Returns:
        The replicas whose devices belong to that process, and the process's
        rank among the processes that own any of the strategy's devices.
    """
    n = strategy.num_replicas_in_sync
    me = jax.process_index() if process_index is None else process_index
    owner = process_of if process_of is not None else (lambda d: d.process_index)
    sharding = strategy.per_replica_sharding
    local: set[int] = set()
    processes: set[int] = set()
    for device, index in sharding.devices_indices_map((n,)).items():
        p = owner(device)
        processes.add(p)
        if p == me:
            local.update(range(*index[0].indices(n)))
    if not local:
        raise ValueError(
            f"{type(strategy).__name__}: process {me} owns none of the strategy's devices (they "
            f"belong to processes {sorted(processes)}), so it has no replicas to feed. Create "
            "the strategy over devices that include this process's (jax.local_devices())."
        )
    ranks = sorted(processes)
    return Layout(n, tuple(sorted(local)), len(ranks), ranks.index(me))


class Rows:
    """One leaf of a full step of per-replica batches, left unstacked (private): replica
    ``r``'s batch is ``rows[r]``. `Batcher._to_devices` places each replica's rows on its
    own device (`jax.make_array_from_callback`), which saves stacking them on the host:
    about 0.5 ms per step of 8 x 64 x 784 float32 rows on CPU, where the stacked array
    is a fresh allocation every step."""

    __slots__ = ("dtype", "rows", "shape")

    def __init__(self, rows: Sequence[np.ndarray]) -> None:
        self.rows = rows
        self.shape = (len(rows), *rows[0].shape)
        self.dtype = rows[0].dtype

    def rows_at(self, index: tuple[slice, ...]) -> np.ndarray:
        """The rows of the replicas ``index[0]`` selects (one per device here)."""
        picked = self.rows[index[0]]
        return picked[0][None] if len(picked) == 1 else np.stack(picked)


class Shared:
    """What the iterators (epochs) of one distributed dataset share (private): the
    warnings already given (each is given once per dataset), the shardings, and the
    device copies of full batches' valid counts (placed once, not once per epoch)."""

    def __init__(self, strategy: StrategyLike) -> None:
        self.warned: set[str] = set()
        self.sharding = strategy.per_replica_sharding
        self.replicated = strategy.replicated_sharding
        self.full_valid: dict[tuple[int, int], Any] = {}  # (replicas, rows) -> device counts


class Batcher:
    """Splits, pads and places batches for one iterator of a distributed dataset (private).

    ``shared`` is shared by every iterator of one dataset (`Shared`); warnings
    found while batching (possibly in the prefetch thread) wait in ``pending``
    until the consumer emits them.
    """

    def __init__(
        self,
        strategy: StrategyLike,
        options: InputOptions,
        where: str,
        layout: Layout,
        shared: Shared | None = None,
    ) -> None:
        shared = shared if shared is not None else Shared(strategy)
        self.options = options
        self.where = where
        self.n = layout.n
        self.multi_process = layout.multi_process
        self.sharding = shared.sharding
        self.replicated = shared.replicated
        self.warned = shared.warned
        self._shared_valid = shared.full_valid
        # Set by an iterator that places this batcher's steps in the thread that makes
        # them, in one process (no prefetch thread copies them, no agreement reads ahead):
        # full per-replica steps are then placed without stacking (`Rows`).
        self.rows_in_place = False
        self.pending: list[str] = []
        self.treedef: Any = None
        self.row_shapes: list[tuple[tuple[int, ...], Any]] | None = None
        self.b: int | None = None  # per-replica rows, fixed by the first batch
        self._batches = 0  # global batches seen
        self._first_rows = 0
        self._full_valid: Any = None
        self._full_counts: np.ndarray | None = None
        # The leaves' (type, shape, dtype) of the last checked batch of NumPy arrays: a
        # batch exactly like it skips the checks (`leaves`).
        self._sig: list[tuple[type, tuple[int, ...], Any]] | None = None
        self._empty: HostBatch | None = None
        # With AutoShardPolicy.OFF across processes each process's batch is its own share:
        # it is split over this process's replicas, and only their counts are known here.
        off = options.experimental_auto_shard_policy is AutoShardPolicy.OFF
        self._own_share = off and self.multi_process
        self._share = len(layout.local) if self._own_share else self.n
        self._wanted = list(range(self._share)) if self._own_share else list(layout.local)
        # The wanted replicas' rows of a full batch split (share, b, ...): all of them, a
        # contiguous block (a view), or a selection (a copy).
        lo, count = self._wanted[0], len(self._wanted)
        self._pick: slice | list[int] | None = None
        if count < self._share:
            contiguous = self._wanted == list(range(lo, lo + count))
            self._pick = slice(lo, lo + count) if contiguous else self._wanted

    @property
    def first_rows(self) -> int | None:
        """The rows of the epoch's first global batch (None before it, or for per-replica
        batches)."""
        return self._first_rows or None

    def resume(self, rows_per_replica: int, first_rows: int | None, batches: int) -> None:
        """Takes the per-replica size an earlier run's first batch fixed, for an epoch that
        resumes after ``batches`` batches (so its last batch is padded as before)."""
        self.b = rows_per_replica
        self._first_rows = first_rows or 0
        self._batches = batches

    # Checks -----------------------------------------------------------------------

    def leaves(self, batch: Any, *, per_replica: bool) -> list[np.ndarray]:
        """The batch's leaves as NumPy arrays, after checking them against the first."""
        if self._sig is not None:  # fast path: NumPy leaves exactly like the last checked
            leaves, treedef = _flatten(batch)
            if treedef == self.treedef and [(type(a), a.shape, a.dtype) for a in leaves] == (
                self._sig
            ):
                return leaves
        return self._checked_leaves(batch, per_replica=per_replica)

    def _checked_leaves(self, batch: Any, *, per_replica: bool) -> list[np.ndarray]:
        with_path, treedef = jax.tree_util.tree_flatten_with_path(
            batch, is_leaf=lambda x: isinstance(x, DistributedValues)
        )
        kind = "per-replica batch" if per_replica else "global batch"
        leaves = []
        # Every leaf is checked and every problem reported in one error.
        type_problems: list[str] = []
        value_problems: list[str] = []
        for path, x in with_path:
            name = jax.tree_util.keystr(path) or "<batch>"
            if isinstance(x, DistributedValues):
                type_problems.append(
                    f"the dataset yielded a {type(x).__name__} at {name}; it must yield "
                    f"{kind}es of plain arrays. For per-replica input use "
                    "strategy.distribute_datasets_from_function"
                )
                continue
            if not isinstance(x, (np.ndarray, jax.Array, np.generic, int, float, bool)):
                type_problems.append(
                    f"leaf {name} of a {kind} is a {type(x).__name__}, not an array. Batches "
                    "must be pytrees of arrays; convert or drop other fields in the dataset"
                )
                continue
            arr = np.asarray(x)
            if self.options.experimental_fetch_to_device and not numeric(arr.dtype):
                type_problems.append(
                    f"leaf {name} of a {kind} is an array of dtype {arr.dtype} (shape "
                    f"{arr.shape}), which cannot be placed on the devices: only numeric and "
                    "bool arrays can. Encode it as numbers in the dataset (for example token "
                    "or class ids), drop it from the batches, or pass "
                    "InputOptions(experimental_fetch_to_device=False) to get host NumPy batches"
                )
            elif arr.ndim == 0:
                value_problems.append(
                    f"leaf {name} of a {kind} is a scalar; every leaf needs a leading batch axis"
                )
            else:
                leaves.append((name, arr))
        if type_problems:
            raise TypeError(f"{self.where}: " + "; ".join(type_problems) + ".")
        if value_problems:
            raise ValueError(f"{self.where}: " + "; ".join(value_problems) + ".")
        if not leaves:
            raise ValueError(f"{self.where}: the dataset yielded an empty batch {batch!r}.")
        sizes = {name: a.shape[0] for name, a in leaves}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"{self.where}: the leaves of a {kind} disagree on the batch size: {sizes}. "
                "Every leaf must have the same number of rows."
            )
        rows = [(a.shape[1:], a.dtype) for _, a in leaves]
        if self.treedef is None:
            self.treedef, self.row_shapes = treedef, rows
        elif treedef != self.treedef:
            raise ValueError(
                f"{self.where}: a {kind} has structure {treedef}, but the first had "
                f"{self.treedef}; every batch must have the same structure."
            )
        elif rows != self.row_shapes:
            bad = [
                f"leaf {name} has rows of shape {a.shape[1:]} and dtype {a.dtype}, but the "
                f"first {kind} had {shape} and {dtype}"
                for (name, a), (shape, dtype) in zip(leaves, self.row_shapes or [], strict=True)
                if (a.shape[1:], a.dtype) != (shape, dtype)
            ]
            raise ValueError(f"{self.where}: " + "; ".join(bad) + ".")
        out = [a for _, a in leaves]
        # Batches exactly like this one (NumPy leaves, same shapes) skip these checks.
        plain = all(a is x for a, (_, x) in zip(out, with_path, strict=True))
        self._sig = [(type(a), a.shape, a.dtype) for a in out] if plain else None
        return out

    def _partial(self, got: int, full: int) -> bool:
        """Applies the partial-batch policy; returns False when the batch is dropped."""
        policy = self.options.partial_batches
        if policy == "drop":
            return False
        if policy == "error":
            raise ValueError(
                f"{self.where}: a batch of {got} rows is smaller than the full {full} rows and "
                "InputOptions(partial_batches='error') forbids padding it. Use 'pad' (the "
                "default: padded and masked) or 'drop'."
            )
        return True

    def _note_uneven(self) -> None:
        """Once per dataset: the first global batch was not the last and does not split
        evenly, so every step carries padding."""
        rows, share = self._first_rows, self._share
        if not rows % share or "uneven" in self.warned:
            return
        self.warned.add("uneven")
        assert self.b is not None
        lower, upper = rows // share * share, (rows // share + 1) * share
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        what, size = (
            ("this process's batch size", "batch size")
            if self._own_share
            else ("the global batch size", "global batch size")
        )
        self.pending.append(
            f"{self.where}: {what} {rows} is not divisible by the {share} replicas, so every "
            f"step pads each replica to {self.b} rows ({share * self.b - rows} padding rows "
            f"per step, masked out of reductions but still computed). Use a {size} that is a "
            f"multiple of {share}, for example {fix}."
        )

    # Global batches ----------------------------------------------------------------

    def from_global(self, batch: Any) -> HostBatch | None:
        """Host (local replicas, b, ...) arrays and valid counts for one global batch;
        ``None`` when the partial-batch policy drops it."""
        leaves = self.leaves(batch, per_replica=False)
        rows = leaves[0].shape[0]
        share = self._share
        if self.b is None:
            self.b, self._first_rows = math.ceil(rows / share), rows
        elif self._batches == 1:
            self._note_uneven()
        self._batches += 1
        b = self.b
        if rows > share * b:
            raise ValueError(
                f"{self.where}: a global batch of {rows} rows is larger than the first "
                f"({share * b} rows, {b} per replica for {share} replicas); batches may only "
                "shrink at the end of the dataset."
            )
        if rows == share * b:  # a full batch: views where the rows are contiguous
            pick = self._pick
            out = [a.reshape(share, b, *a.shape[1:]) for a in leaves]
            if pick is not None:
                out = [split[pick] for split in out]
            return out, self._counts_of_full(share)
        if not self._partial(rows, share * b):
            return None
        # tf.distribute's split of a partial batch: ceil(rows / share) rows per replica.
        per = math.ceil(rows / share)
        counts = np.clip(rows - per * np.arange(share), 0, per).astype(np.int32)
        wanted = self._wanted
        out = []
        for a in leaves:
            padded = np.zeros((len(wanted), b, *a.shape[1:]), a.dtype)
            for i, r in enumerate(wanted):
                padded[i, : counts[r]] = a[r * per : r * per + counts[r]]
            out.append(padded)
        # Every replica's counts (each process read the whole global batch), or with the
        # OFF policy across processes, this process's replicas' counts only.
        return out, counts

    # Per-replica batches -----------------------------------------------------------

    def from_per_replica(self, elements: Sequence[Any | None]) -> HostBatch | None:
        """Stacks one per-replica batch per local replica (None: that replica got none);
        ``None`` when the partial-batch policy drops the step."""
        leaf_lists = [None if e is None else self.leaves(e, per_replica=True) for e in elements]
        present = [ls for ls in leaf_lists if ls is not None]
        if self.b is None:
            self.b = present[0][0].shape[0]
        b = self.b
        sizes = [0 if ls is None else ls[0].shape[0] for ls in leaf_lists]
        if max(sizes) > b:
            raise ValueError(
                f"{self.where}: a per-replica batch of {max(sizes)} rows is larger than "
                f"the first ({b} rows). dataset_fn must yield per-replica batches of "
                "input_context.get_per_replica_batch_size(global_batch_size) rows; did it "
                "yield global batches?"
            )
        assert self.row_shapes is not None
        if min(sizes) == b:  # a full step
            if self.rows_in_place and self.options.experimental_fetch_to_device:
                # Each replica's rows go straight to its device (`_to_devices`): no host
                # copy into a stacked array first.
                rows = [Rows(leaf) for leaf in zip(*present, strict=True)]
                return rows, self._counts_of_full(len(elements))  # type: ignore[return-value]
            whole = [np.stack(leaf) for leaf in zip(*present, strict=True)]
            return whole, self._counts_of_full(len(elements))
        full = len(elements) * b
        if not self._partial(sum(sizes), full):
            return None
        counts = np.array(sizes, np.int32)
        out = []
        for j, (shape, dtype) in enumerate(self.row_shapes):
            stacked = np.zeros((len(elements), b, *shape), dtype)
            for i, ls in enumerate(leaf_lists):
                if ls is not None:
                    stacked[i, : counts[i]] = ls[j]
            out.append(stacked)
        # This process's replicas' counts: every replica's in a single process.
        return out, counts

    def _counts_of_full(self, replicas: int) -> np.ndarray:
        """The valid counts of every full batch: one read-only array, so that `place` knows
        a full batch by identity and reuses its device copy."""
        if self._full_counts is None:
            self._full_counts = np.full(replicas, self.b, np.int32)
            self._full_counts.flags.writeable = False
        return self._full_counts

    def empty(self) -> HostBatch | None:
        """An all-padding batch for this process's replicas: the established shapes, valid
        counts 0. What a process whose source has ended feeds while other processes still
        have batches (`jaxdist.input.agreement`); None before the first batch, when the
        shapes are unknown."""
        if self._empty is None and self.row_shapes is not None and self.b is not None:
            replicas = len(self._wanted)
            leaves = [np.zeros((replicas, self.b, *s), dtype) for s, dtype in self.row_shapes]
            counts = np.zeros(replicas, np.int32)
            for a in (*leaves, counts):
                a.flags.writeable = False
            self._empty = (leaves, counts)
        return self._empty

    # Placement ---------------------------------------------------------------------

    def is_full(self, counts: np.ndarray) -> bool:
        """Whether a host batch with these valid counts is full (no padding)."""
        return counts is self._full_counts  # from_global / from_per_replica share it

    def full_valid(self) -> Any:
        """The valid counts of a full batch on the devices (placed once per dataset)."""
        if self._full_valid is None:
            counts = self._full_counts
            assert counts is not None
            key = (len(counts), int(counts[0]))
            placed = self._shared_valid.get(key)
            if placed is None:
                placed = self._shared_valid[key] = self._counts_to_devices(counts)
            self._full_valid = placed
        return self._full_valid

    def place(self, leaves: list[np.ndarray], counts: np.ndarray) -> Any:
        """The batch as a pytree of `PerReplica` leaves sharing one valid-count array."""
        valid: Any
        if not self.options.experimental_fetch_to_device:
            valid = counts
            arrays: list[Any] = leaves
        else:
            arrays = self._to_devices(leaves)
            if counts is self._full_counts:  # `is_full`, inline: once per batch
                valid = self._full_valid if self._full_valid is not None else self.full_valid()
            else:
                valid = self._counts_to_devices(counts)
        return self.treedef.unflatten([_per_replica(None, (a, valid)) for a in arrays])

    def place_group(self, leaves: list[np.ndarray]) -> Any:
        """Full host batches stacked along axis 1 (`jaxdist.input.group.stack_steps`)
        placed together, in one transfer per leaf: a pytree with a `PerReplica` leaf of
        shape ``(N, count, b, ...)`` per batch leaf, without valid counts."""
        arrays = self._to_devices(leaves)
        return self.treedef.unflatten([_per_replica(None, (a, None)) for a in arrays])

    def _counts_to_devices(self, counts: np.ndarray) -> jax.Array:
        """Valid-row counts on the devices: replicated when they are every replica's (so a
        step reads any replica's count without communication), else split by replica."""
        if len(counts) == self.n:
            if not self.multi_process:
                return jax.device_put(counts, self.replicated)
            return jax.make_array_from_process_local_data(self.replicated, counts, (self.n,))
        return jax.make_array_from_process_local_data(self.sharding, counts, (self.n,))

    def _to_devices(self, local: list[np.ndarray]) -> list[jax.Array]:
        """Places per-replica host rows into the sharded layout: one batched transfer in a
        single process (each replica's `Rows` straight to its device), each process its
        own rows in a multi-process job."""
        if not self.multi_process:
            if local and type(local[0]) is Rows:
                return [
                    jax.make_array_from_callback(r.shape, self.sharding, r.rows_at) for r in local
                ]
            return place_host_arrays(local, self.sharding)
        shapes = [(self.n, *a.shape[1:]) for a in local]
        return jax.make_array_from_process_local_data(self.sharding, local, shapes)

    def spec(self, element: Any) -> Any:
        """`jax.ShapeDtypeStruct`s (with shardings) for the elements this batcher yields."""

        def one(x: Any) -> Any:
            if not isinstance(x, PerReplica):
                return x
            fetch = self.options.experimental_fetch_to_device
            valid_sharding = getattr(x.valid, "sharding", None) if fetch else None
            return PerReplica(
                jax.ShapeDtypeStruct(
                    x.array.shape, x.array.dtype, sharding=self.sharding if fetch else None
                ),
                jax.ShapeDtypeStruct(np.shape(x.valid), np.int32, sharding=valid_sharding),
            )

        return jax.tree.map(one, element, is_leaf=lambda x: isinstance(x, PerReplica))
