"""The layout rules: the layout guide's tree is the package's, few modules sit at the top, the one
late-bound hook is the only lookup by name, and private reach-through stays under its
ceiling (counted by ``tests/layout_audit.py``)."""

from __future__ import annotations

import ast
import re
import tomllib

from layout_audit import PACKAGE, ROOT, all_reach_through, repeated_blocks, top_level_modules

# Places that reach into a private member of another object or module, another instance
# of the same class included (173 before the layout work, by the same rule); lower
# it when a seam is made public, never raise it.
REACH_THROUGH_CEILING = 11
# Runs of six or more identical code lines repeated inside tests/ (12 before the layout
# work); shared helpers in tests/_helpers.py keep it down.
REPEATED_TEST_BLOCKS_CEILING = 1


# The contributors' guide to the code layout, with the tree of the package.
LAYOUT_GUIDE = ROOT / "docs" / "guides" / "layout.md"


def _guide_tree() -> dict[str, set[str]]:
    text = LAYOUT_GUIDE.read_text(encoding="utf-8")
    block = text[text.index("```text\n") + 8 :]
    block = block[: block.index("```")]
    tree: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        if line.startswith("jaxdist"):
            folder = line.strip()
            tree[folder] = set()
        elif line.strip() and not line.strip().startswith("#"):
            assert folder is not None, line
            tree[folder].update(line.split())
    return tree


def _package_tree() -> dict[str, set[str]]:
    tree: dict[str, set[str]] = {}
    for folder in [PACKAGE, *PACKAGE.rglob("*")]:
        if folder.is_dir() and folder.name != "__pycache__":
            name = f"{folder.relative_to(ROOT).as_posix()}/"
            tree[name] = {p.name for p in folder.glob("*.py")}
    return tree


def test_the_layout_guide_tree_is_the_package_tree() -> None:
    assert _guide_tree() == _package_tree(), (
        "docs/guides/layout.md's tree differs from jaxdist/: update the guide's ```text block"
    )


def test_at_most_twelve_modules_sit_directly_under_jaxdist() -> None:
    modules = top_level_modules()
    assert len(modules) <= 12, modules


def test_private_reach_through_stays_under_its_ceiling() -> None:
    places = all_reach_through()
    assert len(places) <= REACH_THROUGH_CEILING, "\n".join(places)


def test_repeated_test_blocks_stay_under_their_ceiling() -> None:
    blocks = repeated_blocks(ROOT / "tests")
    assert len(blocks) <= REPEATED_TEST_BLOCKS_CEILING, blocks


def test_the_default_strategy_hook_is_the_only_lookup_by_name() -> None:
    """Below the faces (which load public names on first use), the one module that finds
    another by name is ``_scope``, and what it finds is the default strategy; the
    import-linter configuration names that hook."""
    faces = {PACKAGE / "__init__.py", PACKAGE / "experimental" / "__init__.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in faces:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("import_module", "__import__")
            ):
                found.append((path.relative_to(ROOT).as_posix(), ast.unparse(node.args[0])))
    assert found == [("jaxdist/_scope.py", "'jaxdist.strategies.default_strategy'")]
    config = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"#.*late-bound hook", config)
    assert "jaxdist.strategies.default_strategy" in config
    contracts = tomllib.loads(config)["tool"]["importlinter"]["contracts"]
    layers = contracts[0]["layers"]
    assert layers.index("jaxdist.strategies") < layers.index("jaxdist._scope")
