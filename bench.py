"""Cumulative reward and cumulative gain on test streams, with memory vs. from scratch (RIME, Section 5).

    python bench.py                                        # scripted agent + SmolLM2-135M on the Alchemy test stream
    python bench.py --policy scripted --streams codebase19,codebase26,codebase27,camg
    python bench.py --policy smollm2 --policy path/to/hf_dir --attempts 4
    OPENAI_API_KEY=... python bench.py --api https://host/v1 --api-model NAME --streams codebase19
    python bench.py --policy scripted --stream codebase --swebench rows.jsonl --swebench-repos checkouts/
    python bench.py ablations [--seeds 3]                  # RIME's ablation table (trains 3 seeds per variant)
    python bench.py camg-ablations [--seeds 3] [--setting relay] [--jobs 2]   # CAMG's memory ablations (ablations.py has both)
    python bench.py engine | sandbox | envs | ppo | camg [args]   # = python speed.py ... (speed benchmarks)

What one (policy, stream) cell measures:
- with memory: the actor solves task t with memory M(t-1); the writer then writes M(t). Text memory
  (alchemy, codebase*): the writer's two-section notes (the scripted agent's writer is
  `alchemy.memory_text` on what its actor inferred; a model or API agent is its own writer). File
  memory (camg): `.agent_memory/` is kept on one env instance from task to task.
- from scratch: empty memory (files blanked before every task), `attempts` tries per task, averaged.
- cumulative reward = sum of with-memory scores; cumulative gain = that minus the sum of the
  from-scratch means (rewards.stream_metrics).
Policies: scripted (each env's reference policy), tiny, smollm2 or an HF checkpoint dir (through our
engine, `max_turns` turns of `max_new_tokens` tokens: a 135M model on 2 cores cannot afford more),
and an OpenAI-compatible endpoint (the env's full turn budget unless --api-max-turns, its own chat
history per task; see ApiAgent for what it does when the context is full).
Streams:
- alchemy: the fixed Alchemy test stream: AlchemyEnv(seed=0) test worlds, make_stream(order=
  "easy_to_hard", segment=6, seed=0) = world w16, 6 easy tasks (12-11 edges) then 6 hard (8-7 edges);
- codebase19: codebase.test_stream() (9 tablib then 10 tenacity issues); codebase26 / codebase27:
  codebase.long_streams() tablib (26) / tenacity (27);
- codebase: the SWE-bench JSONL rows of --swebench, in file order, on the git checkouts of
  --swebench-repos (codebase.load_swebench_jsonl: nothing is fetched; a row whose repository or base
  commit is not there stops the bench with one line before any model loads);
- camg: per environment (shop, coding, deepresearch, autoresearch) the first test group's tasks,
  easiest first (order "long"), at most `camg_tasks`.
Published rows (published.py) are printed beside ours, each labelled by its source: "released figures"
(the authors' released result tables), "abstract", or "derived" (computed here from released figures,
never reported as such). With a camg stream the CAMG paper's success table and its abstract's claim follow.
Results: every finished task is one JSONL line in <results>/rows.jsonl keyed by (policy, stream, mode,
task id, attempt) and the settings that change results; a rerun skips those (an interrupted bench
resumes; the with-memory run also resumes its memory from the last row).
Failures: an episode whose environment or endpoint errors is rerun `task_retries` times with
exponential backoff, then recorded as failed with its reason. A failed run is never scored 0: a task
counts only when its with-memory run and at least one from-scratch attempt succeeded; the table's
`failed` column counts the failed runs and `tasks` the counted tasks. A writer that fails keeps the
old memory (so "with memory" drifts toward "from scratch"): its failures are the `writer failed`
column and a line under the table. With --api the endpoint is asked once before any work (no
answer: one line, exit 2); a run stops (exit 2, rows kept) when --api-max-failures tries in a row got
no answer, and ends with exit 1 when every run of a cell failed. Ctrl-C ends with one line; the rows
written so far stay and a rerun resumes from them.

Sizing the default (`python bench.py`, printed with its wall time at the end): SmolLM2-135M gets 4 turns
of 32 tokens per task, a 96-token writer, 2 from-scratch attempts (the paper averages 4: --attempts 4),
1 torch thread and 8 episodes at a time. Measured on this project's 2-core CPU, shared with other jobs:
299 s in all at load ~2 (SmolLM2: 217 s with memory, 74 s from scratch; scripted: 2 s, plus loading),
480 s at load 4-7. SmolLM2 as shipped never emits an `<action>` tag, so it scores 0 both ways: the row
a trained checkpoint has to improve on.
"""

import argparse
import functools
import json
import sys
import time
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate
from pathlib import Path

from tqdm import tqdm

import cli
import published
from chat_api import ApiError, EndpointDown, chat, check_endpoint  # the OpenAI-compatible HTTP client (the judge uses it too)

STREAMS = ("alchemy", "codebase19", "codebase26", "codebase27", "codebase", "camg")
CAMG_ENVS = ("shop", "coding", "deepresearch", "autoresearch")


# -----------------------------------------------------------------------------
# config

@dataclass
class Config:
    policy: list = field(default_factory=lambda: ["scripted", "smollm2"],
                         metadata={"help": "scripted | tiny | smollm2 | HF checkpoint dir (repeat for several)"})
    streams: list = field(default_factory=lambda: ["alchemy"],
                          metadata={"help": f"{' | '.join(STREAMS)} (repeat or comma-separate)"})
    api: str = field(default="", metadata={"help": "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"})
    api_model: str = field(default="", metadata={"help": "model name sent to --api"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "env var holding the API key"})
    # a CPU server (llama.cpp, 135M model, 2 busy cores) read ~1,700 prompt tokens in 20-40 s: a fixed
    # 60 s cut such a request off, and the abandoned request kept the server busy while its retry queued
    api_timeout: float = field(default=60.0, metadata={"help": "seconds per API call, plus --api-timeout-per-token"})
    api_timeout_per_token: float = field(default=0.05, metadata={"help": "extra seconds per prompt token (chars/4) "
                                                                         "and per reply token of a call"})
    api_retries: int = field(default=3, metadata={"help": "API call retries (backoff 1, 2, 4 s ...)"})
    api_max_tokens: int = field(default=512, metadata={"help": "max tokens of one API reply"})
    api_context: int = field(default=0, metadata={"help": "the endpoint's context in tokens (0 = unknown): "
                                                          "replies then ask for at most a quarter of it"})
    api_max_turns: int = field(default=0, metadata={"help": "turns per task for the API agent (0 = the env's budget)"})
    api_max_failures: int = field(default=8, metadata={"help": "stop the run after this many API tries in a row "
                                                               "got no answer"})
    attempts: int = field(default=2, metadata={"help": "from-scratch tries per task, averaged (paper: 4)"})
    max_turns: int = field(default=4, metadata={"help": "turns per task for local models"})
    actor_context: str = field(default="all", metadata={"help": "alchemy, local models: all (the episode so far) | latest "
                                                                "(the memory and the latest observation, as rime.py --actor-context latest plays)"})
    max_new_tokens: int = field(default=32, metadata={"help": "tokens per local-model turn"})
    writer_tokens: int = field(default=96, metadata={"help": "tokens of a local model's memory rewrite"})
    traj_chars: int = field(default=1200, metadata={"help": "trajectory characters the writer sees"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature (attempts must differ)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads, 0 = torch's default (see below)"})
    # rollout keeps each episode's KV cache between turns, `context` slots per row: SmolLM2 needs ~47 KB
    # per slot, and with the copies made while batching ~3x that, so batch 8 x 1024 slots peaks near 1.5 GB
    context: int = field(default=1024, metadata={"help": "tokens per context (KV slots) for local models"})
    batch: int = field(default=8, metadata={"help": "from-scratch episodes a local model runs together"})
    stream_len: int = field(default=0, metadata={"help": "cut every stream to its first N tasks (0 = all)"})
    camg_tasks: int = field(default=12, metadata={"help": "tasks per CAMG environment"})
    task_retries: int = field(default=2, metadata={"help": "reruns of an errored episode before it is failed"})
    backoff: float = field(default=1.0, metadata={"help": "first backoff in seconds (doubles each retry)"})
    retry_failed: bool = field(default=False, metadata={"help": "rerun rows recorded as failed"})
    results: str = field(default="results", metadata={"help": "directory of rows.jsonl, table.md, curves"})
    swebench: str = field(default="", metadata={"help": "SWE-bench JSONL rows: the stream `codebase` (with --stream codebase)"})
    swebench_repos: str = field(default="", metadata={"help": "a git checkout (or a folder of checkouts) holding the "
                                                               "rows' base commits; nothing is fetched"})

    def __post_init__(self):
        self.streams = [s for arg in self.streams for s in str(arg).split(",") if s]
        cli.check(self.actor_context in ("all", "latest"), f"--actor-context must be all or latest, got {self.actor_context!r}")
        bad = [s for s in self.streams if s not in STREAMS]
        if bad or not self.streams:
            raise ValueError(f"unknown stream {bad or '(none)'}; choose from {', '.join(STREAMS)}")
        cli.check(bool(self.swebench) == ("codebase" in self.streams),
                  "--stream codebase evaluates the SWE-bench rows of --swebench FILE: give both (the built-in "
                  "streams are codebase19, codebase26, codebase27)")
        cli.check(not self.swebench or Path(self.swebench).is_file(), f"--swebench {self.swebench!r}: no such file")
        cli.check(not self.swebench or Path(self.swebench_repos).is_dir(),
                  "--swebench needs --swebench-repos DIR: the repositories' git checkouts (nothing is fetched)")
        for p in self.policy:
            if p not in ("scripted", "tiny", "smollm2"):
                cli.check(Path(p).is_dir(), f"policy {p!r} is neither scripted, tiny, smollm2 nor an HF checkpoint dir")
                cli.check_model_dir(p, option="--policy")
        if bool(self.api) != bool(self.api_model):
            raise ValueError("--api URL and --api-model NAME go together")
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"--attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("max_turns", "max_new_tokens", "writer_tokens", "context", "batch", "camg_tasks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if min(self.stream_len, self.task_retries, self.api_retries, self.threads, self.api_max_turns) < 0:
            raise ValueError("--stream-len, --task-retries, --api-retries, --threads and --api-max-turns must be >= 0")
        if self.api_max_failures < 1:
            raise ValueError("--api-max-failures must be >= 1")
        if self.api_context < 0:
            raise ValueError("--api-context must be >= 0 (0 = unknown)")
        cli.check_number("temperature", self.temperature, lo=0)
        cli.check_number("api_timeout", self.api_timeout, lo=0, lo_open=True)
        cli.check_number("api_timeout_per_token", self.api_timeout_per_token, lo=0)


SPEED_TABLES = """the ablation tables (train and evaluate each variant, 3 seeds, resumable; ablations.py):
  python bench.py ablations [--seeds 3]          RIME's, with rime.py
  python bench.py camg-ablations [--seeds 3]     CAMG's memory ablations, with camg.py (--setting relay: camg.py's default)

component speed tables are a program of their own, speed.py (`python speed.py NAME --help` lists
a benchmark's flags; `python bench.py NAME ...` runs the same):
  python speed.py engine    our KV-cache engine vs transformers' generate (--breakdown, --repeats, --device cuda --check)
  python speed.py sandbox   Sandbox.run overhead vs a bare subprocess
  python speed.py envs      environment steps/s, codebase reset and grading times
  python speed.py ppo       learner forward+backward tokens/s vs transformers
  python speed.py camg      CAMG-RL updates/s with 0, 1, 2 rollout workers"""


def parse_config(argv: list) -> Config:
    """argv -> Config: one --flag per field (cli.py's style); list fields repeat; a bad value raises ValueError."""
    p = cli.parser_for(Config, "bench.py", __doc__.split("\n")[0])
    p.epilog = SPEED_TABLES
    p.add_argument("--stream", dest="streams", action="append", help=argparse.SUPPRESS)
    args = {k: v for k, v in vars(p.parse_args(cli.legacy_spellings(argv, {f.name: f for f in fields(Config)}))).items()
            if v is not None}
    if "policy" not in args and args.get("api"):
        args["policy"] = []  # --api alone benchmarks just the endpoint
    return Config(**args)


# -----------------------------------------------------------------------------
# the API agent: an OpenAI-compatible chat endpoint behind the scripted-policy interface

@dataclass
class ApiAgent:
    """An OpenAI-compatible endpoint as an agent, with its own chat history per task.

    When the conversation outgrows the endpoint's context (the server says so: ApiError.context_overflow),
    it does what an agent harness does rather than lose the task:
    - drop the older half of the turns after the task's first message, in one block. Dropping one
      turn per overflow would change the prompt's start on every later turn, and a server's prefix
      cache (llama.cpp keeps the previous prompt's tokens) would re-read the whole prompt each time:
      after a block drop, the prompt up to the newest turns stays the same until the next overflow;
    - when no turn is left to drop, ask for shorter replies (halving max_tokens down to 64: it helps
      servers that count the reply against the context, not llama.cpp's, which checks the prompt);
    - then stop asking: the episode runs out its budget with empty actions and keeps its score so far.
    `policy.context_log` records each of these; bench.act puts it in the episode's info ("context").
    The writer sees `traj_chars` characters of the trajectory; on an overflow it retries with half
    the characters and fewer steps (`_writer_view`), and fails (the caller counts it) below 100."""
    url: str
    model: str
    key_env: str = "OPENAI_API_KEY"
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    max_tokens: int = 512
    temperature: float = 0.0
    traj_chars: int = 1200
    context: int = 0            # the endpoint's context in tokens, 0 = unknown
    timeout_per_token: float = 0.0
    max_turns: int = 0          # turns per task, 0 = the environment's budget
    max_failures: int = 8       # API tries in a row with no answer before the endpoint counts as down

    def __post_init__(self):
        if self.context:            # never ask for more than a quarter of a small context
            self.max_tokens = max(16, min(self.max_tokens, self.context // 4))

    def complete(self, messages, max_tokens=None) -> str:
        return chat(self.url, self.model, messages, key_env=self.key_env, timeout=self.timeout,
                    timeout_per_token=self.timeout_per_token, retries=self.retries, backoff=self.backoff,
                    max_tokens=max_tokens or self.max_tokens, temperature=self.temperature,
                    down_after=self.max_failures)

    def complete_fitting(self, history: list, state: dict) -> str | None:
        """complete(history), shortening it on a context overflow (see the class docstring). Edits
        history and state (the task's max_tokens and its context_log) in place; None once nothing
        more can be cut. The conversation only grows, so a lowered max_tokens stays for the task."""
        log = state["context_log"]
        while True:
            try:
                return self.complete(history, state["max_tokens"])
            except ApiError as e:
                if not e.context_overflow:
                    raise
                # history: system, the task's first message, then (reply, observation) pairs; the
                # last observation is the one being answered, so the pairs before it can go
                turns = (len(history) - 4) // 2
                if turns > 0:
                    drop = (turns + 1) // 2
                    del history[2: 2 + 2 * drop]
                    log.append(f"context full: dropped the oldest {drop} of {turns} earlier turns")
                elif state["max_tokens"] > 64:
                    state["max_tokens"] = max(64, state["max_tokens"] // 2)
                    log.append(f"context full: max_tokens -> {state['max_tokens']}")
                else:
                    log.append(f"context full: episode ended at turn {state['turn']} with its score so far")
                    return None

    def actor(self, memory: str):
        """A policy obs -> action for one task, keeping that task's chat history."""
        from rollout import ACTOR_SYSTEM, first_user_turn, parse_action
        history = [{"role": "system", "content": ACTOR_SYSTEM}]
        state = {"max_tokens": self.max_tokens, "context_log": [], "ended": False, "turn": 0}

        def policy(obs: str) -> str:
            if state["ended"]:
                return ""           # the context cannot hold another turn: the env counts the step
            state["turn"] += 1
            history.append({"role": "user", "content": first_user_turn(obs, memory) if len(history) == 1 else obs})
            reply = self.complete_fitting(history, state)
            if reply is None:
                state["ended"] = True
                return ""
            history.append({"role": "assistant", "content": reply})
            action = parse_action(reply)
            return "" if action is None else action  # no tag: the env answers with its valid forms
        policy.context_log = state["context_log"]
        return policy

    def write(self, episode, old_memory: str) -> str:
        """The new memory. A context overflow is retried with half the trajectory (noted in
        episode.info["context"]); below 100 characters the ApiError goes to the caller."""
        from rollout import WRITER_SYSTEM, writer_prompt
        chars, view = self.traj_chars, episode
        while True:
            try:
                reply = self.complete([{"role": "system", "content": WRITER_SYSTEM},
                                       {"role": "user", "content": writer_prompt(view, old_memory, chars)}])
                return reply.strip() or old_memory
            except ApiError as e:
                if not e.context_overflow or chars // 2 < 100:
                    raise
                chars //= 2
                view = _writer_view(episode, chars)
                episode.info.setdefault("context", []).append(f"writer: context full: trajectory cut to {chars} chars")


def _writer_view(ep, chars: int):
    """The episode as a shortened writer prompt shows it, in about `chars` characters: the task's
    first half of them, then as many of the last steps as fit in the other half, each observation
    cut to 80 characters. rollout.trajectory_text alone keeps at least 80 characters of every
    observation and up to 1,000 of the task, so a smaller budget cannot shrink a 60-step episode."""
    task = [ep.observations[0][: chars // 2]] if ep.observations else []
    steps, room = [], chars // 2
    for action, obs in reversed(list(zip(ep.actions, ep.observations[1:]))):
        room -= len(action) + min(len(obs), 80) + 30    # 30: "Step n: <action></action>\n  -> "
        if room < 0 and steps:
            break
        steps.insert(0, (action, obs[:80]))
    return replace(ep, actions=[a for a, _ in steps], observations=task + [o for _, o in steps])


# -----------------------------------------------------------------------------
# agents and streams

@dataclass
class Agent:
    name: str                 # the table's policy column
    kind: str                 # "scripted" | "model" | "api"
    model: object = None
    tokenizer: object = None  # model agents: theirs; others: the offline tokenizer (rows only)
    api: ApiAgent = None


@functools.lru_cache(maxsize=1)
def offline_tokenizer():
    import model as M
    return M.build_tokenizer()  # trains a small BPE (seconds): build it once per process


def load_agents(cfg: Config) -> list:
    from model import load_named
    agents = []
    for p in cfg.policy + (["api"] if cfg.api else []):
        if p in ("scripted", "api"):
            offline = offline_tokenizer()
            api = ApiAgent(cfg.api, cfg.api_model, cfg.api_key_env, cfg.api_timeout, cfg.api_retries, cfg.backoff,
                           cfg.api_max_tokens, cfg.temperature, traj_chars=cfg.traj_chars, context=cfg.api_context,
                           timeout_per_token=cfg.api_timeout_per_token, max_turns=cfg.api_max_turns,
                           max_failures=cfg.api_max_failures) if p == "api" else None
            agents.append(Agent(f"api:{cfg.api_model}" if api else "scripted", p if p == "scripted" else "api",
                                tokenizer=offline, api=api))
        else:
            model, tokenizer = load_named(p, seed=cfg.seed)
            agents.append(Agent(p, "model", model.eval(), tokenizer))
    return agents


def load_streams(name: str, cfg: Config) -> list:
    """-> [(stream label, env, tasks, memory kind "text" | "files")]."""
    from envs import make
    from curriculum import make_stream
    if name == "alchemy":
        env = make("alchemy", seed=0, actor_context=cfg.actor_context)
        out = [("alchemy", env, make_stream(env.tasks("test"), "easy_to_hard", segment=6, seed=0), "text")]
    elif name.startswith("codebase"):
        import codebase
        try:
            if name == "codebase":  # SWE-bench rows in file order (a bad row, or a repository not checked out: one line)
                tasks = codebase.load_swebench_jsonl(cfg.swebench, cfg.swebench_repos, env_name="codebase")
            else:
                tasks = {"codebase19": codebase.test_stream, "codebase26": lambda: codebase.long_streams()["tablib"],
                         "codebase27": lambda: codebase.long_streams()["tenacity"]}[name]()
            env = make("codebase")  # the sandbox shows the cached test dependencies
        except (ValueError, AssertionError, FileNotFoundError, RuntimeError) as e:  # the cache of real repositories
            cli.fail("bench.py", str(e))
        out = [(name, env, tasks, "text")]
    else:
        out = []
        for env_name in CAMG_ENVS:
            env = make(env_name, keep_memory=True)  # file memory carries along the stream
            test = env.tasks("test")
            stream = make_stream(test, "long", group=test[0].group)[: cfg.camg_tasks]
            out.append((f"camg/{env_name}", env, stream, "files"))
    return [(label, env, tasks[: cfg.stream_len or None], kind) for label, env, tasks, kind in out]


def settings_of(agent: Agent, cfg: Config) -> dict:
    """The knobs that change an agent's results: a cached row is reused only under the same ones."""
    if agent.kind == "model":
        return {**{k: getattr(cfg, k) for k in ("max_turns", "max_new_tokens", "writer_tokens", "traj_chars",
                                                "temperature", "seed", "context")},
                **({"actor_context": "latest"} if cfg.actor_context == "latest" else {})}
    if agent.kind == "api":
        return {"temperature": cfg.temperature, "max_tokens": cfg.api_max_tokens, "traj_chars": cfg.traj_chars,
                "max_turns": cfg.api_max_turns}
    return {}


def act(agent: Agent, envs: list, tasks: list, memories: list, seed: int, cfg: Config) -> list:
    """One episode per task (envs[i] runs tasks[i]) -> list[rollout.Episode]."""
    from rollout import run_episodes, run_scripted
    if agent.kind == "model":
        return run_episodes(agent.model, agent.tokenizer, envs, tasks, memories, temperature=cfg.temperature,
                            seed=seed, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                            context_budget=cfg.context)
    if agent.kind == "api":
        policies = [agent.api.actor(m) for m in memories]
    else:  # the reference policy; Alchemy's reads the notes, the others ignore text memory
        policies = [e.reference_policy(t, notes=m) if t.env == "alchemy" else e.reference_policy(t)
                    for e, t, m in zip(envs, tasks, memories)]
    max_turns = None                          # the environment's own budget
    if agent.kind == "api" and agent.api.max_turns:
        max_turns = agent.api.max_turns
    eps = run_scripted(agent.tokenizer, envs, tasks, policies, memory=memories, max_turns=max_turns)
    for ep, pol in zip(eps, policies):
        if hasattr(pol, "knowledge"):
            ep.info["knowledge"] = pol.knowledge  # for the scripted writer
        if getattr(pol, "context_log", None):
            ep.info["context"] = pol.context_log  # how a context overflow was handled (API agent)
    return eps


def scripted_writer(ep, old_memory: str) -> str:
    """The scripted agent's writer: Alchemy's chemistry notes, else a log of outcomes (two sections)."""
    if "knowledge" in ep.info:
        from alchemy import memory_text
        return memory_text(ep.info["knowledge"], ep.task.id, ep.score)
    facts = [line for line in old_memory.split("### Lessons")[0].splitlines() if line.startswith("- ")][-5:]
    facts.append(f"- {ep.task.id} ({ep.task.group}): score {ep.score:.2f} in {len(ep.actions)} actions.")
    facts = facts if len(facts) >= 2 else facts + ["- Each task's issue names the failing behaviour."]
    return ("### Repository Knowledge\n" + "\n".join(facts) + "\n\n### Lessons & Pitfalls\n"
            "- Reproduce the failure first, then fix it.\n- Run the visible tests before submitting.")


def write(agent: Agent, ep, old_memory: str, seed: int, cfg: Config) -> str:
    if agent.kind == "scripted":
        return scripted_writer(ep, old_memory)
    if agent.kind == "api":
        return agent.api.write(ep, old_memory)
    from rollout import write_memory
    return write_memory(agent.model, agent.tokenizer, [ep], [old_memory], temperature=cfg.temperature, seed=seed,
                        max_new_tokens=cfg.writer_tokens, traj_chars=cfg.traj_chars)[0].memory


# -----------------------------------------------------------------------------
# running a cell: cached rows, retries with backoff

def load_rows(path: Path) -> dict:
    """rows.jsonl -> {key: row}; a line cut by an interruption is skipped (its task simply reruns)."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                rows[row_key(row)] = row
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return rows


def row_key(row: dict) -> tuple:
    return (row["policy"], row["stream"], row["mode"], row["task"], row["attempt"],
            json.dumps(row["settings"], sort_keys=True))


def run_jobs(agent, envs, jobs, cfg, prepare):
    """jobs: [(task, memory)], run len(envs) at a time. An episode that errors (or a chunk that
    raises) is rerun after backoff; yields (job index, episode or None, failure reason) as they finish."""
    pending, reasons = list(range(len(jobs))), {}
    for round_ in range(cfg.task_retries + 1):
        if round_:
            time.sleep(cfg.backoff * 2 ** (round_ - 1))
        retry = []
        for c in range(0, len(pending), len(envs)):
            chunk = pending[c: c + len(envs)]
            try:
                for e in envs[: len(chunk)]:
                    prepare(e)
                eps = act(agent, envs[: len(chunk)], [jobs[j][0] for j in chunk], [jobs[j][1] for j in chunk],
                          cfg.seed * 100003 + round_ * 1009 + chunk[0], cfg)
            except EndpointDown:    # the endpoint stopped answering: every later job would fail too
                raise
            except Exception as e:  # noqa: BLE001 - an endpoint or env error fails these jobs, not the bench
                reasons.update({j: f"{type(e).__name__}: {e}"[:300] for j in chunk})
                retry += chunk
                continue
            for j, ep in zip(chunk, eps):
                if ep.finish == "error":
                    reasons[j] = ep.error[:300]
                    retry.append(j)
                else:
                    yield j, ep, ""
        pending = retry
        if not pending:
            return
    for j in pending:
        yield j, None, reasons[j]


def run_cell(agent, label, env, tasks, kind, cfg, rows, out, bar):
    """With memory (sequential; memory resumes from the cached rows), then from scratch."""
    settings = settings_of(agent, cfg)
    base = dict(policy=agent.name, stream=label, settings=settings)

    def cached(mode, task, attempt):
        row = rows.get(row_key(dict(base, mode=mode, task=task.id, attempt=attempt)))
        return row if row and not (cfg.retry_failed and row["failed"]) else None

    clock = [time.time()]

    def record(mode, task, attempt, ep, reason, **extra):
        now, last = time.time(), clock[0]
        clock[0] = now
        row = dict(base, mode=mode, task=task.id, attempt=attempt, failed=ep is None, reason=reason,
                   score=None if ep is None else ep.score, turns=0 if ep is None else ep.num_turns,
                   success=None if ep is None else ep.info.get("success"),
                   **({"context": ep.info["context"]} if ep is not None and ep.info.get("context") else {}),
                   seconds=round(now - last, 2), **extra)  # wall time since the previous row
        rows[row_key(row)] = row
        out.write(cli.dumps(row) + "\n")
        out.flush()  # the resume point: a row on disk is never recomputed
        bar.update(1)

    has_files = hasattr(env, "set_memory_files")
    bar.update(sum(bool(cached(m, t, a)) for t in tasks for m, a in
                   [("memory", 0)] + [("scratch", a) for a in range(cfg.attempts)]))
    # --- with memory: M(t-1) -> actor -> writer -> M(t)
    memory, files = "", {}
    for t, task in enumerate(tasks):
        row = cached("memory", task, 0)
        if row:
            memory, files = row.get("memory", memory), row.get("memory_files", files)
            continue
        prepare = (lambda e: e.set_memory_files(files if kind == "files" else {})) if has_files else (lambda e: None)
        for _, ep, reason in run_jobs(agent, [env], [(task, memory if kind == "text" else "")], cfg, prepare):
            extra = {}
            if ep is not None and kind == "text":
                try:
                    memory = write(agent, ep, memory, cfg.seed + t, cfg)
                except EndpointDown:
                    raise
                except Exception as e:  # noqa: BLE001 - a writer failure keeps the old memory (counted)
                    extra["writer_error"] = f"{type(e).__name__}: {e}"[:300]
            if ep is not None and kind == "files":
                files = env.memory_files()
            extra.update({"memory": memory} if kind == "text" else {"memory_files": files})
            record("memory", task, 0, ep, reason, **extra)
    # --- from scratch: empty memory, blank files, `attempts` tries per task
    jobs = [(task, a) for a in range(cfg.attempts) for task in tasks if not cached("scratch", task, a)]
    if not jobs:
        return
    envs = [env] + [env.clone() for _ in range(min(cfg.batch, len(jobs)) - 1)] if agent.kind == "model" else [env]
    try:
        prepare = (lambda e: e.set_memory_files({})) if has_files else (lambda e: None)
        for j, ep, reason in run_jobs(agent, envs, [(task, "") for task, _ in jobs], cfg, prepare):
            record("scratch", jobs[j][0], jobs[j][1], ep, reason)
    finally:
        for e in envs[1:]:
            e.close()


# -----------------------------------------------------------------------------
# metrics, table, curves

@dataclass
class Cell:
    policy: str
    stream: str
    reward: float       # cumulative reward over counted tasks
    gain: float         # cumulative gain over counted tasks
    counted: int        # tasks with a with-memory score and >= 1 from-scratch score
    total: int          # tasks in the stream
    failed: int         # failed runs (with-memory tasks + from-scratch attempts)
    with_memory: list   # per counted task
    scratch: list       # per counted task: mean of its attempts
    writer_failed: int = 0  # with-memory tasks whose writer failed (the memory stayed as it was)
    writes: int = 0         # with-memory tasks that ran the writer (finished episodes of text memory)
    runs: int = 0           # rows recorded, failed or not
    writer_reason: str = "" # the first writer failure's reason

    @property
    def all_failed(self) -> bool:
        return self.runs > 0 and self.failed == self.runs


def summarize(policy, stream, task_ids, rows, settings) -> Cell:
    """Failed runs are excluded from both sums (never scored 0); see the module docstring."""
    from rewards import stream_metrics
    mine = [r for r in rows.values() if r["policy"] == policy and r["stream"] == stream and r["settings"] == settings]
    mem = {r["task"]: r for r in mine if r["mode"] == "memory"}
    ids = set(task_ids)
    failed = sum(r["failed"] for r in mine if r["task"] in ids)
    with_memory, scratch = [], []
    for tid in task_ids:
        tries = [r["score"] for r in mine if r["mode"] == "scratch" and r["task"] == tid and not r["failed"]]
        if tid in mem and not mem[tid]["failed"] and tries:
            with_memory.append(mem[tid]["score"])
            scratch.append(tries)
    m = stream_metrics(with_memory, scratch) if with_memory else None
    writes = [r for r in mem.values() if r["task"] in ids and not r["failed"] and "memory" in r]
    writer_errors = [r["writer_error"] for r in writes if r.get("writer_error")]
    return Cell(policy, stream, m.cumulative_reward if m else 0.0, m.cumulative_gain if m else 0.0,
                len(with_memory), len(task_ids), failed, with_memory, [sum(s) / len(s) for s in scratch],
                writer_failed=len(writer_errors), writes=len(writes),
                runs=sum(r["task"] in ids for r in mine), writer_reason=writer_errors[0] if writer_errors else "")


def render_table(cells: list) -> str:
    lines = ["| policy | stream | cumulative reward | cumulative gain | tasks | failed | writer failed | source |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        # a row with no completed task has no figure, not a 0.00
        reward, gain = (f"{c.reward:.2f}", f"{c.gain:+.2f}") if c.counted else ("n/a", "n/a")
        lines.append(f"| {c.policy} | {c.stream} | {reward} | {gain} | {c.counted}/{c.total} "
                     f"| {c.failed} | {c.writer_failed}/{c.writes} | measured here |")
    for name, reward, gain, source in published.RIME_CODEBASE19:
        lines.append(f"| {name} † | codebase19 | {reward:.2f} | {gain:+.2f} | 19/19 | - | - | {source} |")
    lines.append("\n† published, not measured here: the RIME paper's Codebase Adaptation results (19-task stream). "
                 "released figures: the authors' released result tables.")
    if any(c.stream.startswith("camg/") for c in cells):
        lines.append("\nThe CAMG paper measures success (%) per environment, not cumulative reward: its published "
                     "figures, for reference:\n\n" + published.camg_tables())
    return "\n".join(lines)


def sparkline(values: list, top: float) -> str:
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(7, int(v / top * 7.999))] if top > 0 else bars[0] for v in values)


def write_curves(cells: list, results: Path) -> str:
    """Per-task cumulative curves, with vs. without memory: PNGs if matplotlib imports, else sparklines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    text = []
    for c in cells:
        mem, scr = list(accumulate(c.with_memory)), list(accumulate(c.scratch))
        if plt is not None and mem:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.plot(range(1, len(mem) + 1), mem, marker="o", label="with memory")
            ax.plot(range(1, len(scr) + 1), scr, marker="s", label="from scratch")
            ax.set(xlabel="task", ylabel="cumulative reward", title=f"{c.policy} / {c.stream}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(results / f"curve_{c.policy}_{c.stream}.png".replace("/", "_").replace(":", "_"))
            plt.close(fig)
        top = max(mem + scr + [0.0])
        text.append(f"{c.policy} / {c.stream}\n  with memory  {sparkline(mem, top)} {mem[-1] if mem else 0:.2f}"
                    f"\n  from scratch {sparkline(scr, top)} {scr[-1] if scr else 0:.2f}")
    (results / "curves.txt").write_text("\n".join(text) + "\n")
    return "\n".join(text)


# -----------------------------------------------------------------------------
# main

def bench(cfg: Config) -> list:
    t_start = time.time()
    if cfg.threads:
        import torch
        # 1 thread: a 135M model's decode step is ~600 tiny kernels, and with 2 threads on a shared,
        # loaded CPU each one waits at a thread barrier; measured here 6x slower decode than 1 thread
        torch.set_num_threads(cfg.threads)
    results = Path(cfg.results)
    if cfg.api:                     # one request before any work: a dead endpoint is one line, not 14 minutes
        try:
            check_endpoint(cfg.api, cfg.api_model, key_env=cfg.api_key_env, timeout=cfg.api_timeout)
        except ApiError as e:
            cli.fail("bench.py", f"--api {cfg.api}: {e}")
    streams, cells, stopped = [], [], ""
    try:
        for name in cfg.streams:    # first: a stream that cannot load is an error before any model loads
            streams += load_streams(name, cfg)
        agents = load_agents(cfg)
        results.mkdir(parents=True, exist_ok=True)
        rows = load_rows(results / "rows.jsonl")
        with open(results / "rows.jsonl", "a") as out:
            for agent in agents:
                for label, env, tasks, kind in streams:
                    try:
                        with tqdm(total=len(tasks) * (1 + cfg.attempts), desc=f"{agent.name} {label}") as bar:
                            run_cell(agent, label, env, tasks, kind, cfg, rows, out, bar)
                    finally:        # a cell cut short still shows what it did
                        cells.append(summarize(agent.name, label, [t.id for t in tasks], rows, settings_of(agent, cfg)))
    except EndpointDown as e:       # the table shows what was done; the run stops below
        stopped = str(e)
    finally:
        for _, env, _, _ in streams:
            env.close()
    table = render_table(cells)
    (results / "table.md").write_text(table + "\n")
    print("\n" + table + "\n\n" + write_curves(cells, results))
    for c in cells:
        if c.writer_failed:         # the with-memory column then measures a memory that never changed
            print(f"{c.policy} / {c.stream}: the writer failed on {c.writer_failed} of {c.writes} tasks and the "
                  f"memory stayed as it was; first reason: {c.writer_reason}")
    print(f"\nwall time {time.time() - t_start:.0f} s; rows in {results / 'rows.jsonl'}, "
          f"table in {results / 'table.md'}")
    if stopped:
        cli.fail("bench.py", f"{stopped}; stopped, the rows so far are in {results / 'rows.jsonl'} (a rerun resumes)")
    dead = [f"{c.policy} / {c.stream}" for c in cells if c.all_failed]
    if dead:
        print(f"bench.py: error: every run of {', '.join(dead)} failed (reasons in {results / 'rows.jsonl'})",
              file=sys.stderr)
        sys.exit(1)
    return cells


SPEED_BENCHMARKS = ("engine", "sandbox", "envs", "ppo", "camg")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("ablations", "camg-ablations"):
        import ablations
        return (ablations.rime_ablations if argv[0] == "ablations" else ablations.camg_ablations)(argv[1:])
    if argv and argv[0] in SPEED_BENCHMARKS:   # speed.py's, run as the program it is (no entry point imports another)
        import subprocess
        code = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "speed.py"), *argv]).returncode
        if code:
            raise SystemExit(code)
        return None
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        cli.fail("bench.py", str(e))
    try:
        return bench(cfg)
    except KeyboardInterrupt:       # rows.jsonl is flushed row by row: what finished is kept
        print(f"\nbench.py: interrupted; finished rows are kept in {Path(cfg.results) / 'rows.jsonl'} "
              "(a rerun resumes)", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
