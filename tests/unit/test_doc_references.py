"""Every document the repository cites is in the repository, and every cited section exists.

Code, tests, the proto, scripts, the Dockerfile and the docs cite documents as paths
(``docs/architecture.md#object-keys``, ``README.md``, or a markdown link from one document
to another).
A clone must be able to follow each one, so:

* a cited ``*.md`` path (or any ``docs/...`` path) must exist, relative to the repository
  root or to the citing file's folder;
* a ``#anchor`` after a markdown path must be the GitHub anchor of one of its headings;
* the old forms of citing private notes (a capitalised name, a section sign and a number;
  "seed section" and a number) cite documents no clone has, so they fail too.

The checker is tested on deliberately broken text first, so it is known to be able to fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {
    ".git",
    ".venv",
    ".venv-vllm033",
    ".venv-sglang",
    ".venv-lmcache",
    "venv",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    "build",
    "dist",
    ".eggs",
}
SUFFIXES = {".py", ".pyi", ".proto", ".sh", ".md", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".txt"}
NAMES = {"Dockerfile", "Makefile", ".dockerignore"}

_MD = ".md"
# A path ending in .md, with an optional #anchor; not part of a URL (no "://" before it).
MD_REF = re.compile(r"(?<![\w./:-])((?:[\w-]+/|\.\./|\./)*[\w.-]+" + re.escape(_MD) + r")(?:#([\w-]+))?")
# Any path under docs/ (a folder, an image, a document).
DOCS_REF = re.compile(r"(?<![\w./:-])((?:\.\./)*docs/[\w./-]*[\w/])(?:#([\w-]+))?")
# The private notes' section marks: a capitalised name, a section sign, a number.
SECTION_REF = re.compile(
    r"\b([A-Z][A-Z_]+)(?:" + re.escape(_MD) + r")? ?\u00a7 ?\d+"
    r"|\b(?i:seeds? section) \d+"
)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors of every heading of a markdown file (outside fenced code), with GitHub's
    ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _resolve(ref: str, citing: Path, root: Path) -> Path | None:
    for base in (citing.parent, root):
        target = (base / ref).resolve()
        if target.exists():
            return target
    return None


def problems(text: str, citing: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the references in ``text`` (from file ``citing``): one line each."""
    out: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{citing.relative_to(root) if citing.is_relative_to(root) else citing}:{lineno}"
        for m in SECTION_REF.finditer(line):
            out.append(
                f"{where}: {m.group(0)!r} cites a section of a document that is not in the "
                "repository; cite docs/<doc>.md#<heading> instead"
            )
        refs = [(m.group(1), m.group(2)) for m in MD_REF.finditer(line)]
        refs += [(m.group(1), m.group(2)) for m in DOCS_REF.finditer(line) if not m.group(1).endswith(_MD)]
        for ref, anchor in refs:
            target = _resolve(ref, citing, root)
            if target is None:
                out.append(f"{where}: {ref!r} does not exist in the repository")
            elif anchor and target.suffix == _MD and anchor not in anchors(target):
                out.append(f"{where}: {ref}#{anchor}: no heading of {ref} has that anchor")
    return out


SELF = Path(__file__).resolve()  # its checker's tests cite missing documents on purpose


def cited_files(root: Path = ROOT):
    for path in sorted(root.rglob("*")):
        if path.resolve() == SELF:
            continue
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name in NAMES):
            yield path


# --- the checker can fail -------------------------------------------------------------------


def test_checker_fails_on_a_missing_document(tmp_path):
    (tmp_path / "docs").mkdir()
    src = tmp_path / "mod.py"
    missing = "DESIGN" + _MD
    assert problems(f'"""The contract ({missing})."""', src, tmp_path)
    assert problems("see docs/nowhere" + _MD + " and docs/plots/", src, tmp_path)


def test_checker_fails_on_an_old_section_mark(tmp_path):
    mark = "DESIGN \u00a73"
    found = problems(f"# keys ({mark})", tmp_path / "mod.py", tmp_path)
    assert len(found) == 1 and "\u00a7" in found[0]
    assert problems("Rules (seed " + "section 3):", tmp_path / "mod.py", tmp_path)


def test_checker_fails_on_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Object keys\n\n```sh\n# not a heading\n```\n")
    src = tmp_path / "mod.py"
    assert problems("docs/a" + _MD + "#object-keys", src, tmp_path) == []
    assert problems("docs/a" + _MD + "#object-format", src, tmp_path)
    assert problems("docs/a" + _MD + "#not-a-heading", src, tmp_path)


def test_checker_resolves_links_relative_to_the_citing_document(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("## The store process\n## Tiers\n## Tiers\n")
    (tmp_path / "README.md").write_text("# r\n")
    doc = tmp_path / "docs" / "b.md"
    ok = "[a](a" + _MD + "#the-store-process), [again](a" + _MD + "#tiers-1), [r](../README" + _MD + ")"
    assert problems(ok, doc, tmp_path) == []
    assert problems("https://example.com/x/GONE" + _MD, doc, tmp_path) == []  # a URL is not ours


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Object keys", "object-keys"),
        ("The store process (`kvstore serve`)", "the-store-process-kvstore-serve"),
        ("Load or recompute", "load-or-recompute"),
        (
            "Engines users run: tensor parallelism, hybrid attention, MLA",
            "engines-users-run-tensor-parallelism-hybrid-attention-mla",
        ),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


# --- the repository -------------------------------------------------------------------------


def test_every_cited_document_and_section_is_in_the_repository():
    found = []
    for path in cited_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += problems(text, path)
    assert not found, "\n".join(found)
