"""`FSDPStrategy`: fully sharded data parallelism (ZeRO-3 storage) with loud sharding rules.

Data parallel like `MirroredStrategy` (one replica per device, a 1-D mesh over
the replica axis, the same replica functions and `ReplicaContext`), except for
the training state that `jaxdist.train_step` (and so `jaxdist.fit`) carries:
NNX variables (parameters, optimizer state) and `TrainState` leaves are stored
sharded over the replica axis, one slice per device, between steps. The step
all-gathers each sharded parameter when it enters the replica function, so
the user's code sees whole arrays and makes the usual ``ctx.all_reduce`` of
gradients; the updated state leaves the step as each device's slice again.
Since only slices are kept, the step computes only slices: a gradient sum
whose result is needed sliced is a reduce-scatter, the optimizer's
element-wise update runs on each device's slice, and the optimizer state is
never gathered (`jaxdist._run.sliced_eval`). The results are those of
`MirroredStrategy` (the same operations on the same values; a reduce-scatter
may add in another order than an all-reduce).

Which leaf is sharded, and along which dimension, is decided per leaf from its
``/``-joined path (``layers/0/kernel``, ``opt_state/0/mu/layers/0/kernel``,
``params/Dense_0/kernel`` for a `TrainState`), by `state_layout`:

1. a leaf smaller than ``min_shard_bytes`` (or a scalar, or a PRNG key) is
   replicated;
2. else the first rule ``(regex, dim)`` whose regex matches the path
   (``re.search``) decides: ``dim`` (an int, negative counts from the end) is
   sharded, ``None`` replicates;
3. else the first dimension divisible by the number of devices is sharded;
4. else it is an error: a large tensor is never replicated silently.

Every problem of a state (leaves without a divisible dimension, rules naming a
dimension that does not divide, too much replicated state under
``max_replicated_fraction``) is reported in one ``ValueError``.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist.devices import resolve_devices
from jaxdist.strategies._job import job_devices
from jaxdist.strategies._sharded_create import create_sharded
from jaxdist.strategies._state_leaves import as_leaves, leaf_bytes, replicated_problem
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.checks import (
    check_fraction,
    check_min_shard_bytes,
    check_regex,
    ordered_pairs,
)

__all__ = ["DEFAULT_MIN_SHARD_BYTES", "FSDPStrategy", "shard_dims"]

DEFAULT_MIN_SHARD_BYTES = 1 << 14  # 16 KiB: smaller leaves cost more to gather than to keep

_WHERE = "FSDPStrategy"


def _check_rules(rules: Any) -> tuple[tuple[str, int | None], ...]:
    example = (
        f"(({rules!r:.40}, 0),)" if isinstance(rules, str) else "((r'embed', 1), (r'norm', None))"
    )
    items = ordered_pairs(rules, "rules", _WHERE, example)
    checked: list[tuple[str, int | None]] = []
    for i, rule in enumerate(items):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        dim = rule[1] if ok else None
        if ok and dim is not None:
            ok = isinstance(dim, numbers.Integral) and not isinstance(dim, bool)
        if not ok:
            raise TypeError(
                f"{_WHERE}(rules=...): rules[{i}] must be a (regex, dim or None) pair, got "
                f"{rule!r}. Example: (r'layers/\\d+/kernel', 0)."
            )
        check_regex(rule[0], f"rules[{i}]", _WHERE)
        checked.append((rule[0], None if dim is None else int(dim)))
    return tuple(checked)


def shard_dims(
    leaves: Sequence[tuple[str, Any]],
    num_shards: int,
    *,
    rules: Sequence[tuple[str, int | None]] = (),
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    max_replicated_fraction: float | None = None,
    where: str = _WHERE,
    whole: bool = True,
) -> list[int | None]:
    """The dimension each state leaf is sharded on (``None``: replicated).

    Args:
        leaves: ``(path, array)`` pairs, the path ``/``-joined; the arrays may be
            abstract (anything with ``shape`` and ``dtype``).
        num_shards: the number of devices the state is sharded over.
        rules, min_shard_bytes, max_replicated_fraction: as `FSDPStrategy`.
        where: the caller, for error messages.
        whole: ``leaves`` are a whole training state, so a rule whose regex matches
            none of their paths is an error (it is misspelled, or names a model that
            is not this one); ``False`` for a part of a state.

    Raises:
        ValueError: listing every leaf that cannot be placed, every rule that
            matches nothing, and the replicated fraction when it passes
            ``max_replicated_fraction``.
    """
    compiled = [(re.compile(pattern), pattern, dim) for pattern, dim in rules]
    dims: list[int | None] = []
    problems: list[str] = []
    replicated: list[tuple[int, str, tuple[int, ...]]] = []
    total = 0
    leaves = [(leaf[0], leaf[1]) for leaf in leaves]
    if whole and leaves:
        for i, (regex, pattern, dim) in enumerate(compiled):
            if not any(regex.search(path) for path, _ in leaves):
                examples = ", ".join(path for path, _ in leaves[:4])
                problems.append(
                    f"rules[{i}] ({pattern!r}, {dim}) matches no leaf of the state (its "
                    f"paths look like {examples}, ...); fix the regex or remove the rule"
                )
    for path, value in leaves:
        shape = tuple(np.shape(value))
        size = leaf_bytes(value)
        dim = _leaf_dim(path, shape, size, num_shards, compiled, min_shard_bytes, problems)
        dims.append(dim)
        if size is not None:
            total += size
            if dim is None:
                replicated.append((size, path, shape))
    guard = replicated_problem(replicated, total, max_replicated_fraction)
    if guard is not None:
        problems.append(guard)
    if problems:
        raise ValueError(
            f"{where}: cannot shard the training state over {num_shards} devices "
            f"(rules={tuple(rules)!r}, min_shard_bytes={min_shard_bytes}):\n  - "
            + "\n  - ".join(problems)
        )
    return dims


def _leaf_dim(
    path: str,
    shape: tuple[int, ...],
    size: int | None,
    n: int,
    compiled: list[tuple[re.Pattern[str], str, int | None]],
    min_shard_bytes: int,
    problems: list[str],
) -> int | None:
    if size is None or not shape or size < min_shard_bytes:
        return None
    for regex, pattern, dim in compiled:
        if not regex.search(path):
            continue
        if dim is None:
            return None
        if not -len(shape) <= dim < len(shape):
            problems.append(
                f"{path} of shape {shape}: rule ({pattern!r}, {dim}) names dimension {dim}, "
                f"but the leaf has rank {len(shape)}"
            )
            return None
        if shape[dim] % n:
            problems.append(
                f"{path} of shape {shape}: rule ({pattern!r}, {dim}) shards dimension {dim} "
                f"of size {shape[dim]}, not divisible by the {n} devices; pick another "
                "dimension, or None to replicate it"
            )
            return None
        return dim % len(shape)
    for d, extent in enumerate(shape):
        if extent % n == 0:
            return d
    problems.append(
        f"{path} of shape {shape} ({size:,} bytes): no dimension is divisible by the {n} "
        f"devices and no rule matches it. Add a rule ({re.escape(path)!r}, None) to "
        "replicate it (or pad the dimension to a multiple of the device count)"
    )
    return None


class FSDPStrategy(Strategy):
    """Data parallelism with the training state sharded over the replicas (ZeRO-3 storage).

    Args:
        devices: the devices; ``None``: every device of the job (in a job of several
            processes, every device of every process, connecting them first as
            `MultiWorkerMirroredStrategy` does).
        min_shard_bytes: leaves smaller than this are replicated (gathering them
            costs more than storing them).
        rules: ``(regex, dim or None)`` pairs matched with ``re.search`` against
            each state leaf's ``/``-joined path; the first match wins; ``dim`` is
            the dimension to shard over the devices, ``None`` replicates. Rules
            apply to leaves of at least ``min_shard_bytes``.
        max_replicated_fraction: opt-in guard: raise when more than this
            fraction of the state's bytes stays replicated (the error lists the
            five largest replicated leaves). ``None``: no guard.

    `jaxdist.train_step` and `jaxdist.fit` run unchanged: NNX parameters and
    optimizer state, and `TrainState` arguments and results, are stored
    sharded (each device holds ``1 / num_replicas_in_sync`` of every sharded
    leaf); inside the step each replica sees whole arrays (all-gathered on
    entry), so replica functions, ``ctx.all_reduce`` of gradients and the
    results are exactly those of `MirroredStrategy`. The updated state leaves
    the step as each device's slice. A leaf that is large and matches no rule
    is sharded on its first dimension divisible by the device count; if none
    divides, a ``ValueError`` names its path and shape (never silent
    replication). ``strategy.run`` and distributed variables behave as under
    `MirroredStrategy` (replicated).

    `experimental_create` builds the state directly in those slices (an abstract
    trace, the rules, then a ``jax.jit`` with ``out_shardings``), so a model
    larger than one device can start; a model built eagerly is sharded by the
    first step instead, after existing whole on one device.

    Inside the step only the parameters are gathered (for the forward and
    backward pass); gradients that are kept as slices are reduce-scattered
    and the optimizer updates each device's slice, as ZeRO-3 does. Element-wise
    optimizer code (optax's, NNX's) takes that path; an update that mixes
    elements (a global norm clip, for example) is computed on whole arrays and
    then sliced, with the same results. ``step.lower(...).compile().
    memory_analysis()`` shows the memory of the compiled step.

    Example:
        >>> import jax, jaxdist as jd
        >>> s = jd.experimental.FSDPStrategy(rules=((r"norm", None),))
        >>> s.num_replicas_in_sync == jax.local_device_count()
        True
        >>> from jax.sharding import PartitionSpec as P
        >>> s.state_layout([("layers/0/kernel", jax.numpy.zeros((64, 256))),
        ...                 ("norm/scale", jax.numpy.zeros((8192,)))]) == {
        ...     "layers/0/kernel": P("replica"), "norm/scale": P()}
        True
    """

    __slots__ = ("_max_replicated_fraction", "_min_shard_bytes", "_rules")
    _min_shard_bytes: int
    _rules: tuple[tuple[str, int | None], ...]
    _max_replicated_fraction: float | None

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        rules: Sequence[tuple[str, int | None]] = (),
        max_replicated_fraction: float | None = None,
    ) -> None:
        object.__setattr__(self, "_min_shard_bytes", check_min_shard_bytes(min_shard_bytes, _WHERE))
        object.__setattr__(self, "_rules", _check_rules(rules))
        object.__setattr__(
            self, "_max_replicated_fraction", check_fraction(max_replicated_fraction, _WHERE)
        )
        if devices is None:
            super().__init__(job_devices())
        else:
            super().__init__(resolve_devices(devices, where=f"{_WHERE}(devices=...)"))

    def extra_key(self) -> tuple[Any, ...]:
        return (self._min_shard_bytes, self._rules, self._max_replicated_fraction)

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(num_replicas={self.num_replicas_in_sync}, "
            f"platform={self._devices[0].platform}, min_shard_bytes={self._min_shard_bytes}, "
            f"rules={self._rules!r})"
        )

    @property
    def rules(self) -> tuple[tuple[str, int | None], ...]:
        """The sharding rules, ``(regex, dim or None)`` pairs, first match wins."""
        return self._rules

    @property
    def min_shard_bytes(self) -> int:
        """Leaves smaller than this many bytes are replicated."""
        return self._min_shard_bytes

    @property
    def max_replicated_fraction(self) -> float | None:
        """The opt-in bound on the replicated fraction of the state's bytes."""
        return self._max_replicated_fraction

    def state_layout(self, state: Any) -> dict[str, P]:
        """``{path: PartitionSpec}`` of every leaf of a training state, by this strategy's
        rules, without training (``P()``: replicated).

        ``state``: an NNX object (a Module, an ``nnx.Optimizer``), a tuple of them, a
        `jaxdist.TrainState`, a pytree of arrays, or a list of ``(path, array)``
        pairs. Raises ``ValueError`` listing every leaf that cannot be placed and every
        rule that matches no leaf."""
        leaves = as_leaves(state)
        specs = self.state_specs(leaves, self._name("state_layout"))
        assert specs is not None
        return {leaf.path: spec for leaf, spec in zip(leaves, specs, strict=True)}

    def experimental_create(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls ``fn(*args, **kwargs)`` to build the training state directly in slices:
        no device ever holds the whole state, so a model larger than one device can start.

        ``fn`` builds NNX objects (a Module, or a tuple such as ``(model,
        nnx.Optimizer(model, tx, wrt=nnx.Param))``), a `jaxdist.TrainState`, or a
        pytree of arrays. It is traced abstractly first (``nnx.eval_shape``), each
        leaf is laid out by this strategy's rules (`state_layout`, the same decision
        and errors as the train step's, paths as there: inside each returned object
        or `TrainState`), then ``fn`` runs under ``jax.jit`` with those
        ``out_shardings``, so each device computes only its slices. The values are
        those of calling ``fn`` directly (the same RNG seeds give the same bits), and
        the result is stored exactly as `jaxdist.train_step` keeps state under this
        strategy: the first step moves nothing. Create ``nnx.Rngs`` inside ``fn``
        (from a seed); arrays among ``args`` are captured as constants.

        Raises:
            TypeError: ``fn`` is not callable, or returns a leaf that is not an array.
            ValueError: ``fn`` returns no arrays, or the rules cannot place a leaf
                (as `state_layout`).

        Example:
            >>> import optax, jaxdist as jd
            >>> from flax import nnx
            >>> s = jd.experimental.FSDPStrategy(min_shard_bytes=1024)
            >>> def make():
            ...     model = nnx.Linear(64, 512, rngs=nnx.Rngs(0))
            ...     return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
            >>> model, opt = s.experimental_create(make)
            >>> kernel = model.kernel.get_value()   # (64, 512): 64 / 8 rows per device
            >>> kernel.addressable_shards[0].data.shape == (64 // s.num_replicas_in_sync, 512)
            True
        """
        return create_sharded(self, fn, args, kwargs, self._name("experimental_create"))

    def state_dims(
        self, leaves: Sequence[tuple[str, Any]], where: str, *, whole: bool = True
    ) -> list[int | None]:
        return shard_dims(
            leaves,
            self.num_replicas_in_sync,
            rules=self._rules,
            min_shard_bytes=self._min_shard_bytes,
            max_replicated_fraction=self._max_replicated_fraction,
            where=where,
            whole=whole,
        )
