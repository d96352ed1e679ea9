"""The same PPO run, single-process (imported by tests/test_ppo.py) or under
`torchrun --nproc_per_node 2 tests/_ppo_dist.py OUT_DIR` (FSDP2 on gloo): three updates on one global
batch, a checkpoint after the second, then a fresh learner resumes from it. Rank 0 writes OUT_DIR/out.pt."""
import copy
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import tiny                                                     # noqa: E402
from ppo import Batch, Learner, _full, init_distributed, make_batch, teardown_distributed  # noqa: E402


def global_batch(vocab_size: int, version: int, num_rows: int = 5, seed: int = 0) -> Batch:
    """Rows of different lengths: a prompt (mask 0), a reply (mask 1), an observation (mask 0), a reply."""
    g = torch.Generator().manual_seed(seed)
    tokens, masks, logps, advs, rets, olds, sfts = [], [], [], [], [], [], []
    for b in range(num_rows):
        p, r1, o, r2 = (int(x) for x in torch.randint(2, 9, (4,), generator=g))
        n = p + r1 + o + r2
        tokens.append(torch.randint(3, vocab_size, (n,), generator=g).tolist())
        m = [0] * p + [1] * r1 + [0] * o + [1] * r2
        masks.append(m)
        logps.append([-6.9 + 0.3 * float(x) if mi else 0.0 for x, mi in zip(torch.randn(n, generator=g), m)])
        advs.append(float(torch.randn((), generator=g)))
        rets.append(torch.randn(n, generator=g).tolist())
        olds.append((0.1 * torch.randn(n, generator=g)).tolist())
        sfts.append([0] * p + [b % 2] * r1 + [0] * (o + r2))     # some rows also get an SFT loss
    # the last row is 2 versions old: with max_lag=1 it is dropped
    versions = [version] * (num_rows - 1) + [version - 2]
    return make_batch(tokens, masks, logps, advs, returns=rets, old_values=olds, versions=versions, sft_mask=sfts)


def make_learner(model, ref, d):
    return Learner(model, ref_model=ref, value_head=True, lr=1e-4, kl_coef=0.05, kl_estimator="k3",
                   entropy_coef=0.01, sft_coef=0.5, max_lag=1, micro_batch_tokens=48, dist_info=d)


def run(d, ckpt_dir: str) -> dict:
    torch.manual_seed(0)
    model, _ = tiny("qwen3_5", seed=0)
    V = model.config.vocab_size
    base = copy.deepcopy(model)
    learner = make_learner(model, copy.deepcopy(base), d)
    learner.version = 5                 # as if 5 updates had run, so a row can be 2 versions old
    out = {"loss": [], "grad_norm": []}

    def step(lrn, seed):
        b = global_batch(V, lrn.version, seed=seed)
        s = lrn.update(b.shard(d.rank, d.world_size) if d.world_size > 1 else b)
        return s

    for k in range(2):
        s = step(learner, k)
        out["loss"].append(s["loss"])
        out["grad_norm"].append(s["grad_norm"])
    out["stats"] = s
    learner.save(ckpt_dir, caller_state={"stream_pos": 7})
    s = step(learner, 2)
    out["next_loss"] = s["loss"]
    out["next_rand"] = (torch.rand(3), random.random())
    out["weights"] = {k: v.clone() for k, v in learner.gen_model.state_dict().items()}
    out["value_head"] = _full(learner.policy.value_head.weight.detach()).clone()
    out["version"] = learner.gen_model.version
    # a learner built from other weights must come back exactly to the checkpoint
    other = copy.deepcopy(base)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    resumed = make_learner(other, copy.deepcopy(base), d)
    out["caller_state"] = resumed.load(ckpt_dir)
    s = step(resumed, 2)
    out["resumed_loss"] = s["loss"]
    out["resumed_rand"] = (torch.rand(3), random.random())
    out["resumed_weights"] = {k: v.clone() for k, v in resumed.gen_model.state_dict().items()}
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    d = init_distributed("cpu")
    out = run(d, str(Path(sys.argv[1]) / "ckpt"))
    if d.is_main:
        torch.save(out, Path(sys.argv[1]) / "out.pt")
    teardown_distributed()
