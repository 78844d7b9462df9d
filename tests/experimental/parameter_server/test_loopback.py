"""The local Ray runtime jaxdist starts listens on loopback only, with the dashboard off.

A fresh process (``RAY_ADDRESS`` unset, so jaxdist starts the runtime itself) makes a
1 PS x 1 worker strategy, runs a closure, and lists every listening TCP socket of the
processes it started (Ray's GCS, raylet, agents, workers and actors are its descendants),
with their command lines.
Reference: the loopback addresses 127.0.0.0/8, ::1 and their IPv4-mapped form.
"""

from __future__ import annotations

import ipaddress

import pytest

pytest.importorskip("ray")
pytest.importorskip("psutil")

from _helpers import run_python

pytestmark = pytest.mark.slow

_CODE = """
import json

import jax.numpy as jnp
import psutil
import ray

import jaxdist as jd

assert not ray.is_initialized()
spec = jd.cluster_resolver.ClusterSpec({"chief": ["c"], "worker": ["w"], "ps": ["p"]})
s = jd.ParameterServerStrategy(jd.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="ray"))
with s.scope():
    v = jd.Variable(jnp.zeros(2), aggregation="sum")
c = jd.coordinator.ClusterCoordinator(s)
c.schedule(s.function(lambda ctx, v: ctx.assign_add(v, jnp.ones(2))), args=(v,))
c.join()
me = psutil.Process()
procs = {p.pid: p for p in me.children(recursive=True)}
procs[me.pid] = me
listening = []
for conn in psutil.net_connections(kind="tcp"):
    if conn.status == psutil.CONN_LISTEN and conn.pid in procs:
        listening.append([procs[conn.pid].name(), conn.laddr.ip, conn.laddr.port])
commands = []
for p in procs.values():
    try:
        commands.append(" ".join(p.cmdline()))
    except psutil.Error:
        pass
print(json.dumps({
    "node_ip": ray.util.get_node_ip_address(),
    "webui": ray._private.worker._global_node.address_info["webui_url"],
    "gcs": ray.get_runtime_context().gcs_address,
    "listening": listening,
    "commands": commands,
    "value": [float(x) for x in v.numpy()],
}))
ray.shutdown()  # the runtime this process started
"""


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def test_runtime_jaxdist_starts_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # jaxdist starts its own runtime
    got = run_python(_CODE, timeout=240, devices=1)
    assert got["value"] == [1.0, 1.0]  # the runtime worked: one closure added ones
    assert got["node_ip"] == "127.0.0.1" and got["gcs"].startswith("127.0.0.1:"), got
    names = {e[0] for e in got["listening"]}
    # Ray's servers did start (so the check below saw them): the GCS and the raylet.
    assert {"gcs_server", "raylet"} <= names, got["listening"]
    outside = [entry for entry in got["listening"] if not _loopback(entry[1])]
    assert not outside, f"listening beyond loopback: {outside}"
    # Dashboard off: no web UI address, and Ray's head process for its internal modules (it
    # runs even so) runs without the web frontend.
    assert got["webui"] == "", got["webui"]
    heads = [cmd for cmd in got["commands"] if "dashboard/dashboard.py" in cmd]
    assert all("--disable-frontend" in cmd for cmd in heads), heads
