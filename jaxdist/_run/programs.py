"""The cache of compiled replica programs.

`program_for(fn, strategy, options)` returns a `Program`: one `jax.jit` of
`jaxdist._run.compile.replicated` for that function, strategy and options. jit
then caches one executable per argument signature, so a repeat call costs
one C++ dispatch.

The cache is a bounded LRU (`set_program_cache_size`, default 256 programs)
and holds replica functions weakly where Python allows: when a function is
garbage collected its programs and executables go with it, so a stream of
distinct closures does not grow memory. A function that keeps being
re-created (a new ``lambda`` or ``functools.partial`` on every step)
recompiles every time; after `RECOMPILE_WARNING_AFTER` such programs for the
same code and strategy, jaxdist warns once and names `Strategy.function` as the fix.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any, cast

import jax
import numpy as np

from jaxdist._jax_compat import concrete_array_type
from jaxdist._protocols import StrategyLike
from jaxdist._run.compile import path_str, replicated
from jaxdist.errors import DonatedArgumentError
from jaxdist.run_options import RunOptions
from jaxdist.values.distributed import PerReplica
from jaxdist.values.distributed import unflatten_per_replica as _per_replica

__all__ = ["Program", "get_program_cache_size", "program_for", "set_program_cache_size"]

DEFAULT_CACHE_SIZE = 256
RECOMPILE_WARNING_AFTER = 16


def _check_outputs(fn: Callable[..., Any], where: str, out: Any) -> None:
    """Raises (while tracing) naming the user's function and its file when it returned a
    leaf that is not an array or a number (JAX would name jaxdist's own wrapper)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if leaf is None or isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float,
                                             complex, bool)):  # fmt: skip
            continue
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):  # tracers, ShapeDtypeStructs
            continue
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
        code = getattr(inspect.unwrap(fn), "__code__", None)
        at = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise TypeError(
            f"{where}: {name}{at} returned a {type(leaf).__name__} at "
            f"result{jax.tree_util.keystr(path)}; a replica function returns arrays, "
            "numbers and pytrees of them. Return the value as an array, or keep it out of "
            "the result (print or log it inside instead)."
        )


class Program:
    """A replica function compiled for one strategy and one set of options."""

    __slots__ = ("__weakref__", "call", "caller", "jitted", "strategy")

    def __init__(
        self,
        fn_ref: Callable[[], Callable[..., Any] | None],
        strategy: StrategyLike,
        options: RunOptions | None,
        plain: bool,
    ) -> None:
        opts = options or RunOptions()
        name = getattr(fn_ref(), "__name__", "replica_fn")

        def program(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            fn = fn_ref()
            if fn is None:  # pragma: no cover - the cache entry dies with the function
                raise RuntimeError("jaxdist: the replica function was garbage collected.")
            out = replicated(fn, strategy, args, kwargs, plain=plain)
            _check_outputs(fn, f"{type(strategy).__name__}.run", out)
            return out

        program.__name__ = program.__qualname__ = f"jaxdist_{name}"
        jit_kwargs: dict[str, Any] = {}
        if opts.experimental_xla_options:
            jit_kwargs["compiler_options"] = dict(opts.experimental_xla_options)
        # What `Strategy.dispatch_program` calls with (args, kwargs).
        self.call: Callable[[tuple[Any, ...], dict[str, Any]], Any]
        where = f"{type(strategy).__name__}.run({name})"
        if opts.donate_args:
            self.jitted = jax.jit(_with_counts(program), donate_argnums=(0, 1), **jit_kwargs)
            self.call = _donating(self.jitted, where)
        elif opts.donate_argnums:
            nums = cast(tuple[int, ...], opts.donate_argnums)  # a tuple: RunOptions made it
            self.jitted = jax.jit(_some_donated(program, nums), donate_argnums=0, **jit_kwargs)
            flat = jax.jit(
                _flat_donated(program, nums), static_argnums=0, donate_argnums=1, **jit_kwargs
            )
            self.call = _donating_some(self.jitted, flat, nums, where)
        else:
            self.jitted = jax.jit(program, **jit_kwargs)
            self.call = self.jitted
        self.strategy = strategy
        # The per-call path (`Strategy.program_caller`): what run, function and _dispatch call.
        self.caller = strategy.program_caller(self.call)

    def lower(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LoweredStep:
        if self.call is self.jitted:
            return LoweredStep(self.jitted.lower(args, kwargs))
        nums = getattr(self.call, "donate_argnums", None)
        if nums is not None:
            return LoweredStep(self.jitted.lower(*_split_donated(args, kwargs, nums)))
        return LoweredStep(self.jitted.lower(*_counts_apart(args, kwargs)[:3]))


# Donation -----------------------------------------------------------------------
# A distributed dataset's batches share one device array of valid-row counts, so a step
# that donates its arguments keeps those counts apart, undonated.


_ARRAY: Any = concrete_array_type()


def _is_per_replica(x: Any) -> bool:
    return type(x) is PerReplica


def _counts_apart(args: Any, kwargs: Any) -> tuple[Any, Any, list[Any], bool]:
    """``args`` and ``kwargs`` with the valid counts of every `PerReplica` taken out,
    those counts (None where it has none) in order, and whether any array among them was
    deleted (donated to an earlier call), found in the same walk."""
    counts: list[Any] = []
    deleted = [False]

    def take(x: Any) -> Any:
        if type(x) is PerReplica:
            counts.append(x.valid)
            x = _per_replica(None, (x.array, None))
            if type(x.array) is _ARRAY and x.array.is_deleted():
                deleted[0] = True
        elif type(x) is _ARRAY and x.is_deleted():
            deleted[0] = True
        return x

    args, kwargs = jax.tree.map(take, (args, kwargs), is_leaf=_is_per_replica)
    return args, kwargs, counts, deleted[0]


def _with_counts(program: Callable[[Any, Any], Any]) -> Callable[[Any, Any, list[Any]], Any]:
    """``program`` taking the counts that `_counts_apart` took out as a third argument."""

    def apart(args: Any, kwargs: Any, counts: list[Any]) -> Any:
        it = iter(counts)

        def put(x: Any) -> Any:
            return _per_replica(None, (x.array, next(it))) if type(x) is PerReplica else x

        return program(*jax.tree.map(put, (args, kwargs), is_leaf=_is_per_replica))

    apart.__name__ = apart.__qualname__ = getattr(program, "__name__", "program")
    return apart


def _donating(jitted: Callable[..., Any], where: str) -> Callable[[Any, Any], Any]:
    def call(args: Any, kwargs: Any) -> Any:
        args, kwargs, counts, deleted = _counts_apart(args, kwargs)
        # A buffer donated by an earlier call and passed again crashes XLA's CPU runtime
        # (segmentation fault with jax 0.10): refuse it first.
        if deleted:
            raise _donated_error(where, args, kwargs)
        return jitted(args, kwargs, counts)

    return call


_HOLDS_PER_REPLICA: dict[Any, bool] = {}  # by tree structure of the donated arguments


def _split_donated(
    args: tuple[Any, ...], kwargs: Any, nums: tuple[int, ...]
) -> tuple[Any, Any, Any, list[Any]]:
    """(the donated arguments without their valid counts, the others, kwargs, the
    counts): the jitted arguments of a program donating ``nums``. Donated arguments
    without `PerReplica` values (parameters, optimizer state: the usual case) are not
    walked in Python; whether they hold any is decided once per tree structure."""
    donated = tuple(args[i] for i in nums)
    kept = tuple(x for i, x in enumerate(args) if i not in nums)
    if not _holds_per_replica(donated, jax.tree.structure(donated)):
        return donated, kept, kwargs, []
    donated, _, counts, _ = _counts_apart(donated, {})
    return donated, kept, kwargs, counts


def _holds_per_replica(donated: Any, treedef: Any) -> bool:
    """Whether the donated arguments (of tree structure ``treedef``) hold `PerReplica`
    values; decided once per structure."""
    holds = _HOLDS_PER_REPLICA.get(treedef)
    if holds is None:
        found = jax.tree.leaves(donated, is_leaf=_is_per_replica)
        holds = _HOLDS_PER_REPLICA[treedef] = any(type(x) is PerReplica for x in found)
    return holds


def _deleted(x: Any) -> bool:
    return type(x) is _ARRAY and x.is_deleted()


def _leaves_deleted(leaves: list[Any]) -> bool:
    """Whether an array among ``leaves`` was deleted (donated): one C-level pass when
    they are all concrete arrays (the usual case), else one test per leaf."""
    try:
        return any(map(_ARRAY.is_deleted, leaves))
    except TypeError:  # a leaf of another type (a NumPy array, a Python number)
        return any(map(_deleted, leaves))


def _some_donated(
    program: Callable[[Any, Any], Any], nums: tuple[int, ...]
) -> Callable[[Any, Any, Any, list[Any]], Any]:
    """``program`` taking its arguments split as `_split_donated` splits them."""

    def split(donated: Any, kept: Any, kwargs: Any, counts: list[Any]) -> Any:
        it = iter(counts)

        def put(x: Any) -> Any:
            return _per_replica(None, (x.array, next(it))) if type(x) is PerReplica else x

        donated = jax.tree.map(put, donated, is_leaf=_is_per_replica)
        d, k = iter(donated), iter(kept)
        args = tuple(next(d) if i in nums else next(k) for i in range(len(nums) + len(kept)))
        return program(args, kwargs)

    split.__name__ = split.__qualname__ = getattr(program, "__name__", "program")
    return split


def _flat_donated(
    program: Callable[[Any, Any], Any], nums: tuple[int, ...]
) -> Callable[[Any, list[Any], tuple[Any, ...], Any], Any]:
    """``program`` taking the donated arguments as their flat leaves (after their tree
    structure, a static argument) and the other arguments as they are."""

    def flat(treedef: Any, leaves: list[Any], kept: tuple[Any, ...], kwargs: Any) -> Any:
        d, k = iter(jax.tree.unflatten(treedef, leaves)), iter(kept)
        args = tuple(next(d) if i in nums else next(k) for i in range(len(nums) + len(kept)))
        return program(args, kwargs)

    flat.__name__ = flat.__qualname__ = getattr(program, "__name__", "program")
    return flat


def _donating_some(
    jitted: Callable[..., Any], flat: Callable[..., Any], nums: tuple[int, ...], where: str
) -> Callable[[Any, Any], Any]:
    """The per-call path of a program donating the arguments ``nums``.

    The donated arguments are flattened once here and their buffers checked in
    one pass. Without `PerReplica` values (parameters, optimizer state: the
    usual case) their leaves go to ``flat`` as a list (jit then walks no tree
    for them); others take `_split_donated` and ``jitted``, which keep the
    batches' shared valid counts undonated."""
    nums_set = frozenset(nums)

    def call(args: Any, kwargs: Any) -> Any:
        if nums[-1] >= len(args):
            raise ValueError(
                f"{where}: RunOptions(donate_argnums={nums}) names argument {nums[-1]}, but "
                f"the function was called with {len(args)} positional argument(s) (after ctx)."
            )
        donated = tuple(args[i] for i in nums)
        leaves, treedef = jax.tree.flatten(donated)
        # A buffer donated by an earlier call and passed again crashes XLA's CPU runtime
        # (segmentation fault with jax 0.10): refuse it first.
        if _leaves_deleted(leaves):
            raise _donated_error(where, args, kwargs, "RunOptions(donate_argnums=...)")
        kept = tuple(x for i, x in enumerate(args) if i not in nums_set)
        # An array both donated and passed again (``f(a, a)``) makes XLA's CPU runtime
        # reuse a buffer it also reads (a segmentation fault with plain JAX too): refuse.
        # The usual call passes distinct objects: one set of ids tells, and only a repeated
        # id (a shared valid count, a small int, or a real alias) takes the exact check.
        ids = set(map(id, leaves))
        if len(ids) < len(leaves) or not ids.isdisjoint(map(id, jax.tree.leaves((kept, kwargs)))):
            aliased = _aliased(donated, args, kwargs)
            if aliased:
                raise _aliased_error(where, args, kwargs, nums, aliased)
        if not _holds_per_replica(donated, treedef):
            return flat(treedef, leaves, kept, kwargs)
        return jitted(*_split_donated(args, kwargs, nums))

    call.donate_argnums = nums  # type: ignore[attr-defined]
    return call


def _donated_error(
    where: str, args: Any, kwargs: Any, option: str = "RunOptions(donate_args=True)"
) -> RuntimeError:
    flat = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    paths = [path_str(p) for p, x in flat if type(x) is _ARRAY and x.is_deleted()]
    return DonatedArgumentError(
        f"{where}: {', '.join(paths)} {'was' if len(paths) == 1 else 'were'} donated to an "
        f"earlier call ({option} gives the arguments' buffers to the "
        "outputs): pass the values that call returned, or copy the arguments first "
        "(jnp.copy), or run without donation."
    )


def _aliased(donated: tuple[Any, ...], args: Any, kwargs: Any) -> set[int]:
    """The ids of donated arrays (plain leaves, or a `PerReplica`'s data; a batch's shared
    valid counts are never donated) that appear more than once among the arguments."""
    ids = [
        id(x.array if isinstance(x, PerReplica) else x)
        for x in jax.tree.leaves(donated, is_leaf=lambda x: isinstance(x, PerReplica))
        if type(x) is _ARRAY or isinstance(x, PerReplica)
    ]
    if not ids:
        return set()
    wanted = set(ids)
    counts: dict[int, int] = {}
    for x in jax.tree.leaves((args, kwargs)):
        if id(x) in wanted:
            counts[id(x)] = counts.get(id(x), 0) + 1
    return {i for i, n in counts.items() if n > 1}


def _aliased_error(
    where: str, args: Any, kwargs: Any, nums: tuple[int, ...], aliased: set[int]
) -> ValueError:
    """The arguments that pass one donated array twice."""
    seen: dict[int, str] = {}
    pairs = []
    for p, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if id(x) in aliased:
            name = path_str(p)
            if id(x) in seen:
                pairs.append(f"{seen[id(x)]} and {name}")
            else:
                seen[id(x)] = name
    return ValueError(
        f"{where}: {'; '.join(pairs)} are the same array, and RunOptions(donate_argnums="
        f"{nums}) donates one of them: the program would overwrite a buffer it also reads. "
        "Pass a copy (jnp.copy(x)) as one of them, or do not donate it."
    )


class CompiledStep:
    """A replica function compiled ahead of time; call it with the step's arguments."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(args, kwargs)

    def as_text(self) -> str:
        return self._compiled.as_text()

    def __getattr__(self, name: str) -> Any:  # cost_analysis, memory_analysis, ...
        return getattr(self._compiled, name)


class LoweredStep:
    """A replica function lowered for given arguments (``strategy.function(f).lower(...)``)."""

    def __init__(self, lowered: Any) -> None:
        self._lowered = lowered

    def compile(self) -> CompiledStep:
        return CompiledStep(self._lowered.compile())

    def as_text(self) -> str:
        return self._lowered.as_text()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


# The cache ----------------------------------------------------------------------

# Re-entrant: a function's finalizer (`_forget`) can run in a garbage collection that
# starts while this thread holds the lock inside `program_for` (building a jit allocates).
_lock = threading.RLock()
_cache: collections.OrderedDict[Hashable, Program] = collections.OrderedDict()
_size = [DEFAULT_CACHE_SIZE]
_programs_per_code: dict[Any, int] = {}
_warned: set[Any] = set()


def set_program_cache_size(size: int) -> None:
    """Sets how many compiled replica programs jaxdist keeps (least recently used first out).

    Each program holds the executables of one replica function for one
    strategy and options (one per argument signature). The default is 256.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"jaxdist.experimental.set_program_cache_size: size must be an int >= 1, got {size!r}."
        )
    with _lock:
        _size[0] = size
        while len(_cache) > size:
            _cache.popitem(last=False)


def get_program_cache_size() -> int:
    """The current bound set by `set_program_cache_size`."""
    return _size[0]


def cached_program_count() -> int:
    """How many programs the cache holds now (for tests)."""
    return len(_cache)


def _function_key(fn: Callable[..., Any]) -> tuple[Hashable, Callable[[], Any]]:
    """A cache key for ``fn`` and a callable returning it (a weak reference if possible).

    Bound methods are keyed by their function and instance, so ``obj.step`` (a new
    method object on every attribute access) finds its program again.
    """
    if isinstance(fn, types.MethodType):
        return ("method", fn.__func__, id(fn.__self__)), weakref.WeakMethod(fn)
    try:
        return id(fn), weakref.ref(fn)
    except TypeError:  # not weak-referenceable: kept alive by the cache (bounded)
        return ("strong", fn), lambda: fn


def _code_of(fn: Any) -> Any:
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def _note_new_program(fn: Callable[..., Any], strategy: StrategyLike) -> None:
    code = _code_of(fn)
    if code is None:
        return
    key = (code, strategy)
    count = _programs_per_code.get(key, 0) + 1
    _programs_per_code[key] = count
    if count > RECOMPILE_WARNING_AFTER and code not in _warned:
        _warned.add(code)
        name = getattr(code, "co_name", "fn")
        warnings.warn(
            f"{type(strategy).__name__}.run: the replica function {name!r} "
            f"({code.co_filename}:{code.co_firstlineno}) was compiled {count} times, once per "
            "new function object: a lambda, closure or functools.partial created on every "
            "step is a new function each time, and each one is traced and compiled again. "
            "Create the step once, e.g. `step = strategy.function(train_step)` outside the "
            "loop, and call `step(...)`.",
            RuntimeWarning,
            stacklevel=4,
        )


def program_for(
    fn: Callable[..., Any],
    strategy: StrategyLike,
    options: RunOptions | None,
    *,
    plain: bool = False,
) -> Program:
    """The cached `Program` of ``fn`` under ``strategy`` and ``options`` (built if needed)."""
    fkey, ref = _function_key(fn)
    key = (fkey, strategy, options, plain)
    program = _cache.get(key)
    if program is not None:
        with contextlib.suppress(KeyError):  # evicted by another thread meanwhile
            _cache.move_to_end(key)  # least recently used leaves first
        return program
    with _lock:
        program = _cache.get(key)
        if program is not None:
            return program
        program = Program(ref, strategy, options, plain)
        owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
        # The entry goes when the function does (before its id can be reused).
        with contextlib.suppress(TypeError):
            weakref.finalize(owner, _forget, key)
        _cache[key] = program
        while len(_cache) > _size[0]:
            _cache.popitem(last=False)
    _note_new_program(fn, strategy)
    return program


def _forget(key: Hashable) -> None:
    with _lock:
        _cache.pop(key, None)
