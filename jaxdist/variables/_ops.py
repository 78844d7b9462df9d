"""Reading a variable like an array: conversions and tf.Variable's operator
overloads, each applied to the variable's value (`read_value`)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np


def _reading(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[..., Any]:
    """A binary operator method that applies ``op`` to the variable's value."""
    if reflected:
        return lambda self, other: op(other, self.read_value())
    return lambda self, other: op(self.read_value(), other)


class ReadsLikeAnArray:
    """Mixin for `jaxdist.Variable`: array conversions and arithmetic read the value."""

    __slots__ = ()

    def read_value(self) -> Any:
        raise NotImplementedError

    def __jax_array__(self) -> Any:
        return self.read_value()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.read_value(), dtype=dtype)

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())

    def __complex__(self) -> complex:
        return complex(self.read_value())

    def __bool__(self) -> bool:
        return bool(self.read_value())

    def __index__(self) -> int:
        return operator.index(self.read_value())

    # Arithmetic reads the value, as tf.Variable does -------------------------------

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
        return -self.read_value()

    def __abs__(self) -> Any:
        return abs(self.read_value())
