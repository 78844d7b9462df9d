"""The non-finite check of saved state: a checkpoint of NaN or infinite values
is refused unless the caller allows it (``allow_nonfinite=True``), so a diverged run does
not replace its last good checkpoints with a dead state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["nonfinite_leaves", "refuse_nonfinite"]


def nonfinite_leaves(tree: Any) -> list[tuple[str, int, int]]:
    """(path, non-finite count, size) of every floating leaf of a host tree (NumPy arrays,
    as `to_saveable` gives) that holds a NaN or an infinity, in tree order. Every floating
    dtype JAX has counts, bfloat16 and the float8 types included (NumPy files those under
    kind ``V``)."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.asarray(leaf)
        if _inexact(x.dtype) and x.size and not np.isfinite(x).all():
            bad = int(x.size - np.count_nonzero(np.isfinite(x)))
            found.append((jax.tree_util.keystr(path), bad, int(x.size)))
    return found


def _inexact(dtype: np.dtype) -> bool:
    if dtype.kind in "fc":
        return True
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))  # bfloat16, float8_*: kind "V"
    except TypeError:  # a structured or other non-numeric dtype
        return False


def refuse_nonfinite(where: str, tree: Any, what: str = "the state") -> None:
    """Raises ``ValueError`` naming the first leaves of ``tree`` that are not finite."""
    found = nonfinite_leaves(tree)
    if not found:
        return
    listed = ", ".join(f"{p} ({bad} of {size} values)" for p, bad, size in found[:3])
    more = f" and {len(found) - 3} more arrays" if len(found) > 3 else ""
    raise ValueError(
        f"{where}: {what} holds NaN or infinite values: {listed}{more}. Refusing to save it "
        "(a diverged run would replace its last good checkpoints). Find the step where the "
        "loss became non-finite (jd.training.TerminateOnNaN() stops fit there), or pass "
        "allow_nonfinite=True to save it anyway."
    )
