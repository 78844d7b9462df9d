"""Strategy fixtures (the 8 simulated devices are set up by the root conftest.py)."""

import jax
import pytest

import jaxdist as jd


@pytest.fixture
def mirrored8() -> jd.MirroredStrategy:
    return jd.MirroredStrategy()


@pytest.fixture(params=["one_device", "mirrored2", "mirrored8"])
def strategy(request: pytest.FixtureRequest) -> jd.Strategy:
    """The local strategies the contract must hold for."""
    if request.param == "one_device":
        return jd.OneDeviceStrategy()
    if request.param == "mirrored2":
        return jd.MirroredStrategy(jax.devices()[:2])
    return jd.MirroredStrategy()
