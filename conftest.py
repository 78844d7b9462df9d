"""Every test and doctest sees 8 simulated CPU devices, fixed before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import jax

jax.config.update("jax_num_cpu_devices", 8)
