"""Values that read like an array: conversions and TF's operator overloads, each applied to
the array the value stands for (a variable's `read_value`, a `Mirrored` value's array)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np


def _reading(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[..., Any]:
    """A binary operator method that applies ``op`` to the value's array."""
    if reflected:
        return lambda self, other: op(other, self._array_value())
    return lambda self, other: op(self._array_value(), other)


class ReadsLikeAnArray:
    """Mixin for `jaxdist.Variable` and `jaxdist.Mirrored`: array conversions, arithmetic,
    comparisons and indexing apply to the array the value stands for (`_array_value`)."""

    __slots__ = ()

    if TYPE_CHECKING:

        def read_value(self) -> Any: ...

    def _array_value(self) -> Any:
        """The array the operators apply to: ``read_value()`` (a variable's value);
        `jaxdist.Mirrored`, which has no ``read_value``, returns its array."""
        return self.read_value()

    def __jax_array__(self) -> Any:
        return self._array_value()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self._array_value(), dtype=dtype)

    def __float__(self) -> float:
        return float(self._array_value())

    def __int__(self) -> int:
        return int(self._array_value())

    def __complex__(self) -> complex:
        return complex(self._array_value())

    def __bool__(self) -> bool:
        return bool(self._array_value())

    def __index__(self) -> int:
        return operator.index(self._array_value())

    # Arithmetic reads the value, as tf.Variable and TF's Mirrored do ----------------

    __add__ = _reading(operator.add)
    __radd__ = _reading(operator.add, reflected=True)
    __sub__ = _reading(operator.sub)
    __rsub__ = _reading(operator.sub, reflected=True)
    __mul__ = _reading(operator.mul)
    __rmul__ = _reading(operator.mul, reflected=True)
    __truediv__ = _reading(operator.truediv)
    __rtruediv__ = _reading(operator.truediv, reflected=True)
    __floordiv__ = _reading(operator.floordiv)
    __mod__ = _reading(operator.mod)
    __matmul__ = _reading(operator.matmul)
    __rmatmul__ = _reading(operator.matmul, reflected=True)
    __pow__ = _reading(operator.pow)
    __rpow__ = _reading(operator.pow, reflected=True)
    __lt__ = _reading(operator.lt)
    __le__ = _reading(operator.le)
    __gt__ = _reading(operator.gt)
    __ge__ = _reading(operator.ge)
    __getitem__ = _reading(operator.getitem)

    def __neg__(self) -> Any:
        return -self._array_value()

    def __abs__(self) -> Any:
        return abs(self._array_value())
