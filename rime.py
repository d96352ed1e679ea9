"""RIME: one model, shared weights, two roles, trained by RL so that its memory makes later tasks
of a stream go better (RIME, Section 3; the README's overview).

    python rime.py                                   # laptop: warm start + RL on Symbolic Alchemy (2 CPU cores)
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

The laptop model starts as a reader: pretrain.py taught it in-context lookup on synthetic random data
(notes read and acted on; no fact of any world), and its reading ladder is logged before anything else.
Then a warm start (`ppo.sft_loss` in the same learner) teaches the protocol. By default
(--warmstart-mode protocol) it teaches only what a pretrained chat model already knows: the action
syntax (the protocol actor: it acts on what its memory says, else explores in a fixed order) and
the memory's two-section shape (an unselective note-taker's: the effects the episode showed, in the
observations' words, and generic lessons; nothing kept from the previous memory), no task knowledge; --warmstart-mode imitation imitates the scripted reference actor and writer, content included. It stops when the writer's
held-out format rate and the actor's protocol agreement (imitation: its validity) reach
`warmstart_threshold`, and is skipped when the model already follows the protocol.

Evaluation: `eval_streams` held-out 3+3 streams over the test worlds (never a training world), with
memory and from scratch; summary.json's rl_effect holds the gain before and after RL and the 95% CI
of their paired difference over the streams. For Alchemy a diagnostic that is not a reward is logged
too: the share of the potion effects a memory states that are true, and how many of the 6 it states,
and whether the actor acts on notes (warmstart.reference_match: its greedy action in the scripted agent's states).
--attribute then replays the stored memories across the actors before and after RL (attribution.py):
the RL effect split into the writer's part and the actor's. --writer-temperature samples the writer's
memories in RL at a temperature of their own (the actor reads them at the next task).

Ablations (the paper's table): --no-explore, --writer frozen|decoupled, --actor frozen, --order
shuffled, --segment 6, --beta / --explore-mode reward --lam, --k, --judge heuristic|local|openai;
`python bench.py ablations` trains and evaluates them with 3 seeds each.

Departures from the paper, on purpose: the laptop preset uses a 1.7M-parameter Qwen3 pretrained here
to read (pretrain.py; `--model scratch` is the same model without it), not a pretrained LLM
(SmolLM2-135M generates ~40 tok/s here, too slow for RL on a laptop: `--model smollm2` runs it), one
Alchemy trial per task, groups of 4 instead of 8, 3+3
streams and short episodes. The README gives its wall time and figures. Ranks split the streams and
run whole groups each, so group statistics never cross ranks; rank 0 evaluates and writes files.
"""

import copy
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

import attribution
import cli
import curriculum
import envs
import judge as judges
import rewards
import rollout
import warmstart
from model import load, load_named, load_tokenizer, save
from ppo import Learner, checkpoint_path, init_distributed, is_rank0, make_batch, print0, teardown_distributed

# -----------------------------------------------------------------------------
# config


@dataclass
class Args:
    """RIME training. Defaults are the laptop preset; `--preset paper` sets the paper's values."""
    preset: str = "laptop"           # laptop | paper (paper: groups of 8, 6+6 streams, lr 1e-6, 40 turns, 2048-token memory)
    model: str = "small"             # small (the 1.7M reader of pretrain.py) | scratch (same model, no pretraining) | tiny (smoke) | smollm2 | HF dir
    env: str = "alchemy"             # alchemy | codebase
    run_dir: str = "runs/rime"       # config, metrics.jsonl, memories/, checkpoints; resumed if it exists
    resume: bool = True              # resume from run_dir's last checkpoint when there is one
    seed: int = 0
    steps: int = 12                  # RL steps (one PPO update each; a fresh AdamW after the warm start)
    streams_per_step: int = 2        # streams per step per rank; each runs group_size times
    group_size: int = 4              # GRPO group size (paper 8)
    segment: int = 3                 # tasks per curriculum block: a stream is segment easy + segment hard (paper 6)
    order: str = "easy_to_hard"      # easy_to_hard | shuffled (the curriculum ablation)
    tier: str = "hard"               # second block's band: easy | mid | hard | mixed
    k: int = 3                       # writer reward window K
    beta: float = 0.3                # exploration bonus on the actor's advantage
    writer_baseline: str = "past"    # past (GRPO's group mean + the past window's share: rewards.past_baseline) | group (GRPO's alone)
    writer_groups: str = "copies"    # copies (the paper's: a group is a stream's G copies at one position, each with
                                     # its own history) | branch (G memories sampled from one state, their next K
                                     # tasks played greedily: the same reward, a shared past; branch_rows)
    branches: int = 2                # --writer-groups branch: branch points per stream per RL step
    writer_next: str = "stream"      # --writer-groups branch: the next window's score is the stream's next K tasks
                                     # (RIME's) | world (the mean over every training task of the world at those K
                                     # tasks' difficulties, each played with the memory: many more episodes, less noise)
    explore_mode: str = "advantage"  # advantage (RIME) | reward (score + lam * explore)
    lam: float = 0.1                 # weight of explore in the reward form
    no_explore: bool = False         # ablation: no exploration reward (the judge is never called)
    writer: str = "shared"           # shared | frozen (writer = initial weights, not trained) | decoupled (own weights)
    actor: str = "trained"           # trained | frozen (the actor plays with the weights RL starts from: only the writer trains)
                                     # | protocol (Alchemy: the scripted note reader plays the actor, acting on every
                                     # note it reads: only the writer trains; what a writer can learn for a reader)
    judge: str = "heuristic"         # heuristic | local (a frozen copy of --judge-model) | openai (the paper preset: an LLM)
    judge_model: str = ""            # local judge checkpoint (default: --model)
    judge_url: str = ""              # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    judge_api_model: str = ""        # model name at that endpoint (key from $OPENAI_API_KEY)
    lr: float = 3e-4                 # RL learning rate (paper 1e-6 on 4B; a tiny model needs more)
    kl_coef: float = 0.01            # KL to the frozen reference (the warm start's weights), a loss term
    kl_estimator: str = "k1"         # k1 (RIME's; zero-mean gradient on fresh samples) | k3 (pulls back: ppo_loss)
    writer_gate: str = "zero"        # zero (RIME's: a malformed memory earns 0) | floor (it earns -1, below every
                                     # well-formed memory: rewards.writer_reward_gated)
    clip_low: float = 0.2
    clip_high: float = 0.28
    behav_imp_weight_cap: float = 0.0  # drop tokens whose pi_prox/pi_behav exceeds this (0 = off; see ppo.policy_loss)
    clip_ratio_c: float = 0.0        # dual-clip bound for negative advantages (0 = off; verl uses 3.0)
    temperature: float = 1.0
    writer_temperature: float = -1.0  # the writer's sampling temperature in RL (-1 = --temperature; see play_streams)
    max_turns: int = 24              # actor turns per task (paper 40)
    actor_context: str = "all"       # all (the episode so far, the paper's) | latest (Alchemy: the memory and the
                                     # latest observation, a fresh context each turn; measured, not the default:
                                     # docs/reader.md, "The actor on the latest observation")
    max_new_tokens: int = 32         # tokens per actor reply (the note reader's chain takes 24)
    memory_tokens: int = 160         # memory cap in tokens (paper 2048)
    traj_chars: int = 1200           # trajectory budget the writer sees
    micro_batch_tokens: int = 16384
    warmstart_steps: int = -1        # max imitation steps before RL; -1 = auto (300 for small/smollm2/dirs on alchemy, 0 for tiny)
    warmstart_threshold: float = 0.95  # held-out protocol agreement (imitation: validity) and writer format rate that end the warm start (> 1: never)
    warmstart_lr: float = 3e-3       # the warm start's first lr, decaying linearly to 0 (warmstart.warmstart_lr_at)
    warmstart_mode: str = "protocol"  # protocol (action syntax + memory shape only) | imitation (the scripted agent's content too)
    warmstart_batch: int = 10        # rows per imitation step (an episode's actor rows count as one)
    warmstart_reading: float = -1.0  # share of those rows rehearsing the reader's rungs; -1 = auto (0.4 for small, else 0)
    warmstart_writer: str = "transcribing"  # transcribing (the protocol memory: what the episode showed) | inferring
                                     # (and the best stone its stone values imply: warmstart.protocol_memory) | thinking
                                     # (that inference in a think block before the memory: warmstart.writer_reply) |
                                     # first-state (the best stone the first state implies, no block: with --writer-task-last)
    writer_think_tokens: int = -1    # the writer's budget for a think block beyond --memory-tokens; -1 = auto (128 thinking, else 0)
    writer_task_last: bool = False   # the writer's prompt ends with the task's first observation again (rollout.writer_prompt)
    warmstart_decisions: float = 0.2  # share of those rows that are the turns where the notes decide the move (protocol mode)
    warmstart_writer_rows: float = 0.0  # share of those rows drawn from the writer's rows alone (beside the units, where
                                     # they are about half): its own turn seen more often (warmstart.warm_start)
    warmstart_streams: int = 48      # scripted streams that make the imitation data
    rl_rehearsal: int = 0            # rows of the warm start's mix (its shares above) in every RL update, trained by
                                     # cross-entropy beside the PPO loss (InstructGPT's PPO-ptx); 0 = none (RIME's)
    eval_attempts: int = 2           # from-scratch attempts per task when eval_temperature > 0 (benchmark: 4)
    eval_temperature: float = 0.0    # 0 = greedy evaluation (then one from-scratch attempt is exact)
    eval_streams: int = -1           # held-out streams over the test worlds (the CI is over streams); -1 = auto:
                                     # 64 on alchemy (an RL effect of ~0.2 resolves over 64, not 16), 16 on codebase
    train_worlds: int = 16           # Alchemy training worlds (the 4 test worlds are the same for any number)
    eval_segment: int = 3            # tasks per block of a held-out stream (fixed, so --segment ablations share them)
    swebench: str = ""               # --env codebase: evaluate on these SWE-bench JSONL rows instead of the 19-issue stream
    swebench_repos: str = ""         # a git checkout (or a folder of checkouts) holding the rows' base commits, offline
    eval_every: int = 0              # also evaluate every N RL steps (0 = only before and after)
    attribute: bool = False          # after RL, replay each actor with the other's memories (attribution.py; 4-5 passes more)
    init_from: str = ""              # start from this HF policy (e.g. another run's final/); --model still sets the preset's sizes
    before_from: str = ""            # the run dir that policy came from (trained --steps 0 there): reuse its before-RL evaluation
    checkpoint_every: int = 1        # RL steps between checkpoints
    threads: int = 0                 # CPU threads per process; 0 = auto (1 for tiny/small models: their ops are too small to split)

    def writer_settings(self) -> dict:
        """The writer's settings as rollout.write_memory takes them (the same wherever the writer writes)."""
        return dict(memory_tokens=self.memory_tokens, traj_chars=self.traj_chars,
                    think_tokens=self.writer_think_tokens, task_last=self.writer_task_last)

    def __post_init__(self):
        if self.warmstart_steps < 0:     # auto: the smoke model, codebase and a given start policy skip it
            self.warmstart_steps = 300 if (self.model != "tiny" and self.env == "alchemy" and not self.init_from) else 0
        if self.warmstart_reading < 0:   # auto: only the reader rehearses its reading (scratch never learned one)
            self.warmstart_reading = 0.4 if self.model == "small" else 0.0
        if self.model == "tiny":         # the smoke run: the whole pipeline, minimal sizes
            for name, value in dict(streams_per_step=1, group_size=2, segment=1, max_turns=6,
                                    max_new_tokens=16, memory_tokens=48, eval_attempts=1, eval_streams=2).items():
                if getattr(self, name) == getattr(Args, name):
                    setattr(self, name, value)
        if self.preset == "paper":
            # the paper's judge is an LLM: an endpoint when one is given, else a frozen local copy
            judge = "openai" if self.judge_url else "local"
            for name, value in dict(group_size=8, segment=6, eval_segment=6, lr=1e-6, max_turns=40,
                                    max_new_tokens=512, memory_tokens=2048, traj_chars=8000, eval_attempts=4,
                                    warmstart_steps=0, judge=judge, writer_baseline="group").items():
                if getattr(self, name) == getattr(Args, name):   # explicit flags win over the preset
                    setattr(self, name, value)
        if self.eval_streams < 0:
            self.eval_streams = 64 if self.env == "alchemy" else 16
        check = cli.check
        check(self.preset in ("laptop", "paper"), f"--preset must be laptop or paper, got {self.preset!r}")
        check(self.env in ("alchemy", "codebase"), f"--env must be alchemy or codebase (RIME's domains), got {self.env!r}")
        if self.model not in ("small", "scratch", "tiny", "smollm2"):
            check(os.path.isdir(self.model), f"--model {self.model!r}: not 'small', 'scratch', 'tiny', 'smollm2' or an existing checkpoint directory")
            cli.check_model_dir(self.model)
        check(self.actor_context in ("all", "latest"), f"--actor-context must be all or latest, got {self.actor_context!r}")
        check(self.actor_context == "all" or self.env == "alchemy",
              f"--actor-context latest needs --env alchemy (an observation that states the whole state), got --env {self.env}")
        check(self.k >= 1, f"--k must be >= 1, got {self.k}")
        check(self.group_size >= 2, f"--group-size must be >= 2 for group baselines, got {self.group_size}")
        for name in ("segment", "streams_per_step", "max_turns", "max_new_tokens", "memory_tokens", "traj_chars",
                     "micro_batch_tokens", "warmstart_batch", "warmstart_streams", "eval_attempts",
                     "checkpoint_every", "eval_streams", "eval_segment", "train_worlds"):
            check(getattr(self, name) >= 1, f"{cli.flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "eval_every", "threads", "warmstart_steps"):
            check(getattr(self, name) >= 0, f"{cli.flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.writer_temperature < 0:
            cli.check(self.writer_temperature == -1, "--writer-temperature must be > 0, or -1 (= --temperature)")
            self.writer_temperature = self.temperature
        for name in ("lr", "warmstart_lr", "temperature", "writer_temperature"):
            cli.check_number(name, getattr(self, name), lo=0, lo_open=True)
        for name in ("kl_coef", "clip_low", "clip_high", "beta", "lam", "eval_temperature"):
            cli.check_number(name, getattr(self, name), lo=0)
        cli.check_number("warmstart_threshold", self.warmstart_threshold, lo=0)
        cli.check_number("warmstart_reading", self.warmstart_reading, lo=0, hi=1)
        cli.check_number("warmstart_decisions", self.warmstart_decisions, lo=0, hi=1)
        cli.check_number("warmstart_writer_rows", self.warmstart_writer_rows, lo=0, hi=1)
        check(self.rl_rehearsal >= 0, f"--rl-rehearsal must be >= 0, got {self.rl_rehearsal}")
        for n, what in ((self.warmstart_batch, "warm-start batch"), (self.rl_rehearsal, "RL rehearsal")):
            taken = n - warmstart.share_counts(n, self)["units"]
            check(n == 0 or taken < n,
                  f"--warmstart-reading + --warmstart-decisions + --warmstart-writer-rows take {taken} of each "
                  f"{what} of {n} rows: leave at least one to the scripted episodes")
        cli.check(self.behav_imp_weight_cap == 0 or self.behav_imp_weight_cap > 1, "--behav-imp-weight-cap must be 0 (off) or > 1")
        cli.check(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "--clip-ratio-c must be 0 (off) or > 1")
        check(self.warmstart_writer in ("transcribing", "inferring", "thinking", "first-state"),
              f"--warmstart-writer must be transcribing, inferring, thinking or first-state, got {self.warmstart_writer!r}")
        if self.writer_think_tokens == -1:
            self.writer_think_tokens = 128 if self.warmstart_writer == "thinking" else 0
        check(self.writer_think_tokens >= 0, f"--writer-think-tokens must be >= 0 (or -1: auto), got {self.writer_think_tokens}")
        check(self.warmstart_mode in ("protocol", "imitation"), f"--warmstart-mode must be protocol or imitation, got {self.warmstart_mode!r}")
        check(self.order in ("easy_to_hard", "shuffled"), f"--order must be easy_to_hard or shuffled, got {self.order!r}")
        check(self.explore_mode in ("advantage", "reward"), "--explore-mode must be advantage or reward")
        check(self.writer_baseline in ("past", "group"), "--writer-baseline must be past or group")
        check(self.writer_groups in ("copies", "branch"), f"--writer-groups must be copies or branch, got {self.writer_groups!r}")
        check(self.branches >= 1, f"--branches must be >= 1, got {self.branches}")
        check(self.writer_next in ("stream", "world"), f"--writer-next must be stream or world, got {self.writer_next!r}")
        check(self.writer_next == "stream" or self.writer_groups == "branch",
              "--writer-next world scores the memories of one state: add --writer-groups branch")
        check(self.kl_estimator in ("k1", "k3"), f"--kl-estimator must be k1 or k3, got {self.kl_estimator!r}")
        check(self.writer_gate in ("zero", "floor"), f"--writer-gate must be zero or floor, got {self.writer_gate!r}")
        check(self.writer in ("shared", "frozen", "decoupled"), "--writer must be shared, frozen or decoupled")
        check(self.actor in ("trained", "frozen", PROTOCOL), "--actor must be trained, frozen or protocol")
        check(self.actor == "trained" or self.writer == "shared", f"--actor {self.actor} trains only the writer: keep --writer shared")
        check(self.actor != PROTOCOL or self.env == "alchemy", "--actor protocol is Alchemy's scripted note reader: use --env alchemy")
        check(self.actor != PROTOCOL or not self.attribute, "--attribute replays learned actors: not with --actor protocol")
        check(self.actor != PROTOCOL or not self.before_from,
              "--before-from reuses a learned actor's evaluation: --actor protocol makes its own")
        check(self.judge in ("heuristic", "local", "openai"), "--judge must be heuristic, local or openai")
        check(self.judge != "openai" or (self.judge_url and self.judge_api_model), "--judge openai needs --judge-url and --judge-api-model")
        check(not self.swebench or self.env == "codebase", "--swebench evaluates codebase tasks: add --env codebase")
        check(not self.swebench or os.path.isfile(self.swebench), f"--swebench {self.swebench!r}: no such file")
        check(not self.swebench or os.path.isdir(self.swebench_repos),
              "--swebench needs --swebench-repos DIR: the repositories' git checkouts (nothing is fetched)")
        if self.init_from:
            cli.check_model_dir(self.init_from, "--init-from")
        check(not self.before_from or self.init_from, "--before-from reuses the evaluation of an --init-from policy: give both")
        check(not self.before_from or os.path.isfile(os.path.join(self.before_from, "summary.json")),
              f"--before-from {self.before_from!r}: no summary.json there (a finished rime.py run dir)")
        check(self.warmstart_steps == 0 or self.env == "alchemy",
              "the warm start imitates the scripted Alchemy writer: use --warmstart-steps 0 with --env codebase")
        check(self.rl_rehearsal == 0 or self.env == "alchemy",
              "--rl-rehearsal rehearses the warm start's scripted Alchemy rows: use it with --env alchemy")
        check(self.rl_rehearsal == 0 or (self.writer == "shared" and self.actor == "trained"),
              "--rl-rehearsal trains the shared weights on both roles' rows: keep --writer shared --actor trained")


def parse_args(argv=None) -> Args:
    return cli.parse(Args, argv, prog="rime.py", description=__doc__.split("\n\n")[0])


# -----------------------------------------------------------------------------
# models, judge, streams


def load_model(name: str, seed: int):
    """model.load_named, plus RIME's laptop models: "small" is the reader (pretrain.py: a 1.7M Qwen3 with
    its own BPE, pretrained on synthetic reading data; shipped in weights/reader, one set of weights for
    every seed), "scratch" the same model with seeded random weights (the no-pretraining baseline)."""
    import pretrain
    if name == "small":     # Qwen3 rather than Qwen3.5: the DeltaNet's chunked rule in plain PyTorch trains ~2.3x slower on CPU
        return pretrain.load_reader()
    if name == "scratch":
        return pretrain.new_model(seed)
    return load_named(name, seed, max_seq_len=8192)


def make_env(args: Args):
    """The domain's env: on Alchemy --train-worlds training worlds, and the laptop preset plays one
    trial per task (the paper's episodes are longer), so rows stay short."""
    if args.env != "alchemy":
        return envs.make(args.env)
    return envs.make("alchemy", num_train_worlds=args.train_worlds, actor_context=args.actor_context,
                     **({"num_trials": 1} if args.preset == "laptop" else {}))


def make_judge(args: Args, tokenizer):
    if args.no_explore:
        return None
    if args.judge == "heuristic":
        return judges.HeuristicJudge()
    if args.judge == "openai":
        return judges.LLMJudge(judges.openai_complete(args.judge_url, args.judge_api_model))
    jm, jt = load_model(args.judge_model or args.model, args.seed)
    return judges.LLMJudge(judges.local_complete(jm.eval(), jt))


def run_actor(actor, tokenizer, env, tasks, memory, args: Args, *, temperature: float, seed: int) -> list:
    """The actor's episodes on `tasks` with `memory` (one text, or one per task): the model's, or with
    --actor protocol the scripted note reader's (warmstart.protocol_policy: it acts on every note it
    reads, true or not, and explores in a fixed order elsewhere; deterministic)."""
    if actor == PROTOCOL:
        mems = memory if isinstance(memory, list) else [memory] * len(tasks)
        return rollout.run_scripted(tokenizer, env, tasks, [warmstart.protocol_policy(m) for m in mems], memory=mems,
                                    max_turns=args.max_turns)
    return rollout.run_episodes(actor, tokenizer, env, tasks, memory=memory, temperature=temperature, seed=seed,
                                max_turns=args.max_turns, max_new_tokens=args.max_new_tokens)


def train_streams(env, tasks, args: Args, step: int, rank: int):
    """This rank's streams for one RL step, each repeated group_size times (a GRPO group)."""
    base = curriculum.make_streams(tasks, args.streams_per_step, order=args.order, segment=args.segment,
                                   seed=args.seed * 1_000_003 + step * 101 + rank, tier=args.tier)
    return base, [s for s in base for _ in range(args.group_size)]


def eval_streams(env, args: Args) -> list:
    """The held-out streams: `eval_streams` easy_to_hard streams over the TEST worlds (never a training
    world), the worlds taking turns; for codebase the benchmark's 19-issue stream (9 tablib, 10 tenacity)."""
    if args.env == "codebase":
        import codebase
        if args.swebench:           # the rows in file order, one stream (a bad row is a one-line error)
            return [codebase.load_swebench_jsonl(args.swebench, args.swebench_repos, env_name="codebase")]
        return [codebase.test_stream()]
    return curriculum.make_streams(env.tasks("test"), args.eval_streams, order="easy_to_hard",
                                   segment=args.eval_segment, seed=12345, tier=args.tier)


# -----------------------------------------------------------------------------
# the stream loop: actor with M(t-1) -> score s(t) -> writer writes M(t)


@dataclass
class StreamRollout:
    """One pass over a stream with evolving memory. Index t is the stream position."""
    tasks: list
    episodes: list = dataclasses.field(default_factory=list)   # rollout.Episode per task (actor rows)
    writes: list = dataclasses.field(default_factory=list)     # rollout.WriterSample per task (M(t), written after task t)
    memories: list = dataclasses.field(default_factory=list)   # memories[t] = M(t-1), what the actor of task t saw
    explore: list = dataclasses.field(default_factory=list)    # judge score of M(t-1) -> M(t) (rl_step fills it)

    @property
    def scores(self) -> list[float]:
        return [ep.score for ep in self.episodes]


def play_streams(actor, writer, tokenizer, env, streams, args: Args, *, temperature: float, seed: int,
                 on_task=None, writer_temperature: float = None, memories: list = None) -> list:
    """Every stream with memory, all side by side: at each position t the actor solves task t of
    every stream with its memory M(t-1) (one batched call), then the writer reads each finished
    episode and rewrites the memory into M(t) (one batched call). actor and writer are one model
    under shared weights; a frozen or decoupled writer is another. Streams may repeat (the copies
    of a GRPO group). writer_temperature (default: temperature) samples the writer apart from the
    actor: the actor of task t+1 reads what the writer wrote at it, so a writer sampled cooler in RL
    hands the actor memories closer to the greedy ones it is evaluated with. memories: the memory each
    stream starts with (default: none). Returns one StreamRollout per stream."""
    writer_temperature = temperature if writer_temperature is None else writer_temperature
    lengths = {len(s) for s in streams}
    assert len(lengths) == 1, f"streams run in lockstep and must have one length, got {sorted(lengths)}"
    envs_ = [env] + [env.clone() for _ in streams[1:]]
    outs = [StreamRollout(tasks=list(s)) for s in streams]
    memories = list(memories) if memories is not None else [""] * len(streams)
    for t in range(lengths.pop()):
        # the actor: task t with memory M(t-1)
        eps = run_actor(actor, tokenizer, envs_, [s[t] for s in streams], memories, args,
                        temperature=temperature, seed=seed * 7907 + t)
        # the writer: the finished episode and M(t-1) -> M(t), which replaces it
        writes = rollout.write_memory(writer, tokenizer, eps, memories, temperature=writer_temperature,
                                      seed=seed * 7919 + t, **args.writer_settings())
        for o, ep, w, old in zip(outs, eps, writes, memories):
            o.episodes.append(ep)
            o.writes.append(w)
            o.memories.append(old)
        memories = [w.memory for w in writes]
        if on_task is not None:
            on_task(t)
    for e in envs_[1:]:
        e.close()
    return outs


# -----------------------------------------------------------------------------
# evaluation: cumulative reward with memory vs from scratch, over many held-out streams


def evaluate(model, tokenizer, env, streams, args: Args, writer_model=None) -> dict:
    """Every held-out stream with memory and from scratch, decoded alike. Per stream: cumulative
    reward, from-scratch sum, gain. Greedy decoding (the default) needs one from-scratch attempt per
    task; at eval_temperature > 0 the from-scratch score of a task is the mean of eval_attempts."""
    from tqdm import tqdm
    if model != PROTOCOL:
        model.eval()
    attempts = args.eval_attempts if args.eval_temperature > 0 else 1
    with tqdm(total=len(streams[0]) + attempts, desc=f"evaluate ({len(streams)} streams)", disable=not is_rank0(),
              leave=False) as bar:
        with_mem = play_streams(model, writer_model or model, tokenizer, env, streams, args,
                                temperature=args.eval_temperature, seed=attribution.EVAL_SEED, on_task=lambda t: bar.update(1))
        flat = [t for s in streams for t in s]
        scratch, scratch_actions = [[] for _ in flat], []
        for a in range(attempts):
            # from scratch: every task with empty memory (the first task of a stream has none either,
            # so under greedy decoding it gains 0 by construction)
            eps = run_actor(model, tokenizer, env, flat, "", args, temperature=args.eval_temperature, seed=100 + a)
            for i, ep in enumerate(eps):
                scratch[i].append(ep.score)
            scratch_actions = scratch_actions or [ep.actions for ep in eps]
            bar.update(1)
    per_stream, i = [], 0
    for s, o in zip(streams, with_mem):
        m = rewards.stream_metrics(o.scores, scratch[i:i + len(s)])
        i += len(s)
        per_stream.append(m)
    gains = [m.cumulative_gain for m in per_stream]
    turns = sum(ep.num_turns for o in with_mem for ep in o.episodes)
    invalid = sum(ep.num_format_errors + int(ep.info.get("invalid", 0)) for o in with_mem for ep in o.episodes)
    out = {"cumulative_reward": mean(m.cumulative_reward for m in per_stream),
           "cumulative_scratch": mean(m.cumulative_scratch for m in per_stream),
           "cumulative_gain": mean(gains), "gain_ci95": list(rewards.mean_ci95(gains)[1:]),
           "stream_gains": gains, "stream_rewards": [m.cumulative_reward for m in per_stream],
           "stream_scratch": [m.cumulative_scratch for m in per_stream], "gains": [mean(g) for g in zip(*(m.gains for m in per_stream))],
           "validity": 1.0 - invalid / max(turns, 1), "streams": len(streams),
           # a diagnostic: the share of tasks after the first whose actions with memory differ from
           # the first from-scratch attempt's (0 under greedy decoding = the actor ignores its memory)
           "memory_influence": mean(o.episodes[t].actions != scratch_actions[k * len(o.tasks) + t]
                                    for k, o in enumerate(with_mem) for t in range(1, len(o.tasks))),
           "memories": [[w.memory for w in o.writes] for o in with_mem]}
    if args.env == "alchemy":    # a diagnostic, not a reward: are the written facts true, and how many?
        import alchemy
        acc = [[alchemy.memory_accuracy(w.memory, task) for w, task in zip(o.writes, o.tasks)] for o in with_mem]
        out["memory_accuracy"] = [mean(a[t][0] for a in acc if a[t][0] is not None) for t in range(len(acc[0]))]
        out["memory_coverage"] = [mean(a[t][1] for a in acc) for t in range(len(acc[0]))]
    if args.env == "alchemy" and model != PROTOCOL:
        # and does the actor act on notes? its greedy action in the scripted reference's states, same streams
        out["reference_match"] = warmstart.reference_match(model, tokenizer, env, streams, args)
        out["note_agreement"] = warmstart.note_agreement(model, tokenizer, env, streams, args)
    return out


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def rl_effect(before: dict, after: dict) -> dict:
    """Gain before and after RL on the same held-out streams, and the paired difference's 95% CI
    (over streams; over the tasks of the stream when there is only one)."""
    if before["streams"] > 1:
        deltas, scale = [a - b for a, b in zip(after["stream_gains"], before["stream_gains"])], 1
    else:                            # one stream: its gain is a sum over tasks, so is the CI
        deltas = [a - b for a, b in zip(after["gains"], before["gains"])]
        scale = len(deltas)
    _, lo, hi = rewards.mean_ci95(deltas)
    return {"gain_before": before["cumulative_gain"], "gain_after": after["cumulative_gain"],
            "delta": after["cumulative_gain"] - before["cumulative_gain"], "ci95": [lo * scale, hi * scale],
            "streams": before["streams"]}


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
        if adv.keep[i] and args.actor == "trained":
            for r in outs[c].episodes[t].rows():
                actor.append((r.tokens, r.loss_mask, r.logprobs, adv.advantages[i], r.temperature))
    # writer: windowed reward per copy, then GRPO over the group at (stream, position)
    w_rewards, w_groups, w_items, deltas, pasts, oks = [], [], [], [], [], []
    for c, o in enumerate(outs):
        wr = rewards.writer_rewards_gated(o.scores, args.k, [w.memory for w in o.writes], o.memories,
                                          prompt_text=writer_prompt_text, statuses=[w.status for w in o.writes],
                                          gate=args.writer_gate)
        for t, r in enumerate(wr):
            oks.append(float(r.ok))
            if not r.trainable:
                continue                     # the last memory has no later task: no reward, no row
            w_rewards.append(r.reward); w_groups.append((groups_of[c], t)); w_items.append(o.writes[t])
            deltas.append(r.delta); pasts.append(r.past_mean)
    # the writer's baseline: GRPO's group mean, and with --writer-baseline past also the part of the
    # reward its past window predicts (rewards.past_baseline: variance only, the reward is unchanged)
    baselined, slope = (rewards.past_baseline(w_rewards, pasts, w_groups) if args.writer_baseline == "past"
                        else (w_rewards, float("nan")))
    w_adv, w_keep = rewards.group_advantages(baselined, w_groups)
    if args.writer != "frozen":
        for w, a, k in zip(w_items, w_adv, w_keep):
            if k:
                writer.append((w.tokens, w.loss_mask, w.logprobs, a, w.temperature))
    statuses = [w.status for o in outs for w in o.writes]
    parts.update(score=sum(scores) / len(scores), explore=sum(explore) / len(explore),
                 explore_bonus=sum(abs(b) for b in adv.explore_bonus) / len(scores),
                 writer_reward=sum(w_rewards) / max(len(w_rewards), 1), writer_format_ok=sum(oks) / len(oks),
                 writer_delta=sum(deltas) / max(len(deltas), 1),
                 mean_reversion_corr=rewards.mean_reversion_corr(deltas, pasts) if len(deltas) > 2 else float("nan"),
                 past_slope=slope,
                 writer_empty=statuses.count("empty") / len(statuses),
                 writer_truncated=statuses.count("truncated") / len(statuses),
                 actor_rows=len(actor), writer_rows=len(writer),
                 actor_groups_dropped=adv.num_dropped_groups, writer_groups_dropped=w_keep.count(False) / max(args.group_size, 1),
                 format_errors=sum(ep.num_format_errors for o in outs for ep in o.episodes) / len(scores))
    return actor, writer, parts


def branch_rows(actor, writer, tokenizer, env, outs, groups_of, args: Args, *, seed: int):
    """--writer-groups branch: the writer's rows from groups that share their prompt. The paper groups a
    stream's G copies at one position, but by then each copy has its own history, so the group mean
    compares histories: the past window differs from copy to copy and the delta is mostly mean
    reversion (docs/results.md, "What a memory is worth"). Here, at `branches` points per stream (a copy
    and a position t < T-1, drawn from `seed`), G memories are sampled from that copy's one state (its
    episode t and the memory M(t-1) it read). Each gets RIME's reward unchanged, R = ok * (next K mean -
    past K mean) + 0.1 * ok: the past K are the copy's own scores, shared by the group, and the next K
    tasks are the stream's, played greedily (actor and writer, as evaluated) from that memory, so the
    next mean is a function of the memory alone. The group's baseline then removes the past exactly and
    the advantage compares memories. Costs up to branches * G * K greedy episodes more per stream.
    -> (writer rows, logged parts)."""
    rng = random.Random(seed)
    T, G = len(outs[0].tasks), args.group_size
    points = []
    for b in sorted(set(groups_of)):
        members = [c for c, g in enumerate(groups_of) if g == b]
        points += [(rng.choice(members), rng.randrange(T - 1)) for _ in range(args.branches)]
    eps = [outs[c].episodes[t] for c, t in points for _ in range(G)]
    olds = [outs[c].memories[t] for c, t in points for _ in range(G)]
    writes = rollout.write_memory(writer, tokenizer, eps, olds, temperature=args.writer_temperature,
                                  seed=seed, **args.writer_settings())
    # the next K tasks from each sampled memory, greedily; streams of one length run together
    nxt = [outs[c].tasks[t + 1:t + 1 + args.k] for c, t in points for _ in range(G)]
    if args.writer_next == "world":    # not RIME's: each memory's worth at the next difficulties (world_next)
        cont = world_next(actor, tokenizer, env, nxt, [w.memory for w in writes], args)
    else:
        cont = [None] * len(writes)
        for n in sorted({len(x) for x in nxt}):
            idx = [i for i, x in enumerate(nxt) if len(x) == n]
            played = play_streams(actor, writer, tokenizer, env, [nxt[i] for i in idx], args, temperature=0.0,
                                  seed=seed, memories=[writes[i].memory for i in idx])
            for i, o in zip(idx, played):
                cont[i] = o.scores
    w_rewards, groups, oks = [], [], []
    for i, w in enumerate(writes):
        c, t = points[i // G]
        ok = rewards.writer_format_ok(w.memory, olds[i], rollout.WRITER_SYSTEM)[0] and w.status == "ok"
        window = rewards.writer_windows(outs[c].scores[:t + 1] + cont[i], args.k)[t]   # the copy's past, this next
        w_rewards.append(rewards.writer_reward_gated(window.delta, ok, gate=args.writer_gate))
        groups.append(i // G)
        oks.append(float(ok))
    adv, keep = rewards.group_advantages(w_rewards, groups)
    rows = [(w.tokens, w.loss_mask, w.logprobs, a, w.temperature) for w, a, k in zip(writes, adv, keep) if k]
    spread = [max(w_rewards[j * G:(j + 1) * G]) - min(w_rewards[j * G:(j + 1) * G]) for j in range(len(points))]
    return rows, dict(branch_reward=mean(w_rewards), branch_format_ok=mean(oks), writer_rows=len(rows),
                      writer_groups_dropped=keep.count(False) / G, branch_spread=mean(spread),
                      branch_points=len(points))


def world_next(actor, tokenizer, env, nxt, memories, args: Args) -> list:
    """--writer-next world: each memory's next window scored by what the memory is worth there rather than by
    one draw of it. For next tasks `nxt[i]` (a world's, at some difficulties), every training task of that
    world at each of those difficulties is played greedily with `memories[i]` (the memory as written, not
    rewritten between them), and each of the K positions gets the mean score at its difficulty. The worths
    of a group's samples to the note reader differ by 0.01-0.08 a task, and three tasks rarely tell them
    apart (docs/results.md, "What a memory is worth to the note reader"). -> per memory, K scores."""
    pool = {}
    for task in env.tasks("train"):
        pool.setdefault((task.group, task.difficulty), []).append(task)
    keys = [sorted({(t.group, t.difficulty) for t in x}) for x in nxt]
    jobs = [(i, key, task) for i, ks in enumerate(keys) for key in ks for task in pool[key]]
    eps = run_actor(actor, tokenizer, env, [task for _, _, task in jobs], [memories[i] for i, _, _ in jobs], args,
                    temperature=0.0, seed=0)
    scores = {}
    for (i, key, _), ep in zip(jobs, eps):
        scores.setdefault((i, key), []).append(ep.score)
    return [[mean(scores[(i, (t.group, t.difficulty))]) for t in x] for i, x in enumerate(nxt)]


def batch_of(rows, version, rehearsal=()):
    # every rank must join every update (FSDP collectives): a rank whose groups were all dropped
    # joins with one empty row (mask 0), which contributes nothing to the global token mean
    # rows: (tokens, loss mask, behaviour logprobs, advantage, sampling temperature); the learner
    # scores every logprob under the temperature its row was sampled at. rehearsal: (tokens, mask) rows
    # trained by cross-entropy only (their PPO mask 0); the learner adds the two token means (ppo.Learner)
    rows = rows or [([0, 0], [0, 0], [0.0, 0.0], 0.0, 1.0)]
    sft = [[0] * len(r[0]) for r in rows] + [list(m) for _, m in rehearsal] if rehearsal else None
    rows = rows + [(t, [0] * len(t), [0.0] * len(t), 0.0, 1.0) for t, _ in rehearsal]
    return make_batch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                      versions=[version] * len(rows), temperatures=[r[4] for r in rows], sft_mask=sft)


# -----------------------------------------------------------------------------
# main: setup, warm start, RL steps, evaluation, report


@dataclass
class Run:
    """What a RIME run holds; main() returns it (tests compare resumed and uninterrupted runs)."""
    args: Args
    d: object
    tokenizer: object
    env: object
    learner: Learner
    judge: object = None
    writer_model: object = None        # frozen or decoupled writer; None = the shared weights
    actor_model: object = None         # frozen actor (--actor frozen); None = the learner's weights
    writer_learner: Learner = None     # decoupled writer's own learner
    mix: object = None                 # the warm start's rows, rehearsed in RL (--rl-rehearsal; warmstart.Mix)
    streams: list = None               # held-out evaluation streams
    state: dict = None                 # step, warm start and pre-RL evaluation: checkpointed
    resuming: bool = False             # a complete checkpoint was found at start

    def path(self, *parts):
        return os.path.join(self.args.run_dir, *parts)

    def log(self, row: dict) -> None:
        if self.d.is_main:
            with open(self.path("metrics.jsonl"), "a") as f:
                f.write(cli.dumps({"time": time.time(), **row}) + "\n")


def learner_settings(args: Args, d) -> dict:
    # activation checkpointing pays off on GPUs with real models; on CPU small models it only recomputes
    return dict(lr=args.lr, clip_low=args.clip_low, clip_high=args.clip_high, kl_coef=args.kl_coef,
                kl_estimator=args.kl_estimator,
                micro_batch_tokens=args.micro_batch_tokens, gradient_checkpointing=d.device.type == "cuda",
                dist_info=d, behav_imp_weight_cap=args.behav_imp_weight_cap or None,
                clip_ratio_c=args.clip_ratio_c or None)


def setup(args: Args) -> Run:
    """Model, learner(s), environment, judge, held-out streams; resume from the last checkpoint.
    The reference (KL anchor) and a frozen writer hold the weights RL starts from: on a resume they
    are rebuilt from <run>/warmstart (or the initial weights when no warm start ran), never from the
    resumed RL policy; a decoupled writer's learner has its own checkpoint."""
    d = init_distributed()
    if d.device.type == "cpu" and (args.threads or args.model in ("tiny", "small", "scratch")):
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(args.seed + d.rank)
    random.seed(args.seed + d.rank)
    model, tokenizer = load_model(args.model, args.seed)     # checked before anything is written
    if args.init_from:                                       # another run's policy (and its tokenizer)
        model, tokenizer = load(args.init_from), load_tokenizer(args.init_from)
    env = make_env(args)
    streams = eval_streams(env, args)
    os.makedirs(os.path.join(args.run_dir, "memories"), exist_ok=True)
    if d.is_main:
        with open(os.path.join(args.run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=2)
    ckpt = os.path.join(args.run_dir, "checkpoint")
    # every rank decides before any rank saves, or a fast rank's first save could make a slow rank
    # "resume" from a half-written one (ppo.checkpoint_path only returns complete checkpoints)
    resuming = args.resume and checkpoint_path(ckpt) is not None
    warm_dir = os.path.join(args.run_dir, "warmstart")
    if resuming and os.path.isdir(warm_dir):
        model = load(warm_dir)                              # the weights RL started from
    learner = Learner(model, ref_model=copy.deepcopy(model), **learner_settings(args, d))
    run = Run(args, d, tokenizer, env, learner, judge=make_judge(args, tokenizer), streams=streams,
              state={"step": 0, "warm": None, "eval_before": None}, resuming=resuming)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return run


def log_ladder(run: Run, when: str) -> dict:
    """The reading ladder (pretrain.py --check) of the policy now, logged and printed: 64 held-out items a rung."""
    import pretrain
    ladder = pretrain.ladder(run.learner.gen_model, run.tokenizer, num_items=64)
    run.log({"phase": "ladder", "when": when, **{k: v["accuracy"] for k, v in ladder.items()}})
    print0(f"reading ladder {when} (64 held-out items per rung):\n" + pretrain.ladder_table(ladder, 0.9))
    return ladder


def warm_start_phase(run: Run) -> None:
    """Warm start (fresh runs only), then the writers, then the resume of every learner."""
    args, learner = run.args, run.learner
    ladder_logged = not run.resuming and args.model in ("small", "scratch") and run.d.is_main
    if ladder_logged:
        log_ladder(run, "before the warm start" if args.warmstart_steps else "before RL")
    if not run.resuming:
        run.state["warm"] = warmstart.warm_start(learner, run.tokenizer, run.env, args, run.log) if args.warmstart_steps else {}
        if run.state["warm"].get("steps"):
            if ladder_logged:           # did imitating the protocol cost the reading?
                log_ladder(run, "after the warm start")
            if run.d.is_main:
                save(learner.gen_model, run.tokenizer, run.path("warmstart"))
                print0(f"warm-started weights saved to {run.path('warmstart')}")
            learner.reset_reference()   # the KL anchors RL to the warm-started policy
            learner.reset_optimizer()   # and RL's AdamW starts fresh (ppo.Learner.reset_optimizer)
    # the frozen writer is the weights RL starts from; the decoupled writer trains its own copy
    if args.writer == "frozen":
        run.writer_model = copy.deepcopy(learner.gen_model)
    if args.actor != "trained":         # only the writer trains: the actor keeps the start weights, or is scripted
        run.actor_model = copy.deepcopy(learner.gen_model) if args.actor == "frozen" else PROTOCOL
        run.writer_model = learner.gen_model
    elif args.writer == "decoupled":
        wm = copy.deepcopy(learner.gen_model).float().requires_grad_(True)   # the generation copy is frozen (bf16 on GPU)
        run.writer_learner = Learner(wm, ref_model=copy.deepcopy(wm), **learner_settings(args, run.d))
        run.writer_model = run.writer_learner.gen_model
    if run.resuming:
        if run.writer_learner is not None:
            run.writer_learner.load(run.path("checkpoint_writer"))
        run.state = learner.load(run.path("checkpoint"))       # last: its RNG state is the one that counts
        print0(f"resumed from {run.path('checkpoint')} at RL step {run.state['step']}")


def save_checkpoint(run: Run) -> None:
    """The learner(s) as DCP checkpoints, and the policy in HF format beside them (<run>/policy),
    which `bench.py --policy` and `rime.py --model` read."""
    if run.writer_learner is not None:
        run.writer_learner.save(run.path("checkpoint_writer"))
    run.learner.save(run.path("checkpoint"), caller_state=run.state)
    if run.d.is_main:
        export_policy(run, run.path("policy"))


def export_policy(run: Run, path: str) -> None:
    """HF-format weights of the trained policy, written to a temp dir and swapped in (crash-safe)."""
    import shutil
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save(run.learner.gen_model, run.tokenizer, tmp)
    if run.writer_learner is not None:
        save(run.writer_learner.gen_model, run.tokenizer, os.path.join(tmp, "writer"))
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def rl_step(run: Run, step: int) -> dict:
    """One RIME step: roll out the groups of streams (actor, then writer, at every position), ask the
    judge about each memory change, turn scores into both roles' rows, one PPO update."""
    args, learner, t0 = run.args, run.learner, time.time()
    base, copies = train_streams(run.env, run.env.tasks("train"), args, step, run.d.rank)
    groups_of = [c // args.group_size for c in range(len(copies))]
    outs = play_streams(run.actor_model or learner.gen_model, run.writer_model or learner.gen_model, run.tokenizer,
                        run.env, copies, args, temperature=args.temperature,
                        writer_temperature=args.writer_temperature, seed=args.seed * 7 + step * 1009 + run.d.rank)
    t_roll = time.time() - t0
    judged = judge_memories(run.judge, outs)
    t_judge = time.time() - t0 - t_roll
    actor, writer, parts = rl_rows(outs, groups_of, args, rollout.WRITER_SYSTEM)
    if args.writer_groups == "branch" and args.writer != "frozen":   # the writer's rows from shared prompts
        writer, branched = branch_rows(run.actor_model or learner.gen_model, run.writer_model or learner.gen_model,
                                       run.tokenizer, run.env, outs, groups_of, args,
                                       seed=args.seed * 7 + step * 1009 + run.d.rank + 1)
        parts.update(branched, branch_s=time.time() - t0 - t_roll - t_judge)
    if args.env == "alchemy":
        import alchemy
        acc = [alchemy.memory_accuracy(w.memory, task) for o in outs for w, task in zip(o.writes, o.tasks)]
        parts["memory_accuracy"] = mean(a for a, _ in acc if a is not None)
        parts["memory_coverage"] = mean(c for _, c in acc)
    if args.writer == "decoupled":      # two sets of weights, each trained on its own role's rows
        stats = learner.update(batch_of(actor, learner.version))
        wstats = run.writer_learner.update(batch_of(writer, run.writer_learner.version))
        stats.update({f"writer_{k}": v for k, v in wstats.items()})
    else:                               # shared weights: one PPO step on both roles' tokens
        stats = learner.update(batch_of(actor + writer, learner.version, rehearsal_rows(run, step)))
    row = {"phase": "rl", "step": step + 1, "rollout_s": t_roll, "judge_s": t_judge,
           "update_s": time.time() - t0 - t_roll - t_judge - parts.get("branch_s", 0.0), "step_s": time.time() - t0, **parts, **judged, **stats}
    run.log(row)
    if run.d.is_main:
        with open(run.path("memories", f"step{step + 1:04d}.jsonl"), "w") as f:
            for c, o in enumerate(outs):
                f.write(cli.dumps({"copy": c, "tasks": [t.id for t in o.tasks], "scores": o.scores,
                                   "memories": [w.memory for w in o.writes], "explore": o.explore}) + "\n")
    return row


def rehearsal_rows(run: Run, step: int) -> list:
    """--rl-rehearsal: that many rows of the warm start's mix (warmstart.Mix: its episodes, writer rows,
    note decisions and reading rows, in its shares) for RL step `step`, trained by cross-entropy in the
    same update as the PPO loss: InstructGPT's PPO-ptx, the imitation data mixed into every RL update so
    that RL's steps do not wear down what the warm start taught. Drawn from the step's own RNG (a resumed
    run draws the same rows); [] when off."""
    args = run.args
    if not args.rl_rehearsal:
        return []
    if run.mix is None:
        run.mix = warmstart.Mix(run.tokenizer, run.env, args)
        if run.mix.counts(args.rl_rehearsal)["reading"]:
            run.mix.reading = warmstart.reading_data(run.tokenizer, args.seed)
    rng = random.Random((args.seed * 1_000_003 + step) * 1009 + run.d.rank)
    if run.mix.reading is not None:      # its items from the step's RNG too
        run.mix.reading.rng = random.Random(rng.randrange(2**31))
    return run.mix.draw(args.rl_rehearsal, rng)


def judge_memories(judge, outs) -> dict:
    """Each stream's explore scores (o.explore; None without a judge), and the judge's health: its
    calls and the share that fell back to 0 for want of a usable reply, which the scores alone
    cannot tell from a judgement of 0. The judge sees only the memory before and after each task,
    never the trajectory."""
    called = []
    for o in outs:
        results = [judge.score_parts(old, w.memory) if judge is not None else None
                   for old, w in zip(o.memories, o.writes)]
        o.explore = [None if r is None else r.score for r in results]
        called += [r for r in results if r is not None and (r.attempts or r.fallback)]  # an unchanged memory needs no call
    return {"judge_calls": len(called),
            "judge_fallback": sum(r.fallback for r in called) / len(called) if called else 0.0}


def evaluate_phase(run: Run, step: int, final: bool = False) -> dict:
    ev = evaluate(run.actor_model or run.learner.gen_model, run.tokenizer, run.env, run.streams, run.args,
                  run.writer_model)
    run.log({"phase": "eval", "step": step, **({"final": True} if final else {}),
             **{k: v for k, v in ev.items() if k != "memories"}})
    return ev


RL_HEALTH = (("score", "score", ".3f"), ("explore", "explore", ".2f"), ("jfb", "judge_fallback", ".2f"),
             ("wr", "writer_reward", ".3f"),
             ("ok", "writer_format_ok", ".2f"), ("kl", "approx_kl", ".4f"), ("s", "step_s", ".0f"))


# what the before-RL evaluation depends on, beside the weights and the held-out streams
PROTOCOL = "protocol"    # --actor protocol: run_actor plays warmstart.protocol_policy


EVAL_SETTINGS = ("env", "preset", "eval_temperature", "eval_attempts", "max_turns", "actor_context", "max_new_tokens", "memory_tokens",
                 "writer_think_tokens", "writer_task_last", "traj_chars", "eval_streams", "eval_segment", "tier", "swebench")


def reused_before(run: Run) -> dict:
    """The before-RL evaluation of another run (--before-from) whose final policy is this run's
    starting model (--init-from <that run>/final or /warmstart, trained no further there: --steps 0), on
    the same held-out streams with the same evaluation settings; anything else is a one-line error."""
    args = run.args
    src = args.before_from
    with open(os.path.join(src, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    before = {"actor_context": "all", "writer_think_tokens": 0, "writer_task_last": False}   # what a run made before the setting existed used
    problems = [n for n in EVAL_SETTINGS if config.get(n, before.get(n)) != getattr(args, n)]
    if summary["streams"] != [[t.id for t in s] for s in run.streams]:
        problems.append("held-out streams")
    if config.get("steps") != 0 or os.path.realpath(args.init_from) not in {
            os.path.realpath(os.path.join(src, d)) for d in ("warmstart", "final")}:
        problems.append("--init-from is not that run's untrained policy (its warmstart/ or final/ with --steps 0)")
    if problems:
        cli.fail("rime.py", f"--before-from {src}: differs in {', '.join(problems)}")
    run.log({"phase": "eval", "step": 0, "reused_from": src, **{k: v for k, v in summary["before"].items() if k != "memories"}})
    return summary["before"]


def main(argv=None) -> Run:
    args = parse_args(argv)
    if args.judge == "openai" and not args.no_explore:    # one request before any work
        try:
            judges.check_endpoint(args.judge_url, args.judge_api_model)
        except judges.ApiError as e:
            cli.fail("rime.py", f"--judge-url {args.judge_url}: {e}")
    try:
        run = setup(args)
    except ValueError as e:          # a model dir that cannot be read, a config the env refuses
        cli.fail("rime.py", str(e))
    t_start = time.time()
    warm_start_phase(run)
    if run.state["eval_before"] is None:
        if args.before_from:
            run.state["eval_before"] = reused_before(run) if run.d.is_main else {}
        else:
            run.state["eval_before"] = evaluate_phase(run, 0) if run.d.is_main else {}
        save_checkpoint(run)
    from tqdm import tqdm
    bar = tqdm(range(run.state["step"], args.steps), desc="RIME RL", disable=not run.d.is_main,
               initial=run.state["step"], total=args.steps)
    for step in bar:
        try:
            row = rl_step(run, step)
        except judges.EndpointDown as e:  # the judge's endpoint stopped answering: stop, not train on 0s
            cli.fail("rime.py", f"the judge: {e}; stopped at RL step {step + 1} (a rerun resumes from the last checkpoint)")
        bar.set_postfix_str(cli.health_line(row, RL_HEALTH))
        run.state["step"] = step + 1
        if args.eval_every and run.state["step"] % args.eval_every == 0 and run.state["step"] < args.steps and run.d.is_main:
            evaluate_phase(run, run.state["step"])
        if run.state["step"] % args.checkpoint_every == 0 or run.state["step"] == args.steps:
            save_checkpoint(run)
    if run.d.is_main:
        if args.model in ("small", "scratch"):
            log_ladder(run, "after RL")
        after = evaluate_phase(run, run.state["step"], final=True)
        export_policy(run, run.path("final"))
        attributed = attribution_phase(run, after) if args.attribute else None
        report(run, after, time.time() - t_start, attributed)
    teardown_distributed()
    return run


def attribution_phase(run: Run, after: dict) -> dict:
    """The RL effect split into the writer's part and the actor's (attribution.py): the actor RL
    started from and the trained one, each replayed with the other's held-out memories, with
    another world's and, on Alchemy, with the scripted writer's true notes (alchemy.stream_notes) and with
    scripted writers in the loop (warmstart.scripted_writers: what a memory written that way is worth).
    The start weights are <run>/warmstart, else --init-from, else --model's own."""
    from tqdm import tqdm
    args = run.args
    if os.path.isdir(run.path("warmstart")):
        start = load(run.path("warmstart"))
    elif args.init_from:
        start = load(args.init_from)
    else:
        start = load_model(args.model, args.seed)[0]
    actors = {"before RL": start.eval(), "after RL": (run.actor_model or run.learner.gen_model).eval()}
    settings = dict(temperature=args.eval_temperature, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens)
    before = dict(run.state["eval_before"])
    refs, writers = {}, {}
    if args.env == "alchemy":
        import alchemy
        refs["the scripted writer's"] = [alchemy.stream_notes(run.env, s) for s in run.streams]
        writers = warmstart.scripted_writers(args.traj_chars,
                                             lambda text: len(run.tokenizer.encode(text)) <= args.memory_tokens)
    with tqdm(total=5 + 2 * len(refs) + 2 * len(writers), desc="attribution", leave=False) as bar:
        if before.get("stream_scratch") is None:          # a reused evaluation from before they were stored
            before["stream_scratch"] = attribution.scratch_of(before, start, run.tokenizer, run.env, run.streams, **settings)
        bar.update(1)
        result = attribution.attribute(actors, {"before RL": before, "after RL": after}, run.tokenizer, run.env,
                                       run.streams, references=refs, writers=writers, on_replay=lambda: bar.update(1),
                                       **settings)
    run.log({"phase": "attribution", **{k: v for k, v in result.items() if k != "cells"},
             "cells": {k: {n: c[n] for n in ("gain", "ci95")} for k, c in result["cells"].items()}})
    return result


def _ci(interval) -> str:
    """"[lo, hi]", or "n/a" when there is none (one stream; null once read back from JSON)."""
    lo, hi = interval if interval else (None, None)
    return "n/a" if lo is None or hi is None or lo != lo else f"[{lo:+.2f}, {hi:+.2f}]"


def _applies(match: dict, key: str) -> str:
    """One reference_match line: of the reference's applies, the share the actor predicts whole, with the
    right potion colour and with the right stone, each beside a uniform pick's; "n/a" when absent (an
    evaluation reused from a run made before the diagnostic)."""
    m = match.get(key + "/apply")
    if not m:
        return "n/a"
    return (f"{m['match']:.2f} (chance {m['chance']:.2f}), colour {m['colour']:.2f} ({m['colour_chance']:.2f}), "
            f"stone {m['stone']:.2f} ({m['stone_chance']:.2f}) of {m['actions']}")


def report(run: Run, after: dict, wall_s: float, attributed: dict = None) -> None:
    """summary.json (with rl_effect), gain.png, and the before/after table with 95% CIs."""
    before, warm = run.state["eval_before"], run.state["warm"] or {}
    effect = rl_effect(before, after)
    summary = {"rl_effect": effect, "warmstart": warm, "before": before, "after": after, "wall_s": wall_s,
               "streams": [[t.id for t in s] for s in run.streams],
               **({"attribution": attributed} if attributed else {})}
    with open(run.path("summary.json"), "w") as f:
        f.write(cli.dumps(summary, indent=2))
    plot_gain(before, after, run.path("gain.png"))
    n = effect["streams"]
    print(f"\n| held-out ({n} stream{'s' if n > 1 else ''}) | format validity | cumulative reward | from scratch "
          "| cumulative gain (95% CI) |")
    print("|---|---|---|---|---|")
    for name, ev in (("before RL", before), ("after RL", after)):
        print(f"| {name} | {ev['validity']:.2f} | {ev['cumulative_reward']:.2f} | "
              f"{ev['cumulative_scratch']:.2f} | {ev['cumulative_gain']:+.2f} {_ci(ev['gain_ci95'])} |")
    print(f"\nRL effect on gain: {effect['delta']:+.2f} (95% CI {_ci(effect['ci95'])}, paired over {n} streams)")
    infl = [ev.get("memory_influence") for ev in (before, after)]
    print("memory influence (share of later tasks whose actions change with memory): "
          + " -> ".join("n/a" if x is None or x != x else f"{x:.2f}" for x in infl))
    if "memory_accuracy" in after:
        fmt = lambda xs: " ".join("n/a" if x is None or x != x else f"{x:.2f}" for x in xs)   # noqa: E731  (null: no fact stated)
        print("memory accuracy by stream position (true share of stated potion effects; coverage of the 6):")
        for name, ev in (("before RL", before), ("after RL", after)):
            print(f"  {name}: accuracy {fmt(ev['memory_accuracy'])} | coverage {fmt(ev['memory_coverage'])}")
    if "reference_match" in after:
        print("the scripted reference's applies the actor repeats, greedy in its states (whole, potion colour, stone; chance):")
        for name, ev in (("before RL", before), ("after RL", after)):
            for key in ("with_notes", "scratch"):
                print(f"  {name}, {key.replace('_', ' ')}: {_applies(ev.get('reference_match') or {}, key)}")
    if "note_agreement" in after:
        print("the protocol's applies where its notes decide, repeated greedily in its states: " + " -> ".join(
            f"{ev['note_agreement']['match']:.2f}" if "note_agreement" in ev else "n/a" for ev in (before, after))
            + f" of {after['note_agreement']['states']} (exploring instead: {after['note_agreement']['explore']:.2f})")
    if warm:
        writer = (f", writer format {warm['writer_ok_before']:.2f} -> {warm['writer_ok_after']:.2f}"
                  if "writer_ok_after" in warm else "")
        writer += (f", protocol agreement {warm['agreement_before']:.2f} -> {warm['agreement_after']:.2f}"
                   if "agreement_after" in warm else "")
        print(f"warm start ({run.args.warmstart_mode}): validity {warm['validity_before']:.2f} -> "
              f"{warm['validity_after']:.2f}{writer}, held-out score {warm['score_before']:.2f} -> {warm['score_after']:.2f} "
              f"(6-turn episodes) in {warm['steps']} steps")
    if attributed:
        print("where the RL effect comes from (each actor replayed with stored memories; gain vs its own from scratch):")
        print(attribution.markdown(attributed))
    print(f"wall time {wall_s / 60:.1f} min; run dir {run.args.run_dir} (policy in HF format: {run.path('final')})")


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
    for name, ev in (("before RL", before), ("after RL", after)):   # mean gain per position over the streams
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
