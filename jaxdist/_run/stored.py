"""How a training-state leaf stored sharded on a mesh enters and leaves a replica function.

A sharded strategy (`FSDPStrategy`, `MeshStrategy`) keeps each training-state
leaf between steps with a `jax.sharding.PartitionSpec` over its whole mesh.
`run` is manual over the replica axes only (`Strategy.axis_name`); any other
mesh axis (a tensor-parallel axis) stays automatic, laid out by XLA's
partitioner. So a leaf's spec splits in two (`Stored`):

- the *cut*: the dimensions split over replica axes (of size > 1), each with
  its axes and number of blocks. The replica function sees the whole leaf, so
  a cut is all-gathered on entry; the updated leaf leaves as each device's
  block again (`jaxdist._run.sliced_eval` computes it as a block where it can);
- the *automatic* part: the same spec without the replica axes, a sharding
  constraint on the value inside the function (so the partitioner keeps
  parameters, gradients and optimizer state split over the tensor axes).

The collectives over replica axes of such a leaf (the gather on entry, the
reduce-scatter of its gradient) run in a nested ``shard_map`` manual over its
automatic axes too (`on_blocks`): each device then gathers or scatters its own
tensor-parallel block. Left to XLA's partitioner, a collective over manual axes
of a value split over automatic ones first gathers the value over those axes
(measured: 26 extra all-gathers in a 2-layer decoder's step at (2, 2, 2)).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist._jax_compat import axis_names, varying_axes

__all__ = [
    "Cut",
    "Stored",
    "constrain",
    "gather",
    "local_block",
    "on_blocks",
    "scatter_sum",
    "stored",
    "to_varying",
    "transposed",
]

# (dimension, replica axes it is split over, in order, number of blocks) per split dimension.
Cut = tuple[tuple[int, tuple[str, ...], int], ...]


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class Stored:
    """A leaf's layout between steps, split into what `run` does manually and what XLA's
    partitioner does (private)."""

    spec: P  # over the whole mesh: the array's sharding between steps
    manual: P  # the replica axes only: shard_map's in/out spec
    cut: Cut  # the dimensions split over replica axes of size > 1
    auto: P | None  # the other axes: a sharding constraint inside (None: no such axis)
    separate: bool = True  # no dimension split over both replica and automatic axes


def stored(spec: P, mesh: Mesh, replica_axes: str | tuple[str, ...]) -> Stored | None:
    """``spec`` on ``mesh`` as a `Stored` layout; ``None`` for a replicated leaf."""
    names = set(axis_names(replica_axes))
    sizes = dict(mesh.shape)
    manual: list[Any] = []
    auto: list[Any] = []
    cut: list[tuple[int, tuple[str, ...], int]] = []
    for d, entry in enumerate(spec):
        axes = _entry_axes(entry)
        mine = tuple(a for a in axes if a in names)
        other = tuple(a for a in axes if a not in names)
        manual.append(_entry(mine))
        auto.append(_entry(other))
        split = tuple(a for a in mine if sizes[a] > 1)
        if split:
            cut.append((d, split, math.prod(sizes[a] for a in split)))
    if not any(manual) and not any(auto):
        return None
    has_auto = any(auto)
    separate = not any(auto[d] is not None for d, _, _ in cut)
    return Stored(spec, P(*manual), tuple(cut), P(*auto) if has_auto else None, separate)


def transposed(layout: Stored, permutation: tuple[int, ...]) -> Stored:
    """The layout of ``y`` when ``lax.transpose(y, permutation)`` has ``layout``: the
    block of the transpose is the transpose of ``y``'s block (dimension ``k`` of the
    transpose is dimension ``permutation[k]`` of ``y``)."""

    def moved(spec: P) -> P:
        entries = list(spec) + [None] * (len(permutation) - len(spec))
        out: list[Any] = [None] * len(permutation)
        for k, entry in enumerate(entries):
            out[permutation[k]] = entry
        return P(*out)

    return Stored(
        moved(layout.spec),
        moved(layout.manual),
        tuple((permutation[d], axes, blocks) for d, axes, blocks in layout.cut),
        None if layout.auto is None else moved(layout.auto),
        layout.separate,
    )


def to_varying(x: Any, axis: str | tuple[str, ...]) -> Any:
    """``x`` typed as varying over every replica axis (a cast, the same values)."""
    missing = tuple(a for a in axis_names(axis) if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def on_blocks(fn: Callable[[Any], Any], x: Any, layout: Stored) -> Any:
    """``fn(x)`` (a collective over replica axes) on each device's block of the layout's
    automatic axes: a nested ``shard_map`` manual over them. Without automatic axes, or
    when a dimension is split over both kinds (the blocks would interleave), ``fn(x)``."""
    if layout.auto is None or not layout.separate:
        return fn(x)
    axes = frozenset(a for entry in layout.auto for a in _entry_axes(entry))
    nested = jax.shard_map(
        fn,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=layout.auto,
        out_specs=layout.auto,
        axis_names=axes,
    )
    return nested(x)


def gather(x: Any, layout: Stored) -> Any:
    """Inside the replica function: the whole leaf from this device's block."""

    def gather_cut(x: Any) -> Any:
        for d, axes, _ in layout.cut:
            x = lax.all_gather(x, axes, axis=d, tiled=True)
        return x

    return on_blocks(gather_cut, x, layout) if layout.cut else x


def scatter_sum(x: Any, layout: Stored, axes: tuple[str, ...]) -> Any:
    """This device's block (the layout's one cut) of the sum of ``x`` over the replica
    ``axes`` (which include the cut's): a reduce-scatter over the cut's axes, then a sum
    over the others of size above 1. (An all-reduce over axes of size 1 is no sum, but
    XLA's CPU backend still runs it, as one more collective after the reduce-scatters:
    at mesh (data, fsdp, tensor) = (1, 8, 1) the step without it took 0.92 and 0.98
    of the time with it, timed in the same process, `benchmarks/mesh.py`'s decoder.)

    A cut dimension other than the first is moved first for the reduce-scatter and
    back after it: XLA's CPU backend scatters a non-leading dimension several times
    slower than a leading one (measured on 8 devices: 16.7 ms against 3.4 ms, copy
    included, for a 1024 x 256 gradient cut along its second dimension)."""
    ((d, split, _),) = layout.cut

    def reduce(x: Any) -> Any:
        if d == 0:
            return lax.psum_scatter(x, split, scatter_dimension=0, tiled=True)
        moved = lax.psum_scatter(jnp.moveaxis(x, d, 0), split, scatter_dimension=0, tiled=True)
        return jnp.moveaxis(moved, 0, d)

    x = on_blocks(reduce, x, layout)
    rest = tuple(a for a in axes if a not in split and lax.axis_size(a) > 1)
    return lax.psum(x, rest) if rest else x


def local_block(x: Any, cut: Cut) -> Any:
    """This device's block of the whole ``x`` (the inverse of `gather`)."""
    for d, axes, blocks in cut:
        size = x.shape[d] // blocks
        x = lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * size, size, axis=d)
    return x


def constrain(x: Any, layout: Stored | None) -> Any:
    """``x`` constrained to the layout's automatic (non-replica) axes, if it has any."""
    if layout is None or layout.auto is None:
        return x
    return lax.with_sharding_constraint(x, layout.auto)
