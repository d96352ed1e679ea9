"""CAMG-RL: one policy trained on Shop, Coding, DeepResearch and AutoResearch with fully asynchronous
PPO (actor + critic, GAE, token-level decoupled loss), learning file-based memory from the task reward.

    python camg.py                                     # short CPU run: SmolLM2-135M, 2 processes (1 worker)
    python camg.py --model tiny --steps 2              # smoke run (< 1 minute), tiny random model
    python camg.py --model tiny --steps 2 --num_workers 0          # single process: rollout inline
    python camg.py --eval_only --eval_memory full,blank,shuffle,continuation   # memory ablations
    torchrun --nproc_per_node 8 camg.py --model <HF dir> --steps 200 --batch_episodes 64 \
        --rollout_batch 16 --eval_tasks 128 --eval_stream_len 12 --max_turns 40 \
        --max_new_tokens 512 --context_budget 16384 --exchange_dir /dev/shm/camg   # full scale

The run directory (--run_dir) holds config.json, metrics.jsonl (one line per update: reward parts per
environment, approx_kl, clipfrac, entropy, value loss, explained variance, grad norm, tokens/s,
staleness), episodes.jsonl (every episode that reached the learner and what became of it), the
checkpoint `ckpt/` (ppo.Learner.save; the run resumes from it by default) and eval.md / eval.json.

How the pieces move (DESIGN.md "Asynchronous PPO", AReaL's design):
- Rollout workers generate continuously with the newest weights they have, in streams of tasks whose
  `.agent_memory/` folder persists from task to task (a new stream starts blank). Each episode carries
  the policy version that generated it. The CONTINUATION.md context-reset protocol of rollout.py is on
  (--context_budget); the reset samples nothing and adds no row.
- Every hand-off between processes is a file renamed into place under the exchange directory: episode
  batches into a bounded queue (a worker waits while --max_queue batches are queued), weights (state
  dict + version) from the learner back to the workers. A rename is atomic, so nobody reads half a file,
  and nothing waits inside a collective for a slow peer. With plain `python`, --num_workers processes
  are spawned (0 = rollout inline, single process); under torchrun the first --train_ranks ranks form
  the train group (their own process group, FSDP2) and the other ranks are rollout workers.
- The learner takes --batch_episodes episodes, drops episodes more than eta versions old
  (ppo.fresh_rows) and trains with the decoupled objective: behaviour logprobs come from the worker,
  proximal logprobs are recomputed by the learner. Stale rows are *dropped, not down-weighted*: inside
  the bound the importance weight pi_prox / pi_behav already corrects them without bias, and past it
  that weight has too much variance to be worth a gradient; any down-weighting curve would be an
  arbitrary bias of its own.
- Credit: memory actions (writing notes, CONTINUATION.md) and task actions share the task return; no
  separate memory reward. Every training row of an episode (each context closed by a reset, then the
  last one) gets the episode's score at its last policy token and GAE runs with the critic (value head)
  over the row's policy tokens. Failed episodes (the environment raised) are logged with their reason
  and not trained on: the failure is the environment's, not the policy's.
- Evaluation: --eval_tasks test tasks per environment (128 in the paper), greedy, as streams (each a
  test group's tasks in order, memory carried); success per environment and their average in the
  paper's Table 2 layout beside the published rows. Memory ablations (--eval_memory): `blank` empties
  the saved memory before every task, `shuffle` swaps in another stream's memory folder, `continuation`
  keeps only CONTINUATION.md (the paper trains that ablation: --train_memory continuation).

Where this departs from the paper: small defaults sized for a 2-core CPU (the paper: 200 updates, 4B/9B
models, 128 test tasks per env); weights travel through files, not an NCCL broadcast (use a tmpfs
--exchange_dir at scale); no KL to a reference by default (--kl_coef adds one); a segment's GAE chain
ends at its own last policy token instead of bootstrapping from the next segment's first value (equal
with the default gamma = lam = 1); worker stream positions are not checkpointed (a resumed run starts
fresh streams); the environments are this repo's local re-creations, not the paper's.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

import envs
from ppo import Dist, Learner, fresh_rows, init_distributed, make_batch, print0
from rewards import gae
from rollout import CONTINUATION_PATH, run_episodes

ENV_NAMES = ("shop", "coding", "deepresearch", "autoresearch")
TITLES = {"shop": "Shop", "coding": "Coding", "deepresearch": "DeepResearch", "autoresearch": "AutoResearch"}
MEMORY_MODES = ("full", "blank", "shuffle", "continuation")
CONTINUATION_FILE = CONTINUATION_PATH.split("/", 1)[1]           # "CONTINUATION.md" inside .agent_memory/
# Table 2 of the CAMG paper, success (%): (row, Shop, Coding, DeepResearch, AutoResearch, average)
PAPER_ROWS = [
    ("CAMG-RL-4B", 97.1, 26.6, 55.5, 38.3, 54.4),
    ("CompactionRL-4B", 97.5, 19.5, 50.8, 24.2, 48.0),
    ("Qwen3.5-4B (frozen)", 11.6, 10.9, 36.7, 10.2, 17.4),
    ("CAMG-RL-4B, memory blanked", 97.1 - 29.4, 26.6 - 13.8, 55.5 - 4.8, 38.3 - 8.3, 40.3),
    ("CAMG-RL-4B, trained continuation-only", None, None, None, None, 41.8),
    ("CAMG-RL-4B, no gradient through memory actions", None, None, None, None, 21.1),
]

# -----------------------------------------------------------------------------------------------
# config: one dataclass, every field a command-line flag (--name value)


@dataclass
class Config:
    model: str = "smollm2"          # "tiny" (random ~1M model), "smollm2" (SmolLM2-135M-Instruct) or an HF dir
    run_dir: str = "runs/camg"      # config, metrics, episodes, checkpoint, eval; resumed if it has a checkpoint
    resume: bool = True             # resume from run_dir/ckpt when it exists
    seed: int = 0
    steps: int = 2                  # PPO updates (the paper: 200)
    env_weights: str = "shop=1,coding=1,deepresearch=1,autoresearch=1"   # episode mix; 0 leaves an env out
    batch_episodes: int = 4         # episodes per update
    rollout_batch: int = 4          # episodes a worker runs together (one batched generate per turn)
    num_workers: int = 1            # plain python: rollout worker processes; 0 = rollout inline (one process)
    train_ranks: int = 0            # torchrun: ranks in the train group (0 = half); the rest are workers
    eta: int = 2                    # staleness bound: drop episodes more than eta versions old (0 = synchronous)
    max_queue: int = 4              # bounded queue, in rollout batches; a worker waits while it is full
    max_turns: int = 4              # actions per episode (environments also stop at their own budget)
    max_new_tokens: int = 48        # tokens per reply
    context_budget: int = 1024      # tokens per context; near it the CONTINUATION.md reset protocol runs
    temperature: float = 1.0        # sampling temperature of the workers (evaluation is greedy)
    train_memory: str = "full"      # memory kept between training tasks: full | blank | continuation
    lr: float = 1e-6
    weight_decay: float = 0.1
    clip_low: float = 0.2
    clip_high: float = 0.28
    vf_coef: float = 0.5            # value-loss weight (the critic shares the policy's trunk)
    kl_coef: float = 0.0            # k1 KL to a frozen reference; 0 = no reference model
    entropy_coef: float = 0.0
    gamma: float = 1.0              # GAE discount per policy token
    lam: float = 1.0                # GAE lambda
    num_minibatches: int = 1        # optimizer steps per update
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096  # padded tokens per forward in the learner
    eval_tasks: int = 2             # test tasks per environment (the paper: 128)
    eval_stream_len: int = 1        # tasks per evaluation stream (a test group's first tasks, memory carried)
    eval_memory: str = "full"       # comma list of memory modes to evaluate: full,blank,shuffle,continuation
    eval_every: int = 0             # also evaluate every this many updates (0 = only at the end)
    eval_only: bool = False         # evaluate the (resumed or initial) model, no training
    save_every: int = 50            # checkpoint every this many updates (and at the end)
    exchange_dir: str = ""          # where episodes and weights travel ("" = run_dir/exchange)
    worker_timeout_s: float = 1800.0  # the learner gives up when no episode arrives for this long
    slow_worker_s: float = 0.0      # testing: a worker sleeps this long after each rollout batch (a straggler)
    device: str = ""                # "" = cuda if available else cpu

    def __post_init__(self):
        self.weights = parse_weights(self.env_weights)
        self.eval_modes = [m.strip() for m in self.eval_memory.split(",") if m.strip()]
        bad = [m for m in self.eval_modes if m not in MEMORY_MODES]
        assert not bad and self.eval_modes, f"--eval_memory: unknown mode(s) {bad}; use {','.join(MEMORY_MODES)}"
        assert self.train_memory in ("full", "blank", "continuation"), \
            f"--train_memory must be full, blank or continuation, got {self.train_memory!r}"
        assert self.steps >= 0 and self.eta >= 0, "--steps and --eta must be >= 0"
        assert self.batch_episodes >= 1 and self.rollout_batch >= 1 and self.max_queue >= 1, \
            "--batch_episodes, --rollout_batch and --max_queue must be >= 1"
        assert self.num_workers >= 0 and self.train_ranks >= 0, "--num_workers and --train_ranks must be >= 0"
        assert self.max_turns >= 1 and self.max_new_tokens >= 1, "--max_turns and --max_new_tokens must be >= 1"
        assert self.context_budget >= 2 * self.max_new_tokens + 64, \
            f"--context_budget {self.context_budget} leaves no room for the prompt and two replies " \
            f"of {self.max_new_tokens} tokens: raise it or lower --max_new_tokens"
        assert self.eval_tasks >= 0 and self.eval_stream_len >= 1, "--eval_tasks >= 0 and --eval_stream_len >= 1"
        assert self.num_minibatches >= 1 and self.num_minibatches <= self.batch_episodes, \
            "--num_minibatches must be in [1, batch_episodes]"
        assert 0 < self.gamma <= 1 and 0 <= self.lam <= 1, "--gamma in (0, 1], --lam in [0, 1]"
        assert self.save_every >= 1 and self.worker_timeout_s > 0, "--save_every >= 1, --worker_timeout_s > 0"


def parse_weights(text: str) -> dict:
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, w = part.partition("=")
        assert name in ENV_NAMES, f"--env_weights: unknown environment {name!r}; use {', '.join(ENV_NAMES)}"
        try:
            weights[name] = float(w)
        except ValueError:
            raise AssertionError(f"--env_weights: {part!r} is not name=weight") from None
        assert weights[name] >= 0, f"--env_weights: {name} has a negative weight"
    assert sum(weights.values()) > 0, "--env_weights: at least one environment needs a positive weight"
    return {n: w for n, w in weights.items() if w > 0}


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description="CAMG-RL: asynchronous PPO across the four CAMG environments")
    for f in fields(Config):
        if isinstance(f.default, bool):
            p.add_argument(f"--{f.name}", nargs="?", const=True, default=f.default,
                           type=lambda s: {"true": True, "1": True, "false": False, "0": False}[s.lower()])
        else:
            p.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    try:
        return Config(**vars(args))
    except AssertionError as e:     # a bad config is a clear error before any work starts
        p.error(str(e))


def check_setup(cfg: Config) -> None:
    """What would fail deep inside a run, checked up front with a message saying what to change."""
    if cfg.model not in ("tiny", "smollm2") and not (Path(cfg.model) / "config.json").exists():
        sys.exit(f"camg.py: --model {cfg.model!r} is neither 'tiny', 'smollm2' nor an HF dir with config.json")
    if "coding" in cfg.weights:
        try:
            import codebase
            codebase.require_cache()
        except Exception as e:  # noqa: BLE001 - any reason the coding env cannot start
            sys.exit(f"camg.py: the coding environment cannot start ({e}); run `python codebase.py fetch` "
                     "or leave it out: --env_weights shop=1,coding=0,deepresearch=1,autoresearch=1")


def num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_model(name: str, device: torch.device, seed: int):
    from model import load, load_tokenizer, tiny
    if name == "tiny":
        model, tokenizer = tiny(seed=seed)
    else:
        model, tokenizer = load(name), load_tokenizer(name)
    return model.to(device), tokenizer


# -----------------------------------------------------------------------------------------------
# records and the exchange: episodes and weights move between processes as atomically renamed files


@dataclass
class Sample:
    """One finished episode on its way from a worker to the learner."""
    env: str
    task_id: str
    version: int                    # policy version that generated it
    worker: int
    score: float
    success: float
    finish: str                     # "done" | "turns" | "error"
    error: str = ""                 # why it failed (environment raised, rollout crashed, ...); "" = fine
    rows: list = field(default_factory=list)   # (tokens, loss_mask, logprobs), one per context
    num_turns: int = 0
    num_resets: int = 0
    gen_tokens: int = 0
    gen_s: float = 0.0


def _write_atomic(path: Path, obj, saver=None) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    if saver is None:
        tmp.write_bytes(pickle.dumps(obj))
    else:
        saver(obj, tmp)
    os.replace(tmp, path)           # readers only ever list finished files


class Exchange:
    """A directory shared by the learner and the workers of one launch (a session)."""

    def __init__(self, root, max_queue: int = 4):
        self.root, self.max_queue = Path(root), max_queue
        self.queue = self.root / "queue"
        self.queue.mkdir(parents=True, exist_ok=True)
        self.seq = 0

    def queued(self) -> list[Path]:
        return sorted(p for p in self.queue.iterdir() if not p.name.startswith("."))   # oldest first

    def put(self, samples: list, worker: int, keep_waiting=lambda: True) -> bool:
        """Queue one rollout batch; waits while the queue is full. False if told to stop while waiting."""
        while len(self.queued()) >= self.max_queue:
            if self.stopped() or not keep_waiting():
                return False
            time.sleep(0.05)
        self.seq += 1
        _write_atomic(self.queue / f"{time.time_ns():020d}-w{worker:03d}-{self.seq:06d}.pkl", samples)
        return True

    def take(self) -> list:
        """Every queued episode, oldest batch first; the files are consumed."""
        out = []
        for p in self.queued():
            out += pickle.loads(p.read_bytes())
            p.unlink()
        return out

    def publish(self, state_dict: dict, version: int) -> None:
        _write_atomic(self.root / f"weights-v{version:06d}.pt",
                      {k: v.detach().cpu() for k, v in state_dict.items()}, torch.save)
        for old in sorted(self.root.glob("weights-v*.pt"))[:-2]:   # a worker may still be reading the previous
            old.unlink(missing_ok=True)

    def latest_version(self) -> int:
        found = sorted(self.root.glob("weights-v*.pt"))
        return int(found[-1].stem[len("weights-v"):]) if found else -1

    def load_weights(self, version: int, device):
        try:
            return torch.load(self.root / f"weights-v{version:06d}.pt", map_location=device, weights_only=True)
        except FileNotFoundError:   # replaced by a newer version meanwhile: the caller asks again
            return None

    def write(self, name: str, obj) -> None:
        _write_atomic(self.root / name, obj)

    def read(self, name: str):
        p = self.root / name
        return pickle.loads(p.read_bytes()) if p.exists() else None

    def stop(self) -> None:
        (self.root / "STOP").touch()

    def stopped(self) -> bool:
        return (self.root / "STOP").exists()

    def errors(self) -> list[str]:
        return [p.read_text() for p in sorted(self.root.glob("worker*.error"))]


def session_dir(cfg: Config) -> Path:
    """One exchange subdirectory per launch, named the same by every process of it, so leftovers of an
    earlier launch (its STOP file, its weights) are never mistaken for this one's."""
    base = Path(cfg.exchange_dir or Path(cfg.run_dir) / "exchange")
    if os.environ.get("CAMG_SESSION"):                  # plain python: set by the learner for its workers
        return base / os.environ["CAMG_SESSION"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return base / (f"torchrun-{run_id}" if run_id != "none" else f"torchrun-ppid{os.getppid()}")


# -----------------------------------------------------------------------------------------------
# memory between tasks: what the next task starts with (the ablations are modes of this)


def apply_memory_mode(env_list: list, mode: str) -> None:
    """Before each env's next task. full: keep; blank: empty the saved memory; continuation: keep only
    CONTINUATION.md; shuffle: env i gets the memory folder of env i+1 (another stream's notes)."""
    if mode == "blank":
        for e in env_list:
            e.set_memory_files({})
    elif mode == "continuation":
        for e in env_list:
            e.set_memory_files({k: v for k, v in e.memory_files().items() if k == CONTINUATION_FILE})
    elif mode == "shuffle":
        assert len(env_list) >= 2, "memory mode 'shuffle' needs at least 2 streams: raise --eval_tasks"
        snaps = [e.memory_files() for e in env_list]
        for i, e in enumerate(env_list):
            e.set_memory_files(snaps[(i + 1) % len(snaps)])


def memory_note(env) -> str:
    """The memory text of the first user turn: the saved files' *paths*, never their contents (as after a
    context reset); the policy reads what it needs with a shell action."""
    paths = [f".agent_memory/{p}" for p in sorted(env.memory_files())]
    if not paths:
        return "No saved memory files yet. Notes you write under .agent_memory/ are kept for later tasks."
    return "Saved memory files (read them with a shell action, e.g. cat PATH): " + ", ".join(paths)


def to_samples(episodes, names, version, worker, gen_s) -> list[Sample]:
    out = []
    for ep, name in zip(episodes, names):
        rows = [(r.tokens, r.loss_mask, r.logprobs) for r in ep.rows() if len(r.tokens) >= 2]
        out.append(Sample(env=name, task_id=ep.task.id, version=version, worker=worker, score=float(ep.score),
                          success=0.0 if ep.error else float(ep.info.get("success", 0.0)), finish=ep.finish,
                          error=ep.error, rows=rows, num_turns=ep.num_turns, num_resets=ep.num_resets,
                          gen_tokens=sum(sum(m) for _, m, _ in rows), gen_s=gen_s))
    return out


def failed_sample(name, task, version, worker, reason) -> Sample:
    return Sample(env=name, task_id=task.id, version=version, worker=worker, score=0.0, success=0.0,
                  finish="error", error=reason)


# -----------------------------------------------------------------------------------------------
# rollout worker: streams of training tasks per environment, one batched rollout at a time


@dataclass
class Stream:
    env: object                     # one env instance: its .agent_memory/ carries over between tasks
    tasks: list = field(default_factory=list)
    pos: int = 0


class RolloutWorker:
    """Holds a generation model, its version and open task streams. rollout_batch() never raises: an
    episode that cannot run comes back as a failed Sample with its reason."""

    def __init__(self, cfg: Config, model, tokenizer, worker_id: int = 0, seed: int = 0, make_env=envs.make):
        self.cfg, self.model, self.tokenizer, self.worker_id = cfg, model, tokenizer, worker_id
        self.version = 0
        self.rng = random.Random(seed)
        self.names = list(cfg.weights)
        self.protos = {n: make_env(n) for n in self.names}
        self.groups = {}                # env -> [tasks of one train group, in order (easy -> hard)]
        for n, env in self.protos.items():
            by_group = {}
            for t in env.tasks("train"):
                by_group.setdefault(t.group, []).append(t)
            assert by_group, f"environment {n} has no train tasks"
            self.groups[n] = list(by_group.values())
        self.streams = {n: [] for n in self.names}
        self.num_batches = 0

    def _next(self, name: str, busy: set) -> tuple[Stream, object]:
        free = [s for s in self.streams[name] if id(s) not in busy]
        if not free:                    # one env instance per stream in flight; clones share the worlds
            env = self.protos[name] if not self.streams[name] else self.protos[name].clone()
            self.streams[name].append(Stream(env))
            free = self.streams[name][-1:]
        s = free[0]
        busy.add(id(s))
        if s.pos >= len(s.tasks):       # a new stream: another group's tasks, starting from blank memory
            s.tasks, s.pos = self.rng.choice(self.groups[name]), 0
            s.env.set_memory_files({})
        s.pos += 1
        return s, s.tasks[s.pos - 1]

    def rollout_batch(self) -> list[Sample]:
        cfg, busy = self.cfg, set()
        names = self.rng.choices(self.names, weights=[cfg.weights[n] for n in self.names], k=cfg.rollout_batch)
        picks = [(n, *self._next(n, busy)) for n in names]
        out, run = [None] * len(picks), []
        for i, (name, stream, task) in enumerate(picks):
            try:
                apply_memory_mode([stream.env], cfg.train_memory)
                run.append((i, memory_note(stream.env)))
            except Exception as e:  # noqa: BLE001 - a broken workspace fails its episode, not the worker
                out[i] = failed_sample(name, task, self.version, self.worker_id, f"memory: {e!r}")
        t0 = time.perf_counter()
        self.num_batches += 1
        try:
            eps = run_episodes(self.model, self.tokenizer, [picks[i][1].env for i, _ in run],
                               [picks[i][2] for i, _ in run], memory=[m for _, m in run],
                               temperature=cfg.temperature, seed=self.rng.randrange(1 << 30),
                               max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                               context_budget=cfg.context_budget) if run else []
            dt = time.perf_counter() - t0
            for (i, _), s in zip(run, to_samples(eps, [picks[i][0] for i, _ in run], self.version,
                                                 self.worker_id, dt)):
                out[i] = s
        except Exception as e:  # noqa: BLE001 - e.g. generation failed: every episode of the batch fails
            for i, _ in run:
                out[i] = failed_sample(picks[i][0], picks[i][2], self.version, self.worker_id,
                                       f"rollout: {e!r}")
        return out

    def close(self) -> None:
        for streams in self.streams.values():
            for s in streams:
                s.env.close()
        for n, env in self.protos.items():
            if not self.streams[n]:
                env.close()


def worker_main(cfg: Config, worker_id: int, device: str, num_threads: int, session: str | None = None) -> None:
    """A rollout process: newest weights -> a rollout batch -> the queue, until the learner says stop."""
    if session:
        os.environ["CAMG_SESSION"] = session
    torch.set_num_threads(num_threads)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))      # terminate() still closes the sandboxes
    ex = Exchange(session_dir(cfg), cfg.max_queue)
    worker = None
    try:
        torch.manual_seed(cfg.seed + 1000 * (worker_id + 1))
        model, tokenizer = build_model(cfg.model, torch.device(device), cfg.seed)
        if torch.device(device).type == "cuda":
            model.to(torch.bfloat16)
        model.eval().requires_grad_(False)
        worker = RolloutWorker(cfg, model, tokenizer, worker_id, seed=cfg.seed * 7919 + worker_id + time.time_ns())
        worker.version = -1            # nothing loaded yet: wait for the learner's first weights
        alive = lambda: os.getppid() == parent and not ex.stopped()          # noqa: E731 - orphaned: quit
        while alive():
            v = ex.latest_version()
            if v > worker.version and (sd := ex.load_weights(v, device)) is not None:
                model.load_state_dict(sd)
                worker.version = v
            if worker.version < 0:
                time.sleep(0.1)
                continue
            samples = worker.rollout_batch()
            if cfg.slow_worker_s > 0:
                time.sleep(cfg.slow_worker_s)
            ex.put(samples, worker_id, keep_waiting=alive)
    except SystemExit:
        pass
    except BaseException:           # the learner reports this instead of waiting for episodes forever
        (ex.root / f"worker{worker_id}.error").write_text(traceback.format_exc())
        raise
    finally:
        if worker is not None:
            worker.close()


# -----------------------------------------------------------------------------------------------
# credit: rows of the training batch, GAE with the critic


def build_batch(samples: list[Sample], learner: Learner, gamma: float, lam: float):
    """Training rows of the samples with advantages and value targets. Every row (context) of an episode
    gets the episode's score at its last policy token: memory actions and task actions share the task
    return. values are the critic's at the start of this update; advantages are whitened over all policy
    tokens of the global batch."""
    toks, masks, lps, vers, scores = [], [], [], [], []
    for s in samples:
        for t, m, lp in s.rows:
            if any(m):                  # a context with no policy token trains nothing
                toks.append(t); masks.append(m); lps.append(lp); vers.append(s.version); scores.append(s.score)
    if not toks:
        return None
    batch = make_batch(toks, masks, lps, versions=vers)
    d = learner.d
    if d.world_size > 1:                # every train rank built the same rows; each takes its share
        batch = batch.shard(d.rank, d.world_size)
        scores = scores[d.rank::d.world_size]
    mask = batch.loss_mask                                              # [B, T]
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)            # [B] index of the last policy token
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=rewards.dtype)
    values = learner.values_of(batch).cpu()                            # [B, T], aligned with tokens
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    # whiten over the policy tokens of all ranks (sums all-reduced), so every rank uses the same scale
    sums = torch.tensor([float(mask.sum()), float((adv * mask).sum()), float((adv * adv * mask).sum())],
                        dtype=torch.float64)
    if d.world_size > 1:
        sums = sums.to(d.device)
        torch.distributed.all_reduce(sums)
        sums = sums.cpu()
    n = max(float(sums[0]), 1.0)
    mean = float(sums[1]) / n
    std = max(float(sums[2]) / n - mean * mean, 0.0) ** 0.5
    adv = (adv - mean) * mask / (std + 1e-8)
    return replace(batch, advantages=adv, returns=ret, old_values=values)


# -----------------------------------------------------------------------------------------------
# evaluation: greedy, test streams per environment, success in the paper's Table 2 layout


def eval_streams(env, num_tasks: int, stream_len: int) -> list[list]:
    """Test tasks as streams: each test group's tasks in order, cut into chunks of stream_len, taken
    round-robin over groups (first chunks of every group first) until num_tasks tasks."""
    by_group = {}
    for t in env.tasks("test"):
        by_group.setdefault(t.group, []).append(t)
    chunks = [[g[i:i + stream_len] for i in range(0, len(g), stream_len)] for g in by_group.values()]
    streams, left = [], num_tasks
    for k in range(max(map(len, chunks), default=0)):
        for c in chunks:
            if k < len(c) and left > 0:
                streams.append(c[k][:left])
                left -= len(streams[-1])
    return streams


@torch.no_grad()
def evaluate(cfg: Config, model, tokenizer, mode: str, rank: int = 0, world: int = 1, make_env=envs.make) -> dict:
    """{env: {"success": sum, "score": sum, "num": tasks}} over this rank's streams (pairs of streams stay
    together so that 'shuffle' always has a partner)."""
    results = {}
    for name in cfg.weights:
        proto = make_env(name)
        streams = eval_streams(proto, cfg.eval_tasks, cfg.eval_stream_len)
        parts = [streams[i:i + 2] for i in range(0, len(streams), 2)]
        if len(parts) > 1 and len(parts[-1]) == 1:
            parts[-2] += parts.pop()
        mine = [s for part in parts[rank::world] for s in part]
        env_list = [proto] + [proto.clone() for _ in mine[1:]]
        res = results[name] = {"success": 0.0, "score": 0.0, "num": 0, "failed": 0}
        try:
            for e in env_list:
                e.set_memory_files({})
            for k in range(max(map(len, mine), default=0)):
                idx = [i for i, s in enumerate(mine) if k < len(s)]
                apply_memory_mode([env_list[i] for i in idx], mode if k > 0 else "full")
                eps = run_episodes(model, tokenizer, [env_list[i] for i in idx], [mine[i][k] for i in idx],
                                   memory=[memory_note(env_list[i]) for i in idx], temperature=0.0,
                                   seed=cfg.seed, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                                   context_budget=cfg.context_budget)
                for s in to_samples(eps, [name] * len(eps), 0, -1, 0.0):
                    res["success"] += s.success
                    res["score"] += s.score
                    res["num"] += 1
                    res["failed"] += bool(s.error)
        finally:
            for e in env_list:
                e.close()
    return results


def table2(rows: list[tuple[str, dict]]) -> str:
    """Markdown table: one row per (label, results); the paper's published rows below, marked."""
    head = "| model | " + " | ".join(TITLES[n] for n in ENV_NAMES) + " | Avg |"
    lines = [head, "|" + "---|" * (len(ENV_NAMES) + 2)]
    for label, res in rows:
        cells, vals = [], []
        for n in ENV_NAMES:
            if n in res and res[n]["num"]:
                v = 100.0 * res[n]["success"] / res[n]["num"]
                vals.append(v)
                cells.append(f"{v:.1f} (n={res[n]['num']})")
            else:
                cells.append("—")
        avg = f"{sum(vals) / len(vals):.1f}" if vals else "—"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {avg} |")
    for label, *vals in PAPER_ROWS:
        cells = ["—" if v is None else f"{v:.1f}" for v in vals]
        lines.append(f"| {label} *(reported by the paper)* | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_eval(cfg: Config, learner: Learner, tokenizer, step: int, run_dir: Path, ex: Exchange) -> str:
    """Every train rank evaluates its share of streams; rank 0 gathers the parts (files, no collective
    waiting on the slowest rank) and writes eval.md / eval.json."""
    d, rows = learner.d, []
    for mode in cfg.eval_modes:
        part = evaluate(cfg, learner.gen_model, tokenizer, mode, d.rank, d.world_size)
        ex.write(f"eval-{step}-{mode}-rank{d.rank}.pkl", part)
        if not d.is_main:
            continue
        total = {}
        for r in range(d.world_size):
            while (p := ex.read(f"eval-{step}-{mode}-rank{r}.pkl")) is None:
                time.sleep(0.2)
            for n, res in p.items():
                t = total.setdefault(n, dict.fromkeys(res, 0.0))
                for k, v in res.items():
                    t[k] += v
        rows.append((f"this run: {cfg.model}, update {step}, memory {mode}", total))
    if not d.is_main:
        return ""
    text = table2(rows)
    (run_dir / "eval.md").write_text(f"Success (%) on test tasks, greedy\n\n{text}\n")
    with open(run_dir / "eval.json", "a") as f:
        f.write(json.dumps({"step": step, "results": {label: res for label, res in rows}}) + "\n")
    return text


# -----------------------------------------------------------------------------------------------
# the learner: collect fresh episodes, GAE, decoupled PPO update, publish weights, log, checkpoint


def collect(state: dict, learner: Learner, cfg: Config, source, log) -> list[Sample]:
    """batch_episodes usable episodes. source() returns new samples (possibly none). Failed episodes are
    logged and skipped; episodes more than eta versions old are logged and dropped."""
    buffer, waited = state["buffer"], time.time()
    while True:
        fresh = fresh_rows(torch.tensor([s.version for s in buffer] or [0], dtype=torch.long),
                           learner.version, cfg.eta)[:len(buffer)]
        for s, ok in zip(buffer, fresh.tolist()):
            if not ok:
                log(s, "stale")
                state["num_stale"] += 1
        buffer[:] = [s for s, ok in zip(buffer, fresh.tolist()) if ok]
        if len(buffer) >= cfg.batch_episodes:
            batch, buffer[:] = buffer[:cfg.batch_episodes], buffer[cfg.batch_episodes:]
            return batch
        new = source()
        for s in new:
            if s.error:
                log(s, "failed")
                state["num_failed"] += 1
            else:
                buffer.append(s)
        if new:
            waited = time.time()
        elif time.time() - waited > cfg.worker_timeout_s:
            raise RuntimeError(f"no episode arrived for {cfg.worker_timeout_s:.0f}s: are the rollout workers "
                               "alive? (raise --worker_timeout_s for very slow rollouts)")


def env_parts(samples: list[Sample]) -> dict:
    parts = {}
    for n in ENV_NAMES:
        mine = [s for s in samples if s.env == n]
        if mine:
            parts[f"score/{n}"] = sum(s.score for s in mine) / len(mine)
            parts[f"success/{n}"] = sum(s.success for s in mine) / len(mine)
    return parts


def learner_main(cfg: Config, d: Dist, num_spawn: int = 0, remote_workers: bool = False, make_env=envs.make):
    run_dir = Path(cfg.run_dir)
    ckpt = run_dir / "ckpt"
    resuming = cfg.resume and ckpt.exists()
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        if not resuming:
            for name in ("metrics.jsonl", "episodes.jsonl", "eval.json"):
                (run_dir / name).unlink(missing_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    # --- setup: model, learner (critic = value head), resume
    model, tokenizer = build_model(cfg.model, d.device, cfg.seed)
    ref = None
    if cfg.kl_coef > 0:
        import copy
        ref = copy.deepcopy(model)
    learner = Learner(model, ref_model=ref, value_head=True, lr=cfg.lr, weight_decay=cfg.weight_decay,
                      clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
                      entropy_coef=cfg.entropy_coef, vf_coef=cfg.vf_coef, max_lag=cfg.eta,
                      max_grad_norm=cfg.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens,
                      gradient_checkpointing=d.device.type == "cuda", dist_info=d)
    step = 0
    if resuming:
        step = learner.load(str(ckpt))["step"]
        print0(f"resuming {run_dir} from update {step} (policy version {learner.version})")

    # --- the exchange: a fresh session directory, weights v0 published before any worker generates
    ex = Exchange(session_dir(cfg), cfg.max_queue)
    if d.is_main:
        for old in ex.root.parent.iterdir():
            if old != ex.root and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        ex.take()                       # nothing of this session can be queued yet; be safe anyway
        if num_spawn or remote_workers:
            ex.publish(learner.gen_model.state_dict(), learner.version)
    procs = []
    if num_spawn:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        threads = max(1, num_cpus() // (num_spawn + 1)) if d.device.type == "cpu" else 4
        for i in range(num_spawn):
            p = ctx.Process(target=worker_main, args=(cfg, i, str(d.device), threads, ex.root.name), daemon=True)
            p.start()
            procs.append(p)
    inline = None
    if not (num_spawn or remote_workers) and not cfg.eval_only and step < cfg.steps:
        inline = RolloutWorker(cfg, learner.gen_model, tokenizer, 0, seed=cfg.seed + step, make_env=make_env)

    def source() -> list[Sample]:
        if inline is not None:          # single process: generate now, with the current weights
            inline.version = learner.version
            return inline.rollout_batch()
        if not d.is_main:
            return []
        for p in procs:
            if not p.is_alive():
                raise RuntimeError(f"rollout worker {p.pid} exited with code {p.exitcode}:\n"
                                   + "\n".join(ex.errors()))
        if ex.errors():
            raise RuntimeError("a rollout worker failed:\n" + "\n".join(ex.errors()))
        got = ex.take()
        if not got:
            time.sleep(0.05)
        return got

    epi_log = open(run_dir / "episodes.jsonl", "a") if d.is_main else None

    def log(s: Sample, used: str) -> None:
        if epi_log is not None:
            epi_log.write(json.dumps({"update": step, "env": s.env, "task": s.task_id, "version": s.version,
                                      "lag": learner.version - s.version, "worker": s.worker, "score": s.score,
                                      "success": s.success, "finish": s.finish, "resets": s.num_resets,
                                      "used": used, "error": s.error}) + "\n")
            epi_log.flush()

    # --- training
    state = {"buffer": [], "num_stale": 0, "num_failed": 0}
    try:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=min(step, cfg.steps), disable=not d.is_main or cfg.eval_only,
                   desc="camg", dynamic_ncols=True)
        while step < cfg.steps and not cfg.eval_only:
            t0 = time.perf_counter()
            # rank 0 collects and writes the batch; other train ranks read the same file (no collective)
            if d.is_main:
                samples = collect(state, learner, cfg, source, log)
                if d.world_size > 1:
                    ex.write(f"batch-{step}.pkl", samples)
            else:
                while (samples := ex.read(f"batch-{step}.pkl")) is None:
                    time.sleep(0.05)
            wait_s = time.perf_counter() - t0
            lags = [learner.version - s.version for s in samples]
            for s in samples:
                log(s, "train")
            batch = build_batch(samples, learner, cfg.gamma, cfg.lam)
            if batch is None:           # not one policy token in the batch: nothing to learn from
                print0(f"update {step}: no policy tokens in the batch, skipped")
                step += 1
                continue
            stats = learner.update(batch, cfg.num_minibatches)
            step += 1
            if d.is_main and (num_spawn or remote_workers):
                ex.publish(learner.gen_model.state_dict(), learner.version)
                if d.world_size > 1:
                    (ex.root / f"batch-{step - 2}.pkl").unlink(missing_ok=True)   # every rank has read it
            gen_s = sum(s.gen_s for s in samples) / max(len(samples), 1)
            metrics = {"update": step, **env_parts(samples), "score": sum(s.score for s in samples) / len(samples),
                       "success": sum(s.success for s in samples) / len(samples),
                       **{k: stats[k] for k in ("approx_kl", "clipfrac", "entropy", "value_loss", "explained_var",
                                                "grad_norm", "loss", "tokens_per_s", "response_len", "version")
                          if k in stats},
                       "lag_mean": sum(lags) / len(lags), "lag_max": max(lags), "num_stale": state["num_stale"],
                       "num_failed": state["num_failed"], "queue": len(ex.queued()) if d.is_main else 0,
                       "resets": sum(s.num_resets for s in samples) / len(samples),
                       "gen_tokens_per_s": sum(s.gen_tokens for s in samples) / max(gen_s, 1e-9) / max(len(samples), 1),
                       "wait_s": wait_s, "update_s": time.perf_counter() - t0}
            if d.is_main:
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                bar.update(1)
                bar.write(f"update {step:4d} | score {metrics['score']:.3f} success {metrics['success']:.2f} | "
                          f"kl {stats.get('approx_kl', 0):.4f} clip {stats.get('clipfrac', 0):.3f} "
                          f"ent {stats.get('entropy', 0):.2f} vloss {stats.get('value_loss', 0):.4f} "
                          f"ev {stats.get('explained_var', float('nan')):.2f} gnorm {stats.get('grad_norm', 0):.2f} | "
                          f"{stats.get('tokens_per_s', 0):.0f} tok/s | lag {metrics['lag_mean']:.1f}/{metrics['lag_max']} "
                          f"stale {state['num_stale']} failed {state['num_failed']}")
            if step % cfg.save_every == 0 or step == cfg.steps:
                save_checkpoint(learner, ckpt, step)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and cfg.eval_tasks:
                print0(run_eval(cfg, learner, tokenizer, step, run_dir, ex))
        bar.close()
    finally:
        if d.is_main:
            ex.stop()                   # workers finish their batch and exit; then we end the stragglers
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        if inline is not None:
            inline.close()
        if epi_log is not None:
            epi_log.close()

    # --- evaluation
    if cfg.eval_tasks:
        text = run_eval(cfg, learner, tokenizer, step, run_dir, ex)
        print0("\nSuccess (%) on test tasks, greedy (Table 2 layout)\n" + text)
    return learner


def save_checkpoint(learner: Learner, ckpt: Path, step: int) -> None:
    """Write ckpt.tmp, then swap it in: a crash mid-save leaves the previous checkpoint whole."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    if learner.d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if learner.d.world_size > 1:
        torch.distributed.barrier()
    learner.save(str(tmp), caller_state={"step": step})
    if learner.d.world_size > 1:
        torch.distributed.barrier()
    if learner.d.is_main:
        old = ckpt.with_name(ckpt.name + ".old")
        if ckpt.exists():
            os.replace(ckpt, old)
        os.replace(tmp, ckpt)
        shutil.rmtree(old, ignore_errors=True)


# -----------------------------------------------------------------------------------------------
# entry point: plain python (learner + spawned workers) or torchrun (train group + worker ranks)


def main(argv=None):
    cfg = parse_args(argv)
    check_setup(cfg)
    kind = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ and world > 1:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        num_train = cfg.train_ranks or max(1, world // 2)
        if num_train >= world:
            sys.exit(f"camg.py: --train_ranks {num_train} leaves no rollout rank out of {world}")
        device = f"cuda:{local_rank}" if kind == "cuda" else "cpu"
        threads = max(1, num_cpus() // world) if kind == "cpu" else 4
        if rank >= num_train:           # a rollout rank: never joins the train group's collectives
            return worker_main(cfg, rank - num_train, device, threads)
        torch.set_num_threads(threads)
        os.environ["WORLD_SIZE"] = str(num_train)   # the train group = ranks 0..num_train-1 (default group)
        d = init_distributed(kind) if num_train > 1 else Dist(device=torch.device(device))
        return learner_main(cfg, d, remote_workers=True)
    d = Dist(device=torch.device(kind))
    if d.device.type == "cpu" and cfg.num_workers:
        torch.set_num_threads(max(1, num_cpus() // (cfg.num_workers + 1)))
    os.environ["CAMG_SESSION"] = f"pid{os.getpid()}"
    return learner_main(cfg, d, num_spawn=0 if cfg.eval_only else cfg.num_workers)


if __name__ == "__main__":
    main()
