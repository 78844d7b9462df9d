"""Sphinx configuration of jaxdist's documentation site (``make docs``).

Markdown guides and notebooks through MyST-NB, the API reference through autodoc and
autosummary, the book theme: the conventions of JAX, Flax, optax and orbax. The build runs
with warnings as errors (``-W --keep-going``) and ``nitpicky``: every cross-reference to a
jaxdist name must resolve. Names of other projects are not linked (the build reaches no
other site for their inventories) and are listed in ``nitpick_ignore_regex`` below.

The notebooks are executed at build time, each in a fresh kernel with 8 simulated CPU
devices (the environment variables below are inherited by the kernels).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jaxdist, not an installed one
sys.path.insert(0, str(ROOT / "docs"))  # _names, shared with the API-reference test
from _names import MISSING, lookup  # noqa: E402

# Before anything imports JAX: the API reference and the notebooks see 8 CPU devices.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

project = "jaxdist"
author = "the jaxdist authors"
copyright = "the jaxdist authors"
release = version = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "notebooks/README.md", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}

# Single backquotes in docstrings are code, as in JAX's and Flax's docstrings; links are
# made by the reference pages (autosummary) and by explicit roles.
default_role = "code"

# --- API reference -----------------------------------------------------------------------
autosummary_generate = True
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_mock_imports = ["ray"]  # the [ps] extra: the pages document it without installing it
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

nitpicky = True
nitpick_ignore_regex = [
    # Other projects' names (no inventories are fetched: the build runs offline).
    (r"py:.*", r"(jax|jaxlib|numpy|np|optax|flax|nnx|orbax|grain|ray|tf|tensorflow)(\..*)?"),
    (r"py:.*", r"(typing|collections|contextlib|concurrent|enum|os|pathlib|threading)\..*"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Hashable|NamedTuple)"),
    (r"py:.*", r"(int|float|str|bool|bytes|object|tuple|list|dict|set|frozenset|type|None)"),
    (r"py:.*", r"(Exception|ValueError|TypeError|RuntimeError|Warning|UserWarning)"),
    (r"py:.*", r"(Mesh|NamedSharding|PartitionSpec|P|Array|ArrayLike|Device|PyTree|DTypeLike)"),
    (r"py:.*", r"(Path|ModuleType|TracebackType|Enum|IntEnum|Protocol|Self|TypeVar|T)"),
    (r"py:.*", r"(Literal|Optional|Union|Generic|ClassVar|Final|ParamSpec|Concatenate)"),
]

# --- Notebooks ---------------------------------------------------------------------------
nb_execution_mode = "force"  # run every notebook at every build: a failing cell fails it
nb_execution_timeout = 300  # seconds per cell
nb_execution_in_temp = True  # a notebook that writes files writes them in a temporary folder
nb_execution_raise_on_error = False  # a failing cell is a warning, so an error with -W
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# --- HTML --------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "jaxdist"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path: list[str] = []


# --- Hooks ------------------------------------------------------------------------------
_TYPE_LIKE = re.compile(r"^[~\w.]+(\[.*\])?( \| [~\w.\[\], ]+)*$")


def _documented(env: Any) -> dict[int, str]:
    """The documented name of each object the API reference documents, by ``id``."""
    names: dict[int, str] = {}
    for name, entry in env.get_domain("py").objects.items():
        if not entry.aliased:
            obj = lookup(name)
            if obj is not MISSING:
                names.setdefault(id(obj), name)
    return names


def _resolve_by_object(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """A reference to a jaxdist name that is not documented under that path.

    Signatures name classes where they are defined (``jaxdist.strategies.base.Strategy``):
    such a reference goes to the page that documents the same object under its public
    name. An internal name (a protocol, a helper class) is shown as text. A name that
    denotes nothing stays unresolved, and ``nitpicky`` reports it."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("jaxdist."):
        return None
    obj = lookup(target)
    if obj is MISSING:
        return None
    public = _documented(env).get(id(obj))
    if public is None:
        return contnode
    py = env.get_domain("py")
    for role in (node["reftype"], "obj"):
        found = py.resolve_xref(env, node["refdoc"], app.builder, role, public, node, contnode)
        if found is not None:
            return found
    return None


def _keep_prose_first_lines(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Napoleon reads the first line of a property's docstring as ``type: description``;
    where the part before the colon is prose (``The device of each logical core: ...``),
    put the sentence back together."""
    if what not in ("attribute", "property", "data"):
        return
    for i, line in enumerate(lines):
        if line.startswith(":type: "):
            head = line[len(":type: ") :]
            if what == "property" or not _TYPE_LIKE.match(head):
                del lines[i]
                if i and not lines[i - 1].strip():
                    del lines[i - 1]
                lines[0] = f"{head}: {lines[0]}"
            return


def _dataclass_defaults(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: str | None, ret: str | None
) -> tuple[str | None, str | None] | None:
    """A dataclass field made by a factory has the default ``<factory>``, which is not
    Python: Sphinx would then split the signature at every comma. Show ``...`` instead."""
    if signature and "<factory>" in signature:
        return signature.replace("<factory>", "..."), ret
    return None


_NOTEBOOK_LINK = re.compile(r"\[([^\]`]+)\]\((?:\.\./)+notebooks/(\w+)\.ipynb\)")


_JD_NAME = re.compile(r"(?<![`\w])`jd\.([A-Za-z_][\w.]*\w)(\([^`<>]*\))?`(?!`)")


def _guide_links(app: Any, docname: str, source: list[str]) -> None:
    """Links in the guides, which are Markdown that reads as files too.

    They link the notebooks by their place in the repository (``../../notebooks/x.ipynb``);
    on the site the notebooks are the documents ``notebooks/x`` (``docs/notebooks`` is a
    link to the folder), so such a link becomes a ``{doc}`` reference. A jaxdist name
    written as code (`` `jd.fit` ``, `` `jd.fit(step, ...)` ``) becomes a reference to its
    API entry (a name documented under another path is found by object, see
    `_resolve_by_object`; one that names nothing fails the build)."""
    if docname.startswith("guides/"):
        text = _NOTEBOOK_LINK.sub(r"{doc}`\1 </notebooks/\2>`", source[0])
        source[0] = _JD_NAME.sub(r"{py:obj}`jd.\1\2 <jaxdist.\1>`", text)


def setup(app: Any) -> None:
    app.connect("source-read", _guide_links)
    app.connect("autodoc-process-signature", _dataclass_defaults)
    app.connect("missing-reference", _resolve_by_object)
    app.connect("autodoc-process-docstring", _keep_prose_first_lines, priority=600)
