"""Codebase Adaptation (RIME) and Coding (CAMG): fix real bugs in real repositories with a shell.

Both environments serve the same bug-fix tasks in two pinned PyPI releases, `tablib` 3.10.0 and
`tenacity` 9.2.1, whose sdists ship their test suites:

    python codebase.py fetch         # once, at set-up: sdists + test deps into the local cache
    env = make("codebase")           # or make("coding")
    obs = env.reset(env.tasks("test")[0])
    obs, reward, done = env.step("grep -n 'def stack' src/tablib/core.py")   # any shell command
    obs, reward, done = env.step("submit")                                    # grade and end

A task (data/codebase/<repo>.json; 48 tablib and 42 tenacity tasks) is an issue written like a
user's bug report, `edits` that inject the bug into the pristine source (its unified diff is
`patch`), hidden FAIL_TO_PASS tests (fail with the bug, pass on the pristine source) and
PASS_TO_PASS tests (the other fast, passing tests of the same test modules). `origin` says whether
the bug is real (a fix released between two versions, reversed; `source` names it) or injected.
Difficulty: 0 = a one-line slip, 1 = a few lines of one function, 2 = a logic bug across
functions. `data/codebase/build.py` computed the test lists.

Episode: the workspace (env.workdir) holds the repository at the bugged state as a git repo, with
the FAIL_TO_PASS test functions cut out of its test files. Every action is a shell command run
there in a sandbox (output capped), or `submit`. The sandbox's filesystem shows the system, the
interpreter, the test dependencies (at /opt/rime-deps, on PYTHONPATH) and the workspace; nothing of
this project: not its source, not data/codebase/*.json (patches, test lists), not the cache with
the pristine sources. Memory: `codebase` (RIME) starts every task with an empty workspace, since
RIME's memory is the writer's text; `coding` (CAMG) keeps `.agent_memory/` through the episode,
and from task to task only with keep_memory=True.
Grading builds its own tree on the host: the agent's package copied next to the pristine, complete
test files from the cache (for SWE-bench rows: the agent's checkout with the pristine test files
put back, then test_patch), and runs FAIL_TO_PASS + PASS_TO_PASS there in a fresh sandbox, with
planted control tests and cross-checks so that a report the tested code forges does not count
(see "What the grader guarantees" below). Resolution is SWE-bench's: every FAIL_TO_PASS test
passes and every PASS_TO_PASS test still passes; a missing package, an error, a timeout or an
untrusted run is unresolved. (PASS_TO_PASS runs only once every FAIL_TO_PASS test passes: it
cannot change the verdict otherwise, and it is the slow part.)
Rewards (paid by the `submit` step; 40 steps at most, running out pays 0; rollout.py shows the
turns left):
- codebase: `1 - (solved_step - 1) / 40` if resolved else 0 (the RIME benchmark's reward);
- coding: 1 if resolved else 0 (CAMG's success).
env.info: resolved, success, f2p_frac (fraction of FAIL_TO_PASS passing), solved_step.

Streams (test split = the held-out long streams; train = every other task):
- `test_stream()`: the benchmark's 19-task stream, 9 tablib tasks then 10 tenacity tasks;
- `long_streams()`: {"tablib": 26 tasks, "tenacity": 27 tasks}; they include the 19-stream's
  tasks, never a train task.

`load_swebench_jsonl(path, repo_root)` turns SWE-bench rows (instance_id, repo, base_commit,
problem_statement, patch, test_patch, FAIL_TO_PASS, PASS_TO_PASS, test_command, test_timeout) into
Tasks both envs run from local git checkouts (test_patch applied only in the grading copy); bad
input is a one-line ValueError.

Simplified on purpose: the hidden tests come from the release's own test files, not from the
upstream PR's test patch; test dependencies are pip-installed into the cache, not per-task images;
the sandbox is a namespace, not a VM (sandbox.py says what it does and does not promise).
"""

import ast
import io
import json
import os
import random
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import weakref
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path

from workspace import MEMORY_DIR, Task, read_memory, write_memory

ROOT = Path(__file__).resolve().parent
DATA_DIR = ROOT / "data" / "codebase"
MAX_STEPS = 40            # the RIME benchmark's turn budget
COMMAND_TIMEOUT = 30.0    # seconds per agent shell command
GRADE_TIMEOUT = 120.0     # seconds for one hidden-test run
OBS_CHARS = 2000          # command output shown to the agent (head and tail kept)
PATCH_EOF = "RIME_PATCH_EOF"  # heredoc delimiter of the reference policy's patch
DEPS_MOUNT = "/opt/rime-deps"  # where a sandbox sees the test dependencies (a neutral path, not the cache's)


@dataclass(frozen=True)
class RepoSpec:
    name: str
    version: str
    package: str            # importable package inside the sdist: what the agent fixes
    pythonpath: str         # relative dir put on PYTHONPATH so tests import the package
    copy: tuple             # sdist paths copied into workspace and grading dir
    drop: tuple = ()        # test files whose optional deps we do not install


REPOS = {
    "tablib": RepoSpec("tablib", "3.10.0", "src/tablib", "src", ("src/tablib", "tests", "README.md")),
    "tenacity": RepoSpec("tenacity", "9.2.1", "tenacity", ".", ("tenacity", "tests", "README.rst"),
                         drop=("tests/test_tornado.py",)),
}
# tablib's test module imports xlrd, odf and openpyxl at the top and tests xls/cli export; all
# pure Python. Installed with --no-deps into the cache (pinned, so the test lists stay valid).
TEST_DEPS = ("xlrd==2.0.2", "xlwt==1.3.0", "odfpy==1.4.1", "defusedxml==0.7.1",
             "openpyxl==3.1.5", "et-xmlfile==2.0.0", "tabulate==0.10.0")
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\n"   # replaces tablib's (it needs pytest-cov)


def cache_dir() -> Path:
    """<repo>/.cache/codebase, or $RIME_CACHE/codebase when RIME_CACHE is set."""
    return Path(os.environ.get("RIME_CACHE") or ROOT / ".cache") / "codebase"


def source_dir(repo: str) -> Path:
    spec = REPOS[repo]
    return cache_dir() / f"{spec.name}-{spec.version}"


def deps_dir() -> Path:
    return cache_dir() / "deps"


def require_cache() -> None:
    missing = [str(p) for p in [*(source_dir(r) for r in REPOS), deps_dir() / ".complete"] if not p.exists()]
    if missing:
        raise RuntimeError(f"codebase cache missing ({', '.join(missing)}): run `python codebase.py fetch` "
                           "once at set-up (it needs the PyPI registry; RIME_CACHE moves the cache root)")


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"fetch: could not {what} (needs the PyPI registry):\n  {' '.join(cmd)}\n"
                           + "\n".join((res.stderr or res.stdout).strip().splitlines()[-3:]))


def fetch(log=print) -> Path:
    """Download the pinned sdists, unpack them into the cache, install test deps. Idempotent:
    what is already in the cache is kept (delete the cache folder to fetch again)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    for spec in REPOS.values():
        dest = source_dir(spec.name)
        if dest.exists():
            log(f"{spec.name} {spec.version}: already in {dest}")
            continue
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            _pip(["download", "--no-deps", "--no-binary", ":all:", f"{spec.name}=={spec.version}", "-d", tmp],
                 f"download the {spec.name} {spec.version} sdist")
            (sdist,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            shutil.move(Path(tmp) / f"{spec.name}-{spec.version}", dest)  # all or nothing
        log(f"{spec.name} {spec.version}: unpacked into {dest}")
    if (deps_dir() / ".complete").exists():
        log(f"test dependencies: already in {deps_dir()}")
    else:
        _pip(["install", "--no-deps", "--upgrade", "--target", str(deps_dir()), *TEST_DEPS],
             "install the test dependencies")
        (deps_dir() / ".complete").write_text("\n".join(TEST_DEPS) + "\n")
        log(f"test dependencies: installed into {deps_dir()} ({', '.join(TEST_DEPS)})")
    return cache


# ----------------------------------------------------------------------------- tasks and streams

def _load_repo_data(repo: str) -> dict:
    path = DATA_DIR / f"{repo}.json"
    assert path.exists(), f"task data {path} is missing"
    return json.loads(path.read_text())


def load_tasks(env_name: str = "codebase") -> list[Task]:
    """Every task of both repositories, in file order. split 'test' = in a held-out long stream."""
    tasks = []
    for repo in REPOS:
        data = _load_repo_data(repo)
        held_out = set(data["long_stream"])
        for t in data["tasks"]:
            split = "test" if t["id"] in held_out else "train"
            tasks.append(Task(id=f"{env_name}/{t['id']}", env=env_name, difficulty=t["difficulty"],
                              group=repo, split=split, data={**t, "repo": repo, "kind": "native"}))
    return tasks


def long_streams(env_name: str = "codebase") -> dict[str, list[Task]]:
    """The held-out long streams: {'tablib': 26 tasks, 'tenacity': 27 tasks}, in stream order."""
    by_id = {t.data["id"]: t for t in load_tasks(env_name)}
    return {repo: [by_id[i] for i in _load_repo_data(repo)["long_stream"]] for repo in REPOS}


def test_stream(env_name: str = "codebase") -> list[Task]:
    """The benchmark's 19-task stream: 9 tablib tasks then 10 tenacity tasks."""
    by_id = {t.data["id"]: t for t in load_tasks(env_name)}
    return [by_id[i] for repo in REPOS for i in _load_repo_data(repo)["test_stream"]]


test_stream.__test__ = False  # not a pytest test when imported into a test module


SWEBENCH_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
                   "FAIL_TO_PASS", "PASS_TO_PASS", "test_command", "test_timeout")


def load_swebench_jsonl(path, repo_root, env_name: str = "coding") -> list[Task]:
    """SWE-bench rows -> Tasks. repo_root: a git checkout, or a folder of checkouts named after
    the repo's last part ("jazzband/tablib" -> repo_root/tablib), holding base_commit (nothing is
    fetched). test_command must run pytest: the test ids are appended to it, with --junitxml.
    A missing file, a row without the fields above or a repository not available offline raises
    ValueError with a one-line message."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"SWE-bench file {path} does not exist")
    tasks = []
    for num, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{num}: not a JSON object ({exc})") from None
        missing = [f for f in SWEBENCH_FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise ValueError(f"{path}:{num}: row lacks {', '.join(missing)} (SWE-bench rows need {', '.join(SWEBENCH_FIELDS)})")
        root = Path(repo_root)
        checkout = root if (root / ".git").exists() else root / str(row["repo"]).split("/")[-1]
        if not (checkout / ".git").exists():
            raise ValueError(f"{path}:{num}: {row['repo']} is not available offline: no git checkout at {checkout}")
        found = subprocess.run(["git", "-C", str(checkout), "cat-file", "-e", f"{row['base_commit']}^{{commit}}"],
                               capture_output=True)
        if found.returncode != 0:
            raise ValueError(f"{path}:{num}: the checkout {checkout} lacks base_commit {row['base_commit']}")
        data = {k: row[k] for k in SWEBENCH_FIELDS}
        for k in ("FAIL_TO_PASS", "PASS_TO_PASS"):   # the HF dataset stores these as JSON strings
            try:
                data[k] = json.loads(data[k]) if isinstance(data[k], str) else list(data[k])
            except (json.JSONDecodeError, TypeError):
                raise ValueError(f"{path}:{num}: {k} must be a list of test ids (or one as a JSON string)") from None
        data.update(kind="swebench", checkout=str(checkout.resolve()), issue=row["problem_statement"])
        tasks.append(Task(id=f"{env_name}/{row['instance_id']}", env=env_name, difficulty=1,
                          group=row["repo"], split="test", data=data))
    return tasks


# ----------------------------------------------------------------------------- workspaces

def apply_edits(root: Path, edits: list[dict]) -> None:
    """Apply a task's bug: each edit replaces the one occurrence of `old` in `file` by `new`."""
    for e in edits:
        path = root / e["file"]
        text = path.read_text()
        assert text.count(e["old"]) == 1, f"edit of {e['file']} must match exactly once: {e['old'][:60]!r}"
        path.write_text(text.replace(e["old"], e["new"]))


_AST_LOCK = threading.Lock()


def parse_python(text: str) -> ast.Module:
    """ast.parse under a lock: some CPython releases (3.11.7 among them) can fail with "SystemError:
    AST constructor recursion depth mismatch" when two threads parse at once, and rollout.py resets
    many environments in threads."""
    with _AST_LOCK:
        return ast.parse(text)


def hide_tests(root: Path, test_ids: list[str]) -> None:
    """Cut the given test functions (with their decorators) out of the test files under root."""
    by_file = {}
    for tid in test_ids:
        file, *names = tid.split("::")
        by_file.setdefault(file, set()).add(tuple(n.split("[")[0] for n in names))
    for file, wanted in by_file.items():
        path = root / file
        lines = path.read_text().splitlines(keepends=True)
        cut = []   # (first, last, replacement): 1-based line ranges of the original file

        def visit(body, prefix, cls):
            mine = []
            for node in body:
                if isinstance(node, ast.ClassDef):
                    visit(node.body, (*prefix, node.name), node)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (*prefix, node.name) in wanted:
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    mine.append([first, node.end_lineno, ""])
            if cls is not None and mine and len(mine) == len(body):   # an empty class body is a syntax error
                mine[0][2] = " " * body[0].col_offset + "pass\n"
            cut.extend(mine)

        visit(parse_python("".join(lines)).body, (), None)
        # bottom-up, so that every range still points at the original lines when it is cut
        for first, last, replacement in sorted(cut, reverse=True):
            lines[first - 1:last] = [replacement] if replacement else []
        path.write_text("".join(lines))


def _copy_tree(src: Path, dst: Path, items) -> None:
    for rel in items:
        s, d = src / rel, dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_dir():
            shutil.copytree(s, d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(s, d)


def pristine_tree(repo: str, dest: Path, package: bool = True) -> None:
    """The release's files a task uses (package, tests, README, our pytest.ini), copied from the cache."""
    spec = REPOS[repo]
    _copy_tree(source_dir(spec.name), dest, [c for c in spec.copy if package or c != spec.package])
    for rel in spec.drop:
        (dest / rel).unlink(missing_ok=True)
    (dest / "pytest.ini").write_text(PYTEST_INI)


def _git_archive(checkout: str, commit: str) -> bytes:
    return subprocess.run(["git", "-C", checkout, "archive", "--format=tar", commit],
                          capture_output=True, check=True).stdout


def prepare_workspace(data: dict, workdir: Path) -> None:
    """Fill an empty workdir (but for .agent_memory) with the task's repository at the bug."""
    if data["kind"] == "native":
        pristine_tree(data["repo"], workdir)
        apply_edits(workdir, data["edits"])
        hide_tests(workdir, data["FAIL_TO_PASS"])
    else:
        with tarfile.open(fileobj=io.BytesIO(_git_archive(data["checkout"], data["base_commit"]))) as tar:
            tar.extractall(workdir, filter="data")
    # a git repo at the bugged state, so `git diff` shows the agent its own changes
    env = dict(os.environ, GIT_AUTHOR_NAME="rime", GIT_AUTHOR_EMAIL="rime@localhost",
               GIT_COMMITTER_NAME="rime", GIT_COMMITTER_EMAIL="rime@localhost")
    git = ["git", "-C", str(workdir), "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    (workdir / ".git" / "info").mkdir(parents=True, exist_ok=True)
    (workdir / ".git" / "info" / "exclude").write_text(f"{MEMORY_DIR}/\n__pycache__/\n")
    subprocess.run([*git, "add", "-A"], check=True, env=env)
    subprocess.run([*git, "commit", "-q", "--no-gpg-sign", "-m", "task start"], check=True, env=env)


def agent_env(data: dict, workdir: Path) -> dict:
    """Extra environment variables of a shell in workdir (the agent's, or a grading run's): the
    package and the test deps importable, the deps by their neutral path inside the sandbox."""
    if data["kind"] != "native":
        return {"PYTHONDONTWRITEBYTECODE": "1"}
    spec = REPOS[data["repo"]]
    return {"PYTHONPATH": f"{(workdir / spec.pythonpath).resolve()}{os.pathsep}{DEPS_MOUNT}",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def open_sandbox(workdir: Path, env: dict, timeout: float):
    """A sandbox on workdir that sees the system, the interpreter, the test deps (at DEPS_MOUNT) and
    workdir: nothing of this project (its source, data/, the cache with the pristine sources)."""
    from sandbox import Sandbox
    return Sandbox(timeout=timeout, workdir=workdir, env=env, mounts={DEPS_MOUNT: str(deps_dir())})


# ----------------------------------------------------------------------------- grading
#
# What the grader guarantees, and what it does not. Grading runs the tests on a copy the grader
# builds on the host: the agent's package (or, for SWE-bench rows, its checkout with the pristine test
# files, conftest.py, pytest.ini and tox.ini put back), next to the release's pristine tests, in a
# fresh directory of a fresh sandbox that the agent never saw and that holds no task data. The code
# under test runs inside the pytest process, so it can write anything pytest can: the junit report,
# the output, the exit status. The grader therefore trusts no single channel. It plants control
# tests with random, plausible names at random places among the real tests, some that must pass and
# some that must fail, asks for them in a shuffled list with the real ids, and counts the run only
# when: pytest exits 1 (the must-fail controls fail), the report (at a random name outside the
# tested tree) has exactly one entry per asked id, every control comes out as planted, and pytest's
# printed summary agrees with the report. A report forged without running the tests (the known
# attack: write an all-pass junit file and `os._exit(0)`) fails these checks: it would have to pick
# out the must-fail controls, 4-8 of 8-16 random names, by chance. What this does not stop: code
# that reads the planted test files, works out which controls fail, and imitates pytest's report,
# summary and exit status for them. The controls make that a deliberate program aimed at this grader
# rather than a cheap trick; a grader that shares no process with the tested code would be needed
# to rule it out.

@dataclass
class Grade:
    resolved: bool
    f2p_frac: float                                      # fraction of FAIL_TO_PASS tests passing
    failed: list = field(default_factory=list)           # FAIL_TO_PASS/PASS_TO_PASS ids not passing
    error: str = ""                                      # why grading could not run, if it could not


@dataclass
class TestRun:
    passed: dict                                         # {asked id: passed?}; all False unless trusted
    seconds: dict                                        # {asked id: seconds, as pytest reported them}
    error: str = ""                                      # why the run does not count; "" when it does


TestRun.__test__ = False  # not a pytest test class when imported into a test module


def _junit_key(test_id: str) -> str:
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


def _read_report(path: Path) -> dict | None:
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


def _distrust(exit_code: int, output: str, cases: dict, asked: list, controls: dict) -> str:
    """Why a finished run's report cannot be believed, or "" when every cross-check holds."""
    if exit_code != 1:
        return f"pytest exit status {exit_code}, expected 1 (some planted checks must fail)"
    keys = {_junit_key(t) for t in asked}
    if set(cases) != keys:
        return f"the report has {len(cases)} entries for {len(keys)} asked tests ({len(keys - set(cases))} missing)"
    wrong = sum(cases[_junit_key(t)][0] != must_pass for t, must_pass in controls.items())
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


def run_tests(data: dict, stage: Path, test_ids: list[str], command: str, timeout: float) -> TestRun:
    """Run pytest on test_ids in a fresh copy of stage (a complete tree the grader built) -> TestRun.
    The copy gets planted control tests; the run counts only if the cross-checks above hold."""
    rng = random.SystemRandom()
    none = TestRun({t: False for t in test_ids}, {t: 0.0 for t in test_ids})
    with tempfile.TemporaryDirectory(prefix="codebase-grade-") as tmp:
        box = Path(tmp)
        tree = box / "repo"
        shutil.copytree(stage, tree, symlinks=True)
        files = sorted({t.split("::")[0] for t in test_ids})
        if not all((tree / f).is_file() and not (tree / f).is_symlink() for f in files):
            return replace(none, error="a test file is missing from the grading tree")
        try:   # in up to 3 of the asked files: parsing every test module would slow each run down
            controls = plant_controls(tree, rng.sample(files, min(3, len(files))), rng)
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            return replace(none, error=f"a test file cannot be parsed: {exc}")
        asked = [*test_ids, *controls]
        rng.shuffle(asked)
        report = box / f"{secrets.token_hex(8)}.xml"   # beside the tree, not in it
        cmd = (f"cd {tree.name} && {command} -q --tb=no --junitxml={shlex.quote(str(report))} "
               + " ".join(shlex.quote(t) for t in asked))
        with open_sandbox(box, agent_env(data, tree), timeout) as sb:
            res = sb.run(cmd)
        if res.timed_out:
            return replace(none, error="timeout")
        cases = _read_report(report)
        if cases is None:
            return replace(none, error="pytest wrote no report: " + res.output[-2000:])
    reason = _distrust(res.exit_code, res.output, cases, asked, controls)
    if reason:
        return replace(none, error=f"grading run untrusted: {reason}")
    return TestRun({t: cases[_junit_key(t)][0] for t in test_ids}, {t: cases[_junit_key(t)][1] for t in test_ids})


TEST_CONFIG = ("conftest.py", "pytest.ini", "tox.ini")   # put back pristine (or removed) before a SWE-bench run


def _stage_swebench(data: dict, workdir: Path, stage: Path) -> str:
    """The agent's checkout with the pristine test files, then test_patch -> "" or why it failed."""
    shutil.copytree(workdir, stage, symlinks=True, ignore=shutil.ignore_patterns(".git", MEMORY_DIR))
    patched = re.findall(r"^(?:---|\+\+\+) [ab]/(\S+)", data["test_patch"], flags=re.M)
    tests = {t.split("::")[0] for t in data["FAIL_TO_PASS"] + data["PASS_TO_PASS"]} | set(patched)
    is_test = lambda rel: rel in tests or rel.rsplit("/", 1)[-1] in TEST_CONFIG  # noqa: E731
    for p in [p for p in stage.rglob("*") if p.name in TEST_CONFIG or str(p.relative_to(stage)) in tests]:
        if p.is_symlink() or p.is_file():
            p.unlink()         # the agent's copy goes (an added conftest.py too); pristine ones come back
    try:   # the data filter refuses a member that would land outside stage (through an agent's symlink)
        with tarfile.open(fileobj=io.BytesIO(_git_archive(data["checkout"], data["base_commit"]))) as tar:
            tar.extractall(stage, members=[m for m in tar.getmembers() if m.isfile() and is_test(m.name)],
                           filter="data")
    except (tarfile.TarError, OSError) as exc:
        return f"the pristine test files could not be put back: {exc}"
    applied = subprocess.run(["git", "apply", "-"], cwd=stage, input=data["test_patch"].encode(), capture_output=True)
    if applied.returncode != 0:
        return "test_patch did not apply: " + applied.stderr.decode()[-500:]
    return ""


def grade(data: dict, workdir: Path, timeout: float = GRADE_TIMEOUT) -> Grade:
    """SWE-bench resolution of the agent's workspace, judged on a copy the grader builds (see above)."""
    f2p, p2p = data["FAIL_TO_PASS"], data["PASS_TO_PASS"]
    with tempfile.TemporaryDirectory(prefix="codebase-stage-") as tmp:
        stage = Path(tmp) / "repo"
        if data["kind"] == "native":
            spec = REPOS[data["repo"]]
            pkg = workdir / spec.package
            if pkg.is_symlink() or not pkg.is_dir() or not (pkg / "__init__.py").is_file():
                return Grade(False, 0.0, f2p + p2p, f"the package {spec.package}/ is gone from the workspace")
            pristine_tree(spec.name, stage, package=False)
            shutil.copytree(pkg, stage / spec.package, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
            command = f"{shlex.quote(sys.executable)} -m pytest"
        else:
            problem = _stage_swebench(data, workdir, stage)
            if problem:
                return Grade(False, 0.0, f2p + p2p, problem)
            command = data["test_command"]
            timeout = float(data.get("test_timeout") or timeout)
        # FAIL_TO_PASS first: most submissions fail one, and then PASS_TO_PASS cannot change the verdict
        run = run_tests(data, stage, f2p, command, timeout)
        status, error = dict(run.passed), run.error
        if all(status[t] for t in f2p) and p2p:
            run = run_tests(data, stage, p2p, command, timeout)
            status.update(run.passed)
            error = run.error
    failed = [t for t in f2p + p2p if not status.get(t, False)]
    f2p_frac = sum(status[t] for t in f2p) / max(1, len(f2p))
    return Grade(not failed, f2p_frac, failed, error)


# ----------------------------------------------------------------------------- environments

ACTIONS = ("Actions (one per turn, inside <action>...</action>):\n"
           "  <action>a shell command</action>   e.g. grep -n \"def \" {example}\n"
           "  <action>submit</action>   grade your fix with hidden tests and end the task")


def _clip(text: str, limit: int = OBS_CHARS) -> str:
    if len(text) <= limit:
        return text
    # keep head and tail: tracebacks and pytest summaries put the useful line last
    return text[: limit // 2] + f"\n[... {len(text) - limit} characters cut ...]\n" + text[-limit // 2:]


def _clean_action(action) -> str:
    text = action if isinstance(action, str) else ("" if action is None else str(action))
    text = text.strip()
    if text.startswith("```"):  # a fenced ```bash block (RIME's actor format) is accepted too
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0].strip()
    for prefix in ("shell_command:", "shell:"):   # the CAMG envs' shell form (rollout's reset protocol uses it)
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    return text


class CodebaseEnv:
    """RIME's Codebase Adaptation: score = 1 - (solved_step - 1) / 40 when resolved, else 0.

    Every task starts in an empty workspace: RIME's memory is the writer's text, given in the prompt,
    so nothing the agent leaves on disk (its `.agent_memory/` included) reaches the next task. The
    workspace (env.workdir, a temporary directory) is made on first use and removed by close() or
    when the env is garbage-collected."""

    name = "codebase"

    def __init__(self, command_timeout: float = COMMAND_TIMEOUT, grade_timeout: float = GRADE_TIMEOUT,
                 obs_chars: int = OBS_CHARS, max_steps: int = MAX_STEPS, require_cache: bool = True):
        if require_cache:
            require_cache_fn()
        self._kwargs = dict(command_timeout=command_timeout, grade_timeout=grade_timeout,
                            obs_chars=obs_chars, max_steps=max_steps, require_cache=require_cache)
        self.command_timeout, self.grade_timeout, self.obs_chars = command_timeout, grade_timeout, obs_chars
        self.max_steps = max_steps
        self.task, self.info, self.num_steps, self.done = None, {}, 0, True
        self._workdir, self._remove_workdir, self._sandbox = None, None, None
        self._memory_for_next = None   # the files of the last set_memory_files() since the last reset

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-")).resolve()
            (self._workdir / MEMORY_DIR).mkdir()
            self._remove_workdir = weakref.finalize(self, shutil.rmtree, self._workdir, True)
        return self._workdir

    def score(self, resolved: bool, step: int) -> float:
        return 1.0 - (step - 1) / self.max_steps if resolved else 0.0

    def tasks(self, split: str) -> list[Task]:
        assert split in ("train", "test"), f"split must be 'train' or 'test', not {split!r}"
        return [t for t in load_tasks(self.name) if t.split == split]

    def _memory_at_start(self) -> dict:
        """What `.agent_memory/` holds when the next task starts: nothing, in RIME."""
        return {}

    def _memory_line(self) -> str:
        return ""

    def reset(self, task: Task) -> str:
        kind = task.data.get("kind") if isinstance(task, Task) else None
        if kind not in ("native", "swebench"):
            raise ValueError(f"{self.name}: not a codebase task: {getattr(task, 'id', task)!r}")
        self._close_sandbox()
        memory, self._memory_for_next = self._memory_at_start(), None
        workdir = self.workdir
        for child in workdir.iterdir():   # a fresh workspace: everything goes, then the memory comes back
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        write_memory(workdir, memory)
        prepare_workspace(task.data, workdir)
        self._sandbox = open_sandbox(workdir, agent_env(task.data, workdir), self.command_timeout)
        self.task, self.num_steps, self.done = task, 0, False
        self.info = {"resolved": False, "success": 0.0, "f2p_frac": 0.0, "solved_step": 0}
        if kind == "native":
            spec = REPOS[task.data["repo"]]
            where = f"the {spec.name} {spec.version} repository (package in {spec.package}/, tests in tests/)"
            files = sorted({i.split("::")[0] for i in task.data["FAIL_TO_PASS"]})
            run = f"Run tests: python -m pytest -q {' '.join(files)}"
            example = f"{spec.package}/__init__.py"
        else:
            where, run, example = f"a checkout of {task.data['repo']}", "", "README*"
        return (f"You are fixing a bug in {where}; your shell starts in its root.\n"
                f"Issue:\n{task.data['issue'].strip()}\n\n{ACTIONS.format(example=example)}\n"
                + (f"{run}\n" if run else "") + self._memory_line()
                + f"You have {self.max_steps} turns; each command or submit uses one.")

    def step(self, action) -> tuple[str, float, bool]:
        if self.task is None:
            return "No task yet: call reset(task) first.", 0.0, True
        if self.done:
            return "This task has ended; reset() starts the next one.", 0.0, True
        self.num_steps += 1
        text, reward = _clean_action(action), 0.0
        if text.lower() == "submit":
            g = grade(self.task.data, self.workdir, self.grade_timeout)
            reward = self.score(g.resolved, self.num_steps)
            self.info.update(resolved=g.resolved, success=float(g.resolved), f2p_frac=g.f2p_frac,
                             solved_step=self.num_steps if g.resolved else 0)
            self.done = True
            f2p = self.task.data["FAIL_TO_PASS"]
            broke = " but some previously passing tests now fail" if g.f2p_frac == 1 and not g.resolved else ""
            obs = (f"Submitted. Hidden tests: {round(g.f2p_frac * len(f2p))} of {len(f2p)} failing tests now pass"
                   f"{broke}. Resolved: {'yes' if g.resolved else 'no'}. Score {reward:.3f}.")
            return obs, reward, True
        if not text or "\x00" in text:
            obs = ("Invalid action: give one shell command or `submit`.\n"
                   + ACTIONS.format(example=REPOS.get(self.task.data.get("repo"), REPOS["tablib"]).package))
        else:
            try:
                res = self._sandbox.run(text)
                head = "[timed out]\n" if res.timed_out else ""
                obs = head + _clip(res.output, self.obs_chars).rstrip() + f"\n[exit code {res.exit_code}]"
            except Exception as exc:  # a command the shell cannot even start must not end the run
                obs = f"The command could not run: {type(exc).__name__}: {exc}"
        if self.num_steps >= self.max_steps:
            self.done = True
            obs += "\nOut of turns: the task ended without a submission (score 0)."
        # no "N turns remaining" line here: rollout.py appends the budget to every observation
        return obs, reward, self.done

    def reference_policy(self, task: Task):
        """Scripted oracle: apply the fix as a patch, run the visible tests, submit."""
        if task.data["kind"] == "native":
            fix = f"patch -p1 -R --no-backup-if-mismatch <<'{PATCH_EOF}'\n{task.data['patch']}{PATCH_EOF}"
            files = sorted({i.split("::")[0] for i in task.data["FAIL_TO_PASS"]})
            check = f"python -m pytest -q -x --tb=short {' '.join(files)}"
        else:
            fix = f"git apply <<'{PATCH_EOF}'\n{task.data['patch']}{PATCH_EOF}"
            check = "git diff --stat"
        actions = iter([fix, check, "submit"])
        return lambda obs: next(actions, "submit")

    def memory_files(self) -> dict[str, str]:
        return read_memory(self.workdir)

    def set_memory_files(self, files: dict[str, str]) -> None:
        """Replace `.agent_memory/` now. In Coding the next reset starts with these files; in RIME's
        codebase every task still starts empty."""
        self._memory_for_next = dict(files)
        write_memory(self.workdir, files)

    def clone(self):
        return type(self)(**self._kwargs)

    def _close_sandbox(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def close(self) -> None:
        self._close_sandbox()
        if self._remove_workdir is not None:
            self._remove_workdir()
        self._workdir, self._remove_workdir = None, None


class CodingEnv(CodebaseEnv):
    """CAMG's Coding environment: the same tasks, 40 steps, explicit submit, score = resolution.

    `.agent_memory/` lasts the whole episode (CAMG's context-reset protocol writes CONTINUATION.md
    there). Across tasks it is blank unless keep_memory=True, which carries the folder from one
    task to the next on this instance (a stream's file memory); set_memory_files() before a reset
    always decides what that task starts with (the ablations: blank, shuffled, continuation only)."""

    name = "coding"

    def __init__(self, *args, keep_memory: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_memory = keep_memory
        self._kwargs["keep_memory"] = keep_memory

    def score(self, resolved: bool, step: int) -> float:
        return float(resolved)

    def _memory_at_start(self) -> dict:
        if self._memory_for_next is not None:
            return self._memory_for_next
        return self.memory_files() if self.keep_memory else {}

    def _memory_line(self) -> str:
        if self.keep_memory:
            return f"Your notes folder {MEMORY_DIR}/ is kept between tasks.\n"
        return f"Your notes folder {MEMORY_DIR}/ lasts until this task ends.\n"


require_cache_fn = require_cache  # CodebaseEnv's keyword argument shadows the function's name


if __name__ == "__main__":
    if sys.argv[1:] == ["fetch"]:
        try:
            print(f"codebase cache ready at {fetch()}")
        except RuntimeError as exc:   # no registry: say so, without a traceback
            sys.exit(str(exc))
    else:
        sys.exit("usage: python codebase.py fetch   (downloads tablib/tenacity sdists and test deps)")
