"""sandbox.py against real hostile commands.

Each hostile test checks three things: the command is contained (timed out, refused, capped), no
process it started survives (found by a unique marker in /proc/*/cmdline), and a bystander child of
this test process is untouched. The process-ending tests run in every isolation mode this machine
has ("namespace" or "userns", and always "subreaper"); timeouts are 1-2 s to keep the file fast.
"""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest

import sandbox
from sandbox import RunResult, Sandbox, isolation_mode

MODES = [isolation_mode()] + (["subreaper"] if isolation_mode() != "subreaper" else [])
NAMESPACED = isolation_mode() in ("namespace", "userns")


def _marker() -> str:
    """A sleep duration unique to this test run, so its processes can be found in /proc."""
    return f"1000.{uuid.uuid4().int % 10**9:09d}"


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:   # a process may exit between any two reads (a fork bomb's do, all the time)
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                if marker.encode() not in cmdline:
                    continue
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] != "Z":   # a zombie awaiting its reaper is not running
                pids.append(int(entry.name))
    return pids


def _assert_no_stray(marker: str) -> None:
    deadline = time.monotonic() + 10   # SIGKILLed processes need a moment to be reaped (longer under load)
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _processes_with(marker) == [], f"processes with {marker!r} survived the sandbox"


@pytest.fixture
def bystander():
    """A child of the test process that no sandbox operation may touch."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    alive = proc.poll() is None
    proc.kill()
    proc.wait()
    assert alive, "the sandbox killed a process of the test process"


def _box(mode, **kw) -> Sandbox:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # subreaper mode warns that it cannot isolate the network
        return Sandbox(isolation=mode, **kw)


# ----------------------------------------------------------------------------- basics

def test_run_basics():
    with Sandbox(timeout=5) as sb:
        r = sb.run("echo out; echo err >&2; exit 3")
        assert r == RunResult(3, "out\nerr\n", False, False)
        # cwd is reset to the workspace at every call; files persist
        assert sb.run("cd /; touch /tmp/../$HOME/made; pwd").output == "/\n"
        assert sb.run("pwd").output.strip() == str(sb.workdir)
        assert (sb.workdir / "made").exists()
        assert sb.run("cat; echo done", timeout=2).output == "done\n"   # stdin closed: cat sees EOF at once
        assert sb.run("kill -9 $$").exit_code == 128 + 9
        assert sb.run("printf 'caf\\xc3\\xa9 \\xff'").output == "café \ufffd"
        assert sb.mode in ("namespace", "userns", "subreaper")
        assert sb.mode in sb.describe()


def test_bad_input_gives_clear_errors():
    with pytest.raises(AssertionError, match="timeout"):
        Sandbox(timeout=0)
    with pytest.raises(AssertionError, match="isolation"):
        Sandbox(isolation="docker")
    with Sandbox() as sb:
        with pytest.raises(ValueError, match="str"):
            sb.run(["ls"])
        # agent text flows straight in: a NUL byte or a huge command is refused with a result, never raised
        r = sb.run("echo a\0b")
        assert r.exit_code == 126 and "NUL" in r.output
        r = sb.run("echo " + "x" * 200_000)
        assert r.exit_code == 126 and f"{sandbox.MAX_COMMAND_BYTES:,}-byte limit" in r.output
        assert sb.run("echo " + "x" * 90_000 + " | wc -c").output == "90001\n"
        assert sb.run("echo \ud800").exit_code == 126
    with pytest.raises(AssertionError, match="closed"):
        sb.run("true")


# ----------------------------------------------------------------------------- processes

@pytest.mark.parametrize("mode", MODES)
def test_sleep_times_out(mode, bystander):
    m = _marker()
    with _box(mode, timeout=1) as sb:
        t = time.monotonic()
        r = sb.run(f"echo started; sleep {m}")
        assert time.monotonic() - t < 3
        assert r.timed_out and r.exit_code == 124 and r.output == "started\n"
        _assert_no_stray(m)
        assert sb.run("echo alive").output == "alive\n"   # the sandbox still works after a timeout


@pytest.mark.parametrize("mode", MODES)
def test_setsid_and_double_fork_do_not_escape(mode, bystander):
    m1, m2, m3 = _marker(), _marker(), _marker()
    with _box(mode, timeout=1) as sb:
        # the shell exits at once; what it left running must go with it, without waiting
        t = time.monotonic()
        r = sb.run(f"setsid sleep {m1} & ( ( sleep {m2} & ) & ); echo left")
        assert r.output == "left\n" and not r.timed_out and time.monotonic() - t < 1
        _assert_no_stray(m1)
        _assert_no_stray(m2)
        r = sb.run(f"setsid sleep {m3} > /dev/null 2>&1 < /dev/null & sleep {m3}")
        assert r.timed_out
        _assert_no_stray(m3)


@pytest.mark.parametrize("mode", MODES)
def test_ignored_sigterm_busy_loop(mode, bystander):
    m = _marker()
    with _box(mode, timeout=1) as sb:
        r = sb.run(f"trap '' TERM; while :; do :; done # {m}")
        assert r.timed_out
        _assert_no_stray(m)


@pytest.mark.parametrize("mode", MODES)
def test_yes_is_capped_without_stalling(mode, bystander):
    with _box(mode, timeout=1, max_output=1000) as sb:
        r = sb.run("yes")
        assert r.timed_out and r.truncated
        assert r.output.startswith("y\ny\n") and r.output.endswith("y\n") and "bytes of output truncated" in r.output
        assert len(r.output) < 1100
        # 20 MB of finite output: the head and the tail survive, the middle is dropped
        t = time.monotonic()
        r = sb.run("seq 1 3000000")
        assert not r.timed_out and r.exit_code == 0 and r.truncated and time.monotonic() - t < 5
        assert r.output.startswith("1\n2\n3\n") and r.output.endswith("2999999\n3000000\n")
        assert sb.run("echo small").truncated is False


def _fork_bomb(sb: Sandbox, marker: str, limit: int) -> None:
    """Runs a fork bomb, checking while it rages that it stays under `limit` and the host answers."""
    result = {}
    bomb = threading.Thread(target=lambda: result.update(r=sb.run(f"bomb() {{ bomb | bomb & }}; bomb; sleep 10 # {marker}")))
    bomb.start()
    peak = 0
    while bomb.is_alive():
        peak = max(peak, len(_processes_with(marker)))
        # the host (this test process) can still start processes: no timing assert (a loaded machine
        # is slow for everyone), only a deadlock guard; fork failing on the host would raise here
        assert subprocess.run(["true"], timeout=60).returncode == 0
        time.sleep(0.05)
    bomb.join()
    assert result["r"].timed_out
    assert 0 < peak <= limit, f"fork bomb reached {peak} processes, limit {limit}"
    _assert_no_stray(marker)


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained(mode, bystander):
    with _box(mode, timeout=2, max_procs=24) as sb:
        if sb.limits["procs"].startswith("none"):
            pytest.skip(f"no process limit available here: {sb.describe()}")
        limit = 24 + (300 if "pid_max" in sb.limits["procs"] else 0)
        _fork_bomb(sb, _marker(), limit)
        assert sb.run("echo alive").output == "alive\n"


@pytest.mark.skipif(not (os.geteuid() == 0 and isolation_mode() == "namespace" and sandbox._pid_max_is_per_namespace()),
                    reason="needs root, a PID namespace and a per-namespace pid_max (Linux >= 6.14)")
def test_fork_bomb_as_root_without_cgroups(monkeypatch, bystander):
    # root ignores RLIMIT_NPROC; without a cgroup the namespace's own pid_max is the guard
    monkeypatch.setattr(sandbox, "_make_cgroups", lambda *a: ([], ""))
    with _box("namespace", timeout=2, max_procs=24) as sb:
        assert "pid_max" in sb.limits["procs"]
        _fork_bomb(sb, _marker(), 300 + 24)


# ----------------------------------------------------------------------------- resource limits

@pytest.mark.parametrize("mode", MODES)
def test_dd_huge_file_hits_the_file_size_limit(mode, bystander):
    with _box(mode, timeout=10, max_file_mb=4) as sb:
        r = sb.run("dd if=/dev/zero of=big bs=1M count=100000")
        assert r.exit_code != 0 and not r.timed_out
        assert (sb.workdir / "big").stat().st_size <= 4 << 20


def test_memory_limit(bystander):
    with Sandbox(timeout=20, memory_mb=128) as sb:
        r = sb.run(f"{sys.executable} -c \"b = b'x' * (1 << 30); print('allocated')\"")
        assert r.exit_code != 0 and "allocated" not in r.output, (sb.describe(), r)
        assert sb.run("echo alive").output == "alive\n"


def test_cpu_time_limit(bystander):
    with Sandbox(timeout=20, cpu_seconds=1) as sb:
        t = time.monotonic()
        r = sb.run("while :; do :; done")
        assert not r.timed_out and r.exit_code == 128 + 24, r   # SIGXCPU
        assert time.monotonic() - t < 10


# ----------------------------------------------------------------------------- network and environment

@pytest.fixture
def loopback_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)   # the kernel completes connections into the backlog; no accept() needed
    yield srv.getsockname()[1]
    srv.close()


CONNECT = "{py} -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\""


@pytest.mark.skipif(not NAMESPACED, reason="no network namespace on this machine")
def test_network_is_off_by_default(loopback_server, bystander):
    with Sandbox(timeout=10) as sb:
        r = sb.run(CONNECT.format(py=sys.executable, port=loopback_server))
        assert r.exit_code != 0 and "connected" not in r.output
        if shutil.which("curl"):
            r = sb.run(f"curl -sS -m 2 http://127.0.0.1:{loopback_server}/")
            assert r.exit_code != 0 and ("Failed to connect" in r.output or "Couldn't connect" in r.output), r
    with Sandbox(timeout=10, network=True) as sb:
        r = sb.run(CONNECT.format(py=sys.executable, port=loopback_server))
        assert r.exit_code == 0 and r.output == "connected\n"


@pytest.mark.skipif(not NAMESPACED, reason="no mount namespace on this machine")
def test_destructive_commands_harm_neither_host_nor_other_episodes(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    with Sandbox(timeout=10) as a, Sandbox(timeout=10) as b:
        b.write_file("work.txt", "b's work")
        r = a.run(f"rm -rf {tmp_path} /tmp/* 2>&1; echo x > /etc/sandbox-evil; touch /usr/evil; "
                  f"echo mine > mine.txt; echo scratch > /tmp/scratch && cat /tmp/scratch")
        assert "Read-only file system" in r.output and r.output.endswith("scratch\n"), r.output
        assert victim.read_text() == "precious" and b.read_file("work.txt") == "b's work"
        assert not Path("/etc/sandbox-evil").exists() and not Path("/usr/evil").exists()
        assert a.read_file("mine.txt") == "mine\n"    # the workspace itself stays writable
        assert not Path("/tmp/scratch").exists()       # /tmp is private to the sandbox
    with Sandbox(timeout=10, protect_host=False) as sb:
        assert sb.run(f"rm {victim}").exit_code == 0 and not victim.exists()


def test_subreaper_mode_warns_about_network():
    with pytest.warns(UserWarning, match="network"):
        Sandbox(isolation="subreaper").close()


def test_env_is_scrubbed(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    with Sandbox(timeout=5, env={"TASK_ID": "t-7"}) as sb:
        out = sb.run("env").output
        names = {line.split("=", 1)[0] for line in out.splitlines()}
        assert names <= {"PATH", "HOME", "LANG", "PWD", "SHLVL", "_", "TASK_ID"}, names
        assert f"HOME={sb.workdir}\n" in out and "TASK_ID=t-7\n" in out and "hunter2" not in out
        if NAMESPACED:   # nothing readable inside the namespace holds the host's environment
            assert "hunter2" not in sb.run("cat /proc/*/environ").output


# ----------------------------------------------------------------------------- file tools

def test_file_tools_refuse_paths_outside_the_workspace(tmp_path):
    outside = tmp_path / "outside.txt"
    with Sandbox(timeout=5) as sb:
        sb.write_file("sub/ok.txt", "fine")
        assert sb.read_file("sub/ok.txt") == "fine" and sb.run("cat sub/ok.txt").output == "fine"
        assert sb.run(f"ln -s /etc etc; ln -s $HOME/../.. up; ln -s sub/ok.txt inside; ln -s {outside} dangling").exit_code == 0
        assert sb.read_file("inside") == "fine"   # a link that stays inside is fine
        for rel in ["../../etc/passwd", "/etc/passwd", "etc/passwd", "up/etc/hostname", "sub/../../x",
                    sb.workdir / ".." / "x"]:
            with pytest.raises(PermissionError, match="outside the workspace"):
                sb.read_file(rel)
        for rel in ["etc/sandbox-evil", "dangling", "up/evil", "../evil"]:
            with pytest.raises(PermissionError, match="outside the workspace"):
                sb.write_file(rel, "x")
        assert not Path("/etc/sandbox-evil").exists() and not outside.exists()


# ----------------------------------------------------------------------------- lifetime and concurrency

@pytest.mark.parametrize("mode", MODES)
def test_close_ends_everything_and_removes_the_workspace(mode, tmp_path, bystander):
    sb = _box(mode, timeout=5)
    helper, cgroups, workdir = sb._proc_box[0], list(sb._cgroups), sb.workdir
    sb.run("echo x > f")
    sb.close()
    assert helper.poll() is not None and not workdir.exists()
    assert not any(d.exists() for d in cgroups)
    sb.close()   # closing twice is harmless
    given = tmp_path / "ws"
    with _box(mode, workdir=given) as sb:
        sb.run("echo kept > f")
    assert (given / "f").read_text() == "kept\n"   # a given workspace is not deleted


def test_helper_death_is_survived():
    # in subreaper mode a command can kill its helper (its parent); the sandbox starts a new one
    m = _marker()
    with _box("subreaper", timeout=5) as sb:
        r = sb.run(f"kill -9 $PPID; sleep {m}")
        assert r.exit_code == 137 and "restarted" in r.output
        assert sb.run("echo back").output == "back\n"
        if sb._cgroups:   # the orphans of the dead helper can only be found through its cgroup
            _assert_no_stray(m)


def test_many_sandboxes_side_by_side(bystander):
    m = _marker()
    results = {}

    def episode(i):
        with Sandbox(timeout=1) as sb:
            sb.write_file("id.txt", str(i))
            slow = sb.run(f"sleep {m}") if i % 2 else None   # half of them time out meanwhile
            results[i] = (sb.run("cat id.txt; ls | wc -l").output, slow)

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        out, slow = results[i]
        assert out == f"{i}1\n", (i, out)   # each sees only its own workspace
        assert slow is None or slow.timed_out
    _assert_no_stray(m)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become an ordinary user")
def test_as_an_ordinary_user(tmp_path, bystander):
    """The path of a typical user machine: no root, so no cgroup; RLIMIT_NPROC holds the fork bomb."""
    m = _marker()
    script = f"""
import sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {str(Path(sandbox.__file__).parent)!r})
from sandbox import Sandbox
with Sandbox(timeout=1, max_procs=24) as sb:
    print(sb.describe())
    assert "RLIMIT_NPROC" in sb.limits["procs"], sb.limits
    assert sb.run("setsid sleep {m} & sleep {m}").timed_out
    r = sb.run("bomb() {{ bomb | bomb & }}; bomb; sleep 10 # {m}")
    assert r.timed_out, r
    assert "Read-only" in sb.run("touch /usr/evil").output
    print(sb.run("id -u").output.strip(), "ok")
"""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    python = shutil.which("python3", path=env["PATH"]) or sys.executable   # one an ordinary user may run
    tmp_path.chmod(0o777)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")
    _assert_no_stray(m)


def test_ro_paths_bring_back_host_dirs_under_tmp(tmp_path):
    """The private /tmp hides host directories under /tmp (a cache, a clone); ro_paths re-exposes
    them read-only, and only them."""
    shared = tmp_path / "cache"
    shared.mkdir()
    (shared / "dep.txt").write_text("dependency\n")
    with Sandbox(timeout=5) as sb:
        if not sb.protect_host:
            pytest.skip(f"no private /tmp in this mode: {sb.describe()}")
        assert "dependency" not in sb.run(f"cat {shared}/dep.txt").output
    with Sandbox(timeout=5, ro_paths=[shared]) as sb:
        assert sb.run(f"cat {shared}/dep.txt").output.strip() == "dependency"
        assert sb.run(f"echo x > {shared}/new.txt").exit_code != 0      # still read-only
        assert sb.run("echo y > mine.txt && cat mine.txt").output.strip() == "y"   # the workspace is writable
    assert not (shared / "new.txt").exists()
