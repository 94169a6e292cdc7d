"""The documentation site: the generated reference pages are current, and ``mkdocs build --strict`` passes (a
broken link or anchor fails it, as the last tests show on a copy of the site)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tensora import docsgen

ROOT = Path(__file__).parents[2]
COMMITTED = ROOT / "docs" / "reference"
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}

pytestmark = pytest.mark.timeout(120)


def test_the_committed_reference_pages_are_current(tmp_path: Path) -> None:
    docsgen.write(tmp_path)
    stale = [f"docs/reference/{p.name} is stale: run {docsgen.COMMAND}" for p in sorted(tmp_path.iterdir())
             if not (COMMITTED / p.name).is_file() or (COMMITTED / p.name).read_bytes() != p.read_bytes()]
    assert stale == []


def _check(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensora.docsgen", "--check", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=ENV)


def test_the_check_names_each_stale_page_and_the_command(tmp_path: Path) -> None:
    docsgen.write(tmp_path)
    assert _check(tmp_path).returncode == 0
    (tmp_path / "metrics.md").write_text((tmp_path / "metrics.md").read_text().replace("counter", "gauge"))
    (tmp_path / "cli.md").unlink()
    done = _check(tmp_path)
    assert done.returncode == 1
    assert f"{tmp_path / 'metrics.md'} is stale: run python -m tensora.docsgen" in done.stderr
    assert f"{tmp_path / 'cli.md'} is stale: run python -m tensora.docsgen" in done.stderr
    assert "configuration.md" not in done.stderr and "http-api.md" not in done.stderr


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=90, env=ENV)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    for page in ("reference/cli/index.html", "reference/http-api/index.html", "adr/0010-fallbacks/index.html",
                 "kubernetes/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the site reads offline: no script, stylesheet or font from elsewhere (the theme's fonts are off)
    outside = re.compile(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//", re.I)
    for html in (tmp_path / "site").rglob("*.html"):
        assert not outside.search(html.read_text()), html


@pytest.mark.parametrize("link, said", [
    ("[a missing anchor](concepts/fallbacks.md#no-such-heading)", "does not contain an anchor '#no-such-heading'"),
    ("[a missing page](concepts/no-such-page.md)", "'concepts/no-such-page.md', but the target is not found"),
], ids=["anchor", "page"])
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str, said: str) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    with (tmp_path / "docs" / "index.md").open("a") as f:
        f.write(f"\n{link}\n")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert said in done.stderr


def test_the_readme_is_a_landing_page() -> None:
    """At most 200 lines, the quick start in its first 80, and every link into docs/ pointing at a page."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the rest into docs/"
    assert any("quick start" in ln.lower() for ln in lines[:80] if ln.startswith("#")), "no quick start in 80 lines"
    targets = re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines))
    assert targets, "the README links the docs"
    assert [t for t in targets if not (ROOT / t).is_file()] == []
