"""`TrainState`: the functional training state of Linen and pure-function models."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist._scope import current_state
from jaxdist.training.step.state_placement import placed_copy

__all__ = ["TrainState"]


def _apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, keeping each parameter's dtype (as optax does)."""
    return jax.tree.map(
        lambda p, u: None if p is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype),
        params,
        updates,
        is_leaf=lambda x: x is None,
    )


class TrainState:
    """Step counter, parameters and optimizer state of a model, as one immutable pytree.

    For Linen modules and pure functions (NNX models update themselves in place
    through `jaxdist.train_step`). ``apply_fn`` and ``tx`` (an optax
    ``GradientTransformation``) are static; ``step``, ``params``, ``opt_state``
    and any extra fields given to `create` (``batch_stats``, an RNG key, ...)
    are pytree children.

    Inside a train step, `apply_gradients` with all-reduced gradients returns a
    state that is the same on every replica, so it comes back as one replicated
    copy, not one per replica, and costs no communication beyond the gradient
    all-reduce.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxdist as jd
        >>> state = jd.TrainState.create(
        ...     apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.ones((2, 1))},
        ...     tx=optax.sgd(0.5))
        >>> state = state.apply_gradients(grads={"w": jnp.ones((2, 1))})
        >>> int(state.step), state.params["w"].ravel().tolist()
        (1, [0.5, 0.5])
    """

    __slots__ = ("apply_fn", "extra", "opt_state", "params", "step", "tx")

    step: Any
    params: Any
    opt_state: Any
    apply_fn: Callable[..., Any] | None
    tx: Any
    extra: dict[str, Any]

    def __init__(
        self,
        *,
        step: Any,
        params: Any,
        opt_state: Any,
        apply_fn: Callable[..., Any] | None,
        tx: Any,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "step", step)
        setattr_(self, "params", params)
        setattr_(self, "opt_state", opt_state)
        setattr_(self, "apply_fn", apply_fn)
        setattr_(self, "tx", tx)
        setattr_(self, "extra", dict(extra or {}))

    @classmethod
    def create(
        cls, *, apply_fn: Callable[..., Any] | None, params: Any, tx: Any, **extra: Any
    ) -> TrainState:
        """A state at step 0 with ``opt_state = tx.init(params)``.

        Created inside ``strategy.scope()``, its arrays are placed replicated on
        the strategy's devices, ready for the first step.
        """
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                f"TrainState.create: tx must be an optax GradientTransformation (with init and "
                f"update), got {type(tx).__name__}. For example tx=optax.adamw(1e-3)."
            )
        clash = sorted(set(extra) & {"step", "params", "opt_state", "apply_fn", "tx", "extra"})
        if clash:
            raise ValueError(f"TrainState.create: extra field names {clash} are reserved.")
        state = cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            apply_fn=apply_fn,
            tx=tx,
            extra=extra,
        )
        strategy = current_state().strategy
        if strategy is not None:
            # own buffers: steps donate them
            state = placed_copy(state, strategy.replicated_sharding)
        return state

    def __getattr__(self, name: str) -> Any:
        extra = object.__getattribute__(self, "extra")
        if name in extra:
            return extra[name]
        raise AttributeError(
            f"TrainState has no field {name!r}; its fields are step, params, opt_state, "
            f"apply_fn, tx and the extras {sorted(extra)} given to TrainState.create."
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"TrainState is immutable; use state.replace({name}=...) to get a new state."
        )

    def replace(self, **changes: Any) -> TrainState:
        """A copy with the given fields (or extra fields) changed."""
        fields = {
            "step": self.step,
            "params": self.params,
            "opt_state": self.opt_state,
            "apply_fn": self.apply_fn,
            "tx": self.tx,
        }
        extra = dict(self.extra)
        for k, v in changes.items():
            if k in fields:
                fields[k] = v
            elif k in extra:
                extra[k] = v
            else:
                raise AttributeError(
                    f"TrainState.replace: unknown field {k!r}; fields are {sorted(fields)} "
                    f"and extras {sorted(extra)} (add extras with TrainState.create)."
                )
        return TrainState(**fields, extra=extra)

    def apply_gradients(self, *, grads: Any, **changes: Any) -> TrainState:
        """One optimizer step: ``params`` moved by ``tx``'s update for ``grads``, ``step + 1``.

        Other fields given as keywords are replaced as in `replace`.
        """
        if self.tx is None:
            raise ValueError("TrainState.apply_gradients: this state has no optimizer (tx=None).")
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=_apply_updates(self.params, updates),
            opt_state=opt_state,
            **changes,
        )

    def __repr__(self) -> str:
        extras = "".join(f", {k}=..." for k in self.extra)
        return f"TrainState(step={self.step!r}, params=..., opt_state=...{extras})"


_NO_KEYS: tuple[str, ...] = ()


# flatten/unflatten run on every step's arguments and outputs: kept to plain attribute work.
def _flatten(s: TrainState) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    extra = s.extra
    if not extra:
        return (s.step, s.params, s.opt_state), (s.apply_fn, s.tx, _NO_KEYS)
    keys = tuple(sorted(extra))
    children = (s.step, s.params, s.opt_state, *(extra[k] for k in keys))
    return children, (s.apply_fn, s.tx, keys)


def _flatten_with_keys(s: TrainState) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    children, aux = _flatten(s)
    names = ("step", "params", "opt_state", *aux[2])
    return tuple(
        (jax.tree_util.GetAttrKey(n), c) for n, c in zip(names, children, strict=True)
    ), aux


_new = object.__new__
_set = object.__setattr__


def _unflatten(aux: tuple[Any, ...], children: Any) -> TrainState:
    apply_fn, tx, keys = aux
    s = _new(TrainState)
    _set(s, "step", children[0])
    _set(s, "params", children[1])
    _set(s, "opt_state", children[2])
    _set(s, "apply_fn", apply_fn)
    _set(s, "tx", tx)
    _set(s, "extra", dict(zip(keys, children[3:], strict=True)) if keys else {})
    return s


jax.tree_util.register_pytree_with_keys(TrainState, _flatten_with_keys, _unflatten, _flatten)
