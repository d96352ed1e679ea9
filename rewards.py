"""Rewards: the writer's windowed reward, the actor's advantage with the exploration bonus,
critic-free group advantages, GAE over masked token sequences, and the stream metrics.

RIME (see the README) trains one model in two roles on a *stream* of
tasks. After task t the **writer** rewrites the memory M_t that the actor will read on task t+1.
The writer is paid for the improvement its notes bring downstream, not for their length:

    R(M_t) = ok · (mean r[t+1 .. t+K] − mean r[t−K+1 .. t]) + 0.1 · ok

with `ok` the format check (`writer_format_ok`) and both windows clipped at the stream's edges.
The last memory of a stream has no later task: it gets no reward and is not trained on.
The delta form regresses to the mean (a bad past window is followed, on average, by a better
one whatever the notes say); the paper measures corr(delta, past mean) = −0.74 at K = 1, so
`mean_reversion_corr` is logged beside the reward.

The **actor** is paid its task score. RIME adds an exploration bonus from the judge (judge.py) to
the *advantage*, not the reward: A_i = GRPO(score)_i + β · z_i, where z is the judge score
standardised within the sample's group. The plain reward form `score + λ · explore` is kept as
an option for the ablation.

CAMG-RL instead trains with a critic: `gae` computes GAE over a token sequence in which only the
policy's own tokens (mask 1) are actions; prompt and observation tokens are skipped.

Everything here is a pure function of plain Python numbers (sample-level: a handful per group)
or torch tensors (token-level, [B, T]); each returns its total together with named parts so the
caller can log them. Simplifications: population standard deviations (as GRPO-Zero), and the
whole batch is one process.
"""

import math
import re
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------------------------
# writer: windowed reward


@dataclass
class WriterWindow:
    """The two windows around memory M_t (written after task t), for logging."""
    t: int                      # index of the task after which the memory was written
    past_mean: float            # mean(scores[max(0, t−K+1) : t+1]); never empty (holds task t)
    next_mean: float | None     # mean(scores[t+1 : t+1+K]); None when t is the stream's last task
    delta: float                # next_mean − past_mean, 0.0 where next_mean is None
    trainable: bool             # False for the last memory of a stream: nothing read it


def writer_windows(scores, k):
    """Per task t of one stream: the past window (ending at t, inclusive), the next window
    (starting at t+1), their delta and whether M_t is trained on. Windows are clipped at the
    stream's ends, so early and late tasks average over fewer than k scores."""
    assert isinstance(k, int) and k >= 1, f"window size k must be an int >= 1, got {k!r}"
    scores = [float(s) for s in scores]
    n = len(scores)
    out = []
    for t in range(n):
        past = scores[max(0, t - k + 1): t + 1]   # K scores ending at t (the task M_t learned from)
        nxt = scores[t + 1: t + 1 + k]            # K scores from M_t on (M_t is read at t+1)
        past_mean = sum(past) / len(past)
        if nxt:
            next_mean = sum(nxt) / len(nxt)
            out.append(WriterWindow(t, past_mean, next_mean, next_mean - past_mean, True))
        else:
            out.append(WriterWindow(t, past_mean, None, 0.0, False))
    return out


def writer_rewards(scores, k):
    """Per task t: mean(scores[t+1 : t+1+k]) − mean(scores[max(0,t−k+1) : t+1]).

    Windows are clipped at the stream's ends; 0.0 where the next window is empty (the stream's
    last memory: it is not trained on, see `writer_windows(...)[t].trainable`). The format gate
    and the +0.1 bonus are applied by the caller with `writer_reward_gated`.
    """
    return [w.delta for w in writer_windows(scores, k)]


GATE_FLOOR = -1.0   # below every well-formed memory's reward: scores lie in [0, 1], so delta + bonus >= -0.9


def writer_reward_gated(delta, ok, bonus=0.1, gate="zero"):
    """R = ok · delta + bonus · ok: a memory that fails the format check earns exactly 0, so
    the writer cannot be paid for a lucky next task with a malformed memory. That 0 is above a
    well-formed memory whose next window is harder than its past by more than the bonus (delta <
    -0.1: a third of the positions on easy->hard streams), so there the gate pays the malformed one.
    gate="floor" (not RIME's; docs/results.md) gives a malformed memory GATE_FLOOR instead, below
    every well-formed one, and leaves a well-formed memory's reward as it is."""
    if not ok:
        return GATE_FLOOR if gate == "floor" else 0.0
    return float(delta) + bonus


@dataclass
class WriterReward:
    """Total writer reward of one memory and its named parts (all logged)."""
    reward: float               # ok · delta + bonus · ok
    delta: float                # next_mean − past_mean (before gating)
    format_bonus: float         # bonus · ok
    ok: bool                    # format check passed
    past_mean: float
    next_mean: float | None
    trainable: bool             # False for the stream's last memory: drop it from the batch
    format_reasons: list = field(default_factory=list)  # why the check failed (empty if ok)


def writer_rewards_gated(scores, k, memories, old_memories, prompt_text=None, bonus=0.1, statuses=None,
                         gate="zero"):
    """Everything for one stream at once: memories[t] is M_t (written after task t) and
    old_memories[t] the memory the writer was given (M_{t−1}; "" at the start). statuses[t], if
    given, is the writer's reply status (rollout.WriterSample.status): a reply that was cut at the
    memory cap ("truncated") or empty fails the gate whatever the text it left."""
    assert len(memories) == len(scores) == len(old_memories), (
        f"one memory per task: got {len(scores)} scores, {len(memories)} memories, "
        f"{len(old_memories)} old memories")
    statuses = statuses or ["ok"] * len(scores)
    out = []
    for w, mem, old, status in zip(writer_windows(scores, k), memories, old_memories, statuses):
        ok, reasons = writer_format_ok(mem, old, prompt_text)
        if status != "ok":
            ok, reasons = False, list(reasons) + [f"the reply was {status}"]
        out.append(WriterReward(
            reward=writer_reward_gated(w.delta, ok, bonus, gate) if w.trainable else 0.0,
            delta=w.delta, format_bonus=bonus if ok else 0.0, ok=ok, past_mean=w.past_mean,
            next_mean=w.next_mean, trainable=w.trainable, format_reasons=reasons))
    return out


def mean_reversion_corr(deltas, past_means):
    """Pearson correlation of writer deltas with their past-window means, pooled over the
    trainable memories of a batch. Strongly negative means the reward mostly measures mean
    reversion rather than the notes. NaN when undefined (fewer than 2 points or no spread)."""
    x = [float(v) for v in past_means]
    y = [float(v) for v in deltas]
    assert len(x) == len(y), f"{len(deltas)} deltas vs {len(past_means)} past means"
    n = len(x)
    if n < 2:
        return float("nan")
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx <= 0.0 or syy <= 0.0:
        return float("nan")
    return sxy / math.sqrt(sxx * syy)


MIN_DOF = 8


def past_baseline(rewards, past_means, group_ids, tol=1e-9):
    """A state baseline for the writer's windowed reward, against its mean reversion. The past window is
    played before the memory is written, so any function of it is a baseline: subtracting it leaves the
    policy gradient's expectation (and the reward itself, which is what is logged) unchanged and removes
    variance. Within each (stream, position) group, reward and past mean are centred on their group means;
    the pooled least-squares slope of one on the other (negative when the delta mostly measures how lucky
    the past window was: measured corr -0.36 to -0.91 a step) gives

        adjusted_i = reward_i - slope * (past_i - mean of past in i's group)

    for GRPO to normalise as usual. A group whose rewards are all equal carries no signal and stays so
    (its rewards are returned unchanged, so group_advantages still drops it). With fewer than MIN_DOF
    centred points beyond one per group the slope would fit the memories' own effect away (one group of
    two: always), so it is 0 there. -> (adjusted, slope)."""
    rewards = [float(r) for r in rewards]
    past_means = [float(p) for p in past_means]
    assert len(rewards) == len(past_means) == len(group_ids), "one past mean and group id per reward"
    live, sxy, sxx, dof = [], 0.0, 0.0, 0
    for idx in _groups(group_ids).values():
        rs, ps = [rewards[i] for i in idx], [past_means[i] for i in idx]
        if max(rs) - min(rs) <= tol:
            continue
        mr, mp = sum(rs) / len(rs), sum(ps) / len(ps)
        sxy += sum((r - mr) * (p - mp) for r, p in zip(rs, ps))
        sxx += sum((p - mp) ** 2 for p in ps)
        live.append((idx, mp))
        dof += len(idx) - 1
    slope = sxy / sxx if sxx > tol and dof >= MIN_DOF else 0.0
    out = list(rewards)
    for idx, mp in live:
        for i in idx:
            out[i] = rewards[i] - slope * (past_means[i] - mp)
    return out, slope


# ----------------------------------------------------------------------------------------------
# writer: format gate

MEMORY_HEADERS = ("### Repository Knowledge", "### Lessons & Pitfalls")
MIN_BULLETS = 2
# text that only appears in memory when the writer parrots its prompt or the chat template
ECHO_MARKERS = ("[Memory of what you've learned so far]", "<|im_start|>", "<|im_end|>",
                "<|endoftext|>", "<|eot_id|>", "<think>", "</think>", "<action>", "</action>")
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+\S")


def _norm_lines(text):
    # whitespace-insensitive comparison: trailing spaces and blank lines are not "changes"
    return [" ".join(line.split()) for line in text.strip().splitlines() if line.strip()]


def writer_format_ok(memory, old_memory, prompt_text=None):
    """The writer's format check -> (ok, reasons). ok needs all of:

    - both headers `### Repository Knowledge` and `### Lessons & Pitfalls`, each exactly once;
    - at least 2 bullets (`- `, `* `, `+ ` or `1. `) under each;
    - no other line starting with `###`;
    - no prompt echo: none of ECHO_MARKERS, and, if `prompt_text` (the writer's fixed
      instruction text, *not* the trajectory, whose facts the memory is meant to keep) is given,
      none of its lines of 30+ characters verbatim (unless that line was already in old memory);
    - not a verbatim copy of `old_memory` (up to whitespace).
    reasons lists every failed condition, for logging.
    """
    assert isinstance(memory, str) and isinstance(old_memory, str), "memories must be str"
    reasons = []
    lines = memory.splitlines()
    sections = {h: None for h in MEMORY_HEADERS}   # header -> number of bullets under it
    current = None
    for line in lines:
        s = line.strip()
        if s.startswith("###"):
            h = s.rstrip()
            if h in sections:
                if sections[h] is not None:
                    reasons.append(f"duplicate header {h!r}")
                sections[h] = 0
                current = h
            else:
                reasons.append(f"extra header {s[:60]!r}")
                current = None   # bullets under a stray header count for no section
        elif current is not None and _BULLET.match(line):
            sections[current] += 1
    for h, num in sections.items():
        if num is None:
            reasons.append(f"missing header {h!r}")
        elif num < MIN_BULLETS:
            reasons.append(f"{h!r} has {num} bullets (needs >= {MIN_BULLETS})")

    for m in ECHO_MARKERS:
        if m in memory:
            reasons.append(f"prompt echo: contains {m!r}")
    if prompt_text:
        old_flat, mem_flat = " ".join(old_memory.split()), " ".join(memory.split())
        for p in _norm_lines(prompt_text):
            if len(p) >= 30 and p not in old_flat and p not in MEMORY_HEADERS and p in mem_flat:
                reasons.append(f"prompt echo: {p[:60]!r}")
                break
    if old_memory.strip() and _norm_lines(memory) == _norm_lines(old_memory):
        reasons.append("verbatim copy of the old memory")
    return (not reasons), reasons


# ----------------------------------------------------------------------------------------------
# actor: group-baseline advantages (critic-free) and the exploration bonus


def _groups(group_ids):
    """group id -> list of sample indices, in first-seen order."""
    out = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


def _mean_std(xs):
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))   # population std (GRPO-Zero)


def group_advantages(rewards, group_ids, normalize_std=True, eps=1e-6, tol=1e-9):
    """GRPO's critic-free baseline: A_i = r_i − mean(group), divided by (std(group) + eps) when
    normalize_std (Dr. GRPO argues for False: std-scaling up-weights near-unanimous groups).

    -> (advantages, keep). A group whose rewards are all equal (max − min <= tol; a group of
    one included) carries no learning signal: keep is False for its samples and their
    advantages are 0.0, so the caller drops them from the batch.
    """
    rewards = [float(r) for r in rewards]
    assert len(rewards) == len(group_ids), f"{len(rewards)} rewards vs {len(group_ids)} group ids"
    adv, keep = [0.0] * len(rewards), [False] * len(rewards)
    for idx in _groups(group_ids).values():
        rs = [rewards[i] for i in idx]
        if max(rs) - min(rs) <= tol:
            continue
        m, s = _mean_std(rs)
        for i in idx:
            adv[i] = (rewards[i] - m) / (s + eps) if normalize_std else rewards[i] - m
            keep[i] = True
    return adv, keep


def standardize_in_groups(values, group_ids, eps=1e-6, tol=1e-9):
    """z_i = (v_i − mean(group)) / (std(group) + eps); 0.0 in groups with no spread."""
    values = [float(v) for v in values]
    assert len(values) == len(group_ids), f"{len(values)} values vs {len(group_ids)} group ids"
    z = [0.0] * len(values)
    for idx in _groups(group_ids).values():
        vs = [values[i] for i in idx]
        if max(vs) - min(vs) <= tol:
            continue
        m, s = _mean_std(vs)
        for i in idx:
            z[i] = (values[i] - m) / (s + eps)
    return z


@dataclass
class ActorAdvantages:
    """Per-sample actor advantages (the total) and their named parts."""
    advantages: list            # what PPO multiplies: score_adv + explore_bonus (0.0 where dropped)
    keep: list                  # False: the sample's group carries no signal, drop it
    score_adv: list             # the group-baseline advantage of the (possibly shaped) reward
    explore_bonus: list         # β · z(explore) in "advantage" mode; 0.0 in "reward" mode
    rewards: list               # what the baseline was taken over: score, or score + λ·explore
    num_groups: int
    num_dropped_groups: int


def actor_advantages(scores, groups, explore, beta=0.3, mode="advantage", lam=0.1,
                     normalize_std=True, explore_keeps_group=True, eps=1e-6):
    """The actor's advantage with RIME's exploration bonus.

    scores: task scores; groups: a hashable group id per sample, e.g. (stream, position);
    explore: the judge's score in [0, 1] per sample (memory before/after that sample's task).

    mode "advantage" (RIME): A_i = GRPO(score)_i + beta · z_i, z = explore standardised within
        the group. The bonus only reorders credit between samples of one group; its scale is
        that of a standardised score, so beta = 0.3 is "a third of a std".
    mode "reward" (ablation): r_i = score_i + lam · explore_i, then A = GRPO(r).

    Dropped groups: "groups whose rewards are all equal are dropped". In "advantage" mode the
    reward is the task score, but a group whose scores are all equal (common early on: all 0) may
    still differ in what its memories found; that is exactly when exploration "keeps it searching".
    So by default (explore_keeps_group=True) such a group is kept whenever its judge scores vary,
    with A = beta · z: the exploration signal alone. explore_keeps_group=False drops it (the strict
    reading). In "reward" mode the shaped reward decides.
    """
    assert mode in ("advantage", "reward"), f"mode must be 'advantage' or 'reward', got {mode!r}"
    n = len(scores)
    assert len(groups) == n and len(explore) == n, (
        f"need one group id and one explore score per sample: {n} scores, {len(groups)} groups, "
        f"{len(explore)} explore")
    scores = [float(s) for s in scores]
    explore = [float(e) for e in explore]
    if mode == "reward":
        rewards = [s + lam * e for s, e in zip(scores, explore)]
        score_adv, keep = group_advantages(rewards, groups, normalize_std, eps)
        bonus = [0.0] * n
    else:
        rewards = scores
        score_adv, keep = group_advantages(rewards, groups, normalize_std, eps)
        z = standardize_in_groups(explore, groups, eps)
        if explore_keeps_group:   # keep a whole group if its judge scores have any spread
            for idx in _groups(groups).values():
                if any(z[i] != 0.0 for i in idx):
                    for i in idx:
                        keep[i] = True
        bonus = [beta * zi if k else 0.0 for zi, k in zip(z, keep)]
    adv = [a + b if k else 0.0 for a, b, k in zip(score_adv, bonus, keep)]
    gid = _groups(groups)
    num_dropped = sum(1 for idx in gid.values() if not keep[idx[0]])
    return ActorAdvantages(adv, keep, score_adv, bonus, rewards, len(gid), num_dropped)


# ----------------------------------------------------------------------------------------------
# token level: GAE over masked sequences


@torch.no_grad()
def gae(rewards, values, mask, gamma=1.0, lam=1.0):
    """Generalised Advantage Estimation over token sequences where only mask-1 tokens are actions.

    rewards, values, mask: [B, T]. Returns (advantages, returns), both [B, T] float32, zero where
    mask is 0; returns = advantages + values on policy tokens (the value head's target).

    The choice for prompt and observation tokens (mask 0): GAE runs over the *policy-token
    subsequence* of each row. A mask-0 token is skipped: it gets no advantage, and it does not
    cut the chain: the "next value" of a policy token is the value at the next policy token
    (even across an observation), and γ, λ discount per policy token, not per observation token.
    The value model's estimates at observation tokens are never used, because nobody acts there.
    A reward placed on a mask-0 token (e.g. an environment reward that arrives with the
    observation) is credited to the last policy token before it, the action that caused it.
    The chain ends after the last policy token of a row (terminal: next value 0), so put the
    episode's return there, or anywhere after it. Rows are right-padded with mask 0.
    """
    assert rewards.shape == values.shape == mask.shape and rewards.dim() == 2, (
        f"rewards, values, mask must all be [B, T]; got {tuple(rewards.shape)}, "
        f"{tuple(values.shape)}, {tuple(mask.shape)}")
    B, T = rewards.shape
    r = rewards.float()
    v = values.detach().float()
    m = mask.bool()
    dev = r.device
    # a reward with no action before it cannot be credited to anything: refuse it loudly
    first = torch.where(m.any(dim=1), m.float().argmax(dim=1),
                        torch.full((B,), T, device=dev))                     # [B]
    pre = torch.arange(T, device=dev).unsqueeze(0) < first.unsqueeze(1)      # [B, T]
    assert not (r[pre] != 0).any(), (
        "a reward sits before the row's first policy token (or in a row with none): "
        "no action can be credited with it; place rewards at or after a mask-1 token")

    zero = torch.zeros(B, device=dev)
    adv = torch.zeros(B, T, device=dev)
    next_value = zero                # value of the next policy token (0 past the last one)
    next_adv = zero                  # advantage of the next policy token
    pending = zero                   # rewards seen on mask-0 tokens after this position
    for t in reversed(range(T)):     # T vector steps over [B]; fine for T of a few thousand
        mt = m[:, t]
        rt = r[:, t] + pending       # fold observation rewards into the action before them
        delta = rt + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(mt, a, zero)
        next_value = torch.where(mt, v[:, t], next_value)
        next_adv = torch.where(mt, a, next_adv)
        pending = torch.where(mt, zero, pending + r[:, t])
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, returns


# ----------------------------------------------------------------------------------------------
# stream metrics


def _scratch_mean(x):
    # one from-scratch score, or several attempts of the same task (the benchmark: 4) averaged
    if isinstance(x, (list, tuple)):
        assert len(x) > 0, "a task's from-scratch attempts list is empty"
        return sum(float(v) for v in x) / len(x)
    return float(x)


def cumulative_reward(scores):
    """Sum of task scores over a stream (with memory). The 19-task stream's maximum is 19.0."""
    return float(sum(float(s) for s in scores))


def cumulative_gain(with_memory, from_scratch):
    """sum(with_memory) − sum(from_scratch), with from_scratch[t] either a float or a list of
    several attempts at task t from scratch (averaged first; the benchmark uses 4 attempts)."""
    assert len(with_memory) == len(from_scratch), (
        f"{len(with_memory)} with-memory scores vs {len(from_scratch)} from-scratch entries")
    return cumulative_reward(with_memory) - sum(_scratch_mean(x) for x in from_scratch)


def normalized_score(r, r_stateless, r_max):
    """(r − r_stateless) / (r_max − r_stateless): 0 = no better than without memory, 1 = the
    maximum. NaN when the stateless baseline is already at the maximum."""
    if r_max == r_stateless:
        return float("nan")
    return (float(r) - r_stateless) / (r_max - r_stateless)


@dataclass
class StreamMetrics:
    """Test-stream metrics (the benchmark's metrics), totals and per-task parts."""
    cumulative_reward: float     # sum of scores with memory
    cumulative_scratch: float    # sum of (averaged) from-scratch scores
    cumulative_gain: float       # the difference
    normalized: float            # normalized_score(cumulative_reward, cumulative_scratch, r_max)
    gains: list                  # gain_t = r_with_memory,t − r_from_scratch,t


# Student's t two-sided 95% critical values for 1..30 degrees of freedom (beyond: the normal's 1.96)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def mean_ci95(xs):
    """(mean, lo, hi): the mean and its 95% confidence interval, Student's t over the samples
    (e.g. held-out streams). One sample has no interval: lo = hi = nan."""
    xs = [float(x) for x in xs]
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, float("nan"), float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)
    return m, m - half, m + half


def stream_metrics(with_memory, from_scratch, r_max=None):
    """All stream metrics at once; r_max defaults to the stream length (best score 1 per task)."""
    scratch = [_scratch_mean(x) for x in from_scratch]
    total = cumulative_reward(with_memory)
    base = sum(scratch)
    r_max = float(len(with_memory)) if r_max is None else float(r_max)
    return StreamMetrics(total, base, cumulative_gain(with_memory, from_scratch),
                         normalized_score(total, base, r_max),
                         [float(w) - s for w, s in zip(with_memory, scratch)])
