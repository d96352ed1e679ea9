"""Codebase Adaptation (RIME) and Coding (CAMG): fix real bugs in real repositories with a shell.

This file holds the environments: the workspace an episode runs in, the grader, CodebaseEnv,
CodingEnv and their reference policies. The tasks themselves (the pinned repositories, the cache,
the task files, streams, relay copies, SWE-bench rows) are in codebase_tasks.py; every name there
is importable from here too (`codebase.load_tasks`, `codebase.REPOS`, ...).

    python codebase.py fetch         # once, at set-up: sdists + test deps into the local cache
    env = make("codebase")           # or make("coding")
    obs = env.reset(env.tasks("test")[0])
    obs, reward, done = env.step("grep -n 'def stack' src/tablib/core.py")   # any shell command
    obs, reward, done = env.step("submit")                                    # grade and end

Episode: the workspace (env.workdir) holds the repository at the bugged state as a git repo, with
the FAIL_TO_PASS test functions cut out of its test files. Every action is a shell command run
there in a sandbox (output capped), or `submit`. The sandbox's filesystem shows the system, the
interpreter, the test dependencies (at /opt/rime-deps, on PYTHONPATH) and the workspace; nothing of
this project: not its source, not data/codebase/*.json (patches, test lists), not the cache with
the pristine sources. Memory: `codebase` (RIME) starts every task with an empty workspace, since
RIME's memory is the writer's text; `coding` (CAMG) keeps `.agent_memory/` through the episode,
and from task to task only with keep_memory=True (`envs.make("coding", keep_memory=True)`).
Grading builds its own tree on the host: the agent's package copied next to the pristine, complete
test files from the cache (for SWE-bench rows: the agent's checkout with the pristine test files
put back, then test_patch), and runs FAIL_TO_PASS + PASS_TO_PASS there in a fresh sandbox, with
planted control tests and cross-checks so that a report the tested code forges does not count
(grader.py says what that guarantees and what it does not). Resolution is SWE-bench's: every FAIL_TO_PASS test
passes and every PASS_TO_PASS test still passes; a missing package, an error, a timeout or an
untrusted run is unresolved. (PASS_TO_PASS runs only once every FAIL_TO_PASS test passes: it
cannot change the verdict otherwise, and it is the slow part.)
Rewards (paid by the `submit` step; 40 steps at most, running out pays 0; rollout.py shows the
turns left):
- codebase: `1 - (solved_step - 1) / 40` if resolved else 0 (the RIME benchmark's reward);
- coding: 1 if resolved else 0 (CAMG's success).
env.info: resolved, success, f2p_frac (fraction of FAIL_TO_PASS passing), solved_step.

Relay family (Coding only: `make("coding", relay=True)`, `standard=False` leaves the standard tasks
out; camg.py's laptop preset): codebase_tasks.relay_tasks, a copy of every bug that lies in one
function, without the issue text. The first observation says only that CI failed; the action `ci`
shows the CI report once per episode: the failing (hidden) test ids and the bisected location,
file, function and line. Under a small
context budget the report is gone after a CONTINUATION.md reset, so the bug is found only if the
location is written down before the reset and read back after it. `relay_policy` is its reference.
Grading and reward are the standard ones. `CodingEnv.relay_fact` (camg_eval's relay stages): the fact is
the bug's location, its function (qualified, or its last name) or its file.

Simplified on purpose: the hidden tests come from the release's own test files, not from the
upstream PR's test patch; test dependencies are pip-installed into the cache, not per-task images;
the sandbox is a namespace, not a VM (sandbox.py says what it does and does not promise).
"""

import ast
import functools
import glob
import hashlib
import io
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
from dataclasses import dataclass, field, replace
from pathlib import Path

from codebase_tasks import (DATA_DIR, REPOS, ROOT, SWEBENCH_FIELDS, TEST_DEPS, RepoSpec,  # noqa: F401  (re-exported)
                            bug_location, cache_dir, ci_report, deps_dir, fetch, load_swebench_jsonl,
                            load_tasks, long_streams, relay_tasks, require_cache, source_dir, test_stream)
from grader import distrust, junit_key, parse_python, plant_controls, read_report
from sandbox import remove_tree
from workspace import (COPY_MAX_BYTES, MEMORY_DIR, Task, Workspace, WorkspaceEnv, copy_tree, env_error_observation,
                       read_workspace_file, whole_word)

MAX_STEPS = 40            # the RIME benchmark's turn budget
COMMAND_TIMEOUT = 30.0    # seconds per agent shell command
GRADE_TIMEOUT = 120.0     # seconds for one hidden-test run
OBS_CHARS = 2000          # command output shown to the agent (head and tail kept)
PATCH_EOF = "RIME_PATCH_EOF"  # heredoc delimiter of the reference policy's patch
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\n"   # replaces tablib's (it needs pytest-cov)
DEPS_MOUNT = "/opt/rime-deps"  # where a sandbox sees the test dependencies (a neutral path, not the cache's)
GRADE_COPY_BYTES = COPY_MAX_BYTES   # the grader copies at most this much of a workspace (apparent size)


# ----------------------------------------------------------------------------- workspaces

def apply_edits(root: Path, edits: list[dict]) -> None:
    """Apply a task's bug: each edit replaces the one occurrence of `old` in `file` by `new`."""
    for e in edits:
        path = root / e["file"]
        text = path.read_text()
        assert text.count(e["old"]) == 1, f"edit of {e['file']} must match exactly once: {e['old'][:60]!r}"
        path.write_text(text.replace(e["old"], e["new"]))



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
    # the blobs go straight into one pack (git's bulk check-in), not into some 50 directories of loose
    # objects: making and deleting those is most of a reset's time on some filesystems (ext4 with discard)
    subprocess.run([*git, "-c", "core.bigFileThreshold=1", "add", "-A"], check=True, env=env)
    subprocess.run([*git, "commit", "-q", "--no-gpg-sign", "-m", "task start"], check=True, env=env)


def agent_env(data: dict, workdir: Path) -> dict:
    """Extra environment variables of a shell in workdir (the agent's, or a grading run's): the
    package and the test deps importable, the deps by their neutral path inside the sandbox."""
    if data["kind"] != "native":
        return {"PYTHONDONTWRITEBYTECODE": "1"}
    spec = REPOS[data["repo"]]
    return {"PYTHONPATH": f"{(workdir / spec.pythonpath).resolve()}{os.pathsep}{DEPS_MOUNT}",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def deps_mount() -> dict:
    """{DEPS_MOUNT: host path} for a task's sandbox. The host path is a copy of the cache's deps in the
    temp dir, made once per cache (named by a hash), because /proc/self/mountinfo shows every mount's
    host path: the cache's own path would tell a shell where the pristine sources lie."""
    src = deps_dir().resolve()
    if not src.is_dir():   # no cache: the sandbox says so (require_cache() explains how to fetch it)
        return {DEPS_MOUNT: str(src)}
    stamp = (src / ".complete").read_text() if (src / ".complete").exists() else ""
    name = hashlib.sha256(f"{src}\n{stamp}".encode()).hexdigest()[:16]
    dest = Path(tempfile.gettempdir()) / f"rime-deps-{name}"
    if not (dest / ".complete").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f"rime-deps-{name}-"))
        shutil.copytree(src, tmp / "deps")
        try:
            os.rename(tmp / "deps", dest)   # atomic: another process may have made it meanwhile
        except OSError:
            pass
        remove_tree(tmp)
    return {DEPS_MOUNT: str(dest)}


@functools.lru_cache(maxsize=None)
def vendored_copies() -> tuple[str, ...]:
    """Paths a task's sandbox shows empty: every copy of a task repository's package that the Python
    installations it shows hold, vendored or not (pip's `_vendor` held tenacity 8.2; ensurepip's and
    Debian's wheels hold pip). Looked up where Python keeps packages (each interpreter's stdlib and
    site-packages, /usr and /usr/local's, the system's wheel directory) by name: milliseconds, where a
    walk of the whole system takes seconds. tests/test_grader_attacks.py walks the whole sandbox."""
    import site
    names = sorted({spec.package.rsplit("/", 1)[-1] for spec in REPOS.values()})
    prefixes = {sys.prefix, sys.base_prefix, "/usr", "/usr/local"}
    libs = {d for p in prefixes for d in glob.glob(f"{p}/lib*/python*") if os.path.isdir(d)}   # stdlib, Debian's python3
    sites = {*site.getsitepackages(), *(d for lib in libs for d in glob.glob(f"{lib}/*-packages"))}
    found = {f"{lib}/ensurepip/_bundled" for lib in libs} | {"/usr/share/python-wheels"}
    for d in sites:
        for pattern in (*names, "*/_vendor", *(f"*/*/{n}" for n in names), "*.whl", "*.egg", "*.pyz"):
            found.update(glob.glob(f"{glob.escape(d)}/{pattern}"))
    found = sorted(p for p in found if os.path.lexists(p))
    return tuple(p for p in found if not any(p.startswith(q + "/") for q in found))   # one mount hides what is inside


def open_sandbox(workdir: Path, env: dict, timeout: float):
    """A sandbox on workdir that sees the system, the interpreter, the test deps (at DEPS_MOUNT) and
    workdir: nothing of this project (its source, data/, the cache with the pristine sources), and no
    other copy of a task repository (vendored_copies)."""
    from sandbox import Sandbox
    return Sandbox(timeout=timeout, workdir=workdir, env=env, mounts=deps_mount(), hide=vendored_copies())


# ----------------------------------------------------------------------------- grading
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



def run_tests(data: dict, stage: Path, test_ids: list[str], command: str, timeout: float) -> TestRun:
    """Run pytest on test_ids in a fresh copy of stage (a complete tree the grader built) -> TestRun.
    The copy gets planted control tests; the run counts only if the cross-checks above hold."""
    rng = random.SystemRandom()
    none = TestRun({t: False for t in test_ids}, {t: 0.0 for t in test_ids})
    box = Path(tempfile.mkdtemp(prefix="codebase-grade-"))
    try:   # not TemporaryDirectory: the tested code may leave a tree too deep for shutil.rmtree in box
        tree = box / "repo"
        shutil.copytree(stage, tree, symlinks=True)   # stage: the grader's own, bounded copy
        files = sorted({t.split("::")[0] for t in test_ids})
        if not all(read_workspace_file(tree, f, 1) is not None for f in files):   # no link on the way
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
        cases = read_report(report)
        if cases is None:
            return replace(none, error="pytest wrote no report: " + res.output[-2000:])
    finally:
        remove_tree(box)
    reason = distrust(res.exit_code, res.output, cases, asked, controls)
    if reason:
        return replace(none, error=f"grading run untrusted: {reason}")
    return TestRun({t: cases[junit_key(t)][0] for t in test_ids}, {t: cases[junit_key(t)][1] for t in test_ids})


TEST_CONFIG = ("conftest.py", "pytest.ini", "tox.ini")   # put back pristine (or removed) before a SWE-bench run


def _stage_swebench(data: dict, workdir: Path, stage: Path) -> str:
    """The agent's checkout with the pristine test files, then test_patch -> "" or why it failed."""
    problem = copy_tree(workdir, ".", stage, skip=(".git", MEMORY_DIR))
    if problem:
        return problem
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
    tmp = Path(tempfile.mkdtemp(prefix="codebase-stage-"))
    try:
        stage = tmp / "repo"
        if data["kind"] == "native":
            spec = REPOS[data["repo"]]
            pristine_tree(spec.name, stage, package=False)
            # the agent's package, never through a link (on the way to it or inside it), capped in size
            problem = copy_tree(workdir, spec.package, stage / spec.package, skip=("__pycache__",))
            if problem or read_workspace_file(stage, f"{spec.package}/__init__.py", 1) is None:
                return Grade(False, 0.0, f2p + p2p, problem or f"the package {spec.package}/ is gone from the workspace")
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
    finally:
        remove_tree(tmp)
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


class CodebaseEnv(WorkspaceEnv):
    """RIME's Codebase Adaptation: score = 1 - (solved_step - 1) / 40 when resolved, else 0.

    Every task starts in an empty workspace: RIME's memory is the writer's text, given in the prompt,
    so nothing the agent leaves on disk (its `.agent_memory/` included) reaches the next task. The
    workspace (env.workdir, a temporary directory, workspace.Workspace) is made on first use and
    removed by close() or when the env is garbage-collected; each task gets a fresh sandbox on it."""

    name = "codebase"
    FILE_MEMORY = False   # True in Coding: `.agent_memory/` then follows the workspace's memory rule (keep_memory)

    def __init__(self, command_timeout: float = COMMAND_TIMEOUT, grade_timeout: float = GRADE_TIMEOUT,
                 obs_chars: int = OBS_CHARS, max_steps: int = MAX_STEPS, require_cache: bool = True):
        if require_cache:
            require_cache_fn()
        self.config = dict(command_timeout=command_timeout, grade_timeout=grade_timeout,
                           obs_chars=obs_chars, max_steps=max_steps, require_cache=require_cache)
        self.grade_timeout, self.max_steps = grade_timeout, max_steps
        # its mounts and hidden paths are set by reset(): listing tasks needs neither
        self.workspace = Workspace(command_timeout, obs_chars=obs_chars, keep_memory=False)
        self.task, self.info, self.num_steps, self.done = None, {}, 0, True

    def score(self, resolved: bool, step: int) -> float:
        return 1.0 - (step - 1) / self.max_steps if resolved else 0.0

    def tasks(self, split: str) -> list[Task]:
        assert split in ("train", "test"), f"split must be 'train' or 'test', not {split!r}"
        return [t for t in load_tasks(self.name) if t.split == split]

    def _memory_line(self) -> str:
        return ""

    def _problem(self, task: Task) -> str:
        """What the first observation says about the bug."""
        return f"Issue:\n{task.data['issue'].strip()}"

    def _own_action(self, text: str) -> str | None:
        """The observation of an action of the env's own (not a shell command), or None."""
        return None

    def reset(self, task: Task) -> str:
        kind = task.data.get("kind") if isinstance(task, Task) else None
        if kind not in ("native", "swebench"):
            raise ValueError(f"{self.name}: not a codebase task: {getattr(task, 'id', task)!r}")
        ws = self.workspace
        ws.stop()   # the last task's processes end before its files go
        ws.clear(memory=None if self.FILE_MEMORY else {})
        prepare_workspace(task.data, ws.workdir)
        ws.mounts, ws.hide = deps_mount(), vendored_copies()
        ws.start(agent_env(task.data, ws.workdir))
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
                f"{self._problem(task)}\n\n{ACTIONS.format(example=example)}\n"
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
            try:
                g = grade(self.task.data, self.workdir, self.grade_timeout)
            except Exception as exc:  # noqa: BLE001 - no action may make step() raise (envs.py's contract)
                self.done = True
                self.info["env_error"] = f"{type(exc).__name__}: {exc}"
                return env_error_observation(exc), 0.0, True
            reward = self.score(g.resolved, self.num_steps)
            self.info.update(resolved=g.resolved, success=float(g.resolved), f2p_frac=g.f2p_frac,
                             solved_step=self.num_steps if g.resolved else 0)
            self.done = True
            f2p = self.task.data["FAIL_TO_PASS"]
            broke = " but some previously passing tests now fail" if g.f2p_frac == 1 and not g.resolved else ""
            refused = f" Not graded: {g.error}." if g.error.startswith("refused") else ""
            obs = (f"Submitted. Hidden tests: {round(g.f2p_frac * len(f2p))} of {len(f2p)} failing tests now pass"
                   f"{broke}. Resolved: {'yes' if g.resolved else 'no'}. Score {reward:.3f}.{refused}")
            return obs, reward, True
        if not text or "\x00" in text:
            obs = ("Invalid action: give one shell command or `submit`.\n"
                   + ACTIONS.format(example=REPOS.get(self.task.data.get("repo"), REPOS["tablib"]).package))
        elif (own := self._own_action(text)) is not None:
            obs = own
        else:
            try:
                res = self.workspace.run(text)
                head = "[timed out]\n" if res.timed_out else ""
                obs = head + _clip(res.output, self.workspace.obs_chars).rstrip() + f"\n[exit code {res.exit_code}]"
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


class CodingEnv(CodebaseEnv):
    """CAMG's Coding environment: the same tasks, 40 steps, explicit submit, score = resolution.

    `.agent_memory/` lasts the whole episode (CAMG's context-reset protocol writes CONTINUATION.md
    there). Across tasks it follows the workspace's memory rule: blank unless keep_memory is set
    (`envs.make("coding", keep_memory=True)`), which carries the folder from one task to the next on
    this instance (a stream's file memory); set_memory_files() before a reset always decides what
    that task starts with (the ablations: blank, shuffled, continuation only).
    relay=True adds the relay family (the module docstring; its own action `ci`), standard=False
    leaves the standard tasks out."""

    name = "coding"
    FILE_MEMORY = True

    def __init__(self, relay: bool = False, standard: bool = True, **kwargs):
        if not (relay or standard):
            raise ValueError("coding: relay=False and standard=False leave no tasks")
        super().__init__(**kwargs)
        self.config.update(relay=relay, standard=standard)
        self.relay, self.standard, self.ci_shown = relay, standard, False

    def tasks(self, split: str) -> list[Task]:
        standard = super().tasks(split) if self.standard else []
        return standard + ([t for t in relay_tasks(self.name) if t.split == split] if self.relay else [])

    def reset(self, task: Task) -> str:
        self.ci_shown = False
        return super().reset(task)

    def _problem(self, task: Task) -> str:
        if not task.data.get("relay"):
            return super()._problem(task)
        return ("The CI run of this commit failed. Its report says which tests fail and where the bug is; "
                "it is shown once per episode:\n  <action>ci</action>   show the CI report")

    def _own_action(self, text: str) -> str | None:
        if not self.task.data.get("relay") or text.lower() != "ci":
            return None
        if self.ci_shown:
            return "The CI report was shown once already; it is not shown again."
        self.ci_shown = True
        return ci_report(self.task.data)

    def reference_policy(self, task: Task):
        if task.data.get("relay"):
            return relay_policy(task)
        return super().reference_policy(task)

    def relay_fact(self, task: Task) -> dict | None:
        """The fact a relay task carries (camg_memory's relay stages): the bug's location, as its function
        (qualified, e.g. Dataset.stack, or its last name) or its file, one value of alternatives; None
        for a standard task."""
        if not task.data.get("relay"):
            return None
        file, function, _ = task.data["location"]
        names = dict.fromkeys([function, function.rsplit(".", 1)[-1], file])
        return {"source": ci_report(task.data), "values": ["|".join(f"(?:{whole_word(n)})" for n in names)]}

    def score(self, resolved: bool, step: int) -> float:
        return float(resolved)

    def _memory_line(self) -> str:
        if self.keep_memory:
            return f"Your notes folder {MEMORY_DIR}/ is kept between tasks.\n"
        return f"Your notes folder {MEMORY_DIR}/ lasts until this task ends.\n"


def relay_policy(task: Task):
    """The reference for a relay task, knowing the fix of every relay task of its repository but not
    which one this is: `ci`, look at the reported function, apply the fix of that location (keyed by
    file, function, line and first failing test), run the visible tests, submit. It takes the location
    and its progress from any observation that shows them (the report, or a CONTINUATION.md holding
    the lines notes() gives), so a fresh copy after a context reset resumes from the carried file;
    without the location it cannot tell the fix and submits the workspace as it is."""
    fixes = {(*t.data["location"], t.data["FAIL_TO_PASS"][0]): t.data["patch"]
             for t in relay_tasks(task.env) if t.group == task.group}
    files = " ".join(sorted({i.split("::")[0] for i in task.data["FAIL_TO_PASS"]}))
    st = {"where": None, "asked": False, "done": 0}     # done: actions taken after the report

    def absorb(obs: str) -> None:
        failed = re.search(r"^FAILED (\S+)$", obs, re.M)
        m = re.search(r"the failure comes from (\S+), function (\S+) \(line (\d+)\)", obs)
        carried = re.search(r"^- CI: FAILED (\S+); bug in (\S+), function (\S+) \(line (\d+)\)$", obs, re.M)
        if st["where"] is None and m and failed:
            st["where"] = (m.group(1), m.group(2), int(m.group(3)), failed.group(1))
        elif st["where"] is None and carried:
            st["where"] = (carried.group(2), carried.group(3), int(carried.group(4)), carried.group(1))
        progress = re.search(r"^- progress: done=(\d+)$", obs, re.M)
        if progress:
            st["done"] = max(st["done"], int(progress.group(1)))

    def policy(obs: str) -> str:
        absorb(obs)
        if st["where"] is None:
            if not st["asked"]:
                st["asked"] = True
                return "ci"
            return "submit"                  # the report is gone and nothing says where the bug is
        file, function, line, _ = st["where"]
        patch = fixes.get(st["where"], "")
        steps = [f"nl -ba {file} | sed -n '{max(1, line - 10)},{line + 30}p'",
                 f"patch -p1 -R --no-backup-if-mismatch <<'{PATCH_EOF}'\n{patch}{PATCH_EOF}",
                 f"python -m pytest -q -x --tb=short {files}"]
        st["done"] += 1
        return steps[st["done"] - 1] if st["done"] <= len(steps) and patch else "submit"

    policy.absorb = absorb
    policy.notes = lambda: ([f"- CI: FAILED {st['where'][3]}; bug in {st['where'][0]}, function {st['where'][1]} "
                             f"(line {st['where'][2]})", f"- progress: done={st['done']}"] if st["where"] else [])
    return policy


require_cache_fn = require_cache  # CodebaseEnv's keyword argument shadows the function's name


if __name__ == "__main__":
    if sys.argv[1:] == ["fetch"]:
        try:
            print(f"codebase cache ready at {fetch()}")
        except RuntimeError as exc:   # no registry: say so, without a traceback
            sys.exit(str(exc))
    else:
        sys.exit("usage: python codebase.py fetch   (downloads tablib/tenacity sdists and test deps)")
