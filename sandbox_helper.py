"""The sandbox's helper: the one process that runs inside a sandbox's namespaces, and its command loop.

sandbox.py (the host side, `Sandbox`) starts this file as a script, once per sandbox:
`[unshare ...] python -I -S sandbox_helper.py --serve`, its config as the first JSON line on stdin.
It is imported by nothing but sandbox.py, which takes `sanitize` from it (and re-exports it). It
runs with -I -S (no site-packages, no project directory on sys.path), so it imports only the
standard library. What it does, in order (sandbox.py's docstring says what the set-up promises):

1. set-up, once: join the sandbox's cgroups, set the rlimits that commands inherit, the
   per-namespace pid_max or the child-subreaper flag (`serve`); build the new root from the
   allowlist and enter it with pivot_root (`_build_root`); drop every capability, set
   no_new_privs and become non-dumpable (`_drop_privileges`); reply {"ready": true} or say which
   stage failed;
2. the command loop: one JSON request per stdin line -> `bash -c CMD` in the workspace under the
   timeout and the disk quota (`_run_one`), output capped (`_Capture`) and sanitised
   (`sanitize`), then every process the command left is killed (`_end_leftovers`: kill(-1) as PID 1
   of its namespace, else a subreaper's sweep of its descendants) -> one JSON reply per stdout line.
   A line that is not a request is skipped; stdin's EOF ends the loop (the sandbox is closing).
"""

import ctypes
import json
import os
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

QUOTA_CHECK_S = 0.5           # how often a running command's workspace is measured against disk_mb


# ----------------------------------------------------------------------------- output: sanitised, capped

_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]"            # CSI: colours, cursor moves, screen clears
                     r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?"   # OSC, DCS, SOS, PM, APC strings (titles, links)
                     r"|\x1b[ -/]*[0-~]?"                   # any other escape
                     r"|\x9b[0-?]*[ -/]*[@-~]")             # the one-character CSI
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")     # C0 but \t and \n, DEL, C1


def sanitize(text: str) -> str:
    """What a terminal would act on, made inert: escape sequences go, \\r\\n and a lone \\r become \\n,
    every other control character (NUL included) becomes U+FFFD."""
    text = _ESCAPE.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("\ufffd", text)


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
            return sanitize((self.head + self.tail).decode(errors="replace")), False
        head, tail = (sanitize(b.decode(errors="replace")) for b in (self.head, self.tail))
        return f"{head}\n[... {dropped} bytes of output truncated ...]\n{tail}", True


# ----------------------------------------------------------------------------- the disk quota

class _DiskQuota:
    """The workspace against its limits: bytes (apparent size), entries (inodes) and depth. A file counts
    its size or its blocks, whichever is more: a sparse file counts what it claims, since a copy writes it
    out in full. Measured by a walk before and after each command and every QUOTA_CHECK_S while one runs."""

    def __init__(self, path: str, limit: int, max_entries: int, max_depth: int):
        self.path, self.limit, self.max_entries, self.max_depth = path, limit, max_entries, max_depth
        self.used = self.entries = self.depth = 0

    def over(self) -> bool:
        self.used, self.entries, self.depth = _disk_usage(self.path, self.max_entries, self.max_depth)
        return self.used > self.limit or self.entries > self.max_entries or self.depth > self.max_depth

    def why(self) -> str:
        if self.used > self.limit:
            return f"the workspace holds {self.used >> 20} MB (apparent size), over its {self.limit >> 20} MB quota"
        if self.entries > self.max_entries:
            return f"the workspace holds over {self.max_entries:,} entries (files and directories), over its limit"
        return f"the workspace is over {self.max_depth} levels deep, over its limit"


def _open_dir(name: str, dir_fd: int | None) -> int:
    """A directory below dir_fd, never through a link; `chmod 000 dir` must not hide what it holds (commands
    run as our uid, so we may undo it)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, flags, dir_fd=dir_fd)


def _disk_usage(path: str, max_entries: int, max_depth: int) -> tuple[int, int, int]:
    """(apparent bytes, entries, depth) under path, links not followed. Each directory is opened relative to
    its parent (no path-length limit) and only the current branch holds descriptors; the walk stops going
    down once it passes max_entries or max_depth (the verdict is known then)."""
    total = entries = depth = 0
    try:
        stack = [(_open_dir(path, None), None)]   # (directory fd, its subdirectories still to walk)
    except OSError:
        return 0, 0, 0
    while stack:
        fd, pending = stack[-1]
        if pending is None:   # first visit: sizes now, subdirectories for later
            pending = []
            stack[-1] = (fd, pending)
            depth = max(depth, len(stack) - 1)
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        entries += 1
                        try:
                            if e.is_dir(follow_symlinks=False):
                                pending.append(e.name)
                            else:
                                st = e.stat(follow_symlinks=False)
                                total += max(st.st_size, st.st_blocks * 512)
                        except OSError:
                            continue
            except OSError:
                pass
        if pending and len(stack) > max_depth:
            depth = max_depth + 1
        elif pending and entries <= max_entries:
            try:
                stack.append((_open_dir(pending.pop(), fd), None))
            except OSError:
                pass
            continue
        os.close(fd)
        stack.pop()
    return total, entries, depth


# ----------------------------------------------------------------------------- ending what a command left behind

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
        # at that instant cannot slip through (fork fails once its parent has a fatal signal).
        # No capability is needed: commands run as our own uid and cannot change it.
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


# ----------------------------------------------------------------------------- one command

def _no_growth() -> None:
    """preexec_fn of a command run over quota: no file may grow; a write fails ("File too large")
    instead of killing the writer, so `rm` later in the same command still runs. Where Landlock is
    available (Linux >= 5.13), nothing new may be made either (files, directories, links, nodes)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # an ignored signal stays ignored across exec
    SYS_landlock_create_ruleset, SYS_landlock_restrict_self = 444, 446   # the same on every architecture
    MAKE_ANYTHING = 0x1FC0   # LANDLOCK_ACCESS_FS_MAKE_{CHAR,DIR,REG,SOCK,FIFO,BLOCK,SYM}
    attr = struct.pack("Q", MAKE_ANYTHING)   # handled, and no rule allows them: denied everywhere
    ruleset = _LIBC.syscall(SYS_landlock_create_ruleset, attr, len(attr), 0)
    if ruleset >= 0:   # no_new_privs is set already (the helper's own)
        _LIBC.syscall(SYS_landlock_restrict_self, ruleset, 0)
        os.close(ruleset)


def _run_one(req: dict, config: dict, quota: _DiskQuota) -> dict:
    capture = _Capture(req["max_output"])
    # over quota: this command may delete and truncate, but no file may grow (a full fork, rare)
    full = quota.over()
    at_start = (quota.used, quota.entries, quota.depth)
    workdir = config["workdir"]
    mode = os.stat(workdir).st_mode
    if mode & 0o700 != 0o700:   # `chmod 000 .` must not stop every later command from starting
        os.chmod(workdir, mode | 0o700)
    try:
        proc = subprocess.Popen([config["bash"], "-c", req["cmd"]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=workdir, env=req["env"], start_new_session=True,
                                preexec_fn=_no_growth if full else None)
    except (OSError, subprocess.SubprocessError) as e:
        return {"id": req["id"], "exit_code": 126, "output": f"[sandbox: the command could not start: {e}]\n",
                "timed_out": False, "truncated": False}
    fd = proc.stdout.fileno()
    now = time.monotonic()
    deadline, next_quota_check = now + req["timeout"], now + QUOTA_CHECK_S
    stopped = ""   # why the helper ended the command: "" | "timeout" | "quota"
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None   # readable once bash exits
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    while proc.poll() is None:   # the shell's exit ends the command, even if a background job holds the pipe
        now = time.monotonic()
        if now >= deadline:
            stopped = "timeout"
            break
        if now >= next_quota_check:
            next_quota_check = now + QUOTA_CHECK_S
            # over the quota: stopped, unless it started over and has not grown since (it is deleting)
            if quota.over() and (not full or any(now > then for now, then in
                                                 zip((quota.used, quota.entries, quota.depth), at_start))):
                stopped = "quota"
                break
        events = dict(poller.poll(min(deadline - now, 0.05) * 1000))   # without a pidfd, look every 50 ms
        if events.get(fd):
            chunk = os.read(fd, 1 << 20)
            if chunk:
                capture.add(chunk)
            else:   # EOF (`exec >&-` gets here too): keep waiting for the shell, until the deadline
                poller.unregister(fd)
    if stopped:
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
    if stopped == "quota" or quota.over():
        output += (f"\n[sandbox: {quota.why()}{'; the command was stopped' if stopped else ''}; "
                   "until files are deleted no file may grow or be made]\n")
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return {"id": req["id"], "exit_code": 124 if stopped == "timeout" else code, "output": output,
            "timed_out": stopped == "timeout", "truncated": truncated}


# ----------------------------------------------------------------------------- set-up: a new root from the allowlist, then no privileges

_LIBC = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 1, 2, 4, 8, 4096, 16384
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(_LIBC.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


def _mount_setattr(path: str, attr_set: int, attr_clr: int = 0, recursive: bool = True) -> None:
    """Set flags on the mount at path (and every mount below it): Linux >= 5.12."""
    SYS_mount_setattr, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000   # 442 on every architecture
    attr = struct.pack("QQQQ", attr_set, attr_clr, 0, 0)   # struct mount_attr
    _check(_LIBC.syscall(SYS_mount_setattr, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                         attr, len(attr)), f"mount_setattr {path}")


def _bind(fd: int, target: str, is_dir: bool, attrs: int) -> None:
    """Bind what fd (an O_PATH handle) points at onto target, created in the new root, with attrs."""
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    _mount_setattr(target, attrs, 0 if attrs & MOUNT_ATTR_RDONLY else MOUNT_ATTR_RDONLY)


def _build_root(config: dict) -> None:
    """Replace our root by a tmpfs holding only the allowlist (see the module docstring), and enter it.
    Needs a private mount namespace (unshare gives one) and Linux >= 5.12 (mount_setattr)."""
    # open every source first: the workspace, a venv or a mount may sit under /tmp, which the new root hides
    binds = [(inside, os.open(host, os.O_PATH), os.path.isdir(host), writable)
             for inside, host, writable in config["binds"]]
    devices = [(f"/dev/{d}", os.open(f"/dev/{d}", os.O_PATH)) for d in DEVICES if os.path.exists(f"/dev/{d}")]
    root = "/tmp"   # any directory will do as the mount point of the new root
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name, link in config["symlinks"]:
        os.symlink(link, root + name)
    os.makedirs(root + "/proc")
    hide_gid = next(g for g in range(65534, 0, -1) if g not in os.getgroups() and g != os.getgid())
    try:   # hidepid: a command sees its own processes, never the helper (non-dumpable, so not "its own")
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, f"hidepid=invisible,gid={hide_gid}")
    except OSError:   # Linux < 5.8
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, f"hidepid=2,gid={hide_gid}")
    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "size=64k,mode=0755")
    for path, fd in devices:
        _bind(fd, root + path, False, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)   # writes to a device still work
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
        os.symlink(link, f"{root}/dev/{name}")
    for d in ("/dev/shm", "/tmp"):
        os.makedirs(root + d)
        _mount("tmpfs", root + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['tmp_mb']}m,mode=1777")
    for inside, fd, is_dir, writable in sorted(binds):   # parents before children
        attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (0 if writable else MOUNT_ATTR_RDONLY)
        _bind(fd, root + inside, is_dir, attrs)
        os.close(fd)
    for inside, is_dir in config["hide"]:   # covered by an empty read-only tmpfs, or by /dev/null for a file
        target = root + inside
        if not os.path.lexists(target):
            continue
        if is_dir:
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555")
        else:
            _mount("/dev/null", target, None, MS_BIND)
            _mount_setattr(target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, recursive=False)
    for d in ("/dev", ""):   # the skeleton itself goes read-only last (its own mount only)
        _mount_setattr(root + d, MOUNT_ATTR_RDONLY, recursive=False)
    os.chdir(root)
    SYS_pivot_root = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine)
    assert SYS_pivot_root, f"pivot_root: unknown syscall number on {os.uname().machine}"
    _check(_LIBC.syscall(SYS_pivot_root, b".", b"."), "pivot_root")   # the old root now sits on top of the new one
    _check(_LIBC.umount2(b".", 2), "detach the old root")            # MNT_DETACH: and now it is gone
    os.chdir("/")


def _drop_privileges() -> None:
    """No capability is left for us or for anything we exec, none can be regained (no_new_privs:
    setuid binaries and file capabilities are inert), and we are non-dumpable, so a command can
    neither read nor write our /proc entries (our stdin, our memory)."""
    PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 28, 38, 47
    status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    if int(status["CapEff"], 16) & (1 << 8):   # CAP_SETPCAP: empty the bounding set, lock root out of exec's caps
        # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (locked) and NO_CAP_AMBIENT_RAISE, each with its lock bit
        _check(_LIBC.prctl(PR_SET_SECUREBITS, 0b11101111, 0, 0, 0), "PR_SET_SECUREBITS")
        last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last_cap + 1):
            _check(_LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP {cap}")
    _LIBC.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)   # PR_CAP_AMBIENT_CLEAR_ALL (EINVAL before Linux 4.3: none to clear)
    header = struct.pack("Ii", 0x20080522, 0)   # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_LIBC.capset(header, bytes(24)), "capset")   # effective, permitted, inheritable: all empty
    _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    _check(_LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")
    status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    assert all(int(status[k], 16) == 0 for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")), "capabilities left"


# ----------------------------------------------------------------------------- the loop

def serve() -> None:
    """The helper's loop: its config on the first stdin line, then one JSON request per line, one
    JSON reply per stdout line. Lines that are not a request are skipped."""
    config = json.loads(sys.stdin.buffer.readline())
    out = sys.stdout.buffer

    def reply(obj):
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    try:
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
            PR_SET_CHILD_SUBREAPER = 36
            _check(_LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "PR_SET_CHILD_SUBREAPER")
    except OSError as e:
        reply({"ready": False, "stage": "limits", "error": str(e)})
        return
    if config["new_root"]:
        try:
            _build_root(config)
        except OSError as e:
            reply({"ready": False, "stage": "root", "error": str(e)})
            return
    os.chdir(config["workdir"])
    try:
        _drop_privileges()
    except (OSError, AssertionError) as e:
        reply({"ready": False, "stage": "privileges", "error": str(e)})
        return
    # a handler, not SIG_IGN: as PID 1 we must not die of a command's `kill -INT 1`, and handlers
    # (unlike SIG_IGN) are reset at exec, so commands still get the default SIGINT
    signal.signal(signal.SIGINT, lambda *_: None)
    quota = _DiskQuota(config["workdir"], config["disk_bytes"], config["max_files"], config["max_depth"])
    reply({"ready": True})
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            assert isinstance(req, dict) and {"id", "cmd", "timeout", "max_output", "env"} <= req.keys()
        except (ValueError, AssertionError):
            continue   # not a request of ours
        try:
            reply(_run_one(req, config, quota))
        except Exception as e:   # a bad request must not take the helper down
            _end_leftovers(config["mode"])
            reply({"id": req["id"], "error": f"{type(e).__name__}: {e}"})
    _end_leftovers(config["mode"])   # stdin closed: the sandbox is closing (or its owner died)


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: sandbox.py starts this file as `sandbox_helper.py --serve`, its config on stdin")
    serve()
