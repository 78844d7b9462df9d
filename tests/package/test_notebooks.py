"""The notebooks in ``notebooks/``: stored without outputs, and they run from top to bottom.

Each notebook runs in a fresh Jupyter kernel on this test's own interpreter, with 8
simulated CPU devices, as a reader would run it. A cell that raises fails the test
and the message names the notebook and the cell. Needs the ``test`` extra's
``nbformat``, ``nbclient``, ``ipykernel``, ``matplotlib``, ``flax`` and ``optax``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _helpers import REPO

NOTEBOOKS = REPO / "notebooks"
# Every notebook in notebooks/ is checked and executed; these must be among them.
EXPECTED = (
    "mesh_parallel",
    "migrating_from_tf_distribute",
    "model_parallel",
    "observing_training",
    "quickstart",
    "scaling",
)
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))

# What a notebook may take here (2 CPU cores, 8 simulated devices); all of them together
# run in well under two minutes.
CELL_TIMEOUT_S = 120
NOTEBOOK_TIMEOUT_S = 240


def _path(name: str) -> Path:
    return NOTEBOOKS / f"{name}.ipynb"


def _load(name: str) -> dict[str, Any]:
    with _path(name).open(encoding="utf-8") as f:
        nb: dict[str, Any] = json.load(f)
    return nb


def test_expected_notebooks_are_present() -> None:
    missing = sorted(set(EXPECTED) - set(NAMES))
    assert not missing, f"notebooks/ lacks {missing}.ipynb (it holds {NAMES})"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name: str) -> None:
    nb = _load(name)
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code"
        and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"notebooks/{name}.ipynb: code cells {dirty} have outputs or execution counts; "
        "notebooks are kept stripped. Clear them before committing (Jupyter: Edit > Clear "
        f"Outputs of All Cells, or `jupyter nbconvert --clear-output --inplace "
        f"notebooks/{name}.ipynb`)."
    )
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["language"] == "python"


def test_notebooks_are_valid_nbformat() -> None:
    (nbformat,) = _require("nbformat")
    for each in NAMES:
        nb = nbformat.read(_path(each), as_version=4)
        nbformat.validate(nb)  # raises ValidationError naming the bad field
        ids = [cell.get("id") for cell in nb.cells]
        assert len(set(ids)) == len(ids), f"notebooks/{each}.ipynb: duplicate cell ids {ids}"


# What each notebook must show with the public API (found in its code cells), and what no
# notebook may say any more.
USES = {
    "quickstart": ("jd.train_step(", "jd.compute_average_loss(", "jd.fit("),
    "migrating_from_tf_distribute": (
        "jd.compute_average_loss(",
        "jd.scale_regularization_loss(",
        "jd.fit(",
        "jd.training.EarlyStopping(",
        "jd.MultiWorkerMirroredStrategy()",
        "jd.experimental.CommunicationOptions(",
    ),
    "scaling": ("jd.accumulate_gradients(", "jd.compute_average_loss("),
    "observing_training": ("jd.fit(", "jd.training.MetricsLogger(", "jd.training.Profile("),
    "mesh_parallel": (
        "jd.experimental.MeshStrategy(",
        "jd.train_step(",
        "strategy.scope()",
        "experimental_distribute_dataset(",
    ),
    "model_parallel": (
        "jd.experimental.FSDPStrategy(",
        "jd.MirroredStrategy(",
        "jd.train_step(",
        ".memory_analysis()",
        "state_layout(",
    ),
}
STALE = ("not public yet", "not part of jaxdist's public API")


@pytest.mark.parametrize("name", sorted(USES))
def test_notebook_shows_the_public_api(name: str) -> None:
    nb = _load(name)
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    text = "\n".join("".join(c["source"]) for c in nb["cells"])
    missing = [u for u in USES[name] if u not in code]
    assert not missing, f"notebooks/{name}.ipynb: no code cell calls {missing}"
    stale = [s for s in STALE if s in text]
    assert not stale, f"notebooks/{name}.ipynb still says {stale}"
    if name == "migrating_from_tf_distribute":
        assert "python -m jaxdist.launch --nprocs 2" in text


def _require(*modules: str) -> list[Any]:
    """The modules, imported; a missing one fails the test and names the extra to install."""
    found = []
    for module in modules:
        try:
            found.append(importlib.import_module(module))
        except ImportError as err:
            pytest.fail(
                f"test_notebooks: running the notebooks needs {module!r} ({err}); install "
                'the test extra: pip install -e ".[test]".',
                pytrace=False,
            )
    return found


def _kernel_manager(tmp_path: Path) -> Any:
    """A kernel manager for a kernel on this interpreter, with 8 simulated CPU devices.

    The kernel imports the jaxdist of this checkout (PYTHONPATH), not whichever one the
    interpreter has installed: the kernel runs in ``tmp_path``, where an editable
    install of another checkout would otherwise win."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec_dir = tmp_path / "kernels" / "jaxdist-test"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxdist test kernel",
        "language": "python",
        "env": {
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "8",
            "MPLBACKEND": "Agg",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH")])
            ),
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return AsyncKernelManager(kernel_name="jaxdist-test", kernel_spec_manager=specs)


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, tmp_path: Path) -> None:
    nbformat, nbclient, *_ = _require(
        "nbformat", "nbclient", "ipykernel", "matplotlib", "flax", "optax"
    )

    nb = nbformat.read(_path(name), as_version=4)
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.perf_counter()
    try:
        client.execute(cleanup_kc=True)  # shut the kernel down and close its sockets
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"notebooks/{name}.ipynb: a cell raised:\n{err}", pytrace=False)
    elapsed = time.perf_counter() - start
    assert elapsed < NOTEBOOK_TIMEOUT_S, f"notebooks/{name}.ipynb took {elapsed:.0f} s"

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells, f"notebooks/{name}.ipynb has no code cell"
    assert all(c.execution_count is not None for c in code_cells), (
        f"notebooks/{name}.ipynb: not every code cell ran"
    )
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"notebooks/{name}.ipynb: error outputs {errors}"


# The distribution that installs each third-party module a notebook (or a jaxdist module it
# imports, e.g. jaxdist.examples.digits -> sklearn) imports.
DISTRIBUTIONS = {
    "IPython": "ipykernel",  # the kernel's own dependency
    "flax": "flax",
    "jax": "jax",
    "matplotlib": "matplotlib",
    "numpy": "numpy",
    "optax": "optax",
    "orbax": "orbax-checkpoint",
    "sklearn": "scikit-learn",
    "tensorboardX": "tensorboardX",
    "tqdm": "tqdm",
}


def _imported_modules(source: str) -> set[str]:
    """Every module an ``import`` statement anywhere in ``source`` names (inside functions
    too: ``load_digits`` imports sklearn when called)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _third_party_imports(name: str) -> set[str]:
    """The top-level third-party modules notebook ``name`` needs, following its imports of
    jaxdist's example modules (whose functions import what they use)."""
    cells = [c for c in _load(name)["cells"] if c["cell_type"] == "code"]
    lines = ["".join(c["source"]).splitlines() for c in cells]
    code = "\n".join(ln for cell in lines for ln in cell if not ln.lstrip().startswith(("%", "!")))
    needed = _imported_modules(code)
    for module in sorted(m for m in needed if m.startswith("jaxdist.examples.")):
        source = REPO / (module.replace(".", "/") + ".py")
        if source.is_file():
            needed |= _imported_modules(source.read_text(encoding="utf-8"))
    tops = {m.split(".")[0] for m in needed}
    return {t for t in tops if t != "jaxdist" and t not in sys.stdlib_module_names}


@pytest.mark.parametrize("name", NAMES)
def test_the_docs_extra_installs_what_the_notebook_imports(name: str) -> None:
    """`make docs` executes the notebooks in a virtual environment with only the ``docs``
    extra (and jax, numpy): each module they import must be installed by it."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["docs"]]
    installed = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}
    modules = _third_party_imports(name)
    unknown = sorted(m for m in modules if m not in DISTRIBUTIONS)
    assert not unknown, f"notebooks/{name}.ipynb imports {unknown}: add them to DISTRIBUTIONS"
    missing = sorted(DISTRIBUTIONS[m] for m in modules if DISTRIBUTIONS[m].lower() not in installed)
    assert not missing, (
        f"notebooks/{name}.ipynb imports modules of {missing}, which pyproject.toml's docs "
        "extra does not install: `make docs` would fail executing it; add them to the extra"
    )
