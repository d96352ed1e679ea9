"""The PPO learner: token-level clipped loss (decoupled for asynchronous rollouts), a value head or a
critic-free group baseline, KL to a frozen reference, entropy bonus, SFT loss, FSDP2 sharding, weight
sync to a generation copy, and torch.distributed.checkpoint checkpoints.

    from ppo import Learner, make_batch
    learner = Learner(model, ref_model=copy.deepcopy(model), lr=1e-6)   # single process (CPU or one GPU)
    # critic-free (RIME): one advantage per row, from rewards.group_advantages
    batch = make_batch(tokens, loss_masks, logprobs, row_advantages, versions=versions)
    stats = learner.update(batch)      # one optimizer step; learner.gen_model now holds the new weights
    print(stats)                       # loss, pg_loss, approx_kl, clipfrac, entropy, grad_norm, ...
    # value head + GAE (CAMG): Learner(..., value_head=True), then per token
    values = learner.values_of(batch); adv, ret = rewards.gae(token_rewards, values, batch.loss_mask)
    batch.advantages, batch.returns, batch.old_values = adv, ret, values; learner.update(batch)
    # torchrun --nproc_per_node 8 rime.py : init_distributed() once, then each rank passes its own rows

The objective is AReaL's decoupled PPO (ppo_loss.py holds the losses and explains them): behaviour
(the generator's weights when the row was sampled: `behav_logprobs`, version `versions`), proximal
(the learner's weights at the start of this update: `prox`) and current (the weights being trained)
meet in one token-level clipped loss, where w = pi_prox / pi_behav corrects for rows sampled by older
weights. Staleness is bounded by eta (`max_lag`): rows whose version lag exceeds it are *dropped*
(mask 0, out of the token count), not down-weighted: w already corrects an admissible row without
bias, while any down-weighting function would be an arbitrary bias, and past eta the ratios w have
too much variance to be worth a gradient. eta = 0 is synchronous PPO. policy_loss's two guards for
far-off-policy tokens (`behav_imp_weight_cap`, `clip_ratio_c`) are Learner settings, off by default.

Temperature: generate reports logprobs of softmax(logits / T), so every row carries the T it was sampled
at (Batch.temperatures, from rollout's Segment.temperature through make_batch) and the learner computes
prox, current, reference logprobs and the entropy of each row under softmax(logits / T) too: w is then
exactly 1 on synchronous rows at any T. Rows sampled with top_p < 1 are refused (make_batch says why).

Token alignment: every [B, T] tensor is aligned with `tokens`: logprobs[:, t] is log p(tokens[t] |
tokens[<t]) (computed from the logits at t-1), values[:, t] = V(hidden[t-1]) is the value of the state in
which token t was chosen (so rewards.gae sees values at policy tokens), position 0 is never trained.

Distributed: with world_size > 1 (torchrun) each decoder layer, then the root (policy + value head) is
`fully_shard`ed (FSDP2); bf16 compute with fp32 master weights and fp32 gradient reduction on CUDA, fp32
on CPU (gloo). FSDP averages gradients over ranks, so each rank's loss is its own token *sum* divided by
the global token count and multiplied by world_size: the average of those gradients is exactly the
gradient of the global token mean, however unevenly tokens fall across ranks and micro-batches.

RIME's defaults (critic-free mode): clip 0.2 / 0.28, k1 KL 0.01 to the frozen reference, no entropy
bonus, AdamW lr 1e-6, wd 0.1, one optimizer step per rollout batch (`update(batch)`). Groups of 8 and
dropping groups whose rewards are all equal happen on the caller's side, where groups are known:
`rewards.group_advantages` returns keep=False for such groups; leave those rows out of the Batch.

Simplified on purpose: no sequence packing (micro-batches are right-padded, rows sorted by length), no
tensor/pipeline parallelism, no CPU offload, the reference model is not checkpointed (it is frozen:
rebuild it from the same weights), one process group for everything. A checkpoint is complete once its
`done.json` marker exists (written last); a damaged one fails to load with a one-line ValueError.
"""
from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# the losses (ppo_loss.py); callers may take them from here too (ppo.policy_loss, ppo.sft_loss)
from ppo_loss import kl_to_ref, masked, policy_loss, sft_loss, token_entropy, token_logprobs, value_loss

# -----------------------------------------------------------------------------------------------
# distributed setup: rank, world size and device are worked out once; plain `python` = one process


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None) -> Dist:
    """torchrun sets RANK / LOCAL_RANK / WORLD_SIZE: join the process group (nccl on CUDA, gloo on CPU).
    Without them this is a single process and no process group is made."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ:
        return Dist(device=torch.device(kind))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        # ranks share the machine's cores: more threads than cores makes every op spin-wait
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    return Dist(rank, local_rank, world_size, dev)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    """True on rank 0, and in every process when there is no process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """print on rank 0 only (every process when there is no process group)."""
    if is_rank0():
        print(*args, **kwargs)


def _all_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x


# -----------------------------------------------------------------------------------------------
# the batch: padded rows, every per-token tensor aligned with `tokens`


@dataclass
class Batch:
    tokens: torch.Tensor             # [B, T] long, right-padded
    loss_mask: torch.Tensor          # [B, T] float, 1 where the policy generated the token (PPO trains it)
    behav_logprobs: torch.Tensor     # [B, T] logprob under the behaviour (generating) policy, 0 elsewhere
    advantages: torch.Tensor         # [B, T] per token (a row's group advantage broadcast to its tokens)
    lengths: torch.Tensor            # [B] real tokens per row
    versions: torch.Tensor           # [B] long, policy version that generated the row
    returns: torch.Tensor | None = None      # [B, T] value targets (GAE mode)
    old_values: torch.Tensor | None = None   # [B, T] values at rollout time, for the clipped value loss
    sft_mask: torch.Tensor | None = None     # [B, T] 1 on tokens trained with plain cross-entropy
    temperatures: torch.Tensor | None = None  # [B] the temperature each row was sampled at (None: all 1)

    def __post_init__(self):
        assert self.tokens.dim() == 2, f"tokens must be [B, T], got {tuple(self.tokens.shape)}"
        B, T = self.tokens.shape
        for f in fields(self):
            x = getattr(self, f.name)
            if x is None or f.name == "tokens":
                continue
            want = (B,) if f.name in ("lengths", "versions", "temperatures") else (B, T)
            assert tuple(x.shape) == want, f"Batch.{f.name} is {tuple(x.shape)}, expected {want}"
        for name in ("loss_mask", "sft_mask"):
            m = getattr(self, name)
            # the first token has no context, so nothing predicts it
            assert m is None or not m[:, 0].any(), f"Batch.{name}[:, 0] must be 0: token 0 cannot be trained"

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, idx) -> "Batch":
        """Rows idx (list or LongTensor), in that order."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.tokens.device)
        return replace(self, **{f.name: getattr(self, f.name)[idx] for f in fields(self)
                                if getattr(self, f.name) is not None})

    def shard(self, rank: int, world_size: int) -> "Batch":
        """This rank's rows (rank, rank + world, ...): how a global batch is split under torchrun."""
        assert len(self) >= world_size, f"{len(self)} rows cannot give every one of {world_size} ranks a row"
        return self.select(list(range(rank, len(self), world_size)))

    def to(self, device) -> "Batch":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})


def make_batch(tokens, loss_mask, behav_logprobs=None, advantages=None, *, returns=None, old_values=None,
               versions=None, sft_mask=None, temperatures=None, top_p=1.0, pad_id: int = 0) -> Batch:
    """Pad ragged rows (lists, e.g. rollout.Segment fields) into a Batch.

    tokens, loss_mask, behav_logprobs: one list per row, same lengths. advantages: one float per row
    (critic-free: broadcast to the row's tokens) or one list per row. returns / old_values / sft_mask:
    lists per row. versions: one int per row (default 0). Missing logprobs / advantages are zeros
    (e.g. a pure SFT batch).

    temperatures: the sampling temperature of each row (one float, or one per row: Segment.temperature),
    so the learner scores every row under the distribution it was sampled from; default 1. A greedy row
    (0) is scored at 1, as generate reports its logprobs untempered. top_p: the nucleus the rows were
    sampled with (one float or one per row); below 1 is refused, because generate's behaviour logprobs
    are those of the untruncated distribution, so pi_prox / pi_behav would not be an importance weight
    of the sampler: train on rows sampled with top_p = 1 (evaluate with any top_p)."""
    B = len(tokens)
    assert B > 0, "make_batch needs at least one row"
    top_ps = [top_p] * B if isinstance(top_p, (int, float)) else list(top_p)
    if len(top_ps) != B:
        raise ValueError(f"{len(top_ps)} top_p values for {B} rows")
    if min(top_ps) < 1.0:
        raise ValueError(f"rows sampled with top_p={min(top_ps)} cannot be trained on: their behaviour "
                         f"logprobs are of the untruncated distribution; sample training rows with top_p=1")
    temps = [temperatures] * B if temperatures is None or isinstance(temperatures, (int, float)) else list(temperatures)
    if len(temps) != B:
        raise ValueError(f"{len(temps)} temperatures for {B} rows")
    temps = [1.0 if t is None or t == 0 else float(t) for t in temps]
    if min(temps) < 0:
        raise ValueError(f"temperatures must be >= 0, got {min(temps)}")
    lengths = [len(t) for t in tokens]
    T = max(lengths)
    assert min(lengths) >= 2, "every row needs at least 2 tokens (a context and a trained token)"

    def pad(rows, name, value=0.0, dtype=torch.float32):
        out = torch.full((B, T), value, dtype=dtype)
        for b, row in enumerate(rows):
            assert len(row) == lengths[b], f"{name}[{b}] has {len(row)} entries for {lengths[b]} tokens"
            out[b, :len(row)] = torch.as_tensor(row, dtype=dtype)
        return out

    mask = pad(loss_mask, "loss_mask")
    if torch.is_tensor(advantages):
        advantages = advantages.tolist()
    if advantages is None:
        adv = torch.zeros(B, T)
    elif all(isinstance(a, (int, float)) for a in advantages):
        assert len(advantages) == B, f"{len(advantages)} advantages for {B} rows"
        adv = torch.tensor(advantages, dtype=torch.float32)[:, None] * mask   # [B, 1] -> [B, T]
    else:
        adv = pad(advantages, "advantages")
    return Batch(
        tokens=pad(tokens, "tokens", pad_id, torch.long), loss_mask=mask,
        behav_logprobs=pad(behav_logprobs, "behav_logprobs") if behav_logprobs is not None else torch.zeros(B, T),
        advantages=adv, lengths=torch.tensor(lengths),
        versions=torch.tensor(versions if versions is not None else [0] * B, dtype=torch.long),
        returns=pad(returns, "returns") if returns is not None else None,
        old_values=pad(old_values, "old_values") if old_values is not None else None,
        sft_mask=pad(sft_mask, "sft_mask") if sft_mask is not None else None,
        temperatures=torch.tensor(temps, dtype=torch.float32))


def fresh_rows(versions: torch.Tensor, version: int, max_lag: int) -> torch.Tensor:
    """Staleness bound eta: True for rows generated at most max_lag versions ago ([B] bool)."""
    lag = version - versions
    assert (lag >= 0).all(), f"a row claims version {int(versions.max())} > the learner's {version}"
    return lag <= max_lag


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split rows into micro-batches of at most token_budget padded tokens (rows x longest row).
    Rows go longest first so each micro-batch pads little; a row longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + [cur] if cur else out


# -----------------------------------------------------------------------------------------------
# the learner


class ActorCritic(nn.Module):
    """The policy plus an optional value head V = Linear(D, 1) on its final hidden states. One module so
    FSDP shards the head with the root (embeddings, final norm, lm_head)."""

    def __init__(self, model: nn.Module, value_head: bool):
        super().__init__()
        self.model = model
        D = model.config.hidden_size
        self.value_head = nn.Linear(D, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)    # start at V = 0: no random baseline noise in step 1
            nn.init.zeros_(self.value_head.bias)

    def forward(self, tokens):
        """tokens [B, T] -> logits [B, T, V] fp32, values [B, T] fp32 aligned with tokens (or None)."""
        logits, hidden = self.model(tokens, return_hidden=True)
        if self.value_head is None:
            return logits, None
        v = self.value_head(hidden).squeeze(-1).float()        # [B, T]: value of the state after token t
        return logits, F.pad(v[:, :-1], (1, 0))                # shift: values[:, t] = V(state choosing t)


def _shard(module: nn.Module, layers, mp) -> None:
    """FSDP2: each decoder layer is its own unit (all-gathered just before use, freed after), then the
    root takes what is left. fully_shard refuses containers without forward, hence layer by layer."""
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(module, mp_policy=mp)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP parameter or clip_grad_norm_'s result) -> a plain tensor (all-gather); else t."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _row_temps(batch: Batch, idx=None):
    """The sampling temperature of batch's rows (those in idx): one float when they share it (the usual
    case; 1.0 then costs no [b, t, V] division) or a [b] tensor."""
    if batch.temperatures is None:
        return 1.0
    t = batch.temperatures if idx is None else batch.temperatures[idx]
    return float(t[0]) if bool((t == t[0]).all()) else t


class Learner:
    """Holds the trained policy (+ value head), the frozen reference, AdamW and the version counter.

    update(batch) takes one optimizer step per minibatch over this rank's rows and returns the health
    metrics (already reduced over ranks). Under torchrun every rank must call every collective method
    (update, logprobs_of, values_of, sync_weights, save, load) together.
    """

    def __init__(self, model: nn.Module, *, ref_model: nn.Module | None = None, value_head: bool = False,
                 lr: float = 1e-6, weight_decay: float = 0.1, betas=(0.9, 0.999), max_grad_norm: float = 1.0,
                 clip_low: float = 0.2, clip_high: float = 0.28, kl_coef: float = 0.01, kl_estimator: str = "k1",
                 entropy_coef: float = 0.0, vf_coef: float = 0.5, value_clip: float | None = 0.2,
                 sft_coef: float = 1.0, max_lag: int = 0, micro_batch_tokens: int = 8192,
                 behav_imp_weight_cap: float | None = None, clip_ratio_c: float | None = None,
                 gradient_checkpointing: bool = True, generation_copy: bool = True, dist_info: Dist | None = None):
        assert kl_estimator in ("k1", "k3"), f"kl_estimator must be 'k1' or 'k3', got {kl_estimator!r}"
        if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 1.0:
            raise ValueError(f"behav_imp_weight_cap must be > 1 (or None = off), got {behav_imp_weight_cap}")
        if clip_ratio_c is not None and not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None = off), got {clip_ratio_c}")
        assert max_lag >= 0 and micro_batch_tokens > 0, "max_lag >= 0 and micro_batch_tokens > 0 required"
        assert hasattr(model, "layers") and hasattr(model, "config"), "model must have .layers and .config"
        self.d = dist_info or Dist(device=next(model.parameters()).device)
        assert self.d.world_size == 1 or dist.is_initialized(), "world_size > 1 needs init_distributed() first"
        self.clip_low, self.clip_high, self.max_grad_norm = clip_low, clip_high, max_grad_norm
        self.kl_coef, self.kl_estimator, self.entropy_coef = kl_coef, kl_estimator, entropy_coef
        self.vf_coef, self.value_clip, self.sft_coef = vf_coef, value_clip, sft_coef
        self.max_lag, self.micro_batch_tokens = max_lag, micro_batch_tokens
        self.behav_imp_weight_cap, self.clip_ratio_c = behav_imp_weight_cap, clip_ratio_c   # policy_loss guards
        self.version = 0                    # +1 per update(); rows carry the version that generated them
        dev, cuda = self.d.device, self.d.device.type == "cuda"

        # the generation copy: a full, unsharded model per rank (rollouts run on every rank), taken before
        # sharding; bf16 on GPU. Single process without a copy: generate with learner.policy.model.
        self.gen_model = None
        if generation_copy:
            self.gen_model = copy.deepcopy(model).to(dev).eval()
            if cuda:
                self.gen_model.to(torch.bfloat16)
            self.gen_model.requires_grad_(False)
        elif self.d.world_size > 1:
            raise ValueError("with world_size > 1 the learner's model is sharded: use generation_copy=True")

        model.gradient_checkpointing = gradient_checkpointing
        self.policy = ActorCritic(model, value_head).to(dev)
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(dev).eval().requires_grad_(False)
        # bf16: one process on a GPU uses autocast; FSDP uses its mixed-precision policy instead
        # (bf16 compute, fp32 master weights, fp32 gradient reduce-scatter)
        self.autocast = nullcontext
        if self.d.world_size > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda \
                else MixedPrecisionPolicy()
            _shard(self.policy, self.policy.model.layers, mp)
            if ref_model is not None:
                _shard(ref_model, ref_model.layers, mp)
        elif cuda:
            self.autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)

        # no weight decay on norms and biases (1-d), as in nanoGPT
        params = [p for p in self.policy.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)

    # --- forward passes -------------------------------------------------------------------------

    def _micro(self, lengths: torch.Tensor) -> list[list[int]]:
        """This rank's micro-batches, padded with empty ones to the count of the rank with the most:
        FSDP's all-gathers run once per forward, so every rank must run the same number of forwards."""
        mbs = micro_batches(lengths.tolist(), self.micro_batch_tokens)
        n = _all_reduce(torch.tensor([len(mbs)], device=self.d.device), dist.ReduceOp.MAX)
        return mbs + [[] for _ in range(int(n) - len(mbs))]

    @torch.no_grad()
    def _score(self, module, batch: Batch, temperature=None, values=False):
        """One no-grad pass over this rank's rows -> logprobs [B, T] (and values [B, T]), each row under
        its own sampling temperature (batch.temperatures) unless a temperature is given."""
        B, T = batch.tokens.shape
        lp = torch.zeros(B, T, device=self.d.device)
        vals = torch.zeros(B, T, device=self.d.device) if values else None
        for idx in self._micro(batch.lengths):
            idx = idx or [0]                  # an empty micro-batch still runs a forward (see _micro)
            t_max = int(batch.lengths[idx].max())
            tok = batch.tokens[idx, :t_max].to(self.d.device)
            with self.autocast():
                out = module(tok)
            logits, v = out if isinstance(out, tuple) else (out, None)
            keep = torch.arange(t_max, device=tok.device)[None] < batch.lengths[idx, None].to(tok.device)
            temp = temperature if temperature is not None else _row_temps(batch, idx)
            lp[idx, :t_max] = token_logprobs(logits, tok, temp) * keep             # 0 past each row's end
            if values:
                vals[idx, :t_max] = v
        return (lp, vals) if values else lp

    def logprobs_of(self, batch: Batch, temperature: float | None = None) -> torch.Tensor:
        """Recompute the policy's logprobs of batch.tokens ([B, T], aligned with tokens), each row at its
        sampling temperature (batch.temperatures), or at `temperature` when given."""
        self.policy.eval()
        return self._score(self.policy, batch, temperature)

    def values_of(self, batch: Batch) -> torch.Tensor:
        """Value-head estimates [B, T] (aligned with tokens) for GAE: rewards.gae(r, values, mask)."""
        assert self.policy.value_head is not None, "values_of needs Learner(value_head=True)"
        self.policy.eval()
        return self._score(self.policy, batch, values=True)[1]

    # --- the update -----------------------------------------------------------------------------

    def update(self, batch: Batch, num_minibatches: int = 1) -> dict:
        """PPO on this rank's rows: num_minibatches optimizer steps (RIME: 1), each a global token mean.
        Then version += 1 and the generation copy gets the new weights. Returns health metrics (the
        loss terms, clipfrac, approx_kl, grad_norm... of the last step; counts and tokens/s of the batch)."""
        t0 = time.perf_counter()
        batch = batch.to(self.d.device)
        assert len(batch) >= num_minibatches >= 1, f"{len(batch)} rows cannot make {num_minibatches} minibatches"
        fresh = fresh_rows(batch.versions, self.version, self.max_lag)                  # [B]
        batch = replace(batch, loss_mask=batch.loss_mask * fresh[:, None])              # stale rows: dropped
        # prox = the weights at the start of the update. With one minibatch the weights in the step *are*
        # prox, so the step's own logprobs (detached) serve and save a forward; later minibatches need
        # logprobs recomputed up front, before the first step moves the weights.
        prox = self.logprobs_of(batch) if num_minibatches > 1 else None
        self.policy.train()
        # several minibatches: shuffled rows (torch's RNG, checkpointed); one: all rows in order
        rows = torch.randperm(len(batch)).tolist() if num_minibatches > 1 else list(range(len(batch)))
        stats = {}
        for k in range(num_minibatches):
            mb_rows = rows[k::num_minibatches]
            stats = self._step(batch.select(mb_rows), prox[mb_rows] if prox is not None else None)
        self.version += 1
        if self.gen_model is not None:
            self.sync_weights()
        # metrics that describe the whole batch, reduced over ranks: [rows, dropped rows, tokens, policy tokens,
        # rows with policy tokens] (rows trained by cross-entropy alone, e.g. rime.py --rl-rehearsal's, have none)
        c = _all_reduce(torch.tensor([len(batch), int((~fresh).sum()), float(batch.lengths.sum()),
                                      float(batch.loss_mask.sum()), int((batch.loss_mask.sum(1) > 0).sum())],
                                     device=self.d.device, dtype=torch.float64))
        dt = time.perf_counter() - t0
        stats.update(version=self.version, num_rows=int(c[0]), num_stale=int(c[1]), tokens=int(c[2]),
                     response_len=float(c[3] / max(c[4], 1)), tokens_per_s=float(c[2]) / dt,
                     update_s=dt, lr=self.optimizer.param_groups[0]["lr"])
        return stats

    def _step(self, batch: Batch, prox: torch.Tensor | None) -> dict:
        """One optimizer step: accumulate gradients over micro-batches, clip, check, step."""
        world = self.d.world_size
        use_values = self.policy.value_head is not None and batch.returns is not None and self.vf_coef > 0
        sft_mask = batch.sft_mask if batch.sft_mask is not None else torch.zeros_like(batch.loss_mask)
        # global denominators: the token mean is over the policy tokens of *all* ranks (see module docstring)
        n = _all_reduce(torch.stack([batch.loss_mask.sum(), sft_mask.sum()]).float())
        n_pol, n_sft = n[0].clamp(min=1), n[1].clamp(min=1)
        # a pure imitation batch (warm start) has no policy tokens: no reference forward for a zero KL
        use_ref = self.ref_model is not None and self.kl_coef > 0 and bool(n[0] > 0)
        use_sft = bool(n[1] > 0) and self.sft_coef > 0   # global, so every rank runs the same branches
        sums = {}                           # metric -> 0-dim tensor, a share of the global mean

        def add(name, value):
            sums[name] = sums.get(name, 0.0) + value.detach().float()

        for idx in self._micro(batch.lengths):
            dummy = not idx                 # this rank ran out of rows: a zero-weight forward/backward
            idx = idx or [0]
            t_max = int(batch.lengths[idx].max())
            mb = batch.select(idx)
            tok = mb.tokens[:, :t_max]
            mask = (mb.loss_mask[:, :t_max] * (0.0 if dummy else 1.0)).bool()        # [b, t]
            smask = (sft_mask[idx, :t_max] * (0.0 if dummy else 1.0)).bool()
            with self.autocast():
                logits, values = self.policy(tok)                                   # [b, t, V], [b, t]
            # every distribution the loss compares is the sampler's: softmax(logits / T) of the row's T
            temp = _row_temps(mb)                                                   # [b] or 1.0
            logp = token_logprobs(logits, tok, temp)                                # [b, t]
            mb_prox = prox[idx, :t_max] if prox is not None else logp.detach()
            pg, st = policy_loss(logp, mb_prox, mb.behav_logprobs[:, :t_max], mb.advantages[:, :t_max], mask,
                                 self.clip_low, self.clip_high, num_tokens=n_pol,
                                 behav_imp_weight_cap=self.behav_imp_weight_cap, clip_ratio_c=self.clip_ratio_c)
            loss = pg
            for name, value in st.items():
                add(name, value)
            if self.entropy_coef > 0:
                ent = masked(token_entropy(logits, temp), mask).sum() / n_pol
                loss = loss - self.entropy_coef * ent
            else:                           # only logged: no graph through the [b, t, V] softmax
                with torch.no_grad():
                    ent = masked(token_entropy(logits, temp), mask).sum() / n_pol
            add("entropy", ent)
            if use_ref:
                with torch.no_grad(), self.autocast():
                    ref_logp = token_logprobs(self.ref_model(tok), tok, temp)
                kl = masked(kl_to_ref(logp, ref_logp, self.kl_estimator), mask).sum() / n_pol
                loss = loss + self.kl_coef * kl
                add("kl_ref", kl)
            if use_values:
                ret = mb.returns[:, :t_max]
                old = mb.old_values[:, :t_max] if mb.old_values is not None else None
                vl = value_loss(values, ret, mask, old, self.value_clip, num_tokens=n_pol)
                loss = loss + self.vf_coef * vl
                add("value_loss", vl)
                v, r = masked(values.detach(), mask), masked(ret.float(), mask)       # for explained variance
                for name, x in (("_r", r), ("_r2", r * r), ("_e", r - v), ("_e2", (r - v) ** 2)):
                    add(name, x.sum())
            if use_sft:
                sl = sft_loss(logp, smask, num_tokens=n_sft)
                loss = loss + self.sft_coef * sl
                add("sft_loss", sl)
            add("loss", loss)
            # x world: FSDP averages gradients over ranks; we want the sum of per-rank token sums / n
            (loss * world).backward()

        names = sorted(sums)                # same keys on every rank: all of them ran the same branches
        total = _all_reduce(torch.stack([sums[k] for k in names]))
        stats = {k: float(v) for k, v in zip(names, total)}
        if "_r" in stats:                   # explained variance 1 - Var(R - V) / Var(R) over policy tokens
            cnt = float(n_pol)
            var_r = stats.pop("_r2") / cnt - (stats.pop("_r") / cnt) ** 2
            var_e = stats.pop("_e2") / cnt - (stats.pop("_e") / cnt) ** 2
            stats["explained_var"] = 1.0 - var_e / var_r if var_r > 1e-12 else float("nan")
        params = [p for p in self.policy.parameters() if p.requires_grad]
        grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)))
        stats["grad_norm"] = grad_norm
        # the norm, loss and counts are global (reduced), so every rank takes the same decision
        finite = math.isfinite(stats["loss"]) and math.isfinite(grad_norm)
        stats["skipped"] = float(not finite or float(n.sum()) == 0)
        if not finite:
            print0(f"WARNING: non-finite loss ({stats['loss']}) or grad norm ({grad_norm}) at version "
                   f"{self.version}: optimizer step skipped")
        elif stats["skipped"]:               # AdamW would still move the weights (momentum, weight decay)
            print0(f"WARNING: no trainable tokens at version {self.version} (all rows stale or masked): "
                   f"optimizer step skipped")
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Make the frozen reference the current policy (e.g. after a warm start, so the KL anchors
        RL to the warm-started weights, not the random init). Shards match shard for shard under FSDP."""
        assert self.ref_model is not None, "reset_reference needs a Learner with ref_model"
        ref = dict(self.ref_model.named_parameters())
        for name, p in self.policy.model.named_parameters():
            ref[name].copy_(p.detach())

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (e.g. after a warm start, so RL's steps are sized by RL's gradients, not
        by the far larger SFT gradients the second moments remember: measured on the laptop reader, RL
        that continued the warm start's AdamW moved the policy by a KL of ~2e-5 per update)."""
        self.optimizer.state.clear()

    # --- weight sync ----------------------------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self, gen_model: nn.Module | None = None) -> int:
        """Copy the learner's weights into the generation copy, one parameter at a time: under FSDP each
        full_tensor() all-gathers a single parameter, so no rank ever holds more than one extra full
        parameter beyond its shard and its own generation copy. Returns the version the copy now holds."""
        gen_model = gen_model if gen_model is not None else self.gen_model
        target = dict(gen_model.named_parameters())
        source = dict(self.policy.model.named_parameters())
        assert target.keys() == source.keys(), "generation copy and learner model have different parameters"
        for name, p in source.items():
            target[name].copy_(_full(p.detach()))
        gen_model.version = self.version
        return self.version

    # --- checkpoints ----------------------------------------------------------------------------

    def _dcp_state(self, caller_state=None) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.policy, self.optimizer)
        # RNG differs per rank: a key per rank (DCP writes each distinct key once, from its owner)
        return {"model": model_sd, "optim": optim_sd,
                "learner": {"version": self.version, "caller": pickle.dumps(caller_state)},
                "rng": {f"rank{self.d.rank}": pickle.dumps(_rng_state())}}

    def save(self, path: str, caller_state=None) -> None:
        """torch.distributed.checkpoint of model + value head, optimizer, version, this rank's RNG and
        caller_state (any picklable: stream position, step, ...). Every rank writes its own shards.
        Crash-safe: the shards go to `path.tmp`, then rank 0 writes the `done.json` marker (the last
        file, once every rank's shards are on disk) and swaps directories, so a run killed while saving
        still has its previous checkpoint (`checkpoint_path` finds whichever has its marker)."""
        import shutil
        import torch.distributed.checkpoint as dcp
        tmp, old = path + ".tmp", path + ".old"
        many = self.d.world_size > 1 and dist.is_initialized()
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if many:
            dist.barrier()
        with _single_process_quiet():
            dcp.save(self._dcp_state(caller_state), checkpoint_id=tmp, no_dist=not dist.is_initialized())
        if many:
            dist.barrier()                       # every rank's shards are on disk
        if self.d.is_main:
            with open(os.path.join(tmp, DONE), "w") as f:      # the completeness marker, written last
                json.dump({"version": self.version, "world_size": self.d.world_size}, f)
            shutil.rmtree(old, ignore_errors=True)
            if os.path.isdir(path):
                os.rename(path, old)             # a crash from here on leaves old (or tmp) complete
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        if many:
            dist.barrier()

    def load(self, path: str):
        """Restore what save() wrote (the same world size, for the RNG); returns caller_state. The
        generation copy is re-synced, so generation resumes exactly where the saved run stood."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict
        found = checkpoint_path(path)
        if found is None:
            raise ValueError(f"no complete checkpoint at {path} (a complete one has {DONE})")
        state = self._dcp_state()
        try:
            # the index first: when it is damaged, DCP logs a traceback and then asserts
            dcp.FileSystemReader(found).read_metadata()
            with _single_process_quiet():   # tensors load in place, pickled bytes are replaced
                dcp.load(state, checkpoint_id=found, no_dist=not dist.is_initialized())
            set_state_dict(self.policy, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            rng, caller = pickle.loads(state["rng"][f"rank{self.d.rank}"]), pickle.loads(state["learner"]["caller"])
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's errors are BaseExceptions
            raise ValueError(f"checkpoint {found} is corrupt or does not match this model "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'})") from None
        self.version = int(state["learner"]["version"])
        _set_rng_state(rng)
        if self.gen_model is not None:
            self.sync_weights()
        return caller


DONE = "done.json"   # written into a checkpoint dir after everything else: its presence = complete


def checkpoint_path(path: str) -> str | None:
    """The complete checkpoint saved at `path`: path itself, or the copy a crash mid-swap left
    (path.old, then path.tmp), each complete only once save() wrote its `done.json` marker last;
    None if there is none. A dir with DCP's .metadata but no marker is a save that died half-way."""
    for p in (path, path + ".old", path + ".tmp"):
        if os.path.isfile(os.path.join(p, DONE)):
            return p
    return None


@contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # overwriting is the intent
        yield


def _rng_state() -> dict:
    import numpy as np
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    import numpy as np
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def logprobs_of(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                temperature: float = 1.0, micro_batch_tokens: int = 8192) -> torch.Tensor:
    """Single-process recompute of log p(tokens[t] | tokens[<t]) under softmax(logits / temperature),
    [B, T] aligned with tokens (0 at t = 0 and past each row's length); checks generate's logprobs."""
    B, T = tokens.shape
    lengths = lengths if lengths is not None else torch.full((B,), T)
    out = torch.zeros(B, T)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for idx in micro_batches(lengths.tolist(), micro_batch_tokens):
            t_max = int(lengths[idx].max())
            tok = tokens[idx, :t_max].to(next(model.parameters()).device)
            lp = token_logprobs(model(tok), tok, temperature).cpu()
            keep = torch.arange(t_max)[None] < lengths[idx, None]
            out[idx, :t_max] = lp * keep
    model.train(was_training)
    return out
