"""Engine benchmark: our generate() against transformers' generate(), same weights, same prompts, one process.

    python bench.py engine                          # CPU fp32: ~30M Qwen3, ~30M Qwen3.5, SmolLM2-135M; batch 8, 32
    python bench.py engine --quick                  # small version (batch 8, prompts 32-128, 32 new tokens)
    python bench.py engine --device cuda --check    # GPU: flash-attn vs SDPA check (bf16), then the table

Both engines decode greedily with no stop token, so every row produces exactly --new-tokens tokens;
tok/s = new tokens / wall time of the whole call (prefill included; best of --repeats interleaved runs).
Prompts are ragged (uniform lengths in [--min-prompt, --max-prompt]); transformers gets them left-padded
with an attention mask, as its docs ask. The ~30M models have random weights built from Hugging Face
configs and saved with save_pretrained, so each side loads the same checkpoint. Timings drift ~30%
between runs on a shared CPU: read the ratio. "same tokens" is the fraction of rows where both engines
produced identical tokens (ragged batching and padding change fp rounding, so a near-tie can flip; in
bf16 on GPU expect fewer).
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch

import model as M
from generate import generate, prefill

# ~30M-parameter configs (vocab 8192, tied embeddings): hidden 512, 8 layers
QWEN3_30M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                 max_position_embeddings=4096)
QWEN3_5_30M = dict(QWEN3_30M, intermediate_size=1280, linear_num_key_heads=8, linear_num_value_heads=8,
                   linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                   + ["full_attention"])


def parse(args: list[str]):
    p = argparse.ArgumentParser(prog="bench.py engine", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--check", action="store_true", help="CUDA: compare flash-attn against SDPA first")
    p.add_argument("--models", default="qwen3,qwen3_5,smollm2", help="comma list of qwen3, qwen3_5, smollm2")
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="batch 8, prompts 32-128, 32 new tokens")
    p.add_argument("--repeats", type=int, default=1, help="runs per engine, interleaved; the best is kept")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); 1 is "
                   "steadier on a shared, overloaded CPU")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: this process's CPU time "
                   "instead of wall time; steadier on a shared CPU (use with --threads 1; CPU device only)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(args)
    if a.quick:
        a.batch_sizes, a.max_prompt, a.new_tokens = "8", 128, 32
    a.models = [m for m in a.models.split(",") if m]
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    for m in a.models:
        assert m in ("qwen3", "qwen3_5", "smollm2"), f"unknown model {m!r}: use qwen3, qwen3_5, smollm2"
    assert a.min_prompt >= 1 and a.max_prompt >= a.min_prompt, "need 1 <= --min-prompt <= --max-prompt"
    if a.device == "cuda":
        assert torch.cuda.is_available(), "--device cuda but torch sees no GPU"
        if importlib.util.find_spec("flash_attn") is None:
            raise SystemExit("--device cuda runs our engine with flash-attn: pip install -r requirements-gpu.txt")
    elif a.check:
        raise SystemExit("--check compares flash-attn with SDPA and needs --device cuda")
    assert a.clock == "wall" or a.device == "cpu", "--clock cpu measures CPU time: CPU device only"
    return a


# --- models -------------------------------------------------------------------------------------------


def build_pair(name: str, device: str, dtype: torch.dtype, workdir: str):
    """(ours, transformers) models holding the same weights, both on `device` in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    path = f"{workdir}/{name}"
    if name == "smollm2":
        M.save(M.load("smollm2"), M.load_tokenizer("smollm2"), path)  # HF-format copy transformers can read
    else:
        config = Qwen3Config(**QWEN3_30M) if name == "qwen3" else Qwen3_5TextConfig(**QWEN3_5_30M)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    ours = M.load(path, dtype=dtype, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # random weights may emit EOS: never stop early
    return ours, hf


def ragged_prompts(batch: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# --- the two engines ----------------------------------------------------------------------------------


CLOCK = time.perf_counter  # bench_engine() switches it to time.process_time for --clock cpu


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_ours(model, prompts, new_tokens, device):
    _sync(device)
    t0 = CLOCK()
    outs = generate(model, prompts, max_new_tokens=new_tokens, temperature=0)
    _sync(device)
    return [o.tokens for o in outs], CLOCK() - t0


@torch.inference_mode()
def run_hf(hf, prompts, new_tokens, device):
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)  # (B, T) left padded
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    _sync(device)
    t0 = CLOCK()
    out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(device)
    return out[:, T:].tolist(), CLOCK() - t0


# --- GPU check: flash-attn against SDPA -------------------------------------------------------------


@torch.inference_mode()
def cached_logits(model, prompts, completions):
    """Teacher-forced logits through the cache (B, 1 + n, V): prefill, then the given tokens one by one."""
    device = next(model.parameters()).device
    n = len(completions[0])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    cache, last = prefill(model, [prompts[i] for i in order], max(len(p) for p in prompts) + n, 4096, device)
    forced = torch.tensor([completions[i] for i in order], device=device)  # (B, n)
    steps = [last]
    for k in range(n - 1):
        steps.append(model(forced[:, k : k + 1], cache=cache)[:, -1].float())
    logits = torch.stack(steps, dim=1)  # (B, n, V) in length order
    return logits[torch.argsort(torch.tensor(order, device=device))]


def check_flash(name, ours, prompts, new_tokens):
    """Compare attn_impl="flash" with "sdpa" on one bf16 model: no-cache logits, cached (prefill + decode)
    logits on the same token stream, and greedy tokens. Returns True when within bf16 tolerance."""
    device = next(ours.parameters()).device
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
    valid = torch.arange(T, device=device)[None, :] < torch.tensor([len(p) for p in prompts], device=device)[:, None]
    res = {}
    for impl in ("sdpa", "flash"):
        ours.attn_impl = impl
        with torch.inference_mode():
            full = ours(ids).float()[valid]  # (num real tokens, V): pads after a row's end are ignored
        tokens, _ = run_ours(ours, prompts, new_tokens, device.type)
        res[impl] = (full, tokens)
    ours.attn_impl = "sdpa"
    ref_tokens = res["sdpa"][1]
    cached = {}
    for impl in ("sdpa", "flash"):
        ours.attn_impl = impl
        cached[impl] = cached_logits(ours, prompts, ref_tokens)
    ours.attn_impl = "flash"
    scale = res["sdpa"][0].abs().max().item()
    full_diff = (res["flash"][0] - res["sdpa"][0]).abs().max().item() / scale
    cache_diff = (cached["flash"] - cached["sdpa"]).abs().max().item() / scale
    argmax_agree = (cached["flash"].argmax(-1) == cached["sdpa"].argmax(-1)).float().mean().item()
    same_rows = sum(a == b for a, b in zip(res["flash"][1], res["sdpa"][1])) / len(prompts)
    ok = full_diff < 3e-2 and cache_diff < 3e-2 and argmax_agree > 0.97
    print(f"| {name} | {full_diff:.2e} | {cache_diff:.2e} | {argmax_agree:.3f} | {same_rows:.2f} | "
          f"{'PASS' if ok else 'FAIL'} |")
    return ok


# --- main -------------------------------------------------------------------------------------------


def bench_engine(args: list[str]) -> None:
    a = parse(args)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    if a.threads:
        torch.set_num_threads(a.threads)
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    print(f"engine benchmark: device {a.device} ({dtype}), threads {torch.get_num_threads()}, {a.clock} clock, "
          f"prompts {a.min_prompt}-{a.max_prompt} tokens, {a.new_tokens} new tokens, greedy\n")
    with tempfile.TemporaryDirectory() as workdir:
        pairs = {}
        for name in a.models:
            pairs[name] = build_pair(name, a.device, dtype, workdir)
            if a.device == "cuda":
                pairs[name][0].attn_impl = "flash"
        if a.check:
            print("flash-attn vs SDPA (bf16; diffs are max |Δlogit| / max |logit|)\n")
            print("| model | no-cache logits | cached logits | cached argmax agree | same greedy rows | check |")
            print("|---|---|---|---|---|---|")
            oks = [check_flash(name, pairs[name][0], ragged_prompts(8, a.min_prompt, a.max_prompt,
                   pairs[name][0].config.vocab_size, a.seed), min(a.new_tokens, 64)) for name in a.models]
            print(f"\nflash-attn check: {'PASS' if all(oks) else 'FAIL'}\n")
        print("| model | params | batch | our tok/s | transformers tok/s | ratio | same tokens |")
        print("|---|---|---|---|---|---|---|")
        for name in a.models:
            ours, hf = pairs[name]
            params = sum(p.numel() for p in ours.parameters()) / 1e6
            warm = ragged_prompts(2, 8, 16, ours.config.vocab_size, a.seed + 1)  # first-call overheads
            run_ours(ours, warm, 4, a.device)
            run_hf(hf, warm, 4, a.device)
            for batch in a.batch_sizes:
                prompts = ragged_prompts(batch, a.min_prompt, a.max_prompt, ours.config.vocab_size, a.seed)
                our_s = hf_s = float("inf")
                for r in range(a.repeats):  # interleaved (ABBA...) so slow drift in machine load hits both
                    for engine in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                        if engine == "ours":
                            our_tokens, s = run_ours(ours, prompts, a.new_tokens, a.device)
                            our_s = min(our_s, s)
                        else:
                            hf_tokens, s = run_hf(hf, prompts, a.new_tokens, a.device)
                            hf_s = min(hf_s, s)
                n = batch * a.new_tokens
                same = sum(x == y for x, y in zip(our_tokens, hf_tokens)) / batch
                print(f"| {name} | {params:.0f}M | {batch} | {n / our_s:.0f} | {n / hf_s:.0f} | "
                      f"{hf_s / our_s:.2f}x | {same:.2f} |", flush=True)
            del pairs[name]


if __name__ == "__main__":
    import sys

    bench_engine(sys.argv[1:])
