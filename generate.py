"""Batched KV-cache generation: ragged prompts, prefill + decode, sampling, per-token logprobs.

    from model import tiny
    from generate import generate
    model, tok = tiny("qwen3")
    outs = generate(model, [tok.encode("hello"), tok.encode("a longer prompt")], max_new_tokens=32,
                    temperature=0.7, top_p=0.9, stop_token_ids=[tok.eos_token_id], seed=0)
    outs[0].tokens, outs[0].logprobs, outs[0].finish_reason

How it runs (the nano-vllm / gpt-fast recipe, without paging or continuous batching):
  1. Prefill. Prompts are sorted by length and cut into right-padded micro-batches whose padded size
     (rows x longest prompt) stays under a token budget and is at most 10% padding, so short prompts
     are not padded to the longest one (the padding-free varlen prefill of nano-vllm, approximated).
     One cache holds every row; each micro-batch fills its rows in place (`model(ids, cache=cache.rows(a,
     b), lengths=...)`), and the rows then decode together. Multi-turn: a prompt that extends an earlier
     prompt + completion can pass that call's saved `Prefix`, and only its new tokens are prefilled.
  2. Decode. One token per step for every live row. A row stops at a stop token (kept, with its logprob:
     the learner trains on it) or at its own max_new_tokens. Finished rows are dropped from the batch
     with `Cache.select`, so they stop costing compute. Rows stay in prompt-length order, so the model's
     SDPA path attends in groups of similar-length rows (model.row_groups) and reads little padding.
Attention kernels are the model's business (`model.attn_impl`): PyTorch SDPA on CPU, FlashAttention
(`flash_attn_varlen_func` for prefill, `flash_attn_with_kvcache` for decode) on CUDA in bf16/fp16.

Sampling: logits / temperature -> softmax -> optional top-p truncation -> one draw from a seeded
torch.Generator (temperature 0 = argmax). The logprob returned for a token is log_softmax(logits / T)
at that token, *before* top-p truncation (greedy: the untempered log_softmax), so that a learner can
recompute it exactly from one forward over prompt + completion at the same temperature (ppo.Batch carries
each row's). Rows sampled with top_p < 1 are therefore not behaviour logprobs of the sampler, and
ppo.make_batch refuses them for training.

Weights: the whole call runs inside model.transposed_weights, so decode steps multiply by transposed
weight copies made at the first step and dropped when the call returns (nothing goes stale between calls).

Host syncs: the finish check needs the sampled tokens on the host. On CPU that costs nothing, so we
read them back every step; on CUDA they are read back every `sync_every` steps (default 8) so the host
keeps queueing kernels ahead of the GPU. A row that stops mid-block has its extra tokens discarded. A
row never runs past its length limit: a read-back is forced on the step where the first live row hits it.

Simplified on purpose: no paged KV cache, no continuous batching (new prompts cannot join a running
batch), no CUDA graphs, no speculative decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model import row_groups, transposed_weights


@dataclass
class Prefix:
    """The model state after a prompt's first `num_tokens` tokens: a one-row Cache. A multi-turn
    rollout passes it back with the longer next prompt, so only the new turn is prefilled."""
    cache: object              # model.Cache with one row holding exactly num_tokens tokens
    num_tokens: int


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)      # generated tokens (stop token included)
    logprobs: list[float] = field(default_factory=list)  # one per token, under softmax(logits / T)
    finish_reason: str = "length"                         # "stop" (hit a stop token) | "length"
    prefix: Prefix | None = None  # with keep_prefix: state after prompt + tokens[:-1] (the last token is not fed)


# ----------------------------------------------------------------------------------------------
# input checks: bad input gets an error that says what to change


def _check_inputs(model, prompts, max_new_tokens, temperature, top_p) -> list[int]:
    """Validate arguments; return max_new_tokens as one int per prompt."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("generate() needs a non-empty list of prompts (each a list of token ids)")
    if isinstance(max_new_tokens, int):
        max_new = [max_new_tokens] * len(prompts)
    else:
        max_new = [int(m) for m in max_new_tokens]
        if len(max_new) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new)} entries for {len(prompts)} prompts")
    if min(max_new) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {min(max_new)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    vocab, max_seq_len = model.config.vocab_size, model.config.max_seq_len
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(p) + m > max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens + max_new_tokens {m} = {len(p) + m}, more than the "
                f"model's context of {max_seq_len} tokens (config.max_seq_len): shorten the prompt or "
                f"lower max_new_tokens")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside [0, {vocab})")
    return max_new


# ----------------------------------------------------------------------------------------------
# sampling


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None):
    """logits (B, V) fp32 -> (tokens (B,), logprobs (B,)). No host sync."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)  # (B, V) greedy: logprob under the untempered model
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V) the distribution we report
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        # drop a token once the mass strictly before it already reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_p.masked_fill(drop, 0.0))
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i / sum(p).
    # Unlike torch.multinomial it never syncs with the host. The clamp keeps 0 / 0 = nan (which argmax
    # would pick) away from truncated tokens.
    e = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    tokens = (probs / e).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------
# prefill


def prefill(model, prompts: list[list[int]], cache_len: int, token_budget: int, device,
            prefixes: list[Prefix] | None = None, max_padding: float = 0.1):
    """Run the prompts through the model in right-padded micro-batches; prompts ascend in length.

    cache_len: slots per row of the cache (prompt + completion); token_budget: most padded tokens per
    micro-batch (bounds activation memory); max_padding: most padding per micro-batch, as a fraction.
    prefixes: continue these saved states instead of starting fresh; prompts[i] then holds only the
    tokens after prefixes[i]. Their caches are copied (Cache.cat), so a caller's Prefix stays reusable.
    Returns (cache holding every row in `prompts` order, logits at each row's last prompt token (B, V))."""
    if prefixes is None:
        cache = model.new_cache(len(prompts), cache_len, device=device)
    else:
        cache = type(prefixes[0].cache).cat([pf.cache.resized(cache_len) for pf in prefixes])
    last_logits = []
    # Micro-batches: consecutive prompts (they ascend in length) within the token budget and padding bound
    for start, end in row_groups([len(p) for p in prompts], max_padding, max_tokens=token_budget):
        rows = prompts[start:end]
        T = len(rows[-1])
        ids = torch.zeros(len(rows), T, dtype=torch.long)  # right padding with id 0: causal attention
        for r, p in enumerate(rows):                          # never lets a real token see a pad
            ids[r, : len(p)] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in rows], device=device)
        # last_only: the lm_head runs only at each row's last real token, the one that predicts token 1;
        # cache.rows: views, so the forward fills these rows of the one cache in place
        logits = model(ids.to(device), cache=cache.rows(start, end), lengths=lengths, last_only=True)[:, -1]
        last_logits.append(logits.float())
    return cache, torch.cat(last_logits, dim=0)


# ----------------------------------------------------------------------------------------------
# generate: check, prefill every prompt, then decode all rows together until each has finished


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_token_ids=(),
    seed: int | None = None,
    prefill_token_budget: int | None = None,  # padded tokens per prefill micro-batch; None: 1024 on CPU
                                               # (activations stay in cache: ~10% faster), 4096 on GPU
    sync_every: int | None = None,     # decode steps between host read-backs; None: 1 on CPU, 8 on CUDA
    prefixes: list | None = None,      # per prompt: a Prefix of it from an earlier call, or None
    keep_prefix: bool = False,         # return each row's state in Completion.prefix, to continue it later
    cache_len: int | None = None,      # min cache slots per row (default: longest prompt + max_new_tokens, rounded up)
) -> list[Completion]:
    """Generate a completion for every prompt (a list of token ids; prompts may differ in length).

    max_new_tokens: one int for all prompts, or one per prompt. Returns one Completion per prompt, in order.
    Multi-turn use: with keep_prefix=True each Completion carries a Prefix; pass it (in `prefixes`)
    with the next, longer prompt that starts with prompt + completion, and only the new tokens are
    prefilled. Saved caches grow as needed (Cache.resized), so a long conversation never reserves
    the whole context up front."""
    max_new = _check_inputs(model, prompts, max_new_tokens, temperature, top_p)
    # transposed weight copies for the decode steps of this call only, dropped on return (model.Linear)
    with transposed_weights(model):
        stop = {int(t) for t in stop_token_ids}
        device = next(model.parameters()).device
        prefixes = list(prefixes) if prefixes is not None else [None] * len(prompts)
        assert len(prefixes) == len(prompts), f"{len(prefixes)} prefixes for {len(prompts)} prompts"
        for i, pf in enumerate(prefixes):
            if pf is not None and not 0 < pf.num_tokens < len(prompts[i]):
                raise ValueError(f"prefix {i} holds {pf.num_tokens} tokens: the prompt ({len(prompts[i])} tokens) "
                                 f"must extend it")
        if sync_every is None:
            sync_every = 1 if device.type == "cpu" else 8
        if prefill_token_budget is None:
            prefill_token_budget = 1024 if device.type == "cpu" else 4096
        if keep_prefix:
            # the saved state must stop exactly at the last kept token: a DeltaNet state cannot be rewound
            # past tokens that were sampled after a stop token and fed through the model
            sync_every = 1
        assert sync_every >= 1, f"sync_every must be >= 1, got {sync_every}"
        # seed=None still goes through torch's global RNG, so torch.manual_seed() makes runs repeatable
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=device).manual_seed(seed)

        cache, logits, live = _prefill_all(model, prompts, prefixes, max_new, cache_len, prefill_token_budget,
                                           device)

        # decode: all live rows advance together, so they share the count of generated tokens
        outs = [Completion() for _ in prompts]
        num_generated = 0
        pending_tokens, pending_logprobs = [], []  # (B_live,) device tensors not yet read on the host
        while True:
            tokens, logprobs = sample(logits, temperature, top_p, generator)  # (B,), (B,)
            pending_tokens.append(tokens)
            pending_logprobs.append(logprobs)
            num_generated += 1
            # forced read-back on the step where the first live row reaches its length limit, so no row
            # ever writes past its slot in the cache
            if len(pending_tokens) == sync_every or num_generated == min(max_new[i] for i in live):
                keep = _finish_rows(outs, live, pending_tokens, pending_logprobs, prompts, max_new, stop,
                                    cache if keep_prefix else None)
                pending_tokens, pending_logprobs = [], []
                if not keep:
                    break
                if len(keep) < len(live):  # drop finished rows from the batch and the cache
                    idx = torch.tensor(keep, device=device)
                    cache.select(idx)
                    tokens = tokens[idx]
                    live = [live[row] for row in keep]
            logits = model(tokens[:, None], cache=cache)[:, -1].float()  # (B, V)
        return outs


def _prefill_all(model, prompts, prefixes, max_new, cache_len, token_budget, device):
    """Prefill every prompt into one cache: fresh prompts shortest first, so each micro-batch holds
    prompts of similar length, then those continuing a saved prefix, which prefill only their new
    tokens. Returns (cache, logits at each row's last prompt token (B, V), the prompt index of each
    cache row)."""
    need = max(len(p) + m for p, m in zip(prompts, max_new))   # the longest any row can grow
    # one slot count for the whole batch (rows are concatenated): at least what any row needs and
    # any saved cache holds, rounded up to 256 so a growing conversation rarely reallocates
    saved = max((pf.cache.max_seq_len for pf in prefixes if pf is not None), default=0)
    cache_len = max(cache_len or 0, saved, -(-need // 256) * 256)
    fresh = sorted((i for i in range(len(prompts)) if prefixes[i] is None), key=lambda i: len(prompts[i]))
    cont = sorted((i for i in range(len(prompts)) if prefixes[i] is not None),
                  key=lambda i: len(prompts[i]) - prefixes[i].num_tokens)
    parts = []
    if fresh:
        parts.append(prefill(model, [list(prompts[i]) for i in fresh], cache_len, token_budget, device))
    if cont:
        parts.append(prefill(model, [list(prompts[i][prefixes[i].num_tokens:]) for i in cont], cache_len,
                             token_budget, device, prefixes=[prefixes[i] for i in cont]))
    cache = parts[0][0] if len(parts) == 1 else type(parts[0][0]).cat([p[0] for p in parts])
    return cache, torch.cat([p[1] for p in parts], dim=0), fresh + cont


def _finish_rows(outs, live, pending_tokens, pending_logprobs, prompts, max_new, stop, cache=None) -> list[int]:
    """Read the pending decode steps back to the host (one sync) and append them to each live row's
    Completion, up to its stop token or its length limit. live: the prompt index of each cache row.
    cache: given (keep_prefix), a finished row keeps a copy of its state in Completion.prefix.
    Returns the cache rows that go on decoding."""
    block_tokens = torch.stack(pending_tokens, dim=1).tolist()  # (B, k) host sync
    block_logprobs = torch.stack(pending_logprobs, dim=1).tolist()
    keep = []
    for row, i in enumerate(live):
        out, done = outs[i], False
        for t, lp in zip(block_tokens[row], block_logprobs[row]):
            out.tokens.append(t)
            out.logprobs.append(lp)
            if t in stop:
                out.finish_reason, done = "stop", True
                break  # tokens sampled after the stop token (sync_every > 1) are discarded
            if len(out.tokens) == max_new[i]:
                out.finish_reason, done = "length", True
                break
        if not done:
            keep.append(row)
        elif cache is not None:   # the cache holds prompt + tokens[:-1]: the last token was never fed
            out.prefix = Prefix(cache.take([row]), len(prompts[i]) + len(out.tokens) - 1)
    return keep
