"""The README's quickstart runs as written, and the demo trains."""

from __future__ import annotations

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_quickstart_runs() -> None:
    first = _block("def replica_fn(ctx, x)")
    scope: dict = {}
    exec(compile(first, "README.md", "exec"), scope)
    total, ids, strategy = scope["total"], scope["ids"], scope["strategy"]
    n = strategy.num_replicas_in_sync
    assert n == 8
    np.testing.assert_allclose(total.array, 6.0 * n)
    assert float(strategy.reduce("mean", ids, axis=None)) == (n - 1) / 2


def test_demo_loss_falls() -> None:
    from jaxdist.examples import train_mlp

    first = train_mlp.main(steps=1)
    last = train_mlp.main(steps=40)
    assert last < first


def test_readme_variables_guide_runs() -> None:
    text = (ROOT / "README.md").read_text()
    guide = next(
        b
        for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
        if "ON_READ" in b or "on_read" in b
    )
    scope: dict = {}
    exec(
        compile("import jax, jax.numpy as jnp, jaxdist as jd\n" + guide, "README.md", "exec"), scope
    )
    assert float(scope["seen"].read_value()) == 10 * 16 * 8
    assert scope["w"].synchronization.name == "ON_WRITE"
    assert 0.0 < float(scope["mean_loss"]) < 1.0


def test_readme_input_guide_runs() -> None:
    text = (ROOT / "README.md").read_text()
    guide = next(
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "dataset_fn" in b
    )
    scope: dict = {}
    exec(
        compile("import jax, jax.numpy as jnp, jaxdist as jd\n" + guide, "README.md", "exec"), scope
    )
    rows = sum(
        sum(len(v) for v in scope["strategy"].experimental_local_results(b))
        for b in scope["per_replica_ds"]
    )
    assert rows == 1000


def _block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if marker in b)


def test_readme_training_guide_runs_and_learns() -> None:
    import jax

    scope: dict = {}
    exec(compile(_block("@jd.train_step(strategy)"), "README.md", "exec"), scope)
    model, x, y = scope["model"], scope["x"], scope["y"]
    kernel = model.layers[0].kernel.get_value()
    assert isinstance(kernel, jax.Array) and kernel.sharding.is_fully_replicated
    assert len(kernel.sharding.device_set) == 8
    accuracy = float(np.mean(np.argmax(np.asarray(model(x)), -1) == y))
    assert accuracy > 0.9, accuracy
    assert float(scope["metrics"]["loss"]) < 0.5


def test_readme_multi_worker_snippet_is_a_one_process_cluster() -> None:
    scope: dict = {}
    exec(compile(_block("MultiWorkerMirroredStrategy()"), "README.md", "exec"), scope)
    assert scope["strategy"].num_replicas_in_sync == 8
    assert scope["strategy"].mesh.axis_names == ("host", "local")


def test_readme_launch_commands_name_real_options() -> None:
    from jaxdist.launch import _parser

    text = (ROOT / "README.md").read_text()
    options = set(re.findall(r"(--[a-z][a-z-]+)", _parser("jaxdist-launch").format_help()))
    for command in re.findall(r"^(?:python -m jaxdist\.launch|jaxdist-launch) (.*)$", text, re.M):
        launcher_part = command.split(" train.py")[0]
        for flag in re.findall(r"(--[a-z][a-z-]+)", launcher_part):
            assert flag in options, flag
