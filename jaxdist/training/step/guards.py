"""Checks a `jaxdist.train_step` makes so that training cannot go silently wrong.

`train_step` (in `jaxdist.training.step`) calls these at a few points; every check runs
when a step is traced or when its argument structure is new (the slow path), never on the
per-call fast path:

- `StateGuard`: NNX parameters (``nnx.Param``) and optimizer state (``nnx.OptState``) must
  come back the same on every replica. Per-replica ones mean the gradients were not
  all-reduced (the step would otherwise average the replicas' parameters: training at
  ``lr / N``), so they raise; other NNX state that differs (BatchNorm statistics) is
  averaged. A step that does not write state back (``update_state=False``, used by
  `jaxdist.fit` for evaluation) must not update parameters or optimizer state at all.
- `check_call`: a step function that does not take the replica context first, and a batch
  of Python lists, are explained before tracing.
- `check_outputs`: an output that is not an array (a string, an object) names the user's
  function and its file.
- `warn_host_batch`: a host NumPy batch is broadcast whole to every replica; warned once
  per step function.
- `check_devices`: NNX state that an earlier step of another strategy placed on other
  devices is refused with the way to move it, not moved (or failed on) silently.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.errors import ReplicaDivergenceError
from jaxdist.training.step.nnx import is_nnx_node, nnx_module
from jaxdist.values.distributed import DistributedValues, PerReplica

__all__ = [
    "HostBatchWarning",
    "StateGuard",
    "check_call",
    "check_devices",
    "check_outputs",
    "function_label",
    "object_labels",
    "warn_host_batch",
]

_FIX = (
    "All-reduce the gradients before the update: `grads = ctx.all_reduce('sum', grads)` "
    "(with the loss from jd.compute_average_loss), then `opt.update(model, grads)`"
)


def function_label(fn: Callable[..., Any]) -> str:
    """``step (train.py:12)``: the user's function with its file and first line."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return str(name)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    """The names of the parameters of ``fn(ctx, *args)`` after ``ctx``, while positional."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    names = []
    for p in params:
        if p.kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            break
        names.append(p.name)
    return names


def _arg_path(path: Sequence[Any], fn: Callable[..., Any]) -> tuple[str, str]:
    """(``args[2]['x']`` / ``kwargs['lr']``, the parameter's name path ``batch['x']``) for
    a key path into ``(args, kwargs)``."""
    if len(path) < 2:
        return "args", "args"
    rest = jax.tree_util.keystr(tuple(path[2:]))
    if getattr(path[0], "idx", None) == 1:
        key = str(getattr(path[1], "key", "?"))
        return f"kwargs[{key!r}]{rest}", f"{key}{rest}"
    index = int(getattr(path[1], "idx", 0))
    names = _positional_names(fn)
    name = names[index] if index < len(names) else f"args[{index}]"
    return f"args[{index}]{rest}", f"{name}{rest}"


def object_labels(
    fn: Callable[..., Any], objects: Sequence[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, str]]:
    """For each NNX argument object: (its argument path, its parameter name path)."""
    flat = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_nnx_node)[0]
    where = {id(leaf): path for path, leaf in flat if is_nnx_node(leaf)}
    return [
        _arg_path(where[id(o)], fn) if id(o) in where else (f"object {i}", f"object {i}")
        for i, o in enumerate(objects)
    ]


# NNX state written back --------------------------------------------------------------


class StateGuard:
    """Which NNX variables of one `StateCache` must come back the same on every replica,
    and the names to give them in errors."""

    __slots__ = ("labels", "paths", "strict", "types", "where")

    def __init__(
        self,
        variables: Sequence[Any],
        paths: Sequence[str],
        labels: Sequence[tuple[str, str]],
        where: str,
    ) -> None:
        nnx = nnx_module()
        assert nnx is not None
        kinds = (nnx.Param, nnx.OptState)
        self.strict = [isinstance(v, kinds) for v in variables]
        self.types = [type(v).__name__ for v in variables]
        self.paths = list(paths)  # "0.layer.kernel": object index, then the path inside
        self.labels = list(labels)
        self.where = where

    def name(self, i: int) -> str:
        """```model.l1.kernel``` (args[0].l1.kernel, nnx.Param) for variable ``i``."""
        head, _, rest = self.paths[i].partition(".")
        arg, name = (
            self.labels[int(head)]
            if head.isdigit() and int(head) < len(self.labels)
            else (
                head,
                head,
            )
        )
        inner = f".{rest}" if rest else ""
        return f"`{name}{inner}` ({arg}{inner}, nnx.{self.types[i]})"

    def output(self, i: int, value: Any, synced: Callable[[Any, str], Any], n: int) -> Any:
        """The output leaf for variable ``i``: parameters and optimizer state (with several
        replicas) as plain arrays, which come back `PerReplica` when they differ (see
        `check`); other state as ``synced(value, what)`` (averaged when it differs)."""
        if self.strict[i] and n > 1:
            return value
        return synced(value, f"NNX variable {self.paths[i]}")

    def check(self, outputs: Sequence[Any]) -> None:
        """Raises (while the step is traced, before it runs) when parameters or optimizer
        state came back different per replica."""
        bad = [i for i, x in enumerate(outputs) if self.strict[i] and isinstance(x, PerReplica)]
        if not bad:
            return
        more = f" (and {len(bad) - 1} more: {', '.join(self.name(i) for i in bad[1:4])})"
        raise ReplicaDivergenceError(
            f"{self.where}: {self.name(bad[0])} differs between replicas after the step"
            f"{more if len(bad) > 1 else ''}. Parameters and optimizer state must stay one "
            "replicated copy: this step updated them from per-replica values (gradients of "
            "each replica's own batch), and averaging the replicas' parameters would train at "
            f"the learning rate divided by the number of replicas. {_FIX}. (State that may "
            "differ, such as BatchNorm statistics, is averaged across replicas.) Nothing was "
            "written back."
        )

    def check_unchanged(self, new: Sequence[Any], entered: Sequence[Any]) -> None:
        """For a step that writes no state back: raises when it updated parameters or
        optimizer state (e.g. a training step given as `fit`'s ``eval_step``)."""
        bad = [i for i, s in enumerate(self.strict) if s and new[i] is not entered[i]]
        if not bad:
            return
        raise ValueError(
            f"{self.where}: the step updates {self.name(bad[0])}"
            f"{f' and {len(bad) - 1} more parameter(s) or optimizer state' if len(bad) > 1 else ''}"
            ", but it runs with update_state=False (as jd.fit runs eval_step): an evaluation "
            "step must not train. Give fit an eval_step that computes metrics only (no "
            "opt.update), not the training step."
        )


# Arguments and outputs ------------------------------------------------------------------


_CONTEXT_NAMES = frozenset({"ctx", "context", "replica_context", "replica_ctx", "rctx"})
"""First-parameter names that say a step function takes the replica context: a call that
does not fit such a function has wrong arguments, not a missing context."""


def check_call(
    fn: Callable[..., Any], where: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Explains, before tracing, a step function that does not take the replica context
    first and a batch given as Python lists (both cost pages of traceback otherwise)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(None, *args, **kwargs)
        except TypeError as e:
            name = getattr(fn, "__name__", "fn")
            first = next(iter(sig.parameters), "")
            try:
                if first in _CONTEXT_NAMES:  # it takes the context: the call is what is wrong
                    raise TypeError(str(e))
                sig.bind(*args, **kwargs)
            except TypeError:
                raise TypeError(
                    f"{where}: cannot call {function_label(fn)} as {name}(ctx, "
                    f"<{len(args)} positional argument(s)>"
                    f"{', ' + ', '.join(f'{k}=...' for k in kwargs) if kwargs else ''}): {e}. A "
                    "train step is called with the step's arguments, and the function gets "
                    "the ReplicaContext first."
                ) from None
            params = ", ".join(["ctx", *sig.parameters])
            raise TypeError(
                f"{where}: {function_label(fn)}{sig} does not take the replica context. "
                "jaxdist passes the ReplicaContext as the first argument (TF's "
                f"get_replica_context() made explicit); write it as `def {name}({params}): "
                "...` and all-reduce with ctx.all_reduce inside."
            ) from None
    flat = jax.tree_util.tree_flatten_with_path(
        (args, kwargs), is_leaf=lambda x: is_nnx_node(x) or _is_number_list(x)
    )[0]
    for path, leaf in flat:
        if _is_number_list(leaf):
            arg, name = _arg_path(path, fn)
            shape = np.shape(leaf) if _rectangular(leaf) else "ragged"
            raise TypeError(
                f"{where}: argument `{name}` ({arg}) is a Python list of numbers (shape "
                f"{shape}); each number would enter the step as its own scalar. Pass NumPy or "
                f"JAX arrays: `np.asarray({name.split('[')[0]})` (or distribute the batch with "
                "strategy.experimental_distribute_dataset)."
            )


def _is_number_list(x: Any) -> bool:
    if not isinstance(x, list) or not x:
        return False
    return all(
        _is_number_list(v) or (isinstance(v, (int, float, complex)) and not isinstance(v, bool))
        for v in x
    )


def _rectangular(x: Any) -> bool:
    try:
        np.asarray(x, dtype=float)
    except ValueError:
        return False
    return True


_OK_OUT = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def check_outputs(fn: Callable[..., Any], where: str, out: Any, ok: tuple[type, ...]) -> None:
    """Raises when the step returned something that is not an array (nor a number, nor one
    of the ``ok`` types), naming the user's function and the output's path."""
    flat = jax.tree_util.tree_flatten_with_path(out, is_leaf=lambda x: isinstance(x, ok))[0]
    for path, leaf in flat:
        if not isinstance(leaf, (*_OK_OUT, *ok)):
            at = f"output{jax.tree_util.keystr(tuple(path))}" if path else "its output"
            raise TypeError(
                f"{where}: {function_label(fn)} returned a {type(leaf).__name__} "
                f"({leaf!r:.60}) at {at}; a train step returns arrays (metrics, new state) "
                "in any pytree (dict, tuple). Return the value as an array, or keep "
                "non-array values out of the step."
            )


# Host batches ---------------------------------------------------------------------------


class HostBatchWarning(UserWarning):
    """A host NumPy array was broadcast whole to every replica of a train step."""


def warn_host_batch(
    fn: Callable[..., Any],
    where: str,
    n: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    """Warns when an argument is a host NumPy array (not 0-d) and the step has several
    replicas: every replica then gets the whole array. Returns True when it warned."""
    if n <= 1:
        return False
    flat = jax.tree_util.tree_flatten_with_path(
        (args, kwargs), is_leaf=lambda x: is_nnx_node(x) or isinstance(x, DistributedValues)
    )[0]
    for path, leaf in flat:
        if isinstance(leaf, np.ndarray) and leaf.ndim >= 1:
            arg, name = _arg_path(path, fn)
            warnings.warn(
                f"{where}: argument `{name}` ({arg}) is a host NumPy array of shape "
                f"{leaf.shape}: it is broadcast, so each of the {n} replicas computes on the "
                "whole of it (no data parallelism, the same work done "
                f"{n} times). Split a batch across replicas with "
                "strategy.experimental_distribute_dataset(data) (or jd.fit(..., data=...)), "
                "or build a PerReplica with "
                "strategy.experimental_distribute_values_from_function. To send a constant "
                "to every replica on purpose, pass it as a jax.Array (jnp.asarray). Warned "
                "once per step function.",
                HostBatchWarning,
                stacklevel=4,
            )
            return True
    return False


# Placement ------------------------------------------------------------------------------


def check_devices(
    where: str,
    strategy: Any,
    values: Sequence[Any],
    paths: Sequence[str],
    labels: Callable[[], Sequence[tuple[str, str]]],
) -> None:
    """Raises when NNX state is committed to other devices than the step's strategy places
    it on (an earlier step of another strategy put it there): it is not moved silently, as
    a `jaxdist.Variable` of one strategy is refused by another. ``labels`` names the
    argument objects (computed only for the error)."""
    if strategy.parameter_placed:
        target: set[Any] = {strategy.parameter_device}
    else:
        target = set(strategy.replicated_sharding.device_set)
    for i, value in enumerate(values):
        if not (isinstance(value, jax.Array) and value.committed):
            continue
        devices: set[Any] = set(value.sharding.device_set)
        if devices == target:
            continue
        head, _, rest = paths[i].partition(".")
        named = list(labels())
        arg, name = named[int(head)] if head.isdigit() and int(head) < len(named) else (head, head)
        inner = f".{rest}" if rest else ""
        root = name.split("[")[0].split(".")[0]
        raise ValueError(
            f"{where}: NNX variable `{name}{inner}` ({arg}{inner}) lives on devices "
            f"{sorted(d.id for d in devices)}, but this step's {type(strategy).__name__} "
            f"runs on devices {sorted(d.id for d in target)}. An NNX object is placed by the "
            "first train step that runs it (or by jax.device_put); a step of another strategy "
            "does not move it silently, as a jd.Variable created in one strategy's scope is "
            "refused by another. To move it on purpose, copy its state to the host first: "
            f"`nnx.update({root}, jax.tree.map(np.asarray, nnx.state({root})))` (the next step "
            "places it), for every NNX argument (the optimizer too)."
        )
