"""Saving and restoring strategy-placed state, with tf.distribute's variable semantics
(private module; the names are public through `jaxdist.checkpoint`).

`to_saveable` turns a state pytree into plain host arrays: a mirrored
variable saves its value, an ``ON_READ`` variable its aggregate (the sum of
its copies for ``SUM``; replica 0's copy without an aggregation, as TF does).
`from_saveable` puts saved arrays back into a *template* created under any
strategy (any replica count). `save` / `restore` write and read a directory
with orbax-checkpoint (``pip install jaxdist[checkpoint]``).

Matching and checks. Saved leaves are matched to the template's by their
path (dict keys, attribute names, sequence positions), never by position: a
checkpoint whose keys were renamed, or that lacks or adds entries, raises
`ValueError` naming the paths. Every leaf's shape must equal the template's
(no broadcasting), and its dtype must convert without loss:

- the same dtype, bool into anything, an integer into a wider integer, or
  into a narrower one or a float when every saved value fits exactly;
- a float (or complex) into a wider one, and 64 into 32 bits (``float64`` to
  ``float32``, what JAX itself does while ``jax_enable_x64`` is off);
- never a float into an integer, a complex into a real, anything into bool,
  or a float into a narrower 16-bit type (cast the checkpoint yourself);
- a string only into a string, and nothing else into one.

Reading. An array whose template (a committed array, a `jax.ShapeDtypeStruct`,
a `Mirrored` or `PerReplica` value) asks for the saved shape and dtype in a
placement this process holds whole is read by orbax straight to its devices,
as orbax restores its own checkpoints; the other leaves are read to the host
and converted and placed by the rules above. Either way the bytes are
verified before anything is returned.

Templates without values. A `jax.ShapeDtypeStruct` leaf of the template
stands for an array of that shape and dtype: the restored array goes to the
struct's ``sharding`` when it has one, else where the enclosing scope's
strategy keeps a mirrored variable (replicated on its devices; on the
parameter device of a `CentralStorageStrategy`). A template array that is
not committed to a device gives an uncommitted array, like it.

Random keys. A typed key array (``jax.random.key``) is saved as its key data
(``jax.random.key_data``, ``uint32``) and restored into a template key array
with the template's implementation.

Sharded variables. A `jaxdist.experimental.ShardedVariable` saves its full array (its
shards concatenated along the first axis), so it restores into any number of shards
of the same full shape, or into a plain `Variable` of that shape; a plain variable's
checkpoint restores into a `ShardedVariable` alike.

Replica counts. A variable's checkpoint holds one value, so it restores
under any replica count: ``ON_WRITE`` variables take it; ``ON_READ`` ``SUM``
variables split the total across their copies (exactly for integers:
quotient plus remainder on the first copies), ``MEAN`` and
``ONLY_FIRST_REPLICA`` ones put it in every copy. A raw `PerReplica` leaf
holds one row per replica and has no rule to re-split, so it restores only
into a template with the same replica count.

Checksums. `save` writes ``jaxdist_manifest.json`` beside orbax's files: the
path, dtype, shape and SHA-256 of every saved leaf's bytes (hashed in
threads while orbax writes them). `restore` compares what orbax read back
against it and raises `ValueError` naming the
leaf and the directory on any difference, so a flipped byte in the data
cannot restore silently. The manifest covers the restored *values*, not
orbax's files: a changed byte that alters no restored value (padding, or an
unused field of orbax's metadata) goes unreported, and one that orbax cannot
parse surfaces as orbax's error, wrapped in a `ValueError` naming the
directory. The checksums detect accidents (disk, copy, transfer errors), not
tampering: whoever can rewrite the data can rewrite the manifest.

Example:
    >>> import jax.numpy as jnp, jaxdist as jd
    >>> v = jd.Variable(jnp.arange(3.0))
    >>> saved = jd.checkpoint.to_saveable({"v": v})
    >>> restored = jd.checkpoint.from_saveable(saved, {"v": v.assign(jnp.zeros(3))})
    >>> [float(x) for x in restored["v"].read_value()]
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._dtypes import lossy_cast, numeric
from jaxdist._scope import get_strategy
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import ShardedVariable, Variable
from jaxdist.variables.meta import mirrored_sharding

__all__ = [
    "Placed",
    "from_saveable",
    "host_copy",
    "indexed",
    "is_key",
    "is_saved_node",
    "listed",
    "path_tokens",
    "restore_tree",
    "show",
    "to_saveable",
]

_LIST_AT_MOST = 5


def is_saved_node(x: Any) -> bool:
    """Leaves of a saved tree that are saved as one value each: variables (a sharded one as
    its full array), distributed values."""
    return isinstance(x, (Variable, ShardedVariable, DistributedValues))


def is_key(x: Any) -> bool:
    """True for a typed random key array (or a struct of one)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _saved_value(x: Any) -> Any:
    if isinstance(x, (Variable, ShardedVariable)):
        return np.asarray(x.checkpoint_value())
    if isinstance(x, DistributedValues):
        return np.asarray(x.array)
    if isinstance(x, jax.Array) and is_key(x):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _owned_value(x: Any) -> np.ndarray:
    """`_saved_value` that nothing can change while it is written.

    The value of a JAX array (or of a variable or distributed value, which hold JAX
    arrays) is taken as `_saved_value` gives it: a host copy from an accelerator, or
    on the CPU backend a read-only view of the device buffer, which the view keeps
    alive (JAX arrays are immutable, and the runtime does not donate a buffer that a
    host view refers to: a donating step gets a new buffer instead). Any other leaf
    (a NumPy array the caller may change in place) is copied.
    """
    value = _saved_value(x)
    if isinstance(x, jax.Array) or is_saved_node(x):
        return value
    return np.array(value, copy=True)


def to_saveable(state: Any) -> Any:
    """The pytree ``state`` with every leaf as a host NumPy array, variables aggregated.

    Args:
        state: a pytree of arrays, `Variable` and `DistributedValues` leaves.

    Returns:
        The same structure with NumPy arrays at the leaves. They may share memory
        with the state (on the CPU backend a host array is a view of the device
        buffer); `host_copy` gives values that nothing can change.
    """
    return jax.tree.map(_saved_value, state, is_leaf=is_saved_node)


def host_copy(state: Any) -> Any:
    """`to_saveable` with values nothing can change (see `_owned_value`): the state may be
    changed, and its buffers donated, while they are written. The caller stalls for the
    copies to the host (none on the CPU backend) and of its NumPy leaves."""
    return jax.tree.map(_owned_value, state, is_leaf=is_saved_node)


# Paths ------------------------------------------------------------------------------


def path_tokens(path: Sequence[Any]) -> tuple[str, ...]:
    """A key path as names, the same for a dict key, an attribute or a position (orbax
    restores tuples as lists and custom nodes as dicts)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def show(tokens: Sequence[str]) -> str:
    """A path's names as an error message shows them: ``['w'][0]``, or ``<root>``."""
    if not tokens:
        return "<root>"
    return "".join(f"[{t}]" if t.isdigit() else f"[{t!r}]" for t in tokens)


def listed(paths: Sequence[tuple[str, ...]]) -> str:
    """The first few paths as `show` writes them, and how many more there are."""
    shown = ", ".join(show(p) for p in paths[:_LIST_AT_MOST])
    more = len(paths) - _LIST_AT_MOST
    return shown + (f" and {more} more" if more > 0 else "")


def indexed(where: str, tree: Any) -> dict[tuple[str, ...], Any]:
    """The leaves of a saved tree by path."""
    out: dict[tuple[str, ...], Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_saved_node)[0]:
        key = path_tokens(path)
        if key in out:
            raise ValueError(
                f"{where}: the saved state has two entries named {show(key)} (for example the "
                "dict keys 0 and '0'); give them distinct names."
            )
        out[key] = leaf
    return out


# Checks -----------------------------------------------------------------------------


def _cast_problem(x: np.ndarray, dst: Any) -> str | None:
    """Why the saved array ``x`` does not convert to ``dst`` without loss, or None."""
    src, dst = x.dtype, np.dtype(dst)
    if src == dst:
        return None
    reason = lossy_cast(src, dst)
    if reason is not None or src == np.bool_:
        return reason
    if jnp.issubdtype(src, jnp.integer):
        if not x.size:
            return None
        low, high = int(x.min()), int(x.max())
        if jnp.issubdtype(dst, jnp.integer):
            info = np.iinfo(dst)
            ok = info.min <= low and high <= info.max
            return None if ok else f"its values in [{low}, {high}] do not fit {dst}"
        exact = 2 ** (jnp.finfo(dst).nmant + 1)
        if max(-low, high) <= exact:
            return None
        return f"integers beyond +-{exact} are not exact in {dst}"
    if not jnp.issubdtype(src, jnp.inexact):
        return f"jaxdist does not convert {src} to {dst}"
    try:
        widening = jnp.promote_types(src, dst) == dst
    except jax.dtypes.TypePromotionError:  # no promotion path: float8_e4m3fn, float8_e5m2
        widening = False
    if widening:
        return None
    if jnp.finfo(src).bits == 64 and jnp.finfo(dst).bits == 32:
        return None  # 64 into 32 bits, as JAX does with jax_enable_x64 off
    return f"{src} to {dst} loses precision"


def _check_leaf(
    where: str, name: str, saved: np.ndarray, shape: tuple[int, ...], dtype: Any, what: str
) -> None:
    if tuple(saved.shape) != tuple(shape):
        hint = ""
        if saved.ndim == len(shape) + 1 and tuple(saved.shape[1:]) == tuple(shape):
            hint = (
                f" It looks like {saved.shape[0]} per-replica copies: save the variable "
                "itself (to_saveable stores one aggregated value), not its device_values."
            )
        raise ValueError(
            f"{where}: {name} has shape {tuple(saved.shape)} in the checkpoint, but {what} "
            f"has shape {tuple(shape)}.{hint} Restore into a template built like the state "
            "that was saved (same model and sizes)."
        )
    problem = _cast_problem(saved, dtype)
    if problem is not None and not numeric(saved.dtype):
        raise ValueError(
            f"{where}: {name} is an array of dtype {saved.dtype} in the checkpoint, but {what} "
            f"is {np.dtype(dtype)}: {problem}. Restore into a template built like the state "
            "that was saved."
        )
    if problem is not None:
        raise ValueError(
            f"{where}: {name} is {saved.dtype} in the checkpoint, but {what} is "
            f"{np.dtype(dtype)}: {problem}. Convert the checkpoint's value yourself if that is "
            f"what you want (e.g. saved[...] = np.round(x).astype('{np.dtype(dtype)}')), or "
            f"restore into a template of dtype {saved.dtype}."
        )


def _restore_leaf(where: str, name: str, saved: Any, t: Any) -> Any:
    s = np.asarray(saved)
    if isinstance(t, (Variable, ShardedVariable)):
        what = "variable" if isinstance(t, Variable) else "sharded variable"
        _check_leaf(where, name, s, t.shape, t.dtype, f"{what} {t.name!r}")
        return t.restored(s)
    if isinstance(t, PerReplica):
        n, rows = t.shape[0], s.shape[0] if s.ndim else 0
        if rows != n and s.ndim == len(t.shape) and s.shape[1:] == t.shape[1:]:
            raise ValueError(
                f"{where}: {name} holds {rows} per-replica values (shape {s.shape}) in the "
                f"checkpoint, but the template's PerReplica has {n} replicas (shape "
                f"{t.shape}). Per-replica values carry no rule to re-split them between "
                f"replica counts: restore under a strategy with {rows} replicas, or keep such "
                "state in an ON_READ jd.Variable (SUM / MEAN restore under any count), or save "
                "an aggregate (strategy.reduce)."
            )
        _check_leaf(where, name, s, t.shape, t.dtype, "the template's PerReplica")
        return _Put(s.astype(t.dtype, copy=False), t.array.sharding, PerReplica)
    if isinstance(t, Mirrored):
        _check_leaf(where, name, s, t.shape, t.dtype, "the template's Mirrored value")
        return _Put(s.astype(t.dtype, copy=False), t.array.sharding, Mirrored)
    if isinstance(t, jax.Array) and is_key(t):
        data = jax.random.key_data(t)
        _check_leaf(where, name, s, data.shape, data.dtype, "the template's random key data")
        impl = jax.random.key_impl(t)
        return _put_like(
            s.astype(data.dtype, copy=False),
            data,
            lambda placed: jax.random.wrap_key_data(placed, impl=impl),
        )
    if isinstance(t, jax.Array):
        _check_leaf(where, name, s, t.shape, t.dtype, "the template's array")
        return _put_like(s.astype(t.dtype, copy=False), t)
    if isinstance(t, jax.ShapeDtypeStruct):
        return _restore_struct(where, name, s, t)
    if isinstance(t, (np.ndarray, np.generic)):
        _check_leaf(where, name, s, t.shape, t.dtype, "the template's array")
        return s.astype(t.dtype) if isinstance(t, np.ndarray) else t.dtype.type(s)
    if isinstance(t, (bool, int, float, complex)):
        _check_leaf(where, name, s, (), np.asarray(t).dtype, f"the template's {type(t).__name__}")
        return type(t)(s.item())
    if isinstance(t, str):
        if s.ndim or s.dtype.kind not in "US":
            raise ValueError(
                f"{where}: {name} is an array of dtype {s.dtype} and shape {s.shape} in the "
                f"checkpoint, but the template has the string {t!r:.40} there. Restore into a "
                "template built like the state that was saved."
            )
        return s.item() if s.dtype.kind == "U" else s.item().decode()
    return saved  # not an array or a string: kept as saved


@dataclasses.dataclass(frozen=True)
class Placed:
    """A saved leaf that orbax read straight into its template's placement (see
    `jaxdist.checkpoint._storage`); `from_saveable`'s rules pass it through."""

    array: jax.Array


@dataclasses.dataclass(frozen=True)
class _Put:
    """A host array to place on ``sharding`` (None: uncommitted), then pass to ``finish``;
    `restore_tree` places all of them in one batched transfer."""

    value: np.ndarray
    sharding: Any
    finish: Callable[[jax.Array], Any] | None = None


def _put_like(
    x: np.ndarray, template: jax.Array, finish: Callable[[jax.Array], Any] | None = None
) -> _Put:
    """``x`` to be placed like ``template``: on its sharding, or uncommitted like it."""
    sharding = template.sharding if getattr(template, "committed", True) else None
    return _Put(x, sharding, finish)


def _place(values: list[Any]) -> list[Any]:
    """``values`` with every `_Put` placed: those with a sharding in one batched
    ``jax.device_put`` (faster than one call per leaf), the uncommitted ones alone."""
    puts = [i for i, v in enumerate(values) if isinstance(v, _Put) and v.sharding is not None]
    placed = dict(
        zip(
            puts,
            jax.device_put([values[i].value for i in puts], [values[i].sharding for i in puts]),
            strict=True,
        )
    )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, _Put):
            x = placed[i] if i in placed else jax.device_put(v.value)
            v = x if v.finish is None else v.finish(x)
        out.append(v)
    return out


def _restore_struct(where: str, name: str, s: np.ndarray, t: jax.ShapeDtypeStruct) -> Any:
    """A saved array for a `jax.ShapeDtypeStruct` leaf: on its sharding, or mirrored on the
    enclosing scope's strategy."""
    if is_key(t):
        raise ValueError(
            f"{where}: {name} is a jax.ShapeDtypeStruct of the random key dtype {t.dtype}; "
            "its key implementation cannot be read from a struct. Give a key array there "
            "(e.g. jax.random.key(0)), whose implementation the restored key takes."
        )
    _check_leaf(where, name, s, t.shape, t.dtype, "the template's jax.ShapeDtypeStruct")
    sharding = t.sharding if t.sharding is not None else mirrored_sharding(get_strategy())
    return _Put(s.astype(t.dtype, copy=False), sharding)


def _placed(saved: Placed, t: Any) -> Any:
    """A leaf orbax read into the template's placement (`_direct_sharding`'s cases)."""
    if isinstance(t, (Mirrored, PerReplica)):
        return type(t)(saved.array)
    return saved.array


def restore_tree(where: str, saved: Any, template: Any) -> Any:
    """`from_saveable` for the caller ``where``: also takes `Placed` leaves (see `_storage`)."""
    leaves = indexed(where, saved)
    t_flat, t_def = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_saved_node)
    t_keys = [path_tokens(path) for path, _ in t_flat]
    known = set(t_keys)
    missing = [k for k in t_keys if k not in leaves]
    extra = [k for k in leaves if k not in known]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the template has {listed(missing)}, which the checkpoint lacks")
        if extra:
            parts.append(f"the checkpoint has {listed(extra)}, which the template lacks")
        raise ValueError(
            f"{where}: the checkpoint does not match the template: {'; '.join(parts)}. "
            "Leaves are matched by path (dict keys, attribute names, positions), not by "
            "order. Build the template with the names of the state that was saved, or rename "
            "the saved entries first (e.g. saved['new'] = saved.pop('old'))."
        )
    out = [
        _placed(leaves[k], t)
        if isinstance(leaves[k], Placed)
        else _restore_leaf(where, show(k), _saved_value(leaves[k]), t)
        for k, (_, t) in zip(t_keys, t_flat, strict=True)
    ]
    return jax.tree.unflatten(t_def, _place(out))


def from_saveable(saved: Any, template: Any) -> Any:
    """Puts ``saved`` (from `to_saveable`) into the placement of ``template``.

    Args:
        saved: a pytree of arrays, as `to_saveable` returned it (or a reader of
            its storage; tuples may come back as lists, objects as dicts).
        template: the state to restore into, with the structure and names of
            the saved state; its variables (created in the target strategy's
            scope) give synchronization, aggregation and placement, its other
            leaves shape, dtype and placement (a `jax.ShapeDtypeStruct` leaf:
            its sharding, or mirrored on the enclosing scope's strategy).

    Returns:
        ``template`` with the saved values.

    Raises:
        ValueError: a path missing on either side, a shape that differs, a
            lossy dtype conversion, or a `PerReplica` saved under another
            replica count (see the module docstring).
    """
    return restore_tree("jaxdist.checkpoint.from_saveable", saved, template)
