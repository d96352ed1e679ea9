"""Shell sandboxes: a workspace per episode, where model-written commands cannot hurt the host.

During RL an agent's only action is a shell command (CAMG's `shell_command`; RIME's fenced bash
block), and thousands of them run unattended: endless loops, `yes`, fork bombs, daemons that
`setsid` away, huge files, curl to the host. A `Sandbox` runs each one so that it ends on time,
leaves nothing behind, and the host and the other episodes lose nothing:

    with Sandbox(timeout=30.0) as sb:          # a fresh temporary workspace; Sandbox(workdir=p) reuses p
        r = sb.run("ls -la")                   # -> RunResult(exit_code, output, timed_out, truncated)
        sb.write_file("notes.md", "...")       # file tools refuse paths that resolve outside sb.workdir
        snap = sb.snapshot(); sb.restore(snap) # for environment resets and memory files
    # close() ended every process the sandbox started and removed the temporary workspace

How it works. Each sandbox starts one small helper process (this file, run as `--serve`) and sends
it commands over a pipe; the helper runs `bash -c CMD` for each one and replies with the result.
Starting the helper once keeps a command's cost close to a bare `subprocess.run` (see
`python bench.py sandbox`) while the expensive isolation is set up only once per sandbox:

- isolation "namespace": the helper is PID 1 of its own PID namespace (`unshare --pid --fork
  --kill-child --mount-proc`), plus a network namespace with only a downed loopback unless
  network=True. As PID 1 it ends every other process of the namespace with one `kill(-1, SIGKILL)`,
  so `setsid`, double forks and ignored SIGTERM do not help a process to survive. With
  protect_host=True (the default) every mount but the workspace is read-only inside its mount
  namespace and /tmp, /dev/shm are private tmpfs: `rm -rf /` or `rm -rf /tmp/*` harms neither the
  host nor other episodes. "userns" is the same inside an unprivileged user namespace (what a
  normal user gets on most distros).
- isolation "subreaper" (no namespaces allowed): the helper marks itself a child subreaper, so
  orphaned descendants (`setsid ... &`, double forks) are re-parented to it instead of init, and it
  SIGKILLs its whole descendant tree. No network isolation and no read-only host in this mode
  (a warning says so).

Process and memory limits use a cgroup (v1 or v2; needs root) when one can be created, because
root ignores RLIMIT_NPROC. Otherwise: RLIMIT_NPROC for a non-root user, or the per-namespace
`kernel.pid_max` (Linux >= 6.14) for root, and RLIMIT_AS for memory. File size (RLIMIT_FSIZE) and
CPU time (RLIMIT_CPU) are plain rlimits. `sb.mode` and `sb.describe()` say what is active.

Semantics worth knowing:
- every run() is a fresh `bash -c` started in the workspace: the working directory, shell
  variables and `cd` do not carry over between calls; files do;
- when the command's shell exits, anything it left running (background jobs, daemons) is ended:
  a run() is self-contained;
- stdin is closed; stdout and stderr are merged; the environment is only PATH, HOME (= the
  workspace), LANG=C.UTF-8 and the variables passed in `env`;
- a timeout gives exit_code 124 (like coreutils `timeout`); death by signal N gives 128 + N;
- the workspace directory itself is bind-mounted once: change what is inside it (or restore()),
  never delete and recreate the directory while the sandbox is open.

What is simplified on purpose: commands run as the calling user (root included), the host
filesystem is visible (read-only), and the helper's pipes are reachable through /proc by a process of the
same user. This contains runaway and careless commands; it is not a security boundary against a
deliberately malicious program (use a VM or gVisor for that).
"""

import functools
import io
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 10.0  # extra wait for the helper's reply beyond a command's timeout before declaring it dead


@dataclass
class RunResult:
    exit_code: int     # the shell's exit status; 124 on timeout; 128 + N if killed by signal N
    output: str        # stdout and stderr merged, capped (head + marker + tail)
    timed_out: bool
    truncated: bool    # True when output bytes beyond max_output were dropped from the middle


@dataclass
class Snapshot:
    data: bytes        # an uncompressed tar of the whole workspace (symlinks kept as links)
    num_entries: int   # files, directories and links in it


# ----------------------------------------------------------------------------- probing the machine

@functools.lru_cache(maxsize=None)
def isolation_mode() -> str:
    """The strongest isolation this machine allows: "namespace", "userns" or "subreaper"."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("sandbox.py needs Linux (namespaces or PR_SET_CHILD_SUBREAPER)")
    if shutil.which("unshare"):
        for flags in ([], ["--user", "--map-root-user"]):
            argv = ["unshare", *flags, "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "true"]
            try:
                if subprocess.run(argv, capture_output=True, timeout=10).returncode == 0:
                    return "userns" if flags else "namespace"
            except (OSError, subprocess.TimeoutExpired):
                pass
    return "subreaper"


def _own_cgroups() -> list[tuple[str, str, str]]:
    """(hierarchy id, controllers, path) lines of /proc/self/cgroup."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return [tuple(line.split(":", 2)) for line in lines if line.count(":") >= 2]


def _make_cgroups(name: str, max_procs: int, memory_mb: int) -> tuple[list[Path], str]:
    """Create cgroup(s) limiting pids and memory; return (dirs to join, description), or ([], "").

    Tries cgroup v1 (one directory per controller, under our own cgroup) and v2 (a sibling of our
    own cgroup, whose parent already delegates pids+memory). Any failure means "no cgroup": the
    caller falls back to rlimits. Needs root (or a delegated subtree)."""
    made: list[Path] = []
    try:
        v1 = {c: p for _, cs, p in _own_cgroups() for c in cs.split(",") if c in ("pids", "memory")}
        if set(v1) == {"pids", "memory"} and Path("/sys/fs/cgroup/pids/cgroup.procs").exists():
            for ctrl, limit_file, value in (("pids", "pids.max", max_procs),
                                            ("memory", "memory.limit_in_bytes", memory_mb << 20)):
                d = Path("/sys/fs/cgroup", ctrl, v1[ctrl].lstrip("/"), name)
                d.mkdir()
                made.append(d)
                (d / limit_file).write_text(str(value))
            return made, "cgroup v1"
        v2_path = next(p for h, cs, p in _own_cgroups() if h == "0" and cs == "")
        root = Path("/sys/fs/cgroup")
        own = root / v2_path.lstrip("/")
        if {"pids", "memory"} <= set((own / "cgroup.controllers").read_text().split()) and v2_path != "/":
            d = own.parent / name   # a sibling: our own cgroup holds processes, so it cannot have children
            d.mkdir()
            made.append(d)
            (d / "pids.max").write_text(str(max_procs))
            (d / "memory.max").write_text(str(memory_mb << 20))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            return made, "cgroup v2"
    except (OSError, StopIteration, ValueError):
        pass
    _remove_cgroups(made)
    return [], ""


def _kill_cgroups(dirs: list[Path]) -> None:
    """SIGKILL whatever is still in our cgroups: orphans of a helper that died in subreaper mode."""
    for d in dirs:
        for _ in range(100):
            try:
                pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)


def _remove_cgroups(dirs: list[Path]) -> None:
    _kill_cgroups(dirs)
    for d in dirs:
        for _ in range(100):   # a cgroup can be removed only once its last process has been reaped
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def _count_user_processes(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        try:
            n += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:
            pass
    return n


# ----------------------------------------------------------------------------- the sandbox

class Sandbox:
    """A workspace plus a helper process that runs shell commands in it under limits."""

    def __init__(self, timeout: float = 30.0, workdir=None, network: bool = False, env: dict | None = None,
                 memory_mb: int = 4096, max_output: int = 32768, max_procs: int = 256,
                 max_file_mb: int = 512, cpu_seconds: int = 600, protect_host: bool = True,
                 isolation: str = "auto", ro_paths=()):
        """timeout: default seconds per run(); workdir: reuse this directory (kept on close) instead
        of a fresh temporary one (removed on close); network: allow network access; env: extra
        environment variables; memory_mb: memory of all processes together (per process under the
        RLIMIT_AS fallback); max_output: bytes of output kept (half head, half tail); max_procs:
        processes+threads at once; max_file_mb: largest file a command may write; cpu_seconds: CPU
        time per process; protect_host: make everything but the workspace read-only, with a private
        /tmp (namespace modes only); isolation: "auto", or force "namespace" / "userns" / "subreaper";
        ro_paths: host directories under /tmp that commands must still read (the private /tmp would
        hide them), e.g. a package cache; they stay read-only."""
        assert timeout > 0, f"timeout must be positive seconds, got {timeout}"
        assert max_output >= 64, f"max_output must be at least 64 bytes, got {max_output}"
        assert max_procs >= 4, f"max_procs must be at least 4 (the helper, bash and a pipe), got {max_procs}"
        assert memory_mb >= 64 and max_file_mb >= 1 and cpu_seconds >= 1, "memory_mb, max_file_mb, cpu_seconds too small"
        env = dict(env or {})
        for k, v in env.items():
            assert isinstance(k, str) and isinstance(v, str) and "=" not in k, f"env must map str to str, got {k!r}: {v!r}"
        if isolation == "auto":
            isolation = isolation_mode()
        assert isolation in ("namespace", "userns", "subreaper"), f"unknown isolation {isolation!r}"
        self.timeout, self.network, self.max_output, self.mode = float(timeout), network, max_output, isolation
        self.protect_host = protect_host and isolation != "subreaper"   # needs a mount namespace

        self._owns_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="sandbox-") if workdir is None else workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        assert self.workdir.is_dir(), f"workdir {self.workdir} is not a directory"

        # limits: a cgroup where we may create one, else the best rlimit-style guard for this user
        name = f"sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._cgroups, cgroup_kind = _make_cgroups(name, max_procs, memory_mb) if os.geteuid() == 0 else ([], "")
        rlimits = {"RLIMIT_FSIZE": max_file_mb << 20, "RLIMIT_CORE": 0}
        pid_max = None
        if cgroup_kind:
            self.limits = {"procs": cgroup_kind, "memory": cgroup_kind}
        else:
            rlimits["RLIMIT_AS"] = memory_mb << 20
            self.limits = {"memory": "RLIMIT_AS (per process)"}
            if os.getuid() != 0:   # RLIMIT_NPROC counts all of this user's processes, so add the ones running now
                rlimits["RLIMIT_NPROC"] = _count_user_processes(os.getuid()) + max_procs
                self.limits["procs"] = "RLIMIT_NPROC"
            elif isolation == "namespace" and _pid_max_is_per_namespace():
                # pids below 300 are not reused after a wrap, so the namespace holds up to 300 more
                pid_max = 300 + max_procs
                self.limits["procs"] = f"pid namespace pid_max={pid_max}"
            else:
                self.limits["procs"] = "none (root without cgroups: a fork bomb is not contained)"
                warnings.warn("sandbox: running as root without a writable cgroup; process count is not limited")
        if isolation == "subreaper" and (not network or protect_host):
            warnings.warn("sandbox: no namespaces on this machine; commands can reach the network and write "
                          "anywhere this user may (isolation='subreaper')")

        self._env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                     "HOME": str(self.workdir), "LANG": "C.UTF-8", **env}
        bash = shutil.which("bash", path=self._env["PATH"])
        assert bash, f"bash not found on PATH={self._env['PATH']}"
        self._config = {"workdir": str(self.workdir), "mode": isolation, "rlimits": rlimits, "bash": bash,
                        "cpu_seconds": cpu_seconds, "cgroups": [str(d) for d in self._cgroups], "pid_max": pid_max,
                        "protect_host": self.protect_host, "tmp_mb": max_file_mb,
                        "ro_paths": [str(Path(p).resolve()) for p in ro_paths]}
        self._lock = threading.Lock()   # one command at a time per sandbox; sandboxes run side by side
        self._proc, self._proc_box = None, [None]   # the box is shared with the finalizer, which must not hold self
        # cleanup even if the caller forgets close(): ends the helper and removes what we created
        self._finalizer = weakref.finalize(self, _cleanup, self._proc_box, self._cgroups,
                                           self.workdir if self._owns_workdir else None)
        try:
            self._start_helper()
        except BaseException:
            self._finalizer()
            raise

    def _start_helper(self) -> None:
        argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--serve", json.dumps(self._config)]
        if self.mode in ("namespace", "userns"):
            flags = ["--user", "--map-root-user"] if self.mode == "userns" else []
            flags += ["--pid", "--fork", "--kill-child", "--mount-proc"] + ([] if self.network else ["--net"])
            argv = ["unshare", *flags, *argv]
        # the helper gets no host environment: a command can read /proc/1/environ inside the namespace
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=self.workdir,
                                env={"PATH": self._env["PATH"], "LANG": "C.UTF-8"}, start_new_session=True)
        self._proc_box[0] = proc
        self._proc, self._buf = proc, b""
        ready = self._read_line(deadline=time.monotonic() + 30)
        if ready and ready.get("ready") is False and self._config["protect_host"]:
            warnings.warn(f"sandbox: cannot make the host read-only ({ready['error']}); the host filesystem is writable")
            _stop_helper(proc)
            self._config["protect_host"] = self.protect_host = False
            return self._start_helper()
        assert ready == {"ready": True}, f"sandbox helper failed to start (got {ready!r}); see its stderr above"

    def _read_line(self, deadline: float) -> dict | None:
        """The helper's next JSON reply, or None if it died or missed the deadline."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {}   # not ours (see the request id in run()): skipped by the caller

    def run(self, cmd: str, timeout: float | None = None) -> RunResult:
        """Run `bash -c cmd` in the workspace (fresh shell, cwd = workspace) and return its result."""
        if not isinstance(cmd, str) or "\0" in cmd:
            raise ValueError(f"cmd must be a str without NUL bytes, got {cmd!r:.80}")
        timeout = self.timeout if timeout is None else float(timeout)
        assert timeout > 0, f"timeout must be positive seconds, got {timeout}"
        with self._lock:
            assert self._proc is not None, "this sandbox is closed"
            # the id lets us skip a line that a command forged onto the helper's stdout via /proc
            rid = uuid.uuid4().hex
            request = {"id": rid, "cmd": cmd, "timeout": timeout, "max_output": self.max_output, "env": self._env}
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                deadline = time.monotonic() + timeout + GRACE_S
                reply = self._read_line(deadline)
                while reply is not None and reply.get("id") != rid:
                    reply = self._read_line(deadline)
            except (BrokenPipeError, ValueError):
                reply = None
            if reply is None:   # the helper died (e.g. killed by the OOM killer) or hung: start a new one
                _stop_helper(self._proc)
                _kill_cgroups(self._cgroups)
                self._start_helper()
                return RunResult(137, "[sandbox: the shell was killed; its helper was restarted]", False, False)
            if "error" in reply:
                raise RuntimeError(f"sandbox helper could not run the command: {reply['error']}")
            return RunResult(reply["exit_code"], reply["output"], reply["timed_out"], reply["truncated"])

    # ------------------------------------------------------------------------- file tools

    def _path(self, rel) -> Path:
        """The absolute path of `rel` inside the workspace, with every symlink resolved, or an error."""
        root = self.workdir
        path = (root / rel).resolve()   # follows symlinks exactly as open() would
        if path != root and root not in path.parents:
            raise PermissionError(f"{str(rel)!r} resolves to {path}, outside the workspace {root}")
        return path

    def read_file(self, rel) -> str:
        return self._path(rel).read_text(errors="replace")

    def write_file(self, rel, text: str) -> None:
        path = self._path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    # ------------------------------------------------------------------------- snapshots

    def snapshot(self) -> Snapshot:
        """The whole workspace as an in-memory tar (fine for episode workspaces of a few MB)."""
        buf = io.BytesIO()
        with self._lock, tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(self.workdir.iterdir()):
                tar.add(child, arcname=child.name)   # recursive; symlinks are stored, never followed
            num_entries = len(tar.getmembers())
        return Snapshot(buf.getvalue(), num_entries)

    def restore(self, snap: Snapshot) -> None:
        """Make the workspace exactly what it was at snapshot(): extra files go, changed ones revert."""
        assert isinstance(snap, Snapshot), f"restore() takes a Snapshot from snapshot(), got {type(snap).__name__}"
        with self._lock:
            for child in self.workdir.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            with tarfile.open(fileobj=io.BytesIO(snap.data), mode="r") as tar:
                # the "tar" filter (Python >= 3.11.4) refuses absolute and ../ member names; links to
                # anywhere are restored as links, exactly as they were
                kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
                tar.extractall(self.workdir, **kw)

    # ------------------------------------------------------------------------- lifetime

    def describe(self) -> str:
        net = "on" if self.network else ("off" if self.mode != "subreaper" else "NOT isolated")
        host = "read-only but the workspace, private /tmp" if self.protect_host else "writable"
        return (f"isolation={self.mode}, procs: {self.limits['procs']}, memory: {self.limits['memory']}, "
                f"network: {net}, host filesystem: {host}")

    def close(self) -> None:
        """End every process this sandbox started; remove its cgroups and a temporary workspace."""
        with self._lock:
            self._finalizer()
            self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stop_helper(proc) -> None:
    """Closing stdin asks the helper to end everything and exit; kill it if it does not."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # in namespace mode unshare's death kills the helper (--kill-child) and so the namespace
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.stdout.close()


def _cleanup(proc_box, cgroups, temp_workdir) -> None:
    if proc_box[0] is not None:
        _stop_helper(proc_box[0])
    _remove_cgroups(cgroups)
    if temp_workdir is not None:
        shutil.rmtree(temp_workdir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _pid_max_is_per_namespace() -> bool:
    """Linux >= 6.14 lets PID 1 of a namespace set its own kernel.pid_max."""
    probe = "echo 400 > /proc/sys/kernel/pid_max && test $(cat /proc/sys/kernel/pid_max) = 400"
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", probe]
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ----------------------------------------------------------------------------- the helper (inside the sandbox)

class _Capture:
    """Keeps the first and last max_bytes/2 bytes of a stream of any length, in O(max_bytes) memory."""

    def __init__(self, max_bytes: int):
        self.head_max, self.tail_max = max_bytes // 2, max_bytes - max_bytes // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > self.tail_max:
            del self.tail[: len(self.tail) - self.tail_max]

    def text(self) -> tuple[str, bool]:
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped == 0:
            return (self.head + self.tail).decode(errors="replace"), False
        marker = f"\n[... {dropped} bytes of output truncated ...]\n".encode()
        return (self.head + marker + self.tail).decode(errors="replace"), True


def _reap_all_children() -> bool:
    """Reap exited children without blocking; True while some child is still alive."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])   # the command name may contain spaces and ')'
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _end_leftovers(mode: str) -> None:
    """SIGKILL every process the helper's commands left, then reap them all."""
    if mode in ("namespace", "userns"):
        # PID 1 of a namespace: kill(-1) reaches every other process in it, and a process forking
        # at that instant cannot slip through (fork fails once its parent has a fatal signal)
        assert os.getpid() == 1, "refusing kill(-1) outside a private PID namespace"
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    # subreaper: orphans come back to us, so repeat until we have no children at all
    deadline = time.monotonic() + 10
    while _reap_all_children() and time.monotonic() < deadline:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def _run_one(req: dict, config: dict) -> dict:
    capture = _Capture(req["max_output"])
    proc = subprocess.Popen([config["bash"], "-c", req["cmd"]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=config["workdir"], env=req["env"], start_new_session=True)
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + req["timeout"]
    timed_out = False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None   # readable once bash exits
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        events = dict(poller.poll(min(left, 0.05) * 1000))   # without a pidfd, look every 50 ms
        if events.get(fd):
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break   # EOF: every writer has exited
            capture.add(chunk)
        if proc.poll() is not None:
            break   # the shell is gone; a background job may still hold the pipe open
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)   # bash leads its own session, so its group id is its pid
    proc.wait()   # reap bash first so its status is not lost to the generic reaping below
    _end_leftovers(config["mode"])
    os.set_blocking(fd, False)
    while True:   # every writer is dead now: drain what is left in the pipe
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        capture.add(chunk)
    proc.stdout.close()
    if pidfd is not None:
        os.close(pidfd)
    output, truncated = capture.text()
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return {"id": req["id"], "exit_code": 124 if timed_out else code, "output": output,
            "timed_out": timed_out, "truncated": truncated}


def _protect_host(workdir: str, tmp_mb: int, ro_paths=()) -> None:
    """Inside our mount namespace: make every mount read-only, give /tmp and /dev/shm private tmpfs,
    bring back the ro_paths the tmpfs hid (read-only), and mount the workspace back writable.
    Needs Linux >= 5.12 (mount_setattr)."""
    import ctypes
    import struct
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount_setattr(path: str, attr_set: int, attr_clr: int, recursive: bool):
        SYS_mount_setattr, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000   # 442 on every 64-bit arch
        attr = struct.pack("QQQQ", attr_set, attr_clr, 0, 0)   # struct mount_attr
        flags = AT_RECURSIVE if recursive else 0
        check(libc.syscall(SYS_mount_setattr, AT_FDCWD, path.encode(), flags, attr, len(attr)), f"mount_setattr {path}")

    MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MOUNT_ATTR_RDONLY = 2, 4, 4096, 16384, 1
    handle = os.open(workdir, os.O_PATH)   # the workspace may sit under /tmp, which the tmpfs will hide
    hidden = [(p, os.open(p, os.O_PATH)) for p in ro_paths
              if p.startswith(("/tmp/", "/dev/shm/")) and os.path.isdir(p)]
    mount_setattr("/", MOUNT_ATTR_RDONLY, 0, recursive=True)
    for d in ("/tmp", "/dev/shm"):
        if os.path.isdir(d):
            check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777".encode()),
                  f"mount tmpfs on {d}")
    for path, h in hidden:                 # read-only binds: they keep the flag of the source mount
        os.makedirs(path, exist_ok=True)
        check(libc.mount(f"/proc/self/fd/{h}".encode(), path.encode(), None, MS_BIND | MS_REC, None),
              f"bind-mount {path}")
        os.close(h)
    os.makedirs(workdir, exist_ok=True)   # a mount point inside the new /tmp, if the workspace was under /tmp
    check(libc.mount(f"/proc/self/fd/{handle}".encode(), workdir.encode(), None, MS_BIND | MS_REC, None),
          f"bind-mount {workdir}")
    os.close(handle)
    mount_setattr(workdir, 0, MOUNT_ATTR_RDONLY, recursive=True)   # the bind copied the read-only flag


def serve(config: dict) -> None:
    """The helper's loop: one JSON request per stdin line, one JSON reply per stdout line."""
    for d in config["cgroups"]:
        Path(d, "cgroup.procs").write_text("0")   # "0" = this process; children inherit the cgroup
    # The other rlimits go on the helper itself so that commands inherit them: setting them in
    # each child (preexec_fn) would cost a full fork instead of a vfork, +1 ms a command. They do
    # not hinder the helper: it writes no files and needs little memory.
    for name, value in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    # CPU time: a soft limit only. Each command starts its own count at 0 and SIGXCPU ends it; the
    # helper's own count may pass the limit too, so it catches SIGXCPU (the handler is reset at exec)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = config["cpu_seconds"] if hard == resource.RLIM_INFINITY else min(config["cpu_seconds"], hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    signal.signal(signal.SIGXCPU, lambda *_: None)
    if config["pid_max"]:
        Path("/proc/sys/kernel/pid_max").write_text(str(config["pid_max"]))
    if config["mode"] == "subreaper":
        import ctypes
        PR_SET_CHILD_SUBREAPER = 36
        assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, "prctl failed"
    out = sys.stdout.buffer

    def reply(obj):
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    if config["protect_host"]:
        try:   # last: it makes /sys and /proc read-only too
            _protect_host(config["workdir"], config["tmp_mb"], config.get("ro_paths", ()))
        except OSError as e:
            reply({"ready": False, "error": str(e)})
            return
    # a handler, not SIG_IGN: as PID 1 we must not die of a command's `kill -INT 1`, and handlers
    # (unlike SIG_IGN) are reset at exec, so commands still get the default SIGINT
    signal.signal(signal.SIGINT, lambda *_: None)
    reply({"ready": True})
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            reply(_run_one(req, config))
        except Exception as e:   # a bad request must not take the helper down
            _end_leftovers(config["mode"])
            reply({"id": req.get("id"), "error": f"{type(e).__name__}: {e}"})
    _end_leftovers(config["mode"])   # stdin closed: the sandbox is closing (or its owner died)


if __name__ == "__main__":
    assert sys.argv[1:2] == ["--serve"], "usage: this file is a library; `--serve CONFIG` is its helper"
    serve(json.loads(sys.argv[2]))
