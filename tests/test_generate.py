"""generate.py against independent references: transformers' greedy generate, a full no-cache forward
for logprobs, and the no-stop run for stop tokens / dropped rows. CPU, fp32, tiny random models."""
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from generate import Completion, generate, sample
from model import load

ARCHS = ["qwen3", "qwen3_5", "llama"]
LENGTHS = [3, 200, 17, 64, 5, 120, 33]  # ragged on purpose, not sorted


# small random transformers configs: each is saved with save_pretrained, then both engines load that
# checkpoint. GQA ratios 2 and 4; qwen3 untied, the others tied. initializer_range 0.05 spreads the logits
# enough that greedy argmaxes are no near-ties (top-2 gaps >= ~2e-3 here) while keeping fp32 rounding
# small: the chunked (prefill) and recurrent (decode) DeltaNet rules round differently, and larger
# weights amplify that (init 0.2 gives logprob gaps of 1e-3 between cached decode and a full forward).
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
              max_position_embeddings=512, initializer_range=0.05)
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=False),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1,
                                              tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    """(arch, checkpoint dir, our model loaded from it): the same saved weights for both engines."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, load(path)


def random_prompts(vocab_size, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def full_logits(model, prompt, completion):
    """(len(completion), V) logits that predicted each completion token, from one no-cache forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids)[0]  # (T, V)
    return logits[len(prompt) - 1 : -1]


# --- greedy: token for token against transformers, prompt by prompt -------------------------------


def test_greedy_matches_transformers(ckpt):
    arch, path, ours = ckpt
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop early: compare all max_new_tokens tokens
    prompts = random_prompts(ours.config.vocab_size, LENGTHS)
    # a small prefill budget forces several micro-batches, i.e. the cache merge
    outs = generate(ours, prompts, max_new_tokens=10, temperature=0, prefill_token_budget=256)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert out.tokens == ref[0, len(prompt):].tolist(), f"{arch}: prompt {i} (length {len(prompt)}) differs"
        assert out.finish_reason == "length" and len(out.logprobs) == 10


# --- logprobs: equal log_softmax(logits / T) of a full forward at the chosen tokens ----------------


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_match_full_forward(ckpt, temperature, top_p):
    arch, _, model = ckpt
    prompts = random_prompts(model.config.vocab_size, [3, 50, 9, 120], seed=1)
    outs = generate(model, prompts, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=3)
    for prompt, out in zip(prompts, outs):
        logits = full_logits(model, prompt, out.tokens)
        divisor = temperature if temperature > 0 else 1.0  # greedy reports the untempered logprob
        ref = torch.log_softmax(logits / divisor, dim=-1).gather(-1, torch.tensor(out.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4), (arch, temperature, out.logprobs, ref)
        if temperature == 0:
            assert out.tokens == logits.argmax(-1).tolist()


# --- stop tokens, length limits, dropped rows ------------------------------------------------------


def expected_with_stop(reference: Completion, stop: set[int], limit: int):
    """What a run with stop tokens must return, given the run without them (greedy is deterministic)."""
    tokens = reference.tokens[:limit]
    for k, t in enumerate(tokens):
        if t in stop:
            return tokens[: k + 1], "stop"
    return tokens, "length"


@pytest.mark.parametrize("sync_every", [1, 3])
def test_stop_tokens_and_dropped_rows(ckpt, sync_every):
    """Rows that stop early leave the batch (Cache.select); the others must continue unchanged."""
    arch, _, model = ckpt
    prompts = random_prompts(model.config.vocab_size, LENGTHS, seed=2)
    free = generate(model, prompts, max_new_tokens=16, temperature=0)
    # stop on tokens that appear at different places in different completions
    stop = {free[0].tokens[2], free[3].tokens[7], free[5].tokens[12]}
    limits = [16, 16, 5, 16, 1, 16, 9]  # per-prompt length limits too
    outs = generate(model, prompts, max_new_tokens=limits, temperature=0, stop_token_ids=sorted(stop),
                    sync_every=sync_every)
    reasons = set()
    for i, (ref, out, limit) in enumerate(zip(free, outs, limits)):
        tokens, reason = expected_with_stop(ref, stop, limit)
        assert (out.tokens, out.finish_reason) == (tokens, reason), f"{arch}: prompt {i}"
        assert out.logprobs == pytest.approx(ref.logprobs[: len(tokens)], abs=1e-4)
        reasons.add(reason)
    assert reasons == {"stop", "length"}, "the test should exercise both finish reasons"


def test_stop_on_first_token_and_length_one(ckpt):
    _, _, model = ckpt
    prompts = random_prompts(model.config.vocab_size, [4, 30], seed=4)
    first = generate(model, prompts, max_new_tokens=1, temperature=0)
    assert [len(o.tokens) for o in first] == [1, 1] and all(o.finish_reason == "length" for o in first)
    outs = generate(model, prompts, max_new_tokens=8, temperature=0, stop_token_ids=[first[1].tokens[0]])
    assert outs[1].tokens == first[1].tokens and outs[1].finish_reason == "stop"


# --- sampling --------------------------------------------------------------------------------------


def test_seed_reproducible(ckpt):
    _, _, model = ckpt
    prompts = random_prompts(model.config.vocab_size, [5, 40, 12], seed=5)
    a = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=7)
    b = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=7)
    c = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=8)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in c]


def test_tiny_top_p_is_greedy(ckpt):
    """top_p -> 0 keeps only the most likely token, but the logprob stays the untruncated tempered one."""
    _, _, model = ckpt
    prompts = random_prompts(model.config.vocab_size, [6, 25], seed=6)
    greedy = generate(model, prompts, max_new_tokens=8, temperature=0)
    nucleus = generate(model, prompts, max_new_tokens=8, temperature=0.5, top_p=1e-6, seed=0)
    for g, n, p in zip(greedy, nucleus, prompts):
        assert n.tokens == g.tokens
        logits = full_logits(model, p, n.tokens)
        ref = torch.log_softmax(logits / 0.5, -1).gather(-1, torch.tensor(n.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(n.logprobs), ref, atol=1e-4)


def test_sample_frequencies_and_top_p():
    """sample() draws from softmax(logits / T) restricted to the top-p nucleus."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(40000, 1)  # (N, 4) the same distribution N times
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, temperature=1.0, top_p=1.0, generator=g)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.01), freq
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)
    # top_p = 0.7: keep {0.5, 0.3} (mass before the third token is 0.8 >= 0.7), renormalised to 5/8, 3/8
    tokens, logprobs = sample(logits, temperature=1.0, top_p=0.7, generator=g)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.01), freq
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)  # logprob before truncation
    # temperature sharpens: T = 0.5 squares the probabilities before renormalising
    tokens, logprobs = sample(logits, temperature=0.5, top_p=1.0, generator=g)
    sharp = probs**2 / (probs**2).sum()
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, sharp, atol=0.01), freq
    assert torch.allclose(logprobs, sharp.log()[tokens], atol=1e-5)


# --- bad input -------------------------------------------------------------------------------------


def test_errors(ckpt):
    _, _, model = ckpt
    limit = model.config.max_seq_len
    with pytest.raises(ValueError, match="non-empty list"):
        generate(model, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=rf"prompt 1 has {limit - 2} tokens \+ max_new_tokens 4 .* {limit}"):
        generate(model, [[1, 2], [1] * (limit - 2)], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, model.config.vocab_size]], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        generate(model, [[1, 2]], max_new_tokens=[4, 4])
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[1, 2]], max_new_tokens=4, temperature=-1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_prefix_continuation_equals_full_prefill(arch):
    """A second turn that continues a saved Prefix gives the same greedy tokens and logprobs as
    prefilling the whole conversation again (multi-turn rollouts rely on it)."""
    from model import tiny
    model, tok = tiny(arch, seed=1)
    first = [tok.encode("first prompt"), tok.encode("a much longer first prompt for row two")]
    outs = generate(model, first, 6, temperature=0.0, keep_prefix=True, cache_len=128)
    nxt = [p + o.tokens + tok.encode(" and then more") for p, o in zip(first, outs)]
    assert all(o.prefix is not None and o.prefix.num_tokens == len(p) + len(o.tokens) - 1 for p, o in zip(first, outs))
    cont = generate(model, nxt, 6, temperature=0.0, prefixes=[o.prefix for o in outs], cache_len=128)
    full = generate(model, nxt, 6, temperature=0.0)
    for c, f in zip(cont, full):
        assert c.tokens == f.tokens
        assert max(abs(a - b) for a, b in zip(c.logprobs, f.logprobs)) < 1e-4
    # a prefix that the next prompt does not extend is refused with a clear error
    with pytest.raises(ValueError, match="must extend"):
        generate(model, first, 2, prefixes=[outs[0].prefix, None], cache_len=128)
