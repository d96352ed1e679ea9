"""Benchmark: the cost of a sandboxed command against a bare subprocess (merged into bench.py).

    python bench.py sandbox [--n 300] [--parallel 32] [--per-thread 20]

Latency: `Sandbox.run("true")` against `subprocess.run(["bash", "-c", "true"])`, interleaved one by
one in the same process so that machine noise hits both alike; medians. Throughput: `parallel`
threads, each with its own sandbox (or bare subprocesses), running `per_thread` commands.
Target: sandbox / bare <= 2x.
"""

import argparse
import statistics
import subprocess
import threading
import time

from sandbox import Sandbox


def _bare_true():
    subprocess.run(["bash", "-c", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT)


def _throughput(num_threads: int, per_thread: int, run_one_factory) -> float:
    """Commands per second with num_threads threads, each calling its own run_one per_thread times."""
    runners = [run_one_factory() for _ in range(num_threads)]
    barrier = threading.Barrier(num_threads + 1)

    def work(run_one):
        barrier.wait()
        for _ in range(per_thread):
            run_one()

    threads = [threading.Thread(target=work, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return num_threads * per_thread / (time.perf_counter() - t0)


def bench_sandbox(args: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench.py sandbox")
    p.add_argument("--n", type=int, default=300, help="commands per side for the latency figure")
    p.add_argument("--parallel", type=int, default=32, help="sandboxes (threads) side by side")
    p.add_argument("--per-thread", type=int, default=20, help="commands per thread for throughput")
    a = p.parse_args(args)

    t0 = time.perf_counter()
    sb = Sandbox(timeout=10)
    start_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(10):   # warm up both paths (page cache, first fork of each process)
        sb.run("true")
        _bare_true()
    bare, boxed = [], []
    for _ in range(a.n):
        t = time.perf_counter(); _bare_true(); bare.append(time.perf_counter() - t)
        t = time.perf_counter(); sb.run("true"); boxed.append(time.perf_counter() - t)
    describe = sb.describe()
    sb.close()
    bare_ms, boxed_ms = statistics.median(bare) * 1e3, statistics.median(boxed) * 1e3

    sandboxes: list[Sandbox] = []

    def boxed_factory():
        s = Sandbox(timeout=10)
        sandboxes.append(s)
        return lambda: s.run("true")

    try:
        bare_tput = _throughput(a.parallel, a.per_thread, lambda: _bare_true)
        boxed_tput = _throughput(a.parallel, a.per_thread, boxed_factory)
    finally:
        for s in sandboxes:
            s.close()

    print(f"sandbox: {describe}; helper start {start_ms:.0f} ms (once per sandbox)\n")
    print("| measure | bare subprocess | Sandbox.run | ratio (sandbox / bare) |")
    print("|---|---|---|---|")
    print(f"| latency of `true`, median of {a.n} (ms) | {bare_ms:.2f} | {boxed_ms:.2f} | {boxed_ms / bare_ms:.2f}x |")
    print(f"| throughput, {a.parallel} threads x {a.per_thread} (cmd/s) | {bare_tput:.0f} | {boxed_tput:.0f} "
          f"| {bare_tput / boxed_tput:.2f}x time per command |")


if __name__ == "__main__":
    import sys
    bench_sandbox(sys.argv[1:])
