"""Environment speed (merged into `python bench.py envs` by the coordinator).

bench_envs_alchemy: Alchemy steps/s with three drivers side by side in one process, as ratios to
the cheapest one (random valid actions), so the policy's own cost is visible next to the env's.
    python -c "import _bench_envs as b; b.bench_envs_alchemy(['--tasks', '100'])"
"""

import random
import time

import envs
from alchemy import oracle_policy, parse_observation


def _random_actor(seed):
    rng = random.Random(seed)

    def act(obs):
        state = parse_observation(obs)
        return rng.choice([f"apply p{p} s{s}" for p in state["potions"] for s in state["stones"]]
                          + [f"cauldron s{s}" for s in state["stones"]] + ["end"])
    return act


def bench_envs_alchemy(args: list) -> None:
    num_tasks = int(args[args.index("--tasks") + 1]) if "--tasks" in args else 100
    env = envs.make("alchemy")
    t0 = time.perf_counter()
    tasks = env.tasks("train")
    build_s = time.perf_counter() - t0
    tasks = tasks[:: max(1, len(tasks) // num_tasks)][:num_tasks]
    drivers = {"random valid actions (env only)": lambda t, i: _random_actor(i),
               "reference policy (infers chemistry)": lambda t, i: env.reference_policy(t),
               "oracle (exact search each step)": lambda t, i: oracle_policy(env)}
    rows = []
    for name, make_actor in drivers.items():
        steps, scores, t0 = 0, 0.0, time.perf_counter()
        for i, task in enumerate(tasks):
            actor, obs, done = make_actor(task, i), env.reset(task), False
            while not done:
                obs, _, done = env.step(actor(obs))
                steps += 1
            scores += env.info["score"]
        seconds = time.perf_counter() - t0
        rows.append((name, steps, seconds, steps / seconds, scores / len(tasks)))
    base = rows[0][3]
    print(f"Alchemy: {len(tasks)} train tasks, {env.config['num_trials']} trials each; "
          f"building all {len(env.tasks('train'))} train tasks took {build_s:.2f} s")
    print("| driver | steps | seconds | steps/s | vs random | mean score |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, steps, seconds, rate, score in rows:
        print(f"| {name} | {steps} | {seconds:.2f} | {rate:,.0f} | {rate / base:.2f}x | {score:.3f} |")


if __name__ == "__main__":
    import sys
    bench_envs_alchemy(sys.argv[1:])
