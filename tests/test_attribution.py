"""attribution.py: replaying stored memories gives back the evaluation, and the RL effect splits
into the writer's and the actor's parts exactly."""

import pytest

import attribution
import envs
import rime
from model import tiny


@pytest.fixture(scope="module")
def two_evals():
    args = rime.parse_args(["--model", "tiny", "--eval-streams", "4", "--eval-segment", "1", "--max-turns", "3",
                            "--max-new-tokens", "8", "--memory-tokens", "24"])
    env = envs.make("alchemy", num_trials=1)
    streams = rime.eval_streams(env, args)
    actors, evals = {}, {}
    for name, seed in (("before RL", 0), ("after RL", 1)):
        model, tok = tiny("qwen3", seed=seed)
        actors[name] = model.eval()
        evals[name] = rime.evaluate(model, tok, env, streams, args)
    settings = dict(temperature=0.0, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens)
    return actors, evals, tok, env, streams, settings


def test_a_replay_of_an_actors_own_memories_is_its_evaluation(two_evals):
    actors, evals, tok, env, streams, settings = two_evals
    for name, model in actors.items():
        got = attribution.replay(model, tok, env, streams, evals[name]["memories"], **settings)
        assert got == pytest.approx(evals[name]["stream_rewards"], abs=1e-9)
        # an evaluation stored without its per-stream scratch sums gets them back from a replay
        old = {k: v for k, v in evals[name].items() if k != "stream_scratch"}
        assert attribution.scratch_of(old, model, tok, env, streams, **settings) == pytest.approx(
            evals[name]["stream_scratch"], abs=1e-9)


def test_the_rl_effect_splits_into_writer_actor_and_interaction(two_evals):
    actors, evals, tok, env, streams, settings = two_evals
    calls = []
    out = attribution.attribute(actors, evals, tok, env, streams, on_replay=lambda: calls.append(1), **settings)
    assert len(calls) == 4                       # two crossed replays, two from another world
    cells, parts = out["cells"], out["parts"]
    assert cells["before RL actor, before RL memories"]["stream_gains"] == evals["before RL"]["stream_gains"]
    assert cells["after RL actor, after RL memories"]["stream_gains"] == evals["after RL"]["stream_gains"]
    total = [a - b for a, b in zip(evals["after RL"]["stream_gains"], evals["before RL"]["stream_gains"])]
    assert parts["total"]["delta"] == pytest.approx(sum(total) / len(total))
    assert parts["writer"]["delta"] + parts["actor"]["delta"] + parts["interaction"]["delta"] == pytest.approx(
        parts["total"]["delta"])
    worlds = [s[0].group for s in streams]
    assert all(worlds[p] != worlds[i] for i, p in enumerate(out["other_world"]))
    assert "another world's after RL memories" in " ".join(cells) and "writer part" in attribution.markdown(out)


def test_reference_memories_are_read_by_every_actor(two_evals):
    """A reference memory set gives each actor one more cell; given the after-RL memories themselves, the
    before-RL actor's cell is its crossed replay."""
    actors, evals, tok, env, streams, settings = two_evals
    out = attribution.attribute(actors, evals, tok, env, streams, references={"given": evals["after RL"]["memories"]},
                                **settings)
    cells = out["cells"]
    assert cells["before RL actor, given memories"] == cells["before RL actor, after RL memories"]
    assert cells["after RL actor, given memories"] == cells["after RL actor, after RL memories"]


def test_the_scripted_writers_stream_notes_are_true():
    """alchemy.stream_notes: one memory per task, in the writer's format, every stated effect true, and
    some effect known by the end of the first block and of the stream (a yardstick the learned
    writer's notes are replayed against)."""
    import alchemy
    import rewards
    env = envs.make("alchemy", num_trials=1)
    stream = rime.eval_streams(env, rime.parse_args(["--eval-streams", "1"]))[0]
    notes = alchemy.stream_notes(env, stream)
    assert len(notes) == len(stream) and all(rewards.writer_format_ok(n, "")[0] for n in notes)
    acc = [alchemy.memory_accuracy(n, t) for n, t in zip(notes, stream)]
    assert all(a in (None, 1.0) for a, _ in acc) and acc[-1][1] > 0
    covered = [c for _, c in acc]
    assert covered[len(stream) // 2 - 1] > 0                     # the first block's world is learned


def test_one_world_has_no_other_world():
    env = envs.make("alchemy", num_trials=1, num_test_worlds=1)
    streams = rime.eval_streams(env, rime.parse_args(["--eval-streams", "3"]))
    assert attribution.other_world(streams) is None


def test_a_scripted_writer_in_the_loop_writes_what_the_next_task_reads(two_evals):
    """play_with_writer: a writer that writes nothing gives back the actor's from-scratch sums (greedy, same
    seeds); a writer's memory after task t is the one task t + 1 reads; attribute's writers add a cell each."""
    actors, evals, tok, env, streams, settings = two_evals
    model = actors["before RL"]
    assert attribution.play_with_writer(model, tok, env, streams, lambda ep, old: "", **settings) == pytest.approx(
        evals["before RL"]["stream_scratch"], abs=1e-9)
    seen = []

    def write(ep, old):
        seen.append((ep.memory, old))
        return f"### Repository Knowledge\n- after {ep.task.id}\n"
    longer = rime.eval_streams(env, rime.parse_args(["--model", "tiny", "--eval-streams", "2", "--eval-segment", "2"]))
    attribution.play_with_writer(model, tok, env, longer, write, **settings)
    assert len(seen) == 2 * 3                                   # 4 tasks a stream; nothing reads the last one's
    assert all(given == old for given, old in seen)            # the memory the actor read is the old one handed on
    assert {old for _, old in seen[:2]} == {""}                 # the first task reads none
    assert [old.split("- after ")[1] for _, old in seen[2:]] == [s[t].id + "\n" for t in range(2) for s in longer]
    out = attribution.attribute({"before RL": model}, {"before RL": evals["before RL"]}, tok, env, streams,
                                writers={"empty": lambda ep, old: ""}, **settings)
    assert out["cells"]["before RL actor, empty writer"]["gain"] == pytest.approx(0.0, abs=1e-9)
