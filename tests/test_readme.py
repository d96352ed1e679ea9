"""The README is a new user's contract: its two set-up commands, CI running the test one, and links that
lead somewhere. Text only: no subprocess, no model."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAIN_COMMAND = "bash setup.sh && python rime.py"
TEST_COMMAND = "bash setup.sh && python -m pytest -q tests"
MAX_LINES = 260                                   # a README, not a lab notebook: results live in docs/
LINK = re.compile(r"\]\(([^)\s]+)\)")             # markdown [text](target) and ![alt](target)


def relative_links(path: Path) -> list:
    """(target as written, resolved file) of every link to a file in the repository; web links and
    in-page anchors are not files."""
    links = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        links.append((target, (path.parent / target.split("#")[0]).resolve()))
    return links


def test_readme_gives_both_setup_commands_verbatim():
    text = README.read_text()
    for command in (MAIN_COMMAND, TEST_COMMAND):
        assert command in text, f"README.md lost its set-up command {command!r}"


def test_ci_runs_the_readme_test_command():
    # .ci/run runs the README's test command as its two steps: set-up, then the suite
    steps = [line.split("||")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert steps == TEST_COMMAND.split(" && "), f".ci/run runs {steps}, not the README's {TEST_COMMAND!r}"


def test_readme_links_to_docs_exist():
    docs_links = [(t, f) for t, f in relative_links(README) if t.startswith("docs/")]
    assert docs_links, "README.md links to no page in docs/"
    missing = sorted({t for t, f in docs_links if not f.is_file()})
    assert not missing, f"README.md links to docs that do not exist: {missing}"


def test_docs_links_exist():
    assert DOCS, "docs/ holds no page"
    missing = [f"{page.name}: {t}" for page in DOCS for t, f in relative_links(page) if not f.exists()]
    assert not missing, f"docs/ pages link to files that do not exist: {missing}"


def test_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_LINES, f"README.md has {num_lines} lines (at most {MAX_LINES}): move figures to docs/"


def test_readme_has_no_placeholder_left():
    left = re.findall(r"<<[^<>\n]+>>", README.read_text())
    assert not left, f"README.md still holds placeholders to fill: {left}"
