"""Which dtypes a jaxdist value may have, and which casts lose information (the
bottom layer: used by values, input, variables and checkpoints)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["lossy_cast", "numeric"]


def lossy_cast(src: Any, dst: Any) -> str | None:
    """Why converting dtype ``src`` to ``dst`` loses information by kind, or None (private)."""
    src, dst = np.dtype(src), np.dtype(dst)
    for d in (src, dst):
        if not numeric(d):
            return f"{d} is not a numeric dtype, and JAX arrays hold only numbers and bools"
    if src == dst or src == np.bool_:
        return None
    if dst == np.bool_:
        return "a cast to bool keeps only zero / non-zero"
    inexact = jnp.issubdtype(src, jnp.inexact)
    if jnp.issubdtype(dst, jnp.integer) and inexact:
        return "a cast from floating point to an integer drops the fraction"
    if jnp.issubdtype(dst, jnp.floating) and jnp.issubdtype(src, jnp.complexfloating):
        return "a cast from complex to real drops the imaginary part"
    return None


def numeric(dtype: Any) -> bool:
    """Whether JAX arrays can have ``dtype``: numbers (bfloat16 and friends too) and bool."""
    dtype = np.dtype(dtype)
    return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))
