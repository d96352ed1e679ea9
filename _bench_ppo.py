"""Learner benchmark: our model's forward+backward against transformers' model on the same batch and the
same weights, in one process, plus one full `Learner.update` (PPO loss, KL, entropy log, AdamW step).

    python bench.py ppo                       # CPU fp32: ~30M Qwen3 and Qwen3.5, batch 4 x 256 tokens
    python bench.py ppo --quick               # ~8M models, batch 4 x 128
    python bench.py ppo --device cuda         # bf16 autocast; also MFU = 6 N tokens/s / peak bf16 FLOP/s

tokens/s = batch tokens / median wall time of --steps timed steps (after one warm-up; ours and
transformers' steps interleaved). A step is forward + next-token cross-entropy + backward, no gradient
checkpointing, on both sides; the Learner row adds what one PPO update costs on top (checkpointed layers, logprob/entropy/KL terms, clip, AdamW).
Models have random weights from Hugging Face configs saved with save_pretrained, so both sides load the
same checkpoint. Timings drift ~30% between runs on a shared CPU: read the ratio column.
MFU counts 6 x parameters x tokens (attention FLOPs left out, as nanoGPT's simple estimate does).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

import model as M
from ppo import Learner, make_batch

# ~30M parameters (vocab 8192, tied embeddings): hidden 512, 8 layers; --quick: hidden 256, 4 layers
BASE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096)
QUICK = dict(BASE, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40": 181e12, "A10": 125e12}


def hf_config(arch: str, base: dict):
    import transformers
    if arch == "qwen3":
        return transformers.Qwen3Config(**base)
    L = base["num_hidden_layers"]
    return transformers.Qwen3_5TextConfig(
        **base, linear_num_key_heads=base["num_attention_heads"], linear_num_value_heads=base["num_attention_heads"],
        linear_key_head_dim=base["head_dim"], linear_value_head_dim=base["head_dim"], linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (L // 4))


def parse(args: list[str]):
    p = argparse.ArgumentParser(prog="bench.py ppo", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", default="qwen3,qwen3_5", help="comma list of qwen3, qwen3_5")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--quick", action="store_true", help="~8M models, batch 4 x 128")
    a = p.parse_args(args)
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        assert m in ("qwen3", "qwen3_5"), f"unknown model {m!r}: use qwen3, qwen3_5"
    if a.quick:
        a.seq = min(a.seq, 128)
    assert a.batch >= 1 and a.seq >= 2 and a.steps >= 1, "need --batch >= 1, --seq >= 2, --steps >= 1"
    if a.device == "cuda":
        assert torch.cuda.is_available(), "--device cuda but torch sees no GPU"
    return a


def _time(fns, steps: int, device) -> list[float]:
    """Median seconds per call of each fn, calls interleaved (a, b, a, b, ...) so that load drift on a
    shared machine hits every side alike; one warm-up call each first."""
    times = [[] for _ in fns]
    for k in range(steps + 1):
        for fn, ts in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if k > 0:                          # k = 0: warm-up (allocator, kernels, lazy inits)
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _fwd_bwd(model, tokens, hf: bool, autocast):
    def step():
        with autocast():
            out = model(tokens)
            logits = out.logits if hf else out                           # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def bench_ppo(args: list[str]) -> None:
    from transformers import AutoModelForCausalLM
    a = parse(args)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
    B, T = a.batch, a.seq
    ntok = B * T
    rows = []
    for arch in a.models:
        torch.manual_seed(0)
        cfg = hf_config(arch, QUICK if a.quick else BASE)
        with tempfile.TemporaryDirectory() as d:
            AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
            hf = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa").to(dev).train()
            ours = M.load(d, device=a.device).train()
        n_params = sum(p.numel() for p in ours.parameters())
        tokens = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
        t_ours, t_hf = _time([_fwd_bwd(ours, tokens, False, autocast), _fwd_bwd(hf, tokens, True, autocast)],
                             a.steps, dev)
        del hf
        # one PPO update on the same tokens: the second half of each row is the "reply"
        learner = Learner(ours, ref_model=None, lr=1e-6, micro_batch_tokens=ntok, generation_copy=False)
        toks = tokens.tolist()
        mask = [[0] * (T // 2) + [1] * (T - T // 2) for _ in range(B)]
        batch = make_batch(toks, mask, [[-5.0 * m for m in r] for r in mask], [1.0, -1.0] * (B // 2) + [1.0] * (B % 2))

        def update():
            batch.versions[:] = learner.version
            learner.update(batch)
        (t_upd,) = _time([update], a.steps, dev)
        mfu = lambda t: f"{6 * n_params * ntok / t / peak:.1%}" if peak else "-"           # noqa: E731
        rows.append((arch, f"{n_params / 1e6:.1f}M", ntok / t_ours, ntok / t_hf, t_hf / t_ours, ntok / t_upd,
                     mfu(t_ours), mfu(t_hf), mfu(t_upd)))
        del learner, ours

    dtype = "bf16 autocast" if cuda else "fp32"
    print(f"\n### Learner: forward+backward tokens/s, ours vs transformers ({a.device}, {dtype}, batch {B} x {T})\n")
    print("| model | params | ours tok/s | transformers tok/s | ours / transformers | Learner.update tok/s "
          "| MFU ours | MFU transformers | MFU update |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,.0f} | {r[3]:,.0f} | {r[4]:.2f}x | {r[5]:,.0f} | {r[6]} | {r[7]} | {r[8]} |")
    if cuda and peak is None:
        print(f"\n(MFU: unknown peak bf16 FLOP/s for {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    import sys
    bench_ppo(sys.argv[1:])
