"""RIME: one model, shared weights, two roles, trained by RL so that its memory makes later tasks
of a stream go better (RIME, Section 3; DESIGN.md "RIME in detail").

    python rime.py                                   # laptop: warm start + RL on Symbolic Alchemy (~15 min, 2 CPU cores)
    python rime.py --model tiny --steps 2            # smoke run (< 1 min)
    torchrun --nproc_per_node 8 rime.py --preset paper --model <HF dir> --env codebase   # full scale

The loop, per RL step:
  1. sample streams from curriculum.py (6 easy then 6 hard tasks of one world / repository) and
     run each `group_size` times side by side (the GRPO group);
  2. along each stream: the actor solves task t with memory M(t-1) and scores s(t); the writer
     reads the trajectory and writes M(t); the judge compares M(t-1) with M(t) (never the
     trajectory) and gives e(t);
  3. actor advantage = GRPO(s) over the group at (stream, t) + beta * standardised e (on the
     advantage, not the reward); writer reward = format gate * (mean s[t+1..t+K] - mean
     s[t-K+1..t]) + 0.1 * gate, GRPO over the group at (stream, t); the last memory is dropped;
  4. one PPO step on both roles' tokens with the shared weights.

Before RL, a warm start (imitation of the scripted reference actor and writer, `ppo.sft_loss` in
the same learner) teaches a small model the action format; it stops when held-out format validity
reaches `warmstart_threshold`, and is skipped when the model already follows the protocol.

Ablations (the paper's table): --no-explore, --writer frozen|decoupled, --order shuffled,
--segment 3, --beta / --explore-mode reward --lam, --k, --judge heuristic|local|openai.

Departures from the paper, on purpose: the laptop preset uses a tiny Qwen3.5 warm-started from
scratch (SmolLM2-135M generates ~40 tok/s here, too slow for RL in 15 minutes: `--model smollm2`
runs it), groups of 4 instead of 8, 3+3 streams and short episodes. Ranks split the streams and run
whole groups each, so group statistics never cross ranks; rank 0 evaluates and writes files.
"""

import argparse
import copy
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

import curriculum
import envs
import judge as judges
import rewards
import rollout
from model import load, load_tokenizer, save, tiny
from ppo import Learner, checkpoint_path, init_distributed, make_batch, print0, teardown_distributed

# -----------------------------------------------------------------------------
# config


@dataclass
class Args:
    """RIME training. Defaults are the laptop preset; `--preset paper` sets the paper's values."""
    preset: str = "laptop"           # laptop | paper (paper: groups of 8, 6+6 streams, lr 1e-6, 40 turns, 2048-token memory)
    model: str = "small"             # small (a 1.7M Qwen3 from tiny(), warm-started) | tiny (smoke) | smollm2 | HF checkpoint dir
    env: str = "alchemy"             # alchemy | codebase
    run_dir: str = "runs/rime"       # config, metrics.jsonl, memories/, checkpoints; resumed if it exists
    resume: bool = True              # resume from run_dir's last checkpoint when there is one
    seed: int = 0
    steps: int = 4                   # RL steps (one PPO update each)
    streams_per_step: int = 2        # streams per step per rank; each runs group_size times
    group_size: int = 4              # GRPO group size (paper 8)
    segment: int = 3                 # tasks per curriculum block: a stream is segment easy + segment hard (paper 6)
    order: str = "easy_to_hard"      # easy_to_hard | shuffled (the curriculum ablation)
    tier: str = "hard"               # second block's band: easy | mid | hard | mixed
    k: int = 3                       # writer reward window K
    beta: float = 0.3                # exploration bonus on the actor's advantage
    explore_mode: str = "advantage"  # advantage (RIME) | reward (score + lam * explore)
    lam: float = 0.1                 # weight of explore in the reward form
    no_explore: bool = False         # ablation: no exploration reward (the judge is never called)
    writer: str = "shared"           # shared | frozen (writer = initial weights, not trained) | decoupled (own weights)
    judge: str = "heuristic"         # heuristic | local (a frozen copy of --judge-model) | openai
    judge_model: str = ""            # local judge checkpoint (default: --model)
    judge_url: str = ""              # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    judge_api_model: str = ""        # model name at that endpoint (key from $OPENAI_API_KEY)
    lr: float = 3e-4                 # RL learning rate (paper 1e-6 on 4B; a tiny model needs more)
    kl_coef: float = 0.01            # k1 KL to the frozen reference
    clip_low: float = 0.2
    clip_high: float = 0.28
    temperature: float = 1.0
    max_turns: int = 24              # actor turns per task (paper 40)
    max_new_tokens: int = 24         # tokens per actor reply
    memory_tokens: int = 160         # memory cap in tokens (paper 2048)
    traj_chars: int = 1200           # trajectory budget the writer sees
    micro_batch_tokens: int = 16384
    warmstart_steps: int = -1        # max imitation steps before RL; -1 = auto (150 for small/smollm2/dirs on alchemy, 0 for tiny)
    warmstart_threshold: float = 0.95  # held-out format validity that ends the warm start
    warmstart_lr: float = 3e-3
    warmstart_batch: int = 8         # rows per imitation step
    warmstart_streams: int = 48      # scripted streams that make the imitation data
    eval_attempts: int = 2           # from-scratch attempts per task when eval_temperature > 0 (benchmark: 4)
    eval_temperature: float = 0.0    # 0 = greedy evaluation (then one from-scratch attempt is exact)
    eval_every: int = 0              # also evaluate every N RL steps (0 = only before and after)
    checkpoint_every: int = 1        # RL steps between checkpoints
    threads: int = 0                 # CPU threads per process; 0 = auto (1 for tiny/small models: their ops are too small to split)

    def __post_init__(self):
        if self.warmstart_steps < 0:     # auto: the smoke model and codebase skip it
            self.warmstart_steps = 150 if (self.model != "tiny" and self.env == "alchemy") else 0
        if self.model == "tiny":         # the smoke run: the whole pipeline, minimal sizes
            for name, value in dict(streams_per_step=1, group_size=2, segment=1, max_turns=6,
                                    max_new_tokens=16, memory_tokens=48, eval_attempts=1).items():
                if getattr(self, name) == getattr(Args, name):
                    setattr(self, name, value)
        if self.preset == "paper":
            for name, value in dict(group_size=8, segment=6, lr=1e-6, max_turns=40, max_new_tokens=512,
                                    memory_tokens=2048, traj_chars=8000, eval_attempts=4,
                                    warmstart_steps=0).items():
                if getattr(self, name) == getattr(Args, name):   # explicit flags win over the preset
                    setattr(self, name, value)
        checks = [
            (self.preset in ("laptop", "paper"), f"--preset must be laptop or paper, got {self.preset!r}"),
            (self.env in ("alchemy", "codebase"), f"--env must be alchemy or codebase (RIME's domains), got {self.env!r}"),
            (self.model in ("small", "tiny", "smollm2") or os.path.isdir(self.model),
             f"--model {self.model!r}: not 'small', 'tiny', 'smollm2' or an existing checkpoint directory"),
            (self.k >= 1, f"--k must be >= 1, got {self.k}"),
            (self.group_size >= 2, f"--group-size must be >= 2 for group baselines, got {self.group_size}"),
            (self.segment >= 1 and self.steps >= 0 and self.streams_per_step >= 1, "segment, streams-per-step >= 1 and steps >= 0"),
            (self.order in ("easy_to_hard", "shuffled"), f"--order must be easy_to_hard or shuffled, got {self.order!r}"),
            (self.explore_mode in ("advantage", "reward"), "--explore-mode must be advantage or reward"),
            (self.writer in ("shared", "frozen", "decoupled"), "--writer must be shared, frozen or decoupled"),
            (self.judge in ("heuristic", "local", "openai"), "--judge must be heuristic, local or openai"),
            (self.judge != "openai" or (self.judge_url and self.judge_api_model), "--judge openai needs --judge-url and --judge-api-model"),
            (self.warmstart_steps == 0 or self.env == "alchemy",
             "the warm start imitates the scripted Alchemy writer: use --warmstart-steps 0 with --env codebase"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SystemExit(f"rime.py: bad config: {msg}")


def parse_args(argv=None) -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool and f.default:      # --resume / --no-resume
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=True)
        elif f.type is bool:                   # a switch such as --no-explore (store_true: argparse's
            p.add_argument(flag, action="store_true")   # BooleanOptionalAction reads "--no-x" as False)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    return Args(**vars(p.parse_args(argv)))


# -----------------------------------------------------------------------------
# models, judge, streams


def load_model(name: str, seed: int):
    if name == "tiny":      # the embedded test model: random weights, for smoke runs
        return tiny("qwen3_5", seed=seed, max_seq_len=8192)
    if name == "small":     # big enough to learn the Alchemy protocol by imitation in minutes on 2 cores;
        # Qwen3 rather than Qwen3.5: the DeltaNet's chunked rule in plain PyTorch trains ~2.3x slower on CPU.
        # Its BPE also learns merges from Alchemy text, so an observation takes ~half the tokens.
        from model import build_tokenizer
        tok = build_tokenizer(2048, extra_text=_domain_text())
        return tiny("qwen3", seed=seed, tokenizer=tok, hidden_size=192, num_layers=4, intermediate_size=512,
                    max_seq_len=8192)
    return load(name), load_tokenizer(name)


def _domain_text() -> str:
    """Deterministic sample of what the small model will read and write: scripted Alchemy episodes
    (observations, actions, memories) and the role prompts; the tokenizer's merges are trained on it."""
    from alchemy import memory_text
    env = envs.make("alchemy", num_trials=1, seed=99)
    parts = [rollout.ACTOR_SYSTEM, rollout.WRITER_SYSTEM, rollout.MEMORY_HEADER]
    for task in env.tasks("train")[::9][:40]:
        policy, obs, done = env.reference_policy(task), env.reset(task), False
        parts.append(obs)
        while not done:
            action = policy(obs)
            obs, _, done = env.step(action)
            parts += [f"<action>{action}</action>", obs]
        parts.append(memory_text(policy.knowledge, task.id, env.info.get("score", 0.0)))
    return "\n".join(parts)


def make_judge(args: Args, tokenizer):
    if args.no_explore:
        return None
    if args.judge == "heuristic":
        return judges.HeuristicJudge()
    if args.judge == "openai":
        return judges.LLMJudge(judges.openai_complete(args.judge_url, args.judge_api_model))
    jm, jt = load_model(args.judge_model or args.model, args.seed)
    return judges.LLMJudge(judges.local_complete(jm.eval(), jt))


def train_streams(env, tasks, args: Args, step: int, rank: int):
    """This rank's streams for one RL step, each repeated group_size times (a GRPO group)."""
    base = curriculum.make_streams(tasks, args.streams_per_step, order=args.order, segment=args.segment,
                                   seed=args.seed * 1_000_003 + step * 101 + rank, tier=args.tier)
    return base, [s for s in base for _ in range(args.group_size)]


def eval_stream(env, args: Args):
    """The held-out stream: easy_to_hard on the first test world / the codebase test stream."""
    if args.env == "codebase":
        import codebase
        return codebase.test_stream()          # the benchmark's 19 issues: 9 tablib, then 10 tenacity
    tasks = env.tasks("test")
    first = [t for t in tasks if t.group == tasks[0].group]
    return curriculum.make_stream(first, order="easy_to_hard", segment=args.segment, seed=12345)


# -----------------------------------------------------------------------------
# evaluation: cumulative reward with memory vs from scratch (greedy)


def evaluate(model, tokenizer, env, stream, args: Args, writer_model=None) -> dict:
    model.eval()
    kw = dict(temperature=args.eval_temperature, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens)
    with_mem = rollout.run_streams(model, tokenizer, env, [stream], writer_model=writer_model,
                                   memory_tokens=args.memory_tokens, traj_chars=args.traj_chars, seed=1, **kw)[0]
    # from scratch: every task with empty memory, decoded exactly as the run with memory (so the
    # first task, which has no memory yet, gains 0 by construction); greedy needs one attempt
    scratch = [[] for _ in stream]
    for a in range(args.eval_attempts if args.eval_temperature > 0 else 1):
        eps = rollout.run_episodes(model, tokenizer, env, stream, memory="", seed=100 + a, **kw)
        for t, ep in enumerate(eps):
            scratch[t].append(ep.score)
    m = rewards.stream_metrics(with_mem.scores, scratch)
    turns = sum(ep.num_turns for ep in with_mem.episodes)
    invalid = sum(ep.num_format_errors + int(ep.info.get("invalid", 0)) for ep in with_mem.episodes)
    return {"cumulative_reward": m.cumulative_reward, "cumulative_scratch": m.cumulative_scratch,
            "cumulative_gain": m.cumulative_gain, "gains": m.gains, "scores": with_mem.scores,
            "validity": 1.0 - invalid / max(turns, 1), "memories": [w.memory for w in with_mem.writes]}


# -----------------------------------------------------------------------------
# warm start: imitation rows from the scripted actor and writer, through the rollout protocol


def expert_rows(tokenizer, env, tasks, num_streams, segment, seed, traj_chars):
    """Scripted streams rendered exactly as rollouts are: actor rows from run_scripted (loss mask on
    the agent's tokens) and writer rows = the writer prompt rollout.write_memory builds + the
    scripted memory (alchemy.memory_text of what the reference actor inferred)."""
    from alchemy import memory_text
    fmt = rollout.ChatFormat(tokenizer)
    streams = curriculum.make_streams(tasks, num_streams, order="easy_to_hard", segment=segment, seed=seed)
    rows, memories = [], [""] * len(streams)
    envs_ = [env] + [env.clone() for _ in streams[1:]]
    for t in range(len(streams[0])):
        ts = [s[t] for s in streams]
        pols = [env.reference_policy(task, notes=m or None) for task, m in zip(ts, memories)]
        eps = rollout.run_scripted(tokenizer, envs_, ts, pols, memory=memories)
        for i, (ep, pol) in enumerate(zip(eps, pols)):
            rows += [(r.tokens, r.loss_mask) for r in ep.rows()]
            new = memory_text(pol.knowledge, ep.task.id, ep.score)
            prompt = fmt.prompt(rollout.WRITER_SYSTEM, rollout.writer_prompt(ep, memories[i], traj_chars))
            target = fmt.encode(new) + [fmt.end_id]
            rows.append((prompt + target, [0] * len(prompt) + [1] * len(target)))
            memories[i] = new
    return rows


def format_validity(model, tokenizer, env, tasks, args: Args, turns=6, with_score=False):
    """Share of greedy actor replies on held-out tasks that are valid actions (and the mean score
    those short episodes reach, if with_score)."""
    eps = rollout.run_episodes(model, tokenizer, env, tasks, temperature=0.0, max_turns=turns,
                               max_new_tokens=args.max_new_tokens)
    n = sum(ep.num_turns for ep in eps)
    bad = sum(ep.num_format_errors + int(ep.info.get("invalid", 0)) for ep in eps)
    validity = 1.0 - bad / max(n, 1)
    return (validity, sum(ep.score for ep in eps) / len(eps)) if with_score else validity


def warm_start(learner, tokenizer, env, args: Args, log) -> dict:
    gen = learner.gen_model
    held_out = env.tasks("test")[: 8]
    before, score_before = format_validity(gen, tokenizer, env, held_out, args, with_score=True)
    log({"phase": "warmstart", "step": 0, "validity": before, "score": score_before})
    if before >= args.warmstart_threshold:
        print0(f"warm start skipped: format validity {before:.2f} >= {args.warmstart_threshold}")
        return {"validity_before": before, "validity_after": before, "steps": 0,
                "score_before": score_before, "score_after": score_before}
    rows = expert_rows(tokenizer, env, env.tasks("train"), args.warmstart_streams, args.segment, args.seed,
                       args.traj_chars)
    print0(f"warm start: {len(rows)} expert rows, {sum(len(r[0]) for r in rows)} tokens; validity {before:.2f}")
    rng = random.Random(args.seed)
    for g in learner.optimizer.param_groups:
        g["lr"] = args.warmstart_lr
    from tqdm import tqdm
    bar = tqdm(range(1, args.warmstart_steps + 1), desc="warm start", disable=not _is_main())
    validity, step = before, 0
    for step in bar:
        batch = rng.sample(rows, min(args.warmstart_batch, len(rows)))
        b = make_batch([r[0] for r in batch], [[0] * len(r[1]) for r in batch], sft_mask=[r[1] for r in batch])
        stats = learner.update(b)
        bar.set_postfix(sft=f"{stats.get('sft_loss', 0):.3f}")
        if step % 25 == 0 or step == args.warmstart_steps:
            validity = format_validity(learner.gen_model, tokenizer, env, held_out, args)
            log({"phase": "warmstart", "step": step, "sft_loss": stats.get("sft_loss"), "validity": validity})
            if validity >= args.warmstart_threshold:
                break
    for g in learner.optimizer.param_groups:
        g["lr"] = args.lr
    validity, score_after = format_validity(learner.gen_model, tokenizer, env, held_out, args, with_score=True)
    log({"phase": "warmstart", "step": step, "validity": validity, "score": score_after, "final": True})
    return {"validity_before": before, "validity_after": validity, "steps": step,
            "score_before": score_before, "score_after": score_after}


def _is_main():
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


# -----------------------------------------------------------------------------
# one RL step's rewards -> rows


def rl_rows(outs, groups_of, args: Args, writer_prompt_text: str):
    """Actor and writer rows with their advantages, plus the named reward parts for logging.
    outs: StreamRollout per copy; groups_of[c] = the base stream index of copy c."""
    actor, writer, parts = [], [], {}
    T = len(outs[0].tasks)
    scores = [s for o in outs for s in o.scores]
    explore = [e if e is not None else 0.0 for o in outs for e in o.explore]
    groups = [(groups_of[c], t) for c in range(len(outs)) for t in range(T)]
    adv = rewards.actor_advantages(scores, groups, explore, beta=0.0 if args.no_explore else args.beta,
                                   mode=args.explore_mode, lam=0.0 if args.no_explore else args.lam)
    for i, (c, t) in enumerate((c, t) for c in range(len(outs)) for t in range(T)):
        if adv.keep[i]:
            for r in outs[c].episodes[t].rows():
                actor.append((r.tokens, r.loss_mask, r.logprobs, adv.advantages[i]))
    # writer: windowed reward per copy, then GRPO over the group at (stream, position)
    w_rewards, w_groups, w_items, deltas, pasts, oks = [], [], [], [], [], []
    for c, o in enumerate(outs):
        wr = rewards.writer_rewards_gated(o.scores, args.k, [w.memory for w in o.writes], o.memories,
                                          prompt_text=writer_prompt_text)
        for t, r in enumerate(wr):
            oks.append(float(r.ok))
            if not r.trainable:
                continue                     # the last memory has no later task: no reward, no row
            w_rewards.append(r.reward); w_groups.append((groups_of[c], t)); w_items.append(o.writes[t])
            deltas.append(r.delta); pasts.append(r.past_mean)
    w_adv, w_keep = rewards.group_advantages(w_rewards, w_groups)
    if args.writer != "frozen":
        for w, a, k in zip(w_items, w_adv, w_keep):
            if k:
                writer.append((w.tokens, w.loss_mask, w.logprobs, a))
    statuses = [w.status for o in outs for w in o.writes]
    parts.update(score=sum(scores) / len(scores), explore=sum(explore) / len(explore),
                 explore_bonus=sum(abs(b) for b in adv.explore_bonus) / len(scores),
                 writer_reward=sum(w_rewards) / max(len(w_rewards), 1), writer_format_ok=sum(oks) / len(oks),
                 writer_delta=sum(deltas) / max(len(deltas), 1),
                 mean_reversion_corr=rewards.mean_reversion_corr(deltas, pasts) if len(deltas) > 2 else float("nan"),
                 writer_empty=statuses.count("empty") / len(statuses),
                 writer_truncated=statuses.count("truncated") / len(statuses),
                 actor_rows=len(actor), writer_rows=len(writer),
                 actor_groups_dropped=adv.num_dropped_groups, writer_groups_dropped=w_keep.count(False) / max(args.group_size, 1),
                 format_errors=sum(ep.num_format_errors for o in outs for ep in o.episodes) / len(scores))
    return actor, writer, parts


def batch_of(rows, version):
    # every rank must join every update (FSDP collectives): a rank whose groups were all dropped
    # joins with one empty row (mask 0), which contributes nothing to the global token mean
    rows = rows or [([0, 0], [0, 0], [0.0, 0.0], 0.0)]
    return make_batch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                      versions=[version] * len(rows))


# -----------------------------------------------------------------------------
# main


def main(argv=None):
    args = parse_args(argv)
    d = init_distributed()
    if d.device.type == "cpu" and (args.threads or args.model in ("tiny", "small")):
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(args.seed + d.rank)
    random.seed(args.seed + d.rank)
    os.makedirs(os.path.join(args.run_dir, "memories"), exist_ok=True)
    ckpt = os.path.join(args.run_dir, "checkpoint")
    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    if d.is_main:
        with open(os.path.join(args.run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=2)

    def log(row):
        row = {"time": time.time(), **row}
        if d.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row, default=float) + "\n")

    # --- setup: model, learner(s), environment, judge
    t_start = time.time()
    model, tokenizer = load_model(args.model, args.seed)
    # the laptop preset plays one Alchemy trial per task (the paper's episodes are longer): short rows
    env = envs.make(args.env, **({"num_trials": 1} if args.env == "alchemy" and args.preset == "laptop" else {}))
    train_tasks = env.tasks("train")
    judge = make_judge(args, tokenizer)
    # activation checkpointing pays off on GPUs with real models; on CPU small models it only recomputes
    learner = Learner(model, ref_model=copy.deepcopy(model), lr=args.lr, clip_low=args.clip_low,
                      clip_high=args.clip_high, kl_coef=args.kl_coef, micro_batch_tokens=args.micro_batch_tokens,
                      gradient_checkpointing=d.device.type == "cuda", dist_info=d)
    stream = eval_stream(env, args)
    state = {"step": 0, "warm": None, "eval_before": None}
    # every rank decides before any rank saves, or a fast rank's first save could make a slow rank
    # "resume" from a half-written one (ppo.checkpoint_path only returns complete checkpoints)
    if args.resume and checkpoint_path(ckpt) is not None:
        state = learner.load(ckpt)
        print0(f"resumed from {ckpt} at RL step {state['step']}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()

    # --- warm start (imitation), then the evaluation before RL
    if state["warm"] is None:
        state["warm"] = warm_start(learner, tokenizer, env, args, log) if args.warmstart_steps else {}
        if d.is_main and state["warm"].get("steps"):
            save(learner.gen_model, tokenizer, os.path.join(args.run_dir, "warmstart"))
            print0(f"warm-started weights saved to {args.run_dir}/warmstart (rerun RL with --model it --warmstart-steps 0)")
    if state["warm"].get("steps"):
        learner.reset_reference()   # the KL anchors RL to the warm-started policy (not checkpointed: redone on resume)
    # the frozen writer is the weights RL starts from; the decoupled writer trains its own copy
    writer_learner = None
    writer_model = None
    if args.writer == "frozen":
        writer_model = copy.deepcopy(learner.gen_model)
    elif args.writer == "decoupled":
        wm = copy.deepcopy(learner.gen_model).float().requires_grad_(True)   # the generation copy is frozen (bf16 on GPU)
        writer_learner = Learner(wm, ref_model=copy.deepcopy(wm), lr=args.lr, clip_low=args.clip_low,
                                 clip_high=args.clip_high, kl_coef=args.kl_coef,
                                 micro_batch_tokens=args.micro_batch_tokens,
                                 gradient_checkpointing=d.device.type == "cuda", dist_info=d)
        writer_model = writer_learner.gen_model
    if state["eval_before"] is None:
        state["eval_before"] = evaluate(learner.gen_model, tokenizer, env, stream, args, writer_model) if d.is_main else {}
        log({"phase": "eval", "step": 0, **{k: v for k, v in state["eval_before"].items() if k != "memories"}})
        learner.save(ckpt, caller_state=state)

    # --- RL
    from tqdm import tqdm
    bar = tqdm(range(state["step"], args.steps), desc="RIME RL", disable=not d.is_main,
               initial=state["step"], total=args.steps)
    for step in bar:
        t0 = time.time()
        base, copies = train_streams(env, train_tasks, args, step, d.rank)
        groups_of = [c // args.group_size for c in range(len(copies))]
        outs = rollout.run_streams(learner.gen_model, tokenizer, env, copies, writer_model=writer_model, judge=judge,
                                   temperature=args.temperature, seed=args.seed * 7 + step * 1009 + d.rank,
                                   max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                                   memory_tokens=args.memory_tokens, traj_chars=args.traj_chars)
        t_roll = time.time() - t0
        actor, writer, parts = rl_rows(outs, groups_of, args, rollout.WRITER_SYSTEM)
        if args.writer == "decoupled":      # two sets of weights, each trained on its own role's rows
            stats = learner.update(batch_of(actor, learner.version))
            wstats = writer_learner.update(batch_of(writer, writer_learner.version))
            stats.update({f"writer_{k}": v for k, v in wstats.items()})
        else:                               # shared weights: one PPO step on both roles' tokens
            stats = learner.update(batch_of(actor + writer, learner.version))
        row = {"phase": "rl", "step": step + 1, "rollout_s": t_roll, "step_s": time.time() - t0, **parts, **stats}
        log(row)
        if d.is_main:
            with open(os.path.join(args.run_dir, "memories", f"step{step + 1:04d}.jsonl"), "w") as f:
                for c, o in enumerate(outs):
                    f.write(json.dumps({"copy": c, "tasks": [t.id for t in o.tasks], "scores": o.scores,
                                        "memories": [w.memory for w in o.writes], "explore": o.explore}) + "\n")
        bar.set_postfix(score=f"{parts['score']:.3f}", wr=f"{parts['writer_reward']:.3f}",
                        kl=f"{stats.get('approx_kl', 0):.4f}")
        print0(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                          if k in ("step", "score", "explore", "writer_reward", "writer_format_ok", "approx_kl",
                                   "clipfrac", "entropy", "kl_ref", "grad_norm", "response_len", "tokens_per_s")))
        state["step"] = step + 1
        if args.eval_every and state["step"] % args.eval_every == 0 and d.is_main:
            ev = evaluate(learner.gen_model, tokenizer, env, stream, args, writer_model)
            log({"phase": "eval", "step": state["step"], **{k: v for k, v in ev.items() if k != "memories"}})
        if state["step"] % args.checkpoint_every == 0 or state["step"] == args.steps:
            learner.save(ckpt, caller_state=state)

    # --- the evaluation after RL, and the report
    if d.is_main:
        after = evaluate(learner.gen_model, tokenizer, env, stream, args, writer_model)
        log({"phase": "eval", "step": state["step"], "final": True, **{k: v for k, v in after.items() if k != "memories"}})
        before, warm = state["eval_before"], state["warm"] or {}
        summary = {"warmstart": warm, "before": before, "after": after, "wall_s": time.time() - t_start,
                   "stream": [t.id for t in stream]}
        with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
        plot_gain(before, after, os.path.join(args.run_dir, "gain.png"))
        print("\n| held-out stream | format validity | cumulative reward | from scratch | cumulative gain |")
        print("|---|---|---|---|---|")
        for name, ev in (("before RL", before), ("after RL", after)):
            print(f"| {name} | {ev['validity']:.2f} | {ev['cumulative_reward']:.2f} | "
                  f"{ev['cumulative_scratch']:.2f} | {ev['cumulative_gain']:+.2f} |")
        if warm:
            print(f"\nwarm start: validity {warm['validity_before']:.2f} -> {warm['validity_after']:.2f}, "
                  f"held-out score {warm['score_before']:.2f} -> {warm['score_after']:.2f} (6-turn episodes) "
                  f"in {warm['steps']} steps")
        print(f"stream of {len(stream)} tasks ({stream[0].group}); wall time {summary['wall_s'] / 60:.1f} min; "
              f"run dir {args.run_dir}")
    teardown_distributed()


def plot_gain(before: dict, after: dict, path: str) -> None:
    """Cumulative gain along the held-out stream, before and after RL (PNG if matplotlib exists)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import itertools
    fig, ax = plt.subplots(figsize=(5, 3))
    for name, ev in (("before RL", before), ("after RL", after)):
        ax.plot(range(1, len(ev["gains"]) + 1), list(itertools.accumulate(ev["gains"])), marker="o", label=name)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("task in stream")
    ax.set_ylabel("cumulative gain")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
