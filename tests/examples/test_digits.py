"""The digits demo (``make demo``) reaches its accuracy target, and its options work.

Reference: the held-out 20% of scikit-learn's digits; the target (>= 97% test
accuracy) is the demo's promise. Runs in-process on the 8 simulated devices.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

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
    assert result["seconds"] < 90  # the demo's promise on 2 CPU cores (measured: about 10 s)
    last = out.splitlines()[-1]
    assert re.fullmatch(
        r"test accuracy \d+\.\d\d%  \|  training [\d,]+ examples/s  \|  15 epochs in [\d.]+s", last
    )


@pytest.mark.timeout(120)
def test_one_device_smoke(capsys) -> None:
    result = digits.main(["--strategy", "one_device", "--epochs", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert "OneDeviceStrategy with 1 replica(s)" in out
    assert result["test_accuracy"] > 0.5  # one epoch already learns most digits
    assert out.count("epoch 1/1") == 1


@pytest.mark.timeout(120)
def test_central_storage_on_two_devices_smoke(capsys) -> None:
    result = digits.main(
        ["--strategy", "central_storage", "--devices", "2", "--epochs", "1", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert "CentralStorageStrategy with 2 replica(s)" in out
    assert result["test_accuracy"] > 0.5


def test_make_strategy() -> None:
    assert digits.make_strategy("central_storage", 2).num_replicas_in_sync == 2
    assert digits.make_strategy("mirrored", None).num_replicas_in_sync == len(jax.devices())
    assert digits.make_strategy("one_device", None).num_replicas_in_sync == 1
    with pytest.raises(ValueError, match=r"--devices 9 asks for more devices than the 8 cpu"):
        digits.make_strategy("mirrored", len(jax.devices()) + 1)
    with pytest.raises(ValueError, match=r"one_device trains on one device, but --devices 2"):
        digits.make_strategy("one_device", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "parameter_server"], r"argument --strategy: invalid choice"),
        (["--devices", "two"], r"argument --devices: invalid int value: 'two'"),
        (["--devices", "0"], r"--devices must be >= 1, got 0"),
        (["--epochs", "0"], r"--epochs must be >= 1, got 0"),
        (["--batch-size", "-4"], r"--batch-size must be >= 1, got -4"),
        (["--learning-rate", "0"], r"--learning-rate must be > 0, got 0\.0"),
        (["--strategy", "one_device", "--devices", "4"], r"one_device trains on one device"),
        (["--devices", "9"], r"--devices 9 asks for more devices than the 8 cpu devices"),
        (["--bogus"], r"unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_are_usage_errors(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        digits.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m jaxdist.examples.digits")
    assert re.search(message, err), err


@pytest.mark.timeout(120)
def test_runs_as_a_script_with_simulated_devices() -> None:
    """``python -m jaxdist.examples.digits`` simulates --devices CPU devices itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    cmd = [sys.executable, "-m", "jaxdist.examples.digits", "--devices", "2"]
    run = subprocess.run(
        [*cmd, "--epochs", "1", "--no-progress"],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr
    assert "MirroredStrategy with 2 replica(s) on cpu" in run.stdout
    assert re.search(r"test accuracy \d+\.\d\d%  \|  training [\d,]+ examples/s", run.stdout)
    bad = subprocess.run([*cmd, "--epochs", "x"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid int value: 'x'" in bad.stderr


def test_split_is_stratified_and_fixed() -> None:
    x_train, _, x_test, y_test = digits.load_digits()
    again = digits.load_digits()
    assert x_train.shape == (1437, 8, 8, 1) and x_test.shape == (360, 8, 8, 1)
    assert (again[3] == y_test).all()
    counts = [int((y_test == d).sum()) for d in range(10)]
    assert min(counts) >= 35 and max(counts) <= 37  # about 36 of each digit
    assert float(x_train.min()) >= 0.0 and float(x_train.max()) <= 1.0
