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
