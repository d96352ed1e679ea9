"""Compute each Codebase task's `patch`, FAIL_TO_PASS and PASS_TO_PASS, and write them back.

    python codebase.py fetch                       # the pristine sources must be in the cache
    python data/codebase/build.py [tablib] [tenacity]

A task is authored in data/codebase/<repo>.json as id, difficulty, origin, source, issue and
`edits` (exact replacements that inject the bug). This script runs the repository's test files
once on the pristine source and once per task on the bugged source, then stores:
- patch: the unified diff pristine -> bugged (the reference policy applies it reversed);
- FAIL_TO_PASS: tests that pass on the pristine source and fail with the bug (must be non-empty);
- PASS_TO_PASS: the other pristine-passing tests of the same test modules, minus slow ones
  (> SLOW seconds: grading runs them for every submission) and ones needing packages that
  `fetch` does not install.
Tasks whose edits did not change since the last build keep their lists. It also checks the
streams: test_stream inside long_stream, sizes 9/10 and 26/27.

A bug whose tests hang (e.g. retries that never stop) times out and gets no lists: drop it.
"""

import difflib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import codebase as cb  # noqa: E402

TIMEOUT = 90.0              # seconds per run; a bug that makes a test hang gives no usable lists
SLOW = 0.25                 # seconds; slower tests stay out of PASS_TO_PASS
# tests that assert on wall-clock time (tenacity's test_sleeps wants < 1.1 ms): they fail on a busy
# machine whatever the code does, so they are never graded
TIMING = ("tests/test_asyncio.py::TestContextManager::test_sleeps",)
OPTIONAL = ("trio", "Trio")  # test ids that need packages fetch does not install
STREAM_SIZES = {"tablib": (9, 26), "tenacity": (10, 27)}


def run(repo: str, edits: list, ids: list | None = None) -> tuple[dict, dict]:
    """Run the tests `ids` (default: every test collected) the way grading runs them (codebase.run_tests:
    a sandbox, planted checks, cross-checked report) -> ({id: passed}, {id: seconds})."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cb.pristine_tree(repo, root)
        cb.apply_edits(root, edits)
        py = shlex.quote(sys.executable)
        if ids is None:   # collected on the host, where the test deps sit in the cache
            env = {**os.environ, "PYTHONPATH": f"{root / cb.REPOS[repo].pythonpath}{os.pathsep}{cb.deps_dir()}",
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            out = subprocess.run(f"{py} -m pytest --collect-only -q tests", shell=True, cwd=root,
                                 env=env, capture_output=True, text=True).stdout
            ids = [line.strip() for line in out.splitlines() if "::" in line]
        result = cb.run_tests({"kind": "native", "repo": repo}, root, ids, f"{py} -m pytest", timeout=TIMEOUT)
        assert not result.error or edits, f"pristine {repo} tests did not run: {result.error}"
        out = dict(result.passed)
        if result.error:
            out["__error__"] = result.error
        return out, result.seconds


def unified_patch(repo: str, edits: list) -> str:
    src = cb.source_dir(repo)
    patch = []
    for file in dict.fromkeys(e["file"] for e in edits):
        before = (src / file).read_text()
        after = before
        for e in edits:
            if e["file"] == file:
                after = after.replace(e["old"], e["new"])
        patch += difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                      f"a/{file}", f"b/{file}")
    return "".join(patch)


def build(repo: str) -> None:
    path = cb.DATA_DIR / f"{repo}.json"
    data = json.loads(path.read_text())
    pristine, times = run(repo, [])
    passing = [i for i, ok in pristine.items() if ok and not any(o in i for o in OPTIONAL)]
    print(f"{repo}: {len(pristine)} tests, {len(passing)} pass on the pristine source")

    passing = [i for i in passing if i not in TIMING]

    def one(task):
        if task.get("FAIL_TO_PASS") and task.get("patch") == unified_patch(repo, task["edits"]):
            return task, task["FAIL_TO_PASS"], task["PASS_TO_PASS"]   # unchanged since the last build
        try:
            bugged, _ = run(repo, task["edits"], list(pristine))
            if "__error__" in bugged:
                print(f"  {task['id']}: the bugged test run failed ({bugged['__error__'][:80]}): drop or change it")
                return task, [], []
        except AssertionError as exc:   # an edit that does not match: report it, keep going
            print(f"  {task['id']}: {exc}")
            return task, [], []
        f2p = [i for i in passing if not bugged[i]]
        files = {i.split("::")[0] for i in f2p}
        p2p = [i for i in passing if bugged[i] and i.split("::")[0] in files and times[i] <= SLOW]
        return task, f2p, p2p

    with ThreadPoolExecutor(2) as pool:
        for task, f2p, p2p in pool.map(one, data["tasks"]):
            task["patch"] = unified_patch(repo, task["edits"])
            task["FAIL_TO_PASS"], task["PASS_TO_PASS"] = f2p, p2p
            flag = "" if f2p else "   <-- NO FAIL_TO_PASS: fix this task"
            print(f"  {task['id']}: d{task['difficulty']} f2p={len(f2p)} p2p={len(p2p)}{flag}")

    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    ids = [t["id"] for t in data["tasks"]]
    assert len(set(ids)) == len(ids), f"{repo}: duplicate task ids"
    n_short, n_long = STREAM_SIZES[repo]
    assert len(data["test_stream"]) == n_short and len(data["long_stream"]) == n_long, f"{repo}: stream sizes"
    assert set(data["test_stream"]) <= set(data["long_stream"]) <= set(ids), f"{repo}: stream ids"


if __name__ == "__main__":
    cb.require_cache()
    for repo in sys.argv[1:] or list(cb.REPOS):
        build(repo)
