"""Cluster resolvers and `initialize`: each fed the environment its platform sets.

Many cases port TensorFlow's own resolver tests
(``tensorflow/python/distribute/cluster_resolver/*_test.py`` and
``training/server_lib_test.py``); the expected values are TF's. No test
touches a network, a cloud or the real `jax.distributed.initialize`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import jax
import pytest

from jaxdist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    KubernetesClusterResolver,
    LauncherClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TPUClusterResolver,
    UnionClusterResolver,
    UnionResolver,
    format_master_url,
    initialize,
    is_initialized,
    local_accelerators,
    resolve_default,
    shutdown,
)
from jaxdist.cluster_resolver import default as default_mod
from jaxdist.cluster_resolver import slurm as slurm_mod
from jaxdist.cluster_resolver import tpu as tpu_mod
from jaxdist.cluster_resolver.slurm import expand_hostlist, expand_tasks_per_node

from _helpers import REPO

# `jaxdist.cluster_resolver.initialize` is the function; the module holds the seam to JAX.
init_mod = importlib.import_module("jaxdist.cluster_resolver.initialize")

# The real probes, before the autouse fixture replaces them.
REAL_SLURM_BACKEND_PROBE = slurm_mod.backends_initialized
REAL_GCE_METADATA = tpu_mod._gce_metadata

PS_WORKER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}
_ENV_PREFIXES = ("JAXDIST_", "SLURM_", "TPU_", "MEGASCALE_")
_ENV_NAMES = (
    "TF_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "CLOUD_TPU_TASK_ID",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "JAX_COORDINATOR_PORT",
)


def _no_metadata(key: str) -> str | None:
    raise AssertionError(f"the GCE metadata server was queried for {key!r}")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """No cluster variables, no GPU driver, no metadata server, no backend, no started runtime."""
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(slurm_mod, "_original_visible_devices", [])
    monkeypatch.setattr(slurm_mod, "_NVIDIA_GPUS_DIR", str(tmp_path / "no-driver"))
    monkeypatch.setattr(slurm_mod, "backends_initialized", lambda: False)
    monkeypatch.setattr(tpu_mod, "_gce_metadata", _no_metadata)
    monkeypatch.setattr(default_mod, "_running_in_cloud_tpu_vm", lambda: False)
    monkeypatch.setattr(init_mod, "_started", None)


def set_tf_config(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    raw = config if isinstance(config, str) else json.dumps(config)
    monkeypatch.setenv("TF_CONFIG", raw)


# --------------------------------------------------------------------------- ClusterSpec


def test_cluster_spec_string_conversion() -> None:
    spec = ClusterSpec({"ps": ["ps0:1111"], "worker": ["worker0:3333", "worker1:4444"]})
    assert str(spec) == (
        "ClusterSpec({'ps': ['ps0:1111'], 'worker': ['worker0:3333', 'worker1:4444']})"
    )


@pytest.mark.parametrize(
    "cluster", [PS_WORKER, {"ps": ["ps0:2222", "ps1:2222"], "worker": []}], ids=["dense", "empty"]
)
def test_cluster_spec_round_trips(cluster: dict[str, Any]) -> None:
    spec = ClusterSpec(cluster)
    for copy in (ClusterSpec(spec), ClusterSpec(spec.as_dict())):
        assert copy == spec and copy.as_dict() == spec.as_dict() and hash(copy) == hash(spec)
    assert spec.as_dict()["ps"] == ["ps0:2222", "ps1:2222"]


def test_cluster_spec_accessors() -> None:
    original = {**PS_WORKER, "sparse": {0: "sparse0:2222", 3: "sparse3:2222"}}
    spec = ClusterSpec(original)
    assert spec.as_dict() == original
    assert spec.jobs == ["ps", "worker", "sparse"]
    assert [spec.num_tasks(j) for j in ("ps", "worker", "sparse")] == [2, 3, 2]
    assert spec.task_address("ps", 0) == "ps0:2222"
    assert spec.task_address("sparse", 0) == "sparse0:2222"
    assert spec.task_indices("ps") == [0, 1] and spec.task_indices("sparse") == [0, 3]
    assert spec.job_tasks("worker") == PS_WORKER["worker"]
    assert spec.job_tasks("sparse") == ["sparse0:2222", None, None, "sparse3:2222"]
    for method in ("num_tasks", "task_indices", "job_tasks"):
        with pytest.raises(
            ValueError,
            match=rf"ClusterSpec.{method}\(job_name='unknown'\): no such job in cluster; its "
            r"jobs are \['ps', 'sparse', 'worker'\]",
        ):
            getattr(spec, method)("unknown")
    with pytest.raises(ValueError, match=r"no such job in cluster"):
        spec.task_address("unknown", 0)
    with pytest.raises(
        ValueError,
        match=r"task_address\(job_name='sparse', task_index=2\): no task with index 2 in job "
        r"'sparse'; its task indices are \[0, 3\]",
    ):
        spec.task_address("sparse", 2)


def test_cluster_spec_truth_and_equality() -> None:
    assert not ClusterSpec({}) and ClusterSpec({"job": ["host:port"]})
    assert ClusterSpec({}) == ClusterSpec({})
    assert ClusterSpec({"job": {0: "host:2222"}}) == ClusterSpec({"job": ["host:2222"]})
    assert ClusterSpec({"job": ["host:2222"]}) == {"job": ["host:2222"]}
    assert ClusterSpec({}) != ClusterSpec({"job": ["host:2223"]})
    assert ClusterSpec({"job1": ["host:2222"]}) != ClusterSpec({"job2": ["host:2222"]})
    assert ClusterSpec({"job": ["host:2222"]}) != ClusterSpec({"job": ["host:2223"]})
    assert ClusterSpec({"job": ["h:1", "h:2"]}) != ClusterSpec({"job": ["h:2", "h:1"]})
    assert ClusterSpec({"job": ["h:1"]}) != {"job": 3} and ClusterSpec({}) != 0
    assert len({ClusterSpec({"a": ["h:1"]}), ClusterSpec({"a": {0: "h:1"}})}) == 1


def test_cluster_spec_json_keys_and_immutability() -> None:
    spec = ClusterSpec(json.loads('{"worker": {"1": "w1:2222", "3": "w3:2222"}}'))
    assert spec.task_indices("worker") == [1, 3] and spec.task_address("worker", 3) == "w3:2222"
    given = {"worker": ["w0:1"]}
    spec = ClusterSpec(given)
    given["worker"].append("w1:1")
    spec.as_dict()["worker"].append("w2:1")  # type: ignore[union-attr]
    assert spec.num_tasks("worker") == 1
    with pytest.raises(AttributeError, match="ClusterSpec is immutable"):
        spec._jobs = {}  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cluster", "error", "match"),
    [
        (["w0:1"], TypeError, r"ClusterSpec\(cluster=...\): expected a dict mapping job names"),
        ({"worker": "w0:1"}, TypeError, r"the tasks of job 'worker' must be a list of addresses"),
        ({3: ["w0:1"]}, TypeError, r"job names must be strings, got int 3"),
        ({"worker": [2222]}, TypeError, r"the address of task 0 of job 'worker' must be a string"),
        ({"worker": {"a": "w:1"}}, TypeError, r"task index 'a' of job 'worker' must be an integer"),
        ({"worker": {-1: "w:1"}}, ValueError, r"task index -1 of job 'worker' is negative"),
        ({"worker": {1: "a:1", "1": "b:1"}}, ValueError, r"job 'worker' lists task 1 twice"),
    ],
)
def test_cluster_spec_errors(cluster: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ClusterSpec(cluster)


# ------------------------------------------------------------- Simple and Union resolvers


def test_simple_resolver_properties_and_setters() -> None:
    r = SimpleClusterResolver(
        ClusterSpec(PS_WORKER),
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    assert (r.task_type, r.task_id, r.environment, r.rpc_layer) == ("ps", 1, "cloud", "grpc")
    assert r.num_accelerators() == {"GPU": 8}
    r.task_type, r.task_id, r.rpc_layer = "worker", 2, "http"
    assert (r.task_type, r.task_id, r.rpc_layer) == ("worker", 2, "http")
    assert SimpleClusterResolver(ClusterSpec(PS_WORKER)).num_accelerators() == {}


def test_simple_resolver_master() -> None:
    r = SimpleClusterResolver(ClusterSpec(PS_WORKER))
    assert r.master("worker", 0, rpc_layer="grpc") == "grpc://worker0:2222"
    assert r.master("worker", 2, rpc_layer="grpc") == "grpc://worker2:2222"
    assert r.master("worker", 2) == "worker2:2222"
    assert r.master() == ""
    assert SimpleClusterResolver(PS_WORKER, master="m:1", rpc_layer="grpc").master() == "grpc://m:1"
    assert format_master_url("m:1", "grpc") == "grpc://m:1" and format_master_url("m:1") == "m:1"


def test_simple_resolver_errors() -> None:
    with pytest.raises(TypeError, match=r"SimpleClusterResolver\(cluster_spec=...\): expected"):
        SimpleClusterResolver(["w0:1"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SimpleClusterResolver\(master=...\): expected a string"):
        SimpleClusterResolver(PS_WORKER, master=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="abstract"):
        ClusterResolver()  # type: ignore[abstract]


def _union(*clusters: Any) -> UnionResolver:
    return UnionResolver(*(SimpleClusterResolver(ClusterSpec(c)) for c in clusters))


def test_union_single_and_non_overlapping() -> None:
    assert _union(PS_WORKER).cluster_spec() == ClusterSpec(PS_WORKER)
    merged = _union({"ps": PS_WORKER["ps"]}, {"worker": PS_WORKER["worker"]})
    assert merged.cluster_spec() == ClusterSpec(PS_WORKER)
    assert merged.master() == ""
    assert merged.master("worker", 1) == "worker1:2222"
    assert merged.master("worker", 1, rpc_layer="grpc") == "grpc://worker1:2222"


def test_union_properties_come_from_the_first() -> None:
    first = SimpleClusterResolver(
        PS_WORKER,
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    second = SimpleClusterResolver(
        {"ps": ["ps2:2222"]},
        task_type="worker",
        task_id=2,
        environment="local",
        num_accelerators={"GPU": 16},
        rpc_layer="http",
    )
    u = UnionResolver(first, second)
    assert (u.task_type, u.task_id, u.environment, u.rpc_layer) == ("ps", 1, "cloud", "grpc")
    assert u.num_accelerators() == {"GPU": 8}
    u.task_type, u.task_id, u.rpc_layer = "worker", 2, "http"
    assert (u.task_type, u.task_id, u.rpc_layer) == ("worker", 2, "http")
    # An override of 0 is an override (TF's `or` would fall back to the first resolver's 1).
    assert UnionResolver(first, task_id=0, task_type="worker").task_id == 0
    assert UnionClusterResolver is UnionResolver


def test_union_merging_rules() -> None:
    lists = _union({"worker": ["worker4:2222", "worker5:2222"]}, {"worker": PS_WORKER["worker"]})
    assert lists.cluster_spec().job_tasks("worker") == [
        "worker4:2222",
        "worker5:2222",
        "worker0:2222",
        "worker1:2222",
        "worker2:2222",
    ]
    sparse = _union(
        {"worker": {5: "worker4:2222", 9: "worker5:2222"}},
        {"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}},
    )
    assert sparse.cluster_spec().as_dict() == {
        "worker": {
            3: "worker0:2222",
            5: "worker4:2222",
            6: "worker1:2222",
            7: "worker2:2222",
            9: "worker5:2222",
        }
    }
    mixed = _union(
        {"worker": ["worker4:2222", "worker5:2222"]},
        {"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}},
    )
    assert mixed.cluster_spec().task_indices("worker") == [0, 1, 3, 6, 7]
    kept = _union({"worker": {1: "worker0:2222", 3: "worker1:2222", 5: "worker2:2222"}})
    assert kept.cluster_spec().task_indices("worker") == [1, 3, 5]


@pytest.mark.parametrize(
    "second", [{7: "worker2:2222", 3: "worker0:2222"}, {1: "worker0:2222", 2: "worker1:2222"}]
)
def test_union_conflicts_raise_key_error(second: dict[int, str]) -> None:
    first = {7: "worker4:2222", 9: "worker5:2222"} if 7 in second else ["w4:2222", "w5:2222"]
    u = _union({"worker": first}, {"worker": second})
    with pytest.raises(KeyError, match=r"duplicate keys detected when merging two ClusterSpecs"):
        u.cluster_spec()


def test_union_errors() -> None:
    with pytest.raises(ValueError, match=r"UnionResolver: at least one ClusterResolver"):
        UnionResolver()
    with pytest.raises(ValueError, match=r"unexpected keyword arguments \['environment'\]"):
        UnionResolver(SimpleClusterResolver(PS_WORKER), environment="x")
    with pytest.raises(TypeError, match=r"UnionResolver: argument 1 must be a ClusterResolver"):
        UnionResolver(SimpleClusterResolver(PS_WORKER), ClusterSpec(PS_WORKER))  # type: ignore[arg-type]


# ------------------------------------------------------------------- num_accelerators


def test_local_accelerators_counts_by_type() -> None:
    def devs(*platforms: str) -> list[Any]:
        return [NS(platform=p) for p in platforms]

    assert local_accelerators(devs("gpu", "gpu", "cpu")) == {"GPU": 2}
    assert local_accelerators(devs("cuda", "rocm")) == {"GPU": 2}
    assert local_accelerators(devs(*["tpu"] * 4)) == {"TPU": 4}
    assert local_accelerators(devs("cpu", "cpu")) == {}
    expected = {}
    non_cpu = [d for d in jax.local_devices() if d.platform != "cpu"]
    if non_cpu:  # a GPU/TPU machine: the local devices of its one platform
        expected = {non_cpu[0].platform.upper().replace("CUDA", "GPU"): len(non_cpu)}
    assert SimpleClusterResolver({}).num_accelerators() == {}
    assert TFConfigClusterResolver().num_accelerators() == expected


# ---------------------------------------------------------------- jax_initialize_kwargs

CHIEF_CLUSTER = {
    "chief": ["c0:2222"],
    "worker": ["w0:2222", "w1:2222"],
    "ps": ["p0:2222"],
    "evaluator": ["e0:2222"],
}


@pytest.mark.parametrize(
    ("task_type", "task_id", "process_id"), [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)]
)
def test_jax_kwargs_chief_first(task_type: str, task_id: int, process_id: int) -> None:
    r = SimpleClusterResolver(CHIEF_CLUSTER, task_type=task_type, task_id=task_id)
    assert r.jax_initialize_kwargs() == {
        "coordinator_address": "c0:2222",
        "num_processes": 3,
        "process_id": process_id,
    }


def test_jax_kwargs_without_chief_and_with_rpc_prefixes() -> None:
    cluster = {"worker": ["grpc://w0:2222", "grpc://w1:2223", "w2:2224"], "ps": ["p0:1"]}
    for i in range(3):
        kwargs = SimpleClusterResolver(
            cluster, task_type="worker", task_id=i
        ).jax_initialize_kwargs()
        assert kwargs == {"coordinator_address": "w0:2222", "num_processes": 3, "process_id": i}
    ipv6 = SimpleClusterResolver({"worker": ["[fe80::1]:2222"]}).jax_initialize_kwargs()
    assert ipv6 == {"coordinator_address": "[fe80::1]:2222", "num_processes": 1, "process_id": 0}


@pytest.mark.parametrize(
    ("cluster", "task", "match"),
    [
        ({}, ("worker", 0), r"the cluster spec is empty, which describes a one-process job"),
        ({"ps": ["p0:1"]}, ("ps", 0), r"the cluster has no 'chief' or 'worker' job \(its jobs "),
        ({"chief": ["a:1", "b:1"]}, ("chief", 0), r"has 2 chief tasks \[0, 1\]; a cluster has "),
        ({"worker": {0: "a:1", 2: "b:1"}}, ("worker", 0), r"job 'worker' has the sparse task "),
        (CHIEF_CLUSTER, (None, None), r"this process's task is unknown \(task_type=None, task_i"),
        (CHIEF_CLUSTER, ("evaluator", 0), r"task 'evaluator' 0 is not part of the JAX collectiv"),
        (CHIEF_CLUSTER, ("ps", 0), r"task 'ps' 0 is not part of the JAX collective group"),
        (CHIEF_CLUSTER, ("worker", 5), r"this process is task 'worker' 5, which the cluster doe"),
        (CHIEF_CLUSTER, ("worker", "1"), r"task_id must be an integer, got str '1'"),
        ({"worker": ["w0", "w1:1"]}, ("worker", 1), r"the coordinator address 'w0' is not 'ho"),
        ({"worker": ["w0:0", "w1:1"]}, ("worker", 1), r"coordinator address 'w0:0' is not 'hos"),
        ({"worker": ["a:1,b:1", "c:1"]}, ("worker", 1), r"'a:1,b:1', 'a:1,b' is not a host name"),
        ({"worker": ["fe80::1:1", "c:1"]}, ("worker", 1), r"'fe80::1' is not a host name or an"),
    ],
)
def test_jax_kwargs_errors(cluster: Any, task: tuple[Any, Any], match: str) -> None:
    r = SimpleClusterResolver(cluster, task_type=task[0], task_id=task[1])
    with pytest.raises(ValueError, match=r"SimpleClusterResolver.jax_initialize_kwargs\(\): "):
        r.jax_initialize_kwargs()
    with pytest.raises(ValueError, match=match):
        r.jax_initialize_kwargs()


# ------------------------------------------------------------------------- TF_CONFIG

TF_PS_WORKER = {"cluster": PS_WORKER, "task": {"type": "ps", "index": 0}}


def test_tf_config_reads_cluster_task_and_master(monkeypatch: pytest.MonkeyPatch) -> None:
    set_tf_config(monkeypatch, TF_PS_WORKER)
    r = TFConfigClusterResolver()
    assert r.cluster_spec() == ClusterSpec(PS_WORKER)
    assert r.master() == "ps0:2222"
    assert r.master("worker", 1) == "worker1:2222"
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("ps", 0, None, None)
    set_tf_config(monkeypatch, {**TF_PS_WORKER, "session_master": "sessionmaster:2222"})
    assert r.master() == "sessionmaster:2222"  # re-read on each call
    set_tf_config(monkeypatch, {**TF_PS_WORKER, "rpc_layer": "grpc", "environment": "cloud"})
    assert (r.master(), r.rpc_layer) == ("grpc://ps0:2222", "grpc")
    assert r.master(rpc_layer="") == "ps0:2222"  # TF: an explicit "" means no prefix
    # TF counts the task list: a sparse job's one task at index 1 is [None, "b:1"], two.
    set_tf_config(
        monkeypatch, {"cluster": {"worker": {"1": "b:1"}}, "task": {"type": "worker", "index": 1}}
    )
    assert TFConfigClusterResolver().master() == "b:1"


def test_tf_config_environment_is_the_constructors(monkeypatch: pytest.MonkeyPatch) -> None:
    # TF's resolver returns its constructor's environment, None when not given; it never
    # reads TF_CONFIG's "environment" entry.
    set_tf_config(monkeypatch, {**TF_PS_WORKER, "environment": "cloud"})
    assert TFConfigClusterResolver().environment is None
    assert TFConfigClusterResolver(environment="google").environment == "google"
    monkeypatch.delenv("TF_CONFIG")
    assert TFConfigClusterResolver().environment is None
    assert UnionResolver(TFConfigClusterResolver()).environment is None


def test_tf_config_parameter_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    set_tf_config(
        monkeypatch, {**TF_PS_WORKER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 1}}
    )
    r = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert (r.master(), r.task_type, r.task_id) == ("grpc://ps0:2222", "ps", 0)
    r.task_type, r.task_id, r.rpc_layer = "worker", 1, "test"
    assert (r.master(), r.task_type, r.task_id, r.rpc_layer) == (
        "test://worker1:2222",
        "worker",
        1,
        "test",
    )


def test_tf_config_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    set_tf_config(
        monkeypatch,
        {"cluster": {"123456": ["ps0:2222"], **PS_WORKER}, "task": {"type": 123456, "index": "1"}},
    )
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id) == ("123456", 1)
    set_tf_config(
        monkeypatch,
        {"cluster": {"worker": ["w0:1", "w1:1"]}, "task": {"type": "worker", "index": "0"}},
    )
    assert TFConfigClusterResolver(task_id=1).task_id == 1


@pytest.mark.parametrize(
    "config",
    [None, "", "   ", "{}", {"cluster": {"worker": ["worker0:2222"]}}],
    ids=["unset", "empty", "blank", "empty-object", "one-task"],
)
def test_tf_config_without_master(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    if config is not None:
        set_tf_config(monkeypatch, config)
    r = TFConfigClusterResolver()
    assert r.master() == ""
    if not isinstance(config, dict):
        assert (r.cluster_spec(), r.task_type, r.task_id, r.rpc_layer) == (
            ClusterSpec({}),
            None,
            None,
            None,
        )


def test_tf_config_chief_kwargs_and_sparse_json(monkeypatch: pytest.MonkeyPatch) -> None:
    set_tf_config(monkeypatch, {"cluster": CHIEF_CLUSTER, "task": {"type": "worker", "index": 1}})
    assert TFConfigClusterResolver().jax_initialize_kwargs() == {
        "coordinator_address": "c0:2222",
        "num_processes": 3,
        "process_id": 2,
    }
    set_tf_config(
        monkeypatch, {"cluster": {"worker": {"1": "w1:1"}}, "task": {"type": "worker", "index": 1}}
    )
    assert TFConfigClusterResolver().cluster_spec().job_tasks("worker") == [None, "w1:1"]


@pytest.mark.parametrize(
    ("config", "call", "match"),
    [
        ("{not json", "cluster_spec", r"the TF_CONFIG environment variable is not valid JSON"),
        ("[1, 2]", "task_type", r"TF_CONFIG environment variable must hold a JSON object with "),
        ({"task": "worker"}, "task_type", r"TF_CONFIG's 'task' entry must be an object such as"),
        ({"task": {"index": "one"}}, "task_id", r"TF_CONFIG's task.index must be an integer task"),
        ({"cluster": ["w0:1"]}, "cluster_spec", r"TF_CONFIG's 'cluster' entry must be an object"),
        ({"cluster": PS_WORKER}, "master", r"master\(\): this task is unknown \(task_type=None"),
    ],
)
def test_tf_config_errors(
    monkeypatch: pytest.MonkeyPatch, config: Any, call: str, match: str
) -> None:
    set_tf_config(monkeypatch, config)
    r = TFConfigClusterResolver()
    with pytest.raises(ValueError, match=match):
        attr = getattr(r, call)
        if callable(attr):
            attr()


# ----------------------------------------------------------------------------- Slurm


def test_expand_hostlist() -> None:
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("n[1,3]") == ["n1", "n3"]
    assert expand_hostlist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == [
        "n1",
        "n2",
        "m5",
        "o3",
        "o4",
        "o6",
        "o7",
        "o8",
        "o9",
    ]
    assert expand_hostlist("n[0001-0003],m5,o[009-011]") == [
        "n0001",
        "n0002",
        "n0003",
        "m5",
        "o009",
        "o010",
        "o011",
    ]
    assert expand_hostlist("t02n[13-16],t03n1,t04n[01-02,5]") == [
        "t02n13",
        "t02n14",
        "t02n15",
        "t02n16",
        "t03n1",
        "t04n01",
        "t04n02",
        "t04n5",
    ]
    assert expand_hostlist("r[1-2]-n[08-09].x") == [
        "r1-n08.x",
        "r1-n09.x",
        "r2-n08.x",
        "r2-n09.x",
    ]
    assert expand_hostlist("n[9-10]") == ["n9", "n10"]


@pytest.mark.parametrize("bad", ["", "n[1-2", "n1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "a,,b"])
def test_expand_hostlist_errors(bad: str) -> None:
    with pytest.raises(
        ValueError, match="expand_hostlist: invalid Slurm host list " + re.escape(repr(bad))
    ):
        expand_hostlist(bad)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    assert expand_tasks_per_node("13(x10)") == [13] * 10
    with pytest.raises(ValueError, match=r"invalid Slurm tasks-per-node list '2\(3\)' \(at"):
        expand_tasks_per_node("2(3)")


def slurm_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for key, value in values.items():
        monkeypatch.setenv(f"SLURM_{key}", value)


NODES3 = {"STEP_NODELIST": "t02n13,t02n41,t02n43"}


def test_slurm_simple_retrieval_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(monkeypatch, PROCID="0", STEP_NUM_TASKS="3", STEP_TASKS_PER_NODE="1(x3)", **NODES3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    r = SlurmClusterResolver()
    assert r.cluster_spec() == ClusterSpec(
        {"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]}
    )
    assert r.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert r.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert r.get_task_info() == ("worker", 0)
    assert r.jax_initialize_kwargs() == {
        "coordinator_address": "t02n13:8888",
        "num_processes": 3,
        "process_id": 0,
    }


PS1_WORKER2 = ClusterSpec({"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]})


def test_slurm_explicit_jobs_and_master(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(monkeypatch, PROCID="0", STEP_NUM_TASKS="3", **NODES3)
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    assert r.cluster_spec() == PS1_WORKER2
    assert (r.task_type, r.task_id) == ("ps", 0)
    r.task_type, r.task_id = "worker", 1
    assert r.master() == "grpc://t02n43:8888"
    r.rpc_layer = "ab"
    assert r.master("ps", 0) == "ab://t02n13:8888"
    assert r.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"
    assert (r.task_type, r.task_id) == ("worker", 1)  # overrides survive cluster_spec()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_slurm_task_per_node_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(monkeypatch, PROCID="0", STEP_NUM_TASKS="3", STEP_TASKS_PER_NODE="1(x3)", **NODES3)
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2}, gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False
    )
    assert r.cluster_spec() == PS1_WORKER2


@pytest.mark.parametrize(
    ("gpus_per_node", "gpus_per_task", "visible"), [(2, 1, "1"), (4, 2, "2,3")]
)
def test_slurm_multi_task_per_node_sets_gpus(
    monkeypatch: pytest.MonkeyPatch, gpus_per_node: int, gpus_per_task: int, visible: str
) -> None:
    slurm_env(monkeypatch, PROCID="1", STEP_NUM_TASKS="5", STEP_TASKS_PER_NODE="2(x2),1", **NODES3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, gpus_per_node=gpus_per_node, gpus_per_task=gpus_per_task
    )
    assert r.cluster_spec() == ClusterSpec(
        {
            "ps": ["t02n13:8888"],
            "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"],
        }
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible
    assert (r.task_type, r.task_id, r.num_accelerators()) == ("worker", 0, {"GPU": gpus_per_task})


def test_slurm_job_level_fallbacks_and_node_order(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(monkeypatch, PROCID="3", NTASKS="4", JOB_NODELIST="n[9-10]", TASKS_PER_NODE="2(x2)")
    r = SlurmClusterResolver(jobs={"chief": 1, "worker": 3}, port_base=7000)
    # Slurm's node order (n9 before n10), not string order; chief takes rank 0.
    assert r.cluster_spec() == ClusterSpec(
        {"chief": ["n9:7000"], "worker": ["n9:7001", "n10:7000", "n10:7001"]}
    )
    assert (r.task_type, r.task_id, r.num_accelerators()) == ("worker", 2, {})
    assert r.jax_initialize_kwargs() == {
        "coordinator_address": "n9:7000",
        "num_processes": 4,
        "process_id": 3,
    }
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # no GPUs: nothing set


def test_slurm_maps_gpus_through_the_jobs_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(
        monkeypatch, PROCID="1", STEP_NUM_TASKS="2", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="2"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    r = SlurmClusterResolver()
    assert r.num_accelerators() == {"GPU": 2}
    r.cluster_spec()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    r.cluster_spec()  # again: still mapped through the job's devices, not ours
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert SlurmClusterResolver().num_accelerators() == {"GPU": 2}  # a second resolver agrees


def test_slurm_gpu_detection(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    slurm_env(
        monkeypatch, PROCID="0", STEP_NUM_TASKS="1", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="1"
    )
    assert SlurmClusterResolver().num_accelerators() == {}
    driver = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (driver / bus).mkdir(parents=True)
    monkeypatch.setattr(slurm_mod, "_NVIDIA_GPUS_DIR", str(driver))
    assert SlurmClusterResolver(auto_set_gpu=False).num_accelerators() == {"GPU": 2}
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert SlurmClusterResolver(auto_set_gpu=False).num_accelerators() == {"GPU": 4}


def test_slurm_leaves_gpus_alone_once_jax_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(
        monkeypatch, PROCID="1", STEP_NUM_TASKS="2", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="2"
    )
    monkeypatch.setattr(slurm_mod, "backends_initialized", lambda: True)
    r = SlurmClusterResolver(gpus_per_node=2)
    with pytest.warns(
        RuntimeWarning,
        match=r"did not set CUDA_VISIBLE_DEVICES='1' for task 1 "
        r"because JAX's backend has already started",
    ):
        r.cluster_spec()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize(
    ("env", "kwargs", "error", "match"),
    [
        ({}, {}, RuntimeError, r"SLURM_PROCID is not set: this process is not running inside a "),
        ({"PROCID": "0"}, {}, RuntimeError, r"SLURM_STEP_NUM_TASKS or SLURM_NTASKS is not set"),
        ({"PROCID": "x"}, {}, RuntimeError, r"SLURM_PROCID='x' is not an integer"),
        (
            {"PROCID": "0", "STEP_NUM_TASKS": "3", **NODES3},
            {"tasks_per_node": 2},
            RuntimeError,
            r"requested 3 tasks but Slurm assigned 6",
        ),
        (
            {"PROCID": "0", "STEP_NUM_TASKS": "3", **NODES3},
            {"tasks_per_node": 1, "gpus_per_node": 1, "gpus_per_task": 2},
            RuntimeError,
            r"requested more GPUs per node than available",
        ),
        (
            {"PROCID": "0", "STEP_NUM_TASKS": "3", "STEP_TASKS_PER_NODE": "3", **NODES3},
            {},
            ValueError,
            r"the node list names 3 nodes .* but the tasks-per-node list gives 1 counts",
        ),
        (
            {"PROCID": "5", "STEP_NUM_TASKS": "3", **NODES3},
            {"tasks_per_node": 1},
            RuntimeError,
            r"SLURM_PROCID=5 is outside the step's 3 tasks",
        ),
    ],
)
def test_slurm_errors(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    slurm_env(monkeypatch, **env)
    with pytest.raises(error, match=match):
        SlurmClusterResolver(**kwargs)


# ------------------------------------------------------------------------ Kubernetes


class FakeKubernetesClient:
    """Stands in for ``kubernetes.client.CoreV1Api``: pods per label selector."""

    def __init__(self, pods_by_selector: dict[str, list[tuple[str, str, str]]]) -> None:
        self.pods = pods_by_selector
        self.calls: list[str] = []

    def list_pod_for_all_namespaces(self, label_selector: str) -> Any:
        self.calls.append(label_selector)
        return NS(
            items=[
                NS(
                    metadata=NS(name=name, annotations=None),
                    status=NS(phase=phase, host_ip=ip, pod_ip="pod-" + ip),
                )
                for name, phase, ip in self.pods[label_selector]
            ]
        )


def _k8s(pods: dict[str, list[tuple[str, str, str]]], **kwargs: Any) -> KubernetesClusterResolver:
    return KubernetesClusterResolver(override_client=FakeKubernetesClient(pods), **kwargs)


def test_kubernetes_single_item_and_sort() -> None:
    one = _k8s({"job-name=tensorflow": [("tensorflow-abc123", "Running", "10.1.2.3")]})
    assert one.cluster_spec() == ClusterSpec({"worker": ["10.1.2.3:8470"]})
    three = _k8s(
        {
            "job-name=tensorflow": [
                ("tensorflow-abc123", "Running", "10.1.2.3"),
                ("tensorflow-def456", "Running", "10.1.2.4"),
                ("tensorflow-999999", "Running", "10.1.2.5"),
            ]
        }
    )
    assert three.cluster_spec().job_tasks("worker") == [
        "10.1.2.5:8470",
        "10.1.2.3:8470",
        "10.1.2.4:8470",
    ]


def test_kubernetes_master_with_task_overrides() -> None:
    r = _k8s(
        {
            "job-name=tensorflow": [
                ("worker-0", "Running", "10.1.2.3"),
                ("worker-1", "Running", "10.1.2.4"),
                ("worker-2", "Running", "10.1.2.5"),
            ]
        }
    )
    assert (r.task_type, r.task_id, r.master()) == (None, None, "")
    r.task_type, r.task_id = "worker", 0
    assert r.master() == "grpc://10.1.2.3:8470"
    assert r.master("worker", 2) == "grpc://10.1.2.5:8470"
    r.task_id = 1
    assert r.jax_initialize_kwargs() == {
        "coordinator_address": "10.1.2.3:8470",
        "num_processes": 3,
        "process_id": 1,
    }


def test_kubernetes_non_running_pod() -> None:
    r = _k8s({"job-name=tensorflow": [("tensorflow-abc123", "Failed", "10.1.2.3")]})
    with pytest.raises(
        RuntimeError,
        match=r'Pod "tensorflow-abc123" is not running; phase: '
        r'"Failed"',
    ):
        r.cluster_spec()


def test_kubernetes_multiple_selectors_and_jobs() -> None:
    client = FakeKubernetesClient(
        {
            "job-name=worker1": [
                ("tensorflow-abc123", "Running", "10.1.2.3"),
                ("tensorflow-def456", "Running", "10.1.2.4"),
                ("tensorflow-999999", "Running", "10.1.2.5"),
            ],
            "job-name=worker2": [
                ("tensorflow-abc124", "Running", "10.1.2.6"),
                ("tensorflow-def457", "Running", "10.1.2.7"),
                ("tensorflow-999990", "Running", "10.1.2.8"),
            ],
            "job-name=ps": [
                ("tensorflow-ps-1", "Running", "10.1.2.1"),
                ("tensorflow-ps-2", "Running", "10.1.2.2"),
            ],
        }
    )
    r = KubernetesClusterResolver(
        {"worker": ["job-name=worker1", "job-name=worker2"], "ps": ["job-name=ps"]},
        override_client=client,
    )
    assert r.cluster_spec() == ClusterSpec(
        {
            "ps": ["10.1.2.1:8470", "10.1.2.2:8470"],
            "worker": [
                "10.1.2.5:8470",
                "10.1.2.3:8470",
                "10.1.2.4:8470",
                "10.1.2.8:8470",
                "10.1.2.6:8470",
                "10.1.2.7:8470",
            ],
        }
    )
    r.cluster_spec()
    assert len(client.calls) == 6  # listed afresh on every call


def test_kubernetes_indexed_job_order_and_pod_ips() -> None:
    pods = [
        NS(
            metadata=NS(
                name=f"train-{i}-x",
                annotations={"batch.kubernetes.io/job-completion-index": str(i)},
            ),
            status=NS(phase="Running", host_ip="node", pod_ip=f"10.0.0.{i}"),
        )
        for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)
    ]
    client = NS(list_pod_for_all_namespaces=lambda label_selector: NS(items=pods))
    r = KubernetesClusterResolver(
        {"worker": ["job-name=train"]}, tf_server_port=1234, override_client=client, use_pod_ip=True
    )
    assert r.cluster_spec().job_tasks("worker") == [f"10.0.0.{i}:1234" for i in range(11)]


def test_kubernetes_needs_the_client_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxdist\[kubernetes\]'"):
        KubernetesClusterResolver()
    with pytest.raises(TypeError, match=r"job 'worker' must map to a list of label selectors"):
        KubernetesClusterResolver({"worker": "job-name=x"}, override_client=object())


# ------------------------------------------------------------------------------- TPU


def test_tpu_from_gke_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1,t1v-2,t1v-3")
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    r = TPUClusterResolver()
    assert r.cluster_spec() == ClusterSpec({"worker": [f"t1v-{i}:8470" for i in range(4)]})
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 2, "grpc", "")
    assert r.master() == r.get_master() == "grpc://t1v-2:8470"
    assert r.master("worker", 0) == "grpc://t1v-0:8470" and r.get_job_name() == "worker"
    assert r.jax_initialize_kwargs() == {
        "coordinator_address": "t1v-0:8482",
        "num_processes": 4,
        "process_id": 2,
    }
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "9000")
    assert r.jax_initialize_kwargs()["coordinator_address"] == "t1v-0:9000"
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "x")
    with pytest.raises(ValueError, match=r"JAX_COORDINATOR_PORT='x' is not a port number"):
        r.jax_initialize_kwargs()


def test_tpu_process_addresses_and_task_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_PROCESS_ADDRESSES", "10.0.0.1:8476,10.0.0.2:8476")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "ignored-0,ignored-1")
    monkeypatch.setenv("CLOUD_TPU_TASK_ID", "1")
    r = TPUClusterResolver(
        job_name="tpu_worker", coordinator_name="coordinator", coordinator_address="10.0.0.9:2222"
    )
    assert r.cluster_spec() == ClusterSpec(
        {"tpu_worker": ["10.0.0.1:8470", "10.0.0.2:8470"], "coordinator": ["10.0.0.9:2222"]}
    )
    assert (r.task_type, r.task_id) == ("tpu_worker", 1)


def test_tpu_from_gce_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    metadata = {
        "worker-network-endpoints": "w0:uid0:10.1.0.1,w1:uid1:10.1.0.2",
        "agent-worker-number": "1",
    }
    asked: list[str] = []
    monkeypatch.setattr(tpu_mod, "_gce_metadata", lambda key: asked.append(key) or metadata[key])
    r = TPUClusterResolver()
    assert r.cluster_spec().job_tasks("worker") == ["10.1.0.1:8470", "10.1.0.2:8470"]
    assert r.task_id == 1 and asked == ["worker-network-endpoints", "agent-worker-number"]


def test_tpu_local_and_address(monkeypatch: pytest.MonkeyPatch) -> None:
    local = TPUClusterResolver(tpu="local")
    assert (local.cluster_spec(), local.master(), local.task_id) == (ClusterSpec({}), "", 0)
    with pytest.raises(ValueError, match=r"the cluster spec is empty"):
        local.jax_initialize_kwargs()
    direct = TPUClusterResolver(tpu="grpc://10.240.1.2:8470")
    assert direct.cluster_spec() == ClusterSpec({"worker": ["10.240.1.2:8470"]})
    assert direct.master() == "grpc://10.240.1.2:8470"
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "only-host")
    assert TPUClusterResolver().task_id == 0  # one host needs no index


def test_gce_metadata_stays_off_the_network_off_gce(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("network call")

    monkeypatch.setattr(tpu_mod, "_DMI_PRODUCT", "/nonexistent/product_name")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    assert REAL_GCE_METADATA("agent-worker-number") is None


@pytest.mark.parametrize(
    ("env", "kwargs", "error", "match"),
    [
        (
            {},
            {"tpu": "my-tpu"},
            ValueError,
            r"TPUClusterResolver\(tpu='my-tpu'\): resolving a "
            r"TPU by name needs the Cloud TPU API",
        ),
        ({}, {"tpu": 3}, TypeError, r"expected None, 'local' or 'grpc://host:port', got int 3"),
        ({}, {"coordinator_name": "coordinator"}, ValueError, r"give its address too"),
        (
            {},
            {"coordinator_name": "worker", "coordinator_address": "c:1"},
            ValueError,
            r"coordinator_name and job_name are both 'worker'",
        ),
        (
            {},
            {},
            RuntimeError,
            r"cannot find the TPU workers: TPU_WORKER_HOSTNAMES \(or "
            r"TPU_PROCESS_ADDRESSES\) is not set",
        ),
        (
            {"TPU_WORKER_HOSTNAMES": "a,b"},
            {},
            RuntimeError,
            r"this host's worker index is "
            r"unknown \(TPU_WORKER_ID=None\) in a slice of 2 hosts \['a', 'b'\]",
        ),
        (
            {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "2"},
            {},
            RuntimeError,
            r"worker index 2 is outside the 2 TPU workers",
        ),
        ({"TPU_WORKER_HOSTNAMES": "a:1:2:3"}, {}, ValueError, r"cannot read the TPU worker entry"),
        (
            {},
            {"tpu": "grpc://10.0.0.1:8470,grpc://10.0.0.2:8470"},
            ValueError,
            r"TPUClusterResolver\(tpu='grpc://10.0.0.1:8470,grpc://10.0.0.2:8470'\): in the "
            r"coordinator address .*, '10.0.0.1:8470,grpc://10.0.0.2' is not a host name",
        ),
        ({"MEGASCALE_NUM_SLICES": "2"}, {}, ValueError, r"MEGASCALE_NUM_SLICES=2: a multislice"),
    ],
)
def test_tpu_errors(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tpu_mod, "_gce_metadata", lambda key: None)  # not on GCE
    with pytest.raises(error, match=match):
        TPUClusterResolver(**kwargs)


# -------------------------------------------------------------------------- launcher


def launcher_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for key, value in values.items():
        monkeypatch.setenv(f"JAXDIST_{key}", value)


def test_launcher_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not LauncherClusterResolver.is_present()
    launcher_env(
        monkeypatch,
        COORDINATOR_ADDRESS="127.0.0.1:7001",
        NUM_PROCESSES="3",
        PROCESS_ID="2",
        LOCAL_DEVICE_COUNT="4",
        RESTART_COUNT="1",
    )
    r = LauncherClusterResolver()
    assert LauncherClusterResolver.is_present()
    assert r.cluster_spec() == ClusterSpec(
        {"worker": ["127.0.0.1:7001", "127.0.0.1:0", "127.0.0.1:0"]}
    )
    assert (r.task_type, r.task_id, r.num_processes) == ("worker", 2, 3)
    assert (r.local_device_count, r.restart_count) == (4, 1)
    assert r.coordinator_address == "127.0.0.1:7001"
    assert r.master("worker", 0, rpc_layer="grpc") == "grpc://127.0.0.1:7001"
    assert r.jax_initialize_kwargs() == {
        "coordinator_address": "127.0.0.1:7001",
        "num_processes": 3,
        "process_id": 2,
    }


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, r"JAXDIST_COORDINATOR_ADDRESS is not set: this process was not started by "),
        ({"COORDINATOR_ADDRESS": "127.0.0.1"}, r"the coordinator address '127.0.0.1' is not "),
        ({"COORDINATOR_ADDRESS": "h:1", "PROCESS_ID": "0"}, r"JAXDIST_NUM_PROCESSES is not set "),
        (
            {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "0", "PROCESS_ID": "0"},
            r"JAXDIST_NUM_PROCESSES='0' must be an integer >= 1",
        ),
        (
            {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2", "PROCESS_ID": "2"},
            r"JAXDIST_PROCESS_ID=2 is not below JAXDIST_NUM_PROCESSES=2",
        ),
        (
            {"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2", "PROCESS_ID": "a"},
            r"JAXDIST_PROCESS_ID='a' must be an integer >= 0",
        ),
    ],
)
def test_launcher_errors(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str) -> None:
    launcher_env(monkeypatch, **env)
    with pytest.raises(ValueError, match=r"LauncherClusterResolver\(\)"):
        LauncherClusterResolver()
    with pytest.raises(ValueError, match=match):
        LauncherClusterResolver()


# ------------------------------------------------------------------- resolve_default


def test_resolve_default_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_default() is None
    slurm_env(
        monkeypatch, PROCID="0", STEP_NUM_TASKS="1", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="1"
    )
    assert resolve_default() is None  # a one-task step is one process
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")
    assert isinstance(resolve_default(), SlurmClusterResolver)
    set_tf_config(monkeypatch, TF_PS_WORKER)
    assert isinstance(resolve_default(), TFConfigClusterResolver)
    launcher_env(
        monkeypatch, COORDINATOR_ADDRESS="127.0.0.1:7001", NUM_PROCESSES="2", PROCESS_ID="0"
    )
    assert isinstance(resolve_default(), LauncherClusterResolver)


def test_resolve_default_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0")
    assert resolve_default() is None  # one host: one process
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    resolver = resolve_default()
    assert isinstance(resolver, TPUClusterResolver) and resolver.task_id == 1
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.delenv("TPU_WORKER_ID")
    monkeypatch.setattr(default_mod, "_running_in_cloud_tpu_vm", lambda: True)
    monkeypatch.setattr(tpu_mod, "_gce_metadata", lambda key: None)
    assert resolve_default() is None  # a TPU VM whose metadata describes no slice
    monkeypatch.setattr(
        tpu_mod,
        "_gce_metadata",
        {"worker-network-endpoints": "a,b", "agent-worker-number": "0"}.get,
    )
    assert isinstance(resolve_default(), TPUClusterResolver)


def test_resolve_default_kubernetes_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert resolve_default() is None  # being in a pod says nothing about peers
    monkeypatch.setenv("JAXDIST_KUBERNETES_LABEL_SELECTOR", "job-name=train")
    with pytest.raises(ValueError, match=r"JOB_COMPLETION_INDEX='' does not say which task"):
        resolve_default()
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    monkeypatch.setitem(sys.modules, "kubernetes", types.ModuleType("kubernetes"))
    resolver = resolve_default()
    assert isinstance(resolver, KubernetesClusterResolver)
    assert (resolver.task_type, resolver.task_id, resolver._use_pod_ip) == ("worker", 3, True)
    assert resolver._job_to_label_mapping == {"worker": ["job-name=train"]}


# ------------------------------------------------------------------------ initialize


class FakeJax:
    """Records what `initialize` asks of `jax.distributed`."""

    def __init__(self) -> None:
        self.init_calls: list[dict[str, Any]] = []
        self.check_ins: list[dict[str, Any]] = []
        self.shutdowns = 0
        self.backend_started = False
        self.external: tuple[str | None, int, int] | None = None
        self.fail: Exception | None = None

    def initialize(self, **kwargs: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.init_calls.append(kwargs)

    def shutdown(self) -> None:
        self.shutdowns += 1

    def check_in(self, **kwargs: Any) -> None:
        self.check_ins.append(kwargs)


@pytest.fixture
def fake_jax(monkeypatch: pytest.MonkeyPatch) -> FakeJax:
    fake = FakeJax()
    monkeypatch.setattr(init_mod, "_distributed_initialize", fake.initialize)
    monkeypatch.setattr(init_mod, "_check_in", fake.check_in)
    monkeypatch.setattr(init_mod, "_distributed_shutdown", fake.shutdown)
    monkeypatch.setattr(init_mod, "backends_initialized", lambda: fake.backend_started)
    monkeypatch.setattr(init_mod, "_external_cluster", lambda: fake.external)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # initialize replaces these
    monkeypatch.setattr(sys, "exit", sys.exit)
    return fake


def workers(task_id: int, *addresses: str) -> SimpleClusterResolver:
    return SimpleClusterResolver({"worker": list(addresses)}, task_type="worker", task_id=task_id)


def test_initialize_one_process_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, fake_jax: FakeJax
) -> None:
    assert initialize() is None
    one = workers(0, "w0:2222")
    assert initialize(one) is one
    set_tf_config(monkeypatch, {"task": {"type": "worker", "index": 0}})
    assert isinstance(initialize(), TFConfigClusterResolver)
    evaluator = SimpleClusterResolver(CHIEF_CLUSTER, task_type="evaluator", task_id=0)
    assert initialize(evaluator) is evaluator  # runs alone, as in TF
    assert fake_jax.init_calls == [] and not is_initialized()


def test_initialize_starts_once_with_bounded_timeouts(fake_jax: FakeJax) -> None:
    r = workers(1, "grpc://w0:2222", "w1:2222")
    assert initialize(r) is r
    assert fake_jax.init_calls == [
        {
            "coordinator_address": "w0:2222",
            "num_processes": 2,
            "process_id": 1,
            "initialization_timeout": 300,
            "heartbeat_timeout_seconds": 20,
            "shutdown_timeout_seconds": 300,
            "cluster_detection_method": "deactivate",
        }
    ]
    assert is_initialized()
    assert fake_jax.check_ins == [  # the start-up rendezvous comes first
        {
            "address": "w0:2222",
            "num_processes": 2,
            "process_id": 1,
            "timeout": 300,
            "report_interval": 30.0,
        }
    ]
    initialize(workers(1, "w0:2222", "w1:2222"))  # the same cluster again: nothing to do
    assert len(fake_jax.init_calls) == 1
    with pytest.raises(
        RuntimeError,
        match=r"jax.distributed already runs for another cluster in this process: "
        r"coordinator_address='w0:2222', num_processes=2, process_id=1 \(from "
        r"SimpleClusterResolver.*\); now asked for coordinator_address='w9:2222', "
        r"num_processes=2, process_id=1",
    ):
        initialize(workers(1, "w9:2222", "w1:2222"))
    shutdown()
    assert fake_jax.shutdowns == 1 and not is_initialized()
    shutdown()  # nothing left to stop
    assert fake_jax.shutdowns == 1
    initialize(workers(0, "w9:2222", "w1:2222"))  # after shutdown, another cluster is fine
    assert fake_jax.init_calls[-1]["coordinator_address"] == "w9:2222"
    shutdown()


def test_initialize_timeouts(monkeypatch: pytest.MonkeyPatch, fake_jax: FakeJax) -> None:
    monkeypatch.setenv("JAXDIST_HEARTBEAT_TIMEOUT", "7")
    monkeypatch.setenv("JAXDIST_INITIALIZATION_TIMEOUT", "30")
    monkeypatch.setenv("JAXDIST_SHUTDOWN_TIMEOUT", "40")
    initialize(workers(0, "w0:1", "w1:1"), heartbeat_timeout_seconds=5)
    call = fake_jax.init_calls[0]
    assert (
        call["heartbeat_timeout_seconds"],
        call["initialization_timeout"],
        call["shutdown_timeout_seconds"],
    ) == (5, 30, 40)
    shutdown()
    monkeypatch.setenv("JAXDIST_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(
        ValueError,
        match=r"the environment variable JAXDIST_HEARTBEAT_TIMEOUT "
        r"must be a positive whole number of seconds, got 0",
    ):
        initialize(workers(0, "w0:1", "w1:1"))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError,
            match=rf"initialize\(initialization_timeout=...\) must be "
            rf"a positive whole number of seconds, got {bad!r}",
        ):
            initialize(workers(0, "w0:1", "w1:1"), initialization_timeout=bad)  # type: ignore[arg-type]
    assert len(fake_jax.init_calls) == 1
    monkeypatch.delenv("JAXDIST_HEARTBEAT_TIMEOUT")
    monkeypatch.setenv("JAXDIST_STARTUP_REPORT_INTERVAL", "0.5")
    initialize(workers(0, "w0:1", "w1:1"))
    assert fake_jax.check_ins[-1]["report_interval"] == 0.5
    shutdown()
    monkeypatch.setenv("JAXDIST_STARTUP_REPORT_INTERVAL", "0")  # no rendezvous: JAX alone
    initialize(workers(0, "w0:1", "w1:1"))
    assert len(fake_jax.check_ins) == 2 and len(fake_jax.init_calls) == 3
    shutdown()
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv("JAXDIST_STARTUP_REPORT_INTERVAL", bad)
        with pytest.raises(
            ValueError,
            match=rf"the environment variable JAXDIST_STARTUP_REPORT_INTERVAL must be a number "
            rf"of seconds >= 0 \(0 turns the start-up rendezvous off\), got '{bad}'",
        ):
            initialize(workers(0, "w0:1", "w1:1"))


def test_initialize_after_the_backend_started(fake_jax: FakeJax) -> None:
    fake_jax.backend_started = True
    with pytest.raises(
        RuntimeError,
        match=r"JAX's backend has already started in this process .* so jax.distributed can no "
        r"longer join the cluster coordinator_address='w0:1', num_processes=2, process_id=0 .*"
        r"Call jaxdist.initialize\(\) \(or create the MultiWorkerMirroredStrategy\) at the start",
    ):
        initialize(workers(0, "w0:1", "w1:1"))
    assert fake_jax.init_calls == [] and not is_initialized()
    assert initialize(workers(0, "w0:1")) is not None  # one process never needs the check


def test_initialize_respects_an_existing_jax_distributed(fake_jax: FakeJax) -> None:
    fake_jax.external = ("w0:1", 2, 0)
    initialize(workers(0, "w0:1", "w1:1"))
    assert fake_jax.init_calls == [] and is_initialized()
    shutdown()
    assert fake_jax.shutdowns == 0  # not ours to stop
    with pytest.raises(
        RuntimeError,
        match=r"already initialized in this process \(not by "
        r"jaxdist\) with coordinator_address='w0:1', num_processes=2, process_id=0",
    ):
        initialize(workers(1, "w0:1", "w1:1"))


def test_initialize_failure_can_be_retried(fake_jax: FakeJax) -> None:
    fake_jax.fail = RuntimeError("coordinator unreachable")
    with pytest.raises(RuntimeError, match="coordinator unreachable"):
        initialize(workers(1, "w0:1", "w1:1"))
    assert not is_initialized()
    fake_jax.fail = None
    initialize(workers(1, "w0:1", "w1:1"))
    assert len(fake_jax.init_calls) == 1
    shutdown()


def test_initialize_resolves_the_environment(
    monkeypatch: pytest.MonkeyPatch, fake_jax: FakeJax
) -> None:
    launcher_env(
        monkeypatch, COORDINATOR_ADDRESS="127.0.0.1:7001", NUM_PROCESSES="2", PROCESS_ID="1"
    )
    assert isinstance(initialize(), LauncherClusterResolver)
    assert fake_jax.init_calls[0]["coordinator_address"] == "127.0.0.1:7001"
    with pytest.raises(
        TypeError,
        match=r"jaxdist.initialize\(cluster_resolver=...\): expected a "
        r"jaxdist.cluster_resolver.ClusterResolver",
    ):
        initialize({"worker": ["w0:1"]})  # type: ignore[arg-type]
    shutdown()


def _env_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher_env(
        monkeypatch, COORDINATOR_ADDRESS="127.0.0.1:7001", NUM_PROCESSES="3", PROCESS_ID="1"
    )


def _env_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    set_tf_config(
        monkeypatch,
        {"cluster": {**CHIEF_CLUSTER, "worker": ["grpc://w0:2222", "w1:2222"]},
         "task": {"type": "worker", "index": 1}},
    )  # fmt: skip


def _env_slurm(monkeypatch: pytest.MonkeyPatch) -> None:  # srun -N 2 --ntasks-per-node 2
    slurm_env(
        monkeypatch, PROCID="3", STEP_NUM_TASKS="4", STEP_NODELIST="n[9-10]",
        STEP_TASKS_PER_NODE="2(x2)",
    )  # fmt: skip


def _env_kubernetes(monkeypatch: pytest.MonkeyPatch) -> None:  # an Indexed Job's pod 1
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("JAXDIST_KUBERNETES_LABEL_SELECTOR", "job-name=train")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    pods = [(f"train-{i}", "Running", f"10.0.0.{i}") for i in range(3)]
    client = FakeKubernetesClient({"job-name=train": pods})
    module = types.ModuleType("kubernetes")
    module.client = NS(CoreV1Api=lambda: client)  # type: ignore[attr-defined]
    module.config = NS(load_incluster_config=lambda: None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kubernetes", module)


def _env_tpu_gke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1v-0,t1v-1,t1v-2,t1v-3")
    monkeypatch.setenv("TPU_WORKER_ID", "2")


def _env_tpu_vm(monkeypatch: pytest.MonkeyPatch) -> None:  # the GCE metadata server
    monkeypatch.setattr(default_mod, "_running_in_cloud_tpu_vm", lambda: True)
    metadata = {
        "worker-network-endpoints": "w0:uid0:10.1.0.1,w1:uid1:10.1.0.2",
        "agent-worker-number": "1",
    }
    monkeypatch.setattr(tpu_mod, "_gce_metadata", metadata.get)


@pytest.mark.parametrize(
    ("set_env", "resolver_type", "expected"),
    [
        (_env_launcher, LauncherClusterResolver, ("127.0.0.1:7001", 3, 1)),
        (_env_tf_config, TFConfigClusterResolver, ("c0:2222", 3, 2)),  # the chief is process 0
        (_env_slurm, SlurmClusterResolver, ("n9:8888", 4, 3)),
        (_env_kubernetes, KubernetesClusterResolver, ("pod-10.0.0.0:8470", 3, 1)),
        (_env_tpu_gke, TPUClusterResolver, ("t1v-0:8482", 4, 2)),
        (_env_tpu_vm, TPUClusterResolver, ("10.1.0.1:8482", 2, 1)),
    ],
    ids=["launcher", "tf-config", "slurm", "kubernetes", "tpu-gke", "tpu-vm"],
)
def test_every_environment_gives_initialize_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
    fake_jax: FakeJax,
    set_env: Any,
    resolver_type: type,
    expected: tuple[str, int, int],
) -> None:
    """Each platform's environment, found by `initialize()` itself, becomes the exact call."""
    set_env(monkeypatch)
    resolver = initialize()
    assert type(resolver) is resolver_type
    address, processes, process_id = expected
    assert fake_jax.init_calls == [
        {
            "coordinator_address": address,
            "num_processes": processes,
            "process_id": process_id,
            "initialization_timeout": 300,
            "heartbeat_timeout_seconds": 20,
            "shutdown_timeout_seconds": 300,
            "cluster_detection_method": "deactivate",
        }
    ]
    shutdown()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: SimpleClusterResolver(CHIEF_CLUSTER, task_type="chief", task_id=0),
            ("c0:2222", 3, 0),
        ),
        (
            lambda: UnionResolver(
                SimpleClusterResolver({"worker": ["w0:1", "w1:1"]}, task_type="worker", task_id=1),
                SimpleClusterResolver({"ps": ["p0:1"], "evaluator": ["e0:1"]}),
            ),
            ("w0:1", 2, 1),
        ),
        (
            lambda: _k8s(
                {"app=w": [("b", "Running", "10.0.0.2"), ("a", "Running", "10.0.0.1")]},
                job_to_label_mapping={"worker": ["app=w"]},
                tf_server_port=1234,
            ),
            ("10.0.0.1:1234", 2, 0),
        ),
        (lambda: TPUClusterResolver(tpu="grpc://10.240.1.2:8470"), None),
    ],
    ids=["simple", "union", "kubernetes-client", "tpu-one-worker"],
)
def test_explicit_resolvers_give_initialize_their_arguments(
    fake_jax: FakeJax, make: Any, expected: tuple[str, int, int] | None
) -> None:
    resolver = make()
    if isinstance(resolver, KubernetesClusterResolver):
        resolver.task_type, resolver.task_id = "worker", 0
    if expected is None:  # one process: nothing to start
        assert initialize(resolver) is resolver
        assert fake_jax.init_calls == [] and not is_initialized()
        return
    assert initialize(resolver) is resolver
    address, processes, process_id = expected
    call = fake_jax.init_calls[0]
    assert (call["coordinator_address"], call["num_processes"], call["process_id"]) == (
        address,
        processes,
        process_id,
    )
    shutdown()


def test_uncaught_exception_ends_a_multi_process_job_at_once(
    monkeypatch: pytest.MonkeyPatch, fake_jax: FakeJax, capsys: pytest.CaptureFixture[str]
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    python_hook = sys.excepthook
    initialize(workers(0, "w0:1"))  # one process: Python's own exit
    assert sys.excepthook is python_hook
    initialize(workers(0, "w0:1", "w1:1"))
    assert sys.excepthook is not python_hook
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert exits == [1, 130]  # at once, not through jax.distributed's shutdown barrier
    assert "RuntimeError: boom" in capsys.readouterr().err  # after the traceback
    shutdown()
    monkeypatch.setattr(sys, "excepthook", python_hook)
    monkeypatch.setenv("JAXDIST_EXIT_ON_ERROR", "0")
    initialize(workers(0, "w0:1", "w1:1"))
    assert sys.excepthook is python_hook
    shutdown()


def test_failing_sys_exit_is_hooked_in_multi_process_jobs_only(fake_jax: FakeJax) -> None:
    python_exit = sys.exit
    initialize(workers(0, "w0:1"))  # one process: Python's own exit
    assert sys.exit is python_exit
    initialize(workers(0, "w0:1", "w1:1"))
    assert sys.exit is not python_exit
    for status in [3, "bad input", None, 0]:
        with pytest.raises(SystemExit) as caught:  # except SystemExit still catches it
            sys.exit(status)
        assert caught.value.code == status
        # A successful exit raises Python's own SystemExit: it waits at the barrier.
        assert (type(caught.value) is SystemExit) == (status in (None, 0))
    shutdown()


_EXIT_SCRIPT = """
import atexit, os, sys
from jaxdist.cluster_resolver import _fail_fast
_fail_fast.install(os._exit)
atexit.register(lambda: print("ATEXIT", flush=True))  # where jax.distributed's barrier runs
try:
    sys.exit(4)
except SystemExit as e:
    print("CAUGHT", e.code, flush=True)
def main():
    {ending}
main()
"""


@pytest.mark.parametrize(
    ("ending", "code", "stderr", "at_exit"),
    [
        ("sys.exit(3)", 3, "", False),  # at once, before the exit handlers
        ("sys.exit('bad input')", 1, "bad input\n", False),
        ("sys.exit(0)", 0, "", True),  # success: the normal exit
        ("pass", 0, "", True),
        ("raise SystemExit(5)", 5, "", True),  # Python's own class: the normal exit
    ],
)
def test_failing_sys_exit_ends_the_process_before_the_exit_handlers(
    ending: str, code: int, stderr: str, at_exit: bool, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT.replace("{ending}", ending))
    (tmp_path / "mod.py").write_text(script.read_text())
    # As a script, and as a module (python -m: the exception leaves through runpy's frames).
    for how, cwd in ([str(script)], None), (["-m", "mod"], tmp_path):
        proc = subprocess.run(
            [sys.executable, *how], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "CAUGHT 4\n" + ("ATEXIT\n" if at_exit else ""), proc.stdout
        assert proc.stderr == stderr


def test_initialize_passes_only_what_jax_accepts() -> None:
    def old_jax(coordinator_address: str, num_processes: int, process_id: int) -> None:
        del coordinator_address, num_processes, process_id

    kwargs = {
        "coordinator_address": "w:1",
        "num_processes": 2,
        "process_id": 0,
        "heartbeat_timeout_seconds": 20,
    }
    assert init_mod._supported(old_jax, kwargs) == {
        "coordinator_address": "w:1",
        "num_processes": 2,
        "process_id": 0,
    }
    assert init_mod._supported(lambda **kw: None, kwargs) == kwargs
    assert "heartbeat_timeout_seconds" in init_mod._supported(jax.distributed.initialize, kwargs)


def test_real_jax_probes() -> None:
    jax.devices()
    assert init_mod.backends_initialized() and REAL_SLURM_BACKEND_PROBE()
    assert init_mod._external_cluster() is None  # no test starts jax.distributed in-process
