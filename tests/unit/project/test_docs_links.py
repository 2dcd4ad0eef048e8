"""Every relative link in README.md and docs/ resolves, and none leaves the repository.

The README is short and sends depth to docs/; a page moved or renamed must not leave a dead link
behind. Anchors (`page.md#section`) are checked against the target's headings, as GitHub spells
them (lowercase, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _links(text: str) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", text))
    return _LINK.findall(text)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup and punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    heading = heading.lower().replace("`", "").replace("*", "")
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_anchor(h) for h in _HEADING.findall(text)}


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page.read_text(encoding="utf-8")):
        if not _relative(target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_stays_short() -> None:
    """The README says what this is, the two commands, the map and the walk; depth goes to docs/."""
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024


def test_the_anchor_rule() -> None:
    assert _anchor("Instances across nodes (`nodesPerInstance`)") == "instances-across-nodes-nodesperinstance"
    assert (
        _anchor("Monitoring: Prometheus Operator, alerts, Grafana")
        == "monitoring-prometheus-operator-alerts-grafana"
    )
    assert _links("see [a](b.md) and `[c](d.md)`\n```\n[e](f.md)\n```\n") == ["b.md"]
