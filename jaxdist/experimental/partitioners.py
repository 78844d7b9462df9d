"""Variable partitioners: how many shards a variable of a given shape and dtype gets.

TensorFlow's ``tf.distribute.experimental.partitioners``. A partitioner is
called as ``partitioner(shape, dtype, axis=0)`` and returns a list with one
entry per dimension of ``shape``: the number of shards along ``axis`` and
``1`` everywhere else, e.g. ``[2, 1]`` for a ``(10, 3)`` variable split in
two along its rows. The numbers are TensorFlow's, from the same formulas:

- `FixedShardsPartitioner`: ``min(num_shards, shape[axis])`` shards.
- `MinSizePartitioner`: as many shards as possible with at least
  ``min_shard_bytes`` each, at most ``max_shards`` and ``shape[axis]``.
- `MaxSizePartitioner`: as few shards as possible with at most
  ``max_shard_bytes`` each (a single slice along ``axis`` may still be
  larger), at most ``max_shards`` when that is given.

``shape`` is a tuple or list of ints (a NumPy or JAX shape); ``dtype`` is
anything `numpy.dtype` understands (``np.float32``, ``jnp.bfloat16``,
``"int8"``). String variables (``"string"``, ``str``, ``np.str_``,
``bytes``, ``object``) count ``bytes_per_string`` bytes per element, as TF
estimates its ``tf.string`` elements.

Where TF is undefined, jaxdist answers instead of failing: a dimension of
size 0 along ``axis`` (or no bytes per slice) gets one shard, where TF
returns 0 shards (`FixedShardsPartitioner`) or divides by zero
(`MaxSizePartitioner`). ``num_shards`` and ``max_shards`` below 1 are
errors, where TF accepts ``num_shards=0`` and reads ``max_shards=0`` of
`MaxSizePartitioner` as "no limit".
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any, final

import numpy as np

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
]

# Spellings of TF's `tf.string` dtype that `numpy.dtype` does not take.
_STRING_NAMES = frozenset({"string", "str"})


class Partitioner(abc.ABC):
    """Base class of partitioners: ``partitioner(shape, dtype, axis=0)`` gives shard counts.

    A subclass implements `__call__`, returning a list of ints, one per
    dimension of ``shape``: the number of shards along ``axis``, ``1``
    elsewhere. A partitioner is an immutable value (subclasses are frozen
    dataclasses), so it can be a field of a strategy.
    """

    @abc.abstractmethod
    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """Returns the number of shards on each dimension of ``shape``.

        Args:
            shape: the variable's shape, a tuple or list of non-negative ints.
            dtype: the variable's dtype (NumPy/JAX dtype, or a string dtype).
            axis: the dimension to shard (negative counts from the end).

        Returns:
            A list of ``len(shape)`` ints, the shard count along ``axis`` and
            ``1`` elsewhere.
        """


@final
@dataclasses.dataclass(frozen=True)
class FixedShardsPartitioner(Partitioner):
    """Splits into ``num_shards`` shards (fewer when the dimension is shorter).

    Args:
        num_shards: the number of shards, a positive int.

    Example:
        >>> import numpy as np
        >>> from jaxdist.experimental.partitioners import FixedShardsPartitioner
        >>> partitioner = FixedShardsPartitioner(num_shards=2)
        >>> partitioner((10, 3), np.float32)
        [2, 1]
        >>> partitioner((10, 3), np.float32, axis=1)
        [1, 2]
    """

    num_shards: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_shards", _count(self, "num_shards", self.num_shards))

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        del dtype  # the shard count does not depend on it (as in TF)
        dims, axis = _shape_and_axis(self, shape, axis)
        return _on_axis(len(dims), axis, max(1, min(self.num_shards, dims[axis])))


@final
@dataclasses.dataclass(frozen=True)
class MinSizePartitioner(Partitioner):
    """As many shards as possible, each at least ``min_shard_bytes``, at most ``max_shards``.

    The count is ``ceil(total_bytes / min_shard_bytes)``, capped by
    ``max_shards`` and by ``shape[axis]``, and at least 1.

    Args:
        min_shard_bytes: the minimum bytes of each shard (default 256 KiB).
        max_shards: the largest number of shards (default 1).
        bytes_per_string: the estimated size of one element of a string
            variable.

    Example:
        >>> import numpy as np
        >>> from jaxdist.experimental.partitioners import MinSizePartitioner
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
        [2, 1]
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32)
        [6, 1]
    """

    min_shard_bytes: float = 256 << 10
    max_shards: int = 1
    bytes_per_string: float = 16

    def __post_init__(self) -> None:
        _positive_bytes(self, "min_shard_bytes", self.min_shard_bytes)
        object.__setattr__(self, "max_shards", _count(self, "max_shards", self.max_shards))
        _positive_bytes(self, "bytes_per_string", self.bytes_per_string)

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims, axis = _shape_and_axis(self, shape, axis)
        total = math.prod(dims) * _element_bytes(self, dtype, self.bytes_per_string)
        wanted = _ceil_div(total, self.min_shard_bytes)
        return _on_axis(len(dims), axis, max(1, min(dims[axis], self.max_shards, wanted)))


@final
@dataclasses.dataclass(frozen=True)
class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each at most ``max_shard_bytes``.

    Whole slices along ``axis`` are packed into shards of at most
    ``max_shard_bytes``; a slice larger than that gets a shard of its own.
    With ``max_shards``, at most that many shards, which may then exceed
    ``max_shard_bytes``.

    Args:
        max_shard_bytes: the largest size of a shard in bytes.
        max_shards: the largest number of shards (``None``: no limit).
        bytes_per_string: the estimated size of one element of a string
            variable.

    Example:
        >>> import numpy as np
        >>> from jaxdist.experimental.partitioners import MaxSizePartitioner
        >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32)
        [6, 1]
        >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32)
        [2, 1]
        >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32)
        [1, 1]
    """

    max_shard_bytes: float
    max_shards: int | None = None
    bytes_per_string: float = 16

    def __post_init__(self) -> None:
        _positive_bytes(self, "max_shard_bytes", self.max_shard_bytes)
        if self.max_shards is not None:
            object.__setattr__(self, "max_shards", _count(self, "max_shards", self.max_shards))
        _positive_bytes(self, "bytes_per_string", self.bytes_per_string)

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims, axis = _shape_and_axis(self, shape, axis)
        slice_bytes = math.prod(dims[:axis] + dims[axis + 1 :]) * _element_bytes(
            self, dtype, self.bytes_per_string
        )
        if dims[axis] == 0 or slice_bytes == 0:
            return _on_axis(len(dims), axis, 1)
        slices_per_shard = max(1, _floor_div(self.max_shard_bytes, slice_bytes))
        shards = _ceil_div(dims[axis], slices_per_shard)
        if self.max_shards is not None:
            shards = min(shards, self.max_shards)
        return _on_axis(len(dims), axis, shards)


def _on_axis(rank: int, axis: int, shards: int) -> list[int]:
    result = [1] * rank
    result[axis] = int(shards)
    return result


def _ceil_div(a: float, b: float) -> int:
    if isinstance(a, numbers.Integral) and isinstance(b, numbers.Integral):
        return -(-int(a) // int(b))  # exact for any size
    return math.ceil(a / b)


def _floor_div(a: float, b: float) -> int:
    if isinstance(a, numbers.Integral) and isinstance(b, numbers.Integral):
        return int(a) // int(b)
    return math.floor(a / b)


def _count(owner: Partitioner, name: str, value: Any) -> int:
    """A shard-count argument: a positive int."""
    where = type(owner).__name__
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: argument `{name}` must be a positive int. Received: {value!r} "
            f"({type(value).__name__})."
        )
    if value < 1:
        raise ValueError(f"{where}: Argument `{name}` must be positive. Received: {value}")
    return int(value)


def _positive_bytes(owner: Partitioner, name: str, value: Any) -> None:
    """A byte-count argument: a real number of at least 1 (TF's check)."""
    where = type(owner).__name__
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: argument `{name}` must be a number of bytes. Received: {value!r} "
            f"({type(value).__name__})."
        )
    if value < 1:
        raise ValueError(f"{where}: Argument `{name}` must be positive. Received: {value}")


def _shape_and_axis(owner: Partitioner, shape: Any, axis: Any) -> tuple[list[int], int]:
    """Validates ``shape`` (fully defined, non-negative ints) and normalises ``axis``."""
    where = f"{type(owner).__name__}.__call__"
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(
            f"{where}: `shape` must be a tuple or list of ints (e.g. `x.shape`). "
            f"Received: {shape!r} ({type(shape).__name__})."
        )
    dims: list[int] = []
    for d in shape:
        if d is None:
            raise ValueError(f"{where}: shape is not fully defined: {tuple(shape)}")
        try:
            size = operator.index(d)
        except TypeError:
            raise TypeError(
                f"{where}: every entry of `shape` must be an int. Received: {tuple(shape)}."
            ) from None
        if size < 0:
            raise ValueError(f"{where}: `shape` has a negative dimension: {tuple(shape)}.")
        dims.append(size)
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{where}: `axis` must be an int. Received: {axis!r}.")
    axis = int(axis)
    if not -len(dims) <= axis < len(dims):
        raise ValueError(
            f"{where}: Can not partition variable along axis {axis} when shape is only "
            f"{tuple(dims)}."
        )
    return dims, axis % len(dims)


def _element_bytes(owner: Partitioner, dtype: Any, bytes_per_string: float) -> float:
    """The bytes of one element of ``dtype``; ``bytes_per_string`` for string dtypes."""
    where = f"{type(owner).__name__}.__call__"
    if isinstance(dtype, str) and dtype.strip().lower() in _STRING_NAMES:
        return bytes_per_string
    if dtype is None:
        raise TypeError(f"{where}: `dtype` is required (e.g. np.float32), got None.")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{where}: `dtype` must be a NumPy or JAX dtype (e.g. np.float32, jnp.bfloat16) or "
            f"a string dtype ('string', str, object). Received: {dtype!r}."
        ) from None
    if dt.kind in "USO":  # unicode, bytes, object: TF's tf.string
        return bytes_per_string
    return dt.itemsize
