"""jaxdist: tf.distribute's programming model for JAX.

Only the names in `_PUBLIC` below (and the modules in `_SUBMODULES`:
``jaxdist.experimental``, ``training``, ``checkpoint``, ``data``, ``errors``,
``cluster_resolver``, ``tpu`` and the launcher ``jaxdist.launch``) are public;
every other module is internal.

`_PUBLIC` is the one table of public names: each name and the module that defines
it. ``__all__`` is made from it, and names are loaded from it when first used
(PEP 562): ``import jaxdist`` costs nothing until a name is looked up, so the
launcher (``python -m jaxdist.launch``, which needs only the standard library)
starts without importing JAX. The ``TYPE_CHECKING`` block shows type checkers the
same names; ``tests/package/test_package.py`` checks that it matches the table.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the table below, spelled out for type checkers and IDEs
    from jaxdist import (
        checkpoint,
        cluster_resolver,
        data,
        errors,
        experimental,
        tpu,
        training,
    )
    from jaxdist._scope import (
        experimental_set_strategy,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from jaxdist.cluster_resolver.initialize import (
        initialize,
    )
    from jaxdist.collectives.cross_device_ops import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReductionToOneDevice,
    )
    from jaxdist.context import (
        ReplicaContext,
        get_replica_context,
    )
    from jaxdist.experimental import (
        coordinator,
    )
    from jaxdist.experimental.parameter_server.server import (
        Server,
    )
    from jaxdist.experimental.parameter_server.strategy import (
        ParameterServerStrategy,
    )
    from jaxdist.input.dataset import (
        DistributedDataset,
        DistributedIterator,
    )
    from jaxdist.input.options import (
        InputContext,
        InputOptions,
        InputReplicationMode,
    )
    from jaxdist.run_options import (
        RunOptions,
    )
    from jaxdist.strategies.base import (
        Strategy,
    )
    from jaxdist.strategies.central_storage import (
        CentralStorageStrategy,
    )
    from jaxdist.strategies.extended import (
        StrategyExtended,
    )
    from jaxdist.strategies.mirrored import (
        MirroredStrategy,
    )
    from jaxdist.strategies.multi_worker import (
        MultiWorkerMirroredStrategy,
    )
    from jaxdist.strategies.one_device import (
        OneDeviceStrategy,
    )
    from jaxdist.strategies.tpu import (
        TPUStrategy,
    )
    from jaxdist.training.fit.fit import (
        fit,
    )
    from jaxdist.training.step.accumulate import (
        accumulate_gradients,
    )
    from jaxdist.training.step.losses import (
        compute_average_loss,
        scale_regularization_loss,
    )
    from jaxdist.training.step.state import (
        TrainState,
    )
    from jaxdist.training.step.train_step import (
        train_step,
    )
    from jaxdist.values.distributed import (
        DistributedValues,
        Mirrored,
        PerReplica,
    )
    from jaxdist.values.reduce_op import (
        ReduceOp,
    )
    from jaxdist.variables._variable import (
        Variable,
    )
    from jaxdist.variables.meta import (
        VariableAggregation,
        VariableSynchronization,
    )

__version__ = "0.1.0"

# The public names, and the module that defines each.
_PUBLIC: dict[str, str] = {
    "CentralStorageStrategy": "jaxdist.strategies.central_storage",
    "CrossDeviceOps": "jaxdist.collectives.cross_device_ops",
    "DistributedDataset": "jaxdist.input.dataset",
    "DistributedIterator": "jaxdist.input.dataset",
    "DistributedValues": "jaxdist.values.distributed",
    "HierarchicalCopyAllReduce": "jaxdist.collectives.cross_device_ops",
    "InputContext": "jaxdist.input.options",
    "InputOptions": "jaxdist.input.options",
    "InputReplicationMode": "jaxdist.input.options",
    "Mirrored": "jaxdist.values.distributed",
    "MirroredStrategy": "jaxdist.strategies.mirrored",
    "MultiWorkerMirroredStrategy": "jaxdist.strategies.multi_worker",
    "NcclAllReduce": "jaxdist.collectives.cross_device_ops",
    "OneDeviceStrategy": "jaxdist.strategies.one_device",
    "ParameterServerStrategy": "jaxdist.experimental.parameter_server.strategy",
    "PerReplica": "jaxdist.values.distributed",
    "ReduceOp": "jaxdist.values.reduce_op",
    "ReductionToOneDevice": "jaxdist.collectives.cross_device_ops",
    "ReplicaContext": "jaxdist.context",
    "Server": "jaxdist.experimental.parameter_server.server",
    "RunOptions": "jaxdist.run_options",
    "Strategy": "jaxdist.strategies.base",
    "StrategyExtended": "jaxdist.strategies.extended",
    "TPUStrategy": "jaxdist.strategies.tpu",
    "TrainState": "jaxdist.training.step.state",
    "Variable": "jaxdist.variables._variable",
    "VariableAggregation": "jaxdist.variables.meta",
    "VariableSynchronization": "jaxdist.variables.meta",
    "accumulate_gradients": "jaxdist.training.step.accumulate",
    "compute_average_loss": "jaxdist.training.step.losses",
    "coordinator": "jaxdist.experimental",
    "experimental_set_strategy": "jaxdist._scope",
    "fit": "jaxdist.training.fit.fit",
    "get_replica_context": "jaxdist.context",
    "get_strategy": "jaxdist._scope",
    "has_strategy": "jaxdist._scope",
    "in_cross_replica_context": "jaxdist._scope",
    "initialize": "jaxdist.cluster_resolver.initialize",
    "scale_regularization_loss": "jaxdist.training.step.losses",
    "train_step": "jaxdist.training.step.train_step",
}
# Public submodules.
_SUBMODULES: tuple[str, ...] = (
    "checkpoint",
    "cluster_resolver",
    "data",
    "errors",
    "experimental",
    "tpu",
    "training",
)

# Names that need Ray (the ``[ps]`` extra): left out of ``from jaxdist import *`` when it is
# not installed, so the star import works without it (``jd.Server`` then says what to install).
_NEEDS_RAY = frozenset({"ParameterServerStrategy", "Server", "coordinator"})
_HAS_RAY = importlib.util.find_spec("ray") is not None

__all__ = [*(n for n in _PUBLIC if _HAS_RAY or n not in _NEEDS_RAY), *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxdist.{name}")
    home = _PUBLIC.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
