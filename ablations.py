"""The ablation tables: train and evaluate each variant with rime.py or camg.py, several seeds each, and
print mean ± std beside the paper's direction (`python bench.py ablations` / `bench.py camg-ablations`).

Each run is `python <program> <variant flags> <extra flags> --seed S --run-dir <results>/<run>/seed<S>`,
a subprocess of its own (an entry point is never imported), its output in <results>/<run>/seed<S>.log.
A run whose summary.json exists is finished and never redone, so after an interruption the same
command resumes (and rime.py / camg.py resume an unfinished run from its checkpoint). A run that fails
is one `error:` line on stderr naming its log; the others still run, the table counts the seeds that
finished, and the command exits with status 2. The figures are those the program's own evaluation
wrote in each run's summary.json. results.json keeps the summaries, table.md the table.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

import cli
import published
from benchutil import flags, md_table

HERE = Path(__file__).resolve().parent
PROGRAMS = {"rime": HERE / "rime.py", "camg": HERE / "camg.py"}   # what a run executes (tests point these elsewhere)


def split_extra(args: list) -> tuple[list, list]:
    """[own flags..., "--", flags for every run...] -> (own, extra)."""
    return (args[: args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])


def choose(variants: list, only: str, seeds: int, prog: str) -> list:
    """The variants --only names (all when empty), or a one-line error."""
    names = [o.strip() for o in only.split(",") if o.strip()]
    chosen = [v for v in variants if not names or v[0] in names]
    if not chosen:
        cli.fail(prog, f"--only names none of: {', '.join(v[0] for v in variants)}")
    if seeds < 1:
        cli.fail(prog, "--seeds must be >= 1")
    return chosen


def run_all(program: str, runs: list, root: Path, extra: list, prog: str, jobs: int = 1,
            start: bool = True) -> tuple[dict, list]:
    """runs: [(run name, flags, seed)] -> ({(run, seed): summary}, [one-line failure messages]).
    Finished runs are read, not redone; `jobs` runs go at once (each a process of its own). start=False
    (--table-only) starts none: the unfinished ones are left out of the table."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        run, fl, seed = item
        run_dir = root / run / f"seed{seed}"
        summary, log_path = run_dir / "summary.json", root / run / f"seed{seed}.log"
        if not summary.exists() and not start:
            return None, None
        if not summary.exists():
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as log:
                code = subprocess.run([sys.executable, str(PROGRAMS[program]), *fl, *extra, "--seed", str(seed),
                                       "--run-dir", str(run_dir)], stdout=log, stderr=subprocess.STDOUT).returncode
            if code != 0 or not summary.exists():
                tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
                return None, (f"{run} seed {seed}: {Path(PROGRAMS[program]).name} exited {code}"
                              + (f" ({tail[0].strip()[:200]})" if tail else "") + f"; log: {log_path}")
        return json.loads(summary.read_text()), None

    summaries, failures = {}, []
    with tqdm(total=len(runs), desc=prog) as bar, ThreadPoolExecutor(max(1, jobs)) as pool:
        for (run, _, seed), (summary, failure) in zip(runs, pool.map(one, runs)):
            if failure:
                failures.append(failure)
                tqdm.write(f"{prog}: error: {failure}", file=sys.stderr)
            elif summary is not None:
                summaries[(run, seed)] = summary
            bar.update(1)
    return summaries, failures


def mean_std(xs, scale: float = 1.0, sign: str = "+") -> str:
    xs = [x * scale for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:                  # no spread from one seed: say so rather than print ± 0.00
        return f"{xs[0]:{sign}.2f} (1 seed)"
    return f"{statistics.mean(xs):{sign}.2f} ± {statistics.stdev(xs):.2f}"


def finish(root: Path, table: str, results: dict, failures: list, prog: str) -> None:
    """Write table.md and results.json, print the table; exit 2 after it when a run failed."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "table.md").write_text(table + "\n")
    (root / "results.json").write_text(cli.dumps(results, indent=2))
    print("\n" + table)
    print(f"table in {root / 'table.md'}, runs under {root}")
    if failures:
        cli.fail(prog, f"{len(failures)} run(s) failed, the table counts the rest; first: {failures[0]}")


def scatter_plot(path: Path, names: list, values: dict, ylabel: str, marks: dict = None) -> None:
    """One column of points per variant (its seeds) and their mean; `marks` adds a published value."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, name in enumerate(names):
        ys = [y for y in values.get(name, []) if y is not None]
        ax.scatter([i] * len(ys), ys, color="C0")
        if ys:
            ax.hlines(statistics.mean(ys), i - 0.3, i + 0.3, color="C1")
        if marks and marks.get(name) is not None:
            ax.scatter([i], [marks[name]], marker="x", color="C3", label="published" if i == 0 else None)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -----------------------------------------------------------------------------
# RIME: python bench.py ablations

# (name, rime.py flags, the paper's direction for its held-out gain)
RIME_ABLATIONS = [
    ("full RIME", [], "gain > 0"),
    ("--no-explore", ["--no-explore"], "below full (the paper: negative)"),
    ("--writer frozen", ["--writer", "frozen"], "about 0"),
    ("--actor frozen", ["--actor", "frozen"], "below full"),
    ("--writer decoupled", ["--writer", "decoupled"], "below full (shared weights win)"),
    ("--order shuffled", ["--order", "shuffled"], "below full"),
    ("--segment 6 (6+6)", ["--segment", "6"], "above 3+3 (the paper: 6+6 beats 3+3)"),
    ("--writer-baseline group", ["--writer-baseline", "group"], "below full (ours: the past window's luck stays in)"),
]


def rime_ablations(args: list) -> None:
    """RIME's ablations at the laptop budget, `--seeds` seeds each: mean ± std of the held-out gain after
    RL and of the RL effect on it (after minus before), rime.py's own evaluation of each trained policy.
    Extra flags after `--` go to every run (e.g. `-- --steps 8`). `--jobs N` runs N at once.

    By default the variants of a seed share one warm start, as the paper's ablations share one base
    model: a first run per seed (`_warmstart/seed<S>`, `rime.py --steps 0`) warm-starts and evaluates;
    every variant then starts RL from its weights (`--init-from <it>/final`) and reuses
    its before-RL evaluation of those very weights (`--before-from`). --no-share-warmstart gives each
    variant its own warm start (same seed, so the same weights, at 7x the cost).
        python bench.py ablations [--seeds 3] [--jobs 2] [--only "full RIME,--no-explore"] [--results results/ablations]
    --table-only writes the table of the runs already finished and starts none (a bench stopped midway)."""
    prog = "bench.py ablations"
    own, extra = split_extra(args)
    a = flags(own, prog, seeds=3, results="results/ablations", only="", jobs=1, no_share_warmstart=False,
              table_only=False)
    chosen = choose(RIME_ABLATIONS, a.only, a.seeds, prog)
    run_of = {name: name.split(" (")[0].strip("-").replace(" ", "_") for name, _, _ in chosen}
    root = Path(a.results)
    threads = ["--threads", "1"] if a.jobs > 1 else []      # one core per run
    start = {s: [] for s in range(a.seeds)}
    failures = []
    if not a.no_share_warmstart:
        warm, failures = run_all("rime", [("_warmstart", extra + ["--steps", "0"] + threads, s) for s in range(a.seeds)],
                                 root, [], prog, jobs=a.jobs, start=not a.table_only)
        for s in range(a.seeds):
            d = root / "_warmstart" / f"seed{s}"
            start[s] = ["--init-from", str(d / "final"), "--before-from", str(d)] if ("_warmstart", s) in warm else None
    # the shared start goes after the extra flags: it must win over an --init-from among them
    runs = [(run_of[n], fl + extra + start[s] + threads, s) for n, fl, _ in chosen for s in range(a.seeds)
            if start[s] is not None]
    summaries, more = run_all("rime", runs, root, [], prog, jobs=a.jobs, start=not a.table_only)
    failures += more
    results = {n: [summaries[(run_of[n], s)]["rl_effect"] for s in range(a.seeds) if (run_of[n], s) in summaries]
               for n, _, _ in chosen}
    rows = [[n, len(results[n]), mean_std([e["gain_after"] for e in results[n]]),
             mean_std([e["delta"] for e in results[n]]), direction] for n, _, direction in chosen]
    table = md_table(["variant", "seeds", "held-out gain after RL (mean ± std)", "RL effect on gain (mean ± std)",
                      "the paper's direction"], rows)
    scatter_plot(root / "ablations.png", [n for n, _, _ in chosen],
                 {n: [e["gain_after"] for e in results[n]] for n in results}, "held-out gain after RL")
    finish(root, table, results, failures, prog)


# -----------------------------------------------------------------------------
# CAMG: python bench.py camg-ablations

# (name, run dir, camg.py flags of that run, the figure it reads, the published row or None, the direction).
# The blank-memory and wiped variants train nothing: they are the full runs' own evaluations with the saved
# memory blanked between tasks, or CONTINUATION.md deleted at each reset inside an episode (summary.json's
# after_by_memory["blank"] / ["wiped"]), which is why the full runs evaluate three modes. The paper has no
# wiped row: it asks whether the successes need what the file says.
# Every run keeps memory across the tasks of a stream (camg.py's default blanks it between tasks, and then
# "blank saved memory" would be the full run itself): both task families, 4-task evaluation streams.
CAMG_BASE = ["--family", "both", "--train-memory", "full", "--eval-stream-len", "4"]
CAMG_ABLATIONS = [
    ("full", "full", ["--eval-memory", "full,blank,wiped"], "full",
     "CAMG-RL-4B", "the reference"),
    ("blank memory at evaluation", "full", None, "blank",
     "CAMG-RL-4B, blank saved memory at evaluation", "below full (the paper: about 14 points lower)"),
    ("CONTINUATION.md wiped at each reset", "full", None, "wiped",
     None, "below full where a success needs the file (no published row)"),
    ("continuation-only training", "continuation_only", ["--train-memory", "continuation"], "full",
     "CAMG-RL-4B, trained with only the continuation file", "below full (the paper: 41.8 vs 54.4)"),
    ("no gradients through memory actions", "no_memory_gradients", ["--mask-memory-actions"], "full",
     "CAMG-RL-4B, no gradients through memory actions", "far below full (the paper: 21.1 vs 54.4)"),
]


# --setting relay: camg.py's own default (relay tasks, memory blank between tasks), where the facts a task
# needs cross a context reset inside its episode. There "blank saved memory at evaluation" is the full run
# itself (nothing is saved between tasks) and "continuation-only training" trains what full trains (the
# continuation file is the one memory an episode writes), so their rows are left out and the table says so.
# With one task per evaluation stream, the full runs' `full` evaluation is the `blank` one the other runs
# make (camg.py's default, the training's mode): every mode shows the first turn the policy trained on, and
# each task starts with an empty folder either way (camg_eval.evaluate).
CAMG_RELAY_ABLATIONS = [
    ("full", "full", ["--eval-memory", "full,wiped"], "full", "CAMG-RL-4B", "the reference"),
    ("CONTINUATION.md wiped at each reset", "full", None, "wiped",
     None, "below full where a success needs the file (no published row)"),
    ("no gradients through memory actions", "no_memory_gradients", ["--mask-memory-actions"], "full",
     "CAMG-RL-4B, no gradients through memory actions", "far below full (the paper: 21.1 vs 54.4)"),
]
CAMG_SETTINGS = {"stream": (CAMG_BASE, CAMG_ABLATIONS), "relay": ([], CAMG_RELAY_ABLATIONS)}
RELAY_NOTE = ("\n\nThe relay setting (camg.py's default) keeps no memory between tasks: blank memory at evaluation "
              "is the full run itself, and continuation-only training trains what full trains, so neither has a row.")


def camg_figures(summary: dict, mode: str) -> tuple:
    """(success after RL, RL effect) of one run's summary.json, evaluated with memory `mode`; the RL
    effect (after minus before) exists for the full memory only. Success is a rate in [0, 1]."""
    if mode == "full":
        return summary["rl_effect"]["success_after"], summary["rl_effect"]["delta"]
    after = summary.get("after_by_memory", {}).get(mode)
    return (None if after is None else after["success"]), None


def camg_ablations(args: list) -> None:
    """The CAMG memory ablations at camg.py's laptop budget, `--seeds` seeds each: mean ± std of the
    held-out success after RL (average over the environments, %), of the RL effect (after minus before,
    points) and of the difference to the full runs of the same seeds, beside the paper's published
    average and direction (each labelled by its source). Extra flags after `--` go to every run.
    --setting stream (the paper's: memory kept across a stream's tasks, both task families) or relay
    (camg.py's default: a fact crosses a reset inside the episode; CAMG_RELAY_ABLATIONS says which rows).
        python bench.py camg-ablations [--seeds 3] [--setting stream|relay] [--only "full,..."] [--jobs 2]
            [--table-only] [--results results/camg_ablations, or results/camg_ablations_relay]
    `--jobs N` runs N camg.py runs at once (each a learner and a rollout worker, one torch thread each at
    the laptop models: two runs share 2 cores)."""
    prog = "bench.py camg-ablations"
    own, extra = split_extra(args)
    a = flags(own, prog, seeds=3, setting=("stream", "relay"), results="", only="", jobs=1, table_only=False)
    base, variants = CAMG_SETTINGS[a.setting]
    chosen = choose(variants, a.only, a.seeds, prog)
    runs = {}
    for v in chosen:                        # every run dir once: "blank" reads the full runs
        fl = next(x[2] for x in variants if x[1] == v[1] and x[2] is not None)
        runs.setdefault(v[1], fl)
    root = Path(a.results or "results/camg_ablations" + ("_relay" if a.setting == "relay" else ""))
    summaries, failures = run_all("camg", [(run, base + fl, s) for run, fl in runs.items() for s in range(a.seeds)],
                                  root, extra, prog, jobs=a.jobs, start=not a.table_only)
    figures = {name: {s: camg_figures(summaries[(run, s)], mode) for s in range(a.seeds) if (run, s) in summaries}
               for name, run, _, mode, _, _ in chosen}
    full = {s: camg_figures(summaries[("full", s)], "full")[0] for s in range(a.seeds) if ("full", s) in summaries}
    rows = []
    for name, run, _, mode, paper, direction in chosen:
        after = {s: f[0] for s, f in figures[name].items() if f[0] is not None}
        if len(after) < len(figures[name]):
            failures.append(f"{name}: {len(figures[name]) - len(after)} finished run(s) of {run} have no "
                            f"after_by_memory[{mode!r}] in summary.json")
        vs_full = [after[s] - full[s] for s in after if s in full] if name != "full" else []
        row = published.camg_row(paper) if paper else None
        rows.append([name, len(after), mean_std(after.values(), 100, ""),
                     mean_std([f[1] for f in figures[name].values()], 100),
                     mean_std(vs_full, 100) if name != "full" else "-",
                     f"{row['values']['avg']:.1f}" if row else "—", published.source_cell(row) if row else "ours",
                     direction])
    table = md_table(["variant", "seeds", "success after RL, % (mean ± std)", "RL effect, points",
                      "vs full, points", "published avg % †", "source", "the paper's direction"], rows)
    table += ("\n\n† CAMG paper, CAMG-RL-4B (128 test tasks per environment, 200 updates); published, not measured "
              "here. released figures: the authors' released result tables; derived: computed here from them.")
    table += RELAY_NOTE if a.setting == "relay" else ""
    scatter_plot(root / "camg_ablations.png", [v[0] for v in chosen],
                 {n: [100 * x[0] for x in f.values() if x[0] is not None] for n, f in figures.items()},
                 "held-out success after RL (%)",
                 marks={v[0]: published.camg_row(v[4])["values"]["avg"] for v in chosen if v[4]})
    results = {name: {f"seed{s}": {"success_after": f[0], "rl_effect": f[1]} for s, f in figures[name].items()}
               for name in figures}
    results["summaries"] = {f"{run}/seed{s}": summary for (run, s), summary in summaries.items()}
    finish(root, table, results, failures, prog)
