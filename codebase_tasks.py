"""The tasks of Codebase Adaptation (RIME) and Coding (CAMG): the pinned repositories, their cache,
the task files, the streams, the relay copies and SWE-bench rows. codebase.py (the environments,
the workspace and the grader) re-exports every name here, so `codebase.X` keeps working.

The tasks are bug fixes in two pinned PyPI releases, `tablib` 3.10.0 and `tenacity` 9.2.1, whose
sdists ship their test suites. `fetch()` (`python codebase.py fetch`, once, at set-up) downloads
the sdists and the test dependencies into the cache (`cache_dir()`; RIME_CACHE moves its root);
`require_cache()` says in one line when that has not been done.

A task (data/codebase/<repo>.json; 48 tablib and 42 tenacity tasks; `load_tasks`) is an issue
written like a user's bug report, `edits` that inject the bug into the pristine source (its unified
diff is `patch`), hidden FAIL_TO_PASS tests (fail with the bug, pass on the pristine source) and
PASS_TO_PASS tests (the other fast, passing tests of the same test modules). `origin` says whether
the bug is real (a fix released between two versions, reversed; `source` names it) or injected.
Difficulty: 0 = a one-line slip, 1 = a few lines of one function, 2 = a logic bug across
functions. `data/codebase/build.py` computed the test lists.

Streams (test split = the held-out long streams; train = every other task):
- `test_stream()`: the benchmark's 19-task stream, 9 tablib tasks then 10 tenacity tasks;
- `long_streams()`: {"tablib": 26 tasks, "tenacity": 27 tasks}; they include the 19-stream's
  tasks, never a train task.

Relay family (`relay_tasks()`, served by `make("coding", relay=True)`): the same bug of every native
task whose edits lie in one function (70 of the 90; task id `coding/<id>/relay`, difficulty 3, same
split), with its location (`bug_location`: file, function, line); `ci_report` is what the env's `ci`
action shows.

`load_swebench_jsonl(path, repo_root)` turns SWE-bench rows (instance_id, repo, base_commit,
problem_statement, patch, test_patch, FAIL_TO_PASS, PASS_TO_PASS, test_command, test_timeout) into
Tasks both envs run from local git checkouts (test_patch applied only in the grading copy); bad
input is a one-line ValueError.
"""

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from grader import parse_python
from workspace import Task

ROOT = Path(__file__).resolve().parent
DATA_DIR = ROOT / "data" / "codebase"


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


def bug_location(data: dict) -> tuple[str, str, int] | None:
    """(file, function, line) of a native task's bug in the bugged source: the innermost function
    holding every edit (qualified, e.g. "Dataset.stack") and the first edit's line; None when the
    edits span functions or files, or one lies outside any function."""
    files = {e["file"]: (source_dir(data["repo"]) / e["file"]).read_text() for e in data["edits"]}
    for e in data["edits"]:
        files[e["file"]] = files[e["file"]].replace(e["old"], e["new"])
    found = set()
    for e in data["edits"]:
        text = files[e["file"]]
        line = text[:text.index(e["new"])].count("\n") + 1
        best = None

        def visit(body, prefix):
            nonlocal best
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                        and node.lineno <= line <= node.end_lineno:
                    if not isinstance(node, ast.ClassDef):
                        best = ".".join((*prefix, node.name))
                    visit(node.body, (*prefix, node.name))
        visit(parse_python(text).body, ())
        found.add((e["file"], best, line))
    where = {(f, fn) for f, fn, _ in found}
    if len(where) != 1 or None in next(iter(where)):
        return None
    return (*next(iter(where)), min(line for _, _, line in found))


@functools.lru_cache(maxsize=2)
def relay_tasks(env_name: str = "coding") -> tuple:
    """The relay family (see the module docstring): a task per native task whose bug lies in one
    function, with its location (data["location"]: file, function, line) and data["relay"] = True."""
    out = []
    for t in load_tasks(env_name):
        where = bug_location(t.data)
        if where is not None:
            out.append(replace(t, id=f"{t.id}/relay", difficulty=3,
                               data={**t.data, "relay": True, "location": list(where)}))
    return tuple(out)


def ci_report(data: dict, log_chars: int = 1500) -> str:
    """The CI report a relay task's `ci` action shows (once): the failing tests (up to 5) and the bisected
    location first, then a log of the tests that passed (about log_chars characters), so that, as in a
    real CI log, the fact has to be picked out of a long observation."""
    file, function, line = data["location"]
    failed, passed = data["FAIL_TO_PASS"], data["PASS_TO_PASS"]
    lines = [f"CI report (shown once): {len(failed)} of {len(failed) + len(passed)} tests failed on this commit.",
             *(f"FAILED {t}" for t in failed[:5]), *([f"... and {len(failed) - 5} more FAILED"] if len(failed) > 5 else []),
             f"Bisect: the failure comes from {file}, function {function} (line {line}).",
             "The failing tests are not in your checkout. Fix that function, then submit.", "Log:"]
    size = 0
    for i, t in enumerate(passed):
        if size > log_chars:
            lines.append(f"... and {len(passed) - i} more PASSED")
            break
        lines.append(f"{t} PASSED")
        size += len(lines[-1]) + 1
    return "\n".join(lines)


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
