"""The PPO objective: per-token quantities and losses, pure functions of [B, T] tensors.

ppo.py's Learner builds its loss from these (and re-exports them: `ppo.policy_loss`, `ppo.sft_loss`
...); nothing here knows of models, batches or ranks, and this module imports no other module of
the project. Every [B, T] tensor is aligned with the tokens of a forward: column t is about token t
(log p(tokens[t] | tokens[<t]), from the logits at t-1); column 0 is never trained.

The objective (AReaL's decoupled PPO). Three policies meet in one loss:
behaviour (the generator's weights when the row was sampled: `behav_logprobs`), proximal (the
learner's weights at the start of this update: `prox_logprobs`) and current (the weights being
trained: `logprobs`). Per policy token t, with A the advantage:
    r = pi_cur / pi_prox,  w = pi_prox / pi_behav (no gradient),
    loss_t = w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
and the loss is the token mean over the loss mask of the whole (global) batch (`num_tokens`). w
corrects for rows sampled by older weights; the trust region is measured against prox, so stale
rows are not all clipped. prox == behav (w = 1) is ordinary PPO. Two optional guards bound what a
far-off-policy token can do (both off by default; `policy_loss` says when to turn them on):
`behav_imp_weight_cap` (AReaL: tokens with w above the cap leave the loss) and `clip_ratio_c`
(verl's dual-clip: a negative-advantage token costs at most -A * c before w).

KL estimators, per policy token with d = logp_cur - logp_ref: k1 = d (RIME's), k3 = exp(-d) + d - 1
(Schulman's low-variance estimator, always >= 0). Both estimate KL(pi || ref) on pi's samples, and both
are used here as a loss term (as verl does), not subtracted from the reward. As a loss, k1's gradient
(grad logp) has zero mean on fresh samples: it only pulls back once samples are off-policy; k3's does not.

Temperature: generate reports logprobs of softmax(logits / T), so token_logprobs and token_entropy
take the row's T (a float, or one per row), and w is exactly 1 on synchronous rows at any T.
"""

import torch
import torch.nn.functional as F



def _tempered(logits: torch.Tensor, temperature) -> torch.Tensor:
    """logits[:, :-1] (the ones that predict tokens 1..T-1) in fp32, divided by the temperature: a float,
    or a [B] tensor with one temperature per row (Batch.temperatures)."""
    lg = logits[:, :-1].float()
    if torch.is_tensor(temperature):
        return lg / temperature.to(lg.device, lg.dtype)[:, None, None]
    return lg if temperature == 1.0 else lg / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """logits [B, T, V] of a forward over tokens [B, T] -> [B, T]: out[:, t] = log p(tokens[t] | tokens[<t])
    under softmax(logits / temperature) (generate's convention); out[:, 0] = 0. temperature: a float or a
    [B] tensor (one per row)."""
    B, T, V = logits.shape
    lg = _tempered(logits, temperature)
    # cross_entropy = fused log_softmax + gather: no second [B, T, V] tensor kept for backward
    lp = -F.cross_entropy(lg.reshape(-1, V), tokens[:, 1:].reshape(-1), reduction="none").view(B, T - 1)
    return F.pad(lp, (1, 0))


def token_entropy(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """Entropy of the next-token distribution softmax(logits / temperature) that chose token t:
    [B, T, V] -> [B, T] (0 at t = 0)."""
    lg = _tempered(logits, temperature)
    ent = torch.logsumexp(lg, -1) - (torch.softmax(lg, -1) * lg).sum(-1)
    return F.pad(ent, (1, 0))


def masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x where the bool mask m holds, 0 elsewhere."""
    # where, not multiply: garbage (inf / nan) at masked positions must not leak into loss or gradient
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_loss(logprobs, prox_logprobs, behav_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28,
                num_tokens=None, *, behav_imp_weight_cap=None, clip_ratio_c=None):
    """Token-level decoupled PPO, all tensors [B, T] (see the module docstring):
    sum(mask * w * max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high))) / num_tokens (default sum(mask)),
    r = exp(logprobs - prox_logprobs), w = exp(prox_logprobs - behav_logprobs) without gradient.
    -> (loss, stats); stats are 0-dim tensors over the same denominator: clipfrac (share of tokens
    whose clipped term is active, i.e. no gradient), approx_kl (k3 estimate of KL(prox || cur)),
    behav_kl (k3 of KL(behav || prox): how off-policy the rows are), is_weight (mean w).

    Two guards for asynchronous rows, both off by default (None) and both AReaL's / verl's semantics:
    - behav_imp_weight_cap (AReaL's `behav_imp_weight_cap`, > 1): a token whose w exceeds the cap is
      *masked out* of the loss (its weight set to 0, as AReaL does; it still counts in num_tokens), not
      clipped to the cap. Turn it on when rows are stale (max_lag >= 1) or the sampler runs in another
      precision than the learner (a bf16 generation copy): there w strays from 1, and one token with a
      huge w would otherwise dominate the gradient. stats["behav_cap_frac"]: share of tokens masked.
    - clip_ratio_c (verl's dual-clip `clip_ratio_c`, typically 3.0, > 1): for A < 0 the clipped term is
      further bounded, min(max(-A*r, -A*clip(r)), -A*c), so a negative-advantage token whose ratio r has
      run far above 1 (which PPO's max never bounds) costs at most -A*c before w. Turn it on for
      off-policy rows with negative advantages (async training, critic-free groups).
      stats["dualclip_frac"]: share of tokens where the bound is active."""
    shapes = [tuple(x.shape) for x in (logprobs, prox_logprobs, behav_logprobs, advantages, mask)]
    assert len(set(shapes)) == 1 and len(shapes[0]) == 2, f"policy_loss needs five [B, T] tensors, got {shapes}"
    if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 1.0:
        raise ValueError(f"behav_imp_weight_cap must be > 1 (or None), got {behav_imp_weight_cap}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None), got {clip_ratio_c}")
    m = mask.bool()
    n = m.sum().clamp(min=1) if num_tokens is None else num_tokens
    # sanitise first: a nan at a masked position would otherwise turn 0 * nan into a nan gradient
    prox = masked(prox_logprobs.detach(), m)
    behav = masked(behav_logprobs.detach(), m)
    adv = masked(advantages.detach().float(), m)
    log_r = masked(logprobs - prox, m)
    ratio = torch.exp(log_r)
    w = torch.exp(prox - behav)                                                     # no grad: detached inputs
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    if clip_ratio_c is not None:                    # dual-clip: bound the negative-advantage tokens
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (clipped > bound)
        clipped = torch.where(dual, bound, clipped)
    w_used = w
    if behav_imp_weight_cap is not None:            # AReaL: tokens past the cap leave the loss
        capped = w > behav_imp_weight_cap
        w_used = torch.where(capped, torch.zeros((), dtype=w.dtype, device=w.device), w)
    per_token = w_used * clipped
    loss = masked(per_token, m).sum() / n
    with torch.no_grad():
        log_w = prox - behav
        stats = {
            "pg_loss": loss.detach(),
            "clipfrac": masked((pg2 > pg1).float(), m).sum() / n,
            "approx_kl": masked(ratio - 1 - log_r, m).sum() / n,
            "behav_kl": masked(torch.exp(log_w) - 1 - log_w, m).sum() / n,
            "is_weight": masked(w, m).sum() / n,
        }
        if behav_imp_weight_cap is not None:
            stats["behav_cap_frac"] = masked(capped.float(), m).sum() / n
        if clip_ratio_c is not None:
            stats["dualclip_frac"] = masked(dual.float(), m).sum() / n
    return loss, stats


def value_loss(values, returns, mask, old_values=None, clip=0.2, num_tokens=None):
    """0.5 * token mean of (V - R)^2, PPO-clipped around old_values when given:
    max((V - R)^2, (old + clip(V - old, -clip, clip) - R)^2), so one update cannot move a value far."""
    m = mask.bool()
    n = m.sum().clamp(min=1) if num_tokens is None else num_tokens
    ret = masked(returns.detach().float(), m)
    v = masked(values.float(), m)
    err = (v - ret) ** 2
    if old_values is not None and clip is not None:
        old = masked(old_values.detach().float(), m)
        err = torch.maximum(err, (old + torch.clamp(v - old, -clip, clip) - ret) ** 2)
    return 0.5 * masked(err, m).sum() / n


def kl_to_ref(logprobs, ref_logprobs, estimator="k1"):
    """Per-token estimate of KL(pi || ref) on pi's samples, [B, T]: k1 = d, k3 = exp(-d) + d - 1, d = lp - ref."""
    d = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return d
    if estimator == "k3":
        return torch.exp(-d) + d - 1
    raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")


def sft_loss(logprobs, mask, num_tokens=None):
    """Cross-entropy on the mask-1 tokens (warm start: imitation rows trained beside PPO rows)."""
    m = mask.bool()
    n = m.sum().clamp(min=1) if num_tokens is None else num_tokens
    return -masked(logprobs, m).sum() / n
