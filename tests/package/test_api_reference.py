"""The API reference documents every public name: each name of ``jaxdist/__init__.py``'s
table and each name in the ``__all__`` of the public submodules has an autodoc entry in
``docs/api/*.rst``, or is named there (````jaxdist.x.y````) as another path of an object
that has one. ``make docs`` then checks that every entry renders and every reference
resolves; this test is the cheap half that runs with the test suite."""

from __future__ import annotations

import re
import types

import jaxdist as jd

from _helpers import REPO, load_script

API = REPO / "docs" / "api"
_names = load_script(REPO / "docs" / "_names.py", "docs_names")  # conf.py's lookup too
_lookup, _MISSING = _names.lookup, _names.MISSING
_DIRECTIVE = re.compile(r"^\.\. (auto\w+|currentmodule):: ([\w.]+)", re.M)


def _documented() -> tuple[set[str], set[str]]:
    """The names with an autodoc entry, and the ``jaxdist.`` paths named in literals."""
    entries: set[str] = set()
    named: set[str] = set()
    for page in sorted(API.glob("*.rst")):
        text = page.read_text(encoding="utf-8")
        module = "jaxdist"
        for kind, name in _DIRECTIVE.findall(text):
            if kind == "currentmodule":
                module = name
            elif kind == "automodule" or name.startswith("jaxdist."):
                entries.add(name)
            else:
                entries.add(f"{module}.{name}")
        named.update(re.findall(r"``(jaxdist(?:\.\w+)+)``", text))
    return entries, named


def _public_names() -> list[str]:
    names = [f"jaxdist.{n}" for n in jd._PUBLIC]
    modules: list[types.ModuleType] = [getattr(jd, m) for m in jd._SUBMODULES]
    modules += [jd.tpu.experimental, jd.experimental.partitioners, jd.experimental.coordinator]
    for module in modules:
        names.append(module.__name__)
        names += [f"{module.__name__}.{n}" for n in module.__all__]
    return sorted(set(names))


def test_every_public_name_is_in_the_api_reference() -> None:
    entries, named = _documented()
    by_object = {id(_lookup(e)) for e in entries}
    missing = []
    for name in _public_names():
        obj = _lookup(name)
        assert obj is not _MISSING, name
        if name in entries:
            continue
        if name in named and id(obj) in by_object:
            continue  # another path of a documented object, said so on its page
        missing.append(name)
    assert not missing, (
        f"docs/api/*.rst documents no {missing}: add an autodoc entry on the page of its "
        "concept (or, for another path of a documented object, name it there in ``...``)."
    )


def test_every_entry_names_a_real_object() -> None:
    entries, named = _documented()
    unknown = sorted(e for e in entries | named if _lookup(e) is _MISSING)
    assert not unknown, f"docs/api/*.rst names {unknown}, which jaxdist does not define"
