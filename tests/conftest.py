import json
import os
import sys

# tests import the flat modules from the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def send_json(handler, status: int, obj) -> None:
    """Answer a stub HTTP server's request (from a BaseHTTPRequestHandler) with obj as JSON."""
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def run_episode(env, task, policy) -> float:
    """Play one episode of env with a text policy (obs -> action); the score (sum of rewards)."""
    obs, total, done = env.reset(task), 0.0, False
    while not done:
        obs, r, done = env.step(policy(obs))
        total += r
    return total


def check_relay_needs_the_fact_carried(env_name: str) -> None:
    """What each text env's test_relay_tasks_need_the_fact_carried_across_a_context_reset asserts of
    its relay family (shop, deepresearch, autoresearch): at camg.py's preset (context budget, turns,
    reply length, its "small" BPE) the reference policy, knowing only its current context, solves
    every sampled held-out relay task (every second of the first 32), at least half of them through
    a reset; the same policy without CONTINUATION.md (it starts over after a reset) fails every task
    of the first 24 that it resets in."""
    import camg
    import camg_worker
    cfg, tok = camg.Config(), camg_worker.small_tokenizer()
    proto = camg_worker.make_env(env_name, "relay")
    tasks = proto.tasks("test")
    assert tasks and {t.difficulty for t in tasks} == {3}
    carried, outcomes = camg_worker.reference_episodes(proto, tasks[::2][:16], tok, cfg)
    assert all(ep.info.get("success") for ep in carried), [ep.task.id for ep in carried if not ep.info.get("success")]
    assert sum(ep.num_resets > 0 for ep in carried) >= len(carried) / 2
    assert all(o["before"] == "written" and o["read"] for out in outcomes for o in out)
    lost, _ = camg_worker.reference_episodes(camg_worker.make_env(env_name, "relay"), tasks[:24], tok, cfg, carry=False)
    reset = [ep for ep in lost if ep.num_resets]
    assert reset and not any(ep.info.get("success") for ep in reset)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: first run converts SmolLM2 GGUF")


# The test models are tiny: their ops are far too small to share between threads, and tests that
# start subprocesses (torchrun ranks, sandboxes) would oversubscribe the cores. One thread each.
import torch  # noqa: E402

torch.set_num_threads(1)
