"""Shell sandboxes: a workspace per episode, where model-written commands cannot hurt the host.

During RL an agent's only action is a shell command (CAMG's `shell_command`; RIME's fenced bash
block), and millions of them run unattended. A policy optimises against every hole it can reach,
so besides runaway commands (endless loops, `yes`, fork bombs, daemons that `setsid` away, huge
files) a `Sandbox` must also hold against deliberate ones: reading the environment's answers,
undoing the limits, forging what the host reads. It runs each command so that it ends on time,
leaves nothing behind, and the host and the other episodes lose nothing:

    with Sandbox(timeout=30.0) as sb:          # a fresh temporary workspace; Sandbox(workdir=p) reuses p
        r = sb.run("ls -la")                   # -> RunResult(exit_code, output, timed_out, truncated)
        sb.write_file("notes.md", "...")       # file tools refuse paths that resolve outside sb.workdir
    # close() ended every process the sandbox started and removed the temporary workspace

How it works. Each sandbox starts one small helper process (sandbox_helper.py, its config on
stdin) and sends it commands over a pipe; the helper runs `bash -c CMD` for each one and replies
with the result. Starting the helper once keeps a command's cost close to a bare `subprocess.run`
(see `python speed.py sandbox`): all the expensive set-up happens once per sandbox. This file is
the host's side (probing the machine, the allowlist, cgroups, the `Sandbox` that talks to the
helper); sandbox_helper.py is what runs inside the namespaces (the set-up below, the command loop).

What a command gets, in isolation "namespace" (root) or "userns" (an ordinary user, in an
unprivileged user namespace):
- no privileges: the helper drops every capability (effective, permitted, inheritable, ambient and
  the bounding set, with securebits locked) and sets no_new_privs before it runs anything, so
  commands, root or not, hold none and gain none (setuid binaries and file capabilities are inert).
  mount, umount, remount and cgroup writes fail; a user namespace made inside gives capabilities
  only over mounts the kernel keeps locked (read-only stays read-only, nothing can be uncovered);
- a filesystem built from an allowlist: a new root (a read-only tmpfs, entered with pivot_root)
  holding the system directories (/usr, /bin, /lib*, /sbin, /etc), the running interpreter (its
  prefixes, the real directory of its executable and its site-packages, each at its own path:
  a venv under /tmp works, and one reached through a link shows at the link's path too; pyenv shows
  its one version under an otherwise empty $HOME), `ro_paths` at their own path, `mounts` at neutral
  paths (all read-only), `hide` paths shown empty, a fresh /proc, a minimal /dev, private /tmp and
  /dev/shm tmpfs, and the workspace (the only writable host directory, at its own path). Nothing
  else of the host is there: not the project's source, data or caches, not $HOME, not the host's
  /tmp. /proc/self/mountinfo names each mount's host path, so a mount's host path must not tell
  where anything else lies;
- an unreachable helper: it is PID 1 of its own PID namespace and non-dumpable, and /proc hides
  it (hidepid), so a command cannot read its command line or write to its stdin; a stray line on
  that pipe is skipped all the same;
- no network: a network namespace with only a downed loopback, unless network=True; a private IPC
  namespace (no SysV shared memory or message queue outlives the sandbox);
- limits: a timeout (exit code 124; reached even when a command closed its output), process and
  memory limits through a cgroup (v1 or v2, needs root) when one can be made, else RLIMIT_NPROC
  for a non-root user or the per-namespace `kernel.pid_max` (Linux >= 6.14) for root, and
  RLIMIT_AS for memory; RLIMIT_FSIZE (one file), RLIMIT_CPU (CPU time per process), a quota on
  the workspace: `disk_mb` of apparent size (a sparse file counts what it claims), `max_files`
  entries and MAX_DEPTH levels, measured every sandbox_helper.QUOTA_CHECK_S and before and after
  each command: over it, the command is stopped and later commands may delete but grow no file (and,
  with Landlock, make none) until it is back under; and size-limited tmpfs for /tmp and /dev/shm;
- output capped (head and tail) and sanitised: terminal escape sequences removed, \r made \n,
  NUL and other control characters replaced; a command with a NUL byte or over MAX_COMMAND_BYTES
  is not run (exit code 126, the output says why), and neither is one that cannot start (126): no
  command makes run() raise (`chmod 000 .` is undone before the next command).
As PID 1, the helper ends every other process of its namespace with one `kill(-1, SIGKILL)` after
each command, so `setsid`, double forks and ignored SIGTERM do not help a process to survive.
`sb.mode` and `sb.describe()` say what is active.

Where the machine allows no namespaces, isolation "subreaper": the helper marks itself a child
subreaper, so orphaned descendants are re-parented to it, and it SIGKILLs its whole descendant
tree. Commands still hold no capabilities and the limits hold, but the host filesystem is visible
and writable where this user may write, and the network is reachable (a warning says so). If the
allowlisted root cannot be built (Linux < 5.12: no mount_setattr), a warning says so and commands
see the host's filesystem.

What it does not promise: it is not a VM. A kernel exploit, a side channel (timing, shared CPU
caches) or a denial of service the kernel does not account to the sandbox (say, filling the disk
inside one quota interval) is outside what it stops; the quota is checked, not enforced by the
filesystem. Read-only things in the allowlist (the interpreter, /etc, `mounts`) are readable by
design: never mount anything that holds an answer. Use gVisor or a VM for a stronger boundary.

Semantics worth knowing:
- every run() is a fresh `bash -c` started in the workspace: the working directory, shell
  variables and `cd` do not carry over between calls; files do;
- when the command's shell exits, anything it left running (background jobs, daemons) is ended:
  a run() is self-contained;
- stdin is closed; stdout and stderr are merged; the environment is only PATH (the interpreter's
  bin directory first, so `python` is the running interpreter), HOME (= the workspace),
  LANG=C.UTF-8 and the variables passed in `env`;
- a timeout gives exit_code 124 (like coreutils `timeout`); death by signal N gives 128 + N;
- the workspace directory itself is bind-mounted once: change what is inside it,
  never delete and recreate the directory while the sandbox is open.
"""

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

# what runs inside a sandbox; sanitize is re-exported (workspace.py reads files through it)
from sandbox_helper import sanitize  # noqa: F401

HELPER = str(Path(__file__).resolve().with_name("sandbox_helper.py"))   # its script, started with -I -S
GRACE_S = 10.0  # extra wait for the helper's reply beyond a command's timeout before declaring it dead
MAX_COMMAND_BYTES = 100_000   # a longer command is refused (the kernel caps one exec argument at 128 KiB)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")   # as the host has them
MAX_DEPTH = 128   # directory levels a workspace may hold (deeper trees break host walks; they count as over quota)


@dataclass
class RunResult:
    exit_code: int     # the shell's exit status; 124 on timeout; 128 + N if killed by signal N
    output: str        # stdout and stderr merged, capped (head + marker + tail)
    timed_out: bool
    truncated: bool    # True when output bytes beyond max_output were dropped from the middle


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


@functools.lru_cache(maxsize=None)
def interpreter_paths() -> tuple[str, ...]:
    """The running interpreter as a sandbox shows it: its prefixes, the real directory of its
    executable and its site-packages, wherever they live (a venv under /tmp, pyenv under $HOME)."""
    import site
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
             *site.getsitepackages()]
    user_site = site.getusersitepackages()
    if user_site in sys.path:   # `pip install --user` packages, when this interpreter uses them
        paths.append(user_site)
    return tuple(p for p in paths if os.path.isdir(p))


def _allowlist(ro_paths, mounts: list) -> tuple[list, list]:
    """(binds, symlinks) of a sandbox's new root, the workspace aside. binds: (path inside, host
    path, writable), with every same-path bind resolved and those already inside another one
    dropped; symlinks: top-level system links such as /bin -> usr/bin, recreated as on the host."""
    symlinks, same_path = [], []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            symlinks.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            same_path.append(d)
    same_path += [os.path.realpath(p) for p in (*interpreter_paths(), *ro_paths)]
    # an interpreter reached through a link (a venv linked from the temp dir) is shown at the link's path too,
    # since sys.executable and sys.prefix name that path
    linked = {os.path.abspath(p): os.path.realpath(p) for p in interpreter_paths()
              if os.path.abspath(p) != os.path.realpath(p)}
    kept, binds = [], {}
    for p in sorted(set(same_path) | set(linked)):   # sorted: a parent comes before what it contains
        if not any(p.startswith(q.rstrip("/") + "/") for q in kept):
            kept.append(p)
            binds[p] = linked.get(p, p)
    for inside, _ in mounts:   # a mount point inside a read-only bind could not be made
        under = [q for q in kept if inside == q or inside.startswith(q.rstrip("/") + "/")]
        assert not under, f"mounts: {inside!r} lies inside {under[0]}, which a sandbox shows already; choose a neutral path such as /opt/deps"
    return [(p, binds[p], False) for p in kept] + [(inside, host, False) for inside, host in mounts], symlinks


def _check_mounts(mounts: dict) -> list[tuple[str, str]]:
    """Sandbox(mounts=...) as (path inside, resolved host path) pairs, or a one-line error."""
    checked = []
    for inside, host in mounts.items():
        assert isinstance(inside, str) and os.path.isabs(inside), f"mounts: the path inside must be absolute, got {inside!r}"
        inside = os.path.normpath(inside)
        assert inside not in ("/", "/tmp") and not inside.startswith(("/proc", "/dev")), \
            f"mounts: {inside!r} would cover what every sandbox needs; choose a neutral path such as /opt/deps"
        assert os.path.exists(host), f"mounts: host path {str(host)!r} (for {inside}) does not exist"
        checked.append((inside, os.path.realpath(host)))
    return checked


# ----------------------------------------------------------------------------- the sandbox

class Sandbox:
    """A workspace plus a helper process that runs shell commands in it under limits."""

    def __init__(self, timeout: float = 30.0, workdir=None, network: bool = False, env: dict | None = None,
                 memory_mb: int = 4096, max_output: int = 32768, max_procs: int = 256,
                 max_file_mb: int = 512, cpu_seconds: int = 600, disk_mb: int = 1024, max_files: int = 100_000,
                 protect_host: bool = True, isolation: str = "auto", ro_paths=(), mounts: dict | None = None,
                 hide=()):
        """timeout: default seconds per run(); workdir: reuse this directory (kept on close) instead
        of a fresh temporary one (removed on close); network: allow network access; env: extra
        environment variables; memory_mb: memory of all processes together (per process under the
        RLIMIT_AS fallback); max_output: bytes of output kept (half head, half tail); max_procs:
        processes+threads at once; max_file_mb: largest file a command may write (and the size of
        the private /tmp); cpu_seconds: CPU time per process; disk_mb: quota of the workspace (apparent
        size); max_files: entries (files, directories, links) the workspace may hold;
        protect_host: build the filesystem from the allowlist (namespace modes only); isolation:
        "auto", or force "namespace" / "userns" / "subreaper"; ro_paths: more host paths to show
        read-only at their own path; mounts: {path inside: host path} to show read-only at a neutral
        path, e.g. {"/opt/deps": cache_dir} (then put /opt/deps on PYTHONPATH through env); hide: host
        paths inside the allowlist to show empty (a directory) or as /dev/null (a file), e.g. vendored
        copies of what a task asks to write."""
        assert timeout > 0, f"timeout must be positive seconds, got {timeout}"
        assert max_output >= 64, f"max_output must be at least 64 bytes, got {max_output}"
        assert max_procs >= 4, f"max_procs must be at least 4 (the helper, bash and a pipe), got {max_procs}"
        assert memory_mb >= 64 and max_file_mb >= 1 and cpu_seconds >= 1 and disk_mb >= 1 and max_files >= 16, \
            "memory_mb, max_file_mb, cpu_seconds, disk_mb, max_files too small"
        env = dict(env or {})
        for k, v in env.items():
            assert isinstance(k, str) and isinstance(v, str) and "=" not in k, f"env must map str to str, got {k!r}: {v!r}"
        if isolation == "auto":
            isolation = isolation_mode()
        assert isolation in ("namespace", "userns", "subreaper"), f"unknown isolation {isolation!r}"
        self.timeout, self.network, self.max_output, self.mode = float(timeout), network, max_output, isolation
        self.protect_host = protect_host and isolation != "subreaper"   # needs a mount namespace

        binds, symlinks = _allowlist(ro_paths, _check_mounts(dict(mounts or {})))

        self._owns_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="sandbox-") if workdir is None else workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        assert self.workdir.is_dir(), f"workdir {self.workdir} is not a directory"
        binds.append((str(self.workdir), str(self.workdir), True))   # the one writable host directory

        # limits: a cgroup where we may create one, else the best rlimit-style guard for this user
        name = f"sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._cgroups, cgroup_kind = _make_cgroups(name, max_procs, memory_mb) if os.geteuid() == 0 else ([], "")
        rlimits = {"RLIMIT_FSIZE": min(max_file_mb, disk_mb) << 20, "RLIMIT_CORE": 0}
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
        self.limits["disk"] = f"{disk_mb} MB workspace quota, {max_files:,} entries, {MAX_DEPTH} levels"
        if isolation == "subreaper" and (not network or protect_host):
            warnings.warn("sandbox: no namespaces on this machine; commands can reach the network and read and "
                          "write anywhere this user may (isolation='subreaper')")

        # PATH: the running interpreter first, so that `python` in a command is this one (pyenv's
        # shims live in $HOME, which a sandbox does not show)
        self._env = {"PATH": os.pathsep.join([os.path.realpath(os.path.dirname(sys.executable)),
                                              "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
                     "HOME": str(self.workdir), "LANG": "C.UTF-8", **env}
        bash = shutil.which("bash", path=self._env["PATH"])
        assert bash, f"bash not found on PATH={self._env['PATH']}"
        self._config = {"workdir": str(self.workdir), "mode": isolation, "rlimits": rlimits, "bash": bash,
                        "cpu_seconds": cpu_seconds, "cgroups": [str(d) for d in self._cgroups], "pid_max": pid_max,
                        "new_root": self.protect_host, "tmp_mb": max_file_mb, "disk_bytes": disk_mb << 20,
                        "max_files": max_files, "max_depth": MAX_DEPTH, "binds": binds, "symlinks": symlinks,
                        "hide": [(os.path.realpath(p), os.path.isdir(p)) for p in hide if os.path.lexists(p)]}
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
        # the config travels on stdin, and the helper gets no host environment
        argv = [sys.executable, "-I", "-S", HELPER, "--serve"]
        if self.mode in ("namespace", "userns"):
            flags = ["--user", "--map-root-user"] if self.mode == "userns" else []
            flags += ["--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"] + ([] if self.network else ["--net"])
            argv = ["unshare", *flags, *argv]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=self.workdir,
                                env={"PATH": self._env["PATH"], "LANG": "C.UTF-8"}, start_new_session=True)
        self._proc_box[0] = proc
        self._proc, self._buf = proc, b""
        try:
            proc.stdin.write(json.dumps(self._config).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready = self._read_line(deadline=time.monotonic() + 30)
        if ready and ready.get("stage") == "root":
            warnings.warn(f"sandbox: cannot build the allowlisted filesystem ({ready['error']}); "
                          "commands see the host's and may write where this user may")
            _stop_helper(proc)
            self._config["new_root"] = self.protect_host = False
            return self._start_helper()
        if ready != {"ready": True}:
            _stop_helper(proc)
            self._proc_box[0] = self._proc = None
            why = ready.get("error") if ready else "it exited; see its stderr above"
            raise RuntimeError(f"sandbox helper failed to start: {why}")

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
        """Run `bash -c cmd` in the workspace (fresh shell, cwd = workspace) and return its result.
        A command with a NUL byte or longer than MAX_COMMAND_BYTES is not run: exit code 126 and
        an output saying why."""
        if not isinstance(cmd, str):
            raise ValueError(f"cmd must be a str, got {type(cmd).__name__}")
        if "\0" in cmd:
            return RunResult(126, "[sandbox: the command contains a NUL byte; it was not run]\n", False, False)
        try:
            size = len(cmd.encode())
        except UnicodeEncodeError:
            return RunResult(126, "[sandbox: the command is not valid text (a lone surrogate); it was not run]\n", False, False)
        if size > MAX_COMMAND_BYTES:
            return RunResult(126, f"[sandbox: the command is {size:,} bytes, over the {MAX_COMMAND_BYTES:,}-byte limit; "
                                  f"it was not run. Write long content to a file in several commands.]\n", False, False)
        timeout = self.timeout if timeout is None else float(timeout)
        assert timeout > 0, f"timeout must be positive seconds, got {timeout}"
        with self._lock:
            assert self._proc is not None, "this sandbox is closed"
            rid = uuid.uuid4().hex
            request = {"id": rid, "cmd": cmd, "timeout": timeout, "max_output": self.max_output, "env": self._env}
            # (a command cannot reach the helper's stdin; the id guards against a stray line all the same)
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
            if "error" in reply:   # the helper survived; what the command did must not make run() raise
                return RunResult(126, f"[sandbox: the command could not run: {reply['error']}]\n", False, False)
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

    # ------------------------------------------------------------------------- lifetime

    def describe(self) -> str:
        net = "on" if self.network else ("off" if self.mode != "subreaper" else "NOT isolated")
        files = "allowlist (system, interpreter, mounts) + workspace, private /tmp" if self.protect_host else "the host's"
        return (f"isolation={self.mode}, procs: {self.limits['procs']}, memory: {self.limits['memory']}, "
                f"disk: {self.limits['disk']}, network: {net}, filesystem: {files}, no capabilities")

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
        remove_tree(temp_workdir)


def remove_tree(*paths) -> None:
    """Remove what commands left at paths, whatever it is: never through a link, at any depth (Python's
    rmtree recurses and fails past ~1,000 levels), whatever the modes (`chmod 000` on a directory is
    undone first). GNU rm walks with directory descriptors, so no path length limit applies."""
    paths = [str(p) for p in paths if os.path.lexists(p)]
    if not paths:
        return
    rm = ["rm", "-rf", "--one-file-system", "--", *paths]
    if subprocess.run(rm, stdin=subprocess.DEVNULL, capture_output=True).returncode != 0:
        # -R changes no link and follows none (GNU chmod's default -P); a top-level link is left alone
        real = [p for p in paths if not os.path.islink(p)]
        subprocess.run(["chmod", "-R", "u+rwx", "--", *real], stdin=subprocess.DEVNULL, capture_output=True)
        subprocess.run(rm, stdin=subprocess.DEVNULL, capture_output=True)


@functools.lru_cache(maxsize=None)
def _pid_max_is_per_namespace() -> bool:
    """Linux >= 6.14 lets PID 1 of a namespace set its own kernel.pid_max."""
    probe = "echo 400 > /proc/sys/kernel/pid_max && test $(cat /proc/sys/kernel/pid_max) = 400"
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", probe]
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
