"""Consecutive full batches placed on the devices together.

``jd.train_step(..., steps_per_execution=k)`` runs k batches in one compiled
call and wants them as one array per leaf, ``(replicas, k, b, ...)``. A
`DistributedIterator` asked for a group (``_next_group``) stacks the host
batches of a group once and places them in one transfer per leaf, instead of
placing each batch and stacking them again on the devices: a `PlacedGroup`.
Only full batches are grouped; a padded batch (the end of the data, or a
process whose source ended) always travels alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.input.batching import HostBatch, Rows
from jaxdist.input.host_pool import aligned_empty
from jaxdist.values.distributed import PerReplica

__all__ = ["PlacedGroup", "stack_steps"]


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


class PlacedGroup:
    """``count`` full batches of one iterator on the devices.

    Attributes:
        tree: the batches' structure with a `PerReplica` leaf of shape
            ``(N, count, b, ...)`` per batch leaf (no valid counts: every row is valid).
        count: the number of batches (steps).
        valid: the valid counts of one full batch on the devices, for `batch`.
    """

    __slots__ = ("count", "tree", "valid")

    def __init__(self, tree: Any, count: int, valid: Any) -> None:
        self.tree = tree
        self.count = count
        self.valid = valid

    def _map(self, fn: Any) -> Any:
        return jax.tree.map(fn, self.tree, is_leaf=_is_per_replica)

    def split(self, n: int) -> tuple[PlacedGroup, PlacedGroup]:
        """The first ``n`` batches and the rest, as two groups (slices on the devices)."""
        if not 0 < n < self.count:
            raise ValueError(f"PlacedGroup.split: n={n} must be in [1, {self.count - 1}].")
        head = self._map(lambda x: PerReplica(x.array[:, :n]))
        tail = self._map(lambda x: PerReplica(x.array[:, n:]))
        return PlacedGroup(head, n, self.valid), PlacedGroup(tail, self.count - n, self.valid)

    def batch(self) -> Any:
        """A group of one batch as that batch (`PerReplica` leaves ``(N, b, ...)`` carrying
        the full valid counts, as the iterator's ``next`` returns it)."""
        if self.count != 1:
            raise ValueError(f"PlacedGroup.batch: the group holds {self.count} batches, not 1.")
        return self._map(lambda x: PerReplica(x.array[:, 0], self.valid))


def stack_steps(items: Sequence[HostBatch]) -> list[np.ndarray]:
    """The leaves of host batches ``(replicas, b, ...)`` stacked along a new axis 1:
    ``(replicas, len(items), b, ...)``, one host copy into aligned memory (which the CPU
    backend then uses as the device buffer)."""
    out = []
    for i, first in enumerate(items[0][0]):
        dst = aligned_empty((first.shape[0], len(items), *first.shape[1:]), first.dtype)
        for j, (leaves, _) in enumerate(items):
            a = leaves[i]
            if type(a) is Rows:  # one array per replica (`Rows`)
                for r, row in enumerate(a.rows):
                    dst[r, j] = row
            else:
                dst[:, j] = a
        out.append(dst)
    return out
