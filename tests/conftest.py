import os
import sys

# tests import the flat modules from the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_episode(env, task, policy) -> float:
    """Play one episode of env with a text policy (obs -> action); the score (sum of rewards)."""
    obs, total, done = env.reset(task), 0.0, False
    while not done:
        obs, r, done = env.step(policy(obs))
        total += r
    return total


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: first run converts SmolLM2 GGUF")


# The test models are tiny: their ops are far too small to share between threads, and tests that
# start subprocesses (torchrun ranks, sandboxes) would oversubscribe the cores. One thread each.
import torch  # noqa: E402

torch.set_num_threads(1)
