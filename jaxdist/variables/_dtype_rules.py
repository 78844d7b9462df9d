"""Variable dtypes: TF's dtype rules for initial values and exact integer splits (private;
used by `jaxdist.variables`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._dtypes import lossy_cast, numeric
from jaxdist.values.distributed import Mirrored, PerReplica

__all__ = ["fits", "initial_array", "split_sum"]


# TF's dtypes for Python numbers (and lists of them): 32 bits, whatever jax_enable_x64 says.
PYTHON_DEFAULTS = {"b": np.bool_, "i": np.int32, "u": np.int32, "f": np.float32, "c": np.complex64}


def initial_array(value: Any, dtype: Any, where: str) -> Any:
    """The initial value as a strongly typed array (TF's dtype rules)."""
    if hasattr(value, "read_value"):  # a jaxdist.Variable
        value = value.read_value()
    elif isinstance(value, Mirrored):
        value = value.array
    elif isinstance(value, PerReplica):
        raise TypeError(
            f"{where}: initial_value is a PerReplica ({value.shape[0]} per-replica values), "
            "which has no single value to start from. Create the variable with one value "
            "(for an ON_READ variable, zeros) and then give each replica its own copy with "
            "v.assign(per_replica)."
        )
    if hasattr(value, "dtype"):
        src = np.dtype(value.dtype)
        host = None
        if not numeric(src):
            raise TypeError(
                f"{where}: initial_value is an array of dtype {src} (shape "
                f"{np.shape(value)}); a variable holds numbers or bools. Encode the values as "
                "numbers first (for example ids into a vocabulary)."
            )
    else:  # Python numbers or nested lists of them
        host = np.asarray(value)
        if host.dtype.kind not in PYTHON_DEFAULTS:
            raise TypeError(
                f"{where}: initial_value {value!r:.60} is not a number or an array of numbers "
                f"(NumPy reads it as dtype {host.dtype})."
            )
        src = np.dtype(PYTHON_DEFAULTS[host.dtype.kind])
        if host.dtype.kind in "iu" and host.size and not fits(host, np.int32):
            src = np.dtype(np.int64)
            if not jax.config.read("jax_enable_x64"):
                raise OverflowError(
                    f"{where}: initial_value {value!r:.60} does not fit int32 and 64-bit "
                    "types are disabled in JAX; pass dtype= explicitly or enable them with "
                    "jax.config.update('jax_enable_x64', True)."
                )
    if dtype is None:
        target = jax.dtypes.canonicalize_dtype(src)  # float64 is float32 with x64 off
    else:
        try:
            target = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"{where}: dtype={dtype!r} is not a dtype.") from None
        if not numeric(target):
            raise TypeError(
                f"{where}: dtype={dtype!r} ({target}) is not a numeric dtype; a variable holds "
                "numbers or bools (for example dtype='float32' or 'int32')."
            )
        reason = lossy_cast(src, target)
        if reason is not None:
            raise TypeError(
                f"{where}: cannot create a {target} variable from an initial value of dtype "
                f"{src}: {reason}. Convert the value first (for example "
                f"jnp.round(x).astype('{target}')) if that is what you mean."
            )
    arr = jnp.asarray(value if host is None else host, dtype=target)
    return jnp.asarray(arr, dtype=arr.dtype)  # drops a weak type


def fits(x: np.ndarray, dtype: Any) -> bool:
    info = np.iinfo(dtype)
    return bool(int(x.min()) >= info.min and int(x.max()) <= info.max)


def split_sum(value: Any, n: int) -> Any:
    """``n`` copies whose sum is ``value``: ``value / n`` each for inexact dtypes; for
    integers the quotient, plus one (towards ``value``'s sign) on the first ``|remainder|``
    copies, so the sum is exact."""
    if not jnp.issubdtype(value.dtype, jnp.integer):
        return jnp.broadcast_to((value / n).astype(value.dtype), (n, *value.shape))
    sign = jnp.sign(value)
    magnitude = jnp.abs(value)
    first = jnp.arange(n, dtype=value.dtype).reshape((n,) + (1,) * value.ndim)
    extra = (first < magnitude % n).astype(value.dtype)
    return sign * (magnitude // n) + sign * extra
