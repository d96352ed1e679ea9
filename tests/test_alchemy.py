"""Symbolic Alchemy: rules against hand-worked examples, exact optimum, reference actor, protocol."""

import functools
import random
import statistics

import pytest

import envs
from alchemy import (ALL_EDGES, COLOURS, AlchemyEnv, FEATURE_NAMES, FEATURES, LEVELS, Chemistry, chemistry_of,
                     explore_action, inferred_best, inferred_best_in, protocol_reply, format_notes, note_reader_reply, observed_notes, oracle_policy, parse_action, parse_notes, parse_observation, stone_text,
                     stone_value, trial_optimum)
from envs import Task

RED, GREEN, ORANGE, CYAN, YELLOW, PINK = range(6)
IDENTITY = dict(perm=(0, 1, 2), dirs=(1, 1, 1))
# a spanning tree of the cube without the edge (6, 0) between latent 110 and 111, and the other 5 edges
TREE = [[0, 1], [1, 1], [4, 1], [5, 1], [0, 0], [4, 0], [0, 2]]
EXTRA = [[2, 0], [6, 0], [1, 2], [2, 2], [3, 2]]


@pytest.fixture(scope="module")
def env():
    return envs.make("alchemy")


@pytest.fixture(scope="module")
def train(env):
    return env.tasks("train")


def hand_task(stones, potions, difficulty=0, flips=0, perm=(0, 1, 2), dirs=(1, 1, 1), trials=1):
    data = {"flips": flips, "perm": list(perm), "dirs": list(dirs), "tree": TREE, "extra": EXTRA,
            "world": "hand", "difficulty": difficulty,
            "trials": [{"stones": list(stones), "potions": list(potions)}] * trials}
    return Task(id="alchemy/hand/t00", env="alchemy", difficulty=difficulty, group="hand", split="test", data=data)


def play(env, task, policy):
    obs, done, rewards = env.reset(task), False, []
    while not done:
        obs, reward, done = env.step(policy(obs))
        rewards.append(reward)
    return env.info["score"], rewards


# --- rules --------------------------------------------------------------------------------------

def test_stone_values_are_dm_alchemy_rewards():
    # latent bit i set = coordinate +1; value x + y + z, + 12 at (1, 1, 1)
    assert [stone_value(v) for v in (0, 1, 2, 4, 3, 5, 6, 7)] == [-3, -1, -1, -1, 1, 1, 1, 15]


def test_potion_moves_stone_along_its_axis_and_direction():
    chem = Chemistry(0, (0, 1, 2), (1, 1, 1), frozenset(map(tuple, ALL_EDGES)))
    assert chem.apply(0b000, RED) == 0b001      # red: axis 0 towards +1
    assert chem.apply(0b001, RED) == 0b001      # already at that end: nothing
    assert chem.apply(0b001, GREEN) == 0b000    # its pair partner goes the other way
    assert chem.apply(0b000, ORANGE) == 0b010 and chem.apply(0b000, YELLOW) == 0b100
    # a permuted, flipped potion map: pair 0 -> axis 2, pair 1 -> axis 0, pair 2 -> axis 1 (reversed)
    chem = Chemistry(0, (2, 0, 1), (1, -1, 1), frozenset(map(tuple, ALL_EDGES)))
    assert chem.potion_effect(RED) == (2, 1) and chem.potion_effect(GREEN) == (2, 0)
    assert chem.potion_effect(ORANGE) == (0, 1) and chem.potion_effect(CYAN) == (0, 0)
    assert chem.potion_effect(YELLOW) == (1, 0) and chem.potion_effect(PINK) == (1, 1)
    assert chem.apply(0b000, PINK) == 0b010 and chem.apply(0b010, YELLOW) == 0b000


def test_removed_edge_blocks_the_potion():
    edges = frozenset(map(tuple, TREE))
    chem = Chemistry(0, (0, 1, 2), (1, 1, 1), edges)
    assert (6, 0) not in edges
    assert chem.apply(0b110, RED) == 0b110      # edge 110 - 111 removed: no effect
    assert chem.apply(0b111, GREEN) == 0b111    # undirected: blocked both ways
    assert chem.apply(0b100, RED) == 0b101      # edge (4, 0) kept


def test_step_by_step_hand_example(env):
    # size axis reversed (flips=1): latent 110 (value +1) shows as large purple pointy
    obs = env.reset(hand_task(stones=[0b110, 0b000], potions=[RED, YELLOW], flips=1))
    assert obs.endswith("Trial 1 of 1, 20 steps left.\nStones: s1 large purple pointy (value +1); "
                        "s2 large blue round (value -3)\nPotions: p1 red, p2 yellow\n"
                        "Actions: apply P S | cauldron S | end")
    obs, reward, done = env.step("apply p1 s1")
    # the effect in a note's own words ("small red": red makes a stone small), then the stone's new look
    assert obs.startswith("p1 red on s1: small red. s1 is now small purple pointy (value +15), best small purple pointy.")
    assert (reward, done) == (0.0, False)
    obs, reward, done = env.step("apply p2 s1")     # yellow: latent axis 2 towards +1, already there
    assert obs.startswith("p2 yellow on s1: no effect.") and "Potions: none" in obs
    obs, reward, done = env.step("cauldron s1")
    assert obs.startswith("s1 into the cauldron: value +15, best small purple pointy.") and not done
    assert reward == pytest.approx(1.0)              # +15 is this trial's optimum
    obs, reward, done = env.step("end")
    assert done and "score 1.00" in obs and env.info["value"] == env.info["optimal"] == 15


def test_blocked_edge_in_env_and_detour_is_optimal(env):
    # difficulty 5 keeps only TREE: the direct red step 110 -> 111 is gone, but
    # 110 -cyan-> 100 -red-> 101 -orange-> 111 reaches +15 along the tree
    task = hand_task(stones=[0b110], potions=[RED, CYAN, ORANGE], difficulty=5)
    assert trial_optimum(chemistry_of(task.data), [0b110], [RED, CYAN, ORANGE]) == 15
    env.reset(task)
    obs, _, _ = env.step("apply p1 s1")
    assert obs.startswith("p1 red on s1: no effect.")
    score, _ = play(env, task, oracle_policy(env))
    assert score == 1.0
    obs = env.reset(hand_task(stones=[0b110], potions=[RED], difficulty=0))  # all 12 edges
    assert env.step("apply p1 s1")[0].startswith("p1 red on s1: large red. s1 is now large purple pointy (value +15)")


def test_negative_stone_gives_negative_reward_and_rewards_sum_to_score(env):
    task = hand_task(stones=[0b011, 0b000], potions=[YELLOW])  # +1 stone; -3 stone; yellow makes 011 -> 111
    env.reset(task)
    _, r1, _ = env.step("apply p1 s1")
    _, r2, _ = env.step("cauldron s1")   # +15 of 15
    _, r3, done = env.step("cauldron s2")  # -3: the ratio drops to 12 / 15
    assert done and r2 == pytest.approx(1.0) and r3 == pytest.approx(-3 / 15)
    assert r1 + r2 + r3 == pytest.approx(env.info["score"]) == pytest.approx(0.8)
    env.reset(task)
    _, r, _ = env.step("cauldron s2")
    _, r2, done = env.step("end")
    assert r == 0.0 and done and env.info["score"] == 0.0  # clipped at 0


# --- the exact optimum --------------------------------------------------------------------------

def brute_force(chem, stones, potions):
    """Independent reference: try every action sequence of the game itself (memoised)."""
    @functools.lru_cache(maxsize=None)
    def best(stones, potions):
        value = 0  # "end"
        for i, s in enumerate(stones):
            rest = stones[:i] + stones[i + 1:]
            value = max(value, stone_value(s) + best(rest, potions))
            for j, c in enumerate(potions):
                if j and potions[j - 1] == c:
                    continue
                value = max(value, best(tuple(sorted(rest + (chem.apply(s, c),))), potions[:j] + potions[j + 1:]))
        return value
    return best(tuple(sorted(stones)), tuple(sorted(potions)))


def test_solver_matches_brute_force_on_random_trials(train):
    rng = random.Random(0)
    for task in rng.sample(train, 25):
        chem = chemistry_of(task.data)
        for _ in range(2):
            stones = [rng.randrange(8) for _ in range(rng.randint(1, 3))]
            potions = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
            assert trial_optimum(chem, stones, potions) == brute_force(chem, stones, potions)


def test_optimal_plan_scores_exactly_one(env, train):
    for task in train[::24]:  # every world, all difficulties
        score, rewards = play(env, task, oracle_policy(env))
        assert env.info["value"] == env.info["optimal"] > 0
        assert score == 1.0 and sum(rewards) == pytest.approx(1.0)


# --- tasks and worlds ---------------------------------------------------------------------------

def test_tasks_cover_worlds_and_difficulties(env, train):
    test = env.tasks("test")
    assert len(train) == 16 * 36 and len(test) == 4 * 36
    assert len({t.id for t in train + test}) == len(train) + len(test)
    assert {t.group for t in train}.isdisjoint({t.group for t in test})
    for task in train[:36] + test[:36]:
        chem = chemistry_of(task.data)
        assert len(chem.edges) == 12 - task.difficulty == LEVELS[task.difficulty][0]
        reached, frontier = {0}, [0]  # every corner reachable
        while frontier:
            v = frontier.pop()
            for lo, a in chem.edges:
                for u, w in ((lo, lo | 1 << a), (lo | 1 << a, lo)):
                    if u == v and w not in reached:
                        reached.add(w); frontier.append(w)
        assert reached == set(range(8))
        for trial in task.data["trials"]:
            assert 7 not in trial["stones"]
            assert (len(trial["stones"]), len(trial["potions"])) == LEVELS[task.difficulty][1:]
            assert trial_optimum(chem, trial["stones"], trial["potions"]) > 0


def test_more_training_worlds_keep_the_test_worlds(env):
    """--train-worlds past 16 adds training worlds and leaves the test tasks as they were (so runs
    that train on more worlds are scored on the same tasks); fewer than 16 moves them down, as before."""
    more = AlchemyEnv(num_train_worlds=20, tasks_per_level=1)
    base = AlchemyEnv(tasks_per_level=1)
    assert [(t.id, t.data) for t in more.tasks("test")] == [(t.id, t.data) for t in base.tasks("test")]
    assert {t.group for t in more.tasks("test")} == {"w16", "w17", "w18", "w19"}
    train = {t.group for t in more.tasks("train")}
    assert len(train) == 20 and train.isdisjoint({"w16", "w17", "w18", "w19"}) and "w23" in train
    assert [t.data for t in more.tasks("train")[:16 * 6]] == [t.data for t in base.tasks("train")]
    fewer = AlchemyEnv(num_train_worlds=3, num_test_worlds=2, tasks_per_level=1)
    assert {t.group for t in fewer.tasks("train")} == {"w00", "w01", "w02"}
    assert {t.group for t in fewer.tasks("test")} == {"w03", "w04"}


def test_world_fixes_chemistry_and_graphs_are_nested(train):
    world = [t for t in train if t.group == "w03"]
    assert len({(t.data["flips"], tuple(t.data["perm"]), tuple(t.data["dirs"])) for t in world}) == 1
    by_level = {t.difficulty: chemistry_of(t.data).edges for t in world}
    for d in range(1, len(LEVELS)):
        assert by_level[d] < by_level[d - 1]  # a harder task only loses edges
    assert len({(t.data["flips"], tuple(t.data["perm"])) for t in train}) > 4  # worlds differ


def test_determinism_and_clone(env):
    a, b = envs.make("alchemy", seed=0).tasks("test"), env.clone().tasks("test")
    assert [(t.id, t.data) for t in a] == [(t.id, t.data) for t in b]
    assert [t.data for t in envs.make("alchemy", seed=1).tasks("test")] != [t.data for t in a]
    runs = []
    for e in (env, env.clone()):
        rng, obs, done, trace = random.Random(3), e.reset(a[40]), False, []
        while not done:
            state = parse_observation(obs)
            action = rng.choice([f"apply p{p} s{s}" for p in state["potions"] for s in state["stones"]]
                                + [f"cauldron s{s}" for s in state["stones"]] + ["end"])
            obs, reward, done = e.step(action)
            trace.append((obs, reward))
        runs.append(trace)
    assert runs[0] == runs[1]


# --- protocol -----------------------------------------------------------------------------------

def test_parse_action_forms():
    assert parse_action("apply p1 s2") == ("apply", (1, 2))
    assert parse_action("  Apply potion 3 to stone 4. ") == ("apply", (3, 4))
    assert parse_action("cauldron s2") == ("cauldron", (2,))
    assert parse_action("put s1 into the cauldron") == ("cauldron", (1,))
    assert parse_action("END") == ("end", ())
    assert parse_action("apply p1") is None and parse_action("") is None and parse_action("drink p1") is None


def test_invalid_actions_explain_and_never_raise(env, train):
    env.reset(train[0])
    for bad, message in (("fly away", "Invalid action 'fly away'."), ("apply p9 s1", "There is no potion p9."),
                         ("cauldron s7", "There is no stone s7."), (None, "Invalid action"), (42, "Invalid action")):
        obs, reward, done = env.step(bad)
        assert obs.startswith(message) and "apply P S (e.g. apply p1 s1)" in obs
        assert reward == 0.0 and not done
    assert env.info["invalid"] == 5 and "15 steps left" in obs
    for _ in range(15):  # invalid actions use the trial's steps up
        obs, _, _ = env.step("?")
    assert "No steps left. Trial 1 ended" in obs and "Trial 2 of 3, 20 steps left." in obs
    with pytest.raises(ValueError, match="alchemy Task"):
        env.reset(Task("x", "shop", 0, "g", "train"))
    with pytest.raises(ValueError, match="split"):
        env.tasks("valid")
    with pytest.raises(ValueError, match="trial_steps"):
        envs.make("alchemy", trial_steps=5)
    with pytest.raises(ValueError, match="actor_context must be 'all' or 'latest'"):
        envs.make("alchemy", actor_context="last")


def test_episode_end_and_budget(env, train):
    obs, done, steps = env.reset(train[100]), False, 0
    while not done:
        obs, reward, done = env.step("end")
        steps += 1
    assert steps == 3 <= env.max_steps and "The episode is over" in obs and env.info["score"] == 0.0
    assert env.step("end") == ("The episode is over.", 0.0, True)


# --- the reference actor ------------------------------------------------------------------------

def random_policy(seed):
    rng = random.Random(seed)

    def act(obs):
        state = parse_observation(obs)
        return rng.choice([f"apply p{p} s{s}" for p in state["potions"] for s in state["stones"]]
                          + [f"cauldron s{s}" for s in state["stones"]] + ["end"])
    return act


def test_reference_beats_random_by_a_wide_margin(env, train):
    tasks = train[::len(train) // 50][:50]
    ref = [play(env, t, env.reference_policy(t))[0] for t in tasks]
    rnd = [play(env, t, random_policy(i))[0] for i, t in enumerate(tasks)]
    assert statistics.mean(ref) > 0.7 and statistics.mean(ref) > statistics.mean(rnd) + 0.5


def test_reference_does_not_peek_and_rewards_sum_to_score(env, train):
    task = train[77]
    blind = Task(task.id, "alchemy", task.difficulty, task.group, task.split, data={})  # no hidden data
    score, rewards = play(env, task, env.reference_policy(blind))
    assert 0.0 <= score <= 1.0 and sum(rewards) == pytest.approx(score)


def true_knowledge(task):
    chem = chemistry_of(task.data)
    potions = {}
    for c in range(6):
        axis, bit = chem.potion_effect(c)
        potions[COLOURS[c]] = FEATURES[axis][bit ^ (chem.flips >> axis & 1)]
    good = {FEATURE_NAMES[i]: FEATURES[i][1 ^ (chem.flips >> i & 1)] for i in range(3)}
    blocked = [f"{stone_text(lo ^ chem.flips)} <-> {stone_text(lo ^ chem.flips ^ 1 << a)}"
               for lo, a in ALL_EDGES if (lo, a) not in chem.edges]
    return {"potions": potions, "good": good, "blocked": blocked}


def test_reference_with_the_true_chemistry_plays_optimally(env, train):
    for task in train[5::48]:
        knowledge = true_knowledge(task)
        assert play(env, task, env.reference_policy(task, knowledge=knowledge))[0] == 1.0
        assert play(env, task, env.reference_policy(task, notes=format_notes(knowledge)))[0] == 1.0


def test_notes_from_an_earlier_task_help(env, train):
    without, with_notes = [], []
    for task in train[6::24]:  # one difficulty-1+ task per world
        earlier = next(t for t in train if t.group == task.group and t.difficulty == 0)
        writer = env.reference_policy(earlier)
        play(env, earlier, writer)
        with_notes.append(play(env, task, env.reference_policy(task, notes=writer.notes()))[0])
        without.append(play(env, task, env.reference_policy(task))[0])
    assert statistics.mean(with_notes) > statistics.mean(without) + 0.05


def test_knowledge_is_inferred_and_round_trips_through_notes(env, train):
    task = train[30]
    policy = env.reference_policy(task)
    play(env, task, policy)
    truth, knowledge = true_knowledge(task), policy.knowledge
    assert knowledge["potions"] and all(truth["potions"][c] == v for c, v in knowledge["potions"].items())
    assert all(truth["good"][f] == v for f, v in knowledge["good"].items())
    assert set(knowledge["blocked"]) <= set(truth["blocked"])
    assert parse_notes(policy.notes()) == knowledge
    assert parse_notes("garbage ### potion blue makes a stone huge") == {"potions": {}, "good": {}, "blocked": []}
    with pytest.raises(ValueError, match="knowledge must be a dict"):
        env.reference_policy(task, knowledge="red makes large")


def test_wrong_notes_are_overridden_by_observation(env, train):
    task = train[200]
    wrong = true_knowledge(task)
    wrong["good"] = {f: FEATURES[i][0] if v == FEATURES[i][1] else FEATURES[i][1]
                     for i, (f, v) in enumerate(wrong["good"].items())}  # every feature reversed
    policy = env.reference_policy(task, knowledge=wrong)
    score, _ = play(env, task, policy)
    assert policy.knowledge["good"] == true_knowledge(task)["good"] and score > 0.5


def test_tasks_are_made_once_per_config_and_handed_out_as_copies():
    """Envs of one config (clones included) share the solved tasks; another config gets its own, and
    a caller editing its list changes nobody else's."""
    a, b = AlchemyEnv(num_trials=1), AlchemyEnv(num_trials=1)
    first = a.tasks("test")
    assert b.tasks("test") == first and b.clone().tasks("test")[0] is first[0]
    first.clear()
    assert len(a.tasks("test")) == 4 * 6 * 6
    assert AlchemyEnv(num_trials=2).tasks("test")[0].data != a.tasks("test")[0].data


# --- the words memory hops use (key-adjacent notes, colour-named applies, the note reader) -----------

def test_a_potion_can_be_named_by_colour(env):
    # size axis reversed: latent 110 shows as large purple pointy; red (first of its pair) sets latent size +1
    obs = env.reset(hand_task(stones=[0b110], potions=[YELLOW, RED, RED], flips=1))
    obs, _, _ = env.step("apply red s1")               # the first red potion: p2
    assert obs.startswith("p2 red on s1: small red.") and "Potions: p1 yellow, p3 red" in obs
    obs, _, _ = env.step("apply pink s1")               # none on the table: invalid, a step used
    assert obs.startswith("There is no pink potion.") and env.info["invalid"] == 1


def test_notes_are_key_adjacent_and_read_back_in_both_wordings():
    knowledge = {"potions": {"pink": "large", "red": "round"}, "good": dict(zip(FEATURE_NAMES, ("large", "purple", "pointy"))),
                 "blocked": ["small blue round <-> large blue round"]}
    notes = format_notes(knowledge)
    assert notes.splitlines()[:3] == ["- large pink", "- round red", "- best large purple pointy"]
    assert parse_notes(notes) == knowledge
    old = "- Potion pink makes a stone large.\n- Best stone: large purple pointy (value +15)."
    assert parse_notes(old)["potions"] == {"pink": "large"} and len(parse_notes(old)["good"]) == 3
    # a quoted outcome line states its effect in the same words, and stone words never pose as one
    quoted = "- p2 pink on s1: large pink. s1 is now large purple pointy (value +15), best large purple pointy."
    assert parse_notes(quoted)["potions"] == {"pink": "large"} and parse_notes(quoted)["good"]["size"] == "large"


def test_the_note_reader_acts_only_on_what_its_notes_decide():
    obs = ("Trial 1 of 1, 20 steps left.\nStones: s1 small blue round (value -3); s2 small purple pointy (value +1)\n"
           "Potions: p1 red, p2 pink, p3 pink\nActions: apply P S | cauldron S | end")
    notes = "### Repository Knowledge\n- large pink\n- best large purple pointy"
    # s1, the first stone listed, lacks "large" first, and the notes say pink gives it
    assert note_reader_reply(notes, obs) == \
        "s1 small blue round best large purple pointy need large pink <action>apply pink s1</action>"
    assert note_reader_reply("- best large purple pointy", obs) is None          # no note for "large"
    assert note_reader_reply("- large pink", obs) is None                        # no best stone noted
    assert note_reader_reply("- large green\n- best large purple pointy", obs) is None   # no green potion here
    obs15 = obs.replace("s2 small purple pointy (value +1)", "s2 large purple pointy (value +15)")
    assert note_reader_reply("", obs15) == "<action>cauldron s2</action>"
    # the reader reads whatever the notes say: a false note is followed as faithfully as a true one
    assert note_reader_reply("- large red\n- best large purple pointy", obs) == \
        "s1 small blue round best large purple pointy need large red <action>apply red s1</action>"
    # with s1 gone (say, in the cauldron), s2 is the first stone listed
    obs2 = obs.replace("s1 small blue round (value -3); ", "")
    assert note_reader_reply(notes, obs2) == \
        "s2 small purple pointy best large purple pointy need large pink <action>apply pink s2</action>"


def test_the_protocol_explores_in_a_fixed_order():
    """explore_action: a +15 stone into the cauldron; else the first potion on the table on the first stone;
    no potion left: the first positive stone into the cauldron, else end."""
    stones = {1: (["small", "blue", "round"], -3), 2: (["small", "purple", "pointy"], 1), 3: (["large", "blue", "pointy"], 1)}
    assert explore_action(stones, ["red", "pink"]) == "<action>apply red s1</action>"
    assert explore_action({**stones, 3: (["large", "purple", "pointy"], 15)}, ["red"]) == "<action>cauldron s3</action>"
    assert explore_action(stones, []) == "<action>cauldron s2</action>"
    assert explore_action({1: (["small", "blue", "round"], -3)}, []) == "<action>end</action>"
    assert explore_action({}, ["red"]) == "<action>end</action>"


def test_observed_notes_transcribe_only_what_the_observations_said():
    """The protocol writer's facts: an apply that changed a stone gives "- large pink" (its words, its
    order), a stone at +15 (after an apply or in the cauldron) gives "- best ..."; "no effect", an invalid
    action, or a stone description are never read as an effect; repeats are noted once."""
    obs = ["Symbolic Alchemy ...\nStones: s1 small purple pointy (value +1)\nPotions: p1 pink, p2 red",
           "p1 pink on s1: large pink. s1 is now large purple pointy (value +15), best large purple pointy.\nStones: ...",
           "p2 red on s1: no effect.\n", "There is no pink potion. Use: apply P S ...",
           "p3 pink on s2: large pink. s2 is now large blue round (value -1).",
           "s1 into the cauldron: value +15, best large purple pointy."]
    assert observed_notes(obs) == ["- large pink", "- best large purple pointy"]
    assert parse_notes("\n".join(observed_notes(obs))) == {"potions": {"pink": "large"},
                                                          "good": dict(zip(FEATURE_NAMES, ("large", "purple", "pointy"))),
                                                          "blocked": []}
    assert observed_notes(["p1 pink on s1: large red. s1 is now ..."]) == []     # not its own colour: not an effect


def test_the_best_stone_inferred_from_the_writers_text_is_the_one_the_episode_implies():
    """inferred_best_in reads every look with its value in a text, outcome heads included ("s1 is now ...
    (value -3)"): on the writer's view of real episodes (rollout.trajectory_text, whose cut observations
    keep few whole states) it settles the best stone wherever the whole observations do, and never wrongly;
    a state block alone settles far fewer. Words that are no stone's, or no value, count for nothing."""
    import pretrain, rollout, warmstart
    env = AlchemyEnv(num_trials=1)             # the laptop preset's task: one trial, the writer's text holds it
    tasks = env.tasks("train")[:60]
    eps = rollout.run_scripted(pretrain.load_reader()[1], env, tasks, [warmstart.protocol_policy("") for _ in tasks], max_turns=24)
    whole = text = states = 0
    for ep in eps:
        truth = "- best " + stone_text(7 ^ chemistry_of(ep.task.data).flips)
        got = inferred_best_in(rollout.trajectory_text(ep, 1200))
        assert got in (None, truth), ep.task.id
        assert (got is None) == (inferred_best(ep.observations) is None), ep.task.id
        whole += got is not None
        states += inferred_best(ep.observations[:1]) is not None
    assert whole >= 45 and whole > states + 10
    assert inferred_best_in("s1 small blue round (value -3)") == "- best large purple pointy"
    assert inferred_best_in("s1 small blue round (value +1)") is None
    assert inferred_best_in("s1 tiny blue round (value -3); small blue round") is None


def test_the_best_stone_is_inferred_from_the_values_seen_and_never_wrong(env, train):
    """inferred_best: a stone of value -3 has every feature at its bad end, so the best is its opposite;
    one stone of +1 alone leaves it open (None). On real tasks the first observation settles it in most
    and is never wrong (the +15 corner's look is the stone map's image of latent 111)."""
    obs = env.reset(hand_task(stones=[0b110, 0b000], potions=[RED, YELLOW], flips=1))
    assert inferred_best([obs]) == "- best small purple pointy"
    assert inferred_best([env.reset(hand_task(stones=[0b110], potions=[RED], flips=1))]) is None
    assert inferred_best(["Symbolic Alchemy: no stones here"]) is None
    settled = 0
    for task in train[:40]:
        first = env.reset(task)
        got = inferred_best([first])
        if got is not None:
            assert got == "- best " + stone_text(7 ^ chemistry_of(task.data).flips), task.id
            settled += 1
    assert settled >= 20
