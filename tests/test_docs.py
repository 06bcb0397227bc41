"""The documentation a user reads: README.md stays a short guide with the two commands, every
relative link in README.md and docs/*.md resolves (files, and headings for links into Markdown), the
reference pages exist, and the repository speaks of the product only (no numbered work periods or
issue numbers in tracked files, no file named by one).

The link check is a plain reimplementation of how GitHub renders Markdown links and heading anchors,
independent of any Markdown library.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12_000
PAGES = ("architecture", "ann", "filtering", "recommendation", "generative", "serving", "scale-out", "updating",
         "byo", "gpu", "snapshot-format", "benchmarks")
# how the project was made: a numbered work period or an issue number (the pattern `git grep -niE` takes)
HISTORY_WORDS = r"sessions? [0-9]|issues? #?[0-9]"
HISTORY_NAME = re.compile(r"session|(^|[_./-])s[0-9]+([_./-]|$)|(^|/)history\.md$", re.IGNORECASE)

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "kernels" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, markup and punctuation dropped, spaces to hyphens, repeats -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(markdown: str) -> list[str]:
    """The targets of the Markdown links and images outside code."""
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", markdown)))


def broken_links(path: Path) -> list[str]:
    text = path.read_text()
    out = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif not dest.is_relative_to(ROOT):
            out.append(f"{path.relative_to(ROOT)}: {target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append(f"{path.relative_to(ROOT)}: {target} (no heading #{anchor})")
    return out


def git(*args: str) -> str:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout


def test_readme_is_a_short_guide_with_both_commands():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= README_MAX_BYTES, f"README.md is {len(readme):,} bytes, at most {README_MAX_BYTES:,}"
    text = readme.decode()
    for command in ("make demo", "make test"):
        assert command in text, f"README.md does not show `{command}`"
    assert re.search(r"^## Limitations$", text, re.MULTILINE), "README.md has no Limitations section"


def test_reference_pages_exist_and_the_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        assert (ROOT / "docs" / f"{page}.md").is_file(), f"docs/{page}.md is missing"
        assert f"(docs/{page}.md)" in readme, f"README.md does not link docs/{page}.md"


def test_every_relative_link_resolves():
    broken = [b for path in doc_files() for b in broken_links(path)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## The `x.py` part\n\n[ok](b.md#b-heading) [gone](c.md) "
                                   "[anchor](#the-xpy-part) [bad anchor](b.md#nope) `[code](d.md)`\n"
                                   "```\n[fenced](e.md)\n```\n[web](https://example.com/x)\n")
    (tmp_path / "b.md").write_text("## B heading\n")
    assert broken_links(tmp_path / "a.md") == ["a.md: c.md (no such file)", "a.md: b.md#nope (no heading #nope)"]


def test_no_words_of_how_the_project_was_made():
    hits = git("grep", "-niE", HISTORY_WORDS, "--", ".", ":!data/")
    assert not hits, "work periods or issue numbers in tracked files (say what the product does instead):\n" + hits


def test_no_file_named_by_a_work_period():
    names = [n for n in git("ls-files").splitlines() if not n.startswith("data/") and HISTORY_NAME.search(n)]
    assert not names, f"tracked files named by a work period or history (name them by what they hold): {names}"
