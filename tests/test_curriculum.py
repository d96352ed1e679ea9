"""Task streams: easy -> hard blocks, shuffled, long held-out streams; determinism and errors."""

import random
from collections import Counter

import pytest

from curriculum import TIERS, difficulty_bands, make_stream, make_streams
from envs import Task


def catalogue(groups=("a", "b", "c"), levels=6, per_level=6):
    return [Task(id=f"{g}/{d}/{i}", env="toy", difficulty=d, group=g, split="train")
            for g in groups for d in range(levels) for i in range(per_level)]


def ids(stream):
    return [t.id for t in stream]


def test_bands_split_levels_in_thirds():
    assert difficulty_bands(catalogue(levels=6)) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    assert difficulty_bands(catalogue(levels=3)) == {0: 0, 1: 1, 2: 2}
    assert difficulty_bands(catalogue(levels=2)) == {0: 0, 1: 2}


@pytest.mark.parametrize("segment", [6, 3])
def test_easy_to_hard_is_easy_block_then_hard_block_of_one_group(segment):
    stream = make_stream(catalogue(), "easy_to_hard", segment=segment, seed=1)
    first, second = stream[:segment], stream[segment:]
    assert len(stream) == 2 * segment and len(set(ids(stream))) == 2 * segment
    assert all(t.difficulty in (0, 1) for t in first) and all(t.difficulty in (4, 5) for t in second)
    for block in (first, second):  # easiest first inside a block
        assert [t.difficulty for t in block] == sorted(t.difficulty for t in block)
    assert len({t.group for t in stream}) == 1


def test_same_group_false_puts_blocks_in_different_groups():
    for seed in range(5):
        stream = make_stream(catalogue(), segment=6, seed=seed, same_group=False)
        assert stream[0].group != stream[6].group
        assert len({t.group for t in stream[:6]}) == len({t.group for t in stream[6:]}) == 1


def test_tiers():
    tasks = catalogue()
    for seed in range(3):
        assert {t.difficulty for t in make_stream(tasks, tier="easy", seed=seed)} <= {0, 1}
        mid = make_stream(tasks, tier="mid", seed=seed)
        assert {t.difficulty for t in mid[:6]} <= {0, 1} and {t.difficulty for t in mid[6:]} <= {2, 3}
        mixed = make_stream(tasks, tier="mixed", seed=seed)
        assert {t.difficulty for t in mixed[:6]} <= {0, 1, 2, 3} and len(set(ids(mixed))) == 12
    assert set(TIERS) == {"easy", "mid", "mixed", "hard"}


def test_deterministic_for_a_seed_and_independent_of_input_order():
    tasks = catalogue()
    shuffled_input = random.Random(0).sample(tasks, len(tasks))
    for order in ("easy_to_hard", "shuffled"):
        a = make_stream(tasks, order, seed=7)
        assert ids(a) == ids(make_stream(tasks, order, seed=7)) == ids(make_stream(shuffled_input, order, seed=7))
        assert len({tuple(ids(make_stream(tasks, order, seed=s))) for s in range(6)}) > 1


def test_shuffled_uses_the_same_tasks_in_another_order():
    tasks = catalogue()
    for seed in range(4):
        ordered, shuffled = make_stream(tasks, seed=seed), make_stream(tasks, "shuffled", seed=seed)
        assert sorted(ids(ordered)) == sorted(ids(shuffled))
    assert any(ids(make_stream(tasks, seed=s)) != ids(make_stream(tasks, "shuffled", seed=s)) for s in range(4))


def test_long_and_given_streams():
    tasks = random.Random(1).sample(catalogue(per_level=5), 90)
    stream = make_stream(tasks, "long", group="b")
    assert sorted(ids(stream)) == sorted(t.id for t in tasks if t.group == "b") and len(stream) == 30
    assert [t.difficulty for t in stream] == sorted(t.difficulty for t in stream)
    given_b = [t.id for t in tasks if t.group == "b"]  # ties keep the given order
    for d in range(6):
        assert [t.id for t in stream if t.difficulty == d] == [i for i in given_b if int(i.split("/")[1]) == d]
    everything = make_stream(tasks, "long")
    assert len(everything) == 90 and [t.group for t in everything] == sorted(
        (t.group for t in tasks), key=list(dict.fromkeys(t.group for t in tasks)).index)
    assert ids(make_stream(tasks, "given")) == ids(tasks)


def test_make_streams_rotates_groups_and_is_deterministic():
    tasks = catalogue()
    streams = make_streams(tasks, num_streams=9, order="easy_to_hard", segment=3, seed=2)
    assert len(streams) == 9 and all(len(s) == 6 for s in streams)
    assert Counter(s[0].group for s in streams) == {"a": 3, "b": 3, "c": 3}
    again = make_streams(tasks, num_streams=9, order="easy_to_hard", segment=3, seed=2)
    assert [ids(s) for s in streams] == [ids(s) for s in again]
    assert len({tuple(ids(s)) for s in streams}) == 9


def test_alchemy_tasks_make_6_plus_6_streams_in_every_tier():
    import envs
    tasks = envs.make("alchemy").tasks("train")
    for tier in TIERS:
        stream = make_stream(tasks, tier=tier, segment=6, seed=0)
        assert len(stream) == 12 and len({t.group for t in stream}) == 1


def test_bad_arguments_raise_clear_errors():
    tasks = catalogue()
    with pytest.raises(ValueError, match="unknown order"):
        make_stream(tasks, order="hard_to_easy")
    with pytest.raises(ValueError, match="unknown tier"):
        make_stream(tasks, tier="expert")
    with pytest.raises(ValueError, match="segment"):
        make_stream(tasks, segment=0)
    with pytest.raises(ValueError, match="no tasks"):
        make_stream([])
    with pytest.raises(ValueError, match="at least 2 difficulty levels"):
        make_stream([t for t in tasks if t.difficulty == 3])
    few_easy = [t for t in tasks if t.difficulty >= 1 or t.id.endswith("/0")]  # 1 + 6 easy tasks per group
    with pytest.raises(ValueError, match="no group has 8 \\+ 8"):
        make_stream(few_easy, segment=8)
    with pytest.raises(ValueError, match="group 'zzz'"):
        make_stream(tasks, group="zzz")
    with pytest.raises(ValueError, match="num_streams"):
        make_streams(tasks, num_streams=0)
    with pytest.raises(ValueError, match="no group has"):
        make_streams(few_easy, num_streams=2, segment=8)
