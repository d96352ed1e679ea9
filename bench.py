"""Cumulative reward and cumulative gain on test streams, with memory vs. from scratch (RIME, Section 5).

    python bench.py                                        # scripted agent + SmolLM2-135M on the Alchemy test stream
    python bench.py --policy scripted --streams codebase19,codebase26,codebase27,camg
    python bench.py --policy smollm2 --policy path/to/hf_dir --attempts 4
    OPENAI_API_KEY=... python bench.py --api https://host/v1 --api-model NAME --streams codebase19
    python bench.py ablations [--seeds 3]                  # RIME's ablation table (trains 3 seeds per variant)
    python bench.py engine | sandbox | envs | ppo | camg [args]   # component speed benchmarks (see below)

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
and an OpenAI-compatible endpoint (full turn budget, its own chat history per task).
Streams:
- alchemy: the fixed Alchemy test stream: AlchemyEnv(seed=0) test worlds, make_stream(order=
  "easy_to_hard", segment=6, seed=0) = world w16, 6 easy tasks (12-11 edges) then 6 hard (8-7 edges);
- codebase19: codebase.test_stream() (9 tablib then 10 tenacity issues); codebase26 / codebase27:
  codebase.long_streams() tablib (26) / tenacity (27);
- camg: per environment (shop, coding, deepresearch, autoresearch) the first test group's tasks,
  easiest first (order "long"), at most `camg_tasks`.
Results: every finished task is one JSONL line in <results>/rows.jsonl keyed by (policy, stream, mode,
task id, attempt) and the settings that change results; a rerun skips those (an interrupted bench
resumes; the with-memory run also resumes its memory from the last row).
Failures: an episode whose environment or endpoint errors is rerun `task_retries` times with
exponential backoff, then recorded as failed with its reason. A failed run is never scored 0: a task
counts only when its with-memory run and at least one from-scratch attempt succeeded; the table's
`failed` column counts the failed runs and `tasks` the counted tasks.

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
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, fields
from itertools import accumulate
from pathlib import Path

from tqdm import tqdm

import cli
from judge import ApiError, chat  # the OpenAI-compatible HTTP client (the judge uses it too)

STREAMS = ("alchemy", "codebase19", "codebase26", "codebase27", "camg")
CAMG_ENVS = ("shop", "coding", "deepresearch", "autoresearch")
# DESIGN.md / the seed text: Codebase Adaptation, 19-task stream (cumulative reward, cumulative gain)
PUBLISHED = [("Qwen3.5-4B + RIME", 10.55, 2.27), ("GPT-5.4", 10.14, 0.69), ("Claude Opus 4.7", 10.36, 1.49),
             ("GPT-6 Astra", 17.25, 2.26), ("Claude Opus 5.5", 17.40, 0.90)]


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
    api_timeout: float = field(default=60.0, metadata={"help": "seconds per API call"})
    api_retries: int = field(default=3, metadata={"help": "API call retries (backoff 1, 2, 4 s ...)"})
    api_max_tokens: int = field(default=512, metadata={"help": "max tokens of one API reply"})
    api_context: int = field(default=0, metadata={"help": "the endpoint's context in tokens (0 = unknown): "
                                                          "replies then ask for at most a quarter of it"})
    attempts: int = field(default=2, metadata={"help": "from-scratch tries per task, averaged (paper: 4)"})
    max_turns: int = field(default=4, metadata={"help": "turns per task for local models"})
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

    def __post_init__(self):
        self.streams = [s for arg in self.streams for s in str(arg).split(",") if s]
        bad = [s for s in self.streams if s not in STREAMS]
        if bad or not self.streams:
            raise ValueError(f"unknown stream {bad or '(none)'}; choose from {', '.join(STREAMS)}")
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
        if self.stream_len < 0 or self.task_retries < 0 or self.api_retries < 0 or self.threads < 0:
            raise ValueError("--stream-len, --task-retries, --api-retries and --threads must be >= 0")
        if self.api_context < 0:
            raise ValueError("--api-context must be >= 0 (0 = unknown)")
        cli.check_number("temperature", self.temperature, lo=0)
        cli.check_number("api_timeout", self.api_timeout, lo=0, lo_open=True)


SPEED_TABLES = """RIME's ablation table (trains and evaluates each variant, resumable):
  python bench.py ablations [--seeds 3]

component speed tables (each prints a markdown table of ratios against a baseline
timed side by side in the same process; `python bench.py NAME --help` lists its flags):
  python bench.py engine    our KV-cache engine vs transformers' generate (--breakdown, --repeats, --device cuda --check)
  python bench.py sandbox   Sandbox.run overhead vs a bare subprocess
  python bench.py envs      environment steps/s, codebase reset and grading times
  python bench.py ppo       learner forward+backward tokens/s vs transformers
  python bench.py camg      CAMG-RL updates/s with 0, 1, 2 rollout workers"""


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
    it does what an agent harness does rather than lose the task: first ask for shorter replies
    (halving max_tokens down to 64), then drop the oldest turns after the task's first message, and
    when nothing is left to drop, stop asking: the episode runs out its budget with empty actions
    and keeps its score so far. `policy.context_log` records each of these; bench.act puts it in
    the episode's info ("context")."""
    url: str
    model: str
    key_env: str = "OPENAI_API_KEY"
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    max_tokens: int = 512
    temperature: float = 0.0
    traj_chars: int = 4000
    context: int = 0            # the endpoint's context in tokens, 0 = unknown

    def __post_init__(self):
        if self.context:            # never ask for more than a quarter of a small context
            self.max_tokens = max(16, min(self.max_tokens, self.context // 4))

    def complete(self, messages, max_tokens=None) -> str:
        return chat(self.url, self.model, messages, key_env=self.key_env, timeout=self.timeout,
                    retries=self.retries, backoff=self.backoff, max_tokens=max_tokens or self.max_tokens,
                    temperature=self.temperature)

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
                if state["max_tokens"] > 64:
                    state["max_tokens"] = max(64, state["max_tokens"] // 2)
                    log.append(f"context full: max_tokens -> {state['max_tokens']}")
                elif len(history) > 3:      # system, the task's first message, ..., the latest observation
                    del history[2:4]        # the oldest assistant reply and the observation after it
                    log.append("context full: dropped the oldest turn")
                else:
                    log.append(f"context full: episode ended at turn {len(log)} with its score so far")
                    return None

    def actor(self, memory: str):
        """A policy obs -> action for one task, keeping that task's chat history."""
        from rollout import ACTOR_SYSTEM, first_user_turn, parse_action
        history = [{"role": "system", "content": ACTOR_SYSTEM}]
        state = {"max_tokens": self.max_tokens, "context_log": [], "ended": False}

        def policy(obs: str) -> str:
            if state["ended"]:
                return ""           # the context cannot hold another turn: the env counts the step
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
        from rollout import WRITER_SYSTEM, writer_prompt
        reply = self.complete([{"role": "system", "content": WRITER_SYSTEM},
                               {"role": "user", "content": writer_prompt(episode, old_memory, self.traj_chars)}])
        return reply.strip() or old_memory


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
    import model as M
    agents = []
    for p in cfg.policy + (["api"] if cfg.api else []):
        if p in ("scripted", "api"):
            offline = offline_tokenizer()
            api = ApiAgent(cfg.api, cfg.api_model, cfg.api_key_env, cfg.api_timeout, cfg.api_retries, cfg.backoff,
                           cfg.api_max_tokens, cfg.temperature, traj_chars=4000,
                           context=cfg.api_context) if p == "api" else None
            agents.append(Agent(f"api:{cfg.api_model}" if api else "scripted", p if p == "scripted" else "api",
                                tokenizer=offline, api=api))
        elif p == "tiny":
            m, tok = M.tiny("qwen3_5", seed=cfg.seed)
            agents.append(Agent("tiny", "model", m.eval(), tok))
        else:
            agents.append(Agent(p, "model", M.load(p).eval(), M.load_tokenizer(p)))
    return agents


def load_streams(name: str, cfg: Config) -> list:
    """-> [(stream label, env, tasks, memory kind "text" | "files")]."""
    from envs import make
    from curriculum import make_stream
    if name == "alchemy":
        env = make("alchemy", seed=0)
        out = [("alchemy", env, make_stream(env.tasks("test"), "easy_to_hard", segment=6, seed=0), "text")]
    elif name.startswith("codebase"):
        import codebase
        try:
            env = make("codebase")
        except (AssertionError, FileNotFoundError, RuntimeError) as e:  # the cache of real repositories
            raise SystemExit(f"bench.py: {e}") from None
        tasks = {"codebase19": codebase.test_stream, "codebase26": lambda: codebase.long_streams()["tablib"],
                 "codebase27": lambda: codebase.long_streams()["tenacity"]}[name]()
        out = [(name, env, tasks, "text")]
    else:
        out = []
        for env_name in CAMG_ENVS:
            env = make(env_name)
            test = env.tasks("test")
            stream = make_stream(test, "long", group=test[0].group)[: cfg.camg_tasks]
            out.append((f"camg/{env_name}", env, stream, "files"))
    return [(label, env, tasks[: cfg.stream_len or None], kind) for label, env, tasks, kind in out]


def settings_of(agent: Agent, cfg: Config) -> dict:
    """The knobs that change an agent's results: a cached row is reused only under the same ones."""
    if agent.kind == "model":
        return {k: getattr(cfg, k) for k in ("max_turns", "max_new_tokens", "writer_tokens", "traj_chars",
                                             "temperature", "seed", "context")}
    return {"temperature": cfg.temperature, "max_tokens": cfg.api_max_tokens} if agent.kind == "api" else {}


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
    eps = run_scripted(agent.tokenizer, envs, tasks, policies, memory=memories)
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
                except Exception as e:  # noqa: BLE001 - a writer failure keeps the old memory
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
    return Cell(policy, stream, m.cumulative_reward if m else 0.0, m.cumulative_gain if m else 0.0,
                len(with_memory), len(task_ids), failed, with_memory, [sum(s) / len(s) for s in scratch])


def render_table(cells: list) -> str:
    lines = ["| policy | stream | cumulative reward | cumulative gain | tasks | failed | source |",
             "|---|---|---:|---:|---:|---:|---|"]
    for c in cells:
        # a row with no completed task has no figure, not a 0.00
        reward, gain = (f"{c.reward:.2f}", f"{c.gain:+.2f}") if c.counted else ("n/a", "n/a")
        lines.append(f"| {c.policy} | {c.stream} | {reward} | {gain} | {c.counted}/{c.total} "
                     f"| {c.failed} | measured here |")
    for name, reward, gain in PUBLISHED:
        lines.append(f"| {name} † | codebase19 | {reward:.2f} | {gain:+.2f} | 19/19 | - "
                     "| reported by the paper, not measured here |")
    lines.append("\n† published rows from the RIME paper (Codebase Adaptation, 19-task stream), "
                 "reported by the paper, not measured here.")
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
    results.mkdir(parents=True, exist_ok=True)
    rows = load_rows(results / "rows.jsonl")
    agents = load_agents(cfg)
    streams = [s for name in cfg.streams for s in load_streams(name, cfg)]
    cells = []
    with open(results / "rows.jsonl", "a") as out:
        try:
            for agent in agents:
                for label, env, tasks, kind in streams:
                    with tqdm(total=len(tasks) * (1 + cfg.attempts), desc=f"{agent.name} {label}") as bar:
                        run_cell(agent, label, env, tasks, kind, cfg, rows, out, bar)
                    cells.append(summarize(agent.name, label, [t.id for t in tasks], rows, settings_of(agent, cfg)))
        finally:
            for _, env, _, _ in streams:
                env.close()
    table = render_table(cells)
    (results / "table.md").write_text(table + "\n")
    print("\n" + table + "\n\n" + write_curves(cells, results))
    print(f"\nwall time {time.time() - t_start:.0f} s; rows in {results / 'rows.jsonl'}, "
          f"table in {results / 'table.md'}")
    return cells


# -----------------------------------------------------------------------------
# component benchmarks: python bench.py engine | sandbox | envs | ppo. Each prints a markdown table
# whose ratios compare against a baseline timed side by side in the same process: on a shared CPU
# absolute timings drift ~30% between runs, ratios much less.

def flags(args: list, prog: str, **defaults):
    """argparse for a component benchmark: --name-with-dashes per keyword, typed by its default; False is a
    switch, a tuple lists the choices (the first is the default). Each function's docstring says what they do."""
    p = argparse.ArgumentParser(prog=f"bench.py {prog}")
    for name, d in defaults.items():
        flag = "--" + name.replace("_", "-")
        if d is False:
            p.add_argument(flag, action="store_true")
        elif isinstance(d, tuple):
            p.add_argument(flag, choices=d, default=d[0])
        else:
            p.add_argument(flag, type=type(d), default=d)
    return p.parse_args(args)


def md_table(header: list, rows: list) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def interleaved_runs(fns, repeats: int, sync=lambda: None, warmup: bool = True, clock=time.perf_counter) -> list:
    """Seconds of every timed call of each fn: [[t_1, ..., t_repeats] per fn]. Calls are interleaved, in
    ABBA order, so that drift in the machine's load hits every side alike; an untimed warm-up call each
    first (allocator, kernels, lazy inits). clock=time.process_time counts this process's CPU time:
    steadier on a shared CPU."""
    times = [[] for _ in fns]
    for k in range(repeats + warmup):
        for i in (range(len(fns)) if k % 2 == 0 else reversed(range(len(fns)))):
            sync()
            t0 = clock()
            fns[i]()
            sync()
            if k or not warmup:
                times[i].append(clock() - t0)
    return times


def interleaved_times(fns, repeats: int, sync=lambda: None, warmup: bool = True, clock=time.perf_counter) -> list:
    """(best, median) seconds per call of each fn, timed by interleaved_runs."""
    return [(min(ts), statistics.median(ts)) for ts in interleaved_runs(fns, repeats, sync, warmup, clock)]


def hf_config(arch: str, quick: bool = False):
    """Random-weight HF configs: ~30M parameters (vocab 8192, tied, hidden 512, 8 layers) or, quick, ~8M."""
    import transformers
    c = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096)
    if quick:
        c.update(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    if arch == "qwen3":
        return transformers.Qwen3Config(**c)
    c["intermediate_size"] = c["intermediate_size"] * 5 // 6  # 1280 (640): the DeltaNet layers are larger
    return transformers.Qwen3_5TextConfig(
        **c, linear_num_key_heads=c["num_attention_heads"], linear_num_value_heads=c["num_attention_heads"],
        linear_key_head_dim=c["head_dim"], linear_value_head_dim=c["head_dim"], linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (c["num_hidden_layers"] // 4))


def model_pair(name: str, device: str, dtype, workdir: str, quick: bool = False, train: bool = False):
    """(ours, transformers) holding the same weights: one checkpoint saved, then loaded by both."""
    import torch
    from transformers import AutoModelForCausalLM
    import model as M
    path = f"{workdir}/{name}"
    if name == "smollm2":
        M.save(M.load("smollm2"), M.load_tokenizer("smollm2"), path)  # an HF-format copy transformers reads
    else:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf_config(name, quick)).save_pretrained(path)
    ours = M.load(path, dtype=dtype, device=device).train(train)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).train(train)
    hf.generation_config.eos_token_id = None  # random weights may emit EOS: never stop early
    return ours, hf


def ragged_prompts(batch: int, lo: int, hi: int, vocab: int, seed: int) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist()
            for n in torch.randint(lo, hi + 1, (batch,), generator=g).tolist()]


def check_flash(name, ours, prompts, new_tokens):
    """attn_impl "flash" vs "sdpa" on one bf16 model: no-cache logits, cached logits (prefill, then the
    sdpa greedy tokens fed one by one) and greedy tokens. -> (table row, within bf16 tolerance)."""
    import torch
    from generate import generate, prefill
    dev = next(ours.parameters()).device
    T, n = max(map(len, prompts)), new_tokens
    ids = torch.tensor([q + [0] * (T - len(q)) for q in prompts], device=dev)  # (B, T) right padded
    valid = torch.arange(T, device=dev)[None] < torch.tensor([len(q) for q in prompts], device=dev)[:, None]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    full, tokens, cached = {}, {}, {}
    for impl in ("sdpa", "flash"):
        ours.attn_impl = impl
        with torch.inference_mode():
            full[impl] = ours(ids).float()[valid]  # (real tokens, V): pads after a row's end are ignored
        tokens[impl] = [o.tokens for o in generate(ours, prompts, max_new_tokens=n, temperature=0)]
    for impl in ("sdpa", "flash"):
        ours.attn_impl = impl
        with torch.inference_mode():
            cache, last = prefill(ours, [prompts[i] for i in order], T + n, 4096, dev)
            forced = torch.tensor([tokens["sdpa"][i] for i in order], device=dev)  # (B, n)
            steps = [last] + [ours(forced[:, k: k + 1], cache=cache)[:, -1].float() for k in range(n - 1)]
        cached[impl] = torch.stack(steps, dim=1)  # (B, n, V), rows in length order for both
    ours.attn_impl = "flash"
    scale = full["sdpa"].abs().max().item()
    full_diff = (full["flash"] - full["sdpa"]).abs().max().item() / scale
    cache_diff = (cached["flash"] - cached["sdpa"]).abs().max().item() / scale
    agree = (cached["flash"].argmax(-1) == cached["sdpa"].argmax(-1)).float().mean().item()
    same = sum(a == b for a, b in zip(tokens["flash"], tokens["sdpa"])) / len(prompts)
    ok = full_diff < 3e-2 and cache_diff < 3e-2 and agree > 0.97
    return [name, f"{full_diff:.2e}", f"{cache_diff:.2e}", f"{agree:.3f}", f"{same:.2f}", "PASS" if ok else "FAIL"], ok


def bench_engine(args: list) -> None:
    """Our generate() against transformers' generate(): same weights, same ragged prompts, greedy with no
    stop token (every row makes exactly --new-tokens tokens); tok/s = new tokens / wall time, prefill
    included; transformers gets left-padded prompts and an attention mask. "same tokens" = rows where
    both agree (padding changes fp rounding, so a near-tie may flip; fewer in bf16). --repeats N: timed
    runs per engine (default 3), interleaved in ABBA order; the table gives the median tok/s and the median
    of the per-repeat ratios with their spread (min-max); --threads 1 --clock cpu: steadier on a shared CPU.
    --breakdown: a second table of where the time goes: prefill s and decode ms/step of both engines,
    and the part of our decode step spent in the weight matmuls alone (both engines must run them: on a
    CPU they bound how far any engine can get ahead at small batch).
        python bench.py engine [--quick] [--models qwen3,qwen3_5,smollm2] [--batch-sizes 8,32] [--new-tokens 128]
        python bench.py engine --device cuda --check     # flash-attn vs SDPA (bf16) first"""
    import importlib.util
    import tempfile
    import torch
    from generate import generate
    a = flags(args, "engine", device=("cpu", "cuda"), check=False, models="qwen3,qwen3_5,smollm2",
              batch_sizes="8,32", min_prompt=32, max_prompt=512, new_tokens=128, quick=False, repeats=3,
              threads=0, clock=("wall", "cpu"), seed=0, breakdown=False)
    if a.quick:
        a.batch_sizes, a.max_prompt, a.new_tokens = "8", 128, 32
    models = [m for m in a.models.split(",") if m]
    if set(models) - {"qwen3", "qwen3_5", "smollm2"} or not 1 <= a.min_prompt <= a.max_prompt or a.repeats < 1:
        raise SystemExit("bench.py engine: --models takes qwen3,qwen3_5,smollm2; "
                         "need 1 <= --min-prompt <= --max-prompt")
    if a.device == "cuda" and (not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None):
        raise SystemExit("--device cuda needs a GPU and flash-attn: pip install -r requirements-gpu.txt")
    if a.device != "cuda" and a.check or a.device != "cpu" and a.clock == "cpu":
        raise SystemExit("--check (flash-attn vs SDPA) needs --device cuda; --clock cpu measures CPU time: CPU only")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter

    def ours_run(model, prompts, n):
        return [o.tokens for o in generate(model, prompts, max_new_tokens=n, temperature=0)]

    @torch.inference_mode()
    def hf_run(hf, prompts, n):
        T = max(map(len, prompts))
        ids = torch.tensor([[0] * (T - len(q)) + q for q in prompts], device=a.device)  # (B, T) left padded
        mask = torch.tensor([[0] * (T - len(q)) + [1] * len(q) for q in prompts], device=a.device)
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[:, T:].tolist()

    print(f"engine: device {a.device} ({dtype}), threads {torch.get_num_threads()}, {a.clock} clock, prompts "
          f"{a.min_prompt}-{a.max_prompt} tokens, {a.new_tokens} new tokens, greedy\n", flush=True)
    header = ["model", "params", "batch", "our tok/s", "transformers tok/s", f"ratio (median of {a.repeats})",
              "ratio spread", "same tokens"]
    checks, rows, parts = [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for name in models:
            ours, hf = model_pair(name, a.device, dtype, workdir)
            if a.device == "cuda":
                ours.attn_impl = "flash"
            if a.check:
                prompts = ragged_prompts(8, a.min_prompt, a.max_prompt, ours.config.vocab_size, a.seed)
                checks.append(check_flash(name, ours, prompts, min(a.new_tokens, 64)))
            warm = ragged_prompts(2, 8, 16, ours.config.vocab_size, a.seed + 1)  # first-call overheads
            ours_run(ours, warm, 4), hf_run(hf, warm, 4)
            for batch in [int(b) for b in a.batch_sizes.split(",")]:
                prompts = ragged_prompts(batch, a.min_prompt, a.max_prompt, ours.config.vocab_size, a.seed)
                out = {}
                our_t, hf_t = interleaved_runs(
                    [lambda: out.update(ours=ours_run(ours, prompts, a.new_tokens)),
                     lambda: out.update(hf=hf_run(hf, prompts, a.new_tokens))], a.repeats, sync, warmup=False,
                    clock=clock)
                ratios = [h / o for o, h in zip(our_t, hf_t)]     # each repeat's pair ran back to back
                n = batch * a.new_tokens
                same = sum(x == y for x, y in zip(out["ours"], out["hf"])) / batch
                rows.append([name, f"{sum(p.numel() for p in ours.parameters()) / 1e6:.0f}M", batch,
                             f"{n / statistics.median(our_t):.0f}", f"{n / statistics.median(hf_t):.0f}",
                             f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x",
                             f"{same:.2f}"])
                print(md_table(header, rows[-1:]).splitlines()[-1], flush=True)  # progress: the table comes last
                if a.breakdown:
                    parts.append([name, batch] + engine_breakdown(ours, hf, prompts, a.new_tokens, ours_run, hf_run,
                                                                  sync, clock))
            del ours, hf
    if checks:
        print("\nflash-attn vs SDPA (bf16; diffs are max |Δlogit| / max |logit|)\n")
        print(md_table(["model", "no-cache logits", "cached logits", "cached argmax agree", "same greedy rows",
                        "check"], [r for r, _ in checks]))
        print(f"\nflash-attn check: {'PASS' if all(ok for _, ok in checks) else 'FAIL'}")
    print("\n" + md_table(header, rows))
    if parts:
        print("\nwhere the time goes (decode = (time for 1 + k tokens - time for 1) / k; ceiling = the ratio if "
              "our decode step were its weight matmuls alone)\n")
        print(md_table(["model", "batch", "our prefill s", "transformers prefill s", "our decode ms/step",
                        "transformers decode ms/step", "our weight matmuls ms/step", "ceiling"], parts))


def engine_breakdown(ours, hf, prompts, new_tokens, ours_run, hf_run, sync, clock, k=32) -> list:
    """Prefill and per-step decode times of both engines, and of our weight matmuls alone (every Linear
    once on a batch-sized input, under inference_mode as in generation): one row of the breakdown table."""
    import torch

    def best(fn, repeats=2):  # the timed runs before this one warmed both engines up
        return interleaved_times([fn], repeats, sync, warmup=False, clock=clock)[0][0]

    our_prefill, hf_prefill = best(lambda: ours_run(ours, prompts, 1)), best(lambda: hf_run(hf, prompts, 1))
    our_step = (best(lambda: ours_run(ours, prompts, 1 + k)) - our_prefill) / k
    hf_step = (best(lambda: hf_run(hf, prompts, 1 + k)) - hf_prefill) / k
    linears = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    p = next(ours.parameters())
    inputs = [torch.randn(len(prompts), m.in_features, device=p.device, dtype=p.dtype) for m in linears]

    @torch.inference_mode()
    def matmuls():
        for m, x in zip(linears, inputs):
            m(x)
    gemm = best(matmuls, repeats=10)
    hf_total, ceiling_total = hf_prefill + new_tokens * hf_step, our_prefill + new_tokens * gemm
    return [f"{our_prefill:.2f}", f"{hf_prefill:.2f}", f"{our_step * 1e3:.1f}", f"{hf_step * 1e3:.1f}",
            f"{gemm * 1e3:.1f}", f"{hf_total / ceiling_total:.2f}x"]


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40": 181e12, "A10": 125e12}


def bench_ppo(args: list) -> None:
    """Learner speed: our model's forward+backward against transformers' on the same batch and weights
    (next-token cross-entropy, no checkpointing, both sides), plus one full `Learner.update` (checkpointed
    layers, PPO loss, KL, entropy, AdamW). tokens/s = batch tokens / median of --steps timed steps. On
    CUDA: bf16 autocast and MFU = 6 x params x tokens/s / peak bf16 FLOP/s (attention FLOPs left out).
        python bench.py ppo [--quick (~8M models, seq <= 128)] [--device cuda] [--batch 4] [--seq 256] [--steps 3]"""
    import tempfile
    from contextlib import nullcontext
    import torch
    import torch.nn.functional as F
    from ppo import Learner, make_batch
    a = flags(args, "ppo", device=("cpu", "cuda"), models="qwen3,qwen3_5", batch=4, seq=256, steps=3, quick=False)
    models = [m for m in a.models.split(",") if m]
    B, T = a.batch, min(a.seq, 128) if a.quick else a.seq
    if set(models) - {"qwen3", "qwen3_5"} or B < 1 or T < 2 or a.steps < 1:
        raise SystemExit("bench.py ppo: --models takes qwen3,qwen3_5; need --batch >= 1, --seq >= 2, --steps >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    cuda = a.device == "cuda"
    dev = torch.device(a.device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
    rows = []
    for arch in models:
        with tempfile.TemporaryDirectory() as d:
            ours, hf = model_pair(arch, a.device, torch.float32, d, quick=a.quick, train=True)
        tokens = torch.randint(0, ours.config.vocab_size, (B, T), device=dev)

        def fwd_bwd(model, is_hf):
            def step():
                with autocast():
                    out = model(tokens)
                    logits = out.logits if is_hf else out  # (B, T, V)
                F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
                model.zero_grad(set_to_none=True)
            return step
        (_, t_ours), (_, t_hf) = interleaved_times([fwd_bwd(ours, False), fwd_bwd(hf, True)], a.steps, sync)
        del hf
        # one PPO update on the same tokens; the second half of each row plays the policy's reply
        learner = Learner(ours, ref_model=None, lr=1e-6, micro_batch_tokens=B * T, generation_copy=False)
        mask = [[0] * (T // 2) + [1] * (T - T // 2) for _ in range(B)]
        batch = make_batch(tokens.tolist(), mask, [[-5.0 * m for m in r] for r in mask],
                           [1.0, -1.0] * (B // 2) + [1.0] * (B % 2))

        def update():
            batch.versions[:] = learner.version
            learner.update(batch)
        ((_, t_upd),) = interleaved_times([update], a.steps, sync)
        n = sum(q.numel() for q in ours.parameters())
        mfu = [f"{6 * n * B * T / t / peak:.1%}" if peak else "-" for t in (t_ours, t_hf, t_upd)]
        rows.append([arch, f"{n / 1e6:.1f}M", f"{B * T / t_ours:,.0f}", f"{B * T / t_hf:,.0f}",
                     f"{t_hf / t_ours:.2f}x", f"{B * T / t_upd:,.0f}"] + mfu)
        del learner, ours
    print(f"\nLearner: forward+backward tokens/s, ours vs transformers ({a.device}, "
          f"{'bf16 autocast' if cuda else 'fp32'}, batch {B} x {T})\n")
    print(md_table(["model", "params", "ours tok/s", "transformers tok/s", "ours / transformers",
                    "Learner.update tok/s", "MFU ours", "MFU transformers", "MFU update"], rows))


def bench_sandbox(args: list) -> None:
    """The cost of a sandboxed command against a bare subprocess (target: <= 2x). Latency: `Sandbox.run
    ("true")` vs `bash -c true`, interleaved one by one, medians. Throughput: --parallel threads, each with
    its own sandbox (or bare subprocesses), --per-thread commands each.
        python bench.py sandbox [--n 300] [--parallel 32] [--per-thread 20]"""
    import subprocess
    import threading
    from sandbox import Sandbox
    a = flags(args, "sandbox", n=300, parallel=32, per_thread=20)

    def bare():
        subprocess.run(["bash", "-c", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)

    def throughput(make_runner) -> float:
        runners = [make_runner() for _ in range(a.parallel)]
        barrier = threading.Barrier(a.parallel + 1)

        def work(run):
            barrier.wait()
            for _ in range(a.per_thread):
                run()
        threads = [threading.Thread(target=work, args=(r,)) for r in runners]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        return a.parallel * a.per_thread / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    sb = Sandbox(timeout=10)
    start_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(10):  # warm up both paths (page cache, first fork of each process)
        sb.run("true"), bare()
    (_, bare_s), (_, boxed_s) = interleaved_times([bare, lambda: sb.run("true")], a.n, warmup=False)
    describe = sb.describe()
    sb.close()
    boxes = []
    try:
        bare_tput = throughput(lambda: bare)
        boxed_tput = throughput(lambda: boxes.append(Sandbox(timeout=10)) or (lambda s=boxes[-1]: s.run("true")))
    finally:
        for s in boxes:
            s.close()
    print(f"sandbox: {describe}; helper start {start_ms:.0f} ms (once per sandbox)\n")
    print(md_table(["measure", "bare subprocess", "Sandbox.run", "ratio (sandbox / bare)"], [
        [f"latency of `true`, median of {a.n} (ms)", f"{bare_s * 1e3:.2f}", f"{boxed_s * 1e3:.2f}",
         f"{boxed_s / bare_s:.2f}x"],
        [f"throughput, {a.parallel} threads x {a.per_thread} (cmd/s)", f"{bare_tput:.0f}", f"{boxed_tput:.0f}",
         f"{bare_tput / boxed_tput:.2f}x time per command"]]))


def bench_envs(args: list) -> None:
    """Environment speed and scripted-agent scores, side by side in one process.
    alchemy: steps/s with random valid actions (the env alone), the reference policy and the oracle
    (exact search each step), as ratios to random. camg: per env, the reference policy on the first test
    tasks (groups in order, one instance) with memory kept vs blanked before every task, and a random
    policy. codebase: reset, a shell command, a no-op and a resolving submit, vs a bare `python -c pass`.
        python bench.py envs [--which alchemy,camg,codebase] [--tasks 100] [--camg-tasks 24]"""
    import random
    import re
    import subprocess
    from alchemy import oracle_policy, parse_observation
    from envs import make
    a = flags(args, "envs", which="alchemy,camg,codebase", tasks=100, camg_tasks=24)

    def play(env, task, policy) -> tuple:
        obs, done, steps, total = env.reset(task), False, 0, 0.0
        while not done:
            obs, r, done = env.step(policy(obs))
            steps, total = steps + 1, total + r
        return steps, total

    def random_alchemy(rng):
        def act(obs):
            s = parse_observation(obs)
            return rng.choice([f"apply p{q} s{t}" for q in s["potions"] for t in s["stones"]]
                              + [f"cauldron s{t}" for t in s["stones"]] + ["end"])
        return act
    if "alchemy" in a.which:
        env = make("alchemy")
        tasks = env.tasks("train")
        tasks = tasks[:: max(1, len(tasks) // a.tasks)][: a.tasks]
        rows = []
        for name, make_actor in (("random valid actions (env only)", lambda t, i: random_alchemy(random.Random(i))),
                                 ("reference policy (infers chemistry)", lambda t, i: env.reference_policy(t)),
                                 ("oracle (exact search each step)", lambda t, i: oracle_policy(env))):
            t0 = time.perf_counter()
            runs = [play(env, t, make_actor(t, i)) for i, t in enumerate(tasks)]
            steps, sec = sum(s for s, _ in runs), time.perf_counter() - t0
            rows.append([name, steps, f"{sec:.2f}", steps / sec, f"{sum(r for _, r in runs) / len(tasks):.3f}"])
        print(f"Alchemy: {len(tasks)} train tasks\n")
        print(md_table(["driver", "steps", "seconds", "steps/s", "vs random", "mean score"],
                       [r[:3] + [f"{r[3]:,.0f}", f"{r[3] / rows[0][3]:.2f}x", r[4]] for r in rows]) + "\n")
    randoms = {  # valid action forms picked at random from what the observation shows
        "shop": lambda rng, obs: rng.choice(["search[blue jacket]", "buy", "click[next]", "click[back]", "shell: ls"]
                                            + [f"click[{i}]" for i in re.findall(r"\[(B\d+)\]", obs)]),
        "deepresearch": lambda rng, obs: rng.choice([f"search[{w}]" for w in re.findall(r"[A-Z][a-z]+", obs)[:5]]
                                                    + [f"open[{i}]" for i in re.findall(r"\[(d\d+)\]", obs)]
                                                    + [f"answer[{w}]" for w in re.findall(r"[A-Z][a-z]+", obs)[:3]]),
        "autoresearch": lambda rng, obs: rng.choice(["shell: ls", "run", "evaluate", "shell: cat README.md"])}
    if "camg" in a.which:
        rows = []
        for name, rand in randoms.items():
            env = make(name)
            try:
                tasks = sorted(env.tasks("test"), key=lambda t: (t.group, t.difficulty, t.id))[: a.camg_tasks]
                t0, res = time.time(), {}
                for mode in ("memory", "scratch", "random"):
                    rng, scores, group = random.Random(0), [], None
                    for task in tasks:
                        if mode != "memory" or task.group != group:
                            env.set_memory_files({})  # a new stream (group) or from scratch: blank memory
                        group = task.group
                        pol = (lambda obs: rand(rng, obs)) if mode == "random" else env.reference_policy(task)
                        scores.append((play(env, task, pol)[1], bool(env.info.get("success"))))
                    res[mode] = (sum(s for _, s in scores) / len(tasks), sum(r for r, _ in scores))
                rows.append([name, len(tasks)] + [f"{res[m][0]:.0%} / {res[m][1] / len(tasks):.2f}" for m in res]
                            + [f"{res['memory'][1] - res['scratch'][1]:+.2f}", f"{time.time() - t0:.1f}"])
            finally:
                env.close()
        print(md_table(["env", "tasks", "memory: success / reward", "scratch: success / reward",
                        "random: success / reward", "gain (sum)", "s"], rows) + "\n")
    if "codebase" in a.which:
        import codebase as cb
        best = lambda fn: interleaved_times([fn], 3, warmup=False)[0][0]  # noqa: E731  (best of 3)
        base = best(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True))
        env, rows = cb.CodebaseEnv(), []
        try:
            for stream in cb.long_streams().values():
                task = stream[0]
                reset = best(lambda: env.reset(task))
                command = best(lambda: env.step("ls"))  # after the last reset: 3 of its 40 steps
                noop = best(lambda: (env.reset(task), env.step("submit")))
                fix = best(lambda: (env.reset(task), env.step(env.reference_policy(task)("")), env.step("submit")))
                rows += [[task.id, what, f"{sec:.3f}", f"{sec / base:.1f}"] for what, sec in (
                    ("reset", reset), ("shell command", command), ("reset + no-op submit", noop),
                    ("reset + fix + resolving submit", fix))]
        finally:
            env.close()
        print(md_table(["task", "step", "seconds", f"x `python -c pass` ({base * 1000:.0f} ms)"], rows))


def bench_camg(args: list) -> None:
    """camg.py's asynchrony: the same short CAMG-RL run with rollout inline (synchronous) vs 1 and 2 rollout
    worker processes. Per setting: wall time, steady seconds per update (after the first), episodes the
    learner received per second, version lag of trained episodes, episodes dropped as stale. On a 2-core
    CPU workers and learner share the cores, so the gain is bounded; on GPUs they run on separate devices.
        python bench.py camg [--steps 4] [--workers 0,1,2] [--eta 2]"""
    import tempfile
    import torch
    import camg
    a = flags(args, "camg", model="tiny", steps=4, workers="0,1,2", eta=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.workers.split(",")]:
            run = Path(tmp) / f"w{n}"
            cfg = camg.parse_args(["--model", a.model, "--steps", str(a.steps), "--num_workers", str(n),
                                   "--eta", str(a.eta), "--run_dir", str(run), "--eval_tasks", "0"])
            os.environ["CAMG_SESSION"] = f"bench{n}"  # what camg.main() sets: the workers' exchange session
            torch.set_num_threads(camg.cpu_threads(cfg, n + 1))
            t0 = time.perf_counter()
            camg.learner_main(cfg, camg.Dist(), num_spawn=n)
            wall = time.perf_counter() - t0
            eps = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
            lags = [e["lag"] for e in eps if e["used"] == "train"]
            steady = [json.loads(line)["update_s"] for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
            rows.append((n, wall, sum(steady) / max(len(steady), 1), len(eps), sum(lags) / max(len(lags), 1),
                         max(lags, default=0), sum(e["used"] == "stale" for e in eps)))
    print(f"\nCAMG-RL asynchrony ({a.model}, {a.steps} updates, eta {a.eta}). wall: the whole run with start-up; "
          "steady: mean seconds per update after the first (waiting for episodes + training)\n")
    print(md_table(["rollout", "wall s", "steady s / update", "episodes received / s", "lag mean", "lag max",
                    "dropped stale", "steady speed-up"],
                   [["inline (sync)" if n == 0 else f"{n} worker process{'es' if n > 1 else ''}", f"{wall:.1f}",
                     f"{steady:.2f}", f"{num / wall:.2f}", f"{lag:.2f}", lag_max, stale, f"{rows[0][2] / steady:.2f}x"]
                    for n, wall, steady, num, lag, lag_max, stale in rows]))


# -----------------------------------------------------------------------------
# the RIME ablation table: python bench.py ablations

# (name, rime.py flags, the paper's direction for its held-out gain)
ABLATIONS = [
    ("full RIME", [], "gain > 0"),
    ("--no-explore", ["--no-explore"], "below full (the paper: negative)"),
    ("--writer frozen", ["--writer", "frozen"], "about 0"),
    ("--actor frozen", ["--actor", "frozen"], "below full"),
    ("--writer decoupled", ["--writer", "decoupled"], "below full (shared weights win)"),
    ("--order shuffled", ["--order", "shuffled"], "below full"),
    ("--segment 6 (6+6)", ["--segment", "6"], "above 3+3 (the paper: 6+6 beats 3+3)"),
]


def bench_ablations(args: list) -> None:
    """Train and evaluate RIME's ablations at the laptop budget, `--seeds` seeds each, and print mean ±
    std of the held-out gain after RL (and of the RL effect, after minus before) beside the paper's
    direction. Each run is `python rime.py <flags> --seed S --run-dir <results>/<variant>/seed<S>`, a
    subprocess of its own, so a run resumes from its checkpoint and a finished run (its summary.json)
    is never redone: rerun the same command after an interruption. The figures are those rime.py's
    own evaluation measured on each run's trained policy (its `final/` HF directory). Extra flags after
    `--` go to every run (e.g. `-- --steps 8`).
        python bench.py ablations [--seeds 3] [--only "full RIME,--no-explore"] [--results results/ablations]"""
    import subprocess
    extra = args[args.index("--") + 1:] if "--" in args else []
    a = flags(args[: args.index("--")] if "--" in args else args, "ablations", seeds=3,
              results="results/ablations", only="")
    chosen = [x for x in ABLATIONS if not a.only or x[0] in [o.strip() for o in a.only.split(",")]]
    if not chosen or a.seeds < 1:
        cli.fail("bench.py ablations", f"--only names none of: {', '.join(x[0] for x in ABLATIONS)}"
                 if not chosen else "--seeds must be >= 1")
    here = Path(__file__).resolve().parent
    root = Path(a.results)
    jobs = [(name, fl, s) for name, fl, _ in chosen for s in range(a.seeds)]
    results = {}
    with tqdm(total=len(jobs), desc="ablations") as bar:
        for name, fl, seed in jobs:
            run_dir = root / name.split(" (")[0].strip("-").replace(" ", "_") / f"seed{seed}"
            summary = run_dir / "summary.json"
            if not summary.exists():
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                with open(run_dir.parent / f"seed{seed}.log", "a") as log:
                    p = subprocess.run([sys.executable, str(here / "rime.py"), *fl, *extra, "--seed", str(seed),
                                        "--run-dir", str(run_dir)], stdout=log, stderr=subprocess.STDOUT)
                if p.returncode != 0 or not summary.exists():
                    tqdm.write(f"{name} seed {seed}: failed (exit {p.returncode}); see {run_dir.parent}/seed{seed}.log")
                    bar.update(1)
                    continue
            results.setdefault(name, []).append(json.loads(summary.read_text())["rl_effect"])
            bar.update(1)

    def ms(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "n/a"
        return f"{statistics.mean(xs):+.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f}"
    rows = []
    for name, _, direction in chosen:
        effs = results.get(name, [])
        rows.append([name, len(effs), ms([e["gain_after"] for e in effs]), ms([e["delta"] for e in effs]),
                     direction])
    table = md_table(["variant", "seeds", "held-out gain after RL (mean ± std)", "RL effect on gain (mean ± std)",
                      "the paper's direction"], rows)
    root.mkdir(parents=True, exist_ok=True)
    (root / "table.md").write_text(table + "\n")
    (root / "results.json").write_text(cli.dumps(results, indent=2))
    print("\n" + table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, (name, _, _) in enumerate(chosen):
            ys = [e["gain_after"] for e in results.get(name, []) if e["gain_after"] is not None]
            ax.scatter([i] * len(ys), ys, color="C0")
            if ys:
                ax.hlines(statistics.mean(ys), i - 0.3, i + 0.3, color="C1")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xticks(range(len(chosen)), [n for n, _, _ in chosen], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("held-out gain after RL")
        fig.tight_layout()
        fig.savefig(root / "ablations.png", dpi=120)
        plt.close(fig)
    except ImportError:
        pass
    print(f"table in {root / 'table.md'}, runs under {root}")


SUBCOMMANDS = {"ablations": bench_ablations, "engine": bench_engine, "sandbox": bench_sandbox, "envs": bench_envs, "ppo": bench_ppo,
               "camg": bench_camg}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        cli.fail("bench.py", str(e))
    return bench(cfg)


if __name__ == "__main__":
    main()
