"""The package's layers: imports run one way (the import-linter contract of ``make test``
checks which layer may import which); here, that no module hides an import of jaxdist
inside a function or under TYPE_CHECKING."""

from __future__ import annotations

import jaxdist as jd


def test_jaxdist_imports_are_at_module_level() -> None:
    """Imports run one way by layer (the import-linter contract), so no module needs an
    import of jaxdist inside a function or under TYPE_CHECKING; only the package face's
    TYPE_CHECKING table may have one."""
    import ast
    import pathlib

    root = pathlib.Path(jd.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            if any(n == "jaxdist" or n.startswith("jaxdist.") for n in names):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not found, found
