"""DeepResearch: SQuAD-style EM / F1 by hand, the generated world and its questions, the reference
policy (with facts kept in memory), a random policy, hidden answers, bad actions, budget."""

import json
import random
import re

import pytest

from deepresearch import PATTERNS, RELATIONS, DeepResearchEnv, answer_reward, f1_score, normalize_answer
from conftest import check_relay_needs_the_fact_carried, run_episode


@pytest.fixture
def env():
    e = DeepResearchEnv(seed=0)
    yield e
    e.close()


def test_normalisation_and_f1_hand_cases():
    assert normalize_answer("The  Varnok, Systems!") == "varnok systems"
    assert normalize_answer("An apple a day") == "apple day"
    assert f1_score("Varnok Labs", "Varnok Systems") == pytest.approx(0.5)       # P = R = 1/2
    assert f1_score("Varnok", "Varnok Systems") == pytest.approx(2 / 3)           # P = 1, R = 1/2
    assert f1_score("Ilsa Varnok Systems", "Varnok") == pytest.approx(0.5)        # P = 1/3, R = 1
    assert f1_score("Tolmere", "Avaria") == 0.0
    assert answer_reward("the Varnok Systems.", "Varnok Systems") == (1.0, {"em": 1.0, "f1": 1.0})
    r, parts = answer_reward("Varnok Labs", "Varnok Systems")
    assert r == pytest.approx(0.25) and parts == {"em": 0.0, "f1": pytest.approx(0.5)}
    r, parts = answer_reward("Systems Varnok", "Varnok Systems")       # right words, wrong order: not exact
    assert r == pytest.approx(0.5) and parts["em"] == 0.0 and parts["f1"] == 1.0
    assert answer_reward("Varnok Labs", "Varnok Systems", partial_credit=0.0)[0] == 0.0


def test_world_corpus_and_questions(env):
    assert len(env.docs) >= 2000
    assert len(set(env.doc_ids)) == len(env.docs)
    train, test = env.tasks("train"), env.tasks("test")
    assert {t.group for t in train}.isdisjoint({t.group for t in test})
    assert {t.difficulty for t in test} == {0, 1, 2}
    assert all(json.loads(json.dumps(t.data)) == t.data for t in train + test), "Task.data must be JSON"
    texts = {title: text for title, text in env.docs}
    for t in test:
        path, answer = t.data["path"], t.data["answer"]
        assert len(path) == t.difficulty + 2 and 2 <= len(path) <= 4
        start = t.data["question"].rsplit(" of ", 1)[1].rstrip("?")
        assert answer not in t.data["question"]
        # walk the chain through the documents alone: every hop is stated by one page
        cur = start
        for rel in path:
            title = (f"{cur}: career" if rel == "employer" else f"{cur}: early life") \
                if RELATIONS[rel][0] == "person" else cur
            cur = re.search(PATTERNS[rel], texts[title]).group(1)
        assert cur == answer, t.id
    assert [t.data for t in DeepResearchEnv(seed=0).tasks("test")] == [t.data for t in test], "not deterministic"


def test_reference_policy_solves_test_tasks(env):
    tasks = [t for t in env.tasks("test") if t.group in ("region19", "region24")]
    scores = [run_episode(env, t, env.reference_policy(t)) for t in tasks]
    assert sum(s == 1.0 for s in scores) >= 0.9 * len(scores), scores
    facts = env.memory_files()["facts.md"]
    assert re.search(r"^- \w+ of .+: .+$", facts, re.M)
    # with the facts file the second pass over the same region needs fewer actions
    steps_before = env.info["steps"]
    run_episode(env, tasks[-1], env.reference_policy(tasks[-1]))
    assert env.info["success"] and env.info["steps"] < steps_before


def test_random_policy_scores_low(env):
    rng = random.Random(0)

    def random_policy(obs):
        ids = re.findall(r"\[(d\d+)\]", obs)
        words = re.findall(r"[A-Z][a-z]+", obs) or ["Nobody"]
        return rng.choice([f"search[{rng.choice(words)}]", f"open[{rng.choice(ids) if ids else 'd0001'}]",
                           f"answer[{rng.choice(words)}]", "shell: ls"])

    scores = [run_episode(env, t, random_policy) for t in env.tasks("test")[:30]]
    assert sum(scores) / len(scores) < 0.15, scores
    assert sum(s == 1.0 for s in scores) <= 1


def test_answers_are_hidden_from_the_workspace(env):
    t = env.tasks("test")[5]
    obs = env.reset(t)
    answer = t.data["answer"]
    assert answer not in obs
    for cmd in [f"grep -ri '{answer}' .", "find . -type f", "ls -la"]:
        obs, r, done = env.step(f"shell: {cmd}")
        assert answer not in obs.split("\n", 1)[1], (cmd, obs)
    assert not done and r == 0.0
    assert not any(answer in text for text in env.memory_files().values())


def test_malformed_actions_never_raise(env):
    env.reset(env.tasks("test")[0])
    bad = ["", None, "open[]", "open[d99999]", "open[Ilsa]", "search[]", "search[ ?? ]", "answer[]", "answer[ . ]",
           "ANSWER", "find[x]", "search[x", "shell:  ", "x" * 5000, "buy"]
    for a in bad:
        obs, r, done = env.step(a)
        assert r == 0.0 and not done and "Valid actions" in obs, (a, obs)
    assert env.info["num_invalid"] == len(bad)
    obs, r, done = env.step("search[Zzzqqq]")
    assert obs.startswith("No results") and not done


def test_episode_ends_at_the_budget():
    env = DeepResearchEnv(seed=0, max_steps=4)
    try:
        env.reset(env.tasks("test")[0])
        dones = [env.step("open[d0001]")[2] for _ in range(4)]
        assert dones == [False] * 3 + [True] and env.info["success"] is False
        assert env.step("answer[x]")[1:] == (0.0, True)
    finally:
        env.close()


def test_memory_survives_reset_and_can_be_replaced(env):
    tasks = env.tasks("train")
    env.reset(tasks[0])
    env.step("shell: echo '- country of Thumo: Liove' > .agent_memory/facts.md && mkdir junk")
    env.reset(tasks[1])
    assert env.memory_files() == {"facts.md": "- country of Thumo: Liove\n"}
    assert not (env.workdir / "junk").exists()
    env.set_memory_files({})
    assert env.memory_files() == {}


# ----------------------------------------------------------------------------- the relay family (CAMG's laptop preset)


def test_relay_tasks_need_the_fact_carried_across_a_context_reset():
    """At camg.py's preset (context budget, turns, reply length, its "small" BPE) the reference policy,
    knowing only its current context, solves every sampled relay task, at least half of them through a reset;
    the same policy without CONTINUATION.md (it starts over after a reset) fails every task it resets in."""
    check_relay_needs_the_fact_carried("deepresearch")
