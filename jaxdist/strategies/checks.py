"""Argument checks and error messages of `Strategy`: the mesh layout, numeric
cross-replica values, MAX/MIN of empty values, per-replica value counts, and `run`
nested where it cannot run."""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._dtypes import numeric
from jaxdist._protocols import StrategyLike
from jaxdist.values.distributed import DistributedValues, PerReplica
from jaxdist.values.reduce_op import ReduceOp
from jaxdist.variables import is_distributed


def check_mesh(
    name: str, count: int, mesh_shape: Any, axis_names: Any
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``mesh_shape`` and ``axis_names`` checked against ``count`` devices (private)."""
    where = f"{name}(mesh_shape={mesh_shape!r}, axis_names={axis_names!r})"
    if isinstance(axis_names, str):
        axis_names = (axis_names,)
    if (
        not isinstance(axis_names, (tuple, list))
        or not axis_names
        or not all(isinstance(a, str) and a for a in axis_names)
        or len(set(axis_names)) != len(axis_names)
    ):
        raise ValueError(
            f"{where}: axis_names must be a non-empty tuple of distinct mesh axis names, "
            "outermost first, e.g. ('host', 'local')."
        )
    names = tuple(axis_names)
    if len(names) == 1:
        example: tuple[int, ...] = (count,)
    elif len(names) == 2 and count % 2 == 0:
        example = (2, count // 2)
    else:
        example = (count,) + (1,) * (len(names) - 1)
    if mesh_shape is None:
        if len(names) != 1:
            raise ValueError(
                f"{where}: {len(names)} axis names need a mesh_shape with one size per name "
                f"whose product is the number of devices ({count}), e.g. mesh_shape={example}."
            )
        return (count,), names
    shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else None
    if (
        shape is None
        or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in shape)
        or len(shape) != len(names)
        or int(np.prod(shape)) != count
    ):
        raise ValueError(
            f"{where}: mesh_shape must give one positive size per axis name {names} whose "
            f"product is the number of devices ({count}), e.g. mesh_shape={example}."
        )
    return shape, names


def check_numeric(strategy: StrategyLike, where: str, value: Any, root: str = "value") -> None:
    """Cross-replica values must be numeric arrays: name every leaf that is not."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(value, is_leaf=is_distributed)[0]:
        arr = leaf.array if isinstance(leaf, DistributedValues) else leaf
        if isinstance(arr, (np.ndarray, np.generic)) and not numeric(arr.dtype):
            found.append(
                f"{root}{jax.tree_util.keystr(path)} is an array of dtype {arr.dtype} "
                f"(shape {arr.shape})"
            )
    if found:
        raise TypeError(
            f"{where}: {'; '.join(found)}; only numeric and bool arrays live on the devices of "
            f"mesh {dict(strategy.mesh.shape)}. Encode them as numbers, or keep them out of "
            "the value."
        )


def check_not_empty(where: str, op: ReduceOp, leaves: Sequence[Any], axis: int | None) -> None:
    """MAX/MIN along an empty axis has no identity element: say so before XLA does."""
    if axis is None:
        return
    for x in leaves:
        arr = x.array if isinstance(x, DistributedValues) else x
        shape = tuple(np.shape(arr))
        per = shape[1:] if isinstance(x, PerReplica) else shape
        if per and -len(per) <= axis < len(per) and per[axis] == 0:
            raise ValueError(
                f"{where}: cannot take the {op.name} along axis {axis} of per-replica values of "
                f"shape {per}: the axis is empty and {op.name} has no identity element. Skip "
                "empty values, or reduce with SUM."
            )


def nested_run_error(name: str, merging: bool) -> RuntimeError:
    """The error for `run` called inside a replica function or a merge_fn."""
    if merging:
        return RuntimeError(
            f"{name}.run was called inside a merge_fn (ReplicaContext.merge_call). A "
            "merge_fn runs once, in cross-replica context, while the replica function is "
            "being traced; it cannot start another replicated computation. Reduce or "
            "gather its arguments there (strategy.reduce, strategy.gather) and return "
            "the result, or call run after the outer run returns."
        )
    return RuntimeError(
        f"{name}.run was called inside a replica function, where only the replica "
        "context's collectives apply. Inside the function use ctx.all_reduce / "
        f"ctx.all_gather, or call {name}.run on the outer function's outputs after "
        "run returns."
    )


def check_counts(strategy: StrategyLike, where: str, leaves: Sequence[Any]) -> None:
    """Every `PerReplica` leaf must have one row per replica of ``strategy``."""
    n = strategy.num_replicas_in_sync
    for x in leaves:
        if isinstance(x, PerReplica):
            rows = x.array.shape[0] if np.ndim(x.array) else 0
            if rows != n:
                raise ValueError(
                    f"{where}: a PerReplica value has {rows} per-replica values (shape "
                    f"{tuple(np.shape(x.array))}) but {strategy!r} has {n} replicas. Use the "
                    "strategy that produced it, or build it for this one "
                    "(experimental_distribute_values_from_function)."
                )


def ordered_pairs(value: Any, arg: str, where: str, example: str) -> tuple[Any, ...]:
    """``value`` (an argument of ordered rule pairs, the first match winning) as a tuple;
    a string, a dict or a non-sequence is a ``TypeError`` that says so (private)."""
    if isinstance(value, (str, bytes, dict)):
        if isinstance(value, dict):
            kind, example = "a dict", f"tuple({value!r:.40}.items())"
        else:
            kind = f"a {type(value).__name__} ({value!r:.40})"
        raise TypeError(
            f"{where}({arg}=...): expected a sequence of pairs, got {kind}: {arg} are "
            f"ordered (the first match wins), so give them as a tuple of pairs, e.g. "
            f"{arg}={example}."
        )
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(
            f"{where}({arg}=...): expected a sequence of pairs, got {type(value).__name__}; "
            f"e.g. {arg}={example}."
        ) from None


def check_min_shard_bytes(value: Any, where: str) -> int:
    """``min_shard_bytes`` of a sharded strategy: a non-negative int (private)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"{where}(min_shard_bytes=...): expected a non-negative int, got {value!r}."
        )
    return int(value)


def check_fraction(value: Any, where: str) -> float | None:
    """``max_replicated_fraction`` of a sharded strategy: ``None`` or in [0, 1] (private)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) <= 1:
        raise ValueError(
            f"{where}(max_replicated_fraction=...): expected a fraction in [0, 1] or None, "
            f"got {value!r}; e.g. 0.02."
        )
    return float(value)


def check_regex(pattern: str, label: str, where: str) -> None:
    """A rule's regex must compile: a ``ValueError`` naming ``label`` (``rules[2]``)."""
    try:
        re.compile(pattern)
    except re.error as err:
        arg = label.split("[")[0]
        raise ValueError(
            f"{where}({arg}=...): {label} has an invalid regex {pattern!r}: {err}."
        ) from None
