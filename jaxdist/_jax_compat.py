"""Every JAX internal jaxdist reads, behind one small function each.

jaxdist supports jax 0.10.2 up to the newest release. Anything it needs that is
not JAX's public API (``jax._src``, ``jax.interpreters``, ``jax.extend``, the
parameters of jaxpr equations, primitive names, JAX error texts, XLA flags) is
read here and nowhere else, so a JAX upgrade that changes one touches this file
only. ``tests/package/test_jax_compat.py`` checks each function against the installed
JAX and fails loudly when JAX changes what it reads. Where a reading can fail on
a JAX this file has not seen, the function says so (``None``, ``False``) and
its caller takes a path that stays correct.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

JAX_VERSION: str = jax.__version__

# Typed varying axes --------------------------------------------------------------


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes along which the traced value ``x`` may differ (empty: invariant)."""
    return aval_varying_axes(jax.typeof(x))


def axis_names(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """A replica axis (one mesh axis name, or a tuple of them) as a tuple of names."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def varies(x: Any, axis: str | tuple[str, ...]) -> bool:
    """True when the traced ``x`` is typed as varying along any of the replica axes."""
    return bool(set(axis_names(axis)) & varying_axes(x))


def aval_varying_axes(aval: Any) -> frozenset[str]:
    """`varying_axes` of an abstract value (empty for tokens and other non-arrays).

    Reads ``aval.manual_axis_type.varying`` (jax >= 0.10)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def with_varying_axes(aval: Any, axes: frozenset[str]) -> Any:
    """``aval`` with its varying axes replaced by ``axes``."""
    mat = aval.manual_axis_type
    return aval.update(manual_axis_type=mat.update(varying=frozenset(axes)))


# Values and tracing ----------------------------------------------------------------


def concrete_array_type() -> type:
    """The class of concrete (non-traced) `jax.Array`s, for exact ``type(x) is`` checks on
    per-call paths (``isinstance(x, jax.Array)`` also matches tracers)."""
    from jax._src.array import ArrayImpl

    return ArrayImpl


def is_tracer(x: Any) -> bool:
    """True when ``x`` is an abstract value being traced (inside jit, grad, ...)."""
    return isinstance(x, jax.core.Tracer)


def eval_jaxpr(jaxpr: Any, consts: Any, *args: Any) -> list[Any]:
    """Evaluates an open jaxpr on ``args`` in the current trace (binding its primitives)."""
    return list(jax.core.eval_jaxpr(jaxpr, consts, *args))


def all_gather_invariant(x: Any, axis_name: str | tuple[str, ...]) -> Any:
    """Stacks every replica's ``x`` along a new leading axis; the result is invariant.

    Public API since jax 0.10 (``jax.lax.all_gather(..., to="invarying")``); should a
    release drop that argument, an equivalent psum of a one-hot placement (more
    traffic, same result) takes over.
    """
    if _INVARYING_GATHER[0]:
        try:
            return jax.lax.all_gather(x, axis_name, axis=0, tiled=False, to="invarying")
        except TypeError:  # pragma: no cover - a JAX without ``to=``
            _INVARYING_GATHER[0] = False
    return _all_gather_invariant_by_psum(x, axis_name)


_INVARYING_GATHER = [True]


def _all_gather_invariant_by_psum(x: Any, axis_name: str | tuple[str, ...]) -> Any:
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
    slot = jax.numpy.zeros((n, *jax.numpy.shape(x)), jax.numpy.result_type(x))
    return jax.lax.psum(slot.at[idx].set(x), axis_name)


# Jaxpr equations -------------------------------------------------------------------


def primitive_name(eqn: Any) -> str:
    """The name of a jaxpr equation's primitive, spelled the same on every supported JAX
    (jax 0.10 names the cast ``reduced_vary_cast_p``; later releases drop the suffix)."""
    name: str = eqn.primitive.name
    return name[:-2] if name.endswith("_p") else name


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs in an equation's parameters (bodies of loops, branches, calls)."""
    return list(jcore.jaxprs_in_params(eqn.params))


def is_literal(atom: Any) -> bool:
    """True when a jaxpr equation operand is a literal constant, not a variable."""
    return isinstance(atom, jcore.Literal)


def collective_axes(eqn: Any) -> tuple[str, ...] | None:
    """The mesh axes a collective equation works over (``None``: not a collective).

    JAX names the parameter ``axes`` (``psum``, ``pmax``, ...) or ``axis_name``
    (``all_gather``, ``ppermute``, ``axis_index``, ...); array reductions such as
    ``reduce_sum`` have integer ``axes``, which are not mesh axes."""
    params = eqn.params
    names = params.get("axis_name", params.get("axes"))
    if names is None:
        return None
    names = (names,) if isinstance(names, str) else tuple(names)
    # ``reduce_sum`` and friends also have ``axes``: array dimensions, not mesh axes.
    if not names or not all(isinstance(n, str) for n in names):
        return None
    return names


def has_axis_index_groups(eqn: Any) -> bool:
    """True when a collective reduces within groups of replicas (``axis_index_groups``)."""
    return eqn.params.get("axis_index_groups") is not None


def scan_layout(eqn: Any) -> tuple[int, int] | None:
    """``(number of consts, number of carries)`` among a ``scan`` equation's operands
    (then come the scanned-over inputs); ``None`` for a layout this file does not know.

    jax 0.10 and 0.11 give ``num_consts`` and ``num_carry``; jax 0.12 gives ``ft_in``,
    a flat tree of the three operand groups."""
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in = params.get("ft_in")
    if ft_in is None:
        return None
    try:
        groups = ft_in.update(list(range(len(eqn.invars)))).unpack()
        consts, carry, xs = (list(g) for g in groups)
    except (AttributeError, TypeError, ValueError):
        return None
    if consts + carry + xs != list(range(len(eqn.invars))):
        return None
    return len(consts), len(carry)


def while_layout(eqn: Any) -> tuple[Any, Any, int, int] | None:
    """``(cond jaxpr, body jaxpr, cond consts, body consts)`` of a ``while`` equation
    (open jaxprs; operands are cond consts, body consts, then the carry); ``None`` for
    a layout this file does not know."""
    params = eqn.params
    try:
        cond, body = params["cond_jaxpr"], params["body_jaxpr"]
        cn, bn = int(params["cond_nconsts"]), int(params["body_nconsts"])
    except (KeyError, TypeError):
        return None
    return getattr(cond, "jaxpr", cond), getattr(body, "jaxpr", body), cn, bn


def cond_branches(eqn: Any) -> list[Any] | None:
    """The branch jaxprs of a ``cond`` equation (open; operands are the branch index,
    then every branch's inputs); ``None`` for a layout this file does not know."""
    branches = eqn.params.get("branches")
    if branches is None:
        return None
    return [getattr(b, "jaxpr", b) for b in branches]


def installed_primitive_names() -> frozenset[str]:
    """The names (as `primitive_name` spells them) of every primitive the installed JAX
    defines in the modules that ``import jax`` and its transformations load."""
    import jax.ad_checkpoint
    import jax.experimental  # noqa: F401

    names = set()
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("jax"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jcore.Primitive):
                name = value.name
                names.add(name[:-2] if name.endswith("_p") else name)
    return frozenset(names)


# Defining a primitive --------------------------------------------------------------


def define_cast_primitive(
    name: str,
    abstract_eval: Callable[..., Any],
    transpose: Callable[..., Any],
) -> Callable[..., Any]:
    """A new unary primitive that changes only the type of its operand: it lowers to
    nothing, is linear (``transpose(ct, x, **params)`` gives the operand's cotangent), and
    batches by passing the batch dimension through. Returns its ``bind``."""
    prim = jcore.Primitive(name)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, lambda ctx, x, **params: [x])
    ad.deflinear2(prim, transpose)

    def batch(vals: Any, dims: Any, **params: Any) -> Any:
        (x,), (d,) = vals, dims
        return prim.bind(x, **params), d

    batching.primitive_batchers[prim] = batch
    return prim.bind


def is_symbolic_zero(ct: Any) -> bool:
    """True when a transpose received a symbolic zero cotangent (``ad.Zero``)."""
    return isinstance(ct, ad.Zero)


def symbolic_zero(aval: Any) -> Any:
    """A symbolic zero cotangent for a value of type ``aval``."""
    return ad.Zero(aval)


# Processes and backends ------------------------------------------------------------


def backends_initialized() -> bool:
    """Whether JAX's backends have started in this process (after which device counts and
    ``jax.distributed`` can no longer change)."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def distributed_client() -> Any:
    """The ``jax.distributed`` coordination service's client (its key-value store), or
    None when ``jax.distributed`` is not running."""
    from jax._src.distributed import global_state

    return global_state.client


def distributed_cluster() -> tuple[str | None, int, int]:
    """``(coordinator address, process count, process id)`` of the running
    ``jax.distributed`` (however it was started)."""
    from jax._src.distributed import global_state

    return (global_state.coordinator_address, global_state.num_processes, global_state.process_id)


def running_in_cloud_tpu_vm() -> bool:
    """JAX's own verdict (made at ``import jax``) that this is a Cloud TPU VM."""
    try:
        from jax._src import cloud_tpu_init
    except ImportError:  # pragma: no cover - depends on the JAX release
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


# JAX error texts and XLA flags -----------------------------------------------------


def is_deadline_exceeded(error: BaseException) -> bool:
    """True when a ``jax.distributed`` key-value call failed only because its wait ran out
    (the coordination service answers ``DEADLINE_EXCEEDED``)."""
    return "DEADLINE_EXCEEDED" in str(error)


def is_incompatible_devices(error: BaseException) -> bool:
    """True when ``jax.jit`` refused arguments committed to devices other than the
    program's ("incompatible devices")."""
    return "incompatible devices" in str(error)


CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
"""The XLA flag (in ``XLA_FLAGS``) that bounds how long a CPU collective waits for its
peers; read by XLA when the CPU backend starts."""


# Host-to-device placement ----------------------------------------------------------

_PLACEMENTS: dict[tuple[Any, tuple[int, ...], Any], tuple[Any, list[Any], list[Any]]] = {}


def _batched_device_put() -> Any:
    try:
        from jax._src.interpreters.pxla import batched_device_put
    except ImportError:  # pragma: no cover - depends on the JAX release
        return None
    return batched_device_put


_BATCHED_DEVICE_PUT = [_batched_device_put()]


def place_host_arrays(arrays: list[Any], sharding: Any) -> list[Any]:
    """``jax.device_put(arrays, sharding)`` in a single-process job, for NumPy arrays of
    canonical dtypes: each goes straight to the per-array batched transfer that
    ``jax.device_put`` itself ends in, without its generic argument handling (about 30
    us per array on CPU, as much as the transfer itself). Anything else (another array
    type, a dtype JAX would convert), or a JAX without that function, takes
    ``jax.device_put``."""
    put = _BATCHED_DEVICE_PUT[0]
    if put is None or not all(
        type(a) is np.ndarray and a.dtype == jax.dtypes.canonicalize_dtype(a.dtype) for a in arrays
    ):
        return list(jax.device_put(arrays, sharding))
    try:
        return _place_each(put, arrays, sharding)
    except TypeError:  # pragma: no cover - a JAX whose internal signature changed
        _BATCHED_DEVICE_PUT[0] = None
        return list(jax.device_put(arrays, sharding))


def _place_each(put: Any, arrays: list[Any], sharding: Any) -> list[Any]:
    out = []
    for a in arrays:
        key = (sharding, a.shape, a.dtype)
        placement = _PLACEMENTS.get(key)
        if placement is None:
            if len(_PLACEMENTS) > 64:  # a few shapes per dataset; never grows without bound
                _PLACEMENTS.clear()
            index_map = sharding.addressable_devices_indices_map(a.shape)
            aval = jax.core.ShapedArray(a.shape, a.dtype)
            placement = _PLACEMENTS[key] = (aval, list(index_map), list(index_map.values()))
        aval, devices, indices = placement
        out.append(put(aval, sharding, [a[i] for i in indices], devices))
    return out
