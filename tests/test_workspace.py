"""The shell workspace every shell environment stands on (workspace.Workspace) and its one memory
rule between tasks, `keep_memory`, which envs.make takes for every env with a file memory."""

import gc

import pytest

import envs
from workspace import MEMORY_DIR, Workspace

NOTE = "shell: echo 'size: m' > .agent_memory/notes.md && echo junk > scratch.txt"


def test_workspace_memory_rule_and_lifetime(tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # this test's temporary directories only
    ws = Workspace(10.0, keep_memory=False)
    assert list(tmp_path.iterdir()) == [], "no directory before the first use"
    assert "(exit 0)" in ws.shell("echo a > .agent_memory/a.md && echo b > b.txt")
    assert ws.workdir.parent == tmp_path and ws.memory_files() == {"a.md": "a\n"}
    ws.clear()
    assert ws.memory_files() == {} and not (ws.workdir / "b.txt").exists(), "keep_memory=False: a blank task"
    ws.set_memory_files({"given.md": "g"})
    ws.clear()
    assert ws.memory_files() == {"given.md": "g"}, "what set_memory_files gave is what the task starts with"
    ws.shell("echo c > .agent_memory/c.md")
    ws.clear()
    assert ws.memory_files() == {}, "set_memory_files counts for the next task only"
    ws.keep_memory = True
    ws.shell("echo d > .agent_memory/d.md")
    ws.clear()
    assert ws.memory_files() == {"d.md": "d\n"}
    ws.clear(memory={})
    assert ws.memory_files() == {}, "an explicit memory overrides the rule"
    old = ws.sandbox   # start(env): a fresh sandbox, whose commands see these variables
    ws.start({"RIME_WS_TEST": "42"})
    assert ws.sandbox is not old and "42" in ws.shell("echo $RIME_WS_TEST")
    workdir = ws.workdir
    ws.close()
    assert not workdir.exists()
    ws = Workspace(10.0)
    workdir = ws.workdir
    del ws
    gc.collect()
    assert not workdir.exists(), "a garbage-collected workspace removes its directory"


@pytest.mark.parametrize("name", ["shop", "deepresearch", "autoresearch"])
def test_keep_memory_option_of_the_shell_envs(name):
    """Default True (notes carry from task to task, as before); keep_memory=False: each task starts
    blank, in clones too, and set_memory_files() before a reset still decides what a task starts with."""
    kept, blank = envs.make(name), envs.make(name, keep_memory=False)
    twin = blank.clone()
    try:
        assert kept.keep_memory and not blank.keep_memory and not twin.keep_memory
        t0, t1, t2 = kept.tasks("test")[:3]
        assert "kept across tasks" in kept.memory_line() and "lasts until this task ends" in blank.memory_line()
        for env in (kept, blank, twin):
            env.reset(t0)
            env.step(NOTE)
            assert env.memory_files() == {"notes.md": "size: m\n"}
            env.reset(t1)
            assert not (env.workdir / "scratch.txt").exists()
        assert kept.memory_files() == {"notes.md": "size: m\n"}
        assert blank.memory_files() == {} and twin.memory_files() == {}
        blank.set_memory_files({"CONTINUATION.md": "go on"})
        assert blank.memory_line() in blank.reset(t2) and kept.memory_line() in kept.reset(t2)   # the task says which
        assert blank.memory_files() == {"CONTINUATION.md": "go on"}
        assert (blank.workdir / MEMORY_DIR).is_dir()
    finally:
        for env in (kept, blank, twin):
            env.close()


@pytest.mark.parametrize("name", ["alchemy", "codebase"])
def test_keep_memory_is_refused_where_memory_is_text(name):
    with pytest.raises(ValueError, match=f"{name} has no keep_memory option"):
        envs.make(name, keep_memory=True)

