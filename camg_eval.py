"""camg.py's evaluation and report: greedy test streams per environment, success in the CAMG paper's
Table 2 layout beside the published rows (published.py), and the run's summary (summary.json): the RL effect
(held-out success before and after RL, per environment and averaged, with paired 95% CIs), success
after RL per evaluation memory mode, the reset protocol's statistics over the evaluation episodes, and
where relay episodes fail (before RL and after, per memory mode).

`evaluate` returns per environment {"success", "score", "num", "failed"} (sums over the episodes) and
"episodes": one record per test task {"task", "success", "resets": [{"before", "read"}, ...], "relay"}.
"relay" is camg_memory.relay_progress of the episode, computed from what it did (its actions,
observations and memory files at each reset): how far it carried its relay fact, or None for a task
that is not a relay task.

Relay stages (`relay_stages`, `relay_table`): the relay episodes of an environment counted at the first
stage each fails at, the success deciding the last one:
  not_opened   the note (memo, lab note, CI report) was never shown;
  no_reset     no context reset came after it, and the task failed;
  not_written  the fact was not in any memory file the episode wrote before that reset;
  not_read     no command after the reset printed it from that file;
  not_used     read, but the actions after the reset do not name it;
  used_wrong   used, and the task still failed;
  solved       the task succeeded, however far the fact was carried (solved_not_carried counts the
               successes whose fact never made it through a reset: solved before any reset, by luck,
               or from what the shop's page still showed).
The fact per environment (each env's relay_fact): Shop, the note's options for the goal's category;
DeepResearch, the memo's person (or an entity the chain reaches from them); AutoResearch, the leaking
column (DROP=[c]); Coding, the bug's function or file. An environment with no relay episode in the
evaluation (--family standard, or no relay family) is "n/a", never a row of zeros: a 0 in a stage's
column means that no episode stopped there.
"""
from __future__ import annotations

import torch

import published
from camg_memory import RELAY_PROGRESS, ProtocolEnv, apply_memory_mode, episode_relay_progress, memory_note
from exchange import to_samples
from rewards import mean_ci95
from rollout import run_episodes

ENV_NAMES = ("shop", "coding", "deepresearch", "autoresearch")
TITLES = {"shop": "Shop", "coding": "Coding", "deepresearch": "DeepResearch", "autoresearch": "AutoResearch"}
# the first stage a relay episode fails at (the module docstring), in order, with the report's column titles
RELAY_STAGES = {"not_opened": "note not opened", "no_reset": "no reset after it", "not_written": "not written",
                "not_read": "not read back", "not_used": "read, not used", "used_wrong": "used, still wrong",
                "solved": "solved"}
NOT_CARRIED = RELAY_PROGRESS[:RELAY_PROGRESS.index("not_used")]   # the fact never got through a reset


def by_group(tasks) -> list[list]:
    """Tasks per group (a shopper, a region, a lab, a repository), each group's tasks in order."""
    groups = {}
    for t in tasks:
        groups.setdefault(t.group, []).append(t)
    return list(groups.values())


def eval_streams(env, num_tasks: int, stream_len: int) -> list[list]:
    """Test tasks as streams: each test group's tasks in order, cut into chunks of stream_len, taken
    round-robin over the groups (every group's first chunk first) until num_tasks tasks."""
    chunks = [[g[i:i + stream_len] for i in range(0, len(g), stream_len)] for g in by_group(env.tasks("test"))]
    streams, left = [], num_tasks
    for k in range(max(map(len, chunks), default=0)):
        for c in chunks:
            if k < len(c) and left > 0:
                streams.append(c[k][:left])
                left -= len(streams[-1])
    return streams


@torch.no_grad()
def evaluate(cfg, model, tokenizer, mode: str, rank: int = 0, world: int = 1, make_env=None) -> dict:
    """Results per env (module docstring) over this rank's streams. All environments' streams step
    together (one batched generate per turn); pairs of streams stay on one rank so that 'shuffle'
    always has a partner of the same environment. cfg: camg.Config (weights, eval_tasks,
    eval_stream_len, seed, max_turns, max_new_tokens, context_budget)."""
    streams, results = [], {}       # streams: (env name, env instance, tasks)
    # every mode shows the first turn the policy trained on (whether the folder is said to be kept follows
    # the training's mode), so that a mode changes only what the folder holds; wiped is the training's
    # mode between tasks with CONTINUATION.md deleted at each reset
    trained = getattr(cfg, "train_memory", "full")
    between, kept = (trained if mode == "wiped" else mode), trained != "blank"
    try:
        for name in cfg.weights:
            proto = make_env(name)
            all_ = eval_streams(proto, cfg.eval_tasks, cfg.eval_stream_len)
            parts = [all_[i:i + 2] for i in range(0, len(all_), 2)]
            if len(parts) > 1 and len(parts[-1]) == 1:
                parts[-2] += parts.pop()
            mine = [s for part in parts[rank::world] for s in part]
            wipe = mode == "wiped"     # CONTINUATION.md deleted at every reset inside an episode
            envs_ = [ProtocolEnv(proto, wipe_at_reset=wipe)] + [ProtocolEnv(proto.clone(), wipe_at_reset=wipe)
                                                                for _ in mine[1:]]
            streams += [(name, e, s) for e, s in zip(envs_, mine)]
            results[name] = {"success": 0.0, "score": 0.0, "num": 0, "failed": 0, "episodes": []}
            if not mine:
                proto.close()
        for _, e, _ in streams:
            e.set_memory_files({})
        for pos in range(max((len(s) for _, _, s in streams), default=0)):
            # between tasks the mode decides what the next task starts with (shuffle partners may have ended)
            for name in results if pos > 0 else ():
                apply_memory_mode([e for n, e, s in streams if n == name and (pos < len(s) or mode == "shuffle")], between)
            live = [st for st in streams if pos < len(st[2])]
            envs_ = [e for _, e, _ in live]
            eps = run_episodes(model, tokenizer, envs_, [s[pos] for _, _, s in live],
                               memory=[memory_note(e, kept) for e in envs_], temperature=0.0,
                               seed=cfg.seed, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                               context_budget=cfg.context_budget)
            samples = to_samples(eps, [n for n, _, _ in live], 0, -1, 0.0, envs_)
            for ep, e, s in zip(eps, envs_, samples):
                r = results[s.env]
                for key, v in (("success", s.success), ("score", s.score), ("num", 1), ("failed", bool(s.error))):
                    r[key] += v
                # relay progress now, while e still holds this episode's record (the next task resets it)
                r["episodes"].append({"task": s.task_id, "success": s.success, "resets": s.reset_log,
                                      "relay": episode_relay_progress(ep, e)})
    finally:
        for _, e, _ in streams:
            e.close()
    return results


def merge(parts: list[dict]) -> dict:
    """The evaluation results of several ranks, summed (episode lists concatenated)."""
    total = {}
    for part in parts:
        for n, res in part.items():
            total[n] = {k: total.get(n, {}).get(k, type(v)()) + v for k, v in res.items()}
    return total


def table2(rows: list[tuple[str, dict]]) -> str:
    """Markdown, the paper's Table 2 layout: this run's rows, then the published rows with their source."""
    lines = ["| model | " + " | ".join(TITLES[n] for n in ENV_NAMES) + " | Avg |", "|---" * (len(ENV_NAMES) + 2) + "|"]
    for label, res in rows:
        vals = {n: 100.0 * r["success"] / r["num"] for n, r in res.items() if r["num"]}
        cells = [f"{vals[n]:.1f} (n={res[n]['num']})" if n in vals else "—" for n in ENV_NAMES]
        avg = f"{sum(vals.values()) / len(vals):.1f}" if vals else "—"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {avg} |")
    for r in published.CAMG_SUCCESS:
        if "(points)" not in r["row"]:             # success rows only (not the ablation cost itself)
            cells = [f"{r['values'][c]:.1f}" if c in r["values"] else "—" for c in ENV_NAMES + ("avg",)]
            lines.append(f"| {r['row']} *(paper: {published.source_cell(r)})* | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nPaper rows: the CAMG paper's Table 2 and memory ablations (4B models, 128 tasks "
                               "per env), labelled by source; \"derived\" figures are computed here from released "
                               "ones. " + published.CAMG_ABSTRACT_CLAIM)


# ----------------------------------------------------------------------------- the summary

def _per_task(res: dict) -> dict:
    return {e["task"]: float(e["success"]) for e in res["episodes"]}


def _effect(before: list, after: list) -> dict:
    diff = mean_ci95([a - b for b, a in zip(before, after)])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")     # noqa: E731
    return {"success_before": mean(before), "success_after": mean(after), "delta": diff[0],
            "ci95": [diff[1], diff[2]], "tasks": len(before)}


def rl_effect(before: dict, after: dict) -> tuple[dict, dict]:
    """(averaged over envs, per env): success before / after RL on the same test tasks, paired. The
    average's CI pairs task slots: slot k is the mean over envs of each env's k-th task's difference."""
    per_env, slots = {}, {}
    for n in [n for n in ENV_NAMES if n in before and n in after]:
        b, a = _per_task(before[n]), _per_task(after[n])
        tasks = [t for t in b if t in a]
        per_env[n] = _effect([b[t] for t in tasks], [a[t] for t in tasks])
        for k, t in enumerate(tasks):
            slots.setdefault(k, []).append((b[t], a[t]))
    avg = lambda xs: sum(xs) / len(xs)                                # noqa: E731
    pairs = [(avg([b for b, _ in s]), avg([a for _, a in s])) for s in slots.values()]
    overall = _effect([b for b, _ in pairs], [a for _, a in pairs])
    overall.update(success_before=avg([e["success_before"] for e in per_env.values()]) if per_env else float("nan"),
                   success_after=avg([e["success_after"] for e in per_env.values()]) if per_env else float("nan"),
                   tasks=sum(e["tasks"] for e in per_env.values()))
    return overall, per_env


def reset_stats(results: dict) -> dict:
    """The reset protocol over the evaluation episodes: the share of episodes with a reset, of resets
    whose CONTINUATION.md was written before them and read back after, and success with vs without one."""
    eps = [e for res in results.values() for e in res["episodes"]]
    resets = [r for e in eps for r in e["resets"]]
    share = lambda xs: sum(xs) / len(xs) if xs else float("nan")    # noqa: E731
    return {"episodes": len(eps), "with_reset": share([bool(e["resets"]) for e in eps]),
            "written_before_reset": share([r["before"] == "written" for r in resets]),
            "read_after_reset": share([r["read"] for r in resets]),
            "success_with_reset": share([e["success"] for e in eps if e["resets"]]),
            "success_without_reset": share([e["success"] for e in eps if not e["resets"]])}


def relay_stage(progress: str, success: float) -> str:
    """An episode's relay stage (RELAY_STAGES) from its relay progress and its success."""
    if success:
        return "solved"
    return "used_wrong" if progress == "used" else progress


def relay_stages(results: dict) -> dict:
    """Per env (in ENV_NAMES order): its relay episodes counted at the first stage each fails at
    (RELAY_STAGES, every stage present), with relay_episodes, not_relay (the env's other episodes, not
    counted) and solved_not_carried; "n/a" for an env whose evaluation had no relay episode."""
    out = {}
    for name in [n for n in ENV_NAMES if n in results] + [n for n in results if n not in ENV_NAMES]:
        eps = results[name]["episodes"]
        relay = [e for e in eps if e.get("relay")]     # None: not a relay task (or an evaluation that predates it)
        if not relay:
            out[name] = "n/a"
            continue
        counts = dict.fromkeys(RELAY_STAGES, 0)
        for e in relay:
            counts[relay_stage(e["relay"], e["success"])] += 1
        out[name] = {**counts, "relay_episodes": len(relay), "not_relay": len(eps) - len(relay),
                     "solved_not_carried": sum(bool(e["success"]) and e["relay"] in NOT_CARRIED for e in relay)}
    return out


def summary(before: dict | None, after_by_mode: dict, wall_s: float) -> dict:
    """summary.json: rl_effect, per_env, after_by_memory, resets (after RL, first memory mode), relay_stages
    ({"before_rl": relay_stages or None without a before-RL evaluation, "after_rl": {mode: relay_stages}}), wall_s."""
    first = next(iter(after_by_mode.values()))
    overall, per_env = rl_effect(before, first) if before is not None else ({}, {})
    by_memory = {mode: {"success": sum(r["success"] / r["num"] for r in res.values() if r["num"]) /
                        max(sum(1 for r in res.values() if r["num"]), 1),
                        "per_env": {n: r["success"] / r["num"] for n, r in res.items() if r["num"]}}
                 for mode, res in after_by_mode.items()}
    relay = {"before_rl": relay_stages(before) if before is not None else None,
             "after_rl": {mode: relay_stages(res) for mode, res in after_by_mode.items()}}
    return {"rl_effect": overall, "per_env": per_env, "after_by_memory": by_memory,
            "resets": reset_stats(first), "relay_stages": relay, "wall_s": wall_s}


def relay_table(rows: list[tuple[str, dict]]) -> str:
    """Markdown: per evaluation (label, relay_stages) and env, the relay episodes counted at the first
    stage each fails at; "n/a" for an env without relay episodes."""
    lines = ["| evaluation | env | relay episodes | " + " | ".join(RELAY_STAGES.values()) + " |",
             "|---" * (len(RELAY_STAGES) + 3) + "|"]
    for label, per_env in rows:
        for name, c in per_env.items():
            if c == "n/a":
                cells = ["n/a"] * (len(RELAY_STAGES) + 1)
            else:
                cells = [str(c["relay_episodes"])] + [str(c[k]) for k in RELAY_STAGES]
                if c["solved_not_carried"]:
                    cells[-1] += f" ({c['solved_not_carried']} not carried)"
            lines.append(f"| {label} | {TITLES.get(name, name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def effect_table(s: dict) -> str:
    """The before/after table of a summary, its reset statistics and its relay stages, as text (the
    statistics and stages only for an evaluation with nothing before it, --eval-only)."""
    pct = lambda x: "nan" if x != x else f"{100 * x:.1f}"            # noqa: E731
    lines = []
    if s["per_env"]:
        lines = ["| env | tasks | success before RL | after RL | delta | 95% CI (paired) |", "|---|---|---|---|---|---|"]
        for name, e in list(s["per_env"].items()) + [("average", s["rl_effect"])]:
            lines.append(f"| {TITLES.get(name, name)} | {e['tasks']} | {pct(e['success_before'])} | "
                         f"{pct(e['success_after'])} | {pct(e['delta'])} | [{pct(e['ci95'][0])}, {pct(e['ci95'][1])}] |")
        lines.append("")
    r = s["resets"]
    lines.append(f"Resets (evaluation after RL, {r['episodes']} episodes): {pct(r['with_reset'])}% of episodes "
                 f"reset at least once; CONTINUATION.md written before {pct(r['written_before_reset'])}% of resets, "
                 f"read back after {pct(r['read_after_reset'])}%; success {pct(r['success_with_reset'])}% with a "
                 f"reset vs {pct(r['success_without_reset'])}% without.")
    relay = s.get("relay_stages")
    if relay:
        after = "after RL" if s["per_env"] else "evaluation"
        rows = ([("before RL", relay["before_rl"])] if relay["before_rl"] is not None else []) + \
            [(f"{after}, memory {mode}", per_env) for mode, per_env in relay["after_rl"].items()]
        lines += ["", "Relay episodes by the first stage they fail at (the fact shown once, needed after a "
                  "context reset; camg_eval's docstring defines each stage)", relay_table(rows)]
    return "\n".join(lines)
