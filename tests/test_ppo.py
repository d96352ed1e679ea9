"""ppo.py against independent references: a hand computation of the decoupled loss, exact-zero gradients
at masked tokens, a single process vs torchrun --nproc_per_node 2 (FSDP2 on gloo), save/resume, the
logprobs generate returned, and a toy task the loop must learn ("say the secret word")."""
import copy
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _ppo_dist import global_batch, run as dist_run
from generate import generate
from model import tiny
from ppo import Dist, Learner, logprobs_of, make_batch, micro_batches, policy_loss
from rewards import group_advantages

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)   # 2 shared cores: one thread per process is several times faster than two


@pytest.fixture(scope="module")
def qwen3():
    return tiny("qwen3", seed=0)


# ---------------------------------------------------------------------------------------------
# the loss


def test_policy_loss_equals_hand_computation():
    """Stale behaviour logprobs (w != 1), both clip sides, and garbage at a masked token."""
    lp = torch.tensor([[-1.0, -0.1, -2.0, -2.0, -0.3]], requires_grad=True)
    prox = torch.tensor([[-1.2, -0.5, -1.5, -1.5, float("nan")]])
    behav = torch.tensor([[-1.0, -0.9, -1.5, -1.7, 1e9]])
    adv = torch.tensor([[1.0, 2.0, 0.5, -1.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = policy_loss(lp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()

    terms, grads, clipped, kls = [], [], 0, []
    for t in range(4):
        r = math.exp(lp[0, t].item() - prox[0, t].item())
        w = math.exp(prox[0, t].item() - behav[0, t].item())
        a = adv[0, t].item()
        unclipped, clip = -a * r, -a * min(max(r, 0.8), 1.28)
        terms.append(w * max(unclipped, clip))
        clipped += clip > unclipped
        grads.append(0.0 if clip > unclipped else w * -a * r / 4)   # d/dlp of w*(-a)*exp(lp - prox), / n
        kls.append(r - 1 - math.log(r))
    assert clipped == 2, "the fixture should clip token 1 (high side) and token 3 (low side)"
    assert loss.item() == pytest.approx(sum(terms) / 4, rel=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["approx_kl"].item() == pytest.approx(sum(kls) / 4, rel=1e-5)
    torch.testing.assert_close(lp.grad[0, :4], torch.tensor(grads), rtol=1e-5, atol=0)
    assert lp.grad[0, 4].item() == 0.0, "a masked token got gradient"
    # prox == behav is ordinary PPO: w = 1
    loss2, st2 = policy_loss(lp[:, :4], prox[:, :4], prox[:, :4], adv[:, :4], mask[:, :4])
    assert st2["is_weight"].item() == pytest.approx(1.0)


def test_decoupled_update_with_staleness_matches_hand(qwen3):
    """eta = 2: the row 3 versions old is dropped; the others are weighted by w = pi_prox / pi_behav."""
    model, _ = qwen3
    learner = Learner(copy.deepcopy(model), lr=1e-3, kl_coef=0.0, max_lag=2, generation_copy=False,
                      micro_batch_tokens=40)
    learner.version = 3
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (9, 14, 11, 7)]
    masks = [[0] * 4 + [1] * (len(r) - 4) for r in rows]
    batch = make_batch(rows, masks, None, [0.7, -1.3, 0.4, 2.0], versions=[3, 2, 1, 0])
    cur = learner.logprobs_of(batch)                 # prox = the weights at the start of the update
    behav = cur - 0.3 * torch.rand(cur.shape, generator=g) * batch.loss_mask   # as if sampled by older weights
    batch.behav_logprobs = behav * batch.loss_mask
    advs = [0.7, -1.3, 0.4, 2.0]

    total, n, w_sum = 0.0, 0, 0.0
    for b in range(3):                               # row 3 (lag 3 > eta) must not count at all
        for t in range(batch.tokens.shape[1]):
            if batch.loss_mask[b, t]:
                w = math.exp(cur[b, t].item() - behav[b, t].item())
                total += w * -advs[b]                # r = 1: the step's weights are prox's
                w_sum += w
                n += 1
    stats = learner.update(batch)
    assert stats["num_stale"] == 1
    assert stats["pg_loss"] == pytest.approx(total / n, rel=1e-5)
    assert stats["is_weight"] == pytest.approx(w_sum / n, rel=1e-5)
    assert learner.version == 4


def test_minibatches_measure_the_trust_region_against_prox(qwen3):
    """One minibatch: the step's weights are prox (r = 1, approx_kl 0). Two: the second step starts from
    moved weights, so r != 1 there, measured against the logprobs recomputed before the first step."""
    model, _ = qwen3
    rows = [[3 + (7 * i + j) % 900 for j in range(10)] for i in range(4)]
    batch = make_batch(rows, [[0] * 3 + [1] * 7] * 4, [[0.0] * 3 + [-6.9] * 7] * 4, [1.0, -1.0, 0.5, -0.5])
    one = Learner(copy.deepcopy(model), lr=1e-2, kl_coef=0.0, generation_copy=False).update(batch)
    two = Learner(copy.deepcopy(model), lr=1e-2, kl_coef=0.0, generation_copy=False).update(batch, 2)
    assert one["approx_kl"] == 0.0 and one["clipfrac"] == 0.0
    assert two["approx_kl"] > 1e-4, two
    assert "approx_kl" in two and "tokens_per_s" in two


def test_masked_tokens_get_exactly_zero_gradient(qwen3):
    """Every loss on (policy, value, KL, entropy, SFT) leaves zero gradient at prompt, observation and
    padding positions, and garbage there changes nothing."""
    model, _ = qwen3
    V = model.config.vocab_size

    def learner():
        return Learner(copy.deepcopy(model), ref_model=copy.deepcopy(model), value_head=True, lr=1e-3,
                       kl_estimator="k3", entropy_coef=0.01, max_lag=5, generation_copy=False,
                       micro_batch_tokens=10_000)
    batch = global_batch(V, version=2)
    batch.versions[:] = 2                            # every row fresh
    a = learner()
    a.version = 2
    grads = []

    def keep_grad(module, inputs, out):              # the final hidden states [B, T, D]: lm_head and value head
        out.register_hook(grads.append)
    a.policy.model.norm.register_forward_hook(keep_grad)
    a.update(batch)
    (grad,) = grads                                   # one micro-batch: rows sorted longest first
    order = micro_batches(batch.lengths.tolist(), 10_000)[0]
    trained = (batch.loss_mask + batch.sft_mask)[order] > 0        # [B, T] tokens some loss trains
    # hidden state p feeds the prediction of token p + 1 (and its value): zero unless p + 1 is trained
    feeds_trained = torch.zeros_like(trained)
    feeds_trained[:, :-1] = trained[:, 1:]
    g = grad.abs().sum(-1)                            # [B, T]
    assert (g[~feeds_trained] == 0).all(), "a masked or padded position received gradient"
    assert (g[feeds_trained] > 0).all(), "a trained position received no gradient"

    # garbage at masked positions: the same update, bit for bit
    bad = copy.deepcopy(batch)
    off = bad.loss_mask == 0
    for name, value in (("behav_logprobs", float("nan")), ("advantages", 1e30), ("returns", float("inf")),
                        ("old_values", float("nan"))):
        getattr(bad, name)[off] = value
    b = learner()
    b.version = 2
    b.update(bad)
    for (name, p), q in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(p, q), f"{name} differs: masked-position values leaked into the update"


def test_nonfinite_loss_skips_step(qwen3, capsys):
    model, _ = qwen3
    learner = Learner(copy.deepcopy(model), lr=1e-2, kl_coef=0.0, generation_copy=False)
    before = [p.detach().clone() for p in learner.policy.parameters()]
    batch = make_batch([[5, 6, 7, 8]], [[0, 1, 1, 1]], [[0.0, -7.0, -7.0, -7.0]], [float("inf")])
    stats = learner.update(batch)
    assert stats["skipped"] == 1.0
    assert "WARNING" in capsys.readouterr().out
    assert all(torch.equal(p, q) for p, q in zip(before, learner.policy.parameters())), "weights moved"
    # a batch whose rows are all past the staleness bound trains nothing: no step (AdamW would still move)
    learner.update(make_batch([[5, 6, 7, 8]], [[0, 1, 1, 1]], [[0.0, -7.0, -7.0, -7.0]], [1.0],
                              versions=[learner.version]))
    before = [p.detach().clone() for p in learner.policy.parameters()]
    stale = learner.update(make_batch([[5, 6, 7, 8]], [[0, 1, 1, 1]], None, [1.0], versions=[0]))
    assert stale["skipped"] == 1.0 and stale["num_stale"] == 1
    assert all(torch.equal(p, q) for p, q in zip(before, learner.policy.parameters())), "weights moved"


def test_bad_input_gets_clear_errors(qwen3):
    with pytest.raises(AssertionError, match="loss_mask\\[0\\] has 2 entries for 3 tokens"):
        make_batch([[1, 2, 3]], [[0, 1]], None, [1.0])
    with pytest.raises(AssertionError, match="token 0 cannot be trained"):
        make_batch([[1, 2, 3]], [[1, 1, 1]], None, [1.0])
    learner = Learner(copy.deepcopy(qwen3[0]), generation_copy=False)
    with pytest.raises(AssertionError, match="claims version"):
        learner.update(make_batch([[1, 2, 3]], [[0, 1, 1]], None, [1.0], versions=[4]))


def test_guards_behav_cap_and_dual_clip_match_hand():
    """AReaL's cap masks tokens whose w = pi_prox / pi_behav exceeds it (weight 0, still in the count);
    verl's dual-clip bounds a negative-advantage token's clipped term by -A * c. Off: the plain loss."""
    lp = torch.tensor([[-1.0, 0.5, -0.2, -1.0, -0.4]], requires_grad=True)
    prox = torch.tensor([[-1.2, -1.5, -0.3, -1.0, -0.5]])
    behav = torch.tensor([[-1.3, -1.6, -2.0, -1.0, -0.6]])      # token 2: w = e^1.7 = 5.5
    adv = torch.tensor([[1.0, -2.0, 0.5, -1.0, -0.5]])           # token 1: r = e^2 = 7.4 with A < 0
    mask = torch.ones(1, 5)
    plain, st0 = policy_loss(lp, prox, behav, adv, mask)
    assert "behav_cap_frac" not in st0 and "dualclip_frac" not in st0
    loss, st = policy_loss(lp, prox, behav, adv, mask, behav_imp_weight_cap=3.0, clip_ratio_c=3.0)
    loss.backward()
    terms, grads, same = [], [], []
    for t in range(5):
        r, w, a = math.exp(lp[0, t].item() - prox[0, t].item()), math.exp(prox[0, t].item() - behav[0, t].item()), adv[0, t].item()
        clipped = max(-a * r, -a * min(max(r, 0.8), 1.28))
        dual = a < 0 and clipped > -a * 3.0
        w_used = 0.0 if w > 3.0 else w
        terms.append(w_used * (-a * 3.0 if dual else clipped))
        same.append(w * clipped)
        active = not dual and -a * r >= -a * min(max(r, 0.8), 1.28)   # the unclipped term carries the gradient
        grads.append(w_used * -a * r / 5 if active else 0.0)
    assert plain.item() == pytest.approx(sum(same) / 5, rel=1e-6)
    assert loss.item() == pytest.approx(sum(terms) / 5, rel=1e-6)
    assert st["behav_cap_frac"].item() == pytest.approx(1 / 5) and st["dualclip_frac"].item() == pytest.approx(1 / 5)
    torch.testing.assert_close(lp.grad[0], torch.tensor(grads), rtol=1e-5, atol=1e-7)
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0, "a guarded token got gradient"
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(lp, prox, behav, adv, mask, clip_ratio_c=0.5)


def test_learner_threads_the_guards_and_logs_how_often_they_bite(qwen3):
    model, _ = qwen3
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 900, (12,), generator=g).tolist() for _ in range(3)]
    batch = make_batch(rows, [[0] * 4 + [1] * 8] * 3, None, [1.0, -1.0, -2.0])
    cur = Learner(copy.deepcopy(model), kl_coef=0.0, generation_copy=False).logprobs_of(batch)
    batch.behav_logprobs = (cur - 2.0 * torch.rand(cur.shape, generator=g)) * batch.loss_mask   # stale: w up to e^2
    off = Learner(copy.deepcopy(model), kl_coef=0.0, generation_copy=False).update(batch)
    on = Learner(copy.deepcopy(model), kl_coef=0.0, generation_copy=False, behav_imp_weight_cap=2.0,
                 clip_ratio_c=3.0).update(batch)
    assert "behav_cap_frac" not in off and "dualclip_frac" not in off
    assert 0.0 < on["behav_cap_frac"] < 1.0 and on["dualclip_frac"] == 0.0   # r = 1 in a single step
    assert on["pg_loss"] != off["pg_loss"] and "behav_cap_frac" in on
    with pytest.raises(ValueError, match="behav_imp_weight_cap must be > 1"):
        Learner(copy.deepcopy(model), generation_copy=False, behav_imp_weight_cap=1.0)


def test_rows_sampled_at_a_temperature_give_weight_one():
    """Rows sampled at T = 0.7 and updated at once: the learner scores them at 0.7 too, so w = 1 and
    the behaviour KL is 0 (at T = 1 the sharpened model's w would range far from 1)."""
    model, tok = tiny("qwen3", seed=0)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(3.0)             # sharper logits: the temperature matters
    learner = Learner(model, kl_coef=0.01, ref_model=copy.deepcopy(model))
    prompts = [tok.encode(s) for s in ("hello there", "The quick brown fox", "ls -la")]
    outs = generate(learner.gen_model, prompts, 12, temperature=0.7, seed=0)
    rows = [p + o.tokens for p, o in zip(prompts, outs)]
    masks = [[0] * len(p) + [1] * len(o.tokens) for p, o in zip(prompts, outs)]
    lps = [[0.0] * len(p) + o.logprobs for p, o in zip(prompts, outs)]
    batch = make_batch(rows, masks, lps, [1.0, -1.0, 0.5], temperatures=[0.7] * 3)
    w = torch.exp(learner.logprobs_of(batch) - batch.behav_logprobs)[batch.loss_mask.bool()]
    assert (w - 1).abs().max().item() < 1e-4
    at_one = torch.exp(learner.logprobs_of(batch, temperature=1.0) - batch.behav_logprobs)[batch.loss_mask.bool()]
    assert (at_one - 1).abs().max().item() > 0.1, "the fixture does not tell T = 0.7 from T = 1"
    stats = learner.update(batch)
    assert stats["is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert abs(stats["behav_kl"]) < 1e-6 and abs(stats["kl_ref"]) < 1e-5
    # greedy rows (T = 0) carry untempered logprobs and are scored at T = 1
    assert make_batch(rows, masks, lps, [0.0] * 3, temperatures=0.0).temperatures.tolist() == [1.0] * 3


def test_top_p_rows_are_refused():
    with pytest.raises(ValueError, match="top_p=0.9 cannot be trained on"):
        make_batch([[1, 2, 3]], [[0, 1, 1]], None, [1.0], top_p=0.9)
    with pytest.raises(ValueError, match="top_p=0.5 cannot be trained on"):
        make_batch([[1, 2, 3], [1, 2]], [[0, 1, 1], [0, 1]], None, [1.0, 1.0], top_p=[1.0, 0.5])
    assert make_batch([[1, 2, 3]], [[0, 1, 1]], None, [1.0], top_p=1.0).temperatures.tolist() == [1.0]


# ---------------------------------------------------------------------------------------------
# distributed, checkpoints


def test_torchrun_matches_single_process_and_resume_is_exact(tmp_path):
    """FSDP2 over 2 gloo ranks (uneven rows and micro-batches per rank, value head, k3 KL, entropy, SFT,
    a stale row) gives the single process's losses and weights; both resume a checkpoint exactly."""
    single = dist_run(Dist(), str(tmp_path / "single_ckpt"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:       # a free port, so parallel test runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           str(REPO / "tests" / "_ppo_dist.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    multi = torch.load(tmp_path / "out.pt", weights_only=False)

    for out in (single, multi):
        assert out["caller_state"] == {"stream_pos": 7}
        assert out["resumed_loss"] == out["next_loss"], "resumed run's next loss differs"
        assert torch.equal(out["resumed_rand"][0], out["next_rand"][0]) and \
            out["resumed_rand"][1] == out["next_rand"][1], "RNG state not restored"
        for k, v in out["weights"].items():
            assert torch.equal(out["resumed_weights"][k], v), f"resumed weights differ at {k}"
        assert out["version"] == 8 and out["stats"]["num_stale"] == 1
    for a, b in zip(single["loss"] + [single["next_loss"]], multi["loss"] + [multi["next_loss"]]):
        assert a == pytest.approx(b, abs=1e-5)
    assert single["grad_norm"] == pytest.approx(multi["grad_norm"], rel=1e-5)
    for k, v in single["weights"].items():
        torch.testing.assert_close(multi["weights"][k], v, rtol=0, atol=1e-5, msg=f"weights differ at {k}")
    torch.testing.assert_close(multi["value_head"], single["value_head"], rtol=0, atol=1e-5)
    # the weights moved (the comparison above is not between two untouched models)
    assert single["loss"][0] != single["next_loss"]


def test_checkpoint_completeness_and_corrupt_metadata(qwen3, tmp_path):
    """A checkpoint is complete only with its done.json marker (written last); a damaged .metadata is a
    one-line ValueError naming the dir, not an assert deep inside torch."""
    from ppo import DONE, checkpoint_path
    learner = Learner(copy.deepcopy(qwen3[0]), generation_copy=False)
    ckpt = str(tmp_path / "ckpt")
    learner.save(ckpt, caller_state={"step": 3})
    assert os.path.isfile(os.path.join(ckpt, DONE)) and checkpoint_path(ckpt) == ckpt
    assert learner.load(ckpt) == {"step": 3}
    half = tmp_path / "half"                 # DCP finished its .metadata, the marker never came
    half.mkdir()
    (half / ".metadata").write_bytes((Path(ckpt) / ".metadata").read_bytes())
    assert checkpoint_path(str(half)) is None
    with pytest.raises(ValueError, match="no complete checkpoint at .*half"):
        learner.load(str(half))
    (Path(ckpt) / ".metadata").write_bytes(b"garbage, not a pickle")
    with pytest.raises(ValueError, match=r"checkpoint .*ckpt is corrupt") as e:
        learner.load(ckpt)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# generate <-> learner, and a learning signal


def test_learner_logprobs_match_generate():
    model, tok = tiny("qwen3_5", seed=0)
    learner = Learner(model, kl_coef=0.0)
    prompts = [tok.encode(s) for s in ("hello there", "The quick brown fox", "ls -la")]
    outs = generate(learner.gen_model, prompts, 12, temperature=0.7, seed=0)
    batch = make_batch([p + o.tokens for p, o in zip(prompts, outs)],
                       [[0] * len(p) + [1] * len(o.tokens) for p, o in zip(prompts, outs)],
                       [[0.0] * len(p) + o.logprobs for p, o in zip(prompts, outs)], [0.0] * 3)
    lp = learner.logprobs_of(batch, temperature=0.7)
    diff = ((lp - batch.behav_logprobs) * batch.loss_mask).abs().max().item()
    print(f"max |learner - generate| logprob difference: {diff:.2e}")
    assert diff < 1e-4
    plain = logprobs_of(learner.gen_model, batch.tokens, batch.lengths, temperature=0.7)   # no Learner
    assert ((plain - batch.behav_logprobs) * batch.loss_mask).abs().max().item() < 1e-4


def test_learns_to_say_the_secret_word(qwen3):
    """Reward 1 if the completion contains "Paris" (one token of ~975: ~1% of random completions).
    Groups of 8 samples of one prompt, group advantages, flat groups dropped, one step per batch."""
    model, tok = qwen3
    torch.manual_seed(0)
    learner = Learner(copy.deepcopy(model), lr=3e-3, kl_coef=0.0, gradient_checkpointing=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the secret word?"}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    G, num_groups, history = 8, 8, []
    for it in range(40):
        outs = generate(learner.gen_model, [prompt] * (G * num_groups), 8, temperature=1.0,
                        stop_token_ids=[tok.eos_token_id], seed=it)
        rewards = [float("Paris" in tok.decode(o.tokens)) for o in outs]
        history.append(sum(rewards) / len(rewards))
        if history[-1] > 0.8:
            break
        adv, keep = group_advantages(rewards, [i // G for i in range(len(outs))])
        idx = [i for i in range(len(outs)) if keep[i]]
        if not idx:
            continue
        batch = make_batch([prompt + outs[i].tokens for i in idx],
                           [[0] * len(prompt) + [1] * len(outs[i].tokens) for i in idx],
                           [[0.0] * len(prompt) + outs[i].logprobs for i in idx], [adv[i] for i in idx],
                           versions=[learner.version] * len(idx))
        learner.update(batch)
    print("secret-word reward per update:", [round(r, 2) for r in history])
    assert history[0] < 0.2, "the task is too easy at the start to show learning"
    assert history[-1] > 0.8, f"reward did not rise above 0.8 in 40 updates: {history}"


def test_reset_optimizer_makes_the_next_step_a_fresh_adamw_step(qwen3):
    """After reset_optimizer (rime.py calls it at the end of the warm start) the next update is exactly the
    update a new Learner would make from the same weights: no moments carried over. Without the reset the
    carried moments make it differ."""
    model, _ = qwen3
    sft = make_batch([[5, 6, 7, 8, 9]], [[0, 0, 0, 0, 0]], sft_mask=[[0, 1, 1, 1, 1]])

    def rl(learner):        # rows of the learner's current version (max_lag 0 drops older ones)
        return make_batch([[5, 6, 7, 8]], [[0, 1, 1, 1]], [[0.0, -2.0, -2.0, -2.0]], [1.0], versions=[learner.version])

    def after(reset: bool):
        learner = Learner(copy.deepcopy(model), lr=1e-2, kl_coef=0.0, generation_copy=False)
        for _ in range(3):
            learner.update(sft)
        start = copy.deepcopy(learner.policy.model)
        if reset:
            learner.reset_optimizer()
        assert learner.update(rl(learner))["skipped"] == 0.0
        fresh = Learner(start, lr=1e-2, kl_coef=0.0, generation_copy=False)
        fresh.update(rl(fresh))
        return [torch.equal(p, q) for p, q in zip(learner.policy.parameters(), fresh.policy.parameters())]
    assert all(after(reset=True))
    assert not all(after(reset=False))
