"""Where a change in memory gain comes from: the actor that reads, or the memories it reads.

RIME trains one set of weights in two roles, so when the held-out gain moves after RL, either role
may be the cause. Replaying stored memory texts tells them apart (a diagnostic, not a reward):

    result = attribution.attribute(actors, evals, tokenizer, env, streams, **episode_settings)

actors and evals are keyed alike ("before RL", "after RL"): each actor's own held-out evaluation
(rime.evaluate's dict: its memories, its per-stream from-scratch sums). Every cell is a gain, with
memory minus that actor's own from-scratch score, per stream:
- actor A reading the memories written in B's evaluation, stream by stream and position by
  position (A's own row is its evaluation itself). With A = before and B = after, the change from
  A's own gain is the *writer's part* of the RL effect: the same reader, the notes RL's writer wrote.
  With A = after and B = before it is the *actor's part*: the notes held fixed, the reader trained.
- actor A reading its own evaluation's memories, but each stream those of a stream over another
  world: a gain that survives this does not come from what the notes say about the world.
- actor A reading reference memories given per stream (rime.py passes the scripted writer's true
  notes on Alchemy): what the reader makes of notes that are right.
- actor A with a scripted writer in the loop (play_with_writer; rime.py passes warmstart.scripted_writers
  on Alchemy): what a memory written that way is worth to this reader, an upper bound on what RL's
  writer gains by learning to write like it.

Replays decode like the evaluation (the same episode seeds, the same batch of streams), so under
greedy decoding a replay of an actor's own memories gives back its evaluation exactly.
"""

import rewards
import rollout

EVAL_SEED = 1   # the seed rime.evaluate plays its streams with: replays use the same episode seeds


def replay(actor, tokenizer, env, streams, memories, *, temperature=0.0, max_turns=None, max_new_tokens=128,
           seed=EVAL_SEED) -> list:
    """Cumulative reward per stream when the actor of task t of stream i reads memories[i][t - 1]
    (given texts, not its writer's; the first task reads none). env is cloned per stream."""
    return _play(actor, tokenizer, env, streams, lambda t, eps, old: [m[t] for m in memories],
                 temperature=temperature, max_turns=max_turns, max_new_tokens=max_new_tokens, seed=seed)


def play_with_writer(actor, tokenizer, env, streams, write, *, temperature=0.0, max_turns=None,
                     max_new_tokens=128, seed=EVAL_SEED) -> list:
    """Cumulative reward per stream when the actor plays its tasks in order and a scripted writer in the
    loop writes each next memory: write(episode, old memory) -> the memory task t + 1 reads (the first
    task reads none). Unlike replay, the memories follow this actor's own episodes. Same seeds as replay."""
    return _play(actor, tokenizer, env, streams, lambda t, eps, old: [write(ep, m) for ep, m in zip(eps, old)],
                 temperature=temperature, max_turns=max_turns, max_new_tokens=max_new_tokens, seed=seed)


def _play(actor, tokenizer, env, streams, next_memories, *, temperature, max_turns, max_new_tokens, seed) -> list:
    """The streams side by side (env cloned per stream), task by task; after task t the memories the next
    task reads are next_memories(t, that task's episodes, the memories it read)."""
    envs_ = [env] + [env.clone() for _ in streams[1:]]
    totals, memory = [0.0] * len(streams), [""] * len(streams)
    try:
        for t in range(len(streams[0])):
            eps = rollout.run_episodes(actor, tokenizer, envs_, [s[t] for s in streams], memory=memory,
                                       temperature=temperature, seed=seed * 7907 + t, max_turns=max_turns,
                                       max_new_tokens=max_new_tokens)
            totals = [x + ep.score for x, ep in zip(totals, eps)]
            if t + 1 < len(streams[0]):
                memory = next_memories(t, eps, memory)
    finally:
        for e in envs_[1:]:
            e.close()
    return totals


def other_world(streams):
    """A stream order in which every stream's partner is over another world (the smallest shift of
    the held-out streams that gives one), or None when there is no such shift (one world, one stream)."""
    n, world = len(streams), [s[0].group for s in streams]
    for shift in range(1, n):
        partner = [(i + shift) % n for i in range(n)]
        if all(world[p] != world[i] for i, p in enumerate(partner)):
            return partner
    return None


def _cell(gains) -> dict:
    m, lo, hi = rewards.mean_ci95(gains)
    return {"gain": m, "ci95": [lo, hi], "stream_gains": list(gains)}


def attribute(actors: dict, evals: dict, tokenizer, env, streams, *, references: dict = None, writers: dict = None,
              on_replay=None, **settings) -> dict:
    """{"cells": {(actor, memories): cell}, "parts": {...}}, a cell = {gain, ci95, stream_gains}.
    evals[name] needs "memories", "stream_gains" and "stream_scratch" (see the module docstring);
    references: {name: memories per stream} that every actor also reads, e.g. a scripted writer's
    true notes (cell "<actor> actor, <name> memories"); writers: {name: write(episode, old memory)}, scripted
    writers played in the loop with every actor (play_with_writer; cell "<actor> actor, <name> writer");
    settings go to replay (temperature, max_turns, max_new_tokens). "parts", when there are exactly
    the two names "before RL" and "after RL": the writer's and the actor's part of the RL effect and
    what is left (their interaction), each paired over the streams."""
    cells = {}
    partner = other_world(streams)
    for a, model in actors.items():
        scratch = evals[a]["stream_scratch"]
        for b in evals:
            if a == b:
                cells[f"{a} actor, {b} memories"] = _cell(evals[a]["stream_gains"])
                continue
            got = replay(model, tokenizer, env, streams, evals[b]["memories"], **settings)
            cells[f"{a} actor, {b} memories"] = _cell([g - s for g, s in zip(got, scratch)])
            if on_replay:
                on_replay()
        if partner is not None:
            own = evals[a]["memories"]
            got = replay(model, tokenizer, env, streams, [own[p] for p in partner], **settings)
            cells[f"{a} actor, another world's {a} memories"] = _cell([g - s for g, s in zip(got, scratch)])
            if on_replay:
                on_replay()
        for name, memories in (references or {}).items():
            got = replay(model, tokenizer, env, streams, memories, **settings)
            cells[f"{a} actor, {name} memories"] = _cell([g - s for g, s in zip(got, scratch)])
            if on_replay:
                on_replay()
        for name, write in (writers or {}).items():
            got = play_with_writer(model, tokenizer, env, streams, write, **settings)
            cells[f"{a} actor, {name} writer"] = _cell([g - s for g, s in zip(got, scratch)])
            if on_replay:
                on_replay()
    out = {"cells": cells, "other_world": partner}
    if set(actors) == {"before RL", "after RL"}:
        g = {k: v["stream_gains"] for k, v in cells.items()}
        bb, ba = g["before RL actor, before RL memories"], g["before RL actor, after RL memories"]
        ab, aa = g["after RL actor, before RL memories"], g["after RL actor, after RL memories"]

        def part(xs):
            m, lo, hi = rewards.mean_ci95(xs)
            return {"delta": m, "ci95": [lo, hi]}
        out["parts"] = {"writer": part([y - x for x, y in zip(bb, ba)]),        # the same reader, RL's notes
                        "actor": part([y - x for x, y in zip(bb, ab)]),         # the same notes, RL's reader
                        "interaction": part([d + x - w - c for x, w, c, d in zip(bb, ba, ab, aa)]),
                        "total": part([y - x for x, y in zip(bb, aa)])}        # = the RL effect on gain
    return out


def scratch_of(ev: dict, actor, tokenizer, env, streams, **settings) -> list:
    """Per-stream from-scratch sums of an evaluation: stored ("stream_scratch"), or, for one made
    before they were stored, recovered as (its memories replayed) - (its per-stream gains); the
    replay gives back the evaluation's own with-memory scores (same seeds, same batch)."""
    if ev.get("stream_scratch") is not None:
        return ev["stream_scratch"]
    got = replay(actor, tokenizer, env, streams, ev["memories"], **settings)
    return [g - gain for g, gain in zip(got, ev["stream_gains"])]


def markdown(result: dict) -> str:
    """The cells as a table, and the parts of the RL effect as lines."""
    def ci(c):
        lo, hi = c
        return "n/a" if lo != lo else f"[{lo:+.2f}, {hi:+.2f}]"
    lines = ["| actor reads | held-out gain (95% CI) |", "|---|---|"]
    lines += [f"| {k} | {v['gain']:+.2f} {ci(v['ci95'])} |" for k, v in result["cells"].items()]
    for name, p in result.get("parts", {}).items():
        lines.append(f"{name} part of the RL effect: {p['delta']:+.2f} (95% CI {ci(p['ci95'])})")
    return "\n".join(lines)
