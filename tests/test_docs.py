"""The documentation's own rules: every relative link reaches its file and heading, the README
stays a short front door, and every page of docs/ can be reached from it.

Links are checked the way GitHub renders them: a `#anchor` must be the slug of a heading of the
target file (lower case; punctuation other than `-` and `_` dropped; each space a `-`; a repeated
heading gets `-1`, `-2`...) or an explicit `<a id="...">` / `<a name="...">`. Fenced code blocks
and inline code are not markdown, so brackets in them are not links.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 150  # a front door read in five minutes; details belong in a page of docs/

#: Top-level pages another branch is still writing: linked before they exist, checked once they do.
PENDING = {ROOT / "RELIABILITY.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def pages() -> list[Path]:
    found = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    found += [p for p in (ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md") if p.exists()]
    return found


def prose(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(markdown.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, INLINE_CODE.sub("", line)))
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    return [(number, target) for number, line in prose(page.read_text())
            for target in LINK.findall(line)]


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not file.exists():
            if file not in PENDING:
                problems.append(f"{where}: no such file")
            continue
        if anchor:
            if file.is_dir() or file.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(file.read_text()):
                problems.append(f"{where}: no heading #{anchor} in {file.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_their_file_and_heading(page: Path):
    assert broken_links(page) == []


def test_readme_stays_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the details into a "
        "page of docs/ and link it")
    text = README.read_text()
    for command in ("make demo", "make test", "docs/bring-your-own-model.md"):
        assert command in text


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(README)}
    unlinked = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))
                if p.resolve() not in linked]
    assert unlinked == []


def test_concepts_are_explained_under_the_anchors_the_pages_link():
    concepts = anchors((ROOT / "docs" / "concepts.md").read_text())
    assert {"tiers", "fingerprint", "goodput", "pools"} <= concepts


# --- the checker itself: a link checker that passes everything would prove nothing -----------------


def test_the_checker_finds_a_missing_file_a_missing_heading_and_ignores_code(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    target = tmp_path / "docs" / "target.md"
    target.write_text("# Title\n\n## Bucket storage: soft delete, not versioning\n\n## `[cost]`\n\n"
                      "## Again\n\n## Again\n\n<a id=\"explicit\"></a>\n\n```\n## Not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/target.md#bucket-storage-soft-delete-not-versioning) [ok](docs/target.md#cost)\n"
        "[ok](docs/target.md#again-1) [ok](docs/target.md#explicit) [web](https://example.com/x#y)\n"
        "[gone](docs/missing.md) [wrong](docs/target.md#no-such-heading)\n"
        "[code](docs/target.md#not-a-heading)\n"
        "`[not a link](docs/nowhere.md)`\n"
        "```\n[not a link](docs/nowhere.md)\n```\n")
    problems = broken_links(page)
    assert problems == [
        "README.md:3: docs/missing.md: no such file",
        "README.md:3: docs/target.md#no-such-heading: no heading #no-such-heading in docs/target.md",
        "README.md:4: docs/target.md#not-a-heading: no heading #not-a-heading in docs/target.md",
    ]


@pytest.mark.parametrize("heading, expected", [
    ("Getting the weights out (`python -m trainer export`)", "getting-the-weights-out-python--m-trainer-export"),
    ("Artifacts (`ctx.artifacts_dir`)", "artifacts-ctxartifacts_dir"),
    ("Before a deploy: `make preflight EXPERIMENT=experiments/x.toml`",
     "before-a-deploy-make-preflight-experimentexperimentsxtoml"),
    ("Drilling a pool (`--nodes`)", "drilling-a-pool---nodes"),
    ("3. Train it on your CPU", "3-train-it-on-your-cpu"),
    ("See [the page](other.md)", "see-the-page"),
])
def test_slugs_follow_github(heading, expected):
    assert slug(heading) == expected
