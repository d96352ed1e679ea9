"""Codebase Adaptation / Coding, against the real test suites: every task's workspace, hidden tests
and reversal; a no-op submit graded for each kind of bug; full episodes, relay tasks, SWE-bench rows.

Needs the cache (`python codebase.py fetch`, run by setup.sh). The per-task checks run two at a
time (threads driving subprocesses), which is what keeps the file within its time budget.
"""

import ast
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import codebase as cb
import curriculum
import envs
from envs import Task, make

ALL_TASKS = cb.load_tasks("codebase")


def _pool_map(fn, items):
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(fn, items))


# ----------------------------------------------------------------------------- data and streams

def test_task_data_and_streams():
    by_repo = {repo: [t for t in ALL_TASKS if t.group == repo] for repo in cb.REPOS}
    for repo, tasks in by_repo.items():
        assert len(tasks) >= 24, f"{repo}: only {len(tasks)} tasks (the issue asks for at least 24)"
        assert {t.difficulty for t in tasks} == {0, 1, 2}, f"{repo}: difficulties 0, 1 and 2 all needed"
        assert any(t.data["origin"] == "real" for t in tasks), f"{repo}: no real (released) bug"
        for t in tasks:
            assert t.data["FAIL_TO_PASS"], f"{t.id} has no FAIL_TO_PASS test"
            assert not set(t.data["FAIL_TO_PASS"]) & set(t.data["PASS_TO_PASS"]), t.id
            assert t.data["issue"] and t.data["patch"].startswith("--- a/"), t.id
    stream = cb.test_stream()
    assert [t.group for t in stream] == ["tablib"] * 9 + ["tenacity"] * 10
    longs = cb.long_streams()
    assert {r: len(s) for r, s in longs.items()} == {"tablib": 26, "tenacity": 27}
    held_out = {t.id for s in longs.values() for t in s}
    assert {t.id for t in stream} <= held_out, "the 19-stream must lie inside the held-out long streams"
    assert all(t.split == "test" for s in longs.values() for t in s), "a long stream holds a train task"
    for repo in cb.REPOS:   # the paper's training curriculum (6 easy then 6 hard) fits each repository
        train = [t for t in by_repo[repo] if t.split == "train"]
        stream = curriculum.make_stream(train, order="easy_to_hard", segment=6, seed=0)
        assert len(stream) == 12 and {t.group for t in stream} == {repo}
    train_all = [t for t in ALL_TASKS if t.split == "train"]
    for tier in curriculum.TIERS:   # RIME's tiers, with the two blocks from different repositories
        stream = curriculum.make_stream(train_all, segment=6, seed=0, tier=tier, same_group=False)
        assert len(stream) == 12, tier
    env = make("codebase")
    try:
        train, test = env.tasks("train"), env.tasks("test")
        assert {t.id for t in test} == held_out and not {t.id for t in train} & held_out
        assert len(train) + len(test) == len(ALL_TASKS) and all(t.env == "codebase" for t in train)
    finally:
        env.close()


def test_missing_cache_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RIME_CACHE", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="python codebase.py fetch"):
        make("codebase")


# ----------------------------------------------------------------------------- every task

@pytest.mark.parametrize("repo", list(cb.REPOS))
def test_pristine_source_passes_every_task_test(repo):
    """One run of the union of all tasks' FAIL_TO_PASS + PASS_TO_PASS on the untouched source."""
    tasks = [t for t in ALL_TASKS if t.group == repo]
    ids = sorted({i for t in tasks for i in t.data["FAIL_TO_PASS"] + t.data["PASS_TO_PASS"]})
    data = {"kind": "native", "repo": repo, "FAIL_TO_PASS": ids, "PASS_TO_PASS": []}
    g = cb.grade(data, cb.source_dir(repo))
    assert g.resolved and g.f2p_frac == 1.0, f"pristine {repo} fails {g.failed[:5]} {g.error}"


def _defined_tests(path: Path) -> set:
    tree = cb.parse_python(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names |= {(node.name, f.name) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add((node.name,))
    return names


def _tree(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _first_of_each_kind(tasks: list) -> set:
    """The ids of the first task, in file order, of each (repository, difficulty, origin): 11 of the 90."""
    first = {}
    for t in tasks:
        first.setdefault((t.group, t.difficulty, t.data["origin"]), t.id)
    return set(first.values())


NOOP_GRADED = _first_of_each_kind(ALL_TASKS)


def _check_tasks(tasks: list) -> list:
    """For each task: the reset works and the hidden tests are out of the workspace; reversing the
    injection there gives back the pristine package, byte for byte. On NOOP_GRADED (every repository,
    difficulty and origin) a no-op submit also scores 0 with every FAIL_TO_PASS failing. -> the
    problems found. One env (and so one workspace) serves all the tasks, one after another.

    Why not a no-op submit on all 90: each is a grading run (a pytest process, about a second, mostly
    imports), which made this the slowest test of the suite. That a task's FAIL_TO_PASS fail with its
    bug is what data/codebase/build.py measured for every task when it chose them; the sample checks
    that the env's grade agrees, per kind of bug, and what can drift per task (the edits, the patch,
    the hidden tests, the workspace) is checked on every task here. (A FAIL_TO_PASS list edited by
    hand is not re-measured outside the sample: rerun build.py after such an edit.) Grading copies
    only the package from the workspace, next to the cache's pristine tests, so a byte-identical
    package is graded exactly as test_pristine_source_passes_every_task_test grades the pristine one
    (every FAIL_TO_PASS and PASS_TO_PASS passes there): the reversal resolves. That is checked with a
    real grading run on the first task of each repository (the full env episode is
    test_reference_policy_full_episode_and_coding_score)."""
    env, problems, graded = cb.CodebaseEnv(), [], set()
    try:
        for task in tasks:
            env.reset(task)
            defined = {}   # test file -> the tests it defines, each file parsed once
            for tid in task.data["FAIL_TO_PASS"]:
                file, *names = tid.split("::")
                key = tuple(n.split("[")[0] for n in names)
                if file not in defined:
                    defined[file] = _defined_tests(env.workdir / file)
                if key in defined[file]:
                    problems.append(f"{task.id}: hidden test {tid} is in the workspace")
            if task.id in NOOP_GRADED:
                obs, reward, done = env.step("submit")
                if not (done and reward == 0.0 and env.info["f2p_frac"] == 0.0 and not env.info["resolved"]):
                    problems.append(f"{task.id}: no-op submit gave reward {reward}, info {env.info}")
            # reverse the injection in the workspace (after the submit, the ended episode's)
            fix = env.reference_policy(task)("")
            res = subprocess.run(["bash", "-c", fix], cwd=env.workdir, capture_output=True, text=True)
            package = cb.REPOS[task.group].package
            if res.returncode != 0:
                problems.append(f"{task.id}: the reversed patch did not apply: {res.stdout[-300:]} {res.stderr[-300:]}")
            elif _tree(env.workdir / package) != _tree(cb.source_dir(task.group) / package):
                problems.append(f"{task.id}: reversing the patch does not give back the pristine {package}/")
            elif task.group not in graded:
                graded.add(task.group)
                g = cb.grade({**task.data, "PASS_TO_PASS": []}, env.workdir)
                if not (g.resolved and g.f2p_frac == 1.0):
                    problems.append(f"{task.id}: reversing the injection did not resolve: {g}")
    finally:
        env.close()
    return problems


def test_every_task_resets_and_reverses_and_each_kind_noop_fails():
    halves = [ALL_TASKS[0::2], ALL_TASKS[1::2]]   # both repositories in each half
    problems = [p for found in _pool_map(_check_tasks, halves) for p in found]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- episode mechanics

@pytest.fixture
def env():
    e = make("codebase")
    yield e
    e.close()


def test_reference_policy_full_episode_and_coding_score():
    task = cb.test_stream()[0]
    for name, expected in (("codebase", 1 - 2 / 40), ("coding", 1.0)):
        env = make(name, command_timeout=60.0)
        try:
            tasks = {t.data["id"]: t for t in env.tasks("test")}
            t = tasks[task.data["id"]]
            obs = env.reset(t)
            assert "You have 40 turns" in obs and "submit" in obs and t.data["issue"][:30] in obs
            policy, total, done, steps = env.reference_policy(t), 0.0, False, 0
            while not done:
                obs, reward, done = env.step(policy(obs))
                total, steps = total + reward, steps + 1
            assert steps == 3 and total == pytest.approx(expected) and env.info["success"] == 1.0
        finally:
            env.close()


def test_malformed_actions_never_raise_and_budget_ends(env):
    env.max_steps = 6
    task = ALL_TASKS[0]
    env.reset(task)
    for action in ["", "   ", None, 12345, "```bash\n```", "echo a\x00b", "exit 3"]:
        obs, reward, done = env.step(action)
        assert isinstance(obs, str) and reward == 0.0
        if done:
            break
    assert done and "Out of turns" in obs and env.info["resolved"] is False
    assert env.step("submit") == ("This task has ended; reset() starts the next one.", 0.0, True)


def test_shell_output_is_capped_and_commands_time_out(env):
    env.workspace.obs_chars = 500
    env.workspace.timeout = 1.0
    env.reset(ALL_TASKS[0])
    obs, _, _ = env.step("python -c \"print('x' * 100000)\"")
    assert len(obs) < 800 and "characters cut" in obs
    obs, _, done = env.step("sleep 5")
    assert "timed out" in obs and not done and env.num_steps == 2


def test_codebase_starts_every_task_empty(env):
    """RIME's memory is the writer's text only: nothing on disk carries over to the next task."""
    tasks = cb.test_stream()
    obs = env.reset(tasks[0])
    assert "kept between tasks" not in obs and cb.MEMORY_DIR not in obs
    env.step("echo 'tablib: headers may be None' > .agent_memory/notes.md && echo junk > scratch.txt")
    assert env.memory_files() == {"notes.md": "tablib: headers may be None\n"}   # within the task: there
    env.set_memory_files({"seed.md": "x"})
    env.reset(tasks[1])
    assert env.memory_files() == {} and not (env.workdir / "scratch.txt").exists()
    clone = env.clone()
    try:
        assert clone.memory_files() == {}
    finally:
        clone.close()


def test_the_workspace_is_a_git_repo_at_the_bug(env):
    """`git diff` shows the agent its own changes: one commit, nothing changed at the start, an
    edit shows in the diff, and the repository is sound (its blobs are packed at the reset)."""
    env.reset(ALL_TASKS[0])
    obs, _, _ = env.step("git status --porcelain && git log --format=%s && git fsck --no-progress && echo sound")
    assert obs.splitlines()[:2] == ["task start", "sound"], obs
    obs, _, _ = env.step("echo '# edited' >> README.md && git diff --stat")
    assert "README.md | 1 +" in obs, obs


def test_coding_memory_carries_over_only_when_asked():
    tasks = cb.test_stream("coding")
    note = "echo 'tablib: headers may be None' > .agent_memory/notes.md"
    blank = make("coding")
    keep = make("coding", keep_memory=True)
    clone = keep.clone()
    try:
        assert "kept between tasks" not in blank.reset(tasks[0])
        blank.step(note)
        blank.reset(tasks[1])
        assert blank.memory_files() == {}, "Coding's memory must not cross tasks by default"
        blank.set_memory_files({"CONTINUATION.md": "go on"})   # what the next task starts with, explicitly
        blank.reset(tasks[2])
        assert blank.memory_files() == {"CONTINUATION.md": "go on"}

        assert "kept between tasks" in keep.reset(tasks[0])
        keep.step(note)
        keep.reset(tasks[1])
        assert keep.memory_files() == {"notes.md": "tablib: headers may be None\n"}
        obs, _, _ = keep.step("git status --short")
        assert "notes.md" not in obs, "memory must stay out of the task's git status"
        keep.set_memory_files({})                              # a new stream starts blank
        keep.reset(tasks[2])
        assert keep.memory_files() == {}
        assert clone.keep_memory and clone.workdir != keep.workdir and clone.memory_files() == {}
    finally:
        for e in (blank, keep, clone):
            e.close()


def test_coding_carries_the_memory_folder_whole():
    """keep_memory carries `.agent_memory/` itself (workspace.Workspace's rule, as in the other shell
    envs): a note longer than what the host reads of one file (MEMORY_FILE_BYTES) is not cut short."""
    tasks = cb.test_stream("coding")
    env = make("coding", keep_memory=True)
    try:
        env.reset(tasks[0])
        size = envs.MEMORY_FILE_BYTES + 1000
        env.step(f"python -c \"print('x' * {size - 1})\" > .agent_memory/log.md")
        env.reset(tasks[1])
        assert (env.workdir / cb.MEMORY_DIR / "log.md").stat().st_size == size
    finally:
        env.close()


def test_listing_tasks_leaves_no_temporary_workspace(tmp_path, monkeypatch):
    import gc
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # this test's temp dirs only, whatever runs beside it
    assert make("codebase").tasks("test") and make("coding").tasks("train")
    gc.collect()
    assert list(tmp_path.iterdir()) == [], "listing tasks must not leave a workspace behind"
    env = make("codebase")
    env.reset(ALL_TASKS[0])
    workdir = env.workdir
    assert workdir.parent == tmp_path
    del env
    gc.collect()
    assert not workdir.exists(), "a garbage-collected env must remove its workspace"
    env = make("coding")
    env.reset(ALL_TASKS[0])
    env.close()
    # what stays is the test deps' copy that sandboxes mount (codebase.deps_mount), made once per cache
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("rime-deps-")] == []


def test_deleted_package_is_unresolved(env):
    task = ALL_TASKS[-1]
    env.reset(task)
    env.step(f"rm -rf {cb.REPOS[task.group].package}")
    obs, reward, done = env.step("submit")
    assert done and reward == 0.0 and not env.info["resolved"]


# ----------------------------------------------------------------------------- SWE-bench JSONL

def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(repo)})


def test_swebench_jsonl_loader(tmp_path):
    repo = tmp_path / "tinylib"
    (repo / "tests").mkdir(parents=True)
    (repo / "tinylib.py").write_text("def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n")
    (repo / "tests" / "test_neg.py").write_text("from tinylib import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    patch = ("--- a/tinylib.py\n+++ b/tinylib.py\n@@ -1,3 +1,3 @@\n def add(a, b):\n-    return a - b\n"
             "+    return a + b\n \n")
    test_patch = ("--- /dev/null\n+++ b/tests/test_add.py\n@@ -0,0 +1,5 @@\n+from tinylib import add\n+\n+\n"
                  "+def test_add():\n+    assert add(2, 3) == 5\n")
    row = {"instance_id": "tiny__tinylib-1", "repo": "tiny/tinylib", "base_commit": base,
           "problem_statement": "add(2, 3) returns -1", "patch": patch, "test_patch": test_patch,
           "FAIL_TO_PASS": json.dumps(["tests/test_add.py::test_add"]),
           "PASS_TO_PASS": ["tests/test_neg.py::test_neg"],
           "test_command": "python -m pytest -p no:cacheprovider", "test_timeout": 60}
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n\n")
    (task,) = cb.load_swebench_jsonl(path, tmp_path)
    assert task.id == "coding/tiny__tinylib-1" and task.group == "tiny/tinylib"
    assert task.data["FAIL_TO_PASS"] == ["tests/test_add.py::test_add"]

    env = make("coding", require_cache=False)
    try:
        obs = env.reset(task)
        assert "add(2, 3) returns -1" in obs and not (env.workdir / "tests" / "test_add.py").exists()
        obs, reward, done = env.step("submit")
        assert done and reward == 0.0 and env.info["success"] == 0.0
        env.reset(task)
        policy, done, total = env.reference_policy(task), False, 0.0
        while not done:
            obs, reward, done = env.step(policy(obs))
            total += reward
        assert total == 1.0 and env.info["resolved"], obs
        # the workspace's tests and pytest config are never used: a conftest.py that turns every
        # outcome into a pass, and a weakened PASS_TO_PASS test, beside a fix that breaks neg()
        env.reset(task)
        env.step(env.reference_policy(task)(""))
        env.step("printf 'import pytest\\n\\n\\n@pytest.hookimpl(hookwrapper=True)\\n"
                 "def pytest_runtest_makereport(item, call):\\n    (yield).get_result().outcome = \"passed\"\\n'"
                 " > conftest.py && sed -i 's/return -a/return a/' tinylib.py && sed -i 's/-2/2/' tests/test_neg.py")
        assert (env.workdir / "conftest.py").read_text().count("passed") == 1
        obs, reward, done = env.step("submit")
        assert reward == 0.0 and not env.info["resolved"] and env.info["f2p_frac"] == 1.0, obs
        # a test_patch that cannot apply is unresolved, not an exception
        broken = Task(task.id, "coding", 1, task.group, "test", {**task.data, "test_patch": "garbage\n"})
        env.reset(broken)
        env.step(env.reference_policy(broken)(""))
        assert env.step("submit")[1] == 0.0
    finally:
        env.close()
    # bad input: a one-line ValueError each
    bad = tmp_path / "bad.jsonl"
    for content, match in ((json.dumps({"instance_id": "x"}), "row lacks repo, base_commit"),
                           ("{not json", "not a JSON object"),
                           (json.dumps({**row, "repo": "tiny/elsewhere"}), "not available offline"),
                           (json.dumps({**row, "base_commit": "0" * 40}), "lacks base_commit"),
                           (json.dumps({**row, "FAIL_TO_PASS": "[oops"}), "FAIL_TO_PASS must be a list")):
        bad.write_text(content + "\n")
        with pytest.raises(ValueError, match=match):
            cb.load_swebench_jsonl(bad, tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        cb.load_swebench_jsonl(tmp_path / "missing.jsonl", tmp_path)


# ----------------------------------------------------------------------------- through rollout.py

def test_coding_reference_policy_through_rollout():
    """The scripted Coding agent through rollout.run_scripted: every task's fix action survives the
    <action> tag and tokenisation unchanged, and two episodes resolve."""
    from model import tiny
    from rollout import ChatFormat, parse_action, run_scripted
    _, tok = tiny(arch="llama", seed=0)
    fmt = ChatFormat(tok)
    env = make("coding")
    try:
        for task in env.tasks("train") + env.tasks("test"):
            action = env.reference_policy(task)("")
            ids = fmt.encode(f"<action>{action}</action>") + [fmt.end_id]
            assert parse_action(tok.decode(ids, skip_special_tokens=True)) == action.strip(), task.id
        stream = cb.test_stream("coding")
        tasks = [stream[0], stream[-1]]
        eps = run_scripted(tok, env, tasks, [env.reference_policy(t) for t in tasks])
        for ep in eps:
            assert ep.finish == "done" and ep.num_turns == 3 and ep.score == 1.0, (ep.task.id, ep.error, ep.observations[-1:])
            assert ep.info["resolved"] and ep.actions[-1] == "submit"
    finally:
        env.close()


# ----------------------------------------------------------------------------- the relay family (CAMG's laptop preset)

def test_coding_relay_family_shows_the_ci_report_once():
    """Relay tasks: no issue text, the `ci` action shows the failing tests and the bug's location (the
    bugged workspace holds the edit at that line, inside that function) once per episode; `ci` is a
    plain shell command in a standard task; a coding env with neither family is refused."""
    relay = make("coding", relay=True, standard=False)
    both = make("coding", relay=True)
    try:
        tasks = relay.tasks("test")
        assert tasks and relay.tasks("train") and {t.difficulty for t in tasks} == {3}
        assert all(t.id.endswith("/relay") for t in tasks) and len(both.tasks("test")) == len(tasks) + len(make("coding").tasks("test"))
        assert {t.data["id"] for t in cb.relay_tasks()} < {t.data["id"] for t in ALL_TASKS}
        task = next(t for t in tasks if t.group == "tenacity")
        obs = relay.reset(task)
        assert task.data["issue"].strip()[:40] not in obs and "<action>ci</action>" in obs
        report, _, done = relay.step("ci")
        file, function, line = task.data["location"]
        assert not done and f"FAILED {task.data['FAIL_TO_PASS'][0]}" in report
        assert f"{file}, function {function} (line {line})" in report
        source = (relay.workdir / file).read_text().splitlines()
        assert task.data["edits"][0]["new"].strip().splitlines()[0] in "\n".join(source[line - 1:])
        assert f"def {function.rsplit('.', 1)[-1]}" in "\n".join(source[:line])
        again, _, _ = relay.step("ci")
        assert "shown once already" in again and "FAILED" not in again
        standard = next(t for t in both.tasks("test") if not t.data.get("relay"))
        both.reset(standard)
        assert "FAILED" not in both.step("ci")[0]
        with pytest.raises(ValueError, match="leave no tasks"):
            make("coding", relay=False, standard=False)
    finally:
        relay.close()
        both.close()


def test_every_relay_task_has_its_own_fix_at_its_reported_location():
    """What relay_policy and the CI report rely on, for every relay task (no grading: the fix itself
    is the native task's reversed patch, checked on every task by
    test_every_task_resets_and_reverses_and_each_kind_noop_fails): its key (file, function, line, first
    failing test) names one fix in its repository, and the bugged source holds its first edit at the
    reported line, inside the reported function."""
    tasks = cb.relay_tasks()
    keys = [(t.group, *t.data["location"], t.data["FAIL_TO_PASS"][0]) for t in tasks]
    assert len(set(keys)) == len(keys), "two relay tasks of a repository share a location and first test"
    for t in tasks:
        file, function, line = t.data["location"]
        assert f"{file}, function {function} (line {line})" in cb.ci_report(t.data), t.id
        source = (cb.source_dir(t.group) / file).read_text()
        for e in t.data["edits"]:
            source = source.replace(e["old"], e["new"]) if e["file"] == file else source
        lines = source.splitlines()
        assert t.data["edits"][0]["new"].strip().splitlines()[0] in "\n".join(lines[line - 1:]), t.id
        assert f"def {function.rsplit('.', 1)[-1]}" in "\n".join(lines[:line]), t.id


def test_coding_relay_fact_is_the_reported_location():
    """CodingEnv.relay_fact (camg_eval's relay stages), on every relay task without grading: the source is
    the CI report, and the fact (the bug's function or file) is what the reference carries and then acts on."""
    from camg_memory import has_fact
    env = make("coding", relay=True)
    try:
        for t in [t for t in env.tasks("test") if t.data.get("relay")]:
            fact, (file, function, line) = env.relay_fact(t), t.data["location"]
            assert fact["source"] == cb.ci_report(t.data), t.id
            policy = env.reference_policy(t)
            policy(fact["source"])                              # the report: the location and the first step
            assert has_fact(fact["values"], "\n".join(policy.notes())), t.id
            assert has_fact(fact["values"], f"nl -ba {file} | sed -n '1,40p'") and not has_fact(fact["values"], "submit")
        assert env.relay_fact(next(t for t in env.tasks("test") if not t.data.get("relay"))) is None
    finally:
        env.close()


def test_relay_tasks_need_the_fact_carried_across_a_context_reset():
    """At camg.py's preset (context budget, turns, reply length, its "small" BPE) the reference policy,
    knowing only its current context, resolves the first held-out relay task of each repository, each
    through a reset; the same policy without CONTINUATION.md (it starts over after a reset: the report
    is not shown again) fails every task it resets in. (Two tasks: each episode is graded in a sandbox;
    what differs from task to task, the fix each key names, is checked on every relay task by
    test_every_relay_task_has_its_own_fix_at_its_reported_location.)"""
    import camg
    import camg_worker
    cfg, tok = camg.Config(), camg_worker.small_tokenizer()
    proto = camg_worker.make_env("coding", "relay")
    tasks = [next(t for t in proto.tasks("test") if t.group == repo) for repo in cb.REPOS]
    carried, outcomes = camg_worker.reference_episodes(proto, tasks, tok, cfg)
    assert all(ep.info.get("success") for ep in carried), [(ep.task.id, ep.error) for ep in carried if not ep.info.get("success")]
    assert all(ep.num_resets > 0 for ep in carried)
    assert all(o["before"] == "written" and o["read"] for out in outcomes for o in out)
    lost, _ = camg_worker.reference_episodes(camg_worker.make_env("coding", "relay"), tasks, tok, cfg, carry=False)
    reset = [ep for ep in lost if ep.num_resets]
    assert reset and not any(ep.info.get("success") for ep in reset)
