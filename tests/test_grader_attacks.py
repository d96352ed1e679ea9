"""Attacks an RL agent can make on the codebase/coding envs, each reproduced with a real shell command.

The answers (the cached pristine package, data/codebase/*.json) must be out of reach of the agent's
shell and of the grading run, and the grader must not believe a report the tested package forges.
"""

import pytest

import codebase as cb
from envs import make

TASKS = {t.group: t for t in reversed(cb.test_stream())}   # the first tablib and the first tenacity task

# Code prepended to the package's __init__.py: it runs when pytest collects the tests, reads the report
# path and the asked ids from sys.argv, writes an all-pass junit report and leaves with EXIT_CODE.
FORGE = '''import os as _os, sys as _sys
from xml.sax.saxutils import quoteattr as _q
_xml = [_a.split("=", 1)[1] for _a in _sys.argv if _a.startswith("--junitxml=")]
if _xml:
    _cases = []
    for _id in [_a for _a in _sys.argv if "::" in _a]:
        _file, *_names = _id.split("::")
        _cls = ".".join([_file[:-3].replace("/", "."), *_names[:-1]])
        _cases.append("<testcase classname=%s name=%s time=\\"0.001\\"/>" % (_q(_cls), _q(_names[-1])))
    with open(_xml[0], "w") as _f:
        _f.write("<?xml version=\\"1.0\\"?><testsuites><testsuite name=\\"pytest\\" tests=\\"%d\\" failures=\\"0\\" "
                 "errors=\\"0\\" skipped=\\"0\\">%s</testsuite></testsuites>" % (len(_cases), "".join(_cases)))
    print("%d passed in 0.01s" % len(_cases))
    _os._exit(EXIT_CODE)
'''


def _prepend(package: str, code: str) -> str:
    """A shell command that puts code at the top of the package's __init__.py."""
    return (f"cat > /tmp/head.py <<'EOF'\n{code}EOF\n"
            f"cat /tmp/head.py {package}/__init__.py > /tmp/init.py && cp /tmp/init.py {package}/__init__.py")


@pytest.mark.parametrize("repo, exit_code", [("tablib", 0), ("tenacity", 0), ("tablib", 1)])
def test_forged_junit_report_does_not_resolve(repo, exit_code):
    """The exact attack (exit 0) used to score 0.975 / 1.0 with nothing fixed; exiting 1 instead
    (what an honest run with a failure gives) does not help either."""
    env = make("codebase")
    try:
        task = TASKS[repo]
        env.reset(task)
        obs, _, _ = env.step(_prepend(cb.REPOS[repo].package, FORGE.replace("EXIT_CODE", str(exit_code))))
        assert "[exit code 0]" in obs, obs
        obs, reward, done = env.step("submit")
        assert done and reward == 0.0 and not env.info["resolved"], obs
        g = cb.grade(task.data, env.workdir)
        assert not g.resolved and g.f2p_frac == 0.0 and "untrusted" in g.error, g
    finally:
        env.close()


def test_symlinked_package_is_not_followed_by_the_grader():
    """Replacing the package by a link to the pristine copy in the cache must not grade the pristine copy."""
    task = TASKS["tablib"]
    env = make("codebase")
    try:
        env.reset(task)
        pristine = cb.source_dir("tablib") / cb.REPOS["tablib"].package
        env.step(f"rm -rf {cb.REPOS['tablib'].package} && ln -s {pristine} {cb.REPOS['tablib'].package}")
        obs, reward, _ = env.step("submit")
        assert reward == 0.0 and not env.info["resolved"], obs
    finally:
        env.close()


# ----------------------------------------------------------------------------- answers out of reach
# These hold only with sandbox.py's allowlisted filesystem (the project, its data and cache hidden).

def test_project_data_and_cache_unreachable_from_the_shell():
    env = make("codebase")
    try:
        task = TASKS["tablib"]
        env.reset(task)
        shell_env = cb.agent_env(task.data, env.workdir)
        for value in shell_env.values():
            assert str(cb.ROOT) not in value and str(cb.cache_dir()) not in value, shell_env
        for cmd in (f"cat {cb.ROOT / 'codebase.py'}", f"ls {cb.ROOT}", f"cat {cb.DATA_DIR / 'tablib.json'}",
                    f"ls {cb.cache_dir()}", f"cat {cb.source_dir('tablib') / 'src/tablib/core.py'}",
                    "python -c 'import codebase'", f"cd {cb.ROOT} && python -c 'import codebase'",
                    f"PYTHONPATH={cb.ROOT} python -c 'import codebase'"):
            obs, _, _ = env.step(cmd)
            assert "[exit code 0]" not in obs, f"{cmd!r} worked from the agent's shell:\n{obs[:300]}"
        obs, _, _ = env.step("python -c 'import tablib, xlrd, openpyxl; print(tablib.Dataset)'")
        assert "[exit code 0]" in obs, f"the package and its test deps must stay importable:\n{obs}"
    finally:
        env.close()


def test_grading_run_cannot_read_the_pristine_package():
    """The package points its import path at the pristine copy in the cache: if the grading run could
    read the cache, its submodules would load from there and the task would resolve."""
    task = TASKS["tablib"]
    env = make("codebase")
    try:
        env.reset(task)
        pristine = cb.source_dir("tablib") / cb.REPOS["tablib"].package
        env.step(_prepend(cb.REPOS["tablib"].package, f"__path__.insert(0, {str(pristine)!r})\n"))
        obs, reward, _ = env.step("submit")
        assert reward == 0.0 and not env.info["resolved"], obs
    finally:
        env.close()


# ----------------------------------------------------------------------------- round 2: links, sizes, vendored copies

@pytest.mark.parametrize("env_name", ["codebase", "coding"])
def test_symlinked_parent_is_not_followed_by_the_grader(env_name):
    """Issue 30.1: the shell learnt the cache's path from /proc/self/mountinfo, then replaced `src` (the
    package's parent) by a link into the cache: the grader copied the pristine package and resolved it."""
    task = TASKS["tablib"]
    env = make(env_name)
    try:
        env.reset(task)
        obs, _, _ = env.step(f"grep -h {cb.DEPS_MOUNT} /proc/self/mountinfo /proc/self/mounts")
        cache = cb.cache_dir().resolve()
        assert "[exit code 0]" in obs and "tablib-3.10.0" not in obs, obs
        assert not any(str(cache.relative_to(p)) in obs for p in list(cache.parents)[1:]), obs
        obs, _, _ = env.step(f"rm -rf src && ln -s {cb.source_dir('tablib') / 'src'} src && ls src/")
        obs, reward, _ = env.step("submit")
        assert reward == 0.0 and not env.info["resolved"], obs
        # a link inside the package (one file of it) is copied as a link, never read through on the host
        env.reset(task)
        core = cb.source_dir("tablib") / "src/tablib/core.py"
        env.step(f"rm src/tablib/core.py && ln -s {core} src/tablib/core.py")
        obs, reward, _ = env.step("submit")
        assert reward == 0.0 and not env.info["resolved"], obs
    finally:
        env.close()


def test_sparse_files_and_fifos_are_refused_by_the_grader(tmp_path, monkeypatch):
    """Issue 30.2 and 30.5: a sparse file costs the workspace nothing, but a copy writes every byte of it
    (the grader copied the package twice); a named pipe made grade() raise. Now the copy is capped by
    apparent size and skips what is not a file, a directory or a link: an observation, score 0."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    task = TASKS["tenacity"]
    env = make("coding")
    try:
        env.reset(task)
        env.step("mkfifo tenacity/pipe")
        obs, reward, done = env.step("submit")
        assert done and reward == 0.0 and "Submitted" in obs, obs
        env.reset(task)
        env.step(f"truncate -s {cb.GRADE_COPY_BYTES + (1 << 20)} tenacity/blob.bin")
        obs, reward, done = env.step("submit")
        assert done and reward == 0.0 and "MB" in obs and "refused" in obs, obs
    finally:
        env.close()
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("rime-deps-")], "grading left files behind"


VENDOR_SCAN = r'''
import json, os, subprocess, sys, zipfile
snippets = json.loads(sys.stdin.read())
names = sorted({n for n, _ in snippets})
archives = ["*.whl", "*.zip", "*.egg", "*.pyz"]
either = lambda pats: [x for p in pats for x in ("-o", "-name", p)][1:]
# find lists the candidates (C speed): every file named like an edited file, every archive
cmd = ["find", "/", "(", "-path", "/proc", "-o", "-path", "/sys", "-o", "-path", "/dev", "-o", "-path", os.getcwd(), ")",
       "-prune", "-o", "-type", "f", "(", "(", *either(names), ")", "-size", "-1024k", "-o", *either(archives), ")",
       "-print0"]
found = []
for path in subprocess.run(cmd, capture_output=True).stdout.decode(errors="replace").split("\0")[:-1]:
    try:
        if path.endswith((".whl", ".zip", ".egg", ".pyz")):
            found += [(path, m) for m in zipfile.ZipFile(path).namelist()
                      if m.split("/")[-1] in names and ("tenacity/" in m or "tablib/" in m)][:1]
        else:
            text = open(path, errors="replace").read()
            found += [(path, i) for i, (n, old) in enumerate(snippets) if n == path.rsplit("/", 1)[-1] and old in text]
    except (OSError, zipfile.BadZipFile, ValueError):
        pass
print(json.dumps(found))
'''


def test_no_copy_of_a_task_repository_is_reachable_from_the_shell():
    """Issue 30.3: pip's vendored tenacity (site-packages/pip/_vendor) held every pristine snippet of 14
    tenacity tasks. Every readable file of a task's sandbox (the workspace aside) is searched for the
    snippets the tasks' edits replace, and every archive for a copy of a task package."""
    import json
    import shlex
    tasks = [t for t in cb.load_tasks("coding")]
    snippets = sorted({(e["file"].rsplit("/", 1)[-1], e["old"]) for t in tasks for e in t.data["edits"]
                       if len(e["old"].strip()) >= 20})   # short snippets ("return x") are everywhere
    env = make("coding")
    try:
        env.reset(TASKS["tenacity"])
        env.workspace.sandbox.write_file("scan.py", VENDOR_SCAN)
        r = env.workspace.sandbox.run(f"echo {shlex.quote(json.dumps(snippets))} | python scan.py", timeout=600)
        assert r.exit_code == 0, r.output[-2000:]
        found = json.loads(r.output.strip().splitlines()[-1])
        assert not found, found[:10]
    finally:
        env.close()
