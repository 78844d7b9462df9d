"""The digits demo (``make demo``) reaches its accuracy target, and its options work.

Reference: the held-out 20% of scikit-learn's digits; the target (>= 97% test
accuracy) is the demo's promise. Runs in-process on the 8 simulated devices.
"""

from __future__ import annotations

import jax
import pytest

from jaxdist.examples import digits


@pytest.mark.timeout(240)
def test_default_run_reaches_97_percent(capsys) -> None:
    result = digits.main([])
    out = capsys.readouterr().out
    assert "MirroredStrategy with 8 replica(s)" in out
    assert "1437 training and 360 held-out images" in out
    assert result["test_accuracy"] >= 0.97, out
    assert result["examples_per_second"] > 0
    assert "test accuracy" in out.splitlines()[-1]


@pytest.mark.timeout(120)
def test_one_device_smoke(capsys) -> None:
    result = digits.main(["--strategy", "one_device", "--epochs", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert "OneDeviceStrategy with 1 replica(s)" in out
    assert result["test_accuracy"] > 0.5  # one epoch already learns most digits
    assert out.count("epoch 1/1") == 1


def test_options_are_checked() -> None:
    assert digits.make_strategy("central_storage", 2).num_replicas_in_sync == 2
    with pytest.raises(ValueError, match=r"--devices 9 asks for more devices than the 8 cpu"):
        digits.make_strategy("mirrored", len(jax.devices()) + 1)
    with pytest.raises(SystemExit):
        digits.parse_args(["--epochs", "0"])


def test_split_is_stratified_and_fixed() -> None:
    x_train, _, x_test, y_test = digits.load_digits()
    again = digits.load_digits()
    assert x_train.shape == (1437, 8, 8, 1) and x_test.shape == (360, 8, 8, 1)
    assert (again[3] == y_test).all()
    counts = [int((y_test == d).sum()) for d in range(10)]
    assert min(counts) >= 35 and max(counts) <= 37  # about 36 of each digit
    assert float(x_train.min()) >= 0.0 and float(x_train.max()) <= 1.0
