"""rewards.py against hand-computed values and small independent references."""

import math
import random

import pytest
import torch

from rewards import (actor_advantages, cumulative_gain, cumulative_reward, gae, group_advantages,
                     mean_reversion_corr, normalized_score, past_baseline, stream_metrics,
                     writer_format_ok, writer_reward_gated, writer_rewards, writer_rewards_gated,
                     writer_windows)

# ---------------------------------------------------------------------------------------------
# writer window

SCORES = [0.2, 0.5, 1.0, 0.0, 0.8]


def test_writer_window_k2_by_hand():
    # t=0: next (.5+1)/2=.75, past .2        -> .55  (past window clipped at the start)
    # t=1: next (1+0)/2=.5,   past (.2+.5)/2 -> .15
    # t=2: next (0+.8)/2=.4,  past (.5+1)/2  -> -.35
    # t=3: next .8 (clipped), past (1+0)/2   -> .3
    # t=4: no next task                      -> 0.0, not trained on
    assert writer_rewards(SCORES, 2) == pytest.approx([0.55, 0.15, -0.35, 0.3, 0.0])
    w = writer_windows(SCORES, 2)
    assert [x.trainable for x in w] == [True, True, True, True, False]
    assert w[4].next_mean is None and w[4].past_mean == pytest.approx(0.4)
    assert w[0].past_mean == pytest.approx(0.2) and w[0].next_mean == pytest.approx(0.75)


def test_writer_window_k1_by_hand():
    assert writer_rewards(SCORES, 1) == pytest.approx([0.3, 0.5, -1.0, 0.8, 0.0])


def test_writer_window_k_larger_than_stream():
    # every window is clipped to what exists: next = all later tasks, past = all tasks so far
    expected = [
        (0.5 + 1.0 + 0.0 + 0.8) / 4 - 0.2,
        (1.0 + 0.0 + 0.8) / 3 - (0.2 + 0.5) / 2,
        (0.0 + 0.8) / 2 - (0.2 + 0.5 + 1.0) / 3,
        0.8 - (0.2 + 0.5 + 1.0 + 0.0) / 4,
        0.0,
    ]
    assert writer_rewards(SCORES, 10) == pytest.approx(expected)


def test_writer_window_edges_and_bad_k():
    assert writer_rewards([], 3) == []
    assert writer_rewards([0.7], 3) == [0.0]
    assert writer_windows([0.7], 3)[0].trainable is False
    with pytest.raises(AssertionError, match="k must be"):
        writer_rewards(SCORES, 0)


def test_writer_window_matches_one_indexed_formula():
    # RIME's 1-indexed form: R(M_k) = mean r[k+1..k+K] - mean r[k-K+1..k]
    rng = random.Random(0)
    for _ in range(50):
        n, K = rng.randint(1, 9), rng.randint(1, 5)
        r = [None] + [rng.random() for _ in range(n)]           # r[1..n]
        got = writer_rewards(r[1:], K)
        for k in range(1, n + 1):
            nxt = [r[j] for j in range(k + 1, k + K + 1) if j <= n]
            past = [r[j] for j in range(k - K + 1, k + 1) if j >= 1]
            want = sum(nxt) / len(nxt) - sum(past) / len(past) if nxt else 0.0
            assert got[k - 1] == pytest.approx(want)


def test_writer_reward_gate():
    assert writer_reward_gated(0.5, True) == pytest.approx(0.6)
    assert writer_reward_gated(-0.3, True) == pytest.approx(-0.2)
    assert writer_reward_gated(0.5, False) == 0.0
    assert writer_reward_gated(-0.5, False) == 0.0


def test_the_floor_gate_puts_a_malformed_memory_below_every_well_formed_one():
    # RIME's gate pays a malformed memory 0, above a well-formed one whose next window is harder
    for delta in (-1.0, -0.5, -0.11, 0.0, 0.7, 1.0):
        assert writer_reward_gated(delta, False, gate="floor") < writer_reward_gated(delta, True, gate="floor")
        assert writer_reward_gated(delta, True, gate="floor") == writer_reward_gated(delta, True)
    assert writer_reward_gated(-0.5, False) > writer_reward_gated(-0.5, True)


GOOD = """### Repository Knowledge
- Tests run with `pytest -x tests/`.
- The CSV exporter is `src/tablib/formats/_csv.py`.
### Lessons & Pitfalls
- Read the failing test first.
- Keep patches small.
"""


def test_writer_rewards_gated_stream():
    bad = "just some text"
    mems = [GOOD, bad, GOOD + "- one more\n", GOOD.replace("small", "minimal"), GOOD]
    olds = [""] + mems[:-1]
    out = writer_rewards_gated(SCORES, 2, mems, olds)
    assert [o.ok for o in out] == [True, False, True, True, True]
    assert out[0].reward == pytest.approx(0.55 + 0.1)
    assert out[1].reward == 0.0 and out[1].delta == pytest.approx(0.15) and out[1].format_reasons
    assert out[2].reward == pytest.approx(-0.35 + 0.1)
    assert out[4].reward == 0.0 and not out[4].trainable   # last memory: no reward, even if ok
    with pytest.raises(AssertionError, match="one memory per task"):
        writer_rewards_gated(SCORES, 2, mems[:2], olds)
    floored = writer_rewards_gated(SCORES, 2, mems, olds, gate="floor")
    assert floored[1].reward == -1.0 and [o.reward for i, o in enumerate(floored) if i != 1] == [
        o.reward for i, o in enumerate(out) if i != 1]


def test_mean_reversion_bias():
    # iid scores at K=1: delta = s[t+1] - s[t], past = s[t] -> corr = -1/sqrt(2) ~ -0.71,
    # the bias RIME's code reports (-0.74) from pure noise
    rng = random.Random(1)
    deltas, pasts = [], []
    for _ in range(400):
        for w in writer_windows([rng.random() for _ in range(12)], 1):
            if w.trainable:
                deltas.append(w.delta)
                pasts.append(w.past_mean)
    assert mean_reversion_corr(deltas, pasts) == pytest.approx(-1 / math.sqrt(2), abs=0.05)
    assert mean_reversion_corr([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert math.isnan(mean_reversion_corr([1.0], [2.0]))
    assert math.isnan(mean_reversion_corr([1.0, 2.0], [5.0, 5.0]))


def test_the_past_baseline_removes_the_lucky_past_and_keeps_the_signal():
    """By hand: in a group whose rewards are -past (pure mean reversion) the baseline leaves them equal;
    a group of equal rewards stays equal (still dropped); the logged reward is never touched. Then a
    simulation of writer groups, in which what the memory is worth to the next window (+0.2) is buried
    under the past window's luck: with the baseline the advantage tells good memories from bad far better,
    and on average the good memories' advantage is positive either way (the baseline adds no bias)."""
    pasts = [0.2, 0.6, 0.1, 0.4, 0.5, 0.3, 0.9, 0.7, 0.8, 0.1, 0.3, 0.9, 0.3, 0.9]
    rewards, groups = [-p for p in pasts[:12]] + [0.0, 0.0], ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"] * 2
    adjusted, slope = past_baseline(rewards, pasts, groups)
    assert slope == pytest.approx(-1.0)
    for g in "abc":
        assert max(a for a, i in zip(adjusted, groups) if i == g) == pytest.approx(min(a for a, i in zip(adjusted, groups) if i == g))
    assert adjusted[12:] == [0.0, 0.0] and rewards[12:] == [0.0, 0.0] and rewards[0] == -0.2
    assert past_baseline(rewards[:4], pasts[:4], groups[:4])[1] == 0.0      # 3 degrees of freedom: too few to fit
    assert past_baseline([0.1, 0.3], [0.5, 0.5], ["a", "a"]) == ([0.1, 0.3], 0.0)   # no spread in past

    rng = random.Random(0)
    good, pasts, rewards, gids = [], [], [], []
    for g in range(40):                     # one RL step's batch: 40 groups of 4 copies, the slope pooled
        for _ in range(4):
            q, p = rng.random() < 0.5, rng.gauss(0.5, 0.3)
            good.append(q), pasts.append(p), gids.append(g)
            rewards.append(0.5 + 0.2 * q + rng.gauss(0, 0.05) - p + 0.1)
    adjusted, slope = past_baseline(rewards, pasts, gids)
    assert -1.1 < slope < -0.8
    rows = {}
    for name, rs in (("group", rewards), ("past", adjusted)):
        adv, keep = group_advantages(rs, gids)
        rows[name] = [(a, q) for a, q, k in zip(adv, good, keep) if k]

    def separation(pairs):          # mean advantage of good minus bad memories
        good = [a for a, q in pairs if q]
        bad = [a for a, q in pairs if not q]
        return sum(good) / len(good) - sum(bad) / len(bad)
    assert separation(rows["past"]) > 2 * separation(rows["group"]) > 0


# ---------------------------------------------------------------------------------------------
# writer format gate


def test_format_ok_good():
    assert writer_format_ok(GOOD, "") == (True, [])
    numbered = GOOD.replace("- Read", "1. Read").replace("- Keep", "2. Keep")
    assert writer_format_ok(numbered, GOOD)[0]


@pytest.mark.parametrize("memory, old, prompt, reason", [
    (GOOD.replace("### Lessons & Pitfalls", "## Lessons"), "", None, "missing header"),
    (GOOD.replace("- Keep patches small.\n", ""), "", None, "has 1 bullets"),
    (GOOD.replace("- Tests", "Tests"), "", None, "has 1 bullets"),
    (GOOD + "### Notes\n- extra\n", "", None, "extra header"),
    (GOOD + "#### Deep\n", "", None, "extra header"),
    (GOOD + "### Repository Knowledge\n- a\n- b\n", "", None, "duplicate header"),
    (GOOD + "- [Memory of what you've learned so far]\n", "", None, "prompt echo"),
    (GOOD + "<|im_end|>", "", None, "prompt echo"),
    (GOOD + "- Rewrite the memory so the next task goes better.\n", "",
     "You are the writer.\nRewrite the memory so the next task goes better.\n", "prompt echo"),
    (GOOD, GOOD, None, "verbatim copy"),
    ("  " + GOOD.replace("\n", "\n\n"), GOOD, None, "verbatim copy"),
])
def test_format_gate_failures(memory, old, prompt, reason):
    ok, reasons = writer_format_ok(memory, old, prompt)
    assert not ok
    assert any(reason in r for r in reasons), reasons


def test_format_gate_edge_passes():
    # bullets under a stray header do not count towards a section (and the header fails anyway)
    stray = "### Repository Knowledge\n- a\n### Other\n- b\n- c\n### Lessons & Pitfalls\n- d\n- e\n"
    ok, reasons = writer_format_ok(stray, "")
    assert not ok and any("has 1 bullets" in r for r in reasons)
    # a prompt line that was already in the old memory may stay; short prompt lines are ignored
    old = GOOD.replace("Keep patches small.", "Rewrite the memory so the next task goes better.")
    new = old + "- new fact `x.py`\n"
    assert writer_format_ok(new, old, "Rewrite the memory so the next task goes better.\nKeep")[0]
    # an edited memory is not a copy
    assert writer_format_ok(GOOD + "- `tox -e py311` works\n", GOOD)[0]


# ---------------------------------------------------------------------------------------------
# actor: group advantages and the exploration bonus


def test_group_advantages_by_hand():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.3]
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    adv, keep = group_advantages(rewards, groups, normalize_std=False)
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    assert keep == [True, True, True, True, False, False, False]   # b: all equal; c: alone
    adv, _ = group_advantages(rewards, groups, normalize_std=True)  # std of a = 0.5
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    adv, keep = group_advantages([0.2, 0.9], [(0, 3), (0, 3)], normalize_std=False)  # tuple ids
    assert adv == pytest.approx([-0.35, 0.35]) and keep == [True, True]


def test_actor_advantage_mode():
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    explore = [0.5, 0.5, 1.0, 0.0, 0.25, 0.75, 0.5, 0.5]
    out = actor_advantages(scores, groups, explore, beta=0.3, explore_keeps_group=False)
    # group 0: score std 0.5 -> score_adv ±1; explore mean 0.5, std sqrt(0.125)
    z = [0.0, 0.0, 0.5 / math.sqrt(0.125), -0.5 / math.sqrt(0.125)]
    assert out.score_adv[:4] == pytest.approx([1, -1, 1, -1], abs=1e-5)
    assert out.explore_bonus[:4] == pytest.approx([0.3 * v for v in z], abs=1e-5)
    assert out.advantages[:4] == pytest.approx([s + 0.3 * v for s, v in zip([1, -1, 1, -1], z)],
                                               abs=1e-5)
    # group 1 all failed: the strict reading drops it although the judge scores differ
    assert out.keep == [True] * 4 + [False] * 4
    assert out.advantages[4:] == [0.0] * 4 and out.num_groups == 2 and out.num_dropped_groups == 1
    # the default keeps it: exploration survives equal scores (its advantage is the bonus alone)
    kept = actor_advantages(scores, groups, explore, beta=0.3)
    assert kept.keep == [True] * 8 and kept.num_dropped_groups == 0
    # ... but not when the judge scores are equal too: no signal at all
    flat = actor_advantages(scores, groups, [0.5, 0.5, 1.0, 0.0, 0.3, 0.3, 0.3, 0.3], beta=0.3)
    assert flat.keep == [True] * 4 + [False] * 4
    z1 = [-0.25 / math.sqrt(0.03125), 0.25 / math.sqrt(0.03125), 0.0, 0.0]
    assert kept.advantages[4:] == pytest.approx([0.3 * v for v in z1], abs=1e-5)


def test_actor_reward_mode_and_errors():
    scores, groups = [1.0, 0.0, 0.0, 0.0], ["g"] * 4
    explore = [0.0, 1.0, 0.0, 0.5]
    out = actor_advantages(scores, groups, explore, mode="reward", lam=0.5, normalize_std=False)
    shaped = [1.0, 0.5, 0.0, 0.25]
    assert out.rewards == pytest.approx(shaped)
    assert out.advantages == pytest.approx([s - sum(shaped) / 4 for s in shaped])
    assert out.explore_bonus == [0.0] * 4
    # in reward mode the shaped reward decides what is dropped: an all-fail group survives
    out = actor_advantages([0.0, 0.0], ["g", "g"], [0.0, 1.0], mode="reward", lam=0.1)
    assert out.keep == [True, True]
    with pytest.raises(AssertionError, match="mode"):
        actor_advantages(scores, groups, explore, mode="bogus")
    with pytest.raises(AssertionError, match="one group id"):
        actor_advantages(scores, groups[:3], explore)


# ---------------------------------------------------------------------------------------------
# GAE and whitening


def test_gae_masked_by_hand():
    # positions: 0 prompt | 1,2 action | 3,4 observation | 5,6 action | 7 pad
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 9.0, 9.0, 0.7, 0.8, 9.0]])  # 9s must never be used
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 1.0, 0.0]])  # 0.2 arrives with the obs
    g, l = 0.9, 0.8
    # over the policy subsequence (v .5 .6 .7 .8; r 0 .2 0 1, the obs reward credited to pos 2):
    a6 = 1.0 - 0.8                                  # terminal: next value 0
    a5 = (0.0 + g * 0.8 - 0.7) + g * l * a6
    a2 = (0.2 + g * 0.7 - 0.6) + g * l * a5         # next value is pos 5's, across the obs
    a1 = (0.0 + g * 0.6 - 0.5) + g * l * a2
    adv, ret = gae(rewards, values, mask, gamma=g, lam=l)
    expected = torch.tensor([[0, a1, a2, 0, 0, a5, a6, 0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.allclose(ret, torch.where(mask.bool(), expected + values, torch.zeros(1, 8)))
    assert a1 == pytest.approx(0.2906176)


def _gae_reference(r, v, gamma, lam):
    # textbook GAE on a plain list, terminal after the last step
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nv = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * nv - v[t] + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_batch_matches_compacted_reference():
    torch.manual_seed(0)
    B, T = 3, 12
    mask = (torch.rand(B, T) > 0.4).long()
    mask[:, 0] = 0                                  # a prompt token first
    mask[2] = 0                                     # a row with no policy token at all
    values = torch.randn(B, T, requires_grad=True)
    rewards = torch.zeros(B, T)
    for b in range(2):
        last = mask[b].nonzero().max().item()
        rewards[b, last] = 1.0 + b
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    assert adv.shape == (B, T) and not adv.requires_grad
    for b in range(2):
        idx = mask[b].nonzero().flatten().tolist()
        ref = _gae_reference(rewards[b, idx].tolist(), values[b, idx].tolist(), 0.95, 0.9)
        assert adv[b, idx].tolist() == pytest.approx(ref, abs=1e-5)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    # gamma = lam = 1 with one terminal reward: A_t = R - V_t on every policy token
    adv1, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    m = mask[0].bool()
    assert torch.allclose(adv1[0, m], 1.0 - values[0, m].detach(), atol=1e-5)


def test_gae_rejects_bad_input():
    mask = torch.tensor([[0, 1, 1]])
    with pytest.raises(AssertionError, match="before the row's first policy token"):
        gae(torch.tensor([[1.0, 0.0, 0.0]]), torch.zeros(1, 3), mask)
    with pytest.raises(AssertionError, match=r"\[B, T\]"):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3))


# ---------------------------------------------------------------------------------------------
# stream metrics


def test_cumulative_reward_and_gain():
    with_mem = [1.0, 0.5, 0.0, 1.0]
    assert cumulative_reward(with_mem) == 2.5
    assert cumulative_gain(with_mem, [0.5, 0.5, 0.5, 0.5]) == pytest.approx(0.5)
    # several from-scratch attempts per task are averaged first (the benchmark: 4 attempts)
    scratch = [[1.0, 0.0, 0.0, 1.0], 0.25, [0.0], [1.0, 1.0]]
    assert cumulative_gain(with_mem, scratch) == pytest.approx(2.5 - (0.5 + 0.25 + 0.0 + 1.0))
    with pytest.raises(AssertionError, match="from-scratch"):
        cumulative_gain(with_mem, [0.5])
    with pytest.raises(AssertionError, match="empty"):
        cumulative_gain([1.0], [[]])


def test_normalized_and_stream_metrics():
    assert normalized_score(10.55, 8.28, 19.0) == pytest.approx((10.55 - 8.28) / (19.0 - 8.28))
    assert math.isnan(normalized_score(1.0, 19.0, 19.0))
    m = stream_metrics([1.0, 0.5, 0.0], [[0.5, 0.5], 1.0, 0.0])
    assert m.cumulative_reward == 1.5 and m.cumulative_scratch == pytest.approx(1.5)
    assert m.cumulative_gain == pytest.approx(0.0)
    assert m.gains == pytest.approx([0.5, -0.5, 0.0])
    assert m.normalized == pytest.approx(0.0)          # r_max defaults to the stream length
    assert stream_metrics([1.0], [0.0], r_max=2.0).normalized == pytest.approx(0.5)


def test_mean_ci95():
    from rewards import mean_ci95
    m, lo, hi = mean_ci95([1.0, 2.0, 3.0, 4.0])
    # sd = 1.29099, t(3) = 3.182, half-width = 3.182 * 1.29099 / 2
    assert m == pytest.approx(2.5) and hi - m == pytest.approx(3.182 * 1.2909944 / 2, rel=1e-4)
    assert lo == pytest.approx(2 * m - hi)
    one = mean_ci95([0.7])
    assert one[0] == 0.7 and math.isnan(one[1]) and math.isnan(one[2])
    assert math.isnan(mean_ci95([])[0])
    big = mean_ci95([float(i % 2) for i in range(100)])     # beyond the table: the normal's 1.96
    assert big[2] - big[0] == pytest.approx(1.96 * 0.50252 / 10, rel=1e-3)


def test_truncated_or_empty_writer_reply_fails_the_gate():
    """A memory cut at the cap passes the text checks but must fail the gate (rollout.write_memory's
    promise), and an empty reply too."""
    from rewards import writer_rewards_gated
    good = "### Repository Knowledge\n- a\n- b\n\n### Lessons & Pitfalls\n- c\n- d"
    scores, olds = [0.0, 1.0, 1.0], ["", good + "x", good + "y"]
    mems = [good, good + "z", good + "w"]
    plain = writer_rewards_gated(scores, 1, mems, olds)
    assert [r.ok for r in plain] == [True, True, True]
    cut = writer_rewards_gated(scores, 1, mems, olds, statuses=["truncated", "ok", "empty"])
    assert [r.ok for r in cut] == [False, True, False] and cut[0].reward == 0.0
    assert "the reply was truncated" in cut[0].format_reasons
