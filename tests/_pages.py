"""The code blocks of the README and of the documentation guides (not a test module).

A page's ```python blocks are run by tests, each found by a marker string that it alone
contains. Any other fenced block is run by a test only when the HTML comment right before
it names that test (``<!-- docs-test: run by test_name ... -->``; the README says
``readme-test``); otherwise that comment says why it is not run
(``<!-- docs-test: skip: reason -->``): it needs a cluster, launches processes, waits for
a signal, or shows output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
_SAID = re.compile(r"<!-- (?:readme|docs)-test: (skip|run by (\w+)\b)[^>]*-->\s*\Z")


def python_blocks(text: str) -> list[str]:
    return [m[2] for m in FENCE.finditer(text) if m[1] == "python"]


def block(page: str, text: str, markers: Mapping[str, str], name: str) -> str:
    """The one python block of ``text`` that contains the marker of snippet ``name``."""
    found = [b for b in python_blocks(text) if markers[name] in b]
    assert len(found) == 1, (
        f"{page}: {len(found)} python blocks contain the marker {markers[name]!r} of the "
        f"{name!r} snippet; exactly one must."
    )
    return found[0]


def run_block(page: str, code: str, name: str, prelude: str = "") -> dict[str, Any]:
    """Executes a snippet in a fresh namespace, which it returns."""
    scope: dict[str, Any] = {}
    exec(compile(prelude + code, f"{page} ({name} snippet)", "exec"), scope)
    return scope


def unaccounted_blocks(
    page: str, text: str, markers: Mapping[str, str], tests: Mapping[str, Any]
) -> list[str]:
    """The fenced blocks of ``text`` that no test runs and no comment excuses; a python
    block must hold a marker, and a comment that names a test must name one in ``tests``."""
    unaccounted = []
    for m in FENCE.finditer(text):
        lang, body = m[1], m[2]
        first = body.splitlines()[0] if body.strip() else ""
        if lang == "python":
            if not any(marker in body for marker in markers.values()):
                unaccounted.append(f"{page}: python block starting {first!r} has no marker")
            continue
        said = _SAID.search(text[: m.start()])
        if said is None:
            unaccounted.append(f"{page}: ```{lang} block starting {first!r}")
        elif said[2] is not None and said[2] not in tests:
            unaccounted.append(f"{page}: a comment names test {said[2]}, which does not exist")
    return unaccounted


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")
