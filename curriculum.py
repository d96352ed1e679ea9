"""Task streams: the order in which an agent meets tasks, so that memory has something to carry.

RIME trains on short curricula and tests on longer held-out streams:

    stream = make_stream(tasks, order="easy_to_hard", segment=6, seed=0)   # 6 easy then 6 hard (paper)
    stream = make_stream(tasks, order="easy_to_hard", segment=3, seed=0)   # 3 + 3 (its ablation)
    stream = make_stream(tasks, order="shuffled", segment=6, seed=0)       # the same 12 tasks, shuffled
    stream = make_stream(tasks, order="long", group="tablib")              # every task of a group, easiest first
    stream = make_stream(tasks, order="given")                             # exactly as given (fixed benchmark streams)
    streams = make_streams(tasks, num_streams=64, order="easy_to_hard", segment=6, seed=0)

Bands. The distinct difficulty levels present in `tasks` are cut into three bands, easy / mid /
hard (level k of n goes to band round(2k / (n - 1)); 6 Alchemy levels -> {0,1} {2,3} {4,5}; 3
levels -> one each; 2 levels -> easy and hard).

easy_to_hard. Two blocks of `segment` tasks: block A is drawn from the easy band, block B from the
band the `tier` names (RIME's tiers run easy -> hard over training):
    tier "easy":  A easy, B easy        (pure-easy blocks)
    tier "mid":   A easy, B mid         (easy + mid)
    tier "mixed": A easy+mid, B any band (mixed easy / mid / hard)
    tier "hard":  A easy, B hard        (the default: the paper's "6 easy then 6 hard")
Inside a block tasks run easiest first (by Task.difficulty; RIME measures it by pass rate).
same_group=True (default) draws both blocks from one group (an Alchemy world, a repository), so
what memory learns early stays true later (the issue: "tasks of one stream share a world");
same_group=False draws block B from another group where one qualifies (RIME's "two blocks of 6
tasks, each from a different repository").

shuffled. Exactly the tasks easy_to_hard picks for the same arguments, in a random order: the
paper's ablation changes only the order.

long. Held-out test streams (the 26- and 27-issue codebase streams): every given task of `group`
(all tasks when group is None), groups in order of first appearance, easiest first inside a group,
ties kept in the given order. `segment` and `seed` are ignored.

given. The tasks exactly as given (the 19-instance benchmark stream is fixed by its authors).

Everything is deterministic for a seed and does not depend on the order of `tasks` (except
"long" ties and "given", which follow it on purpose).
"""

import random

ORDERS = ("easy_to_hard", "shuffled", "long", "given")
TIERS = {"easy": ((0,), (0,)), "mid": ((0,), (1,)), "mixed": ((0, 1), (0, 1, 2)), "hard": ((0,), (2,))}


def difficulty_bands(tasks) -> dict:
    """{difficulty level: band} with band 0 = easy, 1 = mid, 2 = hard."""
    levels = sorted({t.difficulty for t in tasks})
    if len(levels) < 2:
        raise ValueError(f"easy_to_hard needs tasks of at least 2 difficulty levels, got levels {levels}")
    return {d: round(2 * k / (len(levels) - 1)) for k, d in enumerate(levels)}


def _pools(tasks, bands, tier):
    """Per group: (block A candidates, block B candidates), each sorted by (difficulty, id)."""
    bands_a, bands_b = TIERS[tier]
    pools = {}
    for t in sorted(tasks, key=lambda t: (t.difficulty, t.id)):
        a, b = pools.setdefault(t.group, ([], []))
        if bands[t.difficulty] in bands_a:
            a.append(t)
        if bands[t.difficulty] in bands_b:
            b.append(t)
    return pools


def _draw_blocks(tasks, segment, rng, tier, same_group, group):
    bands = difficulty_bands(tasks)
    pools = _pools(tasks, bands, tier)
    if group is not None and group not in pools:
        raise ValueError(f"group {group!r} not among the tasks' groups {sorted(pools)}")

    def fits(a, b):  # enough distinct tasks for both blocks (pools may overlap)
        return len(a) >= segment and len(b) >= segment and len({t.id for t in a + b}) >= 2 * segment

    def pick(pool, exclude=()):
        block = rng.sample([t for t in pool if t.id not in exclude], segment)
        return sorted(block, key=lambda t: (t.difficulty, t.id))  # easiest first inside a block

    groups = [group] if group is not None else sorted(pools)
    sizes = ", ".join(f"{g}: {len(a)}/{len(b)}" for g, (a, b) in sorted(pools.items()))
    if same_group:
        ok = [g for g in groups if fits(*pools[g])]
        if not ok:
            raise ValueError(f"no group has {segment} + {segment} distinct tasks for tier {tier!r} "
                             f"(block A/B candidates per group: {sizes}); lower segment or use same_group=False")
        g = rng.choice(ok)
        block_a = pick(pools[g][0])
        return block_a, pick(pools[g][1], exclude={t.id for t in block_a})
    ok_a = [g for g in groups if len(pools[g][0]) >= segment]
    if not ok_a:
        raise ValueError(f"no group has {segment} tasks for block A (candidates per group: {sizes})")
    g = rng.choice(ok_a)
    others = [h for h in sorted(pools) if h != g and len(pools[h][1]) >= segment]
    if others:  # block B from a different group where one qualifies
        return pick(pools[g][0]), pick(pools[rng.choice(others)][1])
    if not fits(*pools[g]):
        raise ValueError(f"no group has {segment} tasks for block B (candidates per group: {sizes})")
    block_a = pick(pools[g][0])
    return block_a, pick(pools[g][1], exclude={t.id for t in block_a})


def make_stream(tasks, order: str = "easy_to_hard", segment: int = 6, seed: int = 0,
                tier: str = "hard", same_group: bool = True, group: str = None) -> list:
    """One stream of tasks (a list of Task). See the module docstring for each order.

    group: restrict the stream (easy_to_hard/shuffled: block A, and block B if same_group) to one
    Task.group; None lets the seed choose.
    """
    tasks = list(tasks)
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    if not tasks:
        raise ValueError("make_stream got no tasks")
    if order == "given":
        return tasks
    if order == "long":
        groups = list(dict.fromkeys(t.group for t in tasks))
        if group is not None and group not in groups:
            raise ValueError(f"group {group!r} not among the tasks' groups {groups}")
        chosen = [group] if group is not None else groups
        # sorted() is stable: equal difficulties keep the given order
        return [t for g in chosen for t in sorted((t for t in tasks if t.group == g), key=lambda t: t.difficulty)]
    if not isinstance(segment, int) or segment < 1:
        raise ValueError(f"segment must be a positive int, got {segment!r}")
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    rng = random.Random(f"stream/{seed}")
    block_a, block_b = _draw_blocks(tasks, segment, rng, tier, same_group, group)
    stream = block_a + block_b
    if order == "shuffled":
        random.Random(f"shuffle/{seed}").shuffle(stream)
    return stream


def make_streams(tasks, num_streams: int, order: str = "easy_to_hard", segment: int = 6,
                 seed: int = 0, tier: str = "hard", same_group: bool = True) -> list:
    """num_streams training streams; stream i uses seed (seed, i) and groups take turns
    (round robin over a seeded shuffle of the groups that can host a stream), so every world or
    repository is visited about equally often."""
    if not isinstance(num_streams, int) or num_streams < 1:
        raise ValueError(f"num_streams must be a positive int, got {num_streams!r}")
    tasks = list(tasks)
    if order in ("long", "given"):
        return [make_stream(tasks, order, segment, seed, tier, same_group) for _ in range(num_streams)]
    groups = sorted({t.group for t in tasks})
    hosts = []
    for g in groups:  # groups that can host a stream for these arguments
        try:
            make_stream(tasks, order, segment, seed, tier, same_group, group=g)
            hosts.append(g)
        except ValueError:
            pass
    if not hosts:  # raise the informative error of an unrestricted draw
        make_stream(tasks, order, segment, seed, tier, same_group)
        raise ValueError("no group can host a stream for these arguments")
    random.Random(f"streams/{seed}").shuffle(hosts)
    return [make_stream(tasks, order, segment, f"{seed}/{i}", tier, same_group, group=hosts[i % len(hosts)])
            for i in range(num_streams)]
