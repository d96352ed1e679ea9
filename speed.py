"""Component speed benchmarks: each prints a markdown table of ratios against a baseline timed side
by side in the same process (on a shared CPU absolute timings drift ~30% between runs, ratios much
less). The gain tables (cumulative reward and gain on test streams) and RIME's ablations are bench.py.

    python speed.py engine    our KV-cache engine vs transformers' generate (--breakdown, --repeats, --device cuda --check)
    python speed.py sandbox   Sandbox.run overhead vs a bare subprocess
    python speed.py envs      environment steps/s, codebase reset and grading times
    python speed.py ppo       learner forward+backward tokens/s vs transformers
    python speed.py camg      CAMG-RL updates/s with 0, 1, 2 rollout workers

`python speed.py NAME --help` lists a benchmark's flags; its function's docstring says what it measures.
`python bench.py NAME ...` still runs the same benchmark (bench.py hands it to this program).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import cli
from benchutil import flags, md_table

HERE = Path(__file__).resolve().parent

def interleaved_runs(fns, repeats: int, sync=lambda: None, warmup: bool = True, clock=time.perf_counter) -> list:
    """Seconds of every timed call of each fn: [[t_1, ..., t_repeats] per fn]. Calls are interleaved, in
    ABBA order, so that drift in the machine's load hits every side alike; an untimed warm-up call each
    first (allocator, kernels, lazy inits). clock=time.process_time counts this process's CPU time:
    steadier on a shared CPU."""
    times = [[] for _ in fns]
    for k in range(repeats + warmup):
        for i in (range(len(fns)) if k % 2 == 0 else reversed(range(len(fns)))):
            sync()
            t0 = clock()
            fns[i]()
            sync()
            if k or not warmup:
                times[i].append(clock() - t0)
    return times


def interleaved_times(fns, repeats: int, sync=lambda: None, warmup: bool = True, clock=time.perf_counter) -> list:
    """(best, median) seconds per call of each fn, timed by interleaved_runs."""
    return [(min(ts), statistics.median(ts)) for ts in interleaved_runs(fns, repeats, sync, warmup, clock)]


def hf_config(arch: str, quick: bool = False):
    """Random-weight HF configs: ~30M parameters (vocab 8192, tied, hidden 512, 8 layers) or, quick, ~8M."""
    import transformers
    c = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096)
    if quick:
        c.update(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    if arch == "qwen3":
        return transformers.Qwen3Config(**c)
    c["intermediate_size"] = c["intermediate_size"] * 5 // 6  # 1280 (640): the DeltaNet layers are larger
    return transformers.Qwen3_5TextConfig(
        **c, linear_num_key_heads=c["num_attention_heads"], linear_num_value_heads=c["num_attention_heads"],
        linear_key_head_dim=c["head_dim"], linear_value_head_dim=c["head_dim"], linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (c["num_hidden_layers"] // 4))


def model_pair(name: str, device: str, dtype, workdir: str, quick: bool = False, train: bool = False):
    """(ours, transformers) holding the same weights: one checkpoint saved, then loaded by both."""
    import torch
    from transformers import AutoModelForCausalLM
    import model as M
    path = f"{workdir}/{name}"
    if name == "smollm2":
        M.save(M.load("smollm2"), M.load_tokenizer("smollm2"), path)  # an HF-format copy transformers reads
    else:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf_config(name, quick)).save_pretrained(path)
    ours = M.load(path, dtype=dtype, device=device).train(train)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).train(train)
    hf.generation_config.eos_token_id = None  # random weights may emit EOS: never stop early
    return ours, hf


def ragged_prompts(batch: int, lo: int, hi: int, vocab: int, seed: int) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist()
            for n in torch.randint(lo, hi + 1, (batch,), generator=g).tolist()]


def check_flash(name, ours, prompts, new_tokens):
    """attn_impl "flash" vs "sdpa" on one bf16 model: no-cache logits, cached logits (prefill, then the
    sdpa greedy tokens fed one by one) and greedy tokens. -> (table row, within bf16 tolerance)."""
    import torch
    from generate import generate, prefill
    dev = next(ours.parameters()).device
    T, n = max(map(len, prompts)), new_tokens
    ids = torch.tensor([q + [0] * (T - len(q)) for q in prompts], device=dev)  # (B, T) right padded
    valid = torch.arange(T, device=dev)[None] < torch.tensor([len(q) for q in prompts], device=dev)[:, None]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    full, tokens, cached = {}, {}, {}
    for impl in ("sdpa", "flash"):
        ours.attn_impl = impl
        with torch.inference_mode():
            full[impl] = ours(ids).float()[valid]  # (real tokens, V): pads after a row's end are ignored
        tokens[impl] = [o.tokens for o in generate(ours, prompts, max_new_tokens=n, temperature=0)]
    for impl in ("sdpa", "flash"):
        ours.attn_impl = impl
        with torch.inference_mode():
            cache, last = prefill(ours, [prompts[i] for i in order], T + n, 4096, dev)
            forced = torch.tensor([tokens["sdpa"][i] for i in order], device=dev)  # (B, n)
            steps = [last] + [ours(forced[:, k: k + 1], cache=cache)[:, -1].float() for k in range(n - 1)]
        cached[impl] = torch.stack(steps, dim=1)  # (B, n, V), rows in length order for both
    ours.attn_impl = "flash"
    scale = full["sdpa"].abs().max().item()
    full_diff = (full["flash"] - full["sdpa"]).abs().max().item() / scale
    cache_diff = (cached["flash"] - cached["sdpa"]).abs().max().item() / scale
    agree = (cached["flash"].argmax(-1) == cached["sdpa"].argmax(-1)).float().mean().item()
    same = sum(a == b for a, b in zip(tokens["flash"], tokens["sdpa"])) / len(prompts)
    ok = full_diff < 3e-2 and cache_diff < 3e-2 and agree > 0.97
    return [name, f"{full_diff:.2e}", f"{cache_diff:.2e}", f"{agree:.3f}", f"{same:.2f}", "PASS" if ok else "FAIL"], ok


def bench_engine(args: list) -> None:
    """Our generate() against transformers' generate(): same weights, same ragged prompts, greedy with no
    stop token (every row makes exactly --new-tokens tokens); tok/s = new tokens / wall time, prefill
    included; transformers gets left-padded prompts and an attention mask. "same tokens" = rows where
    both agree (padding changes fp rounding, so a near-tie may flip; fewer in bf16). --repeats N: timed
    runs per engine (default 3), interleaved in ABBA order; the table gives the median tok/s and the median
    of the per-repeat ratios with their spread (min-max); --threads 1 --clock cpu: steadier on a shared CPU.
    --breakdown: a second table of where the time goes: prefill s and decode ms/step of both engines,
    and the part of our decode step spent in the weight matmuls alone (both engines must run them: on a
    CPU they bound how far any engine can get ahead at small batch).
        python speed.py engine [--quick] [--models qwen3,qwen3_5,smollm2] [--batch-sizes 8,32] [--new-tokens 128]
        python speed.py engine --device cuda --check     # flash-attn vs SDPA (bf16) first"""
    import importlib.util
    import tempfile
    import torch
    from generate import generate
    a = flags(args, "speed.py engine", device=("cpu", "cuda"), check=False, models="qwen3,qwen3_5,smollm2",
              batch_sizes="8,32", min_prompt=32, max_prompt=512, new_tokens=128, quick=False, repeats=3,
              threads=0, clock=("wall", "cpu"), seed=0, breakdown=False)
    if a.quick:
        a.batch_sizes, a.max_prompt, a.new_tokens = "8", 128, 32
    models = [m for m in a.models.split(",") if m]
    if set(models) - {"qwen3", "qwen3_5", "smollm2"} or not 1 <= a.min_prompt <= a.max_prompt or a.repeats < 1:
        cli.fail("speed.py engine", "--models takes qwen3,qwen3_5,smollm2; need 1 <= --min-prompt <= --max-prompt")
    if a.device == "cuda" and (not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None):
        cli.fail("speed.py engine", "--device cuda needs a GPU and flash-attn: pip install -r requirements-gpu.txt")
    if a.device != "cuda" and a.check or a.device != "cpu" and a.clock == "cpu":
        cli.fail("speed.py engine", "--check (flash-attn vs SDPA) needs --device cuda; --clock cpu measures CPU time: "
                 "CPU only")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter

    def ours_run(model, prompts, n):
        return [o.tokens for o in generate(model, prompts, max_new_tokens=n, temperature=0)]

    @torch.inference_mode()
    def hf_run(hf, prompts, n):
        T = max(map(len, prompts))
        ids = torch.tensor([[0] * (T - len(q)) + q for q in prompts], device=a.device)  # (B, T) left padded
        mask = torch.tensor([[0] * (T - len(q)) + [1] * len(q) for q in prompts], device=a.device)
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[:, T:].tolist()

    print(f"engine: device {a.device} ({dtype}), threads {torch.get_num_threads()}, {a.clock} clock, prompts "
          f"{a.min_prompt}-{a.max_prompt} tokens, {a.new_tokens} new tokens, greedy\n", flush=True)
    header = ["model", "params", "batch", "our tok/s", "transformers tok/s", f"ratio (median of {a.repeats})",
              "ratio spread", "same tokens"]
    checks, rows, parts = [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for name in models:
            ours, hf = model_pair(name, a.device, dtype, workdir)
            if a.device == "cuda":
                ours.attn_impl = "flash"
            if a.check:
                prompts = ragged_prompts(8, a.min_prompt, a.max_prompt, ours.config.vocab_size, a.seed)
                checks.append(check_flash(name, ours, prompts, min(a.new_tokens, 64)))
            warm = ragged_prompts(2, 8, 16, ours.config.vocab_size, a.seed + 1)  # first-call overheads
            ours_run(ours, warm, 4), hf_run(hf, warm, 4)
            for batch in [int(b) for b in a.batch_sizes.split(",")]:
                prompts = ragged_prompts(batch, a.min_prompt, a.max_prompt, ours.config.vocab_size, a.seed)
                out = {}
                our_t, hf_t = interleaved_runs(
                    [lambda: out.update(ours=ours_run(ours, prompts, a.new_tokens)),
                     lambda: out.update(hf=hf_run(hf, prompts, a.new_tokens))], a.repeats, sync, warmup=False,
                    clock=clock)
                ratios = [h / o for o, h in zip(our_t, hf_t)]     # each repeat's pair ran back to back
                n = batch * a.new_tokens
                same = sum(x == y for x, y in zip(out["ours"], out["hf"])) / batch
                rows.append([name, f"{sum(p.numel() for p in ours.parameters()) / 1e6:.0f}M", batch,
                             f"{n / statistics.median(our_t):.0f}", f"{n / statistics.median(hf_t):.0f}",
                             f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x",
                             f"{same:.2f}"])
                print(md_table(header, rows[-1:]).splitlines()[-1], flush=True)  # progress: the table comes last
                if a.breakdown:
                    parts.append([name, batch] + engine_breakdown(ours, hf, prompts, a.new_tokens, ours_run, hf_run,
                                                                  sync, clock))
            del ours, hf
    if checks:
        print("\nflash-attn vs SDPA (bf16; diffs are max |Δlogit| / max |logit|)\n")
        print(md_table(["model", "no-cache logits", "cached logits", "cached argmax agree", "same greedy rows",
                        "check"], [r for r, _ in checks]))
        print(f"\nflash-attn check: {'PASS' if all(ok for _, ok in checks) else 'FAIL'}")
    print("\n" + md_table(header, rows))
    if parts:
        print("\nwhere the time goes (decode = (time for 1 + k tokens - time for 1) / k; ceiling = the ratio if "
              "our decode step were its weight matmuls alone)\n")
        print(md_table(["model", "batch", "our prefill s", "transformers prefill s", "our decode ms/step",
                        "transformers decode ms/step", "our weight matmuls ms/step", "ceiling"], parts))


def engine_breakdown(ours, hf, prompts, new_tokens, ours_run, hf_run, sync, clock, k=32) -> list:
    """Prefill and per-step decode times of both engines, and of our weight matmuls alone (every Linear
    once on a batch-sized input, under inference_mode as in generation): one row of the breakdown table."""
    import torch

    def best(fn, repeats=2):  # the timed runs before this one warmed both engines up
        return interleaved_times([fn], repeats, sync, warmup=False, clock=clock)[0][0]

    our_prefill, hf_prefill = best(lambda: ours_run(ours, prompts, 1)), best(lambda: hf_run(hf, prompts, 1))
    our_step = (best(lambda: ours_run(ours, prompts, 1 + k)) - our_prefill) / k
    hf_step = (best(lambda: hf_run(hf, prompts, 1 + k)) - hf_prefill) / k
    linears = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    p = next(ours.parameters())
    inputs = [torch.randn(len(prompts), m.in_features, device=p.device, dtype=p.dtype) for m in linears]

    @torch.inference_mode()
    def matmuls():
        for m, x in zip(linears, inputs):
            m(x)
    import model as M
    with M.transposed_weights(ours):     # generate's decode path multiplies by transposed copies
        gemm = best(matmuls, repeats=10)
    hf_total, ceiling_total = hf_prefill + new_tokens * hf_step, our_prefill + new_tokens * gemm
    return [f"{our_prefill:.2f}", f"{hf_prefill:.2f}", f"{our_step * 1e3:.1f}", f"{hf_step * 1e3:.1f}",
            f"{gemm * 1e3:.1f}", f"{hf_total / ceiling_total:.2f}x"]


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40": 181e12, "A10": 125e12}


def bench_ppo(args: list) -> None:
    """Learner speed: our model's forward+backward against transformers' on the same batch and weights
    (next-token cross-entropy, no checkpointing, both sides), plus one full `Learner.update` (checkpointed
    layers, PPO loss, KL, entropy, AdamW). tokens/s = batch tokens / median of --steps timed steps. On
    CUDA: bf16 autocast and MFU = 6 x params x tokens/s / peak bf16 FLOP/s (attention FLOPs left out).
        python speed.py ppo [--quick (~8M models, seq <= 128)] [--device cuda] [--batch 4] [--seq 256] [--steps 3]"""
    import tempfile
    from contextlib import nullcontext
    import torch
    import torch.nn.functional as F
    from ppo import Learner, make_batch
    a = flags(args, "speed.py ppo", device=("cpu", "cuda"), models="qwen3,qwen3_5", batch=4, seq=256, steps=3, quick=False)
    models = [m for m in a.models.split(",") if m]
    B, T = a.batch, min(a.seq, 128) if a.quick else a.seq
    if set(models) - {"qwen3", "qwen3_5"} or B < 1 or T < 2 or a.steps < 1:
        cli.fail("speed.py ppo", "--models takes qwen3,qwen3_5; need --batch >= 1, --seq >= 2, --steps >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        cli.fail("speed.py ppo", "--device cuda but torch sees no GPU")
    cuda = a.device == "cuda"
    dev = torch.device(a.device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
    rows = []
    for arch in models:
        with tempfile.TemporaryDirectory() as d:
            ours, hf = model_pair(arch, a.device, torch.float32, d, quick=a.quick, train=True)
        tokens = torch.randint(0, ours.config.vocab_size, (B, T), device=dev)

        def fwd_bwd(model, is_hf):
            def step():
                with autocast():
                    out = model(tokens)
                    logits = out.logits if is_hf else out  # (B, T, V)
                F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
                model.zero_grad(set_to_none=True)
            return step
        (_, t_ours), (_, t_hf) = interleaved_times([fwd_bwd(ours, False), fwd_bwd(hf, True)], a.steps, sync)
        del hf
        # one PPO update on the same tokens; the second half of each row plays the policy's reply
        learner = Learner(ours, ref_model=None, lr=1e-6, micro_batch_tokens=B * T, generation_copy=False)
        mask = [[0] * (T // 2) + [1] * (T - T // 2) for _ in range(B)]
        batch = make_batch(tokens.tolist(), mask, [[-5.0 * m for m in r] for r in mask],
                           [1.0, -1.0] * (B // 2) + [1.0] * (B % 2))

        def update():
            batch.versions[:] = learner.version
            learner.update(batch)
        ((_, t_upd),) = interleaved_times([update], a.steps, sync)
        n = sum(q.numel() for q in ours.parameters())
        mfu = [f"{6 * n * B * T / t / peak:.1%}" if peak else "-" for t in (t_ours, t_hf, t_upd)]
        rows.append([arch, f"{n / 1e6:.1f}M", f"{B * T / t_ours:,.0f}", f"{B * T / t_hf:,.0f}",
                     f"{t_hf / t_ours:.2f}x", f"{B * T / t_upd:,.0f}"] + mfu)
        del learner, ours
    print(f"\nLearner: forward+backward tokens/s, ours vs transformers ({a.device}, "
          f"{'bf16 autocast' if cuda else 'fp32'}, batch {B} x {T})\n")
    print(md_table(["model", "params", "ours tok/s", "transformers tok/s", "ours / transformers",
                    "Learner.update tok/s", "MFU ours", "MFU transformers", "MFU update"], rows))


def bench_sandbox(args: list) -> None:
    """The cost of a sandboxed command against a bare subprocess (target: <= 2x). Latency: `Sandbox.run
    ("true")` vs `bash -c true`, interleaved one by one, medians. Throughput: --parallel threads, each with
    its own sandbox (or bare subprocesses), --per-thread commands each.
        python speed.py sandbox [--n 300] [--parallel 32] [--per-thread 20]"""
    import subprocess
    import threading
    from sandbox import Sandbox
    a = flags(args, "speed.py sandbox", n=300, parallel=32, per_thread=20)

    def bare():
        subprocess.run(["bash", "-c", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)

    def throughput(make_runner) -> float:
        runners = [make_runner() for _ in range(a.parallel)]
        barrier = threading.Barrier(a.parallel + 1)

        def work(run):
            barrier.wait()
            for _ in range(a.per_thread):
                run()
        threads = [threading.Thread(target=work, args=(r,)) for r in runners]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        return a.parallel * a.per_thread / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    sb = Sandbox(timeout=10)
    start_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(10):  # warm up both paths (page cache, first fork of each process)
        sb.run("true"), bare()
    (_, bare_s), (_, boxed_s) = interleaved_times([bare, lambda: sb.run("true")], a.n, warmup=False)
    describe = sb.describe()
    sb.close()
    boxes = []
    try:
        bare_tput = throughput(lambda: bare)
        boxed_tput = throughput(lambda: boxes.append(Sandbox(timeout=10)) or (lambda s=boxes[-1]: s.run("true")))
    finally:
        for s in boxes:
            s.close()
    print(f"sandbox: {describe}; helper start {start_ms:.0f} ms (once per sandbox)\n")
    print(md_table(["measure", "bare subprocess", "Sandbox.run", "ratio (sandbox / bare)"], [
        [f"latency of `true`, median of {a.n} (ms)", f"{bare_s * 1e3:.2f}", f"{boxed_s * 1e3:.2f}",
         f"{boxed_s / bare_s:.2f}x"],
        [f"throughput, {a.parallel} threads x {a.per_thread} (cmd/s)", f"{bare_tput:.0f}", f"{boxed_tput:.0f}",
         f"{bare_tput / boxed_tput:.2f}x time per command"]]))


def bench_envs(args: list) -> None:
    """Environment speed and scripted-agent scores, side by side in one process.
    alchemy: steps/s with random valid actions (the env alone), the reference policy and the oracle
    (exact search each step), as ratios to random. camg: per env, the reference policy on the first test
    tasks (groups in order, one instance) with memory kept vs blanked before every task, and a random
    policy. codebase: reset, a shell command, a no-op and a resolving submit, vs a bare `python -c pass`.
        python speed.py envs [--which alchemy,camg,codebase] [--tasks 100] [--camg-tasks 24]"""
    import random
    import re
    import subprocess
    from alchemy import oracle_policy, parse_observation
    from envs import make
    a = flags(args, "speed.py envs", which="alchemy,camg,codebase", tasks=100, camg_tasks=24)

    def play(env, task, policy) -> tuple:
        obs, done, steps, total = env.reset(task), False, 0, 0.0
        while not done:
            obs, r, done = env.step(policy(obs))
            steps, total = steps + 1, total + r
        return steps, total

    def random_alchemy(rng):
        def act(obs):
            s = parse_observation(obs)
            return rng.choice([f"apply p{q} s{t}" for q in s["potions"] for t in s["stones"]]
                              + [f"cauldron s{t}" for t in s["stones"]] + ["end"])
        return act
    if "alchemy" in a.which:
        env = make("alchemy")
        tasks = env.tasks("train")
        tasks = tasks[:: max(1, len(tasks) // a.tasks)][: a.tasks]
        rows = []
        for name, make_actor in (("random valid actions (env only)", lambda t, i: random_alchemy(random.Random(i))),
                                 ("reference policy (infers chemistry)", lambda t, i: env.reference_policy(t)),
                                 ("oracle (exact search each step)", lambda t, i: oracle_policy(env))):
            t0 = time.perf_counter()
            runs = [play(env, t, make_actor(t, i)) for i, t in enumerate(tasks)]
            steps, sec = sum(s for s, _ in runs), time.perf_counter() - t0
            rows.append([name, steps, f"{sec:.2f}", steps / sec, f"{sum(r for _, r in runs) / len(tasks):.3f}"])
        print(f"Alchemy: {len(tasks)} train tasks\n")
        print(md_table(["driver", "steps", "seconds", "steps/s", "vs random", "mean score"],
                       [r[:3] + [f"{r[3]:,.0f}", f"{r[3] / rows[0][3]:.2f}x", r[4]] for r in rows]) + "\n")
    randoms = {  # valid action forms picked at random from what the observation shows
        "shop": lambda rng, obs: rng.choice(["search[blue jacket]", "buy", "click[next]", "click[back]", "shell: ls"]
                                            + [f"click[{i}]" for i in re.findall(r"\[(B\d+)\]", obs)]),
        "deepresearch": lambda rng, obs: rng.choice([f"search[{w}]" for w in re.findall(r"[A-Z][a-z]+", obs)[:5]]
                                                    + [f"open[{i}]" for i in re.findall(r"\[(d\d+)\]", obs)]
                                                    + [f"answer[{w}]" for w in re.findall(r"[A-Z][a-z]+", obs)[:3]]),
        "autoresearch": lambda rng, obs: rng.choice(["shell: ls", "run", "evaluate", "shell: cat README.md"])}
    if "camg" in a.which:
        rows = []
        for name, rand in randoms.items():
            env = make(name, keep_memory=True)
            try:
                tasks = sorted(env.tasks("test"), key=lambda t: (t.group, t.difficulty, t.id))[: a.camg_tasks]
                t0, res = time.time(), {}
                for mode in ("memory", "scratch", "random"):
                    rng, scores, group = random.Random(0), [], None
                    for task in tasks:
                        if mode != "memory" or task.group != group:
                            env.set_memory_files({})  # a new stream (group) or from scratch: blank memory
                        group = task.group
                        pol = (lambda obs: rand(rng, obs)) if mode == "random" else env.reference_policy(task)
                        scores.append((play(env, task, pol)[1], bool(env.info.get("success"))))
                    res[mode] = (sum(s for _, s in scores) / len(tasks), sum(r for r, _ in scores))
                rows.append([name, len(tasks)] + [f"{res[m][0]:.0%} / {res[m][1] / len(tasks):.2f}" for m in res]
                            + [f"{res['memory'][1] - res['scratch'][1]:+.2f}", f"{time.time() - t0:.1f}"])
            finally:
                env.close()
        print(md_table(["env", "tasks", "memory: success / reward", "scratch: success / reward",
                        "random: success / reward", "gain (sum)", "s"], rows) + "\n")
    if "codebase" in a.which:
        import codebase as cb
        best = lambda fn: interleaved_times([fn], 3, warmup=False)[0][0]  # noqa: E731  (best of 3)
        base = best(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True))
        env, rows = cb.CodebaseEnv(), []
        try:
            for stream in cb.long_streams().values():
                task = stream[0]
                reset = best(lambda: env.reset(task))
                command = best(lambda: env.step("ls"))  # after the last reset: 3 of its 40 steps
                noop = best(lambda: (env.reset(task), env.step("submit")))
                fix = best(lambda: (env.reset(task), env.step(env.reference_policy(task)("")), env.step("submit")))
                rows += [[task.id, what, f"{sec:.3f}", f"{sec / base:.1f}"] for what, sec in (
                    ("reset", reset), ("shell command", command), ("reset + no-op submit", noop),
                    ("reset + fix + resolving submit", fix))]
        finally:
            env.close()
        print(md_table(["task", "step", "seconds", f"x `python -c pass` ({base * 1000:.0f} ms)"], rows))


def bench_camg(args: list) -> None:
    """camg.py's asynchrony: the same short CAMG-RL run with rollout inline (synchronous) vs 1 and 2 rollout
    worker processes. Per setting: wall time, steady seconds per update (after the first), episodes the
    learner received per second, version lag of trained episodes, episodes dropped as stale. Each run is
    `python camg.py ... --device cpu` in a subprocess of its own (camg.py is a program, imported by no
    other), so wall time includes its start-up. On a 2-core CPU workers and learner share the cores,
    so the gain is bounded; on GPUs they run on separate devices.
        python speed.py camg [--steps 4] [--workers 0,1,2] [--eta 2]"""
    import subprocess
    import tempfile
    a = flags(args, "speed.py camg", model="tiny", steps=4, workers="0,1,2", eta=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.workers.split(",")]:
            run = Path(tmp) / f"w{n}"
            cmd = [sys.executable, str(HERE / "camg.py"), "--model", a.model, "--steps", str(a.steps),
                   "--num-workers", str(n), "--eta", str(a.eta), "--run-dir", str(run), "--eval-tasks", "0",
                   "--device", "cpu", "--warmstart-steps", "0",   # the workload measured before the laptop preset grew:
                   "--family", "standard", "--batch-episodes", "2", "--rollout-batch", "2", "--max-turns", "3",
                   "--max-new-tokens", "32", "--context-budget", "1024",
                   "--env-weights", "shop=1,coding=1,deepresearch=1,autoresearch=1"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                cli.fail("speed.py camg", f"camg.py with {n} workers failed (exit {p.returncode}): "
                         + (p.stderr.strip().splitlines() or ["no output"])[-1])
            eps = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
            lags = [e["lag"] for e in eps if e["used"] == "train"]
            steady = [json.loads(line)["update_s"] for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
            rows.append((n, wall, sum(steady) / max(len(steady), 1), len(eps), sum(lags) / max(len(lags), 1),
                         max(lags, default=0), sum(e["used"] == "stale" for e in eps)))
    print(f"\nCAMG-RL asynchrony ({a.model}, {a.steps} updates, eta {a.eta}). wall: the whole run with start-up; "
          "steady: mean seconds per update after the first (waiting for episodes + training)\n")
    print(md_table(["rollout", "wall s", "steady s / update", "episodes received / s", "lag mean", "lag max",
                    "dropped stale", "steady speed-up"],
                   [["inline (sync)" if n == 0 else f"{n} worker process{'es' if n > 1 else ''}", f"{wall:.1f}",
                     f"{steady:.2f}", f"{num / wall:.2f}", f"{lag:.2f}", lag_max, stale, f"{rows[0][2] / steady:.2f}x"]
                    for n, wall, steady, num, lag, lag_max, stale in rows]))


SUBCOMMANDS = {"engine": bench_engine, "sandbox": bench_sandbox, "envs": bench_envs, "ppo": bench_ppo,
               "camg": bench_camg}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            cli.fail("speed.py", f"unknown benchmark {argv[0]!r}; choose one of {', '.join(SUBCOMMANDS)}")
        print(__doc__)
        return None
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
