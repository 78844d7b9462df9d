"""The package surface: every public name resolves, and importing jaxdist (or starting
the launcher) does not import JAX until a name is used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jaxdist as jd


def test_every_public_name_resolves_to_its_module() -> None:
    import jaxdist.strategies.mirrored
    import jaxdist.values.distributed

    namespace: dict[str, object] = {}
    exec("from jaxdist import *", namespace)  # what `import *` gives users
    assert set(jd.__all__) <= set(namespace) and set(jd.__all__) <= set(dir(jd))
    # __all__ is made from the one table of public names.
    assert set(jd._PUBLIC) | set(jd._SUBMODULES) == set(jd.__all__)
    for name in jd.__all__:
        assert getattr(jd, name) is namespace[name]
    # Each name's home in the table is the module that defines it (not a re-export).
    for name, home in jd._PUBLIC.items():
        value = getattr(jd, name)
        if hasattr(value, "__module__") and not isinstance(value, type(jd)):
            assert value.__module__ == home, (name, value.__module__, home)
    assert jd.MirroredStrategy is jaxdist.strategies.mirrored.MirroredStrategy
    assert jd.PerReplica is jaxdist.values.PerReplica
    assert jd.initialize is jd.cluster_resolver.initialize
    assert jd.experimental.CommunicationOptions is not None
    with pytest.raises(AttributeError, match=r"module 'jaxdist' has no attribute 'Mirored'"):
        _ = jd.Mirored  # type: ignore[attr-defined]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in a fresh interpreter; fails the test if it fails."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )


def test_import_and_launcher_start_without_jax() -> None:
    code = (
        "import sys, jaxdist, jaxdist.launch\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'numpy')])\n"
        "jaxdist.OneDeviceStrategy\n"
        "print('jax' in sys.modules)\n"
    )
    out = _python(code)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr


def test_the_type_checking_block_spells_out_the_table() -> None:
    """What type checkers see (the TYPE_CHECKING imports) is exactly the table."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(jd))
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    seen: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            seen[alias.asname or alias.name] = node.module
    submodules = {n for n, m in seen.items() if m == "jaxdist"}
    assert submodules == set(jd._SUBMODULES)
    assert {n: m for n, m in seen.items() if m != "jaxdist"} == jd._PUBLIC


def test_star_imports_work_without_ray() -> None:
    """Ray is the optional [ps] extra: without it, `import *` leaves its names out, and
    asking for one says what to install."""
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "from jaxdist import *\n"
        "from jaxdist.experimental import *\n"
        "print('ParameterServerStrategy' in dir(), 'MirroredStrategy' in dir())\n"
        "import jaxdist\n"
        "try:\n"
        "    jaxdist.ParameterServerStrategy\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = _python(code)
    lines = out.stdout.splitlines()
    assert lines[0] == "False True", out.stdout + out.stderr
    assert "pip install 'jaxdist[ps]'" in lines[1]
