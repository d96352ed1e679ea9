"""Attacks an RL policy can find, each reproduced with a real command, each now gaining nothing.

The sandbox's promises (sandbox.py's docstring): commands hold no privileges, see only an
allowlisted filesystem (never the project, its data, $HOME or the host's /tmp), cannot reach or
crash their helper, end on time, stay under a disk quota, and print only sanitised text. The
host never follows a workspace's symlinks. Every shell environment is probed from its own shell.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import envs
import sandbox
from sandbox import Sandbox, isolation_mode

PROJECT = Path(__file__).resolve().parent.parent
ISOLATED = isolation_mode() in ("namespace", "userns")
needs_namespaces = pytest.mark.skipif(
    not ISOLATED, reason=f"isolation is {isolation_mode()!r}: no mount namespace, so no allowlisted filesystem here")


# ----------------------------------------------------------------------------- privileges

@needs_namespaces
def test_commands_hold_no_privileges(tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("precious")
    with Sandbox(timeout=10, ro_paths=[tmp_path]) as sb:
        status = sb.run("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status").output.split()
        assert status[1::2] == ["0000000000000000"] * 5, status
        for cmd in ["mount -t tmpfs none /tmp", "umount -l /tmp", "mount -o remount,bind,rw /",
                    f"mount -o remount,bind,rw {tmp_path}", "mkdir /sys/fs/cgroup/pids/x",
                    f"echo evil > {host_file}", "touch /usr/evil /etc/evil"]:
            r = sb.run(cmd)
            assert r.exit_code != 0, (cmd, r)
        # a user namespace gives every capability again, but only over mounts it cannot unlock
        sb.write_file("userns.py", f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000 | 0x00020000) == 0    # CLONE_NEWUSER | CLONE_NEWNS
for target in (b"/", b"/usr", {str(tmp_path).encode()!r}):
    print(libc.mount(None, target, None, 32 | 4096, None))   # MS_REMOUNT | MS_BIND: rw again?
print(libc.umount2(b"/tmp", 2), libc.umount2(b"/usr", 2))   # uncover what lies below?
try:
    open({str(host_file)!r}, "w").write("evil")
except OSError as e:
    print(type(e).__name__)
""")
        r = sb.run("python userns.py")
        assert r.output.split() == ["-1", "-1", "-1", "-1", "-1", "OSError"], r
    assert host_file.read_text() == "precious"
    assert not Path("/usr/evil").exists() and not Path("/etc/evil").exists()


@needs_namespaces
def test_helper_is_out_of_reach(capfd):
    with Sandbox(timeout=10) as sb:
        r = sb.run("cat /proc/1/cmdline; ls /proc/1; echo not-json > /proc/1/fd/0")
        assert r.exit_code != 0 and "serve" not in r.output
        assert str(PROJECT) not in sb.run("cat /proc/*/cmdline /proc/*/environ; env").output
        # a line that is not a request (what /proc/1/fd/0 used to let through) is skipped
        sb._proc.stdin.write(b'not-json\n{"id": "forged"}\n[1]\n')
        sb._proc.stdin.flush()
        assert sb.run("echo alive").output == "alive\n"
    assert "Traceback" not in capfd.readouterr().err


# ----------------------------------------------------------------------------- the allowlisted filesystem

@needs_namespaces
def test_filesystem_is_an_allowlist(tmp_path):
    (tmp_path / "host-tmp.txt").write_text("x")
    with Sandbox(timeout=10, env={"PYTHONPATH": str(PROJECT)}) as sb:
        for cmd in [f"ls {PROJECT}", f"cat {PROJECT}/sandbox.py", f"cat {PROJECT}/sandbox_helper.py",
                    f"ls {PROJECT}/data", f"ls {PROJECT}/.cache", "python -c 'import sandbox'",
                    "python -c 'import shop'", f"cat {tmp_path}/host-tmp.txt",
                    "ls /work /home /var /opt /mnt"]:
            r = sb.run(cmd)
            assert r.exit_code != 0, (cmd, r)
        # $HOME shows nothing of its own: at most the path down to the interpreter (pyenv lives there)
        home = Path.home()
        allowed = {Path(p).relative_to(home).parts[0] for p in sandbox.interpreter_paths() if Path(p).is_relative_to(home)}
        shown = set(sb.run(f"ls -A {home}").output.split())
        assert shown <= allowed, shown
        assert sb.run("echo $HOME").output.strip() == str(sb.workdir)
        # what programs need is there: the system, the interpreter and its packages, the workspace
        r = sb.run("python -c 'import sys, numpy, pytest; print(sys.executable)'; ls /dev; echo w > f && cat f")
        assert r.exit_code == 0 and "null" in r.output and r.output.endswith("w\n"), r
        assert sb.run(f"{sys.executable} -m pytest --version").exit_code == 0   # how codebase grading runs


@needs_namespaces
def test_mounts_show_host_dirs_at_a_neutral_path(tmp_path):
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "depmod.py").write_text("VALUE = 42\n")
    with Sandbox(timeout=10, mounts={"/opt/deps": deps}, env={"PYTHONPATH": "/opt/deps"}) as sb:
        assert sb.run("python -c 'import depmod; print(depmod.VALUE)'").output == "42\n"
        assert sb.run("touch /opt/deps/new").exit_code != 0 and not (deps / "new").exists()
        assert sb.run(f"ls {deps}").exit_code != 0   # only the neutral path shows it
    with pytest.raises(AssertionError, match="neutral"):
        Sandbox(mounts={"/": deps})
    with pytest.raises(AssertionError, match="does not exist"):
        Sandbox(mounts={"/opt/x": tmp_path / "missing"})
    with pytest.raises(AssertionError, match="inside /usr"):
        Sandbox(mounts={"/usr/local/deps": deps})


@pytest.mark.parametrize("linked", [False, True], ids=["venv", "venv-through-a-link"])
def test_interpreter_under_the_temp_dir(tmp_path, linked):
    """Issue 15.4: a venv under the system temp dir must run inside the sandbox it starts. Issue 30.8: so
    must one reached through a link there (sys.executable names the link's path, which the allowlist held
    only resolved: exit 127)."""
    venv = Path(tempfile.mkdtemp(prefix="sandbox-venv-", dir=tempfile.gettempdir()))
    link = Path(tempfile.gettempdir()) / f"{venv.name}-link"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True, timeout=120)
        if linked:
            link.symlink_to(venv)
        script = (f"import sys; sys.path.insert(0, {str(PROJECT)!r}); import warnings; warnings.simplefilter('ignore')\n"
                  "from sandbox import Sandbox\n"
                  "with Sandbox(timeout=20) as sb:\n"
                  "    print(sb.run('python -c \"import sys; print(sys.prefix)\"').output.strip())\n"
                  "    print(sb.run(sys.executable + ' -c \"import numpy; print(7)\"').output.strip())\n")
        r = subprocess.run([str((link if linked else venv) / "bin" / "python"), "-c", script], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [str(venv.resolve()), "7"], r.stdout
    finally:
        link.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(venv)])


# ----------------------------------------------------------------------------- time, disk, output

def test_closed_output_still_times_out():
    with Sandbox(timeout=2) as sb:
        t = time.monotonic()
        r = sb.run("exec >&- 2>&-; sleep 30")
        assert r.timed_out and r.exit_code == 124
        assert time.monotonic() - t < 25   # a deadlock guard: the bug waited the full 30 s
        assert sb.run("echo alive").output == "alive\n"


def test_disk_quota():
    with Sandbox(timeout=20, disk_mb=8) as sb:
        # three files, each under the file limit, over the quota together
        r = sb.run("for i in 1 2 3; do head -c 5000000 /dev/zero > f$i; done")
        assert "over its 8 MB quota" in r.output, r
        r = sb.run("echo more >> f1; rm f2 f3")   # over quota nothing grows, but deleting works
        assert "File too large" in r.output and "quota" not in r.output, r
        assert sb.run("echo ok > g && cat g").output == "ok\n"
        # a running command is stopped once the workspace passes the quota; `chmod 000` hides nothing
        r = sb.run("rm -f f1 g; mkdir d; head -c 5000000 /dev/zero > d/a; chmod 000 d; sleep 1; "
                   "head -c 5000000 /dev/zero > b; sleep 30")
        assert not r.timed_out and "the command was stopped" in r.output, r
        sb.run("chmod 700 d; rm -rf d b")
        assert sb.run("echo ok > g && cat g").output == "ok\n"


def test_output_is_sanitised():
    assert sandbox.sanitize("a\0b\x1b[31mred\x1b[0m\x1b]0;title\x07 \x1b]8;;http://x\x1b\\link\x9b2J\r\nc\rd\x07e\tf\x7f") == \
        "a\ufffdbred link\nc\nd\ufffde\tf\ufffd"
    with Sandbox(timeout=5, max_output=200) as sb:
        r = sb.run(r"printf 'x\0y\033[2J\033]0;pwned\007z\n'")
        assert r.output == "x\ufffdyz\n"
        r = sb.run(r"printf '\033[31m%.0s' $(seq 100); seq 1000; printf '\033]0;t\007\0'")   # both halves of a cut output
        assert r.truncated and "\x1b" not in r.output and "\0" not in r.output


# ----------------------------------------------------------------------------- the host reads workspaces safely

def test_memory_never_follows_links_nor_reads_special_files(tmp_path):
    mem = tmp_path / envs.MEMORY_DIR
    mem.mkdir()
    (mem / "notes.md").write_text("kept")
    (mem / "CONTINUATION.md").symlink_to("/proc/self/environ")
    (mem / "dir-link").symlink_to("/etc")
    os.mkfifo(mem / "fifo")                                 # reading it would hang the host
    (mem / "big.md").write_text("x" * (envs.MEMORY_FILE_BYTES + 10))
    assert envs.read_memory(tmp_path) == {"big.md": "x" * envs.MEMORY_FILE_BYTES, "notes.md": "kept"}
    sub = mem / "sub"
    sub.mkdir()
    for i in range(8):
        (sub / f"{i}.md").write_text("y" * envs.MEMORY_FILE_BYTES)
    assert sum(map(len, envs.read_memory(tmp_path).values())) == envs.MEMORY_TOTAL_BYTES
    # .agent_memory itself a link to a host directory: nothing is listed, and replacing it is safe
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / "secret").write_text("s")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / envs.MEMORY_DIR).symlink_to(host_dir)
    assert envs.read_memory(ws) == {}
    envs.write_memory(ws, {})
    assert (ws / envs.MEMORY_DIR).is_dir() and not (ws / envs.MEMORY_DIR).is_symlink()
    assert (host_dir / "secret").read_text() == "s"
    assert envs.read_workspace_file(ws, "host/secret", 100) is None   # no such file inside ws


def test_env_memory_links_made_by_the_agent():
    from shop import ShopEnv
    env = ShopEnv()
    try:
        env.reset(env.tasks("test")[0])
        env.step("shell: ln -s /proc/self/environ .agent_memory/CONTINUATION.md; echo hi > .agent_memory/n.md")
        assert env.memory_files() == {"n.md": "hi\n"}
        env.step("shell: rm -r .agent_memory; ln -s /etc .agent_memory")
        assert env.memory_files() == {}
        env.set_memory_files({})   # CAMG's blank-memory ablation must not raise
        assert env.memory_files() == {}
        env.step("shell: rm -r .agent_memory; ln -s /nonexistent .agent_memory")
        env.reset(env.tasks("test")[1])   # a dangling link must not make reset() raise
        assert env.memory_files() == {} and (env.workdir / envs.MEMORY_DIR).is_dir()
    finally:
        env.close()


# ----------------------------------------------------------------------------- every shell environment

def _shell_envs():
    from autoresearch import AutoResearchEnv
    from deepresearch import DeepResearchEnv
    from shop import ShopEnv
    return {"shop": ShopEnv, "deepresearch": DeepResearchEnv, "autoresearch": AutoResearchEnv}


@pytest.mark.parametrize("name", ["shop", "deepresearch", "autoresearch"])
def test_env_shell_cannot_reach_the_project(name):
    env = _shell_envs()[name]()
    try:
        env.reset(env.tasks("test")[0])
        probes = [f"python -c 'import {name}'", f"PYTHONPATH={PROJECT} python -c 'import {name}'",
                  f"ls {PROJECT}", f"cat {PROJECT}/{name}.py", f"ls {PROJECT}/data", "cat /proc/1/cmdline"]
        for probe in probes if ISOLATED else []:
            obs, reward, done = env.step(f"shell: {probe}; echo status=$?")
            assert "status=0" not in obs and reward == 0.0, (probe, obs)
        # a huge or NUL-laden action is an observation, never an exception
        obs, reward, done = env.step("shell: echo " + "x" * 200_000)
        assert f"{sandbox.MAX_COMMAND_BYTES:,}-byte limit" in obs and len(obs) < 2000 and reward == 0.0
        obs, reward, done = env.step("shell: echo a\0b")
        assert "NUL" in obs and reward == 0.0
    finally:
        env.close()


def test_autoresearch_predictions_are_not_read_through_links():
    from autoresearch import AutoResearchEnv
    env = AutoResearchEnv(seed=0, max_steps=5)
    try:
        env.reset(env.tasks("test")[0])
        env.step("shell: ln -s /proc/self/environ predictions.csv")
        obs, reward, done = env.step("evaluate")
        assert "regular file" in obs and reward == 0.0 and not done
    finally:
        env.close()


# ----------------------------------------------------------------------------- round 2 (issue 30)

def test_quota_counts_apparent_size_and_entries():
    """Issue 30.2 and 30.7: `truncate -s 512M` costs no blocks, and 100k empty files cost no bytes; both
    now count (apparent size, an entry limit, a depth limit), so the command is stopped and nothing grows."""
    with Sandbox(timeout=20, disk_mb=8, max_files=500) as sb:
        r = sb.run("truncate -s 7M a b c")   # each under the file size limit, 21 MB together, no block used
        assert "over its 8 MB quota" in r.output, r
        assert "File too large" in sb.run("echo more >> a").output
        sb.run("rm a b c")
        r = sb.run("mkdir many && cd many && touch $(seq 1000)")
        assert "entries" in r.output and "over" in r.output, r
        r = sb.run("rm -r many; touch new")   # over the limit, nothing new may be made (where Landlock is)
        assert sb.run("rm -f new; echo ok > g && cat g").output == "ok\n"
        r = sb.run("python -c \"import os; os.makedirs('/'.join(['d'] * 600))\"")
        assert "levels deep" in r.output, r
        sb.run("rm -r d")
        assert sb.run("echo ok > g && cat g").output == "ok\n"


def test_no_command_makes_the_sandbox_raise():
    """Issue 30.5: after `chmod 000 .` every later command raised "sandbox helper could not run the command"."""
    with Sandbox(timeout=10) as sb:
        r = sb.run("chmod 000 .")
        assert r.exit_code == 0
        assert sb.run("echo alive").output == "alive\n"


@needs_namespaces
def test_ipc_objects_stay_in_their_sandbox():
    """Issue 30.6: a SysV shared-memory segment outlives the command that made it; without an IPC namespace
    of its own, the next task's sandbox (or the host) could read it."""
    with Sandbox(timeout=10) as a:
        assert "id" in a.run("ipcmk -M 4096").output
        assert a.run("ipcs -m").output.count("0x") == 1
        with Sandbox(timeout=10) as b:
            assert b.run("ipcs -m").output.count("0x") == 0


def _temp_entries():
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(("workspace-", "sandbox-", "codebase-"))}


@pytest.mark.parametrize("name", ["coding", "shop"])
def test_no_action_makes_an_env_raise_or_leave_files(name, tmp_path, monkeypatch):
    """Issue 30.5: a fifo, 1,500 nested directories (RecursionError in every host walk) and `chmod 000`
    made memory_files, reset, set_memory_files, submit and close raise, and close left the workspace.
    (The env gets a temp dir of its own: other jobs' workspaces in the machine's do not count.)"""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _temp_entries()
    env = envs.make(name)
    tasks = env.tasks("test")
    task = next(t for t in tasks if t.group == "tenacity") if name == "coding" else tasks[0]
    shell = "" if name == "coding" else "shell: "
    deep = "python -c \"import os; os.makedirs('/'.join(['d'] * 1500))\""
    try:
        env.reset(task)
        # the deep tree goes where the host walks it: the package (grading) or the memory folder (memory_files)
        for cmd in ["mkfifo .agent_memory/fifo", "mkdir -p locked/inner && chmod 000 locked/inner locked",
                    f"cd {'tenacity' if name == 'coding' else '.agent_memory'} && {deep}", "chmod 000 ."]:
            obs, reward, done = env.step(shell + cmd)
            assert isinstance(obs, str) and not done, obs
        obs, reward, done = env.step(shell + "echo alive")
        assert "alive" in obs, obs
        files = env.memory_files()
        assert set(files) <= {"fifo"} and all(isinstance(v, str) for v in files.values()), files
        if name == "coding":
            obs, reward, done = env.step("submit")
            assert done and reward == 0.0, obs
        env.set_memory_files({})
        env.reset(tasks[1])
        assert sorted(p.name for p in env.workdir.iterdir() if p.name in ("d", "locked")) == []
        assert env.workdir.stat().st_mode & 0o777 == 0o700
        obs, _, _ = env.step(shell + "ls -a .agent_memory; echo alive")
        assert "alive" in obs, obs
    finally:
        env.close()
    assert _temp_entries() <= before, "close() left files in the temp dir"

