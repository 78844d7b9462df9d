"""``python -m jaxdist.examples.gpt``: the decoder trains on the mesh it is given.

In-process on the 8 simulated devices; the mesh tests (tests/strategies/test_mesh.py)
hold the same model to one-device optax at six mesh shapes.
"""

from __future__ import annotations

import re

import pytest

from jaxdist.examples import gpt


@pytest.mark.timeout(240)
def test_the_example_trains_and_reports_each_device_share(capsys) -> None:
    assert gpt.main(["--mesh", "1,4,2", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    losses = [float(m[1]) for line in lines if (m := re.fullmatch(r"step \d: loss (\S+)", line))]
    assert len(losses) == 3
    share = re.search(r"device 0 holds (\S+) of the state", lines[-1])
    assert share is not None and 0.12 < float(share[1]) < 0.2  # fsdp x tensor = 8, norms whole
    assert "MeshStrategy({'data': 1, 'fsdp': 4, 'tensor': 2}" in lines[-1]
