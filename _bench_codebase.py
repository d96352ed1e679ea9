"""Codebase Adaptation speed: the time to reset one task and to score a submission.

    python bench.py envs_codebase     # once merged; standalone: python _bench_codebase.py

Rows: reset (copy the repository, inject the bug, hide the tests, git commit), a shell command,
a no-op submit (FAIL_TO_PASS only: unresolved) and a resolving submit (FAIL_TO_PASS then
PASS_TO_PASS), for one tablib and one tenacity task. The baseline column is a bare
`python -c pass` subprocess, so the ratios survive this machine's ~30% drift between runs.
"""

import subprocess
import sys
import time


def _seconds(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_envs_codebase(args: list[str]) -> None:
    import codebase as cb
    repeat = int(args[0]) if args else 3
    base = _seconds(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), repeat)
    env = cb.CodebaseEnv()
    rows = []
    try:
        for stream in cb.long_streams().values():
            task = stream[0]
            reset = _seconds(lambda: env.reset(task), repeat)
            env.reset(task)
            command = _seconds(lambda: env.step("ls"), repeat)

            def noop():
                env.reset(task)
                env.step("submit")

            def solve():
                env.reset(task)
                env.step(env.reference_policy(task)(""))
                env.step("submit")
            rows += [(task.id, "reset", reset), (task.id, "shell command", command),
                     (task.id, "reset + no-op submit", _seconds(noop, repeat)),
                     (task.id, "reset + fix + resolving submit", _seconds(solve, repeat))]
    finally:
        env.close()
    print(f"| task | step | seconds | x `python -c pass` ({base * 1000:.0f} ms) |")
    print("|---|---|---|---|")
    for tid, what, sec in rows:
        print(f"| {tid} | {what} | {sec:.3f} | {sec / base:.1f} |")


if __name__ == "__main__":
    bench_envs_codebase(sys.argv[1:])
