"""rime.py end to end (smoke runs, torchrun, resume, ablation switches) and the warm start's
expert data (issue: warm start)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import envs
import rime
import rollout
from generate import Completion
from model import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, cwd=ROOT, timeout=300, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_smoke_run(tmp_path):
    run = str(tmp_path / "run")
    p = _run([sys.executable, "rime.py", "--model", "tiny", "--steps", "1", "--run-dir", run])
    assert "cumulative gain" in p.stdout and "before RL" in p.stdout
    rows = _metrics(run)
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1]
    for key in ("score", "explore", "writer_reward", "writer_format_ok", "mean_reversion_corr", "rollout_s"):
        assert key in rl[0]
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert set(summary) >= {"before", "after", "wall_s", "stream"}
    assert os.listdir(os.path.join(run, "memories")) == ["step0001.jsonl"]


def test_resume_after_kill(tmp_path):
    """Kill -9 a run after its first RL checkpoint; the same command resumes at the next step."""
    import signal
    import time
    run = str(tmp_path / "run")
    cmd = [sys.executable, "rime.py", "--model", "tiny", "--steps", "6", "--run-dir", run]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    try:
        # metrics for step 2 are written just before step 2's checkpoint: kill as soon as they appear,
        # so the run dies mid-way with at least step 1's checkpoint on disk
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(os.path.join(run, "metrics.jsonl")) and \
                    any(r["phase"] == "rl" and r["step"] >= 2 for r in _metrics(run)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    done = [r["step"] for r in _metrics(run) if r["phase"] == "rl"]
    p = _run(cmd)
    assert "resumed from" in p.stdout
    steps = [r["step"] for r in _metrics(run) if r["phase"] == "rl"]
    resumed_at = int(p.stdout.split("at RL step ")[1].split()[0])
    assert resumed_at >= 1 and resumed_at <= max(done)
    # every step after the checkpoint is run (again, if it was lost with the kill), up to the last one
    assert steps[len(done):] == list(range(resumed_at + 1, 7))
    # the evaluation before RL is not repeated on resume
    assert [r["step"] for r in _metrics(run) if r["phase"] == "eval" and not r.get("final")] == [0]


def test_torchrun_two_ranks(tmp_path):
    run = str(tmp_path / "run")
    p = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
              "rime.py", "--model", "tiny", "--steps", "1", "--run-dir", run], timeout=400)
    rl = [r for r in _metrics(run) if r["phase"] == "rl"]
    assert len(rl) == 1                     # rank 0 writes the metrics, once per step
    assert "cumulative gain" in p.stdout


def test_bad_config_is_a_clear_error(tmp_path):
    for bad, msg in ((["--k", "0"], "--k must be >= 1"), (["--env", "nope"], "--env must be"),
                     (["--model", str(tmp_path / "missing")], "not 'small', 'tiny'")):
        p = subprocess.run([sys.executable, "rime.py", *bad, "--run-dir", str(tmp_path / "r")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and msg in (p.stdout + p.stderr) and "Traceback" not in p.stderr
        assert not (tmp_path / "r").exists()     # rejected before any work


class CountingJudge:
    def __init__(self):
        self.calls = 0

    def score(self, before, after):
        self.calls += 1
        return 0.5


def _streams(args):
    model, tok = tiny("qwen3_5", seed=0)
    env = envs.make("alchemy", num_trials=1)
    base, copies = rime.train_streams(env, env.tasks("train"), args, step=0, rank=0)
    return model, tok, env, base, copies


def test_ablation_switches_change_what_they_say():
    args = rime.parse_args(["--model", "tiny", "--no-explore", "--writer", "frozen"])
    model, tok, env, base, copies = _streams(args)
    assert rime.make_judge(args, tok) is None            # --no-explore: no judge at all
    judge = CountingJudge()
    kw = dict(max_turns=2, max_new_tokens=4, memory_tokens=8, temperature=1.0)
    outs = rollout.run_streams(model, tok, env, copies, judge=None, **kw)
    assert all(e is None for o in outs for e in o.explore)
    # make every group's scores differ so that no group is dropped, then check the roles' rows
    for c, o in enumerate(outs):
        for t, ep in enumerate(o.episodes):
            ep.score = 0.1 * (c + 1) * (t + 1)   # differs across the group at every position and window
    groups_of = [c // args.group_size for c in range(len(copies))]
    actor, writer, parts = rime.rl_rows(outs, groups_of, args, rollout.WRITER_SYSTEM)
    assert actor and writer == [] and parts["explore"] == 0.0    # frozen writer: no writer rows trained
    args2 = rime.parse_args(["--model", "tiny"])
    outs = rollout.run_streams(model, tok, env, copies, judge=judge, **kw)
    assert judge.calls == len(copies) * len(copies[0])          # the judge scores every memory change
    for c, o in enumerate(outs):
        for t, ep in enumerate(o.episodes):
            ep.score = 0.1 * (c + 1) * (t + 1)   # differs across the group at every position and window
        for w in o.writes:   # well-formed, distinct memories pass the format gate
            w.memory = f"### Repository Knowledge\n- fact {c}\n- fact two\n\n### Lessons & Pitfalls\n- l {w.raw[:3]!r}\n- m"
    actor2, writer2, parts2 = rime.rl_rows(outs, groups_of, args2, rollout.WRITER_SYSTEM)
    # shared writer: trainable memories (all but each stream's last) give writer rows
    assert parts2["writer_rows"] > 0 and len(writer2) == parts2["writer_rows"]
    assert parts2["explore"] == pytest.approx(0.5)


def test_decoupled_writer_trains_its_own_weights(tmp_path):
    run = str(tmp_path / "run")
    rime.main(["--model", "tiny", "--steps", "1", "--writer", "decoupled", "--run-dir", run])
    rl = [r for r in _metrics(run) if r["phase"] == "rl"][0]
    assert "writer_version" in rl and rl["writer_version"] == 1 and rl["version"] == 1


# -----------------------------------------------------------------------------
# warm start


def test_expert_rows_are_the_rollout_protocol(monkeypatch):
    """Writer rows equal what rollout.write_memory builds when the model replies with the scripted
    memory; actor rows are run_scripted's (token-exact protocol rows, mask on the agent's tokens)."""
    _, tok = tiny("qwen3", seed=0)
    env = envs.make("alchemy", num_trials=1)
    tasks = env.tasks("train")
    rows = rime.expert_rows(tok, env, tasks, num_streams=1, segment=1, seed=0, traj_chars=600)
    fmt = rollout.ChatFormat(tok)
    stream = rime.curriculum.make_streams(tasks, 1, order="easy_to_hard", segment=1, seed=0)[0]
    first = env.reference_policy(stream[0])
    ep = rollout.run_scripted(tok, env, [stream[0]], [first])[0]
    assert rows[0] == (ep.tokens, ep.loss_mask)
    from alchemy import memory_text
    memory = memory_text(first.knowledge, ep.task.id, ep.score)

    def fake_generate(model, prompts, max_new_tokens, **kw):
        ids = fmt.encode(memory) + [fmt.end_id]
        return [Completion(tokens=ids, logprobs=[0.0] * len(ids), finish_reason="stop") for _ in prompts]
    monkeypatch.setattr(rollout, "generate", fake_generate)
    sample = rollout.write_memory(None, tok, [ep], [""], traj_chars=600)[0]
    assert rows[1] == (sample.tokens, sample.loss_mask)
    assert sample.memory == memory


def test_scripted_notes_beat_no_notes_on_a_stream():
    env = envs.make("alchemy", num_trials=1)
    tasks = [t for t in env.tasks("test") if t.group == env.tasks("test")[0].group]
    stream = rime.curriculum.make_stream(tasks, order="easy_to_hard", segment=6, seed=3)
    from alchemy import memory_text

    def play(task, notes):
        policy, obs, done = env.reference_policy(task, notes=notes or None), env.reset(task), False
        while not done:
            obs, _, done = env.step(policy(obs))
        return env.info["score"], memory_text(policy.knowledge, task.id, env.info["score"])
    with_notes, memory = [], ""
    for task in stream:
        score, memory = play(task, memory)
        with_notes.append(score)
    without = [play(task, "")[0] for task in stream]
    # the first task has no notes either way; later tasks profit from what was written down
    assert with_notes[0] == pytest.approx(without[0])
    assert sum(with_notes[1:]) > sum(without[1:]) + 0.5


def _first_turns(tokens, mask, turns):
    """The prefix of a protocol row up to the end of its `turns`-th agent reply (still token-exact)."""
    seen, end = 0, len(tokens)
    for i in range(1, len(mask)):
        if mask[i - 1] and not mask[i]:
            seen += 1
            if seen == turns:
                end = i
                break
    return tokens[:end], mask[:end]


def test_warm_start_teaches_the_format():
    """Imitation on expert rows raises held-out format validity from ~0 to > 90% in bounded steps."""
    import copy
    import random
    from ppo import Learner, make_batch
    torch.manual_seed(0)
    args = rime.parse_args(["--model", "tiny", "--max-new-tokens", "16"])
    model, tok = tiny("qwen3", seed=0, hidden_size=96, num_layers=2, intermediate_size=256)
    env = envs.make("alchemy", num_trials=1)
    rows = [r for r in rime.expert_rows(tok, env, env.tasks("train"), 16, 1, 0, 300) if r[0][:1]]
    rows = [_first_turns(t, m, 2) for t, m in rows[::2]]    # actor rows: the first two agent turns
    held_out = env.tasks("test")[:6]
    learner = Learner(model, ref_model=None, lr=1e-2, kl_coef=0.0, gradient_checkpointing=False)
    before = rime.format_validity(learner.gen_model, tok, env, held_out, args, turns=2)
    assert before < 0.2
    rng, after = random.Random(0), before
    for step in range(1, 121):
        batch = rng.sample(rows, 8)
        learner.update(make_batch([r[0] for r in batch], [[0] * len(r[1]) for r in batch],
                                  sft_mask=[r[1] for r in batch]))
        if step % 20 == 0:
            after = rime.format_validity(learner.gen_model, tok, env, held_out, args, turns=2)
            print(f"step {step}: validity {after:.2f}")
            if after > 0.9:
                break
    assert after > 0.9, f"validity {before:.2f} -> {after:.2f} after {step} steps"
