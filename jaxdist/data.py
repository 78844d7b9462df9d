"""Re-iterable datasets: batches sliced from arrays, and generators made anew each epoch.

Slicing whole batches out of one array is far faster than stacking records
one by one (see benchmarks/README.md), so arrays get their own source. A
generator object gives a single epoch; `from_generator` wraps the function
that makes it, so every ``iter()`` (every epoch) starts a new one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["ArrayDataset", "GeneratorDataset", "from_arrays", "from_generator"]


class ArrayDataset:
    """Global batches sliced from in-memory arrays (re-iterable; one epoch per ``iter``).

    Built by `from_arrays`. The last partial batch is kept unless
    ``drop_remainder``; with ``shuffle`` each epoch uses a new permutation
    derived from ``seed`` and the epoch number.
    """

    def __init__(
        self, data: Any, batch_size: int, shuffle: bool, seed: int, drop_remainder: bool
    ) -> None:
        leaves, self._treedef = jax.tree.flatten(data)
        self._leaves = [np.asarray(x) for x in leaves]
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self._epoch = 0
        self.num_rows = self._leaves[0].shape[0]

    @property
    def leaves(self) -> list[np.ndarray]:
        """The arrays the batches are sliced from (the leaves of ``data``, rows first)."""
        return list(self._leaves)

    def __len__(self) -> int:
        if self.drop_remainder:
            return self.num_rows // self.batch_size
        return math.ceil(self.num_rows / self.batch_size)

    @property
    def next_epoch(self) -> int:
        """The epoch (0-based) whose order the next ``iter()`` reads."""
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        self._epoch += 1
        return self._epoch_batches(epoch, 0)

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """Epoch ``epoch``'s batches (its shuffled order) from batch ``start`` on; the next
        ``iter()`` reads epoch ``epoch + 1``. Resuming a stopped epoch costs nothing.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> ds = jd.data.from_arrays(np.arange(6), batch_size=2, shuffle=True, seed=1)
            >>> first, second = list(ds), list(ds)
            >>> [b.tolist() for b in ds.epoch_batches(1, start=2)] == [second[2].tolist()]
            True
        """
        self._epoch = epoch + 1
        return self._epoch_batches(epoch, start)

    def _epoch_batches(self, epoch: int, start: int) -> Iterator[Any]:
        order = None
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(self.num_rows)
        for i in range(start, len(self)):
            lo, hi = i * self.batch_size, min((i + 1) * self.batch_size, self.num_rows)
            if order is None:
                batch = [x[lo:hi] for x in self._leaves]
            else:
                batch = [x[order[lo:hi]] for x in self._leaves]
            yield jax.tree.unflatten(self._treedef, batch)


def from_arrays(
    *arrays: Any,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    drop_remainder: bool = False,
) -> ArrayDataset:
    """A dataset of global batches from arrays that share their first axis.

    Args:
        *arrays: one or more arrays, or one pytree of arrays (e.g. a dict);
            batches keep that structure (a tuple when several are given).
        batch_size: rows per global batch.
        shuffle: reshuffle the rows every epoch.
        seed: the shuffle seed.
        drop_remainder: drop the last batch when it is smaller than
            ``batch_size`` (by default it is kept, then padded and masked when
            distributed).

    Example:
        >>> import numpy as np, jaxdist as jd
        >>> ds = jd.data.from_arrays(np.arange(10), batch_size=4)
        >>> [b.tolist() for b in ds]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """
    if not arrays:
        raise ValueError("jaxdist.data.from_arrays: give at least one array.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"jaxdist.data.from_arrays: batch_size must be an int >= 1, got {batch_size!r}."
        )
    data = arrays[0] if len(arrays) == 1 else tuple(arrays)
    with_path = jax.tree_util.tree_flatten_with_path(data)[0]
    if not with_path:
        raise ValueError("jaxdist.data.from_arrays: the arrays pytree has no leaves.")
    sizes = {
        jax.tree_util.keystr(p) or "<array>": np.shape(x)[0] if np.ndim(x) else None
        for p, x in with_path
    }
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise ValueError(
            f"jaxdist.data.from_arrays: every array needs the same leading (row) axis; got {sizes}."
        )
    return ArrayDataset(data, batch_size, shuffle, seed, drop_remainder)


class GeneratorDataset:
    """Batches from ``generator_fn()``, called anew on every ``iter()`` (one epoch each).

    Built by `from_generator`.
    """

    def __init__(self, generator_fn: Callable[[], Iterable[Any]]) -> None:
        self.generator_fn = generator_fn

    def __iter__(self) -> Iterator[Any]:
        made = self.generator_fn()
        if not isinstance(made, Iterable):
            name = getattr(self.generator_fn, "__name__", repr(self.generator_fn))
            raise TypeError(
                f"jaxdist.data.from_generator: generator_fn {name}() returned a value of type "
                f"{type(made).__name__}, not an iterable of batches. Pass the generator "
                "function itself (from_generator(gen), not from_generator(gen()) or a function "
                "returning one batch)."
            )
        return iter(made)

    def __repr__(self) -> str:
        return f"GeneratorDataset({self.generator_fn!r})"


def from_generator(generator_fn: Callable[[], Iterable[Any]]) -> GeneratorDataset:
    """A re-iterable dataset from a function that returns a new generator of batches.

    A generator object can be iterated once, so a distributed dataset made from
    one has a single epoch. Wrap the generator *function* instead: each epoch
    (each ``iter()``) calls it again and iterates what it returns.

    Args:
        generator_fn: a function of no arguments returning an iterable of
            batches (typically a generator function; use ``functools.partial``
            or a lambda to bind arguments).

    Returns:
        A `GeneratorDataset`: iterable any number of times.

    Example:
        >>> import numpy as np, jaxdist as jd
        >>> def batches():
        ...     for i in range(2):
        ...         yield np.full(4, i)
        >>> ds = jd.data.from_generator(batches)
        >>> [b.tolist() for b in ds], len(list(ds))
        ([[0, 0, 0, 0], [1, 1, 1, 1]], 2)
    """
    if not callable(generator_fn):
        hint = (
            " It is a generator object: pass the generator function (from_generator(gen), not "
            "from_generator(gen()))."
            if isinstance(generator_fn, Iterator)
            else ""
        )
        raise TypeError(
            "jaxdist.data.from_generator: generator_fn must be a callable returning an iterable "
            f"of batches, got a {type(generator_fn).__name__}.{hint}"
        )
    return GeneratorDataset(generator_fn)


class NumpyRows:
    """Rows of in-memory arrays, to be batched (`Strategy.experimental_make_numpy_dataset`,
    TF 1.x's name): ``.batch(n)`` is ``from_arrays(*arrays, batch_size=n)``."""

    def __init__(self, numpy_input: Any) -> None:
        self._input = numpy_input

    def batch(self, batch_size: int, drop_remainder: bool = False) -> ArrayDataset:
        data = self._input
        arrays = data if isinstance(data, tuple) else (data,)
        return from_arrays(*arrays, batch_size=batch_size, drop_remainder=drop_remainder)
