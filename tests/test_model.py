"""model.py against transformers' own Qwen3 / Qwen3.5 / Llama models, the cache against a full forward,
and the errors a user meets. CPU, fp32, tiny random configs."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import gated_delta
import model as M

VOCAB = 300


def hf_model(arch, num_kv_heads=1, tied=False, num_layers=4):
    """A tiny random transformers model; every weight (norms included) perturbed so none is trivial."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=num_kv_heads, head_dim=16, intermediate_size=96, tie_word_embeddings=tied,
                  max_position_embeddings=512)
    torch.manual_seed(0)
    if arch == "qwen3":
        hf = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e4}))
    else:
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, linear_num_key_heads=2, linear_num_value_heads=4,
                                                  linear_key_head_dim=16, linear_value_head_dim=8))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return hf.eval()


def inputs(B=2, T=80, seed=1):  # T > 64 crosses a DeltaNet chunk boundary
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch,num_kv_heads,tied", [
    ("qwen3", 1, False), ("qwen3", 4, True), ("qwen3", 2, False),
    ("llama", 1, True), ("llama", 4, False),
    ("qwen3_5", 1, False), ("qwen3_5", 4, True),
])
def test_logits_match_transformers(tmp_path, arch, num_kv_heads, tied):
    hf = hf_model(arch, num_kv_heads, tied)
    hf.save_pretrained(tmp_path)
    ours = M.load(tmp_path)
    assert ours.config.arch == arch and ours.config.tie_word_embeddings == tied
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied
    x = inputs()
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert max_diff(ref, got) <= 1e-4


def test_sharded_checkpoint(tmp_path):
    hf = hf_model("qwen3", num_kv_heads=2)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    x = inputs(T=20)
    with torch.no_grad():
        assert max_diff(hf(x).logits, M.load(tmp_path)(x)) <= 1e-4


def test_multimodal_qwen3_5_prefix_and_shards(tmp_path):
    """A Qwen3_5ForConditionalGeneration-style checkpoint: nested text_config, `model.language_model.`
    names, a vision tower and an MTP head (both skipped), split over two shards with an index."""
    hf = hf_model("qwen3_5", num_kv_heads=2)
    state = {n.replace("model.", "model.language_model.", 1): t.contiguous() for n, t in hf.state_dict().items()}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    state["mtp.fc.weight"] = torch.zeros(4, 4)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": hf.config.to_dict(),
              "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    x = inputs(T=20)
    with torch.no_grad():
        assert max_diff(hf(x).logits, M.load(tmp_path)(x)) <= 1e-4


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_save_is_read_by_transformers(tmp_path, arch):
    model, tok = M.tiny(arch, seed=3)
    M.save(model, tok, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    again = M.load(tmp_path)
    x = torch.randint(0, model.config.vocab_size, (2, 70))
    with torch.no_grad():
        ref = model(x)
        assert max_diff(hf(x).logits, ref) <= 1e-4
        assert max_diff(again(x), ref) == 0.0
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2.encode("hello world") == tok.encode("hello world")


def perturbed_tiny(arch):
    model, _ = M.tiny(arch, seed=0)
    with torch.no_grad():  # random norms and biggers weights: a wrong position or mask shows up clearly
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_cached_decode_matches_full_forward(arch):
    model = perturbed_tiny(arch)
    B, T = 3, 90
    x = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(B)
    with torch.no_grad():
        full = model(x)
        # ragged prefill: row b has P[b] real tokens, right-padded with garbage
        P = torch.tensor([5, 70, 33])
        cache = model.new_cache(B, 100)
        prompt = torch.randint(0, model.config.vocab_size, (B, int(P.max())))
        for b in range(B):
            prompt[b, :P[b]] = x[b, :P[b]]
        logits = model(prompt, cache=cache, lengths=P)
        for b in range(B):
            assert max_diff(logits[b, :P[b]], full[b, :P[b]]) <= 1e-4
        assert cache.seqlens.tolist() == P.tolist()
        pos = P.clone()
        for _ in range(6):  # one-token decode steps
            logits = model(x[rows, pos][:, None], cache=cache)
            assert max_diff(logits[:, 0], full[rows, pos]) <= 1e-4
            pos += 1
        # a ragged multi-token call after decoding
        L = torch.tensor([3, 1, 7])
        chunk = torch.stack([x[b, pos[b]:pos[b] + 7] for b in range(B)])
        logits = model(chunk, cache=cache, lengths=L)
        for b in range(B):
            assert max_diff(logits[b, :L[b]], full[b, pos[b]:pos[b] + L[b]]) <= 1e-4
        pos += L
        # select: drop row 1, reorder the others; last_only returns each row's last real position
        keep = torch.tensor([2, 0])
        cache.select(keep)
        assert cache.seqlens.tolist() == pos[keep].tolist()
        logits = model(x[keep, pos[keep]][:, None], cache=cache, last_only=True)
        assert logits.shape == (2, 1, model.config.vocab_size)
        assert max_diff(logits[:, 0], full[keep, pos[keep]]) <= 1e-4


def test_cache_cat_and_last_only():
    model = perturbed_tiny("qwen3_5")
    x = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, hidden = model(x, return_hidden=True)
        assert hidden.shape == (3, 12, model.config.hidden_size)
        a, b = model.new_cache(1, 32), model.new_cache(2, 32)
        model(x[:1, :6], cache=a)
        last = model(x[1:, :10], cache=b, lengths=torch.tensor([10, 4]), last_only=True)
        assert max_diff(last[:, 0], full[[1, 2], [9, 3]]) <= 1e-4
        cache = M.Cache.cat([a, b])
        assert cache.seqlens.tolist() == [6, 10, 4]
        logits = model(x[[0, 1, 2], [6, 10, 4]][:, None], cache=cache)
        assert max_diff(logits[:, 0], full[[0, 1, 2], [6, 10, 4]]) <= 1e-4


def test_inference_mode_logits_follow_weight_updates():
    # inside transposed_weights (all of a generate call) every Linear multiplies by a transposed copy
    # of its weight: the copies must match the plain products, and a later call must see weights changed
    # by paths that do not bump weight._version (a .data.copy_, AdamW's foreach / fused kernels)
    model = perturbed_tiny("llama")
    x = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))

    def fast():
        with M.transposed_weights(model), torch.inference_mode():
            out = model(x)
            assert model.lm_head._w_t is not None and model.lm_head._w_t is not False   # the copy was used
        assert model.lm_head._w_t is None                                              # and dropped after
        return out

    def plain():
        with torch.no_grad():
            return model(x)
    before = fast()
    assert max_diff(before, plain()) <= 1e-5
    with torch.no_grad():
        w = model.layers[0].mlp.down_proj.weight
        w.data.copy_(w.data + 0.1)              # .data: a fresh version counter, weight._version unchanged
    after = fast()
    assert max_diff(after, plain()) <= 1e-5 and max_diff(before, after) > 1e-3
    for kind in ("foreach", "fused"):         # fused AdamW (CPU kernels since torch 2.4) bumps no version
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
        except RuntimeError:                  # fused kernels unavailable for this device / build
            continue
        for _ in range(2):
            moved = fast()
            model(x).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            assert max_diff(fast(), plain()) <= 1e-5 and max_diff(fast(), moved) > 1e-4, kind
    with torch.inference_mode():                 # outside the block: the plain product, never a copy
        assert max_diff(model(x), plain()) <= 1e-5 and model.lm_head._w_t is None


def test_generate_follows_weights_changed_in_place():
    from generate import generate
    model = perturbed_tiny("qwen3")
    prompt = [[1, 2, 3, 4, 5]]
    first = generate(model, prompt, 6, temperature=0)[0]
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data.flip(-1) * 1.5)   # new values, no version bump
    second = generate(model, prompt, 6, temperature=0)[0]
    with torch.no_grad():                         # the reference: a plain forward over the same tokens
        ids = torch.tensor([prompt[0] + second.tokens])
        lp = torch.log_softmax(model(ids)[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(lp[-len(second.tokens):], torch.tensor(second.logprobs), atol=1e-4)
    assert first.logprobs != second.logprobs


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nope'} does not exist"):
        M.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty is not a Hugging Face checkpoint dir: config.json is missing"):
        M.load(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(ValueError, match="bad/config.json is not valid JSON"):
        M.load(bad)
    (bad / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ValueError, match="bad/config.json is not a usable config"):
        M.load(bad)
    hf_model("llama", num_layers=2).config.to_json_file(bad / "config.json")
    with pytest.raises(ValueError, match="bad has no weights: expected model.safetensors"):
        M.load(bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read weights .*model.safetensors"):
        M.load(bad)


def test_row_groups():
    # sorted lengths: groups stay under 10% padding; one row always makes a group; max_tokens caps a group
    lengths = [10, 10, 11, 30, 31, 200]
    groups = M.row_groups(lengths)
    assert groups == [(0, 3), (3, 5), (5, 6)]
    for a, b in groups:
        padded = (b - a) * max(lengths[a:b])
        assert padded - sum(lengths[a:b]) <= 0.1 * padded
    assert M.row_groups(lengths, max_tokens=25) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert M.row_groups([5, 1, 5]) == [(0, 1), (1, 2), (2, 3)]  # unsorted rows still group correctly


def test_chunked_delta_rule_equals_recurrent():
    g = torch.Generator().manual_seed(0)
    B, H, T, dk, dv = 2, 3, 150, 8, 5
    q, k = (M.l2norm(torch.randn(B, H, T, dk, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g)
    decay = -torch.rand(B, H, T, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    o1, s1 = gated_delta.recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    o2, s2 = gated_delta.chunk_gated_delta_rule(q, k, v, decay, beta, state, chunk_size=32)
    assert max_diff(o1, o2) <= 1e-4 and max_diff(s1, s2) <= 1e-4
    # the in-place decode step: token by token, the state it updates ends where the rule's does
    s3 = state.clone()
    o3 = torch.stack([gated_delta.gated_delta_step_(q[:, :, t], k[:, :, t], v[:, :, t], decay[:, :, t], beta[:, :, t], s3)
                      for t in range(T)], dim=2)
    assert max_diff(o1, o3) <= 1e-4 and max_diff(s1, s3) <= 1e-4


def test_gradient_checkpointing_and_bf16():
    model = perturbed_tiny("qwen3_5").train()
    x = torch.randint(0, model.config.vocab_size, (2, 20))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(x).logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert max_diff(*grads) <= 1e-6 and grads[0].abs().sum() > 0
    logits = model.to(torch.bfloat16)(x)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*qwen3.*qwen3_5.*llama"):
        M.load(tmp_path)


def test_missing_and_unexpected_tensors(tmp_path):
    hf = hf_model("llama", num_layers=2)
    state = {n: t.contiguous() for n, t in hf.state_dict().items() if "layers.1.mlp.up_proj" not in n}
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    hf.config.to_json_file(tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"
                                         r".*unexpected tensors: \['model.layers.0.mlp.extra.weight'\]"):
        M.load(tmp_path)


def test_too_long_prompt():
    model, _ = M.tiny("qwen3", max_seq_len=32)
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache(2, 16)
    with pytest.raises(ValueError, match="does not fit the cache"):
        model(torch.zeros(2, 20, dtype=torch.long), cache=cache, lengths=torch.tensor([3, 17]))


def test_tiny_tokenizer_offline():
    model, tok = M.tiny("qwen3_5")
    assert model.config.vocab_size == len(tok) and 500 <= len(tok) <= 2048
    assert 5e5 <= sum(p.numel() for p in model.parameters()) <= 3e6
    text = "Paris <action>ls -la</action>\n### Lessons & Pitfalls\n- ünïcode ✓ 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges do compress
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [tok.convert_tokens_to_ids("<|im_start|>")]  # one special token
    # seeded: the same call gives the same model and tokenizer
    model2, tok2 = M.tiny("qwen3_5")
    assert tok2.get_vocab() == tok.get_vocab()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.slow  # the first run converts the GGUF (~30 s); later runs read the safetensors cache
def test_smollm2_answers():
    model, tok = M.load("smollm2"), M.load_tokenizer("smollm2")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt)
    cache, out = model.new_cache(1, len(ids) + 20), []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache)
        for _ in range(20):  # greedy
            out.append(int(logits[0, -1].argmax()))
            if out[-1] == tok.eos_token_id:
                break
            logits = model(torch.tensor([[out[-1]]]), cache=cache)
    assert "Paris" in tok.decode(out)


def fake_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """flash_attn_varlen_func's documented semantics, in SDPA: (total, H, D) tokens, rows cut by cu_seqlens."""
    assert cu_q.dtype == torch.int32 and causal and torch.equal(cu_q, cu_k)
    outs = []
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def fake_flash_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, causal):
    """flash_attn_with_kvcache: append k/v in place at cache_seqlens, causal mask aligned bottom-right."""
    assert cache_seqlens.dtype == torch.int32 and causal
    B, T = q.shape[:2]
    outs = []
    for b in range(B):
        L = int(cache_seqlens[b])
        k_cache[b, L:L + T], v_cache[b, L:L + T] = k[b], v[b]
        mask = torch.arange(L + T)[None] <= (L + torch.arange(T))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), k_cache[b, :L + T].transpose(0, 1), v_cache[b, :L + T].transpose(0, 1),
            attn_mask=mask, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_flash_path_glue(monkeypatch, arch):
    """The flash-attn calls (unpadding, cu_seqlens, in-place cache append with pads) checked on CPU against
    stand-ins that follow the kernels' documented semantics; the real kernels need CUDA."""
    monkeypatch.setattr(M, "flash_attn_varlen_func", fake_flash_varlen)
    monkeypatch.setattr(M, "flash_attn_with_kvcache", fake_flash_kvcache)
    model = perturbed_tiny(arch)
    x = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(4))
    P = torch.tensor([9, 30, 17])
    with torch.no_grad():
        full = model(x)
        model.attn_impl = "flash"
        assert max_diff(model(x), full) <= 1e-4
        unpadded = model(x, lengths=P)
        for b in range(3):
            assert max_diff(unpadded[b, :P[b]], full[b, :P[b]]) <= 1e-4
        cache = model.new_cache(3, 40)
        model(x[:, :30], cache=cache, lengths=P)
        for step in range(3):
            pos = P + step
            logits = model(x[torch.arange(3), pos][:, None], cache=cache)
            assert max_diff(logits[:, 0], full[torch.arange(3), pos]) <= 1e-4
        with pytest.raises(ValueError, match="does not fit the cache"):  # the kernel writes the pads' k/v too
            model(x[:, :30], cache=cache, lengths=torch.tensor([1, 1, 1]))
