"""CAMG's memory: what a task starts with (the memory modes between tasks, the first turn's note) and
the CONTINUATION.md reset protocol inside an episode, as camg.py runs and records it.

Between tasks (`apply_memory_mode`, `memory_note`): full keeps `.agent_memory/`, blank empties it,
continuation keeps only CONTINUATION.md, shuffle swaps in another stream's folder (the ablations);
a task's first user turn lists the saved files' paths, never their contents (camg_eval: in every mode the
words of the training's mode, the first turn the policy trained on). One mode acts inside the
episode: wiped is the training's mode between tasks and deletes CONTINUATION.md at every context reset (`ProtocolEnv(wipe_at_reset=True)`), so a success that needs the file's content fails.

Inside an episode: rollout.py resets a context when the next turn would not fit in the context budget: it first asks
the policy to save its progress to `.agent_memory/CONTINUATION.md` (one sampled, trained action),
then opens a fresh context that holds the task and the memory file paths only. This module adds what
the protocol needs to be measured and learned:

- `ProtocolEnv` wraps an environment for one episode at a time. It bounds CONTINUATION.md to
  MAX_CHARS characters after every action (a longer file is cut, and the observation says so) and
  records, at every reset, the file's state (written in this episode / empty / missing; a file left
  by an earlier task and not rewritten is "stale"), and whether an action of the next context read it
  back ("read" = a shell command that prints the file, e.g. `cat .agent_memory/CONTINUATION.md`).
  A reset is seen as the call rollout.py makes to `memory_files()` to list the paths for the fresh
  context (nothing else asks during an episode: the tests check the count against `num_resets`).
- `reset_outcomes` turns the record into one dict per reset: {"before": "written" | "empty" |
  "missing" | "stale", "read": bool}; camg.py logs them per episode.
- `relay_progress`: how far a relay episode carried its fact across the reset (below), from what the
  episode did: its actions and observations (rollout's Episode, with the turn of each reset) and the
  memory files it had written at each reset (`ProtocolEnv.notes_at_reset`).
- `memory_action_turns` marks the turns whose action writes or reads a memory file (the
  `--mask-memory-actions` ablation puts loss mask 0 on their tokens).
- `CarryingAgent` and `run_reference`: an environment's reference policy run through the same
  loop as the model, knowing only its current context: at a reset it loses everything but what it
  wrote to CONTINUATION.md (carry=True: it writes its notes when asked and `cat`s them back first
  thing after the reset; carry=False: it starts over from the task). These are the warm start's
  trajectories, and the tests' proof that a relay task needs the file.

Relay stages. A relay task shows a fact once (Shop's shopping note, DeepResearch's memo, AutoResearch's
lab note, Coding's CI report) that is needed after a context reset. Each env's `relay_fact(task)` says
what the fact is: {"source": text only the shown note holds, "values": regexes that must all match
where the fact is written}; None for a task of another family. An episode stops at the first of:
  not_opened   no observation holds the source (the note was never shown);
  no_reset     no context reset came after it (nothing had to be carried);
  not_written  at that reset, no memory file written in this episode holds every value;
  not_read     no later command on the memory files (naming .agent_memory or CONTINUATION.md)
               printed the values (its output, not its echo);
  not_used     the later task actions (those not on memory files) do not name every value;
  used         all passed (the task may still have failed: camg_eval's "used_wrong").
The values are searched as regexes, case-insensitively, wherever they stand in the text: a file that
holds them by chance (a copied item page listing every size) counts as written.

Design choice: the protocol is *recorded, not enforced*. Writing and reading the file is rewarded
only through the task (an episode that loses a fact at a reset fails its task), as in the CAMG
paper's memory actions, which share the task return; nothing refuses an action that skips the read.
"""
from __future__ import annotations

import re

from rollout import ACTOR_SYSTEM, CONTINUATION_PATH, ChatFormat, agent_loop, list_paths
from workspace import shell_echo

FILE = CONTINUATION_PATH.split("/", 1)[1]      # "CONTINUATION.md" inside .agent_memory/
MEMORY_MODES = ("full", "blank", "shuffle", "continuation", "wiped")
NO_MEMORY, KEPT = "No saved memory files yet.", " Notes you write under .agent_memory/ are kept for later tasks."
MAX_CHARS = 1200                               # the file's bound: enough for a task's facts, not a transcript
MEMORY_NOTE_CHARS = 1600                       # memory_note's bound, whatever the folder holds
OUTCOMES = ("written", "empty", "missing", "stale")
RELAY_PROGRESS = ("not_opened", "no_reset", "not_written", "not_read", "not_used", "used")   # relay_progress

# a shell command that prints the file (not one that only redirects into it)
_READ_RE = re.compile(r"\b(cat|head|tail|nl|less|more|sed|awk|grep)\b[^|;&>]*CONTINUATION\.md")
_MEMORY_RE = re.compile(r"\.agent_memory|CONTINUATION\.md")


def apply_memory_mode(env_list: list, mode: str) -> None:
    """Before each env's next task. full: keep; blank: empty the saved memory; continuation: keep only
    CONTINUATION.md; shuffle: env i gets the memory folder of env i+1 (another stream's notes)."""
    if mode == "blank":
        for e in env_list:
            e.set_memory_files({})
    elif mode == "continuation":
        for e in env_list:
            e.set_memory_files({k: v for k, v in e.memory_files().items() if k == FILE})
    elif mode == "shuffle":
        assert len(env_list) >= 2, "memory mode 'shuffle' needs at least 2 streams of the same environment"
        snaps = [e.memory_files() for e in env_list]
        for i, e in enumerate(env_list):
            e.set_memory_files(snaps[(i + 1) % len(snaps)])


def memory_note(env, kept: bool = True) -> str:
    """The memory part of a task's first user turn: the saved files' *paths*, never their contents (as
    after a context reset); the policy reads what it needs with a shell action. kept: whether the
    folder is kept for later tasks (memory mode full / continuation / shuffle) or emptied (blank)."""
    paths = [f".agent_memory/{p}" for p in sorted(env.memory_files())]
    if not paths:
        return NO_MEMORY + (KEPT if kept else "")
    head = "Saved memory files (read them with a shell action, e.g. cat PATH): "
    return head + list_paths(paths, MEMORY_NOTE_CHARS - len(head))


# ----------------------------------------------------------------------------- the reset protocol

def _shell(action: str) -> str | None:
    m = re.match(r"\s*(?:shell|shell_command)\s*:\s*(.*)$", action or "", re.S | re.I)
    return m.group(1) if m else None


def reads_continuation(action: str) -> bool:
    cmd = _shell(action)
    return cmd is not None and bool(_READ_RE.search(cmd))


def is_memory_action(action: str) -> bool:
    """A shell action that writes or reads a memory file (CONTINUATION.md or anything in .agent_memory/)."""
    cmd = _shell(action)
    return cmd is not None and bool(_MEMORY_RE.search(cmd))


class ProtocolEnv:
    """An environment with the reset protocol's bound and record (see the module docstring). Every
    attribute it does not define is the wrapped environment's."""

    def __init__(self, env, max_chars: int = MAX_CHARS, wipe_at_reset: bool = False):
        self.env, self.max_chars, self.wipe_at_reset = env, max_chars, wipe_at_reset
        self.start, self.wrote, self.resets, self.reads = None, False, [], []
        self.files_at_start, self.notes_at_reset = {}, []   # the memory folder at reset(); per context reset,
        # the files written in this episode as they stood then (before a wipe): where a relay fact was carried
        self.live = False   # inside an episode (between reset and done): a memory_files() call is a reset

    def __getattr__(self, name):
        return getattr(self.env, name)

    def _file(self):
        return self.env.memory_files().get(FILE)

    def reset(self, task):
        obs = self.env.reset(task)
        self.files_at_start = self.env.memory_files()
        self.start, self.wrote, self.resets, self.reads = self.files_at_start.get(FILE), False, [], []
        self.notes_at_reset = []
        self.live = True
        return obs

    def memory_files(self) -> dict:
        """Called by rollout.py at a reset (to list the paths of the fresh context): record the file."""
        files = self.env.memory_files()
        text = files.get(FILE)
        self.resets.append("missing" if text is None else "empty" if not text.strip()
                           else "written" if self.wrote else "stale")
        self.reads.append(False)
        self.notes_at_reset.append({k: v for k, v in files.items() if self.files_at_start.get(k) != v})
        if self.wipe_at_reset and self.live and text is not None:   # the "wiped" ablation: recorded, then gone
            files = {k: v for k, v in files.items() if k != FILE}
            self.env.set_memory_files(files)
        return files

    def step(self, action: str):
        if self.resets and reads_continuation(action):
            self.reads[-1] = True
        obs, reward, done = self.env.step(action)
        self.live = not done
        text = self._file()
        self.wrote = self.wrote or text != self.start
        if text is not None and len(text) > self.max_chars:
            files = self.env.memory_files()
            files[FILE] = text[:self.max_chars]
            self.env.set_memory_files(files)
            obs += f"\n[{CONTINUATION_PATH} was cut to its first {self.max_chars} characters: keep it short]"
        return obs, reward, done

    def clone(self):
        return ProtocolEnv(self.env.clone(), self.max_chars, self.wipe_at_reset)

    def close(self):
        self.env.close()


def reset_outcomes(env: ProtocolEnv) -> list[dict]:
    """The episode just run on env: one {"before", "read"} per reset."""
    return [{"before": b, "read": r} for b, r in zip(env.resets, env.reads)]


# ----------------------------------------------------------------------------- relay stages

def has_fact(values: list[str], text: str) -> bool:
    """Every value regex of a relay fact occurs in text (case-insensitively)."""
    return all(re.search(v, text, re.I) for v in values)


def command_output(action: str, obs: str) -> str:
    """What a command printed: its observation without the shell's echo of the command (the text
    envs show `$ <command>` first, workspace.shell_echo), which names whatever the command names."""
    cmd = _shell(action)
    echo = shell_echo(cmd.strip()) + "\n" if cmd is not None else None
    return obs[len(echo):] if echo is not None and obs.startswith(echo) else obs


def relay_progress(fact: dict, actions: list[str], observations: list[str], reset_turns: list[int],
                   notes_at_reset: list[dict]) -> str:
    """How far one relay episode carried its fact: the first stage of RELAY_PROGRESS it did not pass, or
    "used" (the module docstring). observations[t + 1] answers actions[t] (observations[0] is the task);
    reset_turns[k]: the turns taken before context reset k; notes_at_reset[k]: the memory files written
    in this episode as they stood at that reset ({path: text}). The reset that counts is the first after
    the turn that showed the source: before it there is nothing to carry."""
    assert len(reset_turns) == len(notes_at_reset), \
        f"{len(reset_turns)} resets but {len(notes_at_reset)} memory snapshots: not one ProtocolEnv episode"
    values = fact["values"]
    shown = next((t for t, obs in enumerate(observations[1:]) if fact["source"] in obs), None)
    if shown is None:
        return "not_opened"
    k = next((k for k, turns in enumerate(reset_turns) if turns > shown), None)
    if k is None:
        return "no_reset"
    files = [path for path, text in notes_at_reset[k].items() if has_fact(values, text)]
    if not files:
        return "not_written"
    after = list(zip(actions, observations[1:]))[reset_turns[k]:]
    # read back: a command on the memory files (it names .agent_memory or CONTINUATION.md) printed the values
    if not any(_MEMORY_RE.search(a) and has_fact(values, command_output(a, o)) for a, o in after):
        return "not_read"
    if not has_fact(values, "\n".join(a for a, _ in after if not _MEMORY_RE.search(a))):
        return "not_used"
    return "used"


def episode_relay_progress(ep, env) -> str | None:
    """relay_progress of an Episode just run on env (a ProtocolEnv whose environment has relay_fact);
    None for a task of another family, an environment with no relay family, or an episode that could
    not run (its reset raised)."""
    fact_of = getattr(env, "relay_fact", None)
    fact = fact_of(ep.task) if callable(fact_of) and not ep.error else None
    if fact is None:
        return None
    return relay_progress(fact, ep.actions, ep.observations, ep.reset_turns, env.notes_at_reset)


def turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) token spans of the replies in a row: each maximal run of loss mask 1 is one turn."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def memory_action_masks(rows: list, actions: list[str]) -> list[list[int]]:
    """Per row, 1 on the tokens of replies whose action writes or reads a memory file. Turns are the
    rows' runs of loss mask 1, in order across the rows; actions[i] is turn i's parsed action."""
    out, turn = [], 0
    for mask in rows:
        flags = [0] * len(mask)
        for a, b in turn_spans(mask):
            if turn < len(actions) and is_memory_action(actions[turn]):
                flags[a:b] = [1] * (b - a)
            turn += 1
        out.append(flags)
    return out


# ----------------------------------------------------------------------------- reference agents

def write_action(lines: list[str]) -> str:
    """One shell action that replaces CONTINUATION.md with the given lines (no single quotes in them)."""
    quoted = " ".join("'" + line.replace("'", "") + "'" for line in lines) or "'(nothing yet)'"
    return f"shell: printf '%s\\n' {quoted} > {CONTINUATION_PATH}"


class CarryingAgent:
    """A reference policy as a model has to be: it knows its current context only. make_policy() builds
    a fresh policy (obs -> action) with a `notes()` method (the lines worth carrying) and optionally
    `absorb(obs)` (take in an observation without acting; default: act and drop the action). carry=True: the
    first time notes() has something, the agent saves it at once (an action of its own: a reset with no
    room left to ask for the file loses nothing); asked to save before a reset, it writes notes() again
    (with its progress); after the reset it starts with `cat CONTINUATION.md`, whose output the fresh
    policy reads. carry=False: after a reset it starts over from the task with nothing."""

    def __init__(self, make_policy, carry: bool = True):
        self.make_policy, self.carry = make_policy, carry
        self.policy, self.context, self.saved, self.queued = make_policy(), 0, False, None

    def notes(self) -> list[str]:
        """What the policy would carry; [] for a policy with no notes() (the standard family's)."""
        notes = getattr(self.policy, "notes", None)
        return notes() if callable(notes) else []

    def __call__(self, ep) -> str:
        obs = ep.observations[-1]
        if ep.num_resets != self.context:           # a fresh context: the old one's state is gone
            self.context, self.policy, self.queued = ep.num_resets, self.make_policy(), None
            if self.carry and callable(getattr(self.policy, "notes", None)):
                return f"shell: cat {CONTINUATION_PATH}"
            obs = ep.observations[0]                # all it has left (or, with no notes, needs): the task
        if ep.reset_pending and self.carry:         # asked to save before the reset: take in the latest
            if self.queued is None:                 # observation first (policy.absorb, or a dropped action)
                getattr(self.policy, "absorb", self.policy)(obs)
            return write_action(self.notes())
        if self.queued is not None:                 # the action held back by a save
            action, self.queued = self.queued, None
            return action
        action = self.policy(obs)
        if self.carry and not self.saved and self.notes():
            self.saved, self.queued = True, action
            return write_action(self.notes())
        return action


def run_reference(tokenizer, envs_, tasks, agents, memory="", *, context_budget: int, max_turns=None,
                  max_new_tokens: int = 64):
    """rollout's agent loop (the one run_episodes and run_scripted share) with CarryingAgents in place
    of the model: the same rows (loss mask 1 on the agent's replies), memory note, context budget and
    reset protocol. Returns list[Episode]."""
    fmt, live = ChatFormat(tokenizer), {}

    def replies(live_eps, step):
        out = []
        for i, ep in zip(sorted(live), live_eps):   # live: {episode index: observation}, for the live ones
            ids = fmt.scripted_reply(f"<action>{agents[i](ep)}</action>")
            out.append((ids, [0.0] * len(ids), True))
        return out
    return agent_loop(fmt, replies, envs_, tasks, memory, max_turns=max_turns, max_new_tokens=max_new_tokens,
                 context_budget=context_budget, system_prompt=ACTOR_SYSTEM, num_threads=8, observe=live)
