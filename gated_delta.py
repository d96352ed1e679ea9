"""The gated delta rule: the recurrence of Qwen3.5's Gated DeltaNet layers, computed three ways.

Per head, with a state S [dk, dv], for each token (q, k [dk], v [dv], log decay g <= 0, beta in [0, 1]):

    S <- S * exp(g)                  forget
    S <- S + k (x) beta * (v - S^T k)  the delta rule: write what S mispredicts for k
    o  = S^T q

- `recurrent_gated_delta_rule`: token by token, the definition;
- `gated_delta_step_`: one decode token, updating the cache's state in place (a decode step is bound
  by moving the states, so it reads S once);
- `chunk_gated_delta_rule`: a whole prompt in chunks of 64, matmuls and triangular solves within a
  chunk (DeltaNet's UT transform), the chunks walked in order.
They agree to float precision (tests/test_model.py checks it). model.py's GatedDeltaNet (the layer:
projections, causal conv, gates, norm) calls them with fp32 tensors; they know nothing of the model
(only gated_delta_step_ changes its input: the state), and this module imports no other of the project.
"""

import torch
import torch.nn.functional as F


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token by token. q, k [B, H, T, dk]; v [B, H, T, dv]; g, beta [B, H, T]; state [B, H, dk, dv]; fp32."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()                      # forget: S <- S * exp(g)
        kv_mem = (k[:, :, t, None, :] @ state)[:, :, 0]                   # S^T k: what S predicts for k [B, H, dv]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]               # delta rule correction
        state = torch.addcmul(state, k[:, :, t, :, None], delta[:, :, None, :])  # S += k (x) delta
        out[:, :, t] = (q[:, :, t, None, :] @ state)[:, :, 0]             # o = S^T q
    return out, state


def gated_delta_step_(q, k, v, g, beta, state):
    """One decode token, updating `state` (the cache's) in place: the recurrent rule above, rearranged so
    that the state is read once for both S^T k and S^T q (taken from the old state, then corrected) and
    updated in place, since a decode step is bound by moving the states. q, k [B, H, dk]; v [B, H, dv];
    g, beta [B, H]; state [B, H, dk, dv] fp32. Returns o [B, H, dv]."""
    decay = g.exp()[..., None]                                            # [B, H, 1]
    k_mem, q_mem = (torch.stack([k, q], dim=2) @ state).unbind(2)         # S^T k, S^T q [B, H, dv]
    delta = (v - k_mem * decay) * beta[..., None]                         # v - (S exp(g))^T k, times beta
    state.mul_(decay[..., None]).addcmul_(k[..., :, None], delta[..., None, :])  # S <- S exp(g) + k (x) delta
    return q_mem * decay + (q * k).sum(-1, keepdim=True) * delta          # S_new^T q


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64):
    """The same rule, in chunks: within a chunk the T sequential updates become triangular solves and
    matmuls (the UT transform of DeltaNet); only the chunks are walked in order. Shapes as above."""
    B, H, T, dk = k.shape
    C = chunk_size
    pad = (C - T % C) % C   # zero padding: beta = 0 and g = 0 leave the state alone
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    # chunk-major [N, B, H, C, d]: each step of the walk below multiplies contiguous blocks
    q, k, v = (x.reshape(B, H, N, C, -1).permute(2, 0, 1, 3, 4).contiguous() for x in (q, k, v))
    g, beta = (x.reshape(B, H, N, C).permute(2, 0, 1, 3).contiguous() for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g_cum = g.cumsum(-1)                                                  # log decay from chunk start to i
    g_exp = g_cum.exp()[..., None]
    future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # [.., C, C] i>=j
    # (I + strict_lower(beta_i k_i.k_j decay_ij)) u = beta v : the per-token corrections inside the chunk
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g_exp, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                               # intra-chunk q.k, causal, decayed
    q_dec = q * g_exp                                                     # q reads the state decayed to i
    k_dec = k * (g_cum[..., -1:] - g_cum).exp()[..., None]                # k's write decays to chunk end
    k_dec = k_dec.transpose(-1, -2).contiguous()                          # [N, B, H, dk, C]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]                   # [N, B, H, 1, 1]
    out = []
    for n in range(N):
        v_new = u[n] - w[n] @ state                                       # corrections net of what S predicts
        out.append(q_dec[n] @ state + attn[n] @ v_new)
        state = state * chunk_decay[n] + k_dec[n] @ v_new
    return torch.stack(out, dim=2).reshape(B, H, N * C, -1)[:, :, :T], state
