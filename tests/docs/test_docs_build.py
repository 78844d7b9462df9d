"""The documentation build fails when it should: on a broken cross-reference, a reference
to a name jaxdist does not define, a link to a missing page, and an example that raises.

Each test builds a one-page site in a temporary folder with the configuration of
``docs/conf.py`` (warnings as errors, ``nitpicky``) in a fresh ``sphinx-build`` process,
and a correct page the same way as the control. ``make docs`` runs these with its own
virtual environment (``.venv-docs``), which has Sphinx and MyST-NB; the test suite's
environments do not, and skip them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="run by `make docs`, whose .venv-docs has Sphinx")
pytest.importorskip("myst_nb", reason="run by `make docs`, whose .venv-docs has MyST-NB")

CONF = Path(__file__).resolve().parents[2] / "docs" / "conf.py"


def _build(tmp_path: Path, pages: dict[str, str]) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "conf.py").write_text(
        f"import runpy\nglobals().update(runpy.run_path({str(CONF)!r}))\n", encoding="utf-8"
    )
    for name, text in pages.items():
        (src / name).write_text(textwrap.dedent(text), encoding="utf-8")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-E", "-q"]
    return subprocess.run(
        [*command, "-b", "html", str(src), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=240,
    )


_PAGE = """\
Page
====

.. autofunction:: jaxdist.has_strategy

.. autoclass:: jaxdist.MirroredStrategy
   :no-members:

See {ref}.
"""


@pytest.mark.timeout(300)
def test_a_correct_page_builds(tmp_path: Path) -> None:
    """The control: references to documented names, one of them by the path of the module
    that defines it, build without a warning."""
    ref = (
        ":py:func:`jaxdist.has_strategy` and "
        ":py:class:`jaxdist.strategies.mirrored.MirroredStrategy`"
    )
    out = _build(tmp_path, {"index.rst": _PAGE.format(ref=ref)})
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "html" / "index.html").read_text(encoding="utf-8")
    assert 'href="#jaxdist.MirroredStrategy"' in html


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ref", "warning"),
    [
        (":py:func:`jaxdist.no_such_function`", "py:func reference target not found"),
        (
            ":py:class:`jaxdist.strategies.mirrored.MirroredStrateg`",
            "py:class reference target not found: jaxdist.strategies.mirrored.MirroredStrateg",
        ),
        (":doc:`no_such_page`", "unknown document"),
    ],
    ids=["undefined-name", "misspelt-module-path", "missing-page"],
)
def test_a_broken_reference_fails_the_build(tmp_path: Path, ref: str, warning: str) -> None:
    out = _build(tmp_path, {"index.rst": _PAGE.format(ref=ref)})
    assert out.returncode != 0, "the build passed with a broken reference"
    assert warning in out.stderr, out.stderr


@pytest.mark.timeout(300)
def test_a_broken_markdown_link_fails_the_build(tmp_path: Path) -> None:
    """A guide's link to a page that does not exist (Markdown, as the guides are written)."""
    page = "# Guide\n\nSee [the other guide](no_such_guide.md) and [this one](index.md).\n"
    out = _build(tmp_path, {"index.md": page})
    assert out.returncode != 0, "the build passed with a broken link"
    assert "no_such_guide" in out.stderr, out.stderr
    assert out.stderr.count("WARNING") == 1, out.stderr  # the good link resolves


@pytest.mark.timeout(300)
def test_jaxdist_names_in_a_guide_link_to_the_api_and_a_misspelt_one_fails(
    tmp_path: Path,
) -> None:
    """In a guide, a name written as code (`` `jd.has_strategy` ``) links to its API entry;
    one that jaxdist does not define fails the build."""
    api = ".. autofunction:: jaxdist.has_strategy\n"
    guide = "# Guide\n\n`jd.has_strategy()` and `jd.has_strategie`.\n"
    index = "Site\n====\n\n.. toctree::\n\n   api\n   guides/page\n"
    (tmp_path / "src" / "guides").mkdir(parents=True)
    out = _build(tmp_path, {"index.rst": index, "api.rst": api, "guides/page.md": guide})
    assert out.returncode != 0, "the build passed with a misspelt name"
    assert out.stderr.count("WARNING") == 1, out.stderr
    assert "jaxdist.has_strategie" in out.stderr, out.stderr
    html = (tmp_path / "html" / "guides" / "page.html").read_text(encoding="utf-8")
    assert 'href="../api.html#jaxdist.has_strategy"' in html


@pytest.mark.timeout(300)
def test_a_failing_example_fails_the_build(tmp_path: Path) -> None:
    """A notebook page whose cell raises: MyST-NB executes it at build time, and the build
    fails naming the error."""
    page = """\
    ---
    file_format: mystnb
    kernelspec:
      name: python3
    ---
    # Example

    ```{code-cell} python
    import jax
    assert len(jax.devices()) == 8, jax.devices()
    ```

    ```{code-cell} python
    raise ValueError("this example is broken")
    ```
    """
    out = _build(tmp_path, {"index.md": page})
    assert out.returncode != 0, "the build passed with a failing example"
    assert "this example is broken" in out.stderr + out.stdout, out.stderr[-3000:]
    assert "AssertionError" not in out.stderr + out.stdout  # 8 devices in the kernel
