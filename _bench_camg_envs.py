"""Bench of the CAMG environments (Shop, DeepResearch, AutoResearch) with scripted agents.

For each environment, on the first test streams (groups in task order, one instance, memory kept
from task to task inside a group), it runs side by side in one process:
- the reference policy with memory (the stream's `.agent_memory/` as the policy left it),
- the same policy from scratch (memory blanked before every task),
- a random policy over the valid action forms.
It prints success, mean reward, mean actions and the memory gain (with memory - from scratch).

    python -c "from _bench_camg_envs import bench_camg_envs; bench_camg_envs(['--tasks', '24'])"
"""

import argparse
import random
import re
import time

from envs import make

RANDOM_ACTIONS = {
    "shop": lambda rng, obs: rng.choice(["search[blue jacket]", "search[organic coffee]", "buy", "click[next]",
                                         "click[back]", "shell: ls"] + [f"click[{i}]" for i in re.findall(r"\[(B\d+)\]", obs)]
                                        + [f"click[{v}]" for v in ("m", "blue", "500g")]),
    "deepresearch": lambda rng, obs: rng.choice([f"search[{w}]" for w in re.findall(r"[A-Z][a-z]+", obs)[:5]]
                                                + [f"open[{i}]" for i in re.findall(r"\[(d\d+)\]", obs)]
                                                + [f"answer[{w}]" for w in re.findall(r"[A-Z][a-z]+", obs)[:3]]
                                                + ["shell: ls"]),
    "autoresearch": lambda rng, obs: rng.choice(["shell: ls", "run", "evaluate", "shell: cat README.md",
                                                 "shell: sed -i 's/^EPOCHS = [^ ]*/EPOCHS = 100/' train.py"]),
}


def run_tasks(env, tasks, mode, seed=0):
    rng = random.Random(seed)
    rewards, successes, steps = [], [], []
    previous_group = None
    for task in tasks:
        if mode == "scratch" or task.group != previous_group:
            env.set_memory_files({})
        previous_group = task.group
        policy = env.reference_policy(task) if mode != "random" else (lambda obs: RANDOM_ACTIONS[task.env](rng, obs))
        obs, total, done = env.reset(task), 0.0, False
        while not done:
            obs, r, done = env.step(policy(obs))
            total += r
        rewards.append(total)
        successes.append(bool(env.info.get("success")))
        steps.append(env.info.get("steps", 0))
    n = len(tasks)
    return {"success": sum(successes) / n, "reward": sum(rewards) / n, "steps": sum(steps) / n, "sum": sum(rewards)}


def bench_camg_envs(args: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench camg_envs")
    p.add_argument("--tasks", type=int, default=24, help="test tasks per environment (whole streams first)")
    p.add_argument("--envs", default="shop,deepresearch,autoresearch")
    a = p.parse_args(args)
    print("| env | tasks | memory: success / reward / actions | scratch: success / reward / actions "
          "| random: success / reward | gain (sum) | s |")
    print("|---|---|---|---|---|---|---|")
    for name in a.envs.split(","):
        env = make(name)
        try:
            tasks = sorted(env.tasks("test"), key=lambda t: (t.group, t.difficulty, t.id))[:a.tasks]
            t0 = time.time()
            mem, scratch, rand = (run_tasks(env, tasks, m) for m in ("memory", "scratch", "random"))
            print(f"| {name} | {len(tasks)} | {mem['success']:.0%} / {mem['reward']:.2f} / {mem['steps']:.1f} "
                  f"| {scratch['success']:.0%} / {scratch['reward']:.2f} / {scratch['steps']:.1f} "
                  f"| {rand['success']:.0%} / {rand['reward']:.2f} | {mem['sum'] - scratch['sum']:+.2f} "
                  f"| {time.time() - t0:.1f} |")
        finally:
            env.close()


if __name__ == "__main__":
    import sys
    bench_camg_envs(sys.argv[1:])
