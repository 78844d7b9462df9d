"""Sharded variables: one logical variable stored as several `Variable`s split along axis 0.

TensorFlow's ``tf.distribute.experimental.partitioners`` and ``ShardedVariable``.
``jd.Variable(value, partitioner=p)`` asks ``p(shape, dtype)`` for shard counts
(a list with the count along axis 0 first and ``1`` elsewhere) and splits the
value into ``n = min(count, shape[0])`` shards by TF's "div" rule: the first
``shape[0] % n`` shards get one row more (10 rows in 4 shards: 3, 3, 2, 2).
One shard, or a scalar, gives a plain `Variable`.

A `ShardedVariable` reads like the concatenation of its shards along axis 0
(``numpy()``, ``np.asarray``, arithmetic, ``read_value``); indexing reads only
the shards it needs (an integer on axis 0 reads one shard). Like every jaxdist
variable it is immutable: ``assign`` / ``assign_add`` / ``assign_sub`` return a
new `ShardedVariable` whose shard ``i`` took its rows of the value. It is a
pytree whose children are its shards, so it goes through ``strategy.run``,
``jax.jit`` and tree maps like a list of variables (a tree map that puts
arrays in place of the shards, as ``strategy.experimental_local_results``
does, gives a `ShardedVariable` of arrays: it reads like the concatenation,
and refuses updates); checkpoints store the full
(concatenated) array and restore into any number of shards, or a plain
`Variable` of the full shape.

Placement: each shard is a `Variable` of the strategy in effect, placed as that
strategy places variables (mirrored shards are replicated on every replica's
device). Shards are not spread over parameter servers or devices.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import _cpu_gate
from jaxdist._jax_compat import is_tracer
from jaxdist.values.array_like import ReadsLikeAnArray
from jaxdist.values.distributed import Mirrored, PerReplica
from jaxdist.variables import _variable
from jaxdist.variables._dtype_rules import initial_array
from jaxdist.variables._variable import Variable, as_distributed

__all__ = ["ShardedVariable", "div_rows"]

_NAME = "ShardedVariable"


def div_rows(rows: int, shards: int) -> list[int]:
    """TF's "div" split of ``rows`` into ``shards``: the first ``rows % shards`` get one more."""
    base, extra = divmod(rows, shards)
    return [base + 1 if i < extra else base for i in range(shards)]


class ShardedVariable(ReadsLikeAnArray):
    """A variable stored as shards along its first axis (``tf.distribute``'s name).

    Args:
        variables: a non-empty list of `jaxdist.Variable`, of one dtype, of rank
            one or more and of the same shape except along the first axis.
        name: an optional name.

    Raises:
        TypeError: ``variables`` is not a non-empty list of variables.
        ValueError: the shards differ in dtype, in shape beyond the first axis,
            in ``trainable`` or in strategy, or are scalars.

    Example:
        >>> import numpy as np, jaxdist as jd
        >>> sv = jd.experimental.ShardedVariable(
        ...     [jd.Variable([[0, 0]]), jd.Variable([[1, 1], [2, 2]])], name="s")
        >>> sv.shape, [v.shape for v in sv.variables]
        ((3, 2), [(1, 2), (2, 2)])
        >>> np.asarray(sv.assign_add(1)).tolist()
        [[1, 1], [2, 2], [3, 3]]
    """

    __slots__ = ("_name", "_variables")
    _variables: tuple[Any, ...]
    _name: str | None

    def __init__(self, variables: Sequence[Variable], name: str | None = None) -> None:
        shards = _checked_shards(variables)
        object.__setattr__(self, "_variables", shards)
        object.__setattr__(self, "_name", name)

    @classmethod
    def _make(cls, variables: Sequence[Any], name: str | None) -> ShardedVariable:
        """Without checks: also rebuilds pytrees whose leaves are not variables (private)."""
        sv = object.__new__(cls)
        object.__setattr__(sv, "_variables", tuple(variables))
        object.__setattr__(sv, "_name", name)
        return sv

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{_NAME} is immutable: assign/assign_add/assign_sub return a new {_NAME}."
        )

    # Metadata -----------------------------------------------------------------------

    @property
    def variables(self) -> tuple[Variable, ...]:
        """The shards, in order along the first axis."""
        return self._variables

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def dtype(self) -> Any:
        return self._variables[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The full shape: the shards' rows added up, then their common other dimensions."""
        first = self._variables[0].shape
        return (sum(v.shape[0] for v in self._variables), *first[1:])

    @property
    def ndim(self) -> int:
        return len(self._variables[0].shape)

    @property
    def trainable(self) -> bool:
        return bool(self._variables[0].trainable)

    @property
    def strategy(self) -> Any:
        """The strategy that placed the shards."""
        return self._variables[0].strategy

    def _bounds(self) -> list[int]:
        """Row offsets: shard ``i`` holds rows ``[bounds[i], bounds[i + 1])``."""
        out = [0]
        for v in self._variables:
            out.append(out[-1] + v.shape[0])
        return out

    def __iter__(self) -> Iterator[Variable]:
        """Iterates over the shards (as TF does), not over rows."""
        return iter(self._variables)

    def __repr__(self) -> str:
        rows = [v.shape[0] for v in self._variables]
        return (
            f"{_NAME}(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"shard_rows={rows})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (list(self._variables), self._name))

    # Reading ------------------------------------------------------------------------

    def read_value(self) -> Any:
        """The full value: the shards' values concatenated along the first axis."""
        return _concat([_read(v) for v in self._variables])

    def value(self) -> Any:
        """Same as `read_value` (tf.Variable's name)."""
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return np.asarray(self.read_value())

    def checkpoint_value(self) -> Any:
        """What a checkpoint stores: the full array (each shard's checkpoint value)."""
        return np.concatenate([np.asarray(v.checkpoint_value()) for v in self._variables])

    def __getitem__(self, key: Any) -> Any:
        """Indexes the full value as a JAX array is indexed, reading only the shards it needs.

        An integer on the first axis reads its one shard; a slice there reads the
        shards it crosses; ``...`` and ``None`` are expanded first. Other keys
        (boolean masks, integer arrays, traced indices) index the full value.

        Raises:
            IndexError: an integer on the first axis out of ``[-rows, rows)``.
        """
        spec = key if isinstance(key, tuple) else (key,)
        if not all(_basic(k) for k in spec) or sum(k is Ellipsis for k in spec) > 1:
            return self.read_value()[key]
        if any(k is Ellipsis for k in spec):
            spec = _expand_ellipsis(spec, self.ndim)
        if not spec:
            return self.read_value()
        head, rest = spec[0], spec[1:]
        if head is None:
            return self[rest][None]
        rows = self.shape[0]
        bounds = self._bounds()
        if isinstance(head, slice):
            return self._slice(head, rest, rows, bounds)
        index = int(head)
        if not -rows <= index < rows:
            raise IndexError(
                f"{_NAME}: slice index {index} of dimension 0 out of bounds. {self!r} has "
                f"{rows} rows; use an index in [-{rows}, {rows})."
            )
        index %= rows
        i = next(j for j in range(len(self._variables)) if index < bounds[j + 1])
        return self._variables[i][(index - bounds[i], *rest)]

    def _slice(self, s: slice, rest: tuple[Any, ...], rows: int, bounds: list[int]) -> Any:
        """``self[s, *rest]``: the pieces of the shards the slice crosses, in its order."""
        picked = range(*s.indices(rows))  # ValueError for a zero step, as NumPy
        order = range(len(self._variables))
        pieces = []
        for i in order if picked.step > 0 else reversed(order):
            part = _within(picked, bounds[i], bounds[i + 1])
            if len(part):
                first, last = part[0] - bounds[i], part[-1] - bounds[i]
                stop = last + (1 if part.step > 0 else -1)
                local = slice(first, stop if stop >= 0 else None, part.step)
                pieces.append(self._variables[i][(local, *rest)])
        if not pieces:
            empty = jnp.zeros((0, *self.shape[1:]), dtype=self.dtype)
            return empty[(slice(None), *rest)]
        return pieces[0] if len(pieces) == 1 else _concat(pieces)

    def sparse_read(self, indices: Any) -> Any:
        """Rows ``indices`` of the full value (an embedding lookup), shard by shard.

        ``indices`` is an integer array of any shape; the result has shape
        ``indices.shape + shape[1:]``. Each shard gathers the ids that fall in
        it, so the full table is never assembled.

        Raises:
            IndexError: concrete ``indices`` outside ``[0, rows)``. Traced ones
                (inside ``jax.jit`` or ``strategy.run``) cannot raise: an
                out-of-range id there reads a row of zeros, as TF's
                ``embedding_lookup`` does on GPU and TPU (on CPU TF raises).
        """
        ids = jnp.asarray(indices)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"{_NAME}.sparse_read: indices must be integers, got dtype {ids.dtype} "
                f"(shape {ids.shape}); cast them first, for example ids.astype('int32')."
            )
        rows = self.shape[0]
        if not is_tracer(ids) and ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= rows:
                raise IndexError(
                    f"{_NAME}.sparse_read: indices in [{low}, {high}] but {self!r} has "
                    f"{rows} rows; use ids in [0, {rows})."
                )
        bounds = self._bounds()
        out = None
        for i, v in enumerate(self._variables):
            size = bounds[i + 1] - bounds[i]
            if size == 0:
                continue
            local = jnp.clip(ids - bounds[i], 0, size - 1)
            rows_i = jnp.take(_read(v), local, axis=0)
            if out is None:
                out = rows_i
                continue
            inside = (ids >= bounds[i]).reshape(ids.shape + (1,) * (self.ndim - 1))
            out = jnp.where(inside, rows_i, out)
        if is_tracer(ids) and out is not None:
            valid = ((ids >= 0) & (ids < rows)).reshape(ids.shape + (1,) * (self.ndim - 1))
            out = jnp.where(valid, out, jnp.zeros((), out.dtype))
        return out

    # Updates ------------------------------------------------------------------------

    def _parts(self, value: Any, where: str) -> list[Any]:
        """``value`` (broadcast to the full shape) as one part per shard."""
        shape = self.shape
        bounds = self._bounds()
        if isinstance(value, PerReplica):
            return self._per_replica_parts(value, where, shape, bounds)
        if isinstance(value, (Variable, ShardedVariable)):
            value = value.read_value()
        elif isinstance(value, Mirrored):
            value = value.array
        elif not hasattr(value, "dtype"):
            value = np.asarray(value)  # Python numbers and lists of them
        vshape = tuple(np.shape(value))
        _check_broadcast(where, self, vshape)
        if len(vshape) < len(shape) or vshape[0] != shape[0]:
            return [value] * len(self._variables)  # fits every shard as it is
        return [value[bounds[i] : bounds[i + 1]] for i in range(len(self._variables))]

    def _per_replica_parts(
        self, value: PerReplica, where: str, shape: tuple[int, ...], bounds: list[int]
    ) -> list[Any]:
        if value.valid is not None:
            raise ValueError(
                f"{where}: the PerReplica value for {self!r} is a padded batch (it carries "
                "valid-row counts), not one value per replica. Reduce it first, for example "
                "strategy.reduce('sum', batch, axis=0)."
            )
        arr = value.array
        row_shape = tuple(arr.shape[1:])
        _check_broadcast(where, self, row_shape)
        pad = (1,) * (len(shape) - len(row_shape))
        full = jnp.broadcast_to(
            arr.reshape((arr.shape[0], *pad, *row_shape)), (arr.shape[0], *shape)
        )
        return [PerReplica(full[:, bounds[i] : bounds[i + 1]]) for i in range(len(self._variables))]

    def _update(self, kind: str, value: Any) -> ShardedVariable:
        return self.updated_by(kind, value, lambda v, k, part: getattr(v, k)(part))

    def updated_by(
        self, kind: str, value: Any, update: Callable[[Variable, str, Any], Variable]
    ) -> ShardedVariable:
        """The variable after ``update(shard, kind, part)`` of every shard, where ``part``
        is the shard's rows of ``value`` (`split`) and ``kind`` is ``"assign"``,
        ``"assign_add"`` or ``"assign_sub"``: `assign` with ``Variable.assign`` as
        ``update``, ``ctx.assign`` with the replica context's."""
        where = f"{_NAME}.{kind}"
        self._check_holds_variables(where)
        parts = self.split(value, where)
        new = [update(v, kind, p) for v, p in zip(self._variables, parts, strict=True)]
        return ShardedVariable._make(new, self._name)

    def split(self, value: Any, where: str) -> list[Any]:
        """``value`` as one part per shard: a value of the full shape (or a `Mirrored` or
        `PerReplica` of it) is cut into the shards' rows; one that broadcasts to every
        shard as it is (a scalar, a row) is given to each. ``where`` names the caller in
        the error for a value that does not fit."""
        return self._parts(value, where)

    def _check_holds_variables(self, where: str) -> None:
        if not all(isinstance(v, Variable) for v in self._variables):
            raise TypeError(
                f"{where}: {self!r} holds arrays, not variables (it came out of a tree map "
                "over its shards, such as strategy.experimental_local_results); read it with "
                "numpy() / read_value(), or update the ShardedVariable it came from."
            )

    def assign(self, value: Any) -> ShardedVariable:
        """Returns the variable set to ``value``: shard ``i`` takes its rows of it.

        ``value`` has the full shape (or broadcasts to it); it may be a `Mirrored`
        or a `PerReplica` as for `jaxdist.Variable.assign`, and inside a replica
        function each shard's update is aggregated as the shard's aggregation says.
        """
        return self._update("assign", value)

    def assign_add(self, delta: Any) -> ShardedVariable:
        """Returns the variable plus ``delta`` (of the full shape, or broadcasting to it)."""
        return self._update("assign_add", delta)

    def assign_sub(self, delta: Any) -> ShardedVariable:
        """Returns the variable minus ``delta`` (of the full shape, or broadcasting to it)."""
        return self._update("assign_sub", delta)

    def restored(self, value: Any) -> ShardedVariable:
        """Each shard set to its rows of a checked checkpoint value (private)."""
        bounds = self._bounds()
        new = [v.restored(value[bounds[i] : bounds[i + 1]]) for i, v in enumerate(self._variables)]
        return ShardedVariable._make(new, self._name)


jax.tree_util.register_pytree_with_keys(
    ShardedVariable,
    lambda sv: (
        tuple((jax.tree_util.SequenceKey(i), v) for i, v in enumerate(sv.variables)),
        sv.name,
    ),
    lambda name, children: ShardedVariable._make(list(children), name),
    lambda sv: (sv.variables, sv.name),
)


def _rebuild(variables: list[Variable], name: str | None) -> ShardedVariable:
    return ShardedVariable(variables, name=name)


# Checks and helpers -------------------------------------------------------------------


def _checked_shards(variables: Any) -> tuple[Variable, ...]:
    where = f"jaxdist.experimental.{_NAME}"
    if (
        not isinstance(variables, (list, tuple))
        or not variables
        or not all(isinstance(v, Variable) for v in variables)
    ):
        got = (
            [type(v).__name__ for v in variables]
            if isinstance(variables, (list, tuple))
            else type(variables).__name__
        )
        raise TypeError(
            f"{where}: variables should be a non-empty list of jaxdist.Variable, got {got}. "
            "Create each shard with jd.Variable(...), or let jd.Variable(value, "
            "partitioner=...) split one."
        )
    shards = tuple(variables)
    dtypes = [str(v.dtype) for v in shards]
    if len(set(dtypes)) > 1:
        raise ValueError(
            f"{where}: all variables must have the same dtype; got dtypes {dtypes}. Create "
            "the shards with one dtype (dtype=...)."
        )
    shapes = [v.shape for v in shards]
    if any(len(s) == 0 for s in shapes):
        raise ValueError(
            f"{where}: the variables must have rank 1 or higher (they are split along their "
            f"first axis); got shapes {shapes}."
        )
    if len({s[1:] for s in shapes}) > 1:
        raise ValueError(
            f"{where}: all variables must have the same shapes except for the first axis; "
            f"got shapes {shapes}. Split one array along its first axis only."
        )
    trainable = [v.trainable for v in shards]
    if len(set(trainable)) > 1:
        raise ValueError(
            f"{where}: all variables must have the same trainable property; got {trainable}."
        )
    strategies = [v.strategy for v in shards]
    if any(s != strategies[0] for s in strategies):
        raise ValueError(
            f"{where}: all variables must belong to one strategy; got "
            f"{sorted({repr(s) for s in strategies})}. Create every shard in the same "
            "strategy's scope."
        )
    return shards


def _check_broadcast(where: str, sv: ShardedVariable, shape: tuple[int, ...]) -> None:
    try:
        fits = np.broadcast_shapes(shape, sv.shape) == sv.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{where}: value of shape {shape} does not fit {sv!r}; pass a value of shape "
            f"{sv.shape} (or one that broadcasts to it)."
        )


def _read(shard: Any) -> Any:
    """A shard's value: a variable's `read_value`, or the array a tree map left there."""
    return shard.read_value() if isinstance(shard, Variable) else shard


def _concat(parts: list[Any]) -> Any:
    """Concatenates along axis 0; eagerly under the CPU gate (one program at a time)."""
    if any(is_tracer(p) for p in parts):
        return jnp.concatenate(parts, axis=0)
    return _cpu_gate.gated(lambda: jnp.concatenate(parts, axis=0))


def _basic(k: Any) -> bool:
    """A key NumPy's basic indexing handles: an int, a slice of ints, ``None``, ``...``."""
    if k is None or k is Ellipsis:
        return True
    if isinstance(k, slice):
        return all(x is None or _is_int(x) for x in (k.start, k.stop, k.step))
    return _is_int(k)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _expand_ellipsis(spec: tuple[Any, ...], ndim: int) -> tuple[Any, ...]:
    """``spec`` with its ``...`` replaced by the slices it stands for."""
    at = next(i for i, k in enumerate(spec) if k is Ellipsis)
    explicit = sum(1 for k in spec if k is not None and k is not Ellipsis)
    fill = (slice(None),) * max(ndim - explicit, 0)
    return (*spec[:at], *fill, *(k for k in spec[at + 1 :] if k is not Ellipsis))


def _within(picked: range, start: int, stop: int) -> range:
    """The part of ``picked`` (a range) whose values lie in ``[start, stop)``."""
    first, step = picked.start, picked.step
    if step > 0:
        lo = math.ceil((start - first) / step)
        hi = math.ceil((stop - first) / step)
    else:
        lo = math.floor((stop - first) / step) + 1
        hi = math.floor((start - first) / step) + 1
    n = len(picked)
    return picked[min(max(lo, 0), n) : min(max(hi, 0), n)]


# Variables created with a partitioner ---------------------------------------------------


def shard_count(partitioner: Any, shape: tuple[int, ...], dtype: Any, where: str) -> int:
    """The number of shards along axis 0 the partitioner asks for, checked."""
    if not callable(partitioner):
        raise TypeError(
            f"{where}: partitioner={partitioner!r} is not callable; pass a partitioner such "
            "as jd.experimental.partitioners.FixedShardsPartitioner(2), or any "
            "partitioner(shape, dtype) returning shard counts."
        )
    counts = partitioner(shape, dtype)
    valid = (
        isinstance(counts, (list, tuple))
        and len(counts) == len(shape)
        and all(_is_int(c) for c in counts)
        and int(counts[0]) >= 1
        and all(int(c) == 1 for c in counts[1:])
    )
    if not valid:
        raise ValueError(
            f"{where}: the partitioner {partitioner!r} returned {counts!r} for shape {shape} "
            f"and dtype {np.dtype(dtype)}; a partitioner must return a list of {len(shape)} "
            "ints: the number of shards along the first axis (1 or more), then 1 for every "
            "other axis (for example [2] + [1] * (rank - 1)). Only the first axis can be "
            "split."
        )
    return min(int(counts[0]), shape[0])


def partitioned_variable(partitioner: Any, initial_value: Any, **kwargs: Any) -> Any:
    """``jd.Variable(initial_value, partitioner=partitioner, **kwargs)`` (private)."""
    name = kwargs.get("name")
    where = f"jaxdist.Variable(name={name!r})"
    if callable(initial_value):
        initial_value = initial_value()  # called once; the shards take their rows
    value = initial_array(initial_value, kwargs.get("dtype"), where)
    shape = tuple(value.shape)
    if not shape:
        return Variable(value, **kwargs)  # a scalar has no rows to split
    n = shard_count(partitioner, shape, value.dtype, where)
    if n <= 1:
        return Variable(value, **kwargs)
    offsets = np.cumsum([0, *div_rows(shape[0], n)])
    shards = []
    for i in range(n):
        part_name = f"{name}/part_{i}" if name is not None else f"part_{i}"
        part = value[int(offsets[i]) : int(offsets[i + 1])]
        shards.append(Variable(part, **{**kwargs, "name": part_name}))
    return ShardedVariable(shards, name=name)


def whole(x: Any) -> Any:
    """A sharded variable as one distributed value (cross-replica methods see the whole
    variable, not its shards): its shards' `Mirrored` copies (``ON_WRITE``) or
    `PerReplica` copies (``ON_READ``) concatenated along the variable's first axis;
    anything else is returned as is."""
    if not isinstance(x, ShardedVariable) or not all(isinstance(v, Variable) for v in x.variables):
        return x
    parts = [as_distributed(v) for v in x.variables]
    if all(isinstance(p, Mirrored) for p in parts):
        return Mirrored(jnp.concatenate([p.array for p in parts], axis=0))
    if all(isinstance(p, PerReplica) for p in parts):
        return PerReplica(jnp.concatenate([p.array for p in parts], axis=1))
    return x


def unshard(tree: Any) -> Any:
    """``tree`` with every sharded variable replaced by `whole` of it."""
    return jax.tree.map(whole, tree, is_leaf=lambda x: isinstance(x, ShardedVariable))


_variable.register_partitioned(partitioned_variable)
