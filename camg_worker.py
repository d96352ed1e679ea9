"""camg.py's rollout side: the environments as CAMG trains on them (task families), the models by
name, and the rollout worker: streams of training tasks per environment, one batched rollout at a time,
episodes out as `exchange.Sample`s (in a spawned process or a torchrun rank: `worker_main`).

Every environment instance is wrapped in camg_memory.ProtocolEnv, which bounds CONTINUATION.md and
records the reset protocol's outcome of each episode. cfg is camg.Config (this module never imports
camg.py, an entry point)."""
from __future__ import annotations

import functools
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import envs
import rollout
from camg_eval import by_group
from camg_memory import (KEPT, NO_MEMORY, CarryingAgent, ProtocolEnv, apply_memory_mode, memory_note,
                         reset_outcomes, run_reference)
from exchange import Exchange, Sample, session_dir, to_samples
from model import build_tokenizer, chat_tokenizer, load_named, tiny
from rollout import run_episodes

# relay tasks per group of each environment's relay family (--family relay | both)
RELAY = {"shop": {"relay_per_shopper": 4}, "coding": {"relay": True}, "deepresearch": {"relay_per_region": 3},
         "autoresearch": {"relay_per_group": 2}}
STANDARD_OFF = {"shop": {"tasks_per_shopper": 0}, "coding": {"standard": False},
                "deepresearch": {"tasks_per_region": 0}, "autoresearch": {"tasks_per_group": 0}}

def make_env(name: str, family: str = "relay", extra_train_relay: int = 0, test_tasks: int = 0):
    """A CAMG environment as this trainer uses it, with the tasks of `family` (relay / standard / both).
    The coding env keeps `.agent_memory/` across tasks here, as the other three do by default (what a
    task starts with is still the worker's memory mode). extra_train_relay: more relay tasks per
    training group (not coding's, whose relay tasks are one per native bug); the test tasks stay.
    test_tasks: the held-out tasks an evaluation takes (--eval-tasks). Where the test split holds fewer,
    each test group gets as many more relay tasks as that takes, after its own (so an evaluation of
    fewer tasks takes the same ones as before, and the training tasks stay)."""
    kw = {**(RELAY[name] if family != "standard" else {}), **(STANDARD_OFF[name] if family == "relay" else {})}
    if extra_train_relay and family != "standard" and name != "coding":
        kw["extra_train_relay"] = extra_train_relay
    make = (lambda **k: envs.make(name, keep_memory=True, **k)) if name == "coding" else \
        (lambda **k: envs.make(name, **k))
    env = make(**kw)
    short, groups = test_tasks - len(env.tasks("test")), len(by_group(env.tasks("test")))
    if short > 0 and family != "standard" and name != "coding" and groups:
        env = make(**kw, extra_test_relay=-(-short // groups))
    return env


def env_maker(cfg):
    return lambda name: make_env(name, cfg.family, cfg.extra_train_relay, cfg.eval_tasks)


# the "small" model's BPE, trained once on domain_text and pinned: an environment's wording may change after
# (e.g. a reference policy's query, 2026-12-05) without invalidating the reader built on it (camg_reader.py)
BPE_PATH = Path(__file__).resolve().parent / "weights" / "camg_bpe.json"


# (every k-th training task, at most n) of each environment in domain_text. Shop's catalogue words (74
# attribute phrases, 10 categories, their options) each occur in few of its episodes: from 8 episodes the
# BPE spelled an attribute phrase in 3.9 tokens, from 72 in 1.85, so its copies are of fewer pieces
DOMAIN_EPISODES = {"shop": (4, 72)}


def domain_text(seed: int = 99) -> str:
    """Deterministic sample of what the small model reads and writes: the reference policies' relay and
    standard episodes (observations and actions) of training tasks and the protocol prompts; its BPE was
    trained on it (train_small_bpe)."""
    parts = [rollout.ACTOR_SYSTEM, rollout.CONTINUATION_PROMPT, rollout.MEMORY_HEADER, NO_MEMORY + KEPT]
    for name in (n for n in RELAY if n != "coding"):   # a coding episode grades in a sandbox (seconds): left out
        env = make_env(name, "both")
        every, most = DOMAIN_EPISODES.get(name, (7, 8))
        for task in env.tasks("train")[::every][:most]:
            parts += rollout.scripted_text(env, task, env.reference_policy(task))
        env.close()
    return "\n".join(parts)


def train_small_bpe(path: Path | None = None):
    """A new BPE (2048 tokens) trained on today's domain_text, written to path (its JSON) when given. To
    move the small model to it: write it to BPE_PATH, bump camg_reader.VERSION and rebuild the reader."""
    tok = build_tokenizer(2048, extra_text=domain_text())
    if path is not None:
        Path(path).write_text(tok.backend_tokenizer.to_str())
    return tok


@functools.lru_cache(maxsize=1)
def small_tokenizer():
    """The "small" model's BPE (2048 tokens), read from BPE_PATH (once per process)."""
    from tokenizers import Tokenizer
    return chat_tokenizer(Tokenizer.from_file(str(BPE_PATH)))


def build_model(name: str, device, seed: int):
    """model.load_named, plus camg's names: "tiny" is a random qwen3 (the fastest tiny on a CPU), and
    "small" a 1.9M qwen3 whose BPE is trained on the environments' text (observations take ~half the
    tokens), big enough to learn the relay protocol by imitation in minutes on 2 cores. "reader" is
    "small" after camg_reader.py's reading pretraining: camg.py's learner loads it (camg_reader.load),
    and a rollout worker builds this shape and waits for the learner's weights."""
    if name in ("small", "reader"):     # "reader" here: a rollout worker's copy, the learner's weights come later
        tok = small_tokenizer()
        model, tokenizer = tiny("qwen3", seed=seed, tokenizer=tok, hidden_size=192, num_layers=4,
                                intermediate_size=512, max_seq_len=8192)
    else:
        model, tokenizer = load_named("tiny-qwen3" if name == "tiny" else name, seed)
    return model.to(device), tokenizer


def reference_episodes(proto, tasks, tokenizer, cfg, carry: bool = True):
    """The env's reference policy on tasks (each from blank memory), as camg_memory.CarryingAgents run
    through the rollout loop at cfg's context budget, max_turns and max_new_tokens: (Episodes, the
    reset outcomes of each). proto is closed afterwards (its clones too)."""
    envs_ = [ProtocolEnv(proto)] + [ProtocolEnv(proto.clone()) for _ in tasks[1:]]
    try:
        for e in envs_:
            e.set_memory_files({})
        agents = [CarryingAgent(lambda t=t, e=e: e.reference_policy(t), carry) for t, e in zip(tasks, envs_)]
        # the first turn RL's streams show (RolloutWorker: the folder said to be kept for later tasks
        # unless --train-memory blank), so that imitation and RL train on the same prompt
        kept = cfg.train_memory != "blank"
        eps = run_reference(tokenizer, envs_, tasks, agents, [memory_note(e, kept) for e in envs_],
                            context_budget=cfg.context_budget, max_turns=cfg.max_turns,
                            max_new_tokens=cfg.max_new_tokens)
        return eps, [reset_outcomes(e) for e in envs_]
    finally:
        for e in envs_:
            e.close()


# -----------------------------------------------------------------------------------------------
# rollout worker: streams of training tasks per environment, one batched rollout at a time


@dataclass
class Stream:
    env: object                     # one env instance (a ProtocolEnv): its .agent_memory/ carries over between tasks
    tasks: list = field(default_factory=list)
    pos: int = 0


class RolloutWorker:
    """A generation model, the policy version it holds and open task streams. rollout_batch() never
    raises: an episode that cannot run comes back as a failed Sample carrying the reason."""

    def __init__(self, cfg, model, tokenizer, worker_id: int = 0, seed=0, make_env=None):
        self.cfg, self.model, self.tokenizer, self.worker_id = cfg, model, tokenizer, worker_id
        self.version, self.rng, self.names = 0, random.Random(seed), list(cfg.weights)
        self.protos = {n: (make_env or env_maker(cfg))(n) for n in self.names}
        self.groups = {n: by_group(env.tasks("train")) for n, env in self.protos.items()}   # in order: easy -> hard
        assert all(self.groups.values()), f"an environment of {self.names} has no train tasks"
        self.streams = {n: [] for n in self.names}

    def _next(self, name: str, busy: set):
        free = [s for s in self.streams[name] if id(s) not in busy]
        if not free:                # one env instance per stream in flight; clones share the catalogue
            env = self.protos[name] if not self.streams[name] else self.protos[name].clone()
            self.streams[name].append(Stream(ProtocolEnv(env)))
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
                notes.append(memory_note(env, cfg.train_memory != "blank"))
                run.append(i)
            except Exception as e:  # noqa: BLE001 - a broken workspace fails its episode, not the worker
                fail(i, f"memory: {e!r}")
        t0 = time.perf_counter()
        try:
            envs_ = [picks[i][1] for i in run]
            eps = run_episodes(self.model, self.tokenizer, envs_, [picks[i][2] for i in run],
                               memory=notes, temperature=cfg.temperature, seed=self.rng.randrange(1 << 30),
                               max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                               context_budget=cfg.context_budget) if run else []
            samples = to_samples(eps, [picks[i][0] for i in run], version, self.worker_id, time.perf_counter() - t0,
                                 envs_)
            for i, s in zip(run, samples):
                out[i] = s
        except Exception as e:  # noqa: BLE001 - e.g. generation failed: every episode of the batch fails
            for i in run:
                fail(i, f"rollout: {e!r}")
        return out

    def close(self) -> None:
        for n in self.names:
            for env in {id(e): e for e in [self.protos[n]] + [s.env.env for s in self.streams[n]]}.values():
                env.close()


def worker_main(cfg, worker_id: int, device: str, num_threads: int, session: str | None = None) -> None:
    """A rollout process: newest weights -> one rollout batch -> the queue, until the learner says stop."""
    if session:
        os.environ["CAMG_SESSION"] = session
    torch.set_num_threads(num_threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))      # terminate() still closes the sandboxes
    parent, ex, worker = os.getppid(), Exchange(session_dir(cfg.exchange_dir, cfg.run_dir), cfg.max_queue), None
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
