"""`MeshStrategy`: data, fully sharded data and tensor parallelism on one named N-D mesh.

One mesh of named axes in the order given (``{"data": 2, "fsdp": 2,
"tensor": 2}``), and logical axis rules as Flax, MaxText and T5X write them
(``("embed", "fsdp")``, ``("mlp", "tensor")``, ``("batch", ("data",
"fsdp"))``). The ``"batch"`` rule names the *replica axes*: one replica per
position of those axes (row-major), each spanning the devices of the other
axes. It generalizes the two sharded strategies before it:

- `run` is `jax.shard_map` manual over the replica axes only, as
  `TPUStrategy` is over its replica axis; the other axes stay automatic, so a
  replica function sees whole arrays and XLA's partitioner splits the
  computation over them (tensor parallelism: `TPUStrategy`'s logical devices);
- training state (`jaxdist.train_step`, `jaxdist.fit`) is stored between
  steps with the spec its logical names map to. The part of a spec over
  replica axes is `FSDPStrategy`'s ZeRO-3 storage (gathered on entry to the
  replica function, the gradient sum reduce-scattered, the optimizer updating
  its block; `jaxdist._run.sliced_eval`), the part over other axes a sharding
  constraint that keeps parameters, gradients and optimizer state split over
  them (`jaxdist._run.stored`).

Layouts come from the variables' own logical names (`_logical_layout`), and
nothing is replicated silently.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jaxdist._scope import current_replica_context
from jaxdist.devices import resolve_devices
from jaxdist.strategies._job import job_devices
from jaxdist.strategies._logical_layout import (
    LogicalLayout,
    batch_axes,
    check_param_rules,
    check_rules,
)
from jaxdist.strategies._sharded_create import create_sharded
from jaxdist.strategies._state_leaves import StateLeaf, as_leaves
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.checks import check_fraction, check_min_shard_bytes

__all__ = ["MeshStrategy", "logical_constraint"]

_WHERE = "MeshStrategy"


def _check_shape(mesh_shape: Any, arg: str, where: str) -> dict[str, int]:
    if not isinstance(mesh_shape, dict) or not mesh_shape:
        raise TypeError(
            f"{where}({arg}=...): expected a dict {{axis name: size}} in mesh order, got "
            f"{mesh_shape!r}; e.g. {{'data': 2, 'fsdp': 2, 'tensor': 2}}."
        )
    for name, size in mesh_shape.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}({arg}=...): axis names must be strings, got {name!r}.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"{where}({arg}=...): the size of axis {name!r} must be a positive int, "
                f"got {size!r}."
            )
    return dict(mesh_shape)


def _granules(devices: Sequence[jax.Device], count: int, where: str) -> list[list[jax.Device]]:
    """The devices in ``count`` groups that each form one ``mesh_shape`` block: one per
    process (host, slice) in a job of ``count`` processes; in one process, consecutive
    groups (the same block order, to try a multi-host layout on one host)."""
    processes = sorted({d.process_index for d in devices})
    if len(processes) == count:
        return [[d for d in devices if d.process_index == p] for p in processes]
    if len(processes) == 1 and len(devices) % count == 0:
        k = len(devices) // count
        return [list(devices[i * k : (i + 1) * k]) for i in range(count)]
    raise ValueError(
        f"{where}(dcn_mesh_shape=...): the devices span {len(processes)} processes, but "
        f"dcn_mesh_shape asks for {count} blocks; its product must be the number of "
        "processes (hosts or slices)."
    )


def _device_grid(
    devices: Sequence[jax.Device], ici: dict[str, int], dcn: dict[str, int], where: str
) -> np.ndarray:
    """The devices as an array of the mesh's shape: each process's devices one ``ici``
    block, the blocks laid out along ``dcn`` (the order of
    ``mesh_utils.create_hybrid_device_mesh``)."""
    names = list(ici)
    shape = tuple(ici[a] * dcn[a] for a in names)
    count = math.prod(dcn.values())
    if count == 1:
        return np.array(devices, dtype=object).reshape(shape)
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        return np.asarray(
            mesh_utils.create_hybrid_device_mesh(
                [ici[a] for a in names], [dcn[a] for a in names], devices=list(devices)
            ),
            dtype=object,
        )
    groups = _granules(devices, count, where)
    block = math.prod(ici.values())
    if any(len(g) != block for g in groups):
        raise ValueError(
            f"{where}: each process must hold one mesh_shape block of {block} devices "
            f"({ici}); they hold {[len(g) for g in groups]}."
        )
    rank = len(names)
    grid = np.array(groups, dtype=object).reshape(
        *(dcn[a] for a in names), *(ici[a] for a in names)
    )
    order = [i for pair in zip(range(rank), range(rank, 2 * rank), strict=True) for i in pair]
    return grid.transpose(order).reshape(shape)


class MeshStrategy(Strategy):
    """Data, fully sharded data (ZeRO-3) and tensor parallelism on one named mesh.

    Args:
        mesh_shape: ``{axis name: size}`` in mesh order, e.g. ``{"data": 2, "fsdp":
            2, "tensor": 2}``; with ``dcn_mesh_shape``, the part of each axis inside
            one process.
        rules: logical axis rules, ``(logical name, mesh axis | tuple of mesh axes |
            None)`` pairs; the first rule for a name wins. The rule for ``"batch"``
            names the axes that split the batch: one replica per position of those
            axes (``num_replicas_in_sync`` is the product of their sizes).
        devices: the devices; ``None``: every device of the job (the processes
            connected first, as `MultiWorkerMirroredStrategy` does).
        dcn_mesh_shape: ``{axis name: size}``, the part of each axis that spans
            processes (hosts, TPU slices); axis ``a`` has ``mesh_shape[a] *
            dcn_mesh_shape.get(a, 1)`` devices and each process's devices form one
            ``mesh_shape`` block.
        param_rules: ``(regex, logical names tuple | None)`` pairs for leaves without
            annotations (plain pytrees, `jaxdist.TrainState` params), matched with
            ``re.search`` on the ``/``-joined path; the first match wins; ``None`` or
            ``()`` replicates.
        min_shard_bytes: an unannotated leaf at least this large that no
            ``param_rules`` entry matches is an error (smaller ones are replicated).
        max_replicated_fraction: `FSDPStrategy`'s guard: an error when more than this
            fraction of the state's bytes stays replicated.

    A leaf's logical names come from the model: Flax NNX ``out_sharding``
    metadata (``nnx.with_partitioning(init, ("embed", "mlp"))``), a Linen
    ``nn.LogicallyPartitioned`` box in a params tree, else ``param_rules``;
    optimizer state follows its parameter. Split over a replica axis a leaf is
    stored in slices and gathered for the step (ZeRO-3: the optimizer updates
    only its slice, its state never gathered); over any other axis XLA
    partitions the computation (tensor parallelism). A logical name without a
    rule, a rule splitting a dimension its axes' size does not divide, or a
    large leaf without names is a ``ValueError`` naming the leaf, its shape,
    its names and the rule; every problem of a state in one error.

    Example:
        >>> import jaxdist as jd
        >>> s = jd.experimental.MeshStrategy(
        ...     {"data": 2, "fsdp": 2, "tensor": 2},
        ...     rules=(("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")),
        ... )
        >>> s.num_replicas_in_sync, dict(s.mesh.shape)
        (4, {'data': 2, 'fsdp': 2, 'tensor': 2})
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> s.state_layout([("w", jnp.zeros((64, 256)), ("embed", "mlp"))]) == {
        ...     "w": P("fsdp", "tensor")}
        True
    """

    __slots__ = ("_batch_axes", "_dcn", "_grid", "_layout", "_shape")
    _shape: dict[str, int]
    _dcn: dict[str, int]
    _grid: np.ndarray
    _layout: LogicalLayout
    _batch_axes: tuple[str, ...]

    def __init__(
        self,
        mesh_shape: dict[str, int],
        rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = (),
        *,
        devices: Sequence[Any] | None = None,
        dcn_mesh_shape: dict[str, int] | None = None,
        param_rules: Sequence[tuple[str, tuple[str | None, ...] | None]] = (),
        min_shard_bytes: int = 16384,
        max_replicated_fraction: float | None = None,
    ) -> None:
        where = _WHERE
        ici = _check_shape(mesh_shape, "mesh_shape", where)
        dcn = {a: 1 for a in ici}
        if dcn_mesh_shape is not None:
            given = _check_shape(dcn_mesh_shape, "dcn_mesh_shape", where)
            extra = [a for a in given if a not in ici]
            if extra:
                raise ValueError(
                    f"{where}(dcn_mesh_shape=...): axis {extra[0]!r} is not an axis of "
                    f"mesh_shape {ici}; dcn_mesh_shape gives, for axes of mesh_shape, the "
                    "part that spans processes."
                )
            dcn.update(given)
        sizes = {a: ici[a] * dcn[a] for a in ici}
        checked = check_rules(rules, sizes, where)
        layout = LogicalLayout(
            tuple(sizes.items()),
            checked,
            check_param_rules(param_rules, where),
            check_min_shard_bytes(min_shard_bytes, where),
            check_fraction(max_replicated_fraction, where),
        )
        devs = (
            job_devices()
            if devices is None
            else resolve_devices(devices, where=f"{where}(devices=...)")
        )
        if math.prod(sizes.values()) != len(devs):
            raise ValueError(
                f"{where}: the mesh {sizes} (mesh_shape={ici}"
                + (f" x dcn_mesh_shape={dcn_mesh_shape}" if dcn_mesh_shape else "")
                + f") has {math.prod(sizes.values())} devices, but there are {len(devs)} "
                f"({devs[0].platform}); make the product of the sizes {len(devs)}."
            )
        grid = _device_grid(devs, ici, dcn, where)
        grid.flags.writeable = False
        replica = batch_axes(checked)
        names = list(sizes)
        rest = [a for a in names if a not in replica]
        order = [names.index(a) for a in (*replica, *rest)]
        first = grid.transpose(order).reshape(math.prod(sizes[a] for a in replica), -1)[:, 0]
        object.__setattr__(self, "_shape", sizes)
        object.__setattr__(self, "_dcn", dcn)
        object.__setattr__(self, "_grid", grid)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_batch_axes", replica)
        super().__init__(
            tuple(first), mesh_shape=tuple(sizes[a] for a in replica), axis_names=replica
        )

    def make_mesh(self, grid: np.ndarray, axis_names: tuple[str, ...]) -> Mesh:
        names = tuple(self._shape)
        return Mesh(self._grid, names, axis_types=(AxisType.Auto,) * len(names))

    def extra_key(self) -> tuple[Any, ...]:
        return (tuple(self._shape.items()), tuple(self._grid.flat), self._layout)

    def __repr__(self) -> str:
        return (
            f"MeshStrategy({self._shape}, batch={self._batch_axes}, "
            f"platform={self._devices[0].platform})"
        )

    @property
    def rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """The logical axis rules, ``(logical name, mesh axes or None)``, first wins."""
        return self._layout.rules

    @property
    def param_rules(self) -> tuple[tuple[str, tuple[str | None, ...] | None], ...]:
        """The ``(regex, logical names)`` rules for unannotated leaves."""
        return self._layout.param_rules

    @property
    def min_shard_bytes(self) -> int:
        """Unannotated leaves at least this large need a ``param_rules`` entry."""
        return self._layout.min_shard_bytes

    @property
    def max_replicated_fraction(self) -> float | None:
        """The opt-in bound on the replicated fraction of the state's bytes."""
        return self._layout.max_replicated_fraction

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes of the ``"batch"`` rule: replicas are their positions."""
        return self._batch_axes

    # Layout --------------------------------------------------------------------------

    def state_specs(
        self, leaves: Sequence[StateLeaf], where: str, *, whole: bool = True
    ) -> list[P]:
        return self._layout.specs(leaves, where)

    def state_layout(self, state: Any) -> dict[str, P]:
        """``{path: PartitionSpec}`` of every leaf of a training state, without training.

        ``state``: an NNX object (a Module, an ``nnx.Optimizer``), a tuple of them, a
        `jaxdist.TrainState`, a pytree of arrays, or a list of ``(path, array)`` or
        ``(path, array, logical names)`` records. Raises ``ValueError`` listing every
        leaf that cannot be laid out (the train step raises the same)."""
        leaves = as_leaves(state)
        specs = self.state_specs(leaves, self._name("state_layout"))
        return {leaf.path: spec for leaf, spec in zip(leaves, specs, strict=True)}

    def logical_spec(self, names: Sequence[str | None], shape: tuple[int, ...]) -> P:
        """The activation spec of logical ``names``: their rules' mesh axes, the replica
        axes dropped (a replica function holds its own rows and cannot split anything
        over them). Raises ``ValueError`` for a name without a rule."""
        where = "jaxdist.experimental.logical_constraint"
        problems: list[str] = []
        drop = frozenset(self._batch_axes)
        spec = self._layout.spec_of("the value", shape, tuple(names), "activation", problems, drop)
        if problems:
            raise ValueError(f"{where}: on mesh {self._shape}: " + "; ".join(problems))
        return spec

    def experimental_create(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls ``fn(*args, **kwargs)`` to build the training state directly in its
        layout: no device holds more than its share, so a model larger than one device
        can start. As `FSDPStrategy.experimental_create`, laid out by this strategy's
        rules (build annotated NNX modules inside ``fn``; the values are those of
        ``jax.jit(fn)``)."""
        with self.scope():  # Flax's eager sharding needs the mesh and rules
            return create_sharded(self, fn, args, kwargs, self._name("experimental_create"))

    # Scope: Flax's eager sharding ----------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """As `Strategy.scope`; also sets this mesh and rules for Flax, so NNX modules
        created inside are born sharded (``nnx.with_partitioning`` variables as a
        ``NamedSharding`` on `mesh` with their ruled spec)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().scope())
            spmd = sys.modules.get("flax.core.spmd")
            if spmd is not None:
                stack.enter_context(jax.set_mesh(self.mesh))
                stack.enter_context(spmd.logical_axis_rules(self.rules))
            yield self


def logical_constraint(x: Any, logical_names: Sequence[str | None]) -> Any:
    """``x`` constrained to the layout its logical axis names map to (activations).

    Inside a replica function of a `MeshStrategy` (or a model called from one):
    ``jax.lax.with_sharding_constraint`` with each name mapped by the strategy's
    rules and the replica (``"batch"``) axes dropped; under any other strategy, and
    outside a strategy, the identity, so a model written with it runs everywhere.

    Raises:
        ValueError: under a `MeshStrategy`, a name has no rule, a mesh axis is used
            twice, or the count of names differs from ``x``'s rank.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> y = jd.experimental.logical_constraint(jnp.ones((2, 3)), ("batch", "embed"))
    """
    ctx = current_replica_context()
    strategy = None if ctx is None else ctx.strategy
    if not isinstance(strategy, MeshStrategy):
        return x
    names = tuple(logical_names)
    return lax.with_sharding_constraint(x, strategy.logical_spec(names, tuple(np.shape(x))))
