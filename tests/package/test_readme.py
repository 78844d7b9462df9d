"""The README is a landing page that tells the truth: its snippets run, its links lead
somewhere, and its claims hold.

The README keeps two ```python blocks, the device-count line and the quickstart; the
getting-started guide starts with the same two, so each test here runs both pages'
copies. The device-count snippet must run before JAX starts, so it runs in a fresh
interpreter; the quickstart runs in this process with the 8 simulated CPU devices of the
root conftest, checked against exact values.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import jaxdist as jd

from _helpers import REPO
from _pages import block, python_blocks, read, run_block, unaccounted_blocks

README = read(REPO / "README.md")
# The landing page stays short: what jaxdist is, the commands, a quickstart, the features,
# the headline figures and links; everything else is in the guides.
MAX_LINES = 200

MARKERS = {
    "devices": 'jax.config.update("jax_num_cpu_devices", 8)',
    "quickstart": "def replica_fn(ctx, x)",
}
# The README and the guide that start with the same snippets.
PAGES = {
    "README.md": README,
    "docs/guides/getting_started.md": read(REPO / "docs" / "guides" / "getting_started.md"),
}


def _block(page: str, name: str) -> str:
    return block(page, PAGES[page], MARKERS, name)


def test_the_readme_is_a_landing_page() -> None:
    lines = README.count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail into docs/guides/"
    for heading in ("## Quickstart", "## Documentation", "## Features", "## Benchmarks"):
        assert heading in README, heading
    assert README.index("make demo") < README.index("## Quickstart")


def test_every_code_block_runs_or_says_why_not() -> None:
    assert len(python_blocks(README)) == len(MARKERS), sorted(MARKERS)
    unaccounted = unaccounted_blocks("README.md", README, MARKERS, globals())
    assert not unaccounted, (
        f"{unaccounted} are run by no test; run them in tests/package/test_readme.py or put "
        "`<!-- readme-test: skip: reason -->` right before them."
    )


def test_links_lead_to_files_of_the_repository() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert "docs/guides/getting_started.md" in local
    missing = sorted(link for link in local if not (REPO / link).exists())
    assert not missing, f"README.md links to missing files {missing}"
    guides = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "guides").glob("*.md"))
    unlinked = [g for g in guides if g not in local]
    assert not unlinked, f"README.md's guide table does not link {unlinked}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", sorted(PAGES))
def test_devices_snippet_gives_8_devices_in_a_fresh_interpreter(page: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    code = _block(page, "devices") + "\nprint(len(jax.devices()))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "8", out.stdout


@pytest.mark.parametrize("page", sorted(PAGES))
def test_quickstart_runs(page: str) -> None:
    scope: dict[str, Any] = run_block(page, _block(page, "quickstart"), "quickstart")
    total, ids, strategy = scope["total"], scope["ids"], scope["strategy"]
    n = strategy.num_replicas_in_sync
    assert n == 8
    assert isinstance(total, jd.Mirrored) and isinstance(ids, jd.PerReplica)
    np.testing.assert_allclose(np.asarray(total.array), 6.0 * n)  # exact in float32
    local = strategy.experimental_local_results(ids)
    assert [int(v) for v in local] == list(range(n))
    assert float(strategy.reduce("mean", ids, axis=None)) == (n - 1) / 2


def test_demo_loss_falls() -> None:
    from jaxdist.examples import train_mlp

    first = train_mlp.main(steps=1)
    last = train_mlp.main(steps=40)
    assert last < first


def test_every_jd_name_in_the_readme_exists() -> None:
    names = sorted(set(re.findall(r"\bjd\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_]\w*)*)", README)))
    assert "MirroredStrategy" in names and "ReduceOp.SUM" in names
    missing = []
    for name in names:
        obj: Any = jd
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            missing.append(name)
    assert not missing, f"README.md mentions jd.{missing}, which jaxdist does not define"


def test_feature_table_points_at_existing_test_files() -> None:
    table = README[README.index("## Features") : README.index("## Benchmarks")]
    named = set(re.findall(r"`((?:[a-z_]+/)*test_[a-z_]+\.py)`", table))  # paths under tests/
    assert "training/fit/test_fit.py" in named and "package/test_guides.py" in named
    missing = sorted(n for n in named if not (REPO / "tests" / n).exists())
    assert not missing, f"README.md's feature table names missing test files {missing}"


def test_make_targets_exist() -> None:
    makefile = read(REPO / "Makefile")
    for target in ("demo", "test", "docs"):
        assert re.search(rf"^{target}:", makefile, re.M), target
        assert f"make {target}" in README
