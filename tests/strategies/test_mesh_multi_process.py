"""`MeshStrategy` across processes: 2 processes x 4 devices through ``python -m
jaxdist.launch``, with ``dcn_mesh_shape``, preempted once and restarted.

``mesh_shape={"data": 1, "fsdp": 2, "tensor": 2}, dcn_mesh_shape={"data": 2}``: each
process's 4 devices are one (fsdp, tensor) block, and ``data`` is the axis that crosses
processes (checked from the mesh's device assignment). The job (tests/mp_scripts/
mesh_training.py) trains the GPT-2-style decoder 8 adamw steps under a
`PreemptionCheckpointHandler`; process 1 sends itself SIGTERM after step 2, both
processes save the same step and exit 42, the launcher restarts the job, and the handler
resumes it. Every step's loss (before and after the restart) and every leaf's sum and sum
of squares at the end equal the one-process run of the same (2, 2, 2) mesh on 8 devices
(rtol 1e-5), which the other mesh tests hold to one device.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.examples.gpt import mesh_strategy

from _helpers import REPO, finish, load_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = REPO / "tests" / "mp_scripts" / "mesh_training.py"
PREEMPT_AFTER = 2  # of the script's 8 steps (the agreement takes a few steps)


mesh_training = load_script(SCRIPT, "mesh_training")  # its make_state and train
STEPS = mesh_training.STEPS


def _launch(ckpt: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [
            sys.executable, "-m", "jaxdist.launch", "--nprocs", "2", "--devices-per-proc", "4",
            "--max-restarts", "1", str(SCRIPT), str(ckpt), "--preempt-after", str(PREEMPT_AFTER),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )  # fmt: skip


def test_two_launched_processes_with_a_dcn_data_axis_train_equal_to_one_process(
    tmp_path: Path,
) -> None:
    job = _launch(tmp_path / "ckpt")
    try:
        strategy = mesh_strategy((2, 2, 2))
        model, optimizer = mesh_training.make_state(strategy)
        losses = mesh_training.train(strategy, model, optimizer)
        leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(nnx.state(model))]
        out, _ = finish(job, timeout=500)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    assert "exited with code 42 (first failure: preempted)" in out, out[-4000:]

    for p in (0, 1):
        lines = [ln[len(f"[{p}] ") :] for ln in out.splitlines() if ln.startswith(f"[{p}] ")]
        # START <restart> <owners> <total_run_calls>, from the first attempt and the restart
        starts = [ln.split(" ", 2)[2].rsplit(" ", 1) for ln in lines if ln.startswith("START ")]
        assert len(starts) == 2, out[-4000:]
        for owners, _ in starts:
            assert json.loads(owners) == [[0], [1]]  # data index d lives on process d
        assert starts[0][1] == "0"
        resumed_at = int(starts[1][1])
        assert PREEMPT_AFTER < resumed_at < STEPS, starts  # saved soon after the notice
        saved = re.search(rf"\(process {p}\): saved \S*ckpt-\d+ after run\(\) call (\d+)", out)
        assert saved and int(saved[1]) == resumed_at, out[-4000:]
        # Every step each attempt ran (the first attempt's last steps again after the
        # restart) has the reference's loss.
        seen: dict[int, list[float]] = {}
        for ln in lines:
            if ln.startswith("LOSS "):
                _, step, value = ln.split()
                seen.setdefault(int(step), []).append(float(value))
        assert sorted(seen) == list(range(1, STEPS + 1)), out[-4000:]
        for step, values in seen.items():
            np.testing.assert_allclose(values, losses[step], rtol=1e-5, atol=1e-6)
        result = json.loads(lines[-1])
        assert result["replicas"] == 4
        np.testing.assert_allclose(result["sums"], [x.sum() for x in leaves], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            result["squares"], [(x * x).sum() for x in leaves], rtol=1e-5, atol=1e-6
        )
