"""The README and every page under docs/: each relative link leads somewhere, each repository path they cite
in code (``apps/train_resnet.py``, ``python bench/...``) exists, and the README stays a short manual.

A link ``[text](path)`` is followed from the folder of the file that holds it, as GitHub resolves it; the
target file or folder must exist. A link ``[text](page.md#anchor)`` (or ``(#anchor)`` within the page) must
name a heading of that page by GitHub's slug: lower case, punctuation other than ``-`` and ``_`` dropped,
spaces as hyphens, ``-1``, ``-2``, ... after repeated headings. Links inside code are not links. A cited path
is one under a top-level folder of the repository (``mpicomm/``, ``apps/``, ``bench/``, ...) inside inline code
or a fenced block, read from the repository root; ``bench/results/`` (what the benchmarks write) and patterns
(``docs/results/scale.*``) are not checked.
"""

import os
import re
from pathlib import Path

import pytest

from .app_runs import REPO

ROOT = Path(REPO)
README_LIMIT = 15_000  # bytes: the README is a short manual; the rest lives in docs/

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$|`[^`\n]+`", re.S | re.M)
_TOP = "mpicomm|apps|bench|scripts|examples|slurm|tests|docs"  # the repository's top-level folders docs cite
_CITED = re.compile(rf"(?<![\w/.~-])((?:{_TOP})/[\w./-]*[\w/])(?![\w*{{}}<./])")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code spans (links in code are not followed)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = _slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto: ... are not followed


def _broken(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}: ({target})"
        if not dest.exists():
            broken.append(f"{where} -> {os.path.relpath(dest, root)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{where} -> no heading '#{anchor}' in {os.path.relpath(dest, root)}")
    return broken


def _missing_cited(page: Path, root: Path = ROOT) -> list[str]:
    text = page.read_text(encoding="utf-8")
    cited = {path for code in _CODE.finditer(text) for path in _CITED.findall(code.group(0))}
    return sorted(f"{page.relative_to(root)}: `{path}` does not exist" for path in cited
                  if not path.startswith("bench/results/") and not (root / path).exists())


def test_the_checker_finds_links_anchors_and_skips_code():
    """The rules above on a hand-written page, so a checker that finds nothing cannot pass the real pages."""
    text = ("# Two networks: inside and between nodes\n## `--overlap` (the option)\n## Notes\n## Notes\n"
            "See [a](x.md), [b](../y/z.md#sec \"t\"), ![img](p.png), [c](https://e.org/a.md), [d](#notes-1).\n"
            "`[not](code.md)`\n```\n[nor](fenced.md)\n# not a heading\n```\n")
    assert _LINK.findall(_prose(text)) == ["x.md", "../y/z.md#sec", "p.png", "https://e.org/a.md", "#notes-1"]
    assert {_slug(h) for h in _HEADING.findall(_FENCE.sub("", text))} == {
        "two-networks-inside-and-between-nodes", "--overlap-the-option", "notes"}


def test_the_checker_reports_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Another world size\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#another-world-size) [gone](a.md) [no](docs/a.md#other)\n", encoding="utf-8")
    assert _broken(page, tmp_path) == ["README.md: (a.md) -> a.md does not exist",
                             "README.md: (docs/a.md#other) -> no heading '#other' in docs/a.md"]


def test_the_checker_finds_cited_paths_in_code_only(tmp_path):
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / "train.py").write_text("", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("Run `python apps/train.py` or `apps/gone.py`, not apps/prose.py; `docs/results/scale.*`,\n"
                    "`bench/results/out.json`, `~/x/apps/home.py`.\n```bash\nsbatch slurm/job.sbatch\n```\n",
                    encoding="utf-8")
    assert _missing_cited(page, tmp_path) == ["README.md: `apps/gone.py` does not exist",
                                              "README.md: `slurm/job.sbatch` does not exist"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_repository_path_exists(page):
    missing = _missing_cited(page)
    assert not missing, "paths cited that the repository does not hold:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page):
    broken = _broken(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_short_manual():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail into docs/"
