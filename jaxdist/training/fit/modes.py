"""Train and eval modes of the NNX modules among `jaxdist.fit`'s state.

`fit` runs its ``eval_step`` with every NNX module in evaluation mode
(``module.eval()``: Flax sets ``deterministic=True`` on dropout layers and
``use_running_average=True`` on batch norms) and puts each module's mode back as
it was afterwards: for a model built for training that is ``module.train()``, and a
layer the user froze on purpose (a ``BatchNorm`` built with
``use_running_average=True``) stays frozen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from jaxdist.training.step.nnx import nnx_module

__all__ = ["MODE_ATTRIBUTES", "eval_mode"]

# The attributes Flax's ``Module.eval()`` / ``Module.train()`` set.
MODE_ATTRIBUTES = ("deterministic", "use_running_average")


@contextlib.contextmanager
def eval_mode(state: Sequence[Any]) -> Iterator[None]:
    """Every NNX module in ``state`` (at any depth) in eval mode inside the block, as
    ``Module.eval()`` sets it; each attribute is put back as it was afterwards."""
    nnx = nnx_module()
    objects = () if nnx is None else tuple(s for s in state if isinstance(s, nnx.Pytree))
    saved = []
    if objects:
        assert nnx is not None
        saved = [
            (node, name, vars(node)[name])
            for _, node in nnx.iter_graph(objects)
            if isinstance(node, nnx.Module)
            for name in MODE_ATTRIBUTES
            if name in vars(node)
        ]
    for node, name, _ in saved:  # what ``Module.eval()`` sets, also in modules held by
        setattr(node, name, True)  # other NNX objects (an ``nnx.ModelAndOptimizer``)
    try:
        yield
    finally:
        for node, name, value in saved:
            setattr(node, name, value)
