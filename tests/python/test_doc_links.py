"""Every relative link in README.md and docs/*.md resolves: the file exists, and an #anchor names
a heading of it (as GitHub derives anchors from headings). The README's Documentation list names
every page of docs/ once."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)


def relative_links(path):
    """The targets of `path`'s links that are not URLs, outside code (fenced or inline)."""
    text = re.sub(r"`[^`\n]*`", "", FENCED.sub("", path.read_text(encoding="utf-8")))
    for m in LINK.finditer(text):
        target = m.group(1)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            yield target


def heading_anchors(path):
    """The anchors of `path`'s headings as GitHub makes them: lower case, punctuation but '-'
    and '_' dropped (the text of inline code kept), spaces as '-', a repeated one suffixed -1,
    -2, ..."""
    seen = {}
    out = set()
    for line in FENCED.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            broken.append(f"{target} (no heading of {dest.name} has the anchor #{anchor})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken links"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## `reshard infer` [--force]\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#title) [ok](other.md#reshard-infer---force) "
                    "[ok](other.md#same-1) [ok](#here) [web](https://example.org/x.md)\n"
                    "`[code](nope.md)`\n\n```\n[block](nope.md)\n```\n\n# Here\n"
                    "[bad](missing.md) [bad](other.md#nowhere) [bad](#there) [bad](other.md#same-2)\n")
    found = [b.split(" ")[0] for b in broken_links(page)]
    assert found == ["missing.md", "other.md#nowhere", "#there", "other.md#same-2"]


def test_the_documentation_list_names_every_page_once():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[[^\]]*\]\(docs/([^)#]+)\)", section, flags=re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(listed) == pages, (
        f"named twice: {sorted({p for p in listed if listed.count(p) > 1})}; "
        f"not named: {sorted(set(pages) - set(listed))}")
