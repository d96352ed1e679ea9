"""CAMG-RL: one policy trained on Shop, Coding, DeepResearch and AutoResearch with fully asynchronous
PPO (actor + critic, GAE, token-level decoupled loss) that learns file-based memory from the task reward.

    python camg.py                            # short CPU run: SmolLM2-135M, learner + 1 rollout worker process
    python camg.py --model tiny --steps 2     # smoke run (< 1 minute) with a tiny random model
    python camg.py --model tiny --num_workers 0                                # one process, rollout inline
    python camg.py --eval_only --eval_tasks 4 --eval_stream_len 2 --eval_memory full,blank,shuffle,continuation
    torchrun --nproc_per_node 8 camg.py --model <HF dir> --steps 200 --batch_episodes 64 --rollout_batch 16 \
        --max_turns 40 --max_new_tokens 512 --context_budget 16384 --eval_tasks 128 --eval_stream_len 12 \
        --exchange_dir /dev/shm/camg          # full scale: 4 train ranks (FSDP2) + 4 rollout ranks

The defaults fit a 2-core CPU (a few minutes with SmolLM2): the pipeline end to end, not a trained model.
--run_dir gets config.json, metrics.jsonl (per update: reward parts per env, approx_kl, clipfrac, entropy,
value loss, explained variance, grad norm, tokens/s, staleness), episodes.jsonl (every episode the learner
received and its fate: train / stale / failed / unused), ckpt/ (resumed by default), eval.md, eval.json.

How it works (as in AReaL's asynchronous PPO):
- Rollout workers generate continuously with the newest weights they have, over streams of training
  tasks whose `.agent_memory/` persists from task to task (a new stream starts blank); each episode
  carries the version of the weights that generated it. rollout.py's CONTINUATION.md reset protocol runs
  at --context_budget; a task's first turn lists the saved memory files' paths, not their contents.
- Every hand-off between processes is a file renamed into place (atomic: nothing reads half a file, and
  no process waits in a collective for a slow peer): episode batches into a bounded queue, weights
  (state dict + version) back to the workers. `python` spawns --num_workers rollout processes (0 = inline,
  one process); under torchrun the first --train_ranks ranks are the train group (FSDP2), the rest roll out.
- The learner drops episodes more than eta versions old (ppo.fresh_rows) and trains with the decoupled
  objective (behaviour logprobs from the worker, proximal ones recomputed). Stale episodes are *dropped,
  not down-weighted*: inside the bound pi_prox / pi_behav corrects them without bias; past it that
  weight's variance makes the gradient worthless, and a down-weighting curve would be a bias of its own.
- Credit: memory actions (notes, CONTINUATION.md) and task actions share the task return (no memory
  reward). Every row of an episode (each context closed by a reset, then the last) gets the episode's
  score at its last policy token; GAE with the critic (a value head) runs over its policy tokens.
  An episode whose environment raised is logged as failed with its reason and not trained on.
- Evaluation: --eval_tasks test tasks per env (the paper: 128), greedy, as streams (a test group's tasks
  in order, memory carried); success per env and the average in the paper's Table 2 layout, beside the
  published rows. Ablations (--eval_memory): blank empties the saved memory before each task, shuffle
  swaps in another stream's memory, continuation keeps only CONTINUATION.md (--train_memory too).

Departures from the paper: small defaults; weights travel through files, not an NCCL broadcast (use a
tmpfs --exchange_dir at scale); no KL to a reference by default (--kl_coef); a segment's GAE chain ends at
its own last policy token instead of bootstrapping from the next segment (the same at the default
gamma = lam = 1); worker stream positions are not checkpointed; the environments are local re-creations.
"""
from __future__ import annotations

import copy
import json
import os
import pickle
import random
import re
import shutil
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.multiprocessing
from tqdm import tqdm

import cli
import envs
from ppo import Dist, Learner, checkpoint_path, fresh_rows, init_distributed, make_batch, print0
from rewards import gae
from rollout import CONTINUATION_PATH, run_episodes

ENV_NAMES = ("shop", "coding", "deepresearch", "autoresearch")
TITLES = {"shop": "Shop", "coding": "Coding", "deepresearch": "DeepResearch", "autoresearch": "AutoResearch"}
MEMORY_MODES = ("full", "blank", "shuffle", "continuation")
CONTINUATION_FILE = CONTINUATION_PATH.split("/", 1)[1]           # "CONTINUATION.md" inside .agent_memory/
# the CAMG paper's Table 2 and ablations, success (%): (row, Shop, Coding, DeepResearch, AutoResearch, average).
# Derived here, not printed as such in the source: CompactionRL's average (mean of its four) and the blanked
# row (the 4B row minus the reported costs 29.4 / 13.8 / 4.8 / 8.3; their mean)
PAPER_ROWS = [
    ("CAMG-RL-4B", 97.1, 26.6, 55.5, 38.3, 54.4),
    ("CompactionRL-4B", 97.5, 19.5, 50.8, 24.2, 48.0),
    ("Qwen3.5-4B (frozen)", 11.6, 10.9, 36.7, 10.2, 17.4),
    ("CAMG-RL-4B, memory blanked", 67.7, 12.8, 50.7, 30.0, 40.3),
    ("CAMG-RL-4B, trained continuation-only", None, None, None, None, 41.8),
    ("CAMG-RL-4B, no gradient through memory actions", None, None, None, None, 21.1),
]

# -----------------------------------------------------------------------------------------------
# config: one dataclass, every field a flag (--name value)


@dataclass
class Config:
    model: str = "smollm2"          # "smollm2" (SmolLM2-135M-Instruct), an HF dir, "tiny" (~1M random qwen3)
                                    # or "tiny-<arch>" (qwen3_5 / llama); qwen3 is the fastest tiny on a CPU
    run_dir: str = "runs/camg"      # config, metrics, episodes, checkpoint, eval
    resume: bool = True             # resume from run_dir/ckpt when it exists (--resume false: start over)
    seed: int = 0
    steps: int = 2                  # PPO updates (the paper: 200)
    env_weights: str = "shop=1,coding=1,deepresearch=1,autoresearch=1"   # episode mix; 0 leaves an env out
    batch_episodes: int = 2         # episodes per update
    rollout_batch: int = 2          # episodes a worker runs together (one batched generate per turn)
    num_workers: int = 1            # plain python: rollout worker processes; 0 = rollout inline, one process
    train_ranks: int = 0            # torchrun: ranks in the train group (0 = half); the others roll out
    eta: int = 2                    # staleness bound: drop episodes more than eta versions old (0 = synchronous)
    max_queue: int = 4              # bounded queue, in rollout batches; a worker waits while it is full
    max_turns: int = 3              # actions per episode (each env also stops at its own budget)
    max_new_tokens: int = 32        # tokens per reply
    context_budget: int = 1024      # tokens per context; near it the CONTINUATION.md reset protocol runs
    temperature: float = 1.0        # the workers' sampling temperature (evaluation is greedy)
    train_memory: str = "full"      # memory kept between training tasks: full | blank | continuation
    lr: float = 1e-6
    weight_decay: float = 0.1
    clip_low: float = 0.2
    clip_high: float = 0.28
    vf_coef: float = 0.5            # value-loss weight (the critic is a head on the policy's trunk)
    kl_coef: float = 0.0            # k1 KL to a frozen reference; 0 = no reference model is kept
    entropy_coef: float = 0.0
    gamma: float = 1.0              # GAE discount per policy token
    lam: float = 1.0                # GAE lambda
    num_minibatches: int = 1        # optimizer steps per update
    max_grad_norm: float = 1.0
    behav_imp_weight_cap: float = 0.0  # drop tokens whose pi_prox/pi_behav exceeds this (0 = off; 5.0 with eta >= 1 or a bf16 sampler)
    clip_ratio_c: float = 0.0       # dual-clip bound for negative advantages (0 = off; verl uses 3.0)
    micro_batch_tokens: int = 4096  # padded tokens per learner forward
    eval_tasks: int = 1             # test tasks per environment (the paper: 128); 0 = no evaluation
    eval_stream_len: int = 1        # tasks per evaluation stream (memory carries along a stream)
    eval_memory: str = "full"       # comma list of memory modes to evaluate: full,blank,shuffle,continuation
    eval_every: int = 0             # also evaluate every this many updates (0 = at the end only)
    eval_only: bool = False         # evaluate the resumed (or initial) model without training
    save_every: int = 50            # checkpoint every this many updates, and at the end
    exchange_dir: str = ""          # where episodes and weights travel ("" = run_dir/exchange)
    worker_timeout_s: float = 1800.0  # the learner gives up when no episode arrives for this long
    device: str = ""                # "" = cuda if available, else cpu

    def __post_init__(self):
        check = cli.check
        self.weights = parse_weights(self.env_weights)
        self.eval_modes = [m.strip() for m in self.eval_memory.split(",") if m.strip()]
        bad = [m for m in self.eval_modes if m not in MEMORY_MODES]
        check(self.eval_modes and not bad, f"--eval-memory: unknown {bad}; choose from {','.join(MEMORY_MODES)}")
        check("shuffle" not in self.eval_modes or self.eval_tasks > self.eval_stream_len,
              "--eval-memory shuffle needs 2 or more streams: make --eval-tasks larger than --eval-stream-len")
        check(self.train_memory in ("full", "blank", "continuation"),
              f"--train-memory must be full, blank or continuation, not {self.train_memory!r}")
        for name in ("steps", "eta", "num_workers", "train_ranks", "eval_tasks", "eval_every"):
            check(getattr(self, name) >= 0, f"{cli.flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("batch_episodes", "rollout_batch", "max_queue", "max_turns", "max_new_tokens",
                     "eval_stream_len", "save_every", "micro_batch_tokens"):
            check(getattr(self, name) >= 1, f"{cli.flag(name)} must be >= 1, got {getattr(self, name)}")
        check(self.context_budget >= 2 * self.max_new_tokens + 256,
              f"--context-budget {self.context_budget} leaves no room for a task prompt and two replies of "
              f"{self.max_new_tokens} tokens: raise it or lower --max-new-tokens")
        check(1 <= self.num_minibatches <= self.batch_episodes, "--num-minibatches must be in [1, batch_episodes]")
        cli.check_number("lr", self.lr, lo=0, lo_open=True)
        cli.check_number("temperature", self.temperature, lo=0, lo_open=True)
        cli.check_number("gamma", self.gamma, lo=0, hi=1, lo_open=True)
        cli.check_number("lam", self.lam, lo=0, hi=1)
        cli.check_number("worker_timeout_s", self.worker_timeout_s, lo=0, lo_open=True)
        for name in ("weight_decay", "clip_low", "clip_high", "vf_coef", "kl_coef", "entropy_coef", "max_grad_norm"):
            cli.check_number(name, getattr(self, name), lo=0)
        for name in ("behav_imp_weight_cap", "clip_ratio_c"):
            check(getattr(self, name) == 0 or getattr(self, name) > 1, f"{cli.flag(name)} must be 0 (off) or > 1")
        check(re.fullmatch(r"(cpu|cuda(:\d+)?)?", self.device),
              f"--device must be cpu, cuda or cuda:N (empty = cuda if available), got {self.device!r}")
        check(not self.device.startswith("cuda") or torch.cuda.is_available(),
              f"--device {self.device}: no CUDA device on this machine")
        if not self.model.startswith(("tiny", "smollm2")):
            cli.check_model_dir(self.model)


def parse_weights(text: str) -> dict:
    weights = {}
    for name, _, w in (part.strip().partition("=") for part in text.split(",") if part.strip()):
        cli.check(name in ENV_NAMES, f"--env-weights: unknown environment {name!r}; use {', '.join(ENV_NAMES)}")
        cli.check(w.replace(".", "", 1).isdigit(), f"--env-weights: {name}={w} is not name=weight (weight >= 0)")
        weights[name] = float(w)
    cli.check(sum(weights.values()) > 0, "--env-weights: at least one environment needs a positive weight")
    return {n: w for n, w in weights.items() if w > 0}


def parse_args(argv=None) -> Config:
    return cli.parse(Config, argv, prog="camg.py",
                     description="CAMG-RL: asynchronous PPO across the four CAMG environments")


def check_setup(cfg: Config) -> None:
    """What would fail deep inside a run, checked up front with a message saying what to change."""
    if "coding" in cfg.weights:
        try:
            import codebase
            codebase.require_cache()
        except Exception as e:  # noqa: BLE001 - whatever keeps the coding env from starting
            cli.fail("camg.py", f"the coding environment cannot start ({e}). Run `python codebase.py fetch`, "
                     "or leave it out: --env-weights shop=1,coding=0,deepresearch=1,autoresearch=1")


def cpu_threads(cfg: Config, num_procs: int) -> int:
    """torch threads per process on a CPU: the cores shared out, but 1 for a tiny model, whose small
    matmuls gain nothing from intra-op threads (they cost ~4x on a busy 2-core machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cfg.model.startswith("tiny") else max(1, cores // num_procs)


def make_env(name: str):
    """A CAMG environment as this trainer uses it: `.agent_memory/` carries from task to task of a
    stream in every environment (the coding env keeps it across tasks only when asked)."""
    return envs.make(name, **({"keep_memory": True} if name == "coding" else {}))


def by_group(tasks) -> list[list]:
    """Tasks per group (a shopper, a region, a lab, a repository), each group's tasks in order."""
    groups = {}
    for t in tasks:
        groups.setdefault(t.group, []).append(t)
    return list(groups.values())


def build_model(name: str, device, seed: int):
    from model import load, load_tokenizer, tiny
    if name.startswith("tiny"):
        model, tokenizer = tiny(arch=name.partition("-")[2] or "qwen3", seed=seed)
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
    version: int                    # the policy version that generated it
    worker: int
    score: float
    success: float
    finish: str                     # "done" | "turns" | "error"
    error: str = ""                 # why it failed (environment raised, rollout crashed, ...); "" = fine
    rows: list = field(default_factory=list)   # (tokens, loss_mask, logprobs, sampling temperature), one per context
    num_turns: int = 0
    num_resets: int = 0
    gen_tokens: int = 0
    gen_s: float = 0.0              # this episode's share of its rollout batch's time


def _write_atomic(path: Path, obj, saver=None) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_bytes(pickle.dumps(obj)) if saver is None else saver(obj, tmp)
    os.replace(tmp, path)           # readers list finished files only


class Exchange:
    """The directory one launch's learner and workers share: queue/ of episode batches, weights, flags."""

    def __init__(self, root, max_queue: int = 4):
        self.root, self.max_queue, self.seq = Path(root), max_queue, 0
        self.queue = self.root / "queue"
        self.queue.mkdir(parents=True, exist_ok=True)

    def queued(self) -> list[Path]:
        return sorted(p for p in self.queue.iterdir() if not p.name.startswith("."))   # oldest first

    def put(self, samples: list, worker: int, keep_waiting=lambda: True) -> bool:
        """Queue one rollout batch, waiting while the queue is full; False if told to stop meanwhile."""
        while len(self.queued()) >= self.max_queue:
            if self.stopped() or not keep_waiting():
                return False
            time.sleep(0.05)
        if self.stopped():          # after STOP nothing new enters the queue: the learner has drained it
            return False
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
        for old in sorted(self.root.glob("weights-v*.pt"))[:-2]:   # a worker may still read the previous one
            old.unlink(missing_ok=True)

    def latest_version(self) -> int:
        found = sorted(self.root.glob("weights-v*.pt"))
        return int(found[-1].stem[len("weights-v"):]) if found else -1

    def load_weights(self, version: int, device):
        try:
            return torch.load(self.root / f"weights-v{version:06d}.pt", map_location=device, weights_only=True)
        except FileNotFoundError:   # replaced by a newer version meanwhile: the caller asks again
            return None

    def write(self, name: str, obj) -> None:     # small records between train ranks: a batch, eval results
        _write_atomic(self.root / name, obj)

    def read(self, name: str):
        return pickle.loads((self.root / name).read_bytes()) if (self.root / name).exists() else None

    def stop(self) -> None:
        (self.root / "STOP").touch()

    def stopped(self) -> bool:
        return (self.root / "STOP").exists()


def session_dir(cfg: Config) -> Path:
    """One exchange subdirectory per launch, named alike by all its processes, so an earlier launch's
    leftovers (its STOP flag, its weights) are never taken for this one's."""
    base = Path(cfg.exchange_dir or Path(cfg.run_dir) / "exchange")
    if os.environ.get("CAMG_SESSION"):                  # plain python: the learner names it for its workers
        return base / os.environ["CAMG_SESSION"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")       # torchrun: every rank has the same parent
    run_id = run_id if run_id != "none" else f"ppid{os.getppid()}"
    return base / f"torchrun-{run_id}-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


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
        assert len(env_list) >= 2, "memory mode 'shuffle' needs at least 2 streams of the same environment"
        snaps = [e.memory_files() for e in env_list]
        for i, e in enumerate(env_list):
            e.set_memory_files(snaps[(i + 1) % len(snaps)])


def memory_note(env) -> str:
    """The memory part of a task's first user turn: the saved files' *paths*, never their contents (as
    after a context reset); the policy reads what it needs with a shell action."""
    paths = [f".agent_memory/{p}" for p in sorted(env.memory_files())]
    if not paths:
        return "No saved memory files yet. Notes you write under .agent_memory/ are kept for later tasks."
    return "Saved memory files (read them with a shell action, e.g. cat PATH): " + ", ".join(paths)


def to_samples(episodes, names, version: int, worker: int, batch_s: float) -> list[Sample]:
    out = []
    for ep, name in zip(episodes, names):
        rows = [(r.tokens, r.loss_mask, r.logprobs, r.temperature) for r in ep.rows() if len(r.tokens) >= 2]
        out.append(Sample(env=name, task_id=ep.task.id, version=version, worker=worker, score=float(ep.score),
                          success=0.0 if ep.error else float(ep.info.get("success", 0.0)), finish=ep.finish,
                          error=ep.error, rows=rows, num_turns=ep.num_turns, num_resets=ep.num_resets,
                          gen_tokens=sum(sum(r[1]) for r in rows), gen_s=batch_s / max(len(episodes), 1)))
    return out


# -----------------------------------------------------------------------------------------------
# rollout worker: streams of training tasks per environment, one batched rollout at a time


@dataclass
class Stream:
    env: object                     # one env instance: its .agent_memory/ carries over between tasks
    tasks: list = field(default_factory=list)
    pos: int = 0


class RolloutWorker:
    """A generation model, the policy version it holds and open task streams. rollout_batch() never
    raises: an episode that cannot run comes back as a failed Sample carrying the reason."""

    def __init__(self, cfg: Config, model, tokenizer, worker_id: int = 0, seed=0, make_env=make_env):
        self.cfg, self.model, self.tokenizer, self.worker_id = cfg, model, tokenizer, worker_id
        self.version, self.rng, self.names = 0, random.Random(seed), list(cfg.weights)
        self.protos = {n: make_env(n) for n in self.names}
        self.groups = {n: by_group(env.tasks("train")) for n, env in self.protos.items()}   # in order: easy -> hard
        assert all(self.groups.values()), f"an environment of {self.names} has no train tasks"
        self.streams = {n: [] for n in self.names}

    def _next(self, name: str, busy: set):
        free = [s for s in self.streams[name] if id(s) not in busy]
        if not free:                # one env instance per stream in flight; clones share the catalogue
            env = self.protos[name] if not self.streams[name] else self.protos[name].clone()
            self.streams[name].append(Stream(env))
            free = self.streams[name][-1:]
        s = free[0]
        busy.add(id(s))
        if s.pos >= len(s.tasks):   # a new stream: another group's tasks, starting from blank memory
            s.tasks, s.pos = self.rng.choice(self.groups[name]), 0
            s.env.set_memory_files({})
        s.pos += 1
        return s.env, s.tasks[s.pos - 1]

    def rollout_batch(self) -> list[Sample]:
        cfg, busy, version = self.cfg, set(), self.version
        names = self.rng.choices(self.names, weights=[cfg.weights[n] for n in self.names], k=cfg.rollout_batch)
        picks = [(n, *self._next(n, busy)) for n in names]             # (env name, env, task)
        out, run, notes = [None] * len(picks), [], []

        def fail(i, reason):
            out[i] = Sample(picks[i][0], picks[i][2].id, version, self.worker_id, 0.0, 0.0, "error", reason)
        for i, (_, env, _) in enumerate(picks):
            try:
                apply_memory_mode([env], cfg.train_memory)
                notes.append(memory_note(env))
                run.append(i)
            except Exception as e:  # noqa: BLE001 - a broken workspace fails its episode, not the worker
                fail(i, f"memory: {e!r}")
        t0 = time.perf_counter()
        try:
            eps = run_episodes(self.model, self.tokenizer, [picks[i][1] for i in run], [picks[i][2] for i in run],
                               memory=notes, temperature=cfg.temperature, seed=self.rng.randrange(1 << 30),
                               max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                               context_budget=cfg.context_budget) if run else []
            samples = to_samples(eps, [picks[i][0] for i in run], version, self.worker_id, time.perf_counter() - t0)
            for i, s in zip(run, samples):
                out[i] = s
        except Exception as e:  # noqa: BLE001 - e.g. generation failed: every episode of the batch fails
            for i in run:
                fail(i, f"rollout: {e!r}")
        return out

    def close(self) -> None:
        for n in self.names:
            for env in {id(e): e for e in [self.protos[n]] + [s.env for s in self.streams[n]]}.values():
                env.close()


def worker_main(cfg: Config, worker_id: int, device: str, num_threads: int, session: str | None = None) -> None:
    """A rollout process: newest weights -> one rollout batch -> the queue, until the learner says stop."""
    if session:
        os.environ["CAMG_SESSION"] = session
    torch.set_num_threads(num_threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))      # terminate() still closes the sandboxes
    parent, ex, worker = os.getppid(), Exchange(session_dir(cfg), cfg.max_queue), None
    alive = lambda: os.getppid() == parent and not ex.stopped()    # noqa: E731 - orphaned or told to stop
    try:
        torch.manual_seed(cfg.seed + 1000 * (worker_id + 1))
        model, tokenizer = build_model(cfg.model, device, cfg.seed)
        model.to(torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32).eval().requires_grad_(False)
        worker = RolloutWorker(cfg, model, tokenizer, worker_id, seed=f"{cfg.seed}/{worker_id}/{ex.root.name}")
        worker.version = -1         # nothing loaded: wait for the learner's first weights
        while alive():
            v = ex.latest_version()
            if v > worker.version and (sd := ex.load_weights(v, device)) is not None:
                model.load_state_dict(sd)
                worker.version = v
            if worker.version < 0:
                time.sleep(0.1)
                continue
            ex.put(worker.rollout_batch(), worker_id, keep_waiting=alive)
    except SystemExit:
        pass
    except BaseException:           # the learner reports this instead of waiting for episodes in vain
        (ex.root / f"worker{worker_id}.error").write_text(f"worker {worker_id}:\n{traceback.format_exc()}")
        raise
    finally:
        if worker is not None:
            worker.close()


# -----------------------------------------------------------------------------------------------
# credit: rows of the training batch, GAE with the critic


def build_batch(samples: list[Sample], learner: Learner, gamma: float, lam: float):
    """This rank's training rows with advantages and value targets, or None without a policy token.
    Every row (context) of an episode gets the episode's score at its last policy token: memory and task
    actions share the task return. values: the critic's at the start of this update."""
    rows = [(t, m, lp, temp, s.version, s.score) for s in samples for t, m, lp, temp in s.rows if any(m)]
    if not rows:
        return None
    toks, masks, lps, temps, vers, scores = map(list, zip(*rows))
    # each row is scored at the temperature it was sampled at (pi_prox / pi_behav = 1 on fresh rows)
    batch, d = make_batch(toks, masks, lps, versions=vers, temperatures=temps), learner.d
    if d.world_size > 1:            # every train rank built the same rows; each trains on its share
        batch, scores = batch.shard(d.rank, d.world_size), scores[d.rank::d.world_size]
    mask = batch.loss_mask                                                 # [B, T]
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)               # [B] the last policy token
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=rewards.dtype)
    values = learner.values_of(batch).cpu()                               # [B, T], aligned with tokens
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    # whiten over the policy tokens of *all* train ranks: sums are all-reduced, one scale everywhere
    sums = torch.tensor([mask.sum(), (adv * mask).sum(), (adv * adv * mask).sum()], dtype=torch.float64)
    if d.world_size > 1:
        sums = sums.to(d.device)
        torch.distributed.all_reduce(sums)
    n, s1, s2 = sums.cpu().tolist()
    mean = s1 / max(n, 1.0)
    std = max(s2 / max(n, 1.0) - mean * mean, 0.0) ** 0.5
    return replace(batch, advantages=(adv - mean) * mask / (std + 1e-8), returns=ret, old_values=values)


# -----------------------------------------------------------------------------------------------
# evaluation: greedy test streams, success in the paper's Table 2 layout


def eval_streams(env, num_tasks: int, stream_len: int) -> list[list]:
    """Test tasks as streams: each test group's tasks in order, cut into chunks of stream_len, taken
    round-robin over the groups (every group's first chunk first) until num_tasks tasks."""
    chunks = [[g[i:i + stream_len] for i in range(0, len(g), stream_len)] for g in by_group(env.tasks("test"))]
    streams, left = [], num_tasks
    for k in range(max(map(len, chunks), default=0)):
        for c in chunks:
            if k < len(c) and left > 0:
                streams.append(c[k][:left])
                left -= len(streams[-1])
    return streams


@torch.no_grad()
def evaluate(cfg: Config, model, tokenizer, mode: str, rank: int = 0, world: int = 1, make_env=make_env) -> dict:
    """{env: {"success", "score", "num", "failed"}} summed over this rank's streams. All environments'
    streams step together (one batched generate per turn); pairs of streams stay on one rank so that
    'shuffle' always has a partner of the same environment."""
    streams, results = [], {}       # streams: (env name, env instance, tasks)
    try:
        for name in cfg.weights:
            proto = make_env(name)
            all_ = eval_streams(proto, cfg.eval_tasks, cfg.eval_stream_len)
            parts = [all_[i:i + 2] for i in range(0, len(all_), 2)]
            if len(parts) > 1 and len(parts[-1]) == 1:
                parts[-2] += parts.pop()
            mine = [s for part in parts[rank::world] for s in part]
            envs_ = [proto] + [proto.clone() for _ in mine[1:]]
            streams += [(name, e, s) for e, s in zip(envs_, mine)]
            results[name] = {"success": 0.0, "score": 0.0, "num": 0, "failed": 0}
            if not mine:
                proto.close()
        for _, e, _ in streams:
            e.set_memory_files({})
        for pos in range(max((len(s) for _, _, s in streams), default=0)):
            # between tasks the mode decides what the next task starts with (shuffle partners may have ended)
            for name in results if pos > 0 else ():
                apply_memory_mode([e for n, e, s in streams if n == name and (pos < len(s) or mode == "shuffle")], mode)
            live = [st for st in streams if pos < len(st[2])]
            eps = run_episodes(model, tokenizer, [e for _, e, _ in live], [s[pos] for _, _, s in live],
                               memory=[memory_note(e) for _, e, _ in live], temperature=0.0, seed=cfg.seed,
                               max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                               context_budget=cfg.context_budget)
            for s in to_samples(eps, [n for n, _, _ in live], 0, -1, 0.0):
                for key, v in (("success", s.success), ("score", s.score), ("num", 1), ("failed", bool(s.error))):
                    results[s.env][key] += v
    finally:
        for _, e, _ in streams:
            e.close()
    return results


def table2(rows: list[tuple[str, dict]]) -> str:
    """Markdown, the paper's Table 2 layout: this run's rows, then the published rows, marked as such."""
    lines = ["| model | " + " | ".join(TITLES[n] for n in ENV_NAMES) + " | Avg |", "|---" * (len(ENV_NAMES) + 2) + "|"]
    for label, res in rows:
        vals = {n: 100.0 * r["success"] / r["num"] for n, r in res.items() if r["num"]}
        cells = [f"{vals[n]:.1f} (n={res[n]['num']})" if n in vals else "—" for n in ENV_NAMES]
        avg = f"{sum(vals.values()) / len(vals):.1f}" if vals else "—"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {avg} |")
    for label, *vals in PAPER_ROWS:
        cells = ["—" if v is None else f"{v:.1f}" for v in vals]
        lines.append(f"| {label} *(reported by the paper)* | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nPaper rows: CAMG paper, Table 2 and ablations (4B models, 128 tasks per env). "
                               "CompactionRL's average and the blanked row are derived from its reported figures.")


def run_eval(cfg: Config, learner: Learner, tokenizer, step: int, ex: Exchange, make_env=make_env) -> str:
    """Every train rank evaluates its share of the streams; rank 0 gathers the parts through files (no
    collective waits on the slowest rank) and writes eval.md / eval.json. Returns the table (rank 0)."""
    d, rows = learner.d, []
    for mode in cfg.eval_modes:
        part = evaluate(cfg, learner.gen_model, tokenizer, mode, d.rank, d.world_size, make_env)
        ex.write(f"eval-{step}-{mode}-rank{d.rank}.pkl", part)
        total = {}
        for r in range(d.world_size if d.is_main else 0):
            while (part := ex.read(f"eval-{step}-{mode}-rank{r}.pkl")) is None:
                time.sleep(0.2)
            for n, res in part.items():
                total[n] = {k: total.get(n, {}).get(k, 0) + v for k, v in res.items()}
        rows.append((f"this run: {cfg.model}, update {step}, memory {mode}", total))
    if not d.is_main:
        return ""
    text = table2(rows)
    run_dir = Path(cfg.run_dir)
    (run_dir / "eval.md").write_text(f"Success (%) on test tasks, greedy (update {step})\n\n{text}\n")
    with open(run_dir / "eval.json", "a") as f:
        f.write(cli.dumps({"update": step, "results": dict(rows)}) + "\n")
    return text


# -----------------------------------------------------------------------------------------------
# the learner: collect fresh episodes, GAE, decoupled PPO update, publish weights, log, checkpoint


def collect(state: dict, version: int, cfg: Config, source, log) -> list[Sample]:
    """batch_episodes usable episodes, oldest first. source() returns what arrived (maybe nothing).
    Failed episodes are logged and skipped; episodes more than eta versions older than the learner are
    logged and dropped (ppo.fresh_rows), also those that went stale while waiting in the buffer."""
    buf, since = state["buffer"], time.time()
    while True:
        if buf:
            fresh = fresh_rows(torch.tensor([s.version for s in buf]), version, cfg.eta).tolist()
            for s in [s for s, ok in zip(buf, fresh) if not ok]:
                log(s, "stale")
                state["num_stale"] += 1
            buf[:] = [s for s, ok in zip(buf, fresh) if ok]
        if len(buf) >= cfg.batch_episodes:
            out, buf[:] = buf[:cfg.batch_episodes], buf[cfg.batch_episodes:]
            return out
        new = source()
        for s in new:
            if s.error:
                log(s, "failed")
                state["num_failed"] += 1
            else:
                buf.append(s)
        if new:
            since = time.time()
        elif time.time() - since > cfg.worker_timeout_s:
            raise RuntimeError(f"no episode arrived for {cfg.worker_timeout_s:.0f}s: are the rollout workers "
                               "alive? (slow rollouts: raise --worker_timeout_s)")


def update_metrics(samples: list[Sample], stats: dict, version: int, state: dict) -> dict:
    """The health line of one update: reward parts per env, PPO health, staleness, throughput."""
    mean = lambda xs: sum(xs) / max(len(xs), 1)                     # noqa: E731
    m = {"score": mean([s.score for s in samples]), "success": mean([s.success for s in samples])}
    for n in ENV_NAMES:
        mine = [s for s in samples if s.env == n]
        if mine:
            m[f"score/{n}"], m[f"success/{n}"] = mean([s.score for s in mine]), mean([s.success for s in mine])
    m.update({k: stats[k] for k in ("approx_kl", "clipfrac", "entropy", "value_loss", "explained_var", "grad_norm",
                                    "loss", "tokens_per_s", "response_len", "num_stale", "version") if k in stats})
    lags = [version - s.version for s in samples]                   # versions behind the learner when trained
    m.update(lag_mean=mean(lags), lag_max=max(lags), dropped_stale=state["num_stale"],
             failed=state["num_failed"], resets=mean([s.num_resets for s in samples]),
             gen_tokens_per_s=sum(s.gen_tokens for s in samples) / max(sum(s.gen_s for s in samples), 1e-9))
    return m


def one_line(m: dict) -> str:
    g = lambda k, f=".3f": format(m.get(k, float("nan")), f)        # noqa: E731
    return (f"update {m['update']:4d} | score {g('score')} success {g('success', '.2f')} | "
            f"kl {g('approx_kl', '.4f')} clip {g('clipfrac')} ent {g('entropy', '.2f')} vloss {g('value_loss', '.4f')} "
            f"ev {g('explained_var', '.2f')} gnorm {g('grad_norm', '.2f')} | {g('tokens_per_s', '.0f')} tok/s | "
            f"lag {g('lag_mean', '.1f')}/{m['lag_max']} stale {m['dropped_stale']} failed {m['failed']}")


def learner_main(cfg: Config, d: Dist, num_spawn: int = 0, remote_workers: bool = False, make_env=make_env):
    run_dir = Path(cfg.run_dir)
    ckpt = run_dir / "ckpt"
    resuming = cfg.resume and checkpoint_path(str(ckpt)) is not None
    saved = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    if resuming and saved.get("model", cfg.model) != cfg.model:
        cli.fail("camg.py", f"{run_dir} holds a checkpoint of --model {saved['model']}, not {cfg.model}: "
                 "pick another --run-dir, or --no-resume to start over")
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.eval_only:       # evaluating leaves a run's config and logs alone
            (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
            for name in ("metrics.jsonl", "episodes.jsonl", "eval.json") if not resuming else ():
                (run_dir / name).unlink(missing_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    # --- setup: model, learner with a value head (the critic), resume
    model, tokenizer = build_model(cfg.model, d.device, cfg.seed)
    learner = Learner(model, ref_model=copy.deepcopy(model) if cfg.kl_coef > 0 else None, value_head=True,
                      lr=cfg.lr, weight_decay=cfg.weight_decay, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                      kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef, vf_coef=cfg.vf_coef, max_lag=cfg.eta,
                      max_grad_norm=cfg.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens,
                      gradient_checkpointing=d.device.type == "cuda", dist_info=d,
                      behav_imp_weight_cap=cfg.behav_imp_weight_cap or None, clip_ratio_c=cfg.clip_ratio_c or None)
    step = learner.load(str(ckpt))["step"] if resuming else 0
    if resuming:
        print0(f"resuming {run_dir} at update {step} (policy version {learner.version})")

    # --- workers: a fresh exchange session, weights published before any worker generates
    ex, remote = Exchange(session_dir(cfg), cfg.max_queue), bool(num_spawn or remote_workers)
    if d.is_main:
        for old in ex.root.parent.iterdir():
            if old != ex.root and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        if remote and not cfg.eval_only:
            ex.publish(learner.gen_model.state_dict(), learner.version)
    training = not cfg.eval_only and step < cfg.steps
    threads = cpu_threads(cfg, num_spawn + 1) if d.device.type == "cpu" else 4
    procs = [torch.multiprocessing.get_context("spawn").Process(
        target=worker_main, args=(cfg, i, str(d.device), threads, ex.root.name), daemon=True)
        for i in range(num_spawn if training else 0)]
    for p in procs:
        p.start()
    # one process: the rollout runs inline, with the learner's generation copy
    inline = RolloutWorker(cfg, learner.gen_model, tokenizer, 0, seed=cfg.seed + step, make_env=make_env) \
        if training and not remote else None

    def source() -> list[Sample]:
        if inline is not None:      # generate now, with the current weights (lag 0: synchronous)
            inline.version = learner.version
            return inline.rollout_batch()
        errors = [p.read_text() for p in sorted(ex.root.glob("worker*.error"))]
        if errors or not all(p.is_alive() for p in procs):
            raise RuntimeError("a rollout worker died:\n" + ("\n".join(errors) or "(no traceback; killed?)"))
        return ex.take() or time.sleep(0.05) or []

    epi_log = open(run_dir / "episodes.jsonl", "a") if d.is_main else None

    def log(s: Sample, used: str) -> None:  # every episode the learner receives, and what became of it
        if epi_log is not None:
            epi_log.write(cli.dumps({"update": step, "env": s.env, "task": s.task_id, "version": s.version,
                                      "lag": learner.version - s.version, "worker": s.worker, "score": s.score,
                                      "success": s.success, "finish": s.finish, "resets": s.num_resets,
                                      "used": used, "error": s.error}) + "\n")
            epi_log.flush()

    # --- training
    state = {"buffer": [], "num_stale": 0, "num_failed": 0}
    try:
        bar = tqdm(total=cfg.steps, initial=min(step, cfg.steps), disable=not d.is_main or not training, desc="camg")
        while training and step < cfg.steps:
            t0 = time.perf_counter()
            if d.is_main:           # rank 0 collects; the other train ranks read the same batch from a file
                samples = collect(state, learner.version, cfg, source, log)
                if d.world_size > 1:
                    ex.write(f"batch-{step}.pkl", samples)
            else:
                while (samples := ex.read(f"batch-{step}.pkl")) is None:
                    time.sleep(0.05)
            for s in samples:
                log(s, "train")
            version, batch = learner.version, build_batch(samples, learner, cfg.gamma, cfg.lam)
            stats = learner.update(batch, cfg.num_minibatches) if batch is not None else {}
            step += 1
            if d.is_main and remote:
                ex.publish(learner.gen_model.state_dict(), learner.version)
                (ex.root / f"batch-{step - 2}.pkl").unlink(missing_ok=True)   # every rank has read it by now
            m = {"update": step, **update_metrics(samples, stats, version, state),
                 "queue": len(ex.queued()), "update_s": time.perf_counter() - t0}
            if d.is_main:
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(cli.dumps(m) + "\n")
                bar.update(1)
                bar.write(one_line(m) if batch is not None else f"update {step}: no policy token in the batch")
            if step % cfg.save_every == 0 or step == cfg.steps:
                save_checkpoint(learner, ckpt, step)
            if cfg.eval_every and cfg.eval_tasks and step % cfg.eval_every == 0 and step < cfg.steps:
                bar.write(run_eval(cfg, learner, tokenizer, step, ex, make_env))
        bar.close()
    finally:
        if d.is_main:
            ex.stop()               # workers finish their batch and exit; stragglers are ended
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.terminate()       # a process this learner started, by its handle
                p.join(timeout=15)
        if d.is_main:
            for s in state["buffer"] + ex.take():
                log(s, "unused")
            epi_log.close()
        if inline is not None:
            inline.close()

    # --- evaluation
    if cfg.eval_tasks:
        table = run_eval(cfg, learner, tokenizer, step, ex, make_env)
        print0("\nSuccess (%) on test tasks, greedy (the paper's Table 2 layout)\n" + table)
    return learner


def save_checkpoint(learner: Learner, ckpt: Path, step: int) -> None:
    """Learner.save writes ckpt.tmp and swaps it in: a crash while saving leaves the last one whole."""
    learner.save(str(ckpt), caller_state={"step": step})


# -----------------------------------------------------------------------------------------------
# entry point: plain python (learner + spawned workers) or torchrun (train group + rollout ranks)


def main(argv=None):
    cfg = parse_args(argv)
    check_setup(cfg)
    kind = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ and world > 1:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        num_train = cfg.train_ranks or max(1, world // 2)
        if num_train >= world:
            cli.fail("camg.py", f"--train-ranks {num_train} leaves no rollout rank among {world}")
        device = f"cuda:{local_rank}" if kind == "cuda" else "cpu"
        threads = cpu_threads(cfg, world) if kind == "cpu" else 4
        if rank >= num_train:       # a rollout rank: never joins the train group's collectives
            return worker_main(cfg, rank - num_train, device, threads)
        torch.set_num_threads(threads)
        os.environ["WORLD_SIZE"] = str(num_train)   # the train group = ranks 0..num_train-1, the default group
        d = init_distributed(kind) if num_train > 1 else Dist(device=torch.device(device))
        return learner_main(cfg, d, remote_workers=True)
    d = Dist(device=torch.device(kind))
    if kind == "cpu":
        torch.set_num_threads(cpu_threads(cfg, 1 + (0 if cfg.eval_only else cfg.num_workers)))
    os.environ["CAMG_SESSION"] = f"pid{os.getpid()}"
    return learner_main(cfg, d, num_spawn=cfg.num_workers)


if __name__ == "__main__":
    main()
