"""One `psum` over every process's devices, started by jaxdist's launcher
(tests/launch/test_launch.py).

Starts `jax.distributed` directly from the launcher's variables, checks the device
and process counts, sums ``process_id * 10 + local index + 1`` over all devices with
one ``jax.jit(jax.shard_map(psum))`` and prints ``PSUM <value> <device count>``.
"""

from __future__ import annotations

import os


def main() -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    num_processes = int(os.environ["JAXDIST_NUM_PROCESSES"])
    process_id = int(os.environ["JAXDIST_PROCESS_ID"])
    local = int(os.environ["JAXDIST_LOCAL_DEVICE_COUNT"])
    jax.distributed.initialize(
        coordinator_address=os.environ["JAXDIST_COORDINATOR_ADDRESS"],
        num_processes=num_processes,
        process_id=process_id,
    )
    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.local_device_count() == local, jax.local_device_count()
    assert jax.device_count() == num_processes * local, jax.device_count()

    mesh = Mesh(np.array(jax.devices()), ("d",))
    spec = PartitionSpec("d")
    values = np.arange(local, dtype=np.float32) + process_id * 10 + 1
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), values)
    total = jax.jit(
        jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=spec, out_specs=spec)
    )(x)
    shards = [float(np.asarray(s.data)[0]) for s in total.addressable_shards]
    assert len(set(shards)) == 1, shards
    print(f"PSUM {shards[0]} {jax.device_count()}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
