"""The guides tell the truth: every Python snippet runs as written, and its claims hold.

Each ```python block of the guides in ``docs/guides/`` is executed by one test here (found
by a marker string it contains), in this process with the 8 simulated CPU devices of the
root conftest, except those that must start processes, which run under the launcher.
Results are checked against NumPy references with the tolerances stated in each test.
Other tests hold the guides' prose to the code: every ``jd.`` name they mention resolves,
the names the tf.distribute table lists as "not yet" are absent, the environment
variables and launcher options they name are real, and what they say about corrupted
checkpoints is what happens. The README's own snippets are run by ``test_readme.py``;
the guides' first two snippets are the README's, and are run there for both pages.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd

from _helpers import ORBAX_CLOSED_LOOP, REPO
from _pages import FENCE, block, read, run_block, unaccounted_blocks

GUIDES = REPO / "docs" / "guides"

# Each guide's python blocks, one marker each, found in exactly one block of that guide; a
# new snippet needs a marker here and a test that runs it.
MARKERS: dict[str, dict[str, str]] = {
    "getting_started.md": {
        "devices": 'jax.config.update("jax_num_cpu_devices", 8)',
        "quickstart": "def replica_fn(ctx, x)",
    },
    "migrating_from_tf_distribute.md": {},
    "training.md": {
        "training": "optimizer = nnx.Optimizer(model, optax.adamw(1e-2)",
        "fit": "jd.accumulate_gradients(loss_fn",
        "observing": 'jd.training.MetricsLogger("runs/demo/logs"',
    },
    "variables.md": {"variables": 'synchronization="on_read"'},
    "input.md": {"input": "def dataset_fn(input_context)"},
    "multi_process.md": {"multi_worker": "jd.MultiWorkerMirroredStrategy()   # first thing"},
    "model_parallelism.md": {
        "model_parallel": "jd.TPUStrategy(device_assignment=assignment)",
        "fsdp": "jd.experimental.FSDPStrategy(min_shard_bytes=1024",
        "mesh": 'jd.experimental.MeshStrategy({"data": 2, "fsdp": 2, "tensor": 2}, rules)',
    },
    "checkpoints.md": {"preemption": "jd.experimental.PreemptionCheckpointHandler("},
    "parameter_servers.md": {"parameter_servers": "def train_step(ctx, w, steps, batch)"},
    "performance.md": {},
    "layout.md": {},
}
PAGES = {name: read(GUIDES / name) for name in MARKERS}
ALL_TEXT = "\n".join(PAGES.values())


def _page_of(name: str) -> str:
    (page,) = [p for p, markers in MARKERS.items() if name in markers]
    return page


def _block(name: str) -> str:
    page = _page_of(name)
    return block(f"docs/guides/{page}", PAGES[page], MARKERS[page], name)


def _run(name: str, prelude: str = "") -> dict[str, Any]:
    """Executes the named guide snippet; returns its global namespace."""
    return run_block(f"docs/guides/{_page_of(name)}", _block(name), name, prelude)


def test_every_guide_is_listed() -> None:
    on_disk = sorted(p.name for p in GUIDES.glob("*.md"))
    assert on_disk == sorted(MARKERS), (
        f"docs/guides holds {on_disk}; MARKERS in tests/package/test_guides.py lists "
        f"{sorted(MARKERS)}: add the new guide (and markers for its python blocks)."
    )


@pytest.mark.parametrize("page", sorted(MARKERS))
def test_every_code_block_runs_or_says_why_not(page: str) -> None:
    """Every fenced block of a guide is run by a test: a python block by the test of its
    marker; any other block only when the HTML comment right before it names the test
    that runs it, else that comment must say why it is not run."""
    unaccounted = unaccounted_blocks(f"docs/guides/{page}", PAGES[page], MARKERS[page], globals())
    assert not unaccounted, (
        f"{unaccounted} are run by no test; add a marker to MARKERS in "
        "tests/package/test_guides.py and a test that runs the block, or put "
        "`<!-- docs-test: skip: reason -->` right before a block that cannot run here."
    )
    for marker in MARKERS[page].values():
        assert marker in PAGES[page], f"docs/guides/{page} has no block with {marker!r}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launcher_block_runs_train_py(tmp_path: pathlib.Path) -> None:
    """The launcher block's first command, on the guide's train.py: 2 processes x 4
    simulated devices all-reduce across all 8 replicas."""
    text = PAGES["multi_process.md"]
    block = next(m[2] for m in FENCE.finditer(text) if "jaxdist.launch --nprocs 2" in m[2])
    command = next(line for line in block.splitlines() if line.startswith("python -m"))
    args = command.split()
    assert args[:3] == ["python", "-m", "jaxdist.launch"] and args[-1] == "train.py", command
    (tmp_path / "train.py").write_text(_block("multi_worker"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, *args[1:]], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=200,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for i in range(2):
        line = f"[{i}] process {i} of 2: 8 replicas, all-reduce of ones = 8.0"
        assert line in out.stdout.splitlines(), out.stdout[-2000:]


def test_training_snippet_runs_and_learns() -> None:
    scope = _run("training")
    model, x, y = scope["model"], scope["x"], scope["y"]
    kernel = model.layers[0].kernel.get_value()
    assert isinstance(kernel, jax.Array) and kernel.sharding.is_fully_replicated
    assert len(kernel.sharding.device_set) == 8
    assert kernel.dtype == jnp.float32
    accuracy = float(np.mean(np.argmax(np.asarray(model(x)), -1) == y))
    assert accuracy > 0.9, accuracy  # the label is x[:, 0] > 0: easily learnt
    assert float(scope["metrics"]["loss"]) < 0.5


def test_observing_snippet_reports_speed_and_writes_logs_and_a_trace(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    scope = _run("observing", prelude=_block("training"))
    history = scope["history"].history
    for key in ("examples_per_second", "flops_per_step", "tflops_per_device", "mfu"):
        assert len(history[key]) == 2 and history[key][-1] > 0, key
    # MFU against the peak given (1 TFLOP/s): the achieved TFLOP/s per device, as a fraction.
    np.testing.assert_allclose(history["mfu"][-1], history["tflops_per_device"][-1], rtol=1e-6)
    assert any((tmp_path / "runs/demo/logs").iterdir())
    assert list((tmp_path / "runs/demo/trace/process_0").rglob("*.xplane.pb"))


@pytest.mark.timeout(120)
def test_slurm_script_gives_each_task_its_process_and_gpu() -> None:
    """The guide's batch script, as task 5 of its ``srun`` step sees the world (Slurm's
    variables made from the ``#SBATCH`` lines, in a fresh interpreter, since the GPU
    assignment must happen before JAX starts): process 5 of 8, the coordinator on the
    first node at port 8888, and the second GPU of its node."""
    text = PAGES["multi_process.md"]
    script = next(m[2] for m in FENCE.finditer(text) if m[2].startswith("#!/bin/bash"))
    options = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\d+)$", script, re.M))
    assert script.rstrip().splitlines()[-1] == "srun python train.py"
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "CUDA_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        SLURM_PROCID="5",
        SLURM_STEP_NUM_TASKS=str(nodes * per_node),
        SLURM_STEP_NODELIST=f"n[01-{nodes:02d}]",
        SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})",
        SLURM_GPUS_ON_NODE=options["gpus-per-node"],
    )
    code = (
        "import json, os, jaxdist as jd\n"
        "r = jd.cluster_resolver.resolve_default()\n"
        "print(json.dumps([type(r).__name__, r.jax_initialize_kwargs(), "
        "os.environ.get('CUDA_VISIBLE_DEVICES')]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110
    )
    assert out.returncode == 0, out.stderr[-3000:]
    name, kwargs, visible = json.loads(out.stdout.splitlines()[-1])
    assert name == "SlurmClusterResolver"
    assert kwargs == {"coordinator_address": "n01:8888", "num_processes": 8, "process_id": 5}
    assert visible == "1"  # task 5 is the second task of the second node


def test_cloud_tpu_hosts_resolve_as_the_guide_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host 3 of a 4-host slice, from the variables the guide names: process 3 of 4, the
    coordinator on worker 0 at port 8482."""
    text = PAGES["multi_process.md"]
    for name in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "8482"):
        assert name in text, name
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t0,t1,t2,t3")
    monkeypatch.setenv("TPU_WORKER_ID", "3")
    resolver = jd.cluster_resolver.resolve_default()
    assert type(resolver).__name__ == "TPUClusterResolver"
    kwargs = resolver.jax_initialize_kwargs()
    assert kwargs == {"coordinator_address": "t0:8482", "num_processes": 4, "process_id": 3}


def test_kubernetes_manifest_starts_an_indexed_job_the_resolver_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guide's Job manifest, as pod 2 of it sees the world: an Indexed Job of 4 pods, the
    label selector in the environment; the default resolver lists the pods with that
    selector (a stand-in for the Kubernetes client) and makes pod 2 process 2 of 4, with
    the coordinator on pod 0's IP at port 8470."""
    import types

    import yaml

    text = PAGES["multi_process.md"]
    manifest = next(m[2] for m in FENCE.finditer(text) if m[1] == "yaml")
    job = yaml.safe_load(manifest)
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    labels = spec["template"]["metadata"]["labels"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    selector = env["JAXDIST_KUBERNETES_LABEL_SELECTOR"]
    assert selector == ",".join(f"{k}={v}" for k, v in labels.items())

    def pod(i: int) -> Any:
        meta = types.SimpleNamespace(
            name=f"train-{i}-x", annotations={"batch.kubernetes.io/job-completion-index": str(i)}
        )
        status = types.SimpleNamespace(phase="Running", pod_ip=f"10.1.0.{i}", host_ip="10.0.0.9")
        return types.SimpleNamespace(metadata=meta, status=status)

    asked = []

    class CoreV1Api:
        def list_pod_for_all_namespaces(self, label_selector: str) -> Any:
            asked.append(label_selector)
            return types.SimpleNamespace(items=[pod(i) for i in (3, 1, 0, 2)])

    fake = types.SimpleNamespace(
        client=types.SimpleNamespace(CoreV1Api=CoreV1Api),
        config=types.SimpleNamespace(load_incluster_config=lambda: None),
    )
    monkeypatch.setitem(sys.modules, "kubernetes", fake)  # the client the image would install
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    resolver = jd.cluster_resolver.resolve_default()
    assert type(resolver).__name__ == "KubernetesClusterResolver"
    kwargs = resolver.jax_initialize_kwargs()
    assert asked and set(asked) == {selector}
    assert kwargs == {
        "coordinator_address": "10.1.0.0:8470",
        "num_processes": spec["completions"],
        "process_id": 2,
    }


@pytest.mark.timeout(120)
def test_fit_snippet_trains_stops_early_and_checkpoints() -> None:
    scope = _run("fit")
    history, state, restored = scope["history"], scope["state"], scope["restored"]
    x, y = scope["x"], scope["y"]
    val = history.history["val_loss"]
    assert history.stopped_early and len(history.epochs) < 30, history.epochs
    assert val[-1] < 1e-2 * val[0], val
    # y = x @ W exactly: the fitted weights approach least squares' (atol 0.05).
    w_ref, *_ = np.linalg.lstsq(x[:448], y[:448], rcond=None)
    np.testing.assert_allclose(np.asarray(state.params["w"]), w_ref, atol=0.05)
    assert state.params["w"].sharding.is_fully_replicated
    # The last checkpoint is the final state; only the newest 2 are kept.
    assert restored.step == history.step == int(state.step)
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    names = os.listdir(scope["ckpt_dir"])
    kept = sorted(int(d.split("-")[1]) for d in names if d.startswith("ckpt-"))
    assert len(kept) == 2 and kept[-1] == history.step, kept


def test_multi_worker_snippet_is_a_one_process_cluster() -> None:
    scope = _run("multi_worker")
    strategy = scope["strategy"]
    assert strategy.num_replicas_in_sync == 8
    assert strategy.mesh.axis_names == ("host", "local")
    assert strategy.mesh.devices.shape == (1, 8)


def test_variables_snippet_runs() -> None:
    scope = _run("variables")  # as written: the block has its imports
    assert float(scope["seen"].read_value()) == 10 * 16 * 8
    assert scope["w"].synchronization.name == "ON_WRITE"
    # Reference: the same 10 steps of gradient descent on one device (rtol 1e-5).
    w = np.zeros((4, 1), np.float32)
    losses = []
    for _ in range(10):
        err = np.ones((16, 4), np.float32) @ w - 1.0
        losses.append(float(np.mean(err**2)))
        w = w - 0.1 * (2 / 16) * np.ones((4, 16), np.float32) @ err
    np.testing.assert_allclose(np.asarray(scope["w"].read_value()), w, rtol=1e-5)
    np.testing.assert_allclose(float(scope["mean_loss"]), np.mean(losses), rtol=1e-5)


def test_input_snippet_runs() -> None:
    scope = _run("input")
    strategy = scope["strategy"]
    rows = sum(
        sum(len(v) for v in strategy.experimental_local_results(b)) for b in scope["per_replica_ds"]
    )
    assert rows == 1000


def test_model_parallel_snippet_trains_like_one_device() -> None:
    scope = _run("model_parallel")
    strategy, params = scope["strategy"], scope["params"]
    assert dict(strategy.mesh.shape) == {"replica": 4, "logical": 2}
    # The first layer's dot runs on half the hidden units per device: f32[32,32].
    assert re.search(r"= f32\[32,32\]\S* dot\(", scope["hlo"])
    # The same 20 adam steps on one device, in plain JAX (rtol 1e-5, atol 1e-6).
    tx, x = scope["tx"], scope["x"]
    y = np.sin(x[:, :1])

    def loss_fn(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    rng = np.random.default_rng(0)
    ref = {
        "w1": jnp.asarray(rng.normal(size=(8, 64)).astype(np.float32) / 3),
        "w2": jnp.asarray(rng.normal(size=(64, 1)).astype(np.float32) / 8),
    }
    opt, first = tx.init(ref), float(loss_fn(ref))
    for _ in range(20):
        loss, grads = jax.value_and_grad(loss_fn)(ref)
        updates, opt = tx.update(grads, opt, ref)
        ref = optax.apply_updates(ref, updates)
    np.testing.assert_allclose(float(scope["loss"]), float(loss), rtol=1e-5, atol=1e-6)
    assert float(loss) < 0.5 * first
    for name in ("w1", "w2"):
        assert isinstance(params[name], jd.Mirrored)
        np.testing.assert_allclose(np.asarray(params[name]), ref[name], rtol=1e-5, atol=1e-6)


def test_mesh_snippet_lays_out_by_the_rules_and_trains_like_one_device() -> None:
    from flax import nnx

    scope = _run("mesh")
    strategy, model, kernel = scope["strategy"], scope["model"], scope["kernel"]
    assert strategy.num_replicas_in_sync == 4
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (32, 128)
    # The same adamw step on one device, in plain NNX + optax (rtol 1e-5, atol 1e-6).
    with nnx.use_eager_sharding(False):
        ref = scope["MLP"]()
        opt = nnx.Optimizer(ref, optax.adamw(1e-3), wrt=nnx.Param)
    x = scope["x"]
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - jnp.sin(x)) ** 2))(ref)
    opt.update(ref, grads)
    np.testing.assert_allclose(float(scope["loss"]), float(loss), rtol=1e-5, atol=1e-6)
    got, want = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_fsdp_snippet_shards_the_state_and_trains_like_one_device() -> None:
    from flax import nnx

    scope = _run("fsdp")
    model, opt, kernel, memory = scope["model"], scope["opt"], scope["kernel"], scope["memory"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("replica")
    assert kernel.addressable_shards[0].data.shape == (8, 512)
    state = nnx.state((model, opt))
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert max(per_device.values()) <= 1.05 * total / 8
    assert memory.argument_size_in_bytes < total / 4
    # The same 10 adamw steps on one device, in plain JAX (loss rtol 1e-5; parameters atol
    # 1e-5: adamw divides by sqrt(nu), which magnifies rounding of near-zero gradients).
    x = scope["x"]
    y = np.sin(x)
    ref_model = nnx.Sequential(
        nnx.Linear(64, 512, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(512, 64, rngs=nnx.Rngs(1))
    )
    graphdef, params = nnx.split(ref_model, nnx.Param)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)

    def loss_fn(p):
        return jnp.mean(jnp.sum((nnx.merge(graphdef, p)(x) - y) ** 2, axis=-1))

    for _ in range(10):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(float(scope["loss"]), float(loss), rtol=1e-5, atol=1e-6)
    got_params = jax.tree.leaves(nnx.state(model, nnx.Param))
    for got, want in zip(got_params, jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_preemption_snippet_resumes_through_the_launcher(tmp_path: pathlib.Path) -> None:
    """The script, SIGTERMed mid-training under the launcher, saves, is restarted, resumes at
    the saved step and ends with the weights of an uninterrupted run, bit for bit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    launch = [sys.executable, "-m", "jaxdist.launch", "--max-restarts", "1"]
    snippet = _block("preemption")
    assert "time.sleep(0.05)" in snippet
    fast = tmp_path / "fast.py"  # the same script without the pause, never stopped
    fast.write_text(snippet.replace("time.sleep(0.05)", "time.sleep(0)"))
    ref = subprocess.run(
        [*launch, str(fast), str(tmp_path / "ref")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    done = re.findall(r"^\[0\] done: w = (\[.*\])$", ref.stdout, re.M)
    assert len(done) == 1, ref.stdout[-2000:]
    # y = x @ [1, -2, 0.5, 3] exactly: 100 SGD steps get close (atol 1e-3).
    np.testing.assert_allclose(json.loads(done[0]), [1.0, -2.0, 0.5, 3.0], atol=1e-3)

    script = tmp_path / "preempt_demo.py"
    script.write_text(snippet)
    job = subprocess.Popen(
        [*launch, str(script), str(tmp_path / "ckpt")],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert job.stdout is not None
        lines = []
        for line in job.stdout:
            lines.append(line)
            if m := re.match(r"\[0\] pid (\d+): starting at step 0$", line):
                time.sleep(1.5)  # some steps in, far from the end (100 steps of 50 ms or more)
                os.kill(int(m[1]), signal.SIGTERM)
        out = "".join(lines)
        assert job.wait(timeout=60) == 0, out[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if job.stdout is not None:
            job.stdout.close()
    saved = re.findall(r"saved .*ckpt-1 after run\(\) call (\d+); calling exit_fn", out)
    assert len(saved) == 1 and 0 < int(saved[0]) < 100, out[-3000:]
    assert "process 0 exited with code 42 (first failure: preempted); process 0 got the" in out
    assert re.search(rf"^\[0\] pid \d+: starting at step {saved[0]}$", out, re.M), out[-3000:]
    assert re.findall(r"^\[0\] done: w = (\[.*\])$", out, re.M) == done  # bit for bit


# The prose ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")  # fork + exec
def test_parameter_servers_snippet_trains() -> None:
    """Async SGD on noiseless data: w reaches the true weights (1e-3), and the ON_READ
    counter counts every closure once (no worker died)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    scope: dict[str, Any] = {}
    try:
        scope = _run("parameter_servers")
        np.testing.assert_allclose(np.asarray(scope["w"]), [1.0, -2.0, 0.5], atol=1e-3)
        assert int(scope["steps"]) == 300
        assert float(scope["losses"][-1].fetch()) < 1e-5
    finally:
        if "strategy" in scope:
            scope["strategy"]._shutdown()
        if started and ray.is_initialized():
            ray.shutdown()  # the runtime jaxdist started for the snippet


def _resolve(dotted: str) -> Any:
    obj: Any = jd
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_jd_name_in_the_guides_exists() -> None:
    names = sorted(set(re.findall(r"\bjd\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_]\w*)*)", ALL_TEXT)))
    assert "fit" in names and "experimental.CommunicationOptions" in names
    missing = []
    for name in names:
        try:
            _resolve(name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"the guides mention jd.{missing}, which jaxdist does not define"


# (where, name) for what the tf.distribute table of the migration guide lists as "not yet".
NOT_YET = [
    (jd, "get_loss_reduction"),
    (jd.experimental, "CollectiveCommunication"),
    (jd.experimental, "rpc"),
    (jd.cluster_resolver, "GCEClusterResolver"),
    (jd.Strategy, "make_dataset_iterator"),
    (jd.Strategy, "make_input_fn_iterator"),
    (jd.ReplicaContext, "experimental_logical_device"),
    (jd.TPUStrategy().extended, "experimental_logical_device"),
    (jd.StrategyExtended, "update_non_slot"),
    (jd.StrategyExtended, "non_slot_devices"),
    (jd.StrategyExtended, "read_var"),
    (jd.CrossDeviceOps, "reduce_implementation"),
]


@pytest.mark.parametrize(("where", "name"), NOT_YET, ids=[n for _, n in NOT_YET])
def test_names_the_readme_lists_as_not_yet_are_absent(where: Any, name: str) -> None:
    table = PAGES["migrating_from_tf_distribute.md"]
    assert re.search(rf"\b{name}\b", table), f"the migration guide does not mention {name}"
    assert not hasattr(where, name), (
        f"{getattr(where, '__name__', where)}.{name} exists now, but the tf.distribute table "
        "of docs/guides/migrating_from_tf_distribute.md says 'not yet': update the table "
        "(and NOT_YET in tests/package/test_guides.py)."
    )


def test_static_shapes_row_matches_the_code() -> None:
    value = jd.MirroredStrategy().extended.experimental_require_static_shapes
    row = next(
        line
        for line in PAGES["migrating_from_tf_distribute.md"].splitlines()
        if "experimental_require_static_shapes` |" in line
    )
    assert f"`{value}`" in row, (value, row)


def test_environment_variables_named_in_the_guides_exist() -> None:
    source = "".join(p.read_text() for p in (REPO / "jaxdist").rglob("*.py"))
    named = set(re.findall(r"\bJAXDIST_[A-Z_]+\b", ALL_TEXT))
    assert "JAXDIST_HEARTBEAT_TIMEOUT" in named
    assert not sorted(n for n in named if n not in source)


def test_launch_commands_and_options_are_real() -> None:
    from jaxdist.launch.cli import _parser

    options = set(re.findall(r"(--[a-z][a-z-]+)", _parser("jaxdist-launch").format_help()))
    commands = re.findall(r"^(?:python -m jaxdist\.launch|jaxdist-launch) (.*)$", ALL_TEXT, re.M)
    assert len(commands) == 3
    for command in commands:
        for flag in re.findall(r"(--[a-z][a-z-]+)", command.split(" train.py")[0]):
            assert flag in options, flag
    prose = PAGES["multi_process.md"]
    for flag in re.findall(r"`(--[a-z][a-z-]+)[` ]", prose):  # not XLA's --xla_... flags
        assert flag in options, flag


def _flip_middle_byte_of_largest_data_file(directory: str) -> None:
    files = [
        f
        for f in glob.glob(os.path.join(directory, "**", "d", "*"), recursive=True)
        if os.path.isfile(f)
    ]
    target = max(files, key=os.path.getsize)
    data = bytearray(pathlib.Path(target).read_bytes())
    data[len(data) // 2] ^= 0xFF
    pathlib.Path(target).write_bytes(bytes(data))


@ORBAX_CLOSED_LOOP
def test_checkpoint_claims_hold_for_a_flipped_byte() -> None:
    """The checkpoints guide: `jd.checkpoint.restore` and `jd.training.restore_checkpoint`
    both detect a flipped data byte."""
    assert "a flipped byte" in PAGES["checkpoints.md"]
    values = jnp.arange(100_000, dtype=jnp.float32)
    with tempfile.TemporaryDirectory() as tmp:
        jd.checkpoint.save(os.path.join(tmp, "plain"), {"w": values})
        _flip_middle_byte_of_largest_data_file(os.path.join(tmp, "plain"))
        with pytest.raises(
            ValueError,
            match=r"jaxdist\.checkpoint\.restore: leaf \['w'\].*does not match its manifest",
        ):
            jd.checkpoint.restore(os.path.join(tmp, "plain"), {"w": jnp.zeros_like(values)})

        loop = jd.training.FitLoop(jd.get_strategy(), ({"w": values},), (True,), step=1)
        ckpt = jd.training.Checkpoint(os.path.join(tmp, "fit"), async_write=False)
        ckpt.set_loop(loop)
        ckpt.save()
        ckpt.close()
        intact = jd.training.restore_checkpoint(ckpt.directory, {"w": jnp.zeros(100_000)})
        np.testing.assert_array_equal(np.asarray(intact.state["w"]), np.asarray(values))
        _flip_middle_byte_of_largest_data_file(ckpt.directory)
        with pytest.raises(
            ValueError,
            match=r"jaxdist\.training\.restore_checkpoint: the checkpoint .*fit.ckpt-1 cannot be "
            r"restored: .*leaf \['items'\]\['state_0'\]\['w'\] of the checkpoint in .*fit.ckpt-1 "
            r"does not match its manifest: sha256 is",
        ):
            jd.training.restore_checkpoint(ckpt.directory, {"w": jnp.zeros(100_000)})
