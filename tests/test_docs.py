"""The documentation's claims about itself: README.md and docs/*.md link only to files (and
headings) that exist, name only tests and repository paths that exist, the README stays short
enough to read, and neither carries CI history or paths of a development machine.

Each checker is a plain function over Markdown text, so the negative controls at the bottom
feed it a small broken document and show that it reports the fault."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
USER_DOCS = [README, *sorted(DOCS_DIR.glob("*.md"))]
# Markdown elsewhere in the repository is link-checked too (it is not held to the history rules)
OTHER_DOCS = [*sorted((ROOT / "infra").rglob("*.md")), *sorted((ROOT / "results").glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
EXTERNAL = re.compile(r"^(https?:|mailto:|ftp:)", re.I)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)

TEST_REF = re.compile(r"(tests/test_\w+\.py)::(\w+)")
# a test named without its file, or with a file not under tests/: `::test_x`, `test_y.py::test_x`
LOOSE_TEST_REF = re.compile(r"(?<![\w/])(?:test_\w+\.py)?::test_\w+")
TEST_FILE = re.compile(r"(?<![\w/])tests/\w+\.py")
REPO_PATH = re.compile(r"(?<![\w./~$<-])((?:kvserve|infra|tests|proto|docs|results)/[\w./-]*[\w/])")

FORBIDDEN = {
    "a CI run id": re.compile(r"\bci[0-9]{2,3}\b", re.I),
    "a development machine's path": re.compile(r"(?<![\w.])/(?:work|home|tmp)/"),
    "an issue number": re.compile(r"(?<![\w&/])#[0-9]+\b|\bissues? [0-9]+\b", re.I),
}


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code removed: what Markdown renders as links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown document (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(text: str, base: Path, root: Path = ROOT) -> list[str]:
    """The relative links of a Markdown text (at directory `base`) whose file does not exist, or
    whose #fragment names no heading of the Markdown file it points into."""
    prose = _prose(text)
    targets = INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)
    broken = []
    for target in targets:
        if not target or EXTERNAL.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        path_part = path_part.split("?")[0]
        if not path_part:
            file_text = text  # a pure #anchor: a heading of this document
        else:
            path = (root / path_part.lstrip("/")) if path_part.startswith("/") else base / path_part
            if not path.exists():
                broken.append(f"{target} (no such file)")
                continue
            file_text = path.read_text() if fragment and path.suffix == ".md" else None
        if fragment and file_text is not None and fragment.lower() not in anchors(file_text):
            broken.append(f"{target} (no such heading)")
    return broken


def defined_tests(path: Path) -> set[str]:
    """The test functions a test module defines (at module level or in its classes)."""
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def missing_tests(text: str, root: Path = ROOT) -> list[str]:
    """The `tests/test_x.py::test_name` references of a text naming no test that exists, every
    test named without its `tests/...py` file, and every `tests/*.py` file that does not exist."""
    missing = []
    for file, name in TEST_REF.findall(text):
        path = root / file
        if not path.exists():
            missing.append(f"{file}::{name} (no such file)")
        elif name not in defined_tests(path):
            missing.append(f"{file}::{name} (no such test)")
    stripped = TEST_REF.sub("", text)
    missing += [f"{ref} (name the file as tests/test_x.py::test_name)"
                for ref in LOOSE_TEST_REF.findall(stripped)]
    missing += [f"{file} (no such file)" for file in TEST_FILE.findall(stripped)
                if not (root / file).exists()]
    return missing


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Repository paths named in the prose and inline code (not in command examples) that do
    not exist."""
    body = FENCE.sub("", text)
    return sorted({p for p in REPO_PATH.findall(body) if not (root / p.rstrip(".")).exists()})


def forbidden(text: str) -> list[str]:
    """CI run ids, development machines' paths and issue numbers in a text."""
    return [f"{what}: {m.group(0)!r}" for what, pattern in FORBIDDEN.items()
            for m in pattern.finditer(text)]


def _per_file(check, files) -> dict[str, list[str]]:
    found = {str(f.relative_to(ROOT)): check(f) for f in files}
    return {name: faults for name, faults in found.items() if faults}


def test_every_relative_link_resolves():
    """Every relative link in README.md, docs/*.md, infra/**/*.md and results/*.md points to a
    file that exists, and a #fragment into a Markdown file to one of its headings."""
    assert _per_file(lambda f: broken_links(f.read_text(), f.parent), USER_DOCS + OTHER_DOCS) == {}


def test_the_readme_is_at_most_250_lines():
    """README.md is a user's first page: at most 250 lines, the rest is under docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_every_named_test_exists():
    """Every `tests/test_x.py::test_name` in README.md and docs/*.md names a test function that
    file defines, and every test the documents name is named with its file."""
    assert _per_file(lambda f: missing_tests(f.read_text()), USER_DOCS) == {}


def test_every_named_repository_path_exists():
    """Every kvserve/, infra/, tests/, proto/, docs/ or results/ path README.md and docs/*.md
    name outside their command examples exists."""
    assert _per_file(lambda f: missing_paths(f.read_text()), USER_DOCS) == {}


def test_no_ci_history_or_development_paths():
    """README.md and docs/*.md carry no CI run ids ("ci" and a run number), no paths of a
    development machine
    (/work/..., /tmp/..., /home/...) and no issue numbers: git keeps the history."""
    assert _per_file(lambda f: forbidden(f.read_text()), USER_DOCS) == {}


def test_the_docs_index_lists_every_page_and_the_readme_links_it():
    """docs/README.md links every page under docs/, and README.md links docs/README.md."""
    index = _prose((DOCS_DIR / "README.md").read_text())
    linked = {Path(t.partition("#")[0]).name for t in INLINE_LINK.findall(index)}
    pages = {p.name for p in DOCS_DIR.glob("*.md")} - {"README.md"}
    assert pages - linked == set()
    assert "docs/README.md" in INLINE_LINK.findall(_prose(README.read_text()))


# Negative controls: each checker, fed a small document with a fault, reports it.

def test_the_link_checker_reports_a_missing_file_and_a_missing_heading(tmp_path):
    """A link to a missing file, or to a heading the target lacks, is reported; links in code,
    external links and links that resolve are not."""
    (tmp_path / "there.md").write_text("# Here it is\n\n## Serving over `gRPC`: the API\n")
    doc = ("# Top\n[ok](there.md) [ok](there.md#here-it-is)"
           " [ok](there.md#serving-over-grpc-the-api) [ok](#top)"
           " [web](https://example.com/nowhere) `[code](nowhere.md)`\n"
           "```\n[fenced](nowhere.md)\n```\n"
           "[gone](nowhere.md#x) ![img](missing.png) [bad](there.md#no-such) [self](#absent)\n"
           "[ref]: also-gone.md\n")
    assert broken_links(doc, tmp_path, tmp_path) == [
        "nowhere.md#x (no such file)", "missing.png (no such file)",
        "there.md#no-such (no such heading)", "#absent (no such heading)",
        "also-gone.md (no such file)"]


def test_the_test_reference_checker_reports_missing_tests_and_loose_names():
    """A named test that its file does not define, a file that does not exist and a test named
    without its file are each reported; a real test is not."""
    doc = ("`tests/test_docs.py::test_the_readme_is_at_most_250_lines` "
           "`tests/test_docs.py::test_that_was_never_written` "
           "`tests/test_nothing_here.py::test_x` `tests/test_nothing_here.py` "
           "`::test_orphan` `test_docs.py::test_the_readme_is_at_most_250_lines`")
    assert missing_tests(doc) == [
        "tests/test_docs.py::test_that_was_never_written (no such test)",
        "tests/test_nothing_here.py::test_x (no such file)",
        "::test_orphan (name the file as tests/test_x.py::test_name)",
        "test_docs.py::test_the_readme_is_at_most_250_lines"
        " (name the file as tests/test_x.py::test_name)",
        "tests/test_nothing_here.py (no such file)"]


def test_the_path_checker_reports_a_path_that_does_not_exist():
    """A repository path that does not exist is reported, one in a command example is not."""
    doc = ("`kvserve/workers/engine.py` and `kvserve/workers/no_such_module.py`, docs/.\n"
           "```\nkvserve/also_missing.py\n```\n")
    assert missing_paths(doc) == ["kvserve/workers/no_such_module.py"]


def test_the_history_checker_reports_run_ids_paths_and_issue_numbers():
    """CI run ids, development paths and issue numbers are reported; ordinary text is not."""
    run_id, number, issue = "ci" + "97", "#" + "16", "issue" + " 21"  # (this file is held to
    # the code rules below)
    assert forbidden(f"Measured with {run_id} in /work/main, see {number} and {issue}.") == [
        f"a CI run id: '{run_id}'", "a development machine's path: '/work/'",
        f"an issue number: '{number}'", f"an issue number: '{issue}'"]
    assert forbidden("CI runs `.ci/run`; see docs/serving.md#status-codes; 12 circles.") == []


# Code and tests say why in the present tense: a comment with a run id, an issue number or a
# date tells a story git already keeps. `ci95` is data (a 95 % confidence interval's key).
CODE_HISTORY = {
    "a CI run id": re.compile(r"\bci(?!95\b)[0-9]{2,3}\b"),
    "an issue number": re.compile(r"(?<![\w&])#[0-9]{1,3}\b|\b[Ii]ssues? #?[0-9]+\b"),
    "a date": re.compile(r"\b20[2-9][0-9]-[01][0-9]-[0-3][0-9]\b"),
}


def code_history(text: str) -> list[str]:
    """Each run id, issue number or date in a source file's text, as 'kind: match'."""
    return [f"{kind}: {m.group(0)!r}" for kind, pattern in CODE_HISTORY.items()
            for m in pattern.finditer(text)]


def test_code_and_tests_carry_no_history():
    """No .py file under kvserve/ or tests/ names a CI run, an issue or a date."""
    files = sorted([*(ROOT / "kvserve").rglob("*.py"), *(ROOT / "tests").glob("*.py")])
    assert len(files) > 100
    assert _per_file(lambda f: code_history(f.read_text()), files) == {}


def test_the_code_history_checker_reports_run_ids_issues_and_dates():
    run_id, number, date, issue = "ci" + "67", "#" + "21", "2026" + "-12-04", "issue" + " 4"
    assert code_history(f"# seen in {run_id} ({issue}, {number}), measured {date}") == [
        f"a CI run id: '{run_id}'", f"an issue number: '{issue}'",
        f"an issue number: '{number}'", f"a date: '{date}'"]
    assert code_history('rates["ci95"] = (lo, hi)  # 95 % interval') == []
