"""Ray for the parameter-server strategy: the import, a loopback runtime, and the
environment every jaxdist actor starts with.

Ray is the optional extra ``jaxdist[ps]``. jaxdist uses the caller's Ray runtime when one is
running (``ray.init(address=...)`` for a cluster, or ``RAY_ADDRESS``), and otherwise starts a
local one (`start_local`) bound to loopback with the dashboard off. It never shuts Ray down:
the runtime is the caller's.

Loopback, checked with Ray 2.60: ``ray.init(_node_ip_address="127.0.0.1")`` alone is not
enough, because `ray.init` passes the node address through
``ray._private.services.resolve_ip_for_localhost``, which swaps a loopback address for the
machine's routable one wherever multi-node clusters are enabled (Linux; macOS and Windows
keep loopback). With that address the GCS, the raylet's two ports, every worker's and
actor's RPC port and an agent's port listen on every interface (``::`` or ``0.0.0.0``),
the runtime-env agent on the machine's address: all reachable from other hosts (Ray's
token authentication, on by default in 2.60, is what guards them). With the node address
127.0.0.1 each of them listens on loopback only, so `start_local` sets Ray's own switch for
that rule (``ray_constants.ENABLE_RAY_CLUSTER``, which the
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` variable sets at import) to false for the length of
its `ray.init` call: the node address stays ``127.0.0.1`` and every listening socket of the
runtime is on 127.0.0.1 (IPv6 sockets on ``::ffff:127.0.0.1``). The switch matters only
while the head node starts; processes Ray starts later take the node address from the
raylet. "Dashboard off" is ``include_dashboard=False``: no web UI and no dashboard address;
Ray still runs its dashboard head process with ``--minimal --disable-frontend`` for its
internal modules, on loopback like the rest. A runtime the caller starts or connects to is
left as the caller made it.

Actors do not inherit the driver's ``sys.path``, so every actor gets a ``runtime_env`` whose
``PYTHONPATH`` leads with the directory this jaxdist was imported from. Its JAX runs on the
CPU with one device and one thread by default; set ``JAXDIST_PS_<NAME>`` in the
coordinator's environment to change variable ``<NAME>`` of `_JAX_ENV` for the actors (for
example ``JAXDIST_PS_JAX_PLATFORMS=cuda`` for workers with GPUs).
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any

try:
    import ray
    from ray import cloudpickle
    from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

    try:  # where `ray start` records the cluster it joined: Ray 2.50 and later, then older
        from ray._common.utils import get_ray_address_file
    except ImportError:  # pragma: no cover - older Ray
        from ray._private.utils import (  # type: ignore[attr-defined,no-redef,unused-ignore]
            get_ray_address_file,
        )
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "jaxdist's ParameterServerStrategy runs on Ray, which is not installed; install the "
        "extra: pip install 'jaxdist[ps]'."
    ) from e

__all__ = [
    "ActorDiedError",
    "RayActorError",
    "RayTaskError",
    "actor_env",
    "address_file",
    "cloudpickle",
    "ensure_ray",
    "forget_address",
    "ray",
    "start_local",
]

# The directory holding the `jaxdist` package this process imported.
_ROOT = str(pathlib.Path(__file__).resolve().parents[3])

# JAX settings for actors: CPU, one device, one thread (a parameter server or worker task
# shares its machine with others). JAXDIST_PS_<NAME> in the caller's environment overrides
# <NAME>.
_JAX_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_NUM_CPU_DEVICES": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def ensure_ray() -> None:
    """Starts a local Ray runtime (loopback, no dashboard) unless one is already running."""
    if ray.is_initialized():
        return
    with warnings.catch_warnings():
        # Ray starts its processes with subprocess (fork, then exec at once): JAX's warning
        # about forking a multithreaded process does not apply.
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        _init()


def _init() -> None:
    address = os.environ.get("RAY_ADDRESS")
    if address:  # the caller's runtime
        ray.init(address=address, configure_logging=False, log_to_driver=True)
    else:
        start_local()


def start_local(**kwargs: Any) -> None:
    """Starts a new local Ray runtime listening on loopback only, dashboard off.

    ``kwargs`` go to `ray.init` (``num_cpus=`` for example). See the module docstring for
    why Ray's cluster switch is off while the head node starts.
    """
    from ray._private import ray_constants  # Ray's switch; read by resolve_ip_for_localhost

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            address="local",
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            configure_logging=False,
            log_to_driver=True,
            **kwargs,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def actor_env(overrides: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``runtime_env`` of a jaxdist actor: this jaxdist on its path, JAX on the CPU."""
    env = {k: os.environ.get(f"JAXDIST_PS_{k}", v) for k, v in _JAX_ENV.items()}
    path = [_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    env.update(overrides or {})
    return {"env_vars": env}


def address_file() -> str:
    """Where ``ray start`` records the cluster it joined (Ray's default temp directory)."""
    return str(get_ray_address_file(None))


def forget_address(address: str) -> None:
    """Removes ``ray start``'s record of the cluster at ``address`` (``ray_current_cluster``
    in Ray's temp directory), as ``ray stop`` does, when it still names that cluster: left
    behind, it makes a later plain ``ray.init(num_cpus=...)`` on this machine try to join
    the stopped cluster and fail."""
    path = address_file()
    try:
        with open(path) as f:
            recorded = f.read().strip()
        if recorded == address.strip():
            os.remove(path)
    except OSError:
        pass
