"""The grader's defence against a report the tested code forges: planted control tests and the
cross-checks a pytest run must pass to count (codebase.run_tests runs them; codebase.grade decides).

What the grader guarantees, and what it does not. Grading runs the tests on a copy the grader
builds on the host: the agent's package (or, for SWE-bench rows, its checkout with the pristine test
files, conftest.py, pytest.ini and tox.ini put back), next to the release's pristine tests, in a
fresh directory of a fresh sandbox that the agent never saw and that holds no task data. The code
under test runs inside the pytest process, so it can write anything pytest can: the junit report,
the output, the exit status. The grader therefore trusts no single channel. It plants control
tests with random, plausible names at random places among the real tests, some that must pass and
some that must fail, asks for them in a shuffled list with the real ids, and counts the run only
when: pytest exits 1 (the must-fail controls fail), the report (at a random name outside the
tested tree) has exactly one entry per asked id, every control comes out as planted, and pytest's
printed summary agrees with the report. A report forged without running the tests (the known
attack: write an all-pass junit file and `os._exit(0)`) fails these checks: it would have to pick
out the must-fail controls, 4-8 of 8-16 random names, by chance. What this does not stop: code
that reads the planted test files, works out which controls fail, and imitates pytest's report,
summary and exit status for them. The controls make that a deliberate program aimed at this grader
rather than a cheap trick; a grader that shares no process with the tested code would be needed
to rule it out.
"""

import ast
import re
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

_AST_LOCK = threading.Lock()


def parse_python(text: str) -> ast.Module:
    """ast.parse under a lock: some CPython releases (3.11.7 among them) can fail with "SystemError:
    AST constructor recursion depth mismatch" when two threads parse at once, and rollout.py resets
    many environments in threads."""
    with _AST_LOCK:
        return ast.parse(text)


def junit_key(test_id: str) -> str:
    # pytest's junit classname is the node id's path (dots, no .py) plus its classes
    file, *names = test_id.split("::")
    return ".".join([file.removesuffix(".py").replace("/", "."), *names[:-1]]) + "::" + names[-1]


WORDS = ("value", "empty", "default", "order", "format", "names", "rows", "state", "retry", "result")


def _control_test(name: str, must_pass: bool, words: list, rng) -> str:
    """The source of one control test: a small check in the style of the suite; wrong on purpose
    when it must fail (the expected value is off)."""
    a, b, c = rng.sample(range(2, 99), 3)
    off = rng.choice((-1, 1)) * rng.randint(1, 9)
    w1, w2 = rng.sample(words, 2) if len(words) >= 2 else ("left", "right")
    kind = rng.randrange(3)
    if kind == 0:
        k = rng.randrange(3)
        expect = sorted([a, b, c])[k]
        body = f"    values = [{a}, {b}, {c}]\n    assert sorted(values)[{k}] == {expect if must_pass else expect + off}\n"
    elif kind == 1:
        body = (f"    data = {{{w1!r}: {a}, {w2!r}: {b}}}\n"
                f"    assert data[{w1!r}] + data[{w2!r}] == {a + b if must_pass else a + b + off}\n")
    else:
        body = f"    text = \"{w1} {w2}\"\n    assert len(text.split()) == {2 if must_pass else 2 + abs(off)}\n"
    return f"def {name}():\n{body}"


def plant_controls(tree: Path, files: list, rng) -> dict:
    """Insert 4-8 must-pass and 4-8 must-fail test functions, named from words of the file's own test
    names, before random top-level statements of the given test files -> {test id: must pass?}."""
    parsed, words = {}, set()
    for rel in files:
        text = (tree / rel).read_text()
        body = parse_python(text).body
        names = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        starts = [min([n.lineno] + [d.lineno for d in n.decorator_list]) for n in body
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        parsed[rel] = (text, names, starts)
        words |= {w for n in names for w in n.lower().split("_")[1:] if w.isalpha() and len(w) > 2}
    words = sorted(words) if len(words) >= 4 else list(WORDS)
    controls, inserts = {}, {rel: [] for rel in files}
    for must_pass in [True] * rng.randint(4, 8) + [False] * rng.randint(4, 8):
        rel = rng.choice(files)
        text, names, starts = parsed[rel]
        name = "test_" + "_".join(rng.sample(words, rng.randint(2, 3)))
        while name in names:
            name += f"_{rng.choice(words)}"
        names.add(name)
        controls[f"{rel}::{name}"] = must_pass
        line = rng.choice(starts) if starts else len(text.splitlines()) + 1
        inserts[rel].append((line, _control_test(name, must_pass, words, rng)))
    for rel, items in inserts.items():
        lines = parsed[rel][0].splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        for line, source in sorted(items, key=lambda item: item[0], reverse=True):  # bottom-up: lines stay valid
            lines[line - 1:line - 1] = ["\n\n" + source + "\n\n"]
        (tree / rel).write_text("".join(lines))
    return controls


def read_report(path: Path) -> dict | None:
    """{junit key: (passed?, seconds)} from a junit report; None when there is no readable one. A key
    passes iff every entry under it passed (failed subtests count)."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    cases = {}
    for case in root.iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
        was_ok, seconds = cases.get(key, (True, 0.0))
        try:
            seconds += float(case.get("time") or 0)
        except ValueError:
            pass
        cases[key] = (was_ok and ok, seconds)
    return cases


def _summary_counts(output: str) -> dict | None:
    """The counts of pytest's last summary line ("2 failed, 40 passed, 3 subtests passed in 0.52s")."""
    for line in reversed(output.splitlines()):
        line = line.strip().strip("=").strip()
        if re.fullmatch(r"\d+ [a-z ]+(, \d+ [a-z ]+)* in [\d.]+s( \([\d:]+\))?", line):
            return {word: int(n) for n, word in re.findall(r"(\d+) ([a-z ]+?)(?:,|$)", line.rsplit(" in ", 1)[0])}
    return None


def distrust(exit_code: int, output: str, cases: dict, asked: list, controls: dict) -> str:
    """Why a finished run's report cannot be believed, or "" when every cross-check holds."""
    if exit_code != 1:
        return f"pytest exit status {exit_code}, expected 1 (some planted checks must fail)"
    keys = {junit_key(t) for t in asked}
    if set(cases) != keys:
        return f"the report has {len(cases)} entries for {len(keys)} asked tests ({len(keys - set(cases))} missing)"
    wrong = sum(cases[junit_key(t)][0] != must_pass for t, must_pass in controls.items())
    if wrong:
        return f"{wrong} of {len(controls)} planted checks came out wrong"
    counts = _summary_counts(output)
    if counts is None:
        return "pytest printed no summary line"
    ran = sum(counts.get(k, 0) for k in ("passed", "failed", "skipped", "xfailed", "xpassed"))
    errors = counts.get("error", 0) + counts.get("errors", 0)
    if counts.get("passed", 0) != sum(ok for ok, _ in cases.values()) or not ran <= len(asked) <= ran + errors:
        return f"pytest's summary {counts} disagrees with its report of {len(asked)} tests"
    return ""
