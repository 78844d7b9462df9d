"""The run path: how `Strategy.run` turns a replica function into one compiled program.

`compile` traces the function once into `jax.shard_map` under `jax.jit`; `invariance`
reads its jaxpr to learn which outputs are the same on every replica; `sliced_eval`
evaluates it when some outputs are wanted as one slice (sharded state); `programs`
caches the compiled programs per function and input signature. Internal.
"""
