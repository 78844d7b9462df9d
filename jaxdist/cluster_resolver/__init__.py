"""Cluster resolvers: where the processes of a job are, and `jax.distributed` start-up.

The names of ``tf.distribute.cluster_resolver`` (`ClusterSpec`,
`ClusterResolver`, `SimpleClusterResolver`, `TFConfigClusterResolver`,
`SlurmClusterResolver`, `KubernetesClusterResolver`, `TPUClusterResolver`,
`UnionResolver`), a resolver for jaxdist's own launcher
(`LauncherClusterResolver`), and the start-up of `jax.distributed`
(`initialize`, `is_initialized`, `shutdown`, `resolve_default`). Every
resolver also gives `ClusterResolver.jax_initialize_kwargs`.
"""

from jaxdist.cluster_resolver.base import (
    ClusterResolver,
    SimpleClusterResolver,
    format_master_url,
    local_accelerators,
)
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec
from jaxdist.cluster_resolver.default import resolve_default
from jaxdist.cluster_resolver.initialize import initialize, is_initialized, shutdown
from jaxdist.cluster_resolver.kubernetes import KubernetesClusterResolver
from jaxdist.cluster_resolver.launcher import LauncherClusterResolver
from jaxdist.cluster_resolver.slurm import SlurmClusterResolver
from jaxdist.cluster_resolver.tf_config import TFConfigClusterResolver
from jaxdist.cluster_resolver.tpu import TPUClusterResolver
from jaxdist.cluster_resolver.union import UnionClusterResolver, UnionResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "KubernetesClusterResolver",
    "LauncherClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "UnionClusterResolver",
    "UnionResolver",
    "format_master_url",
    "initialize",
    "is_initialized",
    "local_accelerators",
    "resolve_default",
    "shutdown",
]
