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
there (output capped), or `submit`. Grading copies the agent's package directory into a separate
directory holding the pristine, complete test files and runs FAIL_TO_PASS + PASS_TO_PASS there.
Resolution is SWE-bench's: every FAIL_TO_PASS test passes and every PASS_TO_PASS test still
passes; a missing package, an error or a timeout is unresolved. (PASS_TO_PASS runs only once
every FAIL_TO_PASS test passes: it cannot change the verdict otherwise, and it is the slow part.)
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
Tasks both envs run from local git checkouts (test_patch applied only in the grading copy).

Simplified on purpose: the hidden tests come from the release's own test files, not from the
upstream PR's test patch; test dependencies are pip-installed into the cache, not per-task
images; the sandbox is a subprocess (sandbox.py), so an agent that reaches outside its
workspace by absolute path could find the cache: the benchmark relies on the workspace holding no
hidden test, as SWE-bench does.
"""

import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from envs import MEMORY_DIR, Task, read_memory, write_memory

ROOT = Path(__file__).resolve().parent
DATA_DIR = ROOT / "data" / "codebase"
MAX_STEPS = 40            # the RIME benchmark's turn budget
COMMAND_TIMEOUT = 30.0    # seconds per agent shell command
GRADE_TIMEOUT = 120.0     # seconds for one hidden-test run
OBS_CHARS = 2000          # command output shown to the agent (head and tail kept)
PATCH_EOF = "RIME_PATCH_EOF"  # heredoc delimiter of the reference policy's patch


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


def load_swebench_jsonl(path, repo_root, env_name: str = "coding") -> list[Task]:
    """SWE-bench rows -> Tasks. repo_root: a git checkout, or a folder of checkouts named after
    the repo's last part ("jazzband/tablib" -> repo_root/tablib). test_command must run pytest:
    the test ids are appended to it, with --junitxml."""
    fields = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
              "FAIL_TO_PASS", "PASS_TO_PASS", "test_command", "test_timeout")
    tasks = []
    for num, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [f for f in fields if f not in row]
        assert not missing, f"{path}:{num}: row lacks {missing}; SWE-bench rows need {fields}"
        root = Path(repo_root)
        checkout = root if (root / ".git").exists() else root / row["repo"].split("/")[-1]
        assert (checkout / ".git").exists(), f"{path}:{num}: no git checkout for {row['repo']} at {checkout}"
        data = {k: row[k] for k in fields}
        for k in ("FAIL_TO_PASS", "PASS_TO_PASS"):   # the HF dataset stores these as JSON strings
            data[k] = json.loads(data[k]) if isinstance(data[k], str) else list(data[k])
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


def prepare_workspace(data: dict, workdir: Path) -> None:
    """Fill an (empty but for .agent_memory) workdir with the task's repository at the bug."""
    if data["kind"] == "native":
        spec = REPOS[data["repo"]]
        _copy_tree(source_dir(spec.name), workdir, spec.copy)
        for rel in spec.drop:
            (workdir / rel).unlink(missing_ok=True)
        apply_edits(workdir, data["edits"])
        hide_tests(workdir, data["FAIL_TO_PASS"])
        (workdir / "pytest.ini").write_text(PYTEST_INI)
    else:
        archive = subprocess.run(["git", "-C", data["checkout"], "archive", "--format=tar", data["base_commit"]],
                                 capture_output=True, check=True).stdout
        with tempfile.TemporaryFile() as f:
            f.write(archive)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
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
    """Extra environment variables of the agent's shell: make the package and test deps importable."""
    if data["kind"] != "native":
        return {"PYTHONDONTWRITEBYTECODE": "1"}
    spec = REPOS[data["repo"]]
    return {"PYTHONPATH": f"{(workdir / spec.pythonpath).resolve()}{os.pathsep}{deps_dir()}",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


# ----------------------------------------------------------------------------- grading

@dataclass
class Grade:
    resolved: bool
    f2p_frac: float                                      # fraction of FAIL_TO_PASS tests passing
    failed: list = field(default_factory=list)           # FAIL_TO_PASS/PASS_TO_PASS ids not passing
    error: str = ""                                      # why grading could not run, if it could not


def _junit_key(test_id: str) -> str:
    # pytest's junit classname is the node id's path (dots, no .py) plus its classes
    file, *names = test_id.split("::")
    return ".".join([file.removesuffix(".py").replace("/", "."), *names[:-1]]) + "::" + names[-1]


def run_tests(cwd: Path, test_ids: list[str], command: str, env: dict, timeout: float) -> dict:
    """Run pytest on test_ids in cwd -> {test id: passed?}, plus {'__error__': text} on failure.
    A test passes iff every junit entry under its id passed (failed subtests count)."""
    from sandbox import Sandbox
    xml = cwd / ".rime-junit.xml"
    cmd = f"{command} -q --tb=no --junitxml={shlex.quote(str(xml))} " + " ".join(shlex.quote(t) for t in test_ids)
    # the cache (test dependencies) may sit under /tmp, which a sandbox's private /tmp would hide
    with Sandbox(timeout=timeout, workdir=cwd, env=env, ro_paths=[cache_dir()]) as sb:
        res = sb.run(cmd)
    status = {t: False for t in test_ids}
    if res.timed_out or not xml.exists():
        status["__error__"] = "timeout" if res.timed_out else res.output[-2000:]
        return status
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        bad = any(child.tag in ("failure", "error", "skipped") for child in case)
        results[key] = results.get(key, True) and not bad
    for t in test_ids:
        status[t] = results.get(_junit_key(t), False)
    return status


def grade(data: dict, workdir: Path, timeout: float = GRADE_TIMEOUT) -> Grade:
    """SWE-bench resolution of the agent's workspace, judged in a separate directory."""
    f2p, p2p = data["FAIL_TO_PASS"], data["PASS_TO_PASS"]
    with tempfile.TemporaryDirectory(prefix="codebase-grade-") as tmp:
        gdir = Path(tmp)
        if data["kind"] == "native":
            spec = REPOS[data["repo"]]
            pkg = workdir / spec.package
            if not (pkg / "__init__.py").exists():
                return Grade(False, 0.0, f2p + p2p, f"the package {spec.package}/ is gone from the workspace")
            _copy_tree(source_dir(spec.name), gdir, [c for c in spec.copy if c != spec.package])
            shutil.copytree(pkg, gdir / spec.package, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
            (gdir / "pytest.ini").write_text(PYTEST_INI)
            env = agent_env(data, gdir)
            command = f"{shlex.quote(sys.executable)} -m pytest"
        else:
            shutil.copytree(workdir, gdir, dirs_exist_ok=True, symlinks=True,
                            ignore=shutil.ignore_patterns(".git", MEMORY_DIR))
            applied = subprocess.run(["git", "apply", "-"], cwd=gdir, input=data["test_patch"].encode(),
                                     capture_output=True)
            if applied.returncode != 0:
                return Grade(False, 0.0, f2p + p2p, "test_patch did not apply: " + applied.stderr.decode()[-500:])
            env, command = {"PYTHONDONTWRITEBYTECODE": "1"}, data["test_command"]
            timeout = float(data.get("test_timeout") or timeout)
        # FAIL_TO_PASS first: most submissions fail one, and then PASS_TO_PASS cannot change the verdict
        status = run_tests(gdir, f2p, command, env, timeout)
        if all(status[t] for t in f2p) and p2p:
            status.update(run_tests(gdir, p2p, command, env, timeout))
    failed = [t for t in f2p + p2p if not status.get(t, False)]
    f2p_frac = sum(status[t] for t in f2p) / max(1, len(f2p))
    return Grade(not failed, f2p_frac, failed, status.get("__error__", ""))


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
    """RIME's Codebase Adaptation: score = 1 - (solved_step - 1) / 40 when resolved, else 0."""

    name = "codebase"

    def __init__(self, command_timeout: float = COMMAND_TIMEOUT, grade_timeout: float = GRADE_TIMEOUT,
                 obs_chars: int = OBS_CHARS, max_steps: int = MAX_STEPS, require_cache: bool = True):
        if require_cache:
            require_cache_fn()
        self._kwargs = dict(command_timeout=command_timeout, grade_timeout=grade_timeout,
                            obs_chars=obs_chars, max_steps=max_steps, require_cache=require_cache)
        self.command_timeout, self.grade_timeout, self.obs_chars = command_timeout, grade_timeout, obs_chars
        self.max_steps = max_steps
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-")).resolve()
        (self.workdir / MEMORY_DIR).mkdir()
        self.task, self.info, self.num_steps, self.done = None, {}, 0, True
        self._sandbox = None

    def score(self, resolved: bool, step: int) -> float:
        return 1.0 - (step - 1) / self.max_steps if resolved else 0.0

    def tasks(self, split: str) -> list[Task]:
        assert split in ("train", "test"), f"split must be 'train' or 'test', not {split!r}"
        return [t for t in load_tasks(self.name) if t.split == split]

    def reset(self, task: Task) -> str:
        kind = task.data.get("kind") if isinstance(task, Task) else None
        if kind not in ("native", "swebench"):
            raise ValueError(f"{self.name}: not a codebase task: {getattr(task, 'id', task)!r}")
        self._close_sandbox()
        for child in self.workdir.iterdir():   # everything but the memory folder goes
            if child.name != MEMORY_DIR:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        (self.workdir / MEMORY_DIR).mkdir(exist_ok=True)
        prepare_workspace(task.data, self.workdir)
        from sandbox import Sandbox
        self._sandbox = Sandbox(timeout=self.command_timeout, workdir=self.workdir,
                                env=agent_env(task.data, self.workdir), ro_paths=[cache_dir()])
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
                + (f"{run}\n" if run else "")
                + f"Your notes folder {MEMORY_DIR}/ is kept between tasks.\n"
                f"You have {self.max_steps} turns; each command or submit uses one.")

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
        write_memory(self.workdir, files)

    def clone(self):
        return type(self)(**self._kwargs)

    def _close_sandbox(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def close(self) -> None:
        self._close_sandbox()
        shutil.rmtree(self.workdir, ignore_errors=True)


class CodingEnv(CodebaseEnv):
    """CAMG's Coding environment: the same tasks, 40 steps, explicit submit, score = resolution."""

    name = "coding"

    def score(self, resolved: bool, step: int) -> float:
        return float(resolved)


require_cache_fn = require_cache  # CodebaseEnv's keyword argument shadows the function's name


if __name__ == "__main__":
    if sys.argv[1:] == ["fetch"]:
        try:
            print(f"codebase cache ready at {fetch()}")
        except RuntimeError as exc:   # no registry: say so, without a traceback
            sys.exit(str(exc))
    else:
        sys.exit("usage: python codebase.py fetch   (downloads tablib/tenacity sdists and test deps)")
