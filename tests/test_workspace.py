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



# ----------------------------------------------------------------------------- round 2 (issue 30)

HIDE = ("shell: echo 'size: m; brand: norvik' | tee /tmp/carry /dev/shm/carry > /dev/null; "
        "python -c \"import os; os.setxattr('.', 'user.carry', b'norvik')\"; chmod 751 .; "
        "echo n > .agent_memory/n.md; python -c \"import os; os.setxattr('.agent_memory/n.md', 'user.carry', b'x')\"; "
        "chmod 4755 .agent_memory/n.md")
PEEK = ("shell: cat /tmp/carry /dev/shm/carry; python -c \"import os; print(os.listxattr('.'), "
        "os.listxattr('.agent_memory/n.md') if os.path.exists('.agent_memory/n.md') else '')\"; stat -c %a . .agent_memory/n.md")


@pytest.mark.parametrize("name", ["shop", "coding"])
def test_only_memory_files_cross_a_task_boundary(name):
    """Issue 30.6: one sandbox served every task of a Shop stream, so its private /tmp and /dev/shm carried
    notes past a blank memory; in every shell env an xattr and the workspace root's mode bits did too."""
    env = envs.make(name, keep_memory=True)
    shell = "" if name == "coding" else "shell: "
    try:
        tasks = env.tasks("test")
        env.reset(tasks[0])
        obs, _, _ = env.step(shell + HIDE.removeprefix("shell: "))
        assert "exit 0" in obs or "exit code 0" in obs, obs
        env.reset(tasks[1])   # kept memory: n.md's content only, as a fresh file
        obs, _, _ = env.step(shell + PEEK.removeprefix("shell: "))
        assert "norvik" not in obs and "'user.carry'" not in obs and "751" not in obs and "4755" not in obs, obs
        assert env.memory_files() == {"n.md": "n\n"}
        env.step(shell + HIDE.removeprefix("shell: "))
        env.set_memory_files({})
        env.reset(tasks[2])   # a blank memory is blank
        obs, _, _ = env.step(shell + PEEK.removeprefix("shell: "))
        assert "norvik" not in obs and "'user.carry'" not in obs and "751" not in obs, obs
        assert env.memory_files() == {}
    finally:
        env.close()


def test_memory_names_are_escaped_and_the_folder_bounded(tmp_path):
    """Issue 30.4 and 30.7: a name that is not UTF-8 became a key with a lone surrogate (the tokenizer
    raised and the whole rollout batch was lost); names went into the prompt raw (escapes, newlines); 100k
    files made a 21 M-character note. Keys are now escaped text, the folder is read up to an entry count and
    a name length, and the note is bounded in characters."""
    import os

    import camg_memory
    from workspace import MEMORY_MAX_FILES, MEMORY_NAME_CHARS, read_memory
    mem = tmp_path / MEMORY_DIR
    mem.mkdir()
    for raw in (b"notes\xff.md", b"\x1b[31mred\x1b[0m", b"two\nlines", b"x" * (MEMORY_NAME_CHARS + 1)):
        (mem / os.fsdecode(raw)).write_bytes(b"t")
    files = read_memory(tmp_path)
    for key in files:
        key.encode("utf-8")   # raises on a lone surrogate
        assert key.isprintable(), repr(key)
    assert set(files) == {"notes\\xff.md", "\\x1b[31mred\\x1b[0m", "two\\nlines"}, files
    for i in range(3 * MEMORY_MAX_FILES):
        (mem / f"{i:05d}-{'n' * 150}").touch()
    files = read_memory(tmp_path)
    assert len(files) <= MEMORY_MAX_FILES

    class Env:
        def memory_files(self):
            return files
    assert len(camg_memory.memory_note(Env())) <= camg_memory.MEMORY_NOTE_CHARS
