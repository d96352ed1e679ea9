"""Bench of camg.py's asynchrony: the same short CAMG-RL run, rollout inline (synchronous, one process)
vs. 1 and 2 rollout worker processes (asynchronous), side by side in one process. Per setting: wall time
and steady-state seconds per update (after the first), episodes the learner received per second, mean /
max version lag of trained episodes, episodes dropped as stale; speed-up is steady, relative to inline. On a 2-core CPU the
workers and the learner share the cores, so the gain is bounded; on GPUs they run on separate devices.

    python -c "from _bench_camg import bench_camg; bench_camg(['--steps', '4'])"
"""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def bench_camg(args: list[str]) -> None:
    import torch

    import camg
    p = argparse.ArgumentParser(prog="bench camg")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--workers", default="0,1,2", help="comma list of --num_workers settings (0 = inline)")
    p.add_argument("--eta", type=int, default=2)
    a = p.parse_args(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.workers.split(",")]:
            run = Path(tmp) / f"w{n}"
            cfg = camg.parse_args(["--model", a.model, "--steps", str(a.steps), "--num_workers", str(n),
                                   "--eta", str(a.eta), "--run_dir", str(run), "--eval_tasks", "0"])
            os.environ["CAMG_SESSION"] = f"bench{n}"       # what main() sets: the workers' exchange session
            torch.set_num_threads(camg.cpu_threads(cfg, n + 1))
            t0 = time.perf_counter()
            camg.learner_main(cfg, camg.Dist(), num_spawn=n)
            wall = time.perf_counter() - t0
            eps = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
            lags = [e["lag"] for e in eps if e["used"] == "train"]
            steady = [json.loads(line)["update_s"] for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
            rows.append((n, wall, sum(steady) / max(len(steady), 1), len(eps), sum(lags) / max(len(lags), 1),
                         max(lags, default=0), sum(e["used"] == "stale" for e in eps)))
    base = rows[0][2]
    print(f"\nCAMG-RL asynchrony ({a.model}, {a.steps} updates, eta {a.eta}). wall: the whole run with start-up; "
          "steady: mean seconds per update after the first (waiting for episodes + training)\n")
    print("| rollout | wall s | steady s / update | episodes received / s | lag mean | lag max | dropped stale "
          "| steady speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for n, wall, steady, num_eps, lag, lag_max, stale in rows:
        label = "inline (sync)" if n == 0 else f"{n} worker process{'es' if n > 1 else ''}"
        print(f"| {label} | {wall:.1f} | {steady:.2f} | {num_eps / wall:.2f} | {lag:.2f} | {lag_max} | {stale} | "
              f"{base / steady:.2f}x |")


if __name__ == "__main__":
    import sys
    bench_camg(sys.argv[1:])
