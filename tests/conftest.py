"""Strategy fixtures (the 8 simulated devices are set up by the root conftest.py).

The tests sit in folders that mirror the package (``tests/values/`` for ``jaxdist/values/``,
...); they import the shared helpers ``_helpers`` and ``_hlo`` from this folder, which is on
``sys.path`` for every import mode (pytest's default puts it there too, as this file's
folder). Test file names are unique across the folders (the folders are not packages).
"""

import sys
from pathlib import Path

import jax
import pytest

import jaxdist as jd

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


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
