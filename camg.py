"""CAMG-RL: one policy trained on Shop, DeepResearch, AutoResearch (and Coding: --env-weights) with fully asynchronous
PPO (actor + critic, GAE, token-level decoupled loss) that learns file-based memory from the task reward.

    python camg.py                            # the laptop preset (~10 min on 2 cores): warm start, RL, before/after
    python camg.py --model tiny --steps 2 --eval-tasks 2      # smoke run with a tiny random model
    python camg.py --eval-only --eval-memory full,blank,continuation                # evaluate the resumed model
    python camg.py --family standard --train-memory full --eval-stream-len 4      # memory across the tasks of a stream
    torchrun --nproc_per_node 8 camg.py --model <HF dir> --steps 200 --batch-episodes 64 --rollout-batch 16 \
        --max-turns 40 --max-new-tokens 512 --context-budget 16384 --eval-tasks 128 --exchange-dir /dev/shm/camg

The laptop preset is the paper's setting at small scale: long episodes in a small context, so that most
episodes hit at least one CONTINUATION.md reset, on the relay task family of each environment (a fact
seen early, e.g. a shopping note, a memo or a CI report shown once, is needed after the reset: the task
is solved only if the policy writes it down before the reset and reads it back after). Memory across the tasks
of a stream is an option (--family standard|both, --train-memory full, --eval-stream-len > 1), not the
default. The default model, "reader", is "small" (a 1.9M Qwen3 with a BPE trained on the environments' text)
after camg_reader.py's reading pretraining (shipped in weights/camg_reader/); a warm start imitates the
reference policies through the same rollout protocol before RL (see warm_start).

--run-dir gets config.json, metrics.jsonl (per update: reward parts per env, approx_kl, clipfrac, entropy,
value loss, explained variance, grad norm, tokens/s, staleness, the reset protocol's shares), episodes.jsonl
(every episode the learner received, its fate: train / stale / failed / unused, and its resets: CONTINUATION.md
written / empty / missing / stale before each, read after or not), warmstart.jsonl, ckpt/ (resumed by default),
eval.md, eval.json and summary.json (held-out success before and after RL with paired 95% CIs, per
evaluation memory mode, the reset statistics, and the relay stages: where each held-out relay episode
failed, from the note never opened to the fact used and the task still failed; camg_eval.summary). Every
evaluation's relay stages are also in its eval.json row, and the report prints them as a table.

How it works (as in AReaL's asynchronous PPO):
- Rollout workers generate continuously with the newest weights they have, over streams of training
  tasks; each episode carries the version of the weights that generated it. The CONTINUATION.md reset
  protocol runs at --context-budget (rollout.py; bounded and recorded by camg_memory.ProtocolEnv).
- Every hand-off between processes is a file renamed into place (exchange.py): episode batches into a
  bounded queue, weights back to the workers. `python` spawns --num-workers rollout processes (0 = inline,
  one process); under torchrun the first --train-ranks ranks are the train group (FSDP2), the rest roll out.
- The learner drops episodes more than eta versions old (ppo.fresh_rows) and trains with the decoupled
  objective (behaviour logprobs from the worker, proximal ones recomputed). Stale episodes are *dropped,
  not down-weighted*: inside the bound pi_prox / pi_behav corrects them without bias; past it that
  weight's variance makes the gradient worthless, and a down-weighting curve would be a bias of its own.
- Credit: memory actions (notes, CONTINUATION.md) and task actions share the task return (no memory
  reward). Every row of an episode (each context closed by a reset, then the last) gets the episode's
  score at its last policy token; GAE with the critic (a value head) runs over its policy tokens, and the
  advantages are whitened over the batch's policy tokens (--whiten env: centred per environment).
  --mask-memory-actions (an ablation) puts loss mask 0 on the tokens of actions that write or read memory
  files. An episode whose environment raised on an action ends there with score 0 and is trained on like
  any other (its reason logged as env_error): a policy must not turn a losing episode into an unpenalised
  one. Only an episode that could not run at all (its reset raised, the rollout crashed) is dropped.
- Evaluation: --eval-tasks test tasks per env (the paper: 128), greedy, as streams (a test group's tasks
  in order); success per env and the average, before RL (after the warm start) and after, paired by
  task; the paper's Table 2 layout beside the published rows; in the training's memory mode unless
  --eval-memory says otherwise. Ablations (--eval-memory): blank empties the saved memory before each
  task, shuffle swaps in another stream's memory, continuation keeps only CONTINUATION.md (--train-memory
  too); wiped (the training's mode) deletes CONTINUATION.md at every reset inside an episode (does a
  success need what the file says?).

Departures from the paper: small defaults; weights travel through files, not an NCCL broadcast (use a
tmpfs --exchange-dir at scale); no KL to a reference by default (--kl-coef); a segment's GAE chain ends at
its own last policy token instead of bootstrapping from the next segment (the same at the default
gamma = lam = 1); worker stream positions are not checkpointed; the environments are local re-creations.
"""
from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.multiprocessing
from tqdm import tqdm

import cli
from camg_eval import ENV_NAMES, effect_table, evaluate, merge, relay_stages, summary, table2
from camg_memory import MEMORY_MODES, memory_note
from camg_worker import RolloutWorker, build_model, env_maker, reference_episodes, worker_main
from exchange import Exchange, Sample, session_dir
from ppo import Dist, Learner, checkpoint_path, fresh_rows, init_distributed, make_batch, print0
from rewards import gae
from rollout import run_episodes

# -----------------------------------------------------------------------------------------------
# config: one dataclass, every field a flag (--name value)


LAPTOP_MODELS = ("small", "reader")    # the laptop models: camg_reader.py's BPE, its ladder reads them


@dataclass
class Config:
    model: str = "reader"           # reader (small after camg_reader.py's reading pretraining, shipped in
                                    # weights/camg_reader/) | small (1.9M qwen3, BPE on the envs' text, random
                                    # weights) | tiny (~1M random qwen3) |
                                    # tiny-<arch> (qwen3 / qwen3_5 / llama) | smollm2 | an HF dir
    run_dir: str = "runs/camg"      # config, metrics, episodes, checkpoint, eval, summary
    resume: bool = True             # resume from run_dir/ckpt when it exists (--no-resume: start over)
    seed: int = 0
    steps: int = 40                 # PPO updates (the paper: 200); 0 = the warm start and its evaluation
    env_weights: str = "shop=1,coding=0,deepresearch=1,autoresearch=1"   # episode mix; 0 leaves an env out (coding: opt in, each episode grades in a sandbox)
    family: str = "relay"           # task family: relay (facts cross a context reset) | standard (facts
                                    # cross the tasks of a stream) | both
    extra_train_relay: int = 0      # more relay tasks per training shopper / region / lab (more facts to carry); test tasks stay
    batch_episodes: int = 8         # episodes per update
    rollout_batch: int = 8          # episodes a worker runs together (one batched generate per turn)
    num_workers: int = 1            # plain python: rollout worker processes; 0 = rollout inline, one process
    train_ranks: int = 0            # torchrun: ranks in the train group (0 = half); the others roll out
    eta: int = 2                    # staleness bound: drop episodes more than eta versions old (0 = synchronous)
    max_queue: int = 4              # bounded queue, in rollout batches; a worker waits while it is full
    max_turns: int = 20             # actions per episode (each env also stops at its own budget: 20)
    max_new_tokens: int = 128       # tokens per reply
    context_budget: int = 1152      # tokens per context; near it the CONTINUATION.md reset protocol runs
    temperature: float = -1.0       # the workers' sampling temperature (evaluation is greedy); -1 = auto: 0.5 for
                                    # the laptop models (at 1.0 the reader solves a third as many training episodes
                                    # and RL moved no held-out task: docs/results.md), 1.0 for a checkpoint dir
    train_memory: str = "blank"     # memory kept between training tasks: blank | full | continuation
    lr: float = 1e-4                # RL learning rate (the paper: 1e-6 on 4B; a tiny model needs more)
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
    mask_memory_actions: bool = False  # ablation: no gradient through actions that write or read memory files
    whiten: str = "global"          # advantages: global (centred and scaled over all policy tokens) | env (centred
                                    # per environment, scaled by the pooled std: an env every episode fails does
                                    # not push its shared actions down; build_batch)
    micro_batch_tokens: int = 4096  # padded tokens per learner forward
    warmstart_steps: int = -1       # max imitation steps before RL; -1 = auto (300 for reader, 150 for small, 0 otherwise)
    warmstart_threshold: float = 0.9   # held-out format validity that ends (or skips) the warm start
    warmstart_lr: float = -1.0      # the first imitation step's, decaying linearly towards 0 at --warmstart-steps;
                                    # -1 = auto (2e-3 for reader: 5e-3 erased its reading, docs/camg.md; 5e-3 otherwise)
    warmstart_batch: int = 4        # rows per imitation step
    warmstart_reading: float = -1   # share of each warm-start batch that rehearses camg_reader.py's rungs
                                    # (added to the rows above); -1 = auto (0.5 for reader, 0 otherwise)
    warmstart_tasks: int = 24       # train tasks per env whose reference trajectories are imitated
    eval_tasks: int = 64            # test tasks per environment (the paper: 128); 0 = no evaluation; beyond a
                                    # relay split (44 / 33 / 22) its test groups get more relay tasks (camg_worker).
                                    # 64, not 16: RL's effect here is +2 to +5 points, which 16 a env cannot resolve
    eval_stream_len: int = 1        # tasks per evaluation stream (memory carries along a stream)
    eval_memory: str = ""           # comma list of memory modes to evaluate: full,blank,shuffle,continuation,wiped;
                                    # "" = the training mode (--train-memory): the first turn the policy trained on
    eval_every: int = 0             # also evaluate every this many updates (0 = at the end only)
    eval_only: bool = False         # evaluate the resumed (or initial) model without training
    save_every: int = 50            # checkpoint every this many updates, and at the end
    exchange_dir: str = ""          # where episodes and weights travel ("" = run_dir/exchange)
    worker_timeout_s: float = 1800.0  # the learner gives up when no episode arrives for this long
    device: str = ""                # "" = cuda if available, else cpu

    def __post_init__(self):
        check = cli.check
        self.weights = parse_weights(self.env_weights)
        check(self.train_memory in ("full", "blank", "continuation"),
              f"--train-memory must be full, blank or continuation, not {self.train_memory!r}")
        self.eval_modes = [m.strip() for m in self.eval_memory.split(",") if m.strip()] or [self.train_memory]
        bad = [m for m in self.eval_modes if m not in MEMORY_MODES]
        check(self.eval_modes and not bad, f"--eval-memory: unknown {bad}; choose from {','.join(MEMORY_MODES)}")
        check("shuffle" not in self.eval_modes or self.eval_tasks > self.eval_stream_len,
              "--eval-memory shuffle needs 2 or more streams: make --eval-tasks larger than --eval-stream-len")
        check(self.whiten in ("global", "env"), f"--whiten must be global or env, not {self.whiten!r}")
        check(self.family in ("relay", "standard", "both"), f"--family must be relay, standard or both, not {self.family!r}")
        for name in ("steps", "eta", "num_workers", "train_ranks", "eval_tasks", "eval_every", "warmstart_tasks",
                     "extra_train_relay"):
            check(getattr(self, name) >= 0, f"{cli.flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("batch_episodes", "rollout_batch", "max_queue", "max_turns", "max_new_tokens",
                     "eval_stream_len", "save_every", "micro_batch_tokens", "warmstart_batch"):
            check(getattr(self, name) >= 1, f"{cli.flag(name)} must be >= 1, got {getattr(self, name)}")
        check(self.warmstart_steps >= -1, f"--warmstart-steps must be -1 (auto) or >= 0, got {self.warmstart_steps}")
        check(self.context_budget >= 2 * self.max_new_tokens + 256,
              f"--context-budget {self.context_budget} leaves no room for a task prompt and two replies of "
              f"{self.max_new_tokens} tokens: raise it or lower --max-new-tokens")
        check(1 <= self.num_minibatches <= self.batch_episodes, "--num-minibatches must be in [1, batch_episodes]")
        if self.warmstart_lr == -1:
            self.warmstart_lr = 2e-3 if self.model == "reader" else 5e-3
        if self.temperature == -1:
            self.temperature = 0.5 if self.model in LAPTOP_MODELS or self.model.startswith("tiny") else 1.0
        for name in ("lr", "temperature", "warmstart_lr"):
            cli.check_number(name, getattr(self, name), lo=0, lo_open=True)
        cli.check_number("gamma", self.gamma, lo=0, hi=1, lo_open=True)
        cli.check_number("lam", self.lam, lo=0, hi=1)
        cli.check_number("warmstart_threshold", self.warmstart_threshold, lo=0, hi=1)
        cli.check_number("worker_timeout_s", self.worker_timeout_s, lo=0, lo_open=True)
        for name in ("weight_decay", "clip_low", "clip_high", "vf_coef", "kl_coef", "entropy_coef", "max_grad_norm"):
            cli.check_number(name, getattr(self, name), lo=0)
        for name in ("behav_imp_weight_cap", "clip_ratio_c"):
            check(getattr(self, name) == 0 or getattr(self, name) > 1, f"{cli.flag(name)} must be 0 (off) or > 1")
        check(re.fullmatch(r"(cpu|cuda(:\d+)?)?", self.device),
              f"--device must be cpu, cuda or cuda:N (empty = cuda if available), got {self.device!r}")
        check(not self.device.startswith("cuda") or torch.cuda.is_available(),
              f"--device {self.device}: no CUDA device on this machine")
        if not self.model.startswith(("tiny", "smollm2", "small")) and self.model != "reader":
            cli.check_model_dir(self.model)
        if self.warmstart_steps == -1:
            self.warmstart_steps = {"reader": 300, "small": 150}.get(self.model, 0)
        if self.warmstart_reading == -1:
            self.warmstart_reading = 0.5 if self.model == "reader" else 0.0
        check(0 <= self.warmstart_reading < 1, f"--warmstart-reading must be in [0, 1) or -1 (auto), got {self.warmstart_reading}")
        check(self.warmstart_reading == 0 or self.model in LAPTOP_MODELS,
              f"--warmstart-reading rehearses camg_reader.py's rungs in its BPE: --model small or reader, not {self.model}")


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
    """torch threads per process on a CPU: the cores shared out, but 1 for a tiny or small model, whose
    small matmuls gain nothing from intra-op threads (they cost ~4x on a busy 2-core machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cfg.model.startswith("tiny") or cfg.model in LAPTOP_MODELS else max(1, cores // num_procs)


# -----------------------------------------------------------------------------------------------
# credit: rows of the training batch, GAE with the critic


def build_batch(samples: list[Sample], learner: Learner, gamma: float, lam: float, mask_memory: bool = False,
                whiten: str = "global"):
    """This rank's training rows with advantages and value targets, or None without a policy token.
    Every row (context) of an episode gets the episode's score at its last policy token: memory and task
    actions share the task return. values: the critic's at the start of this update. mask_memory: loss
    mask 0 on the tokens of actions that write or read memory files (Sample.memory_tokens).
    whiten: "global" centres the GAE advantages on their mean over all policy tokens and divides by their
    std; "env" centres each environment's tokens on that environment's own mean (a per-env baseline on
    top of the critic) and divides by the pooled within-env std. With "global", an env that fails every
    episode while another succeeds has every token pushed down, its protocol actions (the save, the `cat`)
    among them, which the envs share."""
    rows = []
    for s in samples:
        flags = s.memory_tokens if mask_memory and s.memory_tokens else [None] * len(s.rows)
        for (t, m, lp, temp), f in zip(s.rows, flags):
            m = [a * (1 - b) for a, b in zip(m, f)] if f is not None else m
            if any(m):
                rows.append((t, m, lp, temp, s.version, s.score, ENV_NAMES.index(s.env) if whiten == "env" else 0))
    if not rows:
        return None
    toks, masks, lps, temps, vers, scores, groups = map(list, zip(*rows))
    # each row is scored at the temperature it was sampled at (pi_prox / pi_behav = 1 on fresh rows)
    batch, d = make_batch(toks, masks, lps, versions=vers, temperatures=temps), learner.d
    if d.world_size > 1:            # every train rank built the same rows; each trains on its share
        batch = batch.shard(d.rank, d.world_size)
        scores, groups = scores[d.rank::d.world_size], groups[d.rank::d.world_size]
    mask = batch.loss_mask                                                 # [B, T]
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)               # [B] the last policy token
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=rewards.dtype)
    values = learner.values_of(batch).cpu()                               # [B, T], aligned with tokens
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    # per group (one, or one per env): token count, sum, sum of squares, all-reduced over the train ranks
    # so every rank centres and scales alike
    gid = torch.tensor(groups)
    sums = torch.tensor([[mask[gid == g].sum(), (adv * mask)[gid == g].sum(), (adv * adv * mask)[gid == g].sum()]
                         for g in range(len(ENV_NAMES))], dtype=torch.float64)          # [G, 3]
    if d.world_size > 1:
        sums = sums.to(d.device)
        torch.distributed.all_reduce(sums)
    n, s1, s2 = sums.cpu().T
    total = n.sum().clamp(min=1.0)
    mean = s1 / n.clamp(min=1.0)                                           # [G]
    std = max((s2.sum() / total - (n / total * mean * mean).sum()).item(), 0.0) ** 0.5   # pooled within groups
    centre = mean.to(adv.dtype)[gid][:, None]                              # [B, 1]: each row's group mean
    return replace(batch, advantages=(adv - centre) * mask / (std + 1e-8), returns=ret, old_values=values)


# -----------------------------------------------------------------------------------------------
# warm start: imitate the reference policies through the same rollout protocol (ppo's sft loss)


def warmstart_rows(cfg: Config, tokenizer, make_env) -> list:
    """(tokens, sft mask) rows: each env's reference policy on cfg.warmstart_tasks train tasks (spread
    over the split), run by camg_worker.reference_episodes at the run's context budget, so the rows are
    what the model sees, resets included: the continuation file written, `cat` back after the reset."""
    rows = []
    for name in cfg.weights:
        proto = make_env(name)
        train = proto.tasks("train")
        tasks = train[::max(1, len(train) // max(cfg.warmstart_tasks, 1))][:cfg.warmstart_tasks]
        eps, _ = reference_episodes(proto, tasks, tokenizer, cfg)
        rows += [(r.tokens, r.loss_mask) for ep in eps if not (ep.error or ep.env_error) for r in ep.rows()]
    return rows


def format_validity(cfg: Config, model, tokenizer, make_env, turns: int = 6) -> float:
    """Share of greedy replies on 4 held-out tasks per env that are actions the env accepts."""
    n = bad = 0
    for name in cfg.weights:
        env = make_env(name)
        eps = run_episodes(model, tokenizer, env, env.tasks("test")[:4],
                           memory=memory_note(env, cfg.train_memory != "blank"),
                           temperature=0.0, max_turns=turns, max_new_tokens=cfg.max_new_tokens,
                           context_budget=cfg.context_budget)
        n += sum(ep.num_turns for ep in eps)
        bad += sum(ep.num_format_errors + int(ep.info.get("num_invalid", 0)) for ep in eps)
        env.close()
    return 1.0 - bad / max(n, 1)


WARMSTART_CHECK_EVERY = 25        # imitation steps between two held-out format-validity checks


def reading_rows(cfg: Config, tokenizer):
    """n -> n rows of camg_reader.py's last stage's mix (since recipe 8 the line stage: the save and the
    read after a reset in the tasks' form, beside copies and spans whose words repeat; random words): the
    reading rehearsed in each warm-start batch. Imitation alone erases a reader's reading (measured on
    RIME's: lookups 1.00 -> 0.16 in 150 steps; with half of each batch rehearsal 0.69-0.89, docs/reader.md).
    Before 2026-12-06 this was the repeats stage's mix, whose save was recipe 6's form (`carry`); then the
    save stage's (recipe 7, Shop's note a line per attribute)."""
    import camg_reader
    import pretrain
    data = camg_reader.Data(tokenizer, cfg.seed + 31_337)
    mix = camg_reader.stages(camg_reader.Args())[-1][1]
    return lambda n: [(it.tokens, it.mask) for it in pretrain.step_items(data, mix, n)]


def warmstart_lr_at(cfg: Config, step: int) -> float:
    """The imitation lr at step 1..warmstart_steps: linear from warmstart_lr towards 0 (RIME's warm start
    measured the decay keeping more of the reading than a constant lr, docs/reader.md)."""
    return cfg.warmstart_lr * (1 - (step - 1) / cfg.warmstart_steps)


def warm_start(cfg: Config, learner: Learner, tokenizer, make_env, log) -> dict:
    """Imitation of the reference trajectories with ppo's sft loss in the RL learner itself, until held-out
    format validity reaches cfg.warmstart_threshold (checked every WARMSTART_CHECK_EVERY steps); skipped when the model
    already follows the protocol. The lr decays (warmstart_lr_at); with --warmstart-reading each batch also
    rehearses the reader's rungs. log(dict) gets a line per check."""
    before = format_validity(cfg, learner.gen_model, tokenizer, make_env)
    log({"step": 0, "validity": before})
    if before >= cfg.warmstart_threshold:
        print0(f"warm start skipped: format validity {before:.2f} >= {cfg.warmstart_threshold}")
        return {"validity_before": before, "validity_after": before, "steps": 0}
    rows = warmstart_rows(cfg, tokenizer, make_env)
    print0(f"warm start: {len(rows)} rows, {sum(len(r[0]) for r in rows)} tokens; validity {before:.2f}")
    rng, validity, step = random.Random(cfg.seed), before, 0
    rehearse = reading_rows(cfg, tokenizer) if cfg.warmstart_reading else None
    extra = round(cfg.warmstart_batch * cfg.warmstart_reading / (1 - cfg.warmstart_reading))
    bar = tqdm(range(1, cfg.warmstart_steps + 1), desc="warm start", disable=not learner.d.is_main)
    for step in bar:
        for g in learner.optimizer.param_groups:
            g["lr"] = warmstart_lr_at(cfg, step)
        batch = rng.sample(rows, min(cfg.warmstart_batch, len(rows))) + (rehearse(extra) if rehearse else [])
        stats = learner.update(make_batch([r[0] for r in batch], [[0] * len(r[1]) for r in batch],
                                          sft_mask=[r[1] for r in batch]))
        bar.set_postfix(sft=f"{stats.get('sft_loss', 0):.3f}")
        if step % WARMSTART_CHECK_EVERY == 0 or step == cfg.warmstart_steps:
            validity = format_validity(cfg, learner.gen_model, tokenizer, make_env)
            log({"step": step, "sft_loss": stats.get("sft_loss"), "validity": validity})
            if validity >= cfg.warmstart_threshold:
                break
    for g in learner.optimizer.param_groups:
        g["lr"] = cfg.lr
    return {"validity_before": before, "validity_after": validity, "steps": step}


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
                               "alive? (slow rollouts: raise --worker-timeout-s)")


def update_metrics(samples: list[Sample], stats: dict, version: int, state: dict) -> dict:
    """The health line of one update: reward parts per env, PPO health, staleness, throughput, resets."""
    mean = lambda xs: sum(xs) / max(len(xs), 1)                     # noqa: E731
    m = {"score": mean([s.score for s in samples]), "success": mean([s.success for s in samples])}
    for n in ENV_NAMES:
        mine = [s for s in samples if s.env == n]
        if mine:
            m[f"score/{n}"], m[f"success/{n}"] = mean([s.score for s in mine]), mean([s.success for s in mine])
    m.update({k: stats[k] for k in ("approx_kl", "clipfrac", "entropy", "value_loss", "explained_var", "grad_norm",
                                    "loss", "tokens_per_s", "response_len", "num_stale", "version") if k in stats})
    lags = [version - s.version for s in samples]                   # versions behind the learner when trained
    resets = [r for s in samples for r in s.reset_log]
    reset_eps, plain = [s for s in samples if s.num_resets], [s for s in samples if not s.num_resets]
    m.update(lag_mean=mean(lags), lag_max=max(lags), dropped_stale=state["num_stale"],
             failed=state["num_failed"], resets=mean([s.num_resets for s in samples]),
             with_reset=mean([bool(s.num_resets) for s in samples]),
             written_before_reset=mean([r["before"] == "written" for r in resets]) if resets else None,
             read_after_reset=mean([r["read"] for r in resets]) if resets else None,
             success_with_reset=mean([s.success for s in reset_eps]) if reset_eps else None,
             success_without_reset=mean([s.success for s in plain]) if plain else None,
             gen_tokens_per_s=sum(s.gen_tokens for s in samples) / max(sum(s.gen_s for s in samples), 1e-9))
    return m


HEALTH = [("score", "score", ".3f"), ("success", "success", ".2f"), ("| kl", "approx_kl", ".4f"),
          ("clip", "clipfrac", ".3f"), ("ent", "entropy", ".2f"), ("vloss", "value_loss", ".4f"),
          ("ev", "explained_var", ".2f"), ("gnorm", "grad_norm", ".2f"), ("| tok/s", "tokens_per_s", ".0f"),
          ("| resets", "resets", ".2f"), ("written", "written_before_reset", ".2f"), ("read", "read_after_reset", ".2f"),
          ("| lag", "lag_mean", ".1f"), ("stale", "dropped_stale", "d"), ("failed", "failed", "d")]


def one_line(m: dict) -> str:
    return f"update {m['update']:4d} | " + cli.health_line(m, HEALTH)


def save_checkpoint(learner: Learner, ckpt: Path, step: int) -> None:
    """Learner.save writes ckpt.tmp and swaps it in: a crash while saving leaves the last one whole."""
    learner.save(str(ckpt), caller_state={"step": step})


@dataclass
class Run:
    """What the phases of learner_main share."""
    cfg: Config
    d: Dist
    make_env: object
    learner: Learner
    tokenizer: object
    ex: Exchange
    step: int = 0
    resuming: bool = False
    t0: float = field(default_factory=time.time)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def training(self) -> bool:
        return not self.cfg.eval_only and self.step < self.cfg.steps

    def append(self, name: str, row: dict) -> None:
        if self.d.is_main:
            with open(self.run_dir / name, "a") as f:
                f.write(cli.dumps(row) + "\n")


def setup(cfg: Config, d: Dist, make_env) -> Run:
    """The run dir and its logs, the model and its learner (a value head: the critic), resume, and a
    fresh exchange session."""
    run_dir, ckpt = Path(cfg.run_dir), Path(cfg.run_dir) / "ckpt"
    resuming = cfg.resume and checkpoint_path(str(ckpt)) is not None
    saved = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    if resuming and saved.get("model", cfg.model) != cfg.model:
        cli.fail("camg.py", f"{run_dir} holds a checkpoint of --model {saved['model']}, not {cfg.model}: "
                 "pick another --run-dir, or --no-resume to start over")
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.eval_only:       # evaluating leaves a run's config and logs alone
            (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
            for name in ("metrics.jsonl", "episodes.jsonl", "eval.json", "warmstart.jsonl", "eval_before.pkl",
                         "summary.json") if not resuming else ():
                (run_dir / name).unlink(missing_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if cfg.model == "reader":       # the pretrained reader (camg_reader.py: built once, then cached)
        import camg_reader
        model, tokenizer = camg_reader.load()
        model.to(d.device)
    else:
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
    ex = Exchange(session_dir(cfg.exchange_dir, cfg.run_dir), cfg.max_queue)
    if d.is_main:
        for old in ex.root.parent.iterdir():
            if old != ex.root and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return Run(cfg, d, make_env, learner, tokenizer, ex, step, resuming)


def log_ladder(run: Run, when: str) -> None:
    """The reading ladder (camg_reader.py --check) of the policy now, in metrics.jsonl and printed: 64
    held-out items a rung, beside chance. Which rung fails says which copy a relay episode cannot make."""
    import camg_reader
    import pretrain
    ladder = pretrain.ladder(run.learner.gen_model, run.tokenizer, num_items=64, course=camg_reader.COURSE)
    run.append("metrics.jsonl", {"phase": "ladder", "when": when, **{k: v["accuracy"] for k, v in ladder.items()}})
    print0(f"reading ladder {when} (64 held-out items per rung):\n"
           + pretrain.ladder_table(ladder, 0.9, camg_reader.COURSE))


def warm_start_phase(run: Run) -> None:
    """Before RL (not when resuming: the checkpoint has it): the imitation warm start, logged to
    warmstart.jsonl, with the reading ladder before and after it (the laptop models). With --steps 0 the
    run is the warm start and its evaluation, checkpointed at step 0 so that a rerun only evaluates."""
    cfg = run.cfg
    if (run.training or cfg.steps == 0) and not cfg.eval_only and not run.resuming and cfg.warmstart_steps:
        ladder = run.d.is_main and cfg.model in LAPTOP_MODELS
        if ladder:
            log_ladder(run, "before the warm start")
        out = warm_start(cfg, run.learner, run.tokenizer, run.make_env, lambda r: run.append("warmstart.jsonl", r))
        run.append("warmstart.jsonl", {"final": True, **out})
        if ladder:
            log_ladder(run, "after the warm start")
        if cfg.steps == 0:
            save_checkpoint(run.learner, run.run_dir / "ckpt", 0)


def run_eval(run: Run, label: str, modes: list[str]) -> dict:
    """Every train rank evaluates its share of the streams; rank 0 gathers the parts through files (no
    collective waits on the slowest rank) and writes eval.md / eval.json. Returns {mode: results}."""
    cfg, d, out = run.cfg, run.d, {}
    for mode in modes:
        part = evaluate(cfg, run.learner.gen_model, run.tokenizer, mode, d.rank, d.world_size, run.make_env)
        name = f"eval-{label.replace(' ', '_')}-{run.step}-{mode}"
        run.ex.write(f"{name}-rank{d.rank}.pkl", part)
        out[mode] = merge(run.ex.gather(name, d.world_size)) if d.is_main else part
    if d.is_main:
        rows = [(f"this run: {cfg.model}, {label} (update {run.step}), memory {mode}", res) for mode, res in out.items()]
        text = table2(rows)
        (run.run_dir / "eval.md").write_text(f"Success (%) on test tasks, greedy ({label})\n\n{text}\n")
        run.append("eval.json", {"update": run.step, "label": label, "results": dict(rows),
                                 "relay_stages": {mode: relay_stages(res) for mode, res in out.items()}})
        print0(f"\nSuccess (%) on test tasks, greedy, {label} (the paper's Table 2 layout)\n{text}")
    return out


def before_key(cfg: Config) -> dict:
    """What a before-RL evaluation depends on besides the weights (kept beside it, compared on resume).
    first_turn: since 2026-12-05 every mode shows the first turn the policy trained on (camg_eval)."""
    return {"mode": cfg.eval_modes[0], "train_memory": cfg.train_memory, "eval_tasks": cfg.eval_tasks,
            "eval_stream_len": cfg.eval_stream_len, "first_turn": "trained"}


def stored_before(saved, cfg: Config, path) -> dict:
    """The before-RL results kept in eval_before.pkl, if they were made as this run would make them; else a
    one-line error (the weights before RL are gone, so they cannot be remade: pairing them with an
    evaluation of another kind would report a difference that RL did not make)."""
    key, want = (saved.get("key") if isinstance(saved, dict) and "results" in saved else None), before_key(cfg)
    if key != want:
        made = "by an older camg.py (another first turn)" if key is None else \
            ", ".join(f"{k} {v!r}" for k, v in key.items() if want.get(k) != v)
        cli.fail("camg.py", f"{path} (held-out success before RL) was made {'with ' if key else ''}{made}, which this "
                 "run would evaluate otherwise: rerun with the flags that made it, use --eval-only for another "
                 "evaluation, or start over with --no-resume")
    return saved["results"]


def before_rl(run: Run):
    """Held-out success before RL (after the warm start), kept in the run dir so a resumed run pairs with it."""
    path = run.run_dir / "eval_before.pkl"
    if path.exists() and run.cfg.eval_tasks and not run.cfg.eval_only:   # rerunning a finished run pairs with it too
        return stored_before(torch.load(path, weights_only=False), run.cfg, path)
    if not run.training or not run.cfg.eval_tasks:
        return None
    before = run_eval(run, "before RL", run.cfg.eval_modes[:1])[run.cfg.eval_modes[0]]
    if run.d.is_main:
        torch.save({"key": before_key(run.cfg), "results": before}, path)
    return before


def train(run: Run, num_spawn: int, remote_workers: bool) -> None:
    """The update loop: rollout workers (spawned, torchrun ranks, or inline), collect -> GAE -> PPO update
    -> publish the weights, a metrics row and a health line per update, checkpoints."""
    cfg, d, learner, ex = run.cfg, run.d, run.learner, run.ex
    remote = bool(num_spawn or remote_workers)
    if d.is_main and remote and not cfg.eval_only:   # weights published before any worker generates
        ex.publish(learner.gen_model.state_dict(), learner.version)
    training = run.training
    threads = cpu_threads(cfg, num_spawn + 1) if d.device.type == "cpu" else 4
    procs = [torch.multiprocessing.get_context("spawn").Process(
        target=worker_main, args=(cfg, i, str(d.device), threads, ex.root.name), daemon=True)
        for i in range(num_spawn if training else 0)]
    for p in procs:
        p.start()
    # one process: the rollout runs inline, with the learner's generation copy
    inline = RolloutWorker(cfg, learner.gen_model, run.tokenizer, 0, seed=cfg.seed + run.step, make_env=run.make_env) \
        if training and not remote else None

    def source() -> list[Sample]:
        if inline is not None:      # generate now, with the current weights (lag 0: synchronous)
            inline.version = learner.version
            return inline.rollout_batch()
        errors = [p.read_text() for p in sorted(ex.root.glob("worker*.error"))]
        if errors or not all(p.is_alive() for p in procs):
            raise RuntimeError("a rollout worker died:\n" + ("\n".join(errors) or "(no traceback; killed?)"))
        return ex.take() or time.sleep(0.05) or []

    def log(s: Sample, used: str) -> None:  # every episode the learner receives, and what became of it
        run.append("episodes.jsonl", {"update": run.step, "env": s.env, "task": s.task_id, "version": s.version,
                                      "lag": learner.version - s.version, "worker": s.worker, "score": s.score,
                                      "success": s.success, "finish": s.finish, "resets": s.num_resets,
                                      "reset_log": s.reset_log, "used": used, "error": s.error,
                                      "env_error": s.env_error})

    state = {"buffer": [], "num_stale": 0, "num_failed": 0}
    try:
        bar = tqdm(total=cfg.steps, initial=min(run.step, cfg.steps), disable=not d.is_main or not training, desc="camg")
        while training and run.step < cfg.steps:
            t0 = time.perf_counter()
            if d.is_main:           # rank 0 collects; the other train ranks read the same batch from a file
                samples = collect(state, learner.version, cfg, source, log)
                if d.world_size > 1:
                    ex.write(f"batch-{run.step}.pkl", samples)
            else:
                while (samples := ex.read(f"batch-{run.step}.pkl")) is None:
                    time.sleep(0.05)
            for s in samples:
                log(s, "train")
            batch = build_batch(samples, learner, cfg.gamma, cfg.lam, cfg.mask_memory_actions, cfg.whiten)
            version = learner.version
            stats = learner.update(batch, cfg.num_minibatches) if batch is not None else {}
            run.step += 1
            if d.is_main and remote:
                ex.publish(learner.gen_model.state_dict(), learner.version)
                (ex.root / f"batch-{run.step - 2}.pkl").unlink(missing_ok=True)   # every rank has read it by now
            m = {"update": run.step, **update_metrics(samples, stats, version, state),
                 "queue": len(ex.queued()), "update_s": time.perf_counter() - t0}
            run.append("metrics.jsonl", m)
            bar.update(1)
            if d.is_main:
                bar.write(one_line(m) if batch is not None else f"update {run.step}: no policy token in the batch")
            if run.step % cfg.save_every == 0 or run.step == cfg.steps:
                save_checkpoint(learner, run.run_dir / "ckpt", run.step)
            if cfg.eval_every and cfg.eval_tasks and run.step % cfg.eval_every == 0 and run.step < cfg.steps:
                run_eval(run, "during RL", cfg.eval_modes)
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
        if inline is not None:
            inline.close()


def report(run: Run, before, after: dict) -> None:
    """summary.json and the before/after table with the reset statistics and the relay stages (rank 0).
    --eval-only writes summary_eval.json instead and prints the reset statistics and relay stages only:
    the run's own summary stays."""
    if not run.d.is_main:
        return
    s = summary(before, after, time.time() - run.t0)
    name = "summary_eval.json" if run.cfg.eval_only else "summary.json"
    (run.run_dir / name).write_text(cli.dumps(s, indent=2) + "\n")
    print0(("\nHeld-out success before vs after RL (paired by task)\n" if s["per_env"] else "\n") + effect_table(s))


def learner_main(cfg: Config, d: Dist, num_spawn: int = 0, remote_workers: bool = False, make_env=None):
    run = setup(cfg, d, make_env or env_maker(cfg))
    warm_start_phase(run)
    before = before_rl(run)
    train(run, num_spawn, remote_workers)
    if cfg.eval_tasks:
        report(run, before, run_eval(run, "after RL" if before is not None else "evaluation", cfg.eval_modes))
    return run.learner
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
