"""Counts what the layout rules of jaxdist hold the code to (run: ``python tests/layout_audit.py``).

- **Private reach-through**: places that read or write another object's or module's
  private members: ``x._name`` where ``x`` is not ``self``/``cls`` (another instance of
  the same class counts too), and ``from m import _name``. (A private *module* of a
  package, imported by its package's modules, is not a private member.)
- **Top-level modules**: the ``.py`` files directly under ``jaxdist/``.
- **Repeated test blocks**: runs of six or more statement lines that appear again
  elsewhere under ``tests/``, the same after whitespace is folded (blank lines, comments,
  imports and lone brackets skipped); each maximal repeated run counts once per pair of
  places.

``tests/package/test_layout.py`` holds the counts at or under their ceilings.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxdist"


_NAMEDTUPLE_API = frozenset({"_make", "_replace", "_fields", "_asdict", "_field_defaults"})
_OWN = frozenset({"self", "cls", "mcs", "type"})
# Modules of JAX, NumPy and the standard library: a private member of theirs is counted
# apart (the JAX compatibility module is the one door for JAX's).
_THIRD_PARTY = frozenset({"jax", "np", "jnp", "lax", "os", "sys", "threading", "signal"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def reach_through(path: Path) -> list[tuple[int, str, bool]]:
    """The places in ``path`` that reach into another object's or module's private
    members: ``(line, code, third_party)``. ``x._name`` counts unless ``x`` is ``self``,
    ``cls``, ``type(...)`` or ``super()`` (or ``_name`` is namedtuple API), even when
    ``x`` is another instance of the module's own class (say it through a public member)."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr not in _NAMEDTUPLE_API
        ):
            base = node.value
            if isinstance(base, ast.Name) and base.id in _OWN:
                continue
            if (
                isinstance(base, ast.Call)
                and isinstance(base.func, ast.Name)
                and base.func.id in ("type", "super")
            ):
                continue
            third = isinstance(base, ast.Name) and base.id in _THIRD_PARTY
            found.append((node.lineno, ast.unparse(node), third))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxdist"):
            for alias in node.names:
                if _private(alias.name) and not _is_module(f"{node.module}.{alias.name}"):
                    found.append((node.lineno, f"from {node.module} import {alias.name}", False))
    return sorted(found)


def all_reach_through() -> list[str]:
    """Every place under ``jaxdist/`` that reaches into jaxdist's own private members, as
    ``path:line: code`` (private members of JAX, NumPy and the standard library left out)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, code, third in reach_through(path):
            if not third:
                out.append(f"{path.relative_to(ROOT)}:{line}: {code}")
    return out


def top_level_modules() -> list[str]:
    """The modules directly under ``jaxdist/``, ``__init__.py`` left out."""
    return sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


_WINDOW = 6
_SKIP = re.compile(r"^(#|import |from \S+ import |[)\]}]+,?:?$|$)")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = " ".join(line.split())
        if not _SKIP.match(text):
            out.append((number, text))
    return out


def repeated_blocks(root: Path) -> list[tuple[str, str]]:
    """Pairs of places under ``root`` (``file:first-last``) that share a run of at least six
    code lines; one pair per run (overlapping windows of one run are merged)."""
    files = {p: _code_lines(p) for p in sorted(root.rglob("*.py"))}
    seen: dict[tuple[str, ...], list[tuple[Path, int]]] = {}
    for path, lines in files.items():
        for i in range(len(lines) - _WINDOW + 1):
            key = tuple(text for _, text in lines[i : i + _WINDOW])
            seen.setdefault(key, []).append((path, i))
    pairs: dict[tuple[Path, Path], set[tuple[int, int]]] = {}
    for places in seen.values():
        if 1 < len(places) <= 8:  # more places: a boilerplate shape, not a copy
            for a in range(len(places)):
                for b in range(a + 1, len(places)):
                    (pa, ia), (pb, ib) = places[a], places[b]
                    pairs.setdefault((pa, pb), set()).add((ia, ib))
    out = []
    for (pa, pb), starts in sorted(pairs.items()):
        runs: list[list[int]] = []  # merge windows that continue one another
        for ia, ib in sorted(starts):
            if runs and runs[-1][1] == ia - 1 and runs[-1][3] == ib - 1:
                runs[-1][1], runs[-1][3] = ia, ib
            else:
                runs.append([ia, ia, ib, ib])
        for a0, a1, b0, b1 in runs:
            la, lb = files[pa], files[pb]
            where_a = f"{pa.relative_to(root)}:{la[a0][0]}-{la[a1 + _WINDOW - 1][0]}"
            where_b = f"{pb.relative_to(root)}:{lb[b0][0]}-{lb[b1 + _WINDOW - 1][0]}"
            out.append((where_a, where_b))
    return out


if __name__ == "__main__":
    places = all_reach_through()
    if "-v" in sys.argv:
        print("\n".join(places))
    print(f"private reach-through: {len(places)}")
    print(f"top-level modules: {len(top_level_modules())} ({' '.join(top_level_modules())})")
    tests = Path(sys.argv[-1]) if len(sys.argv) > 1 and sys.argv[-1] != "-v" else ROOT / "tests"
    blocks = repeated_blocks(tests)
    if "-v" in sys.argv:
        print("\n".join(f"{a} ~ {b}" for a, b in blocks))
    print(f"repeated test blocks: {len(blocks)}")
