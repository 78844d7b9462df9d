"""What a dotted ``jaxdist....`` name denotes: shared by ``conf.py`` (the Sphinx build,
in ``.venv-docs``) and ``tests/package/test_api_reference.py`` (the test suite, in
``.venv``), so it imports nothing from Sphinx."""

from __future__ import annotations

import importlib
from typing import Any

MISSING = object()


def lookup(dotted: str) -> Any:
    """The object a dotted ``jaxdist....`` name denotes, or `MISSING`: attributes first
    (``jaxdist.training.fit`` is the function, not the package of that name), then
    submodules not yet imported."""
    first, *rest = dotted.split(".")
    try:
        obj: Any = importlib.import_module(first)
    except ImportError:
        return MISSING
    for i, part in enumerate(rest):
        found = getattr(obj, part, MISSING)
        if found is MISSING:  # a module not imported yet, or one a function's name hides
            try:
                found = importlib.import_module(".".join([first, *rest[: i + 1]]))
            except ImportError:
                return MISSING
        obj = found
    return obj
