"""The foundation the environments stand on (envs.py is the menu that builds them).

- `Task`: one task of any environment (its id, group, split, difficulty and payload).
- the memory folder `.agent_memory/` of a shell workspace: `read_memory` / `write_memory` and
  `read_workspace_file`, which read and replace it from the host without following a link the
  agent planted, bounded whatever the folder holds (names escaped by `shown_name`); `copy_tree`,
  the grader's copy of a workspace tree (no link followed, capped by apparent size);
- `Workspace`: the shell workspace of one env instance, a directory and a sandbox on it, with the
  memory rule between tasks (`keep_memory`) and the agent's view of a command (`shell`);
- `WorkspaceEnv`: that part of the env contract (workdir, memory files, keep_memory, clone, close),
  kept once for every shell environment (Codebase and Coding included);
- `ShellTaskEnv`: the step loop that Shop, DeepResearch and AutoResearch share;
- `BM25` and `tokenize`: the search of the two text environments (Shop, DeepResearch).

The contract these serve is in envs.py's docstring.
"""

import math
import os
import re
import stat
import tempfile
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sandbox import MAX_DEPTH, Sandbox, remove_tree, sanitize

MEMORY_DIR = ".agent_memory"


@dataclass
class Task:
    id: str                 # unique across the environment, e.g. "alchemy/w03/t05"
    env: str                # the name make() takes
    difficulty: int         # 0 = easiest; larger is harder (each env documents its scale)
    group: str              # what transfers inside a stream: an Alchemy world, a repository, a shopper
    split: str              # "train" | "test"
    data: dict = field(default_factory=dict)  # env-specific payload; JSON-serialisable


ECHO_CHARS = 500                # how much of a command Workspace.shell echoes back
MEMORY_FILE_BYTES = 64 << 10    # a memory file is read up to this size (the rest is dropped)
MEMORY_TOTAL_BYTES = 256 << 10  # and the whole folder up to this
MEMORY_MAX_FILES = 200          # files read from the folder (in name order; the rest are not memory)
MEMORY_NAME_CHARS = 100         # a longer file or directory name (escaped) is skipped
MEMORY_MAX_DEPTH = 8            # directory levels read below .agent_memory/
COPY_MAX_BYTES = 256 << 20      # a host-side copy of a workspace tree (grading) holds at most this (apparent size)
COPY_MAX_ENTRIES = 100_000      # and at most this many entries


def _open_in(dir_fd: int, name: str, flags: int) -> int:
    """openat() that refuses a symlink as the last component (dir_fd itself was opened the same way)."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def read_workspace_file(workdir, rel: str, max_bytes: int) -> str | None:
    """A regular file of a workspace, read by the host safely: no symlink on the way is followed
    and nothing but a regular file is read (not a FIFO, not /proc/self/environ through a link);
    at most max_bytes. None when there is no such regular file."""
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # the workspace itself is the host's
    try:
        *dirs, name = rel.split("/")
        for d in dirs:
            fd, parent = _open_in(fd, d, os.O_RDONLY | os.O_DIRECTORY), fd
            os.close(parent)
        fd, parent = _open_in(fd, name, os.O_RDONLY | os.O_NONBLOCK), fd   # NONBLOCK: a FIFO must not hang us
        os.close(parent)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, max_bytes).decode(errors="replace")
    except OSError:   # missing, a symlink (ELOOP), not a directory on the way
        return None
    finally:
        os.close(fd)


def shell_echo(command: str) -> str:
    """The first line(s) of Workspace.shell's observation: `$ ` and the command (its first ECHO_CHARS
    characters). What the command printed starts after it (camg_memory.command_output cuts it off)."""
    shown = command if len(command) <= ECHO_CHARS else f"{command[:ECHO_CHARS]}... [{len(command):,} characters]"
    return f"$ {sanitize(shown)}"


def shown_name(name: str) -> str:
    """A file name as text that is safe anywhere (a prompt, a tokenizer, a dict key): bytes that are not
    UTF-8 and every character that is not printable (escapes, newlines) are written as backslash escapes."""
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def read_memory(workdir) -> dict:
    """The memory folder of a workspace as {path relative to .agent_memory/: text}. Only regular files
    and real directories count (symlinks and anything else are skipped, never followed). Bounded
    whatever the folder holds: names are shown escaped (shown_name) and a longer one than
    MEMORY_NAME_CHARS is skipped, at most MEMORY_MAX_FILES files in name order, MEMORY_MAX_DEPTH levels,
    MEMORY_FILE_BYTES a file and MEMORY_TOTAL_BYTES in all."""
    files, budget = {}, MEMORY_TOTAL_BYTES
    try:
        root = os.open(workdir / MEMORY_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:   # missing, or a symlink to somewhere else: no memory
        return {}
    todo = [(root, "", 0)]   # directories still to read: (fd, key prefix, depth); a stack, no recursion
    try:
        while todo:
            dir_fd, prefix, depth = todo.pop()
            try:
                with os.scandir(dir_fd) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                entries = []
            subdirs = []
            for e in entries:
                name = shown_name(e.name)
                if len(files) >= MEMORY_MAX_FILES or budget <= 0:
                    break
                if len(name) > MEMORY_NAME_CHARS:
                    continue
                try:
                    if e.is_dir(follow_symlinks=False) and depth < MEMORY_MAX_DEPTH:
                        subdirs.append((_open_in(dir_fd, e.name, os.O_RDONLY | os.O_DIRECTORY), f"{prefix}{name}/", depth + 1))
                    elif e.is_file(follow_symlinks=False):
                        fd = _open_in(dir_fd, e.name, os.O_RDONLY | os.O_NONBLOCK)
                        try:
                            if stat.S_ISREG(os.fstat(fd).st_mode):   # still the regular file scandir saw
                                data = os.read(fd, min(MEMORY_FILE_BYTES, budget))
                                budget -= len(data)
                                files[prefix + name] = data.decode(errors="replace")
                        finally:
                            os.close(fd)
                except OSError:   # swapped for a link, removed, unreadable: skipped
                    continue
            os.close(dir_fd)
            todo += reversed(subdirs)   # depth first, in name order
    finally:
        for fd, _, _ in todo:
            os.close(fd)
    return files


def write_memory(workdir, files: dict) -> None:
    """Replace the memory folder's contents (ablations: blank it, or give it another task's files).
    Whatever the agent left at .agent_memory (a symlink to a host directory included) is removed,
    never followed."""
    mem = workdir / MEMORY_DIR
    remove_tree(mem)
    mem.mkdir()
    for rel, text in files.items():
        path = (mem / rel).resolve()
        assert path.is_relative_to(mem.resolve()), f"memory file {rel!r} escapes {MEMORY_DIR}/"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, errors="backslashreplace")


def copy_tree(src_root, rel: str, dst, skip=(), links: bool = True) -> str:
    """Copy the directory rel of src_root (a workspace the host owns) to dst, as the agent left it but
    safe for the host: no link is followed on the way to rel or inside it (links are copied as links,
    or left out if not `links`), only regular files, directories and links are copied (a FIFO or a
    device is skipped; modes keep their rwx bits only, xattrs are not copied), names in skip
    are skipped at every level, and the copy is refused past COPY_MAX_BYTES (apparent size: a sparse
    file counts what it claims, since the copy writes it out) or COPY_MAX_ENTRIES, or MAX_DEPTH levels.
    Returns "" or why the tree was refused (a one-line observation)."""
    try:
        fd = os.open(src_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # the workspace itself is the host's
    except OSError as e:
        return f"the workspace cannot be read: {e.strerror}"
    try:
        for part in [p for p in rel.split("/") if p not in ("", ".")]:
            fd, parent = _open_in(fd, part, os.O_RDONLY | os.O_DIRECTORY), fd
            os.close(parent)
    except OSError:
        os.close(fd)
        return f"{rel}/ is not a directory of the workspace (missing, or reached through a link)"
    todo, size, count = [(fd, Path(dst), 0)], 0, 0   # directories still to copy; a stack, no recursion
    try:
        while todo:
            dir_fd, out, depth = todo.pop()
            try:
                out.mkdir(parents=True, exist_ok=True)
                with os.scandir(dir_fd) as it:
                    entries = list(it)
                count += len(entries)
                if count > COPY_MAX_ENTRIES or depth > MAX_DEPTH:
                    return f"refused: {rel}/ holds over {COPY_MAX_ENTRIES:,} entries or {MAX_DEPTH} levels"
                for e in entries:
                    if e.name in skip:
                        continue
                    try:
                        if e.is_symlink():
                            if links:
                                os.symlink(os.readlink(e.name, dir_fd=dir_fd), out / e.name)
                        elif e.is_dir(follow_symlinks=False):
                            todo.append((_open_in(dir_fd, e.name, os.O_RDONLY | os.O_DIRECTORY), out / e.name, depth + 1))
                        elif e.is_file(follow_symlinks=False):
                            size += _copy_file(dir_fd, e.name, out / e.name, COPY_MAX_BYTES - size)
                    except OSError:   # swapped or removed under us: skipped
                        continue
            finally:
                os.close(dir_fd)
    except _TooBig:
        return f"refused: {rel}/ holds over {COPY_MAX_BYTES >> 20} MB (apparent size: a sparse file counts in full)"
    finally:
        for dir_fd, _, _ in todo:
            os.close(dir_fd)
    return ""


class _TooBig(Exception):
    pass


def _copy_file(dir_fd: int, name: str, dst: Path, room: int) -> int:
    """Copy one regular file (never through a link) -> its size; _TooBig when its apparent size passes room."""
    fd = _open_in(dir_fd, name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # swapped for a FIFO since scandir saw it
            return 0
        if st.st_size > room:
            raise _TooBig
        with open(dst, "wb") as out:
            left = st.st_size
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                out.write(chunk)
                left -= len(chunk)
        os.chmod(dst, st.st_mode & 0o755)
        return st.st_size
    finally:
        os.close(fd)


def env_error_observation(exc: Exception) -> str:
    """What the agent sees when the environment fails on its action: the episode ends there, reward 0."""
    return f"The environment failed on this action ({type(exc).__name__}: {exc}); the episode ends with reward 0."


class Workspace:
    """The shell workspace of one env instance: a directory holding the `.agent_memory/` folder, and a
    sandbox whose one writable host directory it is.

    The directory is made on the first use of `workdir` (listing tasks needs no shell) and removed by
    close() or when the Workspace is garbage-collected. The sandbox starts with the first command, or
    with `start(env)` (which first ends the one running, and every process the last task left there).
    `clear()` ends the sandbox and empties the directory for the next task, then applies the memory
    rule, the same in every shell environment: with keep_memory the memory folder's regular files carry
    over (a stream's file memory; nothing else does: not the sandbox's /tmp, not a mode bit or an
    xattr), without it the task starts blank; either way, files given to set_memory_files() since the
    last clear() are what the task starts with (the ablations: blank, shuffled, continuation only).
    `shell(cmd)` gives the agent's view of a command: `$ cmd` (its first ECHO_CHARS characters), its
    output capped at `obs_chars` (the head, or the head and tail halves if `keep_tail`), then
    `(exit N)` or `(timed out)` (`(timed out after Ns)` if `say_timeout`); `run(cmd)` the bare
    RunResult. mounts: {path inside: host path} shown read-only in the sandbox, hide: host paths it shows
    empty (sandbox.Sandbox)."""

    def __init__(self, timeout: float, obs_chars: int = 2000, keep_tail: bool = False, say_timeout: bool = False,
                 keep_memory: bool = True, mounts: dict | None = None, hide=()):
        self.timeout, self.obs_chars, self.keep_tail, self.say_timeout = timeout, obs_chars, keep_tail, say_timeout
        self.keep_memory, self.mounts, self.hide = keep_memory, dict(mounts or {}), tuple(hide)
        self.sandbox, self._workdir, self._remove_workdir, self._memory_given = None, None, None, False

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="workspace-")).resolve()
            (self._workdir / MEMORY_DIR).mkdir()
            self._remove_workdir = weakref.finalize(self, remove_tree, self._workdir)
        return self._workdir

    def memory_files(self) -> dict:
        return read_memory(self.workdir)

    def set_memory_files(self, files: dict) -> None:
        write_memory(self.workdir, files)
        self._memory_given = True

    def clear(self, memory: dict | None = None) -> None:
        """A fresh workspace for the next task: the sandbox ends (its private /tmp and /dev/shm with it)
        and everything goes but the memory folder's regular files, copied as new files (copy_tree: no
        link, FIFO, xattr or mode bit but rwx of the agent's survives, at most COPY_MAX_BYTES); the root
        gets its own mode back and loses its xattrs. The memory folder then holds `memory` if given,
        else what the memory rule (above) says."""
        self.stop()
        workdir = self.workdir
        if memory is None and not (self.keep_memory or self._memory_given):
            memory = {}
        os.chmod(workdir, 0o700)
        try:
            for attr in os.listxattr(workdir):
                os.removexattr(workdir, attr)
        except OSError:   # a filesystem without xattrs
            pass
        kept = Path(tempfile.mkdtemp(prefix="workspace-memory-", dir=workdir.parent)) / MEMORY_DIR
        try:
            if memory is None and copy_tree(workdir, MEMORY_DIR, kept, links=False):   # refused: over the caps
                memory = read_memory(workdir)
            remove_tree(*workdir.iterdir())
            if memory is None:   # the folder whole, as fresh files and directories
                os.rename(kept, workdir / MEMORY_DIR)
            else:
                write_memory(workdir, memory)
        finally:
            remove_tree(kept.parent)
        self._memory_given = False

    def start(self, env: dict | None = None) -> None:
        """A fresh sandbox on the workspace now, with env (extra environment variables) for its commands."""
        self.stop()
        self.sandbox = Sandbox(timeout=self.timeout, workdir=self.workdir, env=env, mounts=self.mounts, hide=self.hide)

    def run(self, command: str):
        """Run a command in the sandbox (started if need be) -> sandbox.RunResult."""
        if self.sandbox is None:
            self.start()
        return self.sandbox.run(command)   # its output is sanitised; a NUL or over-long command gets an explanation

    def shell(self, command: str) -> str:
        r = self.run(command)
        out, n = r.output, self.obs_chars
        if len(out) > n and self.keep_tail:  # a program's last lines (its score, its error) matter too
            out = out[:n // 2] + "\n...[truncated]...\n" + out[-(n // 2):]
        elif len(out) > n:
            out = out[:n] + "\n...[truncated]"
        if r.timed_out:
            status = f"timed out after {self.timeout:.0f}s" if self.say_timeout else "timed out"
        else:
            status = f"exit {r.exit_code}"
        return f"{shell_echo(command)}\n{out.rstrip()}\n({status})"

    def stop(self) -> None:
        """End the sandbox and every process it started; the files stay."""
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def close(self) -> None:
        self.stop()
        if self._remove_workdir is not None:
            self._remove_workdir()
        self._workdir, self._remove_workdir = None, None


class WorkspaceEnv:
    """The part of the env contract every shell environment keeps through its Workspace
    (self.workspace): env.workdir, the memory folder, keep_memory (the memory rule above), clone()
    (the same configuration, self.config = its constructor's arguments, and the same memory rule)
    and close()."""

    @property
    def workdir(self) -> Path:
        return self.workspace.workdir

    @property
    def keep_memory(self) -> bool:
        return self.workspace.keep_memory

    @keep_memory.setter
    def keep_memory(self, keep: bool) -> None:
        self.workspace.keep_memory = bool(keep)

    def memory_files(self) -> dict:
        return self.workspace.memory_files()

    def set_memory_files(self, files: dict) -> None:
        self.workspace.set_memory_files(files)

    def clone(self):
        twin = type(self)(**self.config)   # the same configuration (worlds and catalogues are cached)
        twin.keep_memory = self.keep_memory
        return twin

    def close(self) -> None:
        self.workspace.close()


class ShellTaskEnv(WorkspaceEnv):
    """The episode loop CAMG's Shop, DeepResearch and AutoResearch share. Each step is either
    `shell: <command>` (run in the task's Workspace) or one of the env's own actions, handled by its
    `_act(action)`, which returns an observation, or (observation, reward) for the action that ends the
    task (buy, answer, evaluate). The episode also ends after max_steps actions.
    A subclass sets self.task, self.done, self.steps and self.info (with num_shell and num_invalid) in
    reset(), and names its action forms (VALID_FORMS) and what running out means (OUT_OF_ACTIONS); its
    constructor sets self.config (its arguments, for clone), self._tasks and self.workspace (whose
    keep_memory defaults to True: notes carry from task to task)."""
    VALID_FORMS = "Valid actions: shell: <command>"
    OUT_OF_ACTIONS = "nothing submitted"

    def tasks(self, split: str) -> list[Task]:
        assert split in self._tasks, f"split must be 'train' or 'test', got {split!r}"
        return list(self._tasks[split])

    def memory_line(self) -> str:
        """How the first observation of a task names the memory folder."""
        return f"Memory folder: {MEMORY_DIR}/ ({'kept across tasks' if self.keep_memory else 'lasts until this task ends'})"

    # --- the episode

    def step(self, action: str):
        assert self.task is not None, "call reset(task) before step()"
        if self.done:
            return "The episode is over; call reset().", 0.0, True
        self.steps += 1
        self.info["steps"] = self.steps
        action = (action or "").strip()
        shell = re.match(r"(?:shell|shell_command)\s*:\s*(.*)$", action, re.S | re.I)
        try:
            obs = self._shell(shell.group(1).strip()) if shell else self._act(action)
        except Exception as exc:  # noqa: BLE001 - no action may make step() raise (envs.py's contract)
            self.done = True
            self.info["env_error"] = f"{type(exc).__name__}: {exc}"
            return env_error_observation(exc), 0.0, True
        reward = 0.0
        if isinstance(obs, tuple):  # the task's last action: (observation, reward)
            obs, reward = obs
            self.done = True
        if not self.done and self.steps >= self.max_steps:
            self.done = True
            obs += f"\nOut of actions ({self.max_steps}); {self.OUT_OF_ACTIONS}, reward 0."
        return obs, reward, self.done

    def _shell(self, command: str) -> str:
        if not command:
            return self._invalid("Empty shell command.")
        self.info["num_shell"] += 1
        return self.workspace.shell(command)

    def _invalid(self, why: str) -> str:
        self.info["num_invalid"] += 1
        return f"{why}\n{self.VALID_FORMS}"

    def _act(self, action: str):
        raise NotImplementedError


# --- search for the text environments: Okapi BM25 with an inverted index of numpy arrays

def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def whole_word(text: str) -> str:
    """A regex for text as a whole word (or phrase): no letter, digit, _ or - right before or after it.
    The relay facts (each env's relay_fact) are written with it."""
    return rf"(?<![\w-]){re.escape(text)}(?![\w-])"


class BM25:
    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        toks = [tokenize(d) for d in docs]
        lengths = np.array([len(t) for t in toks], dtype=np.float64)       # [N]
        norm = k1 * (1 - b + b * lengths / max(lengths.mean(), 1.0))        # [N] length penalty
        postings: dict[str, list] = {}
        for i, t in enumerate(toks):
            for term, tf in Counter(t).items():
                postings.setdefault(term, []).append((i, tf))
        self.num_docs = len(docs)
        self.index = {}  # term -> (doc ids [n], per-doc weight [n]); query time is one add per term
        for term, pl in postings.items():
            ids = np.array([p[0] for p in pl])
            tf = np.array([p[1] for p in pl], dtype=np.float64)
            idf = math.log(1 + (self.num_docs - len(ids) + 0.5) / (len(ids) + 0.5))
            self.index[term] = (ids, idf * tf * (k1 + 1) / (tf + norm[ids]))

    def search(self, query: str, k: int) -> list[int]:
        """The ids of the k best documents with any query term, best first (ties: document order)."""
        scores = np.zeros(self.num_docs)
        for term in set(tokenize(query)):
            if term in self.index:
                ids, w = self.index[term]
                scores[ids] += w
        hits = np.flatnonzero(scores > 0)
        return hits[np.argsort(-scores[hits], kind="stable")][:k].tolist()
