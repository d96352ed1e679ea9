"""rime.py end to end (smoke runs, torchrun, resume, ablation switches) and the warm start's
expert data (issue: warm start)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import curriculum
import envs
import rewards
import rime
import rollout
import warmstart
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


# the smoke command: warm start, one RL step, both evaluations and the report, in a fresh process
SMOKE = ["rime.py", "--model", "tiny", "--steps", "1", "--warmstart-steps", "2", "--warmstart-streams", "2",
         "--warmstart-batch", "2", "--warmstart-threshold", "1.0", "--eval-streams", "2", "--eval-segment", "1",
         "--attribute"]


def _smoke(run, hashseed):
    return _run([sys.executable, *SMOKE, "--run-dir", run], env_extra={"PYTHONHASHSEED": hashseed})


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run, shared: test_smoke_run reads its outputs, test_rerun_gives_the_same_figures
    runs the same command once more and compares the figures."""
    run = str(tmp_path_factory.mktemp("smoke") / "run")
    return run, _smoke(run, "1")


def test_smoke_run(smoke):
    """The smoke command end to end: metrics, summary.json with rl_effect and its attribution, the
    report, memories and the policies in HF format (warmstart/, policy/, final/)."""
    run, p = smoke
    assert "cumulative gain" in p.stdout and "before RL" in p.stdout
    rows = _metrics(run)
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1]
    for key in ("score", "explore", "writer_reward", "writer_format_ok", "mean_reversion_corr", "rollout_s"):
        assert key in rl[0]
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert set(summary) >= {"before", "after", "wall_s", "streams", "rl_effect"}
    effect = summary["rl_effect"]
    assert set(effect) == {"gain_before", "gain_after", "delta", "ci95", "streams"}
    assert effect["streams"] == len(summary["streams"]) and len(effect["ci95"]) == 2
    assert all(0.0 <= summary[k]["memory_influence"] <= 1.0 for k in ("before", "after"))
    assert "memory influence" in p.stdout
    # --attribute: the RL effect split into the writer's and the actor's parts (attribution.py)
    parts = summary["attribution"]["parts"]
    assert parts["total"]["delta"] == pytest.approx(effect["delta"]) and "writer part of the RL effect" in p.stdout
    assert [r for r in rows if r["phase"] == "attribution"]
    # the trained policy in HF format, beside the checkpoint and at the end
    from model import load
    for d in ("final", "policy"):
        assert load(os.path.join(run, d)) is not None
    assert os.listdir(os.path.join(run, "memories")) == ["step0001.jsonl"]
    assert summary["warmstart"]["steps"] == 2 and load(os.path.join(run, "warmstart")) is not None


def test_loading_a_policy_draws_no_random_init(smoke):
    """model.load builds the model on the meta device and assigns the checkpoint's tensors: no
    parameter init runs there (nn.Embedding's would import torch._dynamo, 1-2 s per process)."""
    code = ("import sys, model; m = model.load(sys.argv[1]); "
            "print(m.embed_tokens.weight.device, m.lm_head.weight is m.embed_tokens.weight, 'torch._dynamo' in sys.modules)")
    assert _run([sys.executable, "-c", code, os.path.join(smoke[0], "final")]).stdout.split() == ["cpu", "True", "False"]


def test_resume_after_kill(tmp_path):
    """Kill -9 a run after its first RL checkpoint; the same command resumes at the next step."""
    import signal
    import time
    run = str(tmp_path / "run")
    cmd = [sys.executable, "rime.py", "--model", "tiny", "--steps", "3", "--eval-streams", "1", "--eval-segment", "1",
           "--run-dir", run]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    try:
        # metrics for step 2 are written just before step 2's checkpoint: kill as soon as they appear,
        # so the run dies mid-way (step 3 still to come) with at least step 1's checkpoint on disk
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
    assert steps[len(done):] == list(range(resumed_at + 1, 4))
    # the evaluation before RL is not repeated on resume
    assert [r["step"] for r in _metrics(run) if r["phase"] == "eval" and not r.get("final")] == [0]


def test_torchrun_two_ranks(tmp_path):
    run = str(tmp_path / "run")
    p = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
              "rime.py", "--model", "tiny", "--steps", "1", "--eval-streams", "1", "--eval-segment", "1",
              "--run-dir", run], timeout=400)
    rl = [r for r in _metrics(run) if r["phase"] == "rl"]
    assert len(rl) == 1                     # rank 0 writes the metrics, once per step
    assert "cumulative gain" in p.stdout


def test_bad_config_is_a_clear_error(tmp_path):
    corrupt, empty = tmp_path / "corrupt", tmp_path / "empty"
    corrupt.mkdir(), empty.mkdir()
    (corrupt / "config.json").write_text("{not json")
    (corrupt / "model.safetensors").write_bytes(b"")
    for bad, msg in ((["--model", str(corrupt)], "config.json is not valid JSON"),
                     (["--model", str(empty)], "no config.json")):
        p = subprocess.run([sys.executable, "rime.py", *bad, "--run-dir", str(tmp_path / "r")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith("rime.py: error: ")
        assert not (tmp_path / "r").exists()     # rejected before any work, config.json included


def test_train_worlds_reach_the_env_and_keep_its_test_worlds():
    wide, base = (rime.make_env(rime.parse_args(a)) for a in (["--train-worlds", "40"], []))
    assert len({t.group for t in wide.tasks("train")}) == 40 and wide.config["num_trials"] == 1
    assert [t.id for t in wide.tasks("test")] == [t.id for t in base.tasks("test")]


@pytest.mark.parametrize("bad, msg", [
    (["--k", "0"], "--k must be >= 1"), (["--env", "nope"], "--env must be"),
    (["--model", "/no/such/dir"], "not 'small', 'scratch', 'tiny'"), (["--threads", "-1"], "--threads must be >= 0"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"), (["--lr", "0"], "--lr must be a number in (0"),
    (["--lr", "nan"], "--lr must be a number"), (["--temperature", "0"], "--temperature must be a number in (0"),
    (["--max-turns", "0"], "--max-turns must be >= 1"), (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--memory-tokens", "0"], "--memory-tokens must be >= 1"), (["--eval-streams", "0"], "--eval-streams must be >= 1"),
    (["--train-worlds", "0"], "--train-worlds must be >= 1"),
    (["--actor-context", "some"], "--actor-context must be all or latest"),
    (["--actor-context", "latest", "--env", "codebase"], "--actor-context latest needs --env alchemy"),
    (["--warmstart-mode", "copy"], "--warmstart-mode must be protocol or imitation"),
    (["--warmstart-writer", "keeping"], "--warmstart-writer must be transcribing, inferring, thinking or first-state"),
    (["--writer-think-tokens", "-2"], "--writer-think-tokens must be >= 0"),
    (["--eval-temperature", "-1"], "--eval-temperature must be a number in [0"),
    (["--writer-temperature", "0"], "--writer-temperature must be a number in (0"),
    (["--writer-temperature", "-2"], "--writer-temperature must be > 0, or -1"),
    (["--kl-estimator", "k2"], "--kl-estimator must be k1 or k3"),
    (["--writer-groups", "tree"], "--writer-groups must be copies or branch"), (["--branches", "0"], "--branches must be >= 1"),
    (["--warmstart-threshold", "-0.1"], "--warmstart-threshold must be a number in [0"),
    (["--init-from", "/no/such/dir"], "--init-from '/no/such/dir': no such directory"),
    (["--before-from", "/tmp"], "--before-from reuses the evaluation of an --init-from policy")])
def test_bad_values_are_one_line_errors(bad, msg, capsys):
    with pytest.raises(SystemExit) as e:
        rime.parse_args(bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("rime.py: error: ") and msg in err and err.count("\n") == 1


def test_the_kl_estimator_reaches_the_learner():
    """--kl-estimator: k1 (RIME's, the default) or k3, passed to ppo.Learner with --kl-coef."""
    d = type("D", (), {"device": torch.device("cpu")})()
    assert rime.learner_settings(rime.parse_args([]), d)["kl_estimator"] == "k1"
    s = rime.learner_settings(rime.parse_args(["--kl-estimator", "k3", "--kl-coef", "0.5"]), d)
    assert (s["kl_estimator"], s["kl_coef"]) == ("k3", 0.5)


def test_eval_streams_default_to_what_resolves_an_rl_effect():
    """--eval-streams auto: 64 on Alchemy (the 16 of earlier defaults are their first 16), 16 on Codebase,
    the smoke model's 2; an explicit value wins everywhere."""
    assert rime.parse_args([]).eval_streams == 64 and rime.parse_args(["--preset", "paper"]).eval_streams == 64
    assert rime.parse_args(["--env", "codebase", "--warmstart-steps", "0"]).eval_streams == 16
    assert rime.parse_args(["--model", "tiny"]).eval_streams == 2
    assert rime.parse_args(["--eval-streams", "16"]).eval_streams == 16
    env = rime.make_env(rime.parse_args([]))
    wide, narrow = (rime.eval_streams(env, rime.parse_args(a)) for a in ([], ["--eval-streams", "16"]))
    assert [[t.id for t in s] for s in wide[:16]] == [[t.id for t in s] for s in narrow]


def test_the_actor_context_reaches_the_env_and_its_clones():
    """--actor-context: all (the default, the paper's whole episode) or latest (the memory and the latest
    observation); the env and its clones carry it to rollout's agent loop."""
    assert rime.parse_args([]).actor_context == "all" == rime.parse_args(["--preset", "paper"]).actor_context
    env = rime.make_env(rime.parse_args(["--actor-context", "latest"]))
    assert env.actor_context == env.clone().actor_context == "latest"
    assert rime.make_env(rime.parse_args([])).clone().actor_context == "all"


def test_old_flag_spellings_still_parse():
    a = rime.parse_args(["--run_dir", "x", "--resume", "false", "--no_explore", "true"])
    assert a.run_dir == "x" and a.resume is False and a.no_explore is True
    assert rime.parse_args(["--no-resume"]).resume is False and rime.parse_args([]).resume is True


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("writer", ["frozen", "decoupled"])
def test_resume_restores_reference_and_writers(tmp_path, writer):
    """A run stopped after its step-1 checkpoint and resumed equals an uninterrupted run at step 2:
    the KL reference (the warm-started weights), the frozen writer (the weights RL started from),
    the decoupled writer's weights and both optimizers' states."""
    base = ["--model", "tiny", "--warmstart-steps", "2", "--warmstart-streams", "2", "--warmstart-batch", "2",
            "--warmstart-threshold", "1.0", "--eval-streams", "1", "--eval-segment", "1", "--max-turns", "3",
            "--writer", writer]
    whole = rime.main([*base, "--steps", "2", "--run-dir", str(tmp_path / "whole")])
    rime.main([*base, "--steps", "1", "--run-dir", str(tmp_path / "split")])     # "killed" after step 1's checkpoint
    resumed = rime.main([*base, "--steps", "2", "--run-dir", str(tmp_path / "split")])
    assert resumed.resuming and resumed.state["step"] == 2
    assert _same(_params(whole.learner.ref_model), _params(resumed.learner.ref_model))
    assert not _same(_params(whole.learner.ref_model), _params(resumed.learner.policy))   # RL moved the policy
    assert _same(_params(whole.learner.policy), _params(resumed.learner.policy))
    for opt_a, opt_b in [(whole.learner.optimizer, resumed.learner.optimizer)] + (
            [(whole.writer_learner.optimizer, resumed.writer_learner.optimizer)] if writer == "decoupled" else []):
        sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])
    if writer == "frozen":
        assert _same(_params(whole.writer_model), _params(resumed.writer_model))
        assert _same(_params(resumed.writer_model), _params(resumed.learner.ref_model))   # both: the start weights
    else:
        assert _same(_params(whole.writer_learner.policy), _params(resumed.writer_learner.policy))
        assert _same(_params(whole.writer_learner.ref_model), _params(resumed.writer_learner.ref_model))


def test_eval_every_evaluates_between_and_the_last_step_once(tmp_path):
    """--eval-every N evaluates the held-out streams every N RL steps; the last step's is the final
    evaluation only (an evaluation is greedy: a second one would repeat it)."""
    rime.main(["--model", "tiny", "--steps", "2", "--eval-every", "1", "--warmstart-steps", "2",
               "--warmstart-streams", "2", "--warmstart-batch", "2", "--eval-streams", "1", "--eval-segment", "1",
               "--max-turns", "3", "--run-dir", str(tmp_path)])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = [(r["step"], bool(r.get("final"))) for r in rows if r.get("phase") == "eval"]
    assert evals == [(0, False), (1, False), (2, True)]


def test_rerun_gives_the_same_figures(smoke, tmp_path):
    """The same command twice (different hash seeds, as two fresh processes get) writes the same
    metrics, bar the timings."""
    rerun = str(tmp_path / "run")
    _smoke(rerun, "2")
    rows = [[{k: v for k, v in r.items() if k != "time" and not k.endswith("_s") and "per_s" not in k}
             for r in _metrics(run)] for run in (smoke[0], rerun)]
    assert rows[0] == rows[1]


def test_small_models_tokenizer_is_deterministic():
    """The laptop model's BPE is trained on Alchemy text at start-up: it must come out the same in
    every process (hash seeds differ between processes)."""
    code = ("import hashlib, pretrain; from model import build_tokenizer; "
            "t = build_tokenizer(pretrain.VOCAB_SIZE, extra_text=pretrain.domain_text()); "
            "print(hashlib.md5(t.backend_tokenizer.to_str().encode()).hexdigest())")
    outs = {_run([sys.executable, "-c", code], env_extra={"PYTHONHASHSEED": s}).stdout.split()[-1] for s in ("3", "4")}
    assert len(outs) == 1


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
    small = rime.parse_args(["--model", "tiny", "--max-turns", "2", "--max-new-tokens", "4", "--memory-tokens", "8"])
    outs = rime.play_streams(model, model, tok, env, copies, small, temperature=1.0, seed=0)
    assert all(o.explore == [] for o in outs)                  # nothing is judged inside the stream loop
    for o in outs:                                               # rl_step with --no-explore: no judge
        o.explore = [None] * len(o.tasks)
    # make every group's scores differ so that no group is dropped, then check the roles' rows
    for c, o in enumerate(outs):
        for t, ep in enumerate(o.episodes):
            ep.score = 0.1 * (c + 1) * (t + 1)   # differs across the group at every position and window
    groups_of = [c // args.group_size for c in range(len(copies))]
    actor, writer, parts = rime.rl_rows(outs, groups_of, args, rollout.WRITER_SYSTEM)
    assert actor and writer == [] and parts["explore"] == 0.0    # frozen writer: no writer rows trained
    args2 = rime.parse_args(["--model", "tiny"])
    outs = rime.play_streams(model, model, tok, env, copies, small, temperature=1.0, seed=0)
    for o in outs:                                               # what rl_step does, next to the rewards
        o.explore = [judge.score(old, w.memory) for old, w in zip(o.memories, o.writes)]
    assert judge.calls == len(copies) * len(copies[0])          # the judge scores every memory change
    for c, o in enumerate(outs):
        for t, ep in enumerate(o.episodes):
            ep.score = 0.1 * (c + 1) * (t + 1)   # differs across the group at every position and window
        for w in o.writes:   # well-formed, distinct memories pass the format gate
            w.memory = f"### Repository Knowledge\n- fact {c}\n- fact two\n\n### Lessons & Pitfalls\n- l {w.raw[:3]!r}\n- m"
            w.status = "ok"      # a complete reply (the tiny model's own replies hit the memory cap)
    actor2, writer2, parts2 = rime.rl_rows(outs, groups_of, args2, rollout.WRITER_SYSTEM)
    # one group of two copies: too few points to fit the past baseline's slope (rewards.MIN_DOF), so 0
    assert parts2["past_slope"] == 0.0
    group = rime.parse_args(["--model", "tiny", "--writer-baseline", "group"])
    actor2, writer2, parts2 = rime.rl_rows(outs, groups_of, group, rollout.WRITER_SYSTEM)
    # GRPO's baseline alone: trainable memories (all but each stream's last) give writer rows
    assert parts2["writer_rows"] > 0 and len(writer2) == parts2["writer_rows"] and math.isnan(parts2["past_slope"])
    assert parts2["explore"] == pytest.approx(0.5)
    # the reward logged is the same under either baseline (the baseline changes advantages only)
    assert rime.rl_rows(outs, groups_of, args2, rollout.WRITER_SYSTEM)[2]["writer_reward"] == parts2["writer_reward"]


def test_writer_temperature_samples_the_writer_apart():
    """--writer-temperature: the writer's replies (and so its rows) are sampled at their own
    temperature, the actor's at --temperature; -1 (the default) means the same as --temperature."""
    assert rime.parse_args(["--temperature", "0.7"]).writer_temperature == 0.7
    args = rime.parse_args(["--model", "tiny", "--writer-temperature", "0.5", "--max-turns", "2",
                            "--max-new-tokens", "4", "--memory-tokens", "8"])
    assert args.temperature == 1.0 and args.writer_temperature == 0.5
    model, tok, env, base, copies = _streams(args)
    outs = rime.play_streams(model, model, tok, env, copies, args, temperature=args.temperature, seed=0,
                             writer_temperature=args.writer_temperature)
    assert {ep.temperature for o in outs for ep in o.episodes} == {1.0}
    assert {w.temperature for o in outs for w in o.writes} == {0.5}
    for c, o in enumerate(outs):     # as in the test above: scores and memories that keep every group
        o.explore = [0.0] * len(o.tasks)
        for t, ep in enumerate(o.episodes):
            ep.score = 0.1 * (c + 1) * (t + 1)
        for w in o.writes:
            w.memory = f"### Repository Knowledge\n- fact {c}\n- fact two\n\n### Lessons & Pitfalls\n- l {w.raw[:3]!r}\n- m"
            w.status = "ok"
    actor, writer, _ = rime.rl_rows(outs, [c // args.group_size for c in range(len(copies))], args,
                                    rollout.WRITER_SYSTEM)
    assert actor and writer and {r[4] for r in actor} == {1.0} and {r[4] for r in writer} == {0.5}


def test_decoupled_writer_trains_its_own_weights(tmp_path):
    run = str(tmp_path / "run")
    rime.main(["--model", "tiny", "--steps", "1", "--writer", "decoupled", "--eval-streams", "1", "--eval-segment", "1",
               "--run-dir", run])
    rl = [r for r in _metrics(run) if r["phase"] == "rl"][0]
    assert "writer_version" in rl and rl["writer_version"] == 1 and rl["version"] == 1


# -----------------------------------------------------------------------------
# warm start


def test_the_warm_start_samples_whole_episodes_when_the_actor_sees_only_the_latest_observation():
    """units: an episode's actor rows (one a turn under actor_context latest, one under all) and its writer
    row, each a unit, so a batch of --warmstart-batch units holds as many episodes either way."""
    _, tok = tiny("qwen3", seed=0)
    args = rime.parse_args(["--model", "tiny", "--warmstart-streams", "2", "--segment", "1"])
    for context in ("latest", "all"):
        env = envs.make("alchemy", num_trials=1, actor_context=context)
        units = []
        rows = warmstart.warmstart_rows(tok, env, env.tasks("train"), args, units=units)
        assert sorted(i for u in units for i in u) == list(range(len(rows)))
        actor, writer = units[0::2], units[1::2]
        assert len(actor) == len(writer) > 0
        assert all(len(u) == 1 for u in writer)
        prompts = [tok.decode(rows[u[0]][0]) for u in writer]
        assert all(rollout.WRITER_SYSTEM in p for p in prompts)
        if context == "all":
            assert all(len(u) == 1 for u in actor)
        else:   # one row a turn: each opens with the memory and the observation it answers
            assert any(len(u) > 1 for u in actor)
            assert all(tok.decode(rows[i][0]).count(rollout.MEMORY_HEADER) == 1 for u in actor for i in u)


def test_expert_rows_are_the_rollout_protocol(monkeypatch):
    """Writer rows equal what rollout.write_memory builds when the model replies with the scripted
    memory; actor rows are run_scripted's (token-exact protocol rows, mask on the agent's tokens)."""
    _, tok = tiny("qwen3", seed=0)
    env = envs.make("alchemy", num_trials=1)
    tasks = env.tasks("train")
    args = rime.parse_args(["--model", "tiny", "--warmstart-mode", "imitation", "--warmstart-streams", "1",
                            "--segment", "1", "--traj-chars", "600"])
    rows = warmstart.warmstart_rows(tok, env, tasks, args)
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
    import random
    from ppo import Learner, make_batch
    torch.manual_seed(0)
    args = rime.parse_args(["--model", "tiny", "--max-new-tokens", "16"])
    model, tok = tiny("qwen3", seed=0, hidden_size=96, num_layers=2, intermediate_size=256)
    env = envs.make("alchemy", num_trials=1)
    wargs = rime.parse_args(["--model", "tiny", "--warmstart-mode", "imitation", "--warmstart-streams", "16",
                             "--segment", "1", "--traj-chars", "300"])
    rows = [r for r in warmstart.warmstart_rows(tok, env, env.tasks("train"), wargs) if r[0][:1]]
    rows = [_first_turns(t, m, 2) for t, m in rows[::2]]    # actor rows: the first two agent turns
    held_out = env.tasks("test")[:6]
    learner = Learner(model, ref_model=None, lr=1e-2, kl_coef=0.0, gradient_checkpointing=False)
    before = warmstart.format_validity(learner.gen_model, tok, env, held_out, args, turns=2)
    assert before < 0.2
    rng, after = random.Random(0), before
    for step in range(1, 121):
        batch = rng.sample(rows, 8)
        learner.update(make_batch([r[0] for r in batch], [[0] * len(r[1]) for r in batch],
                                  sft_mask=[r[1] for r in batch]))
        if step % 10 == 0:
            after = warmstart.format_validity(learner.gen_model, tok, env, held_out, args, turns=2)
            print(f"step {step}: validity {after:.2f}")
            if after > 0.9:
                break
    assert after > 0.9, f"validity {before:.2f} -> {after:.2f} after {step} steps"


def test_reference_match_splits_notes_from_scratch_and_can_fail(monkeypatch):
    """reference_match asks the actor for its greedy action in every state the scripted reference met,
    counted once, under "scratch" in a stream's first task and "with_notes" after it (where the reference
    reads its own notes): an actor that replies as the reference scores 1, one that never does 0."""
    _, tok = tiny("qwen3", seed=0)
    env = envs.make("alchemy", num_trials=1)
    args = rime.parse_args(["--model", "tiny", "--eval-streams", "2", "--eval-segment", "1"])
    streams = rime.eval_streams(env, args)
    played = [ep for _, ep, _ in warmstart.scripted_play(tok, env, streams, rime.dataclasses.replace(
        args, warmstart_mode="imitation"))]
    replies = {}                            # context -> the reference's reply in it
    for ep in played:
        for row in ep.rows():
            for span in warmstart._spans(row.loss_mask):
                replies[tuple(row.tokens[:span[0]])] = [row.tokens[i] for i in span]
    wrong = tok.encode("<action>apply p99 s99</action>")

    def replying(as_reference):
        def fake(model, prompts, max_new_tokens, **kw):
            return [Completion(tokens=replies[tuple(p)] if as_reference else wrong, logprobs=[], finish_reason="stop")
                    for p in prompts]
        return fake
    monkeypatch.setattr(rollout, "generate", replying(True))
    oracle = warmstart.reference_match(torch.nn.Linear(1, 1), tok, env, streams, args)
    monkeypatch.setattr(rollout, "generate", replying(False))
    blind = warmstart.reference_match(torch.nn.Linear(1, 1), tok, env, streams, args)
    first = sum(ep.num_turns for ep in played[:len(streams)])      # t = 0 comes first, one per stream
    assert oracle["scratch"]["actions"] == first and oracle["with_notes"]["actions"] == sum(
        ep.num_turns for ep in played) - first > 0
    assert sum(oracle.get(f"with_notes/{k}", {"actions": 0})["actions"] for k in ("apply", "cauldron", "end")) == \
        oracle["with_notes"]["actions"]
    assert all(v["match"] == 1.0 for v in oracle.values())
    assert all(v["match"] == 0.0 for v in blind.values()) and blind.keys() == oracle.keys()
    for k in ("scratch/apply", "with_notes/apply"):     # an apply's parts: a right guess gets them all
        assert all(0 < oracle[k][c] < 1 for c in ("chance", "colour_chance", "stone_chance"))
        assert oracle[k]["colour"] == oracle[k]["stone"] == 1.0 and blind[k]["colour"] == blind[k]["stone"] == 0.0


def test_an_apply_of_another_potion_of_the_same_colour_has_the_right_colour():
    state = {"potions": {1: 0, 2: 0, 3: 1}, "stones": {1: (0, -3), 2: (1, -1)}}      # p1, p2 red; p3 green
    same = warmstart._apply_hits("apply p1 s1", "apply p2 s1", state)
    assert same == {"chance": 1 / 6, "colour": True, "colour_chance": 2 / 3, "stone": True, "stone_chance": 0.5}
    other = warmstart._apply_hits("apply p1 s1", "apply p3 s2", state)
    assert not other["colour"] and not other["stone"]
    assert not any(warmstart._apply_hits("apply p1 s1", guess, state)[k] for guess in ("", "end", "cauldron s1")
                   for k in ("colour", "stone"))


@pytest.mark.parametrize("threshold, steps", [(0.95, 50), (2.0, 60)])
def test_warm_start_stops_at_the_threshold_and_above_one_never(monkeypatch, threshold, steps):
    """The actor's protocol agreement 0 then 1 at every check, the writer's format rate 0, 0.5, then 1 (and
    validity 0.5 throughout: in protocol mode it is logged, not a gate): a threshold <= 1 ends the warm
    start at the first check where both reach it (step 50, not 25 where only the actor does); one above 1
    never does, so every --warmstart-steps runs."""
    import types
    checks = iter([(0.0, 0.0, 0.0), (1.0, 0.5, 0.5)] + [(1.0, 0.5, 1.0)] * 10)   # (agreement, score, writer)
    monkeypatch.setattr(warmstart, "held_out_check", lambda *a, **k: dict(zip(("agreement", "score", "writer_ok"),
                                                                            next(checks)), validity=0.5))
    monkeypatch.setattr(warmstart, "warmstart_rows", lambda *a, **k: [([1, 2, 3], [0, 1, 1])] * 4)
    updates = []
    learner = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[{"lr": 0.0}]), gen_model=None,
                                    update=lambda b: updates.append(b) or {})
    args = rime.parse_args(["--model", "tiny", "--warmstart-steps", "60", "--warmstart-threshold", str(threshold)])
    out = warmstart.warm_start(learner, None, envs.make("alchemy", num_trials=1), args, lambda r: None)
    assert out["steps"] == steps == len(updates) and out["agreement_after"] == 1.0 and out["writer_ok_after"] == 1.0


def test_note_decision_rows_are_the_turns_where_the_notes_decide():
    """Protocol mode: every decision row is a prefix of one of its episode's rows whose loss covers exactly
    one reply, and that reply is the note reader's chain for that turn's memory and observation."""
    import pretrain
    from alchemy import note_reader_reply
    _, tok = pretrain.load_reader()
    env = envs.make("alchemy", num_trials=1)
    args = rime.parse_args(["--warmstart-streams", "6", "--run-dir", "unused"])
    decisions, eps = [], []
    rows = warmstart.warmstart_rows(tok, env, env.tasks("train"), args, decisions=decisions)
    streams = rime.curriculum.make_streams(env.tasks("train"), 6, order="easy_to_hard", segment=args.segment, seed=0)
    for _, ep, _ in warmstart.scripted_play(tok, env, streams, args):
        eps.append(ep)
    wanted = [(ep, turn) for ep in eps for turn, obs in enumerate(ep.observations[:ep.num_turns])
              if "<action>apply" in (note_reader_reply(ep.memory, obs) or "")]
    assert len(decisions) == len(wanted) > 0 and len(rows) > len(decisions)
    for (tokens, mask), (ep, turn) in zip(decisions, wanted):
        assert any(r.tokens[:len(tokens)] == tokens for r in ep.rows()) and len(mask) == len(tokens)
        first = mask.index(1)
        assert all(mask[first:]) and not any(mask[:first])
        reply = tok.decode(tokens[first:], skip_special_tokens=True)
        assert note_reader_reply(ep.memory, ep.observations[turn]) in reply and " need " in reply
    assert warmstart.note_decision_rows(eps[0]) == []          # a stream's first task has no notes


def test_note_agreement_counts_the_protocol_moves_its_notes_decide(monkeypatch):
    """note_agreement asks the actor exactly in the protocol's note-decided states of later tasks: with an
    actor that repeats every move it asks about it is 1, with one that never answers 0, and its explore
    baseline is the share of those states where the protocol without notes moves the same."""
    import pretrain
    from alchemy import note_reader_reply, protocol_reply
    _, tok = pretrain.load_reader()
    env = envs.make("alchemy", num_trials=1)
    args = rime.parse_args(["--eval-streams", "4", "--run-dir", "unused"])
    streams = rime.eval_streams(env, args)
    states = [(ep.actions[turn], rollout.parse_action(protocol_reply("", obs)))
              for t, ep, _ in warmstart.scripted_play(tok, env, streams, args) if t
              for turn, obs in enumerate(ep.observations[:ep.num_turns])
              if "<action>apply" in (note_reader_reply(ep.memory, obs) or "")]
    asked = []
    monkeypatch.setattr(warmstart, "greedy_replies", lambda m, t, contexts, n: asked.append(contexts) or [""] * len(contexts))
    none = warmstart.note_agreement(None, tok, env, streams, args)
    assert none["states"] == len(states) == len(asked[0]) > 0 and none["match"] == 0.0
    assert none["explore"] == pytest.approx(sum(w == e for w, e in states) / len(states)) and none["explore"] < 1
    monkeypatch.setattr(warmstart, "greedy_replies", lambda m, t, contexts, n: [w for w, _ in states])
    assert warmstart.note_agreement(None, tok, env, streams, args)["match"] == 1.0


def test_warm_start_lr_decays_linearly_to_zero_and_rl_gets_its_own_lr(monkeypatch):
    """Each warm-start update runs at warmstart_lr * (1 - (step - 1) / steps): 3e-3 first, 1e-5 last of 300;
    after it the optimizer is at --lr for RL."""
    import types
    monkeypatch.setattr(warmstart, "held_out_check", lambda *a, **k: dict(validity=0.0, score=0.0, writer_ok=0.0, agreement=0.0))
    monkeypatch.setattr(warmstart, "warmstart_rows", lambda *a, **k: [([1, 2, 3], [0, 1, 1])] * 4)
    groups = [{"lr": 0.0}, {"lr": 0.0}]
    lrs = []
    learner = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=groups), gen_model=None,
                                    update=lambda b: lrs.append([g["lr"] for g in groups]) or {})
    args = rime.parse_args(["--model", "tiny", "--warmstart-steps", "300", "--lr", "2e-4"])
    warmstart.warm_start(learner, None, envs.make("alchemy", num_trials=1), args, lambda r: None)
    assert len(lrs) == 300 and all(a == b for a, b in lrs)
    assert lrs[0][0] == pytest.approx(3e-3) and lrs[-1][0] == pytest.approx(1e-5) and lrs[150][0] == pytest.approx(1.5e-3)
    assert all(x[0] > y[0] for x, y in zip(lrs, lrs[1:])) and [g["lr"] for g in groups] == [2e-4, 2e-4]


def test_protocol_warm_start_carries_no_task_knowledge():
    """The protocol rows teach the action syntax and the memory's shape: every memory target passes the
    writer's format gate and states nothing but what its own prompt's episode showed, in the
    observations' words ("- large pink" where an outcome read ": large pink.", "- best ..." where one read
    "best ..."): no effect is inferred, nothing is carried from the previous memory. The actor's actions
    are all valid, and its moves are the protocol's (alchemy.protocol_reply)."""
    import alchemy
    from rewards import writer_format_ok
    _, tok = tiny("qwen3", seed=0)
    env = envs.make("alchemy", num_trials=1)
    args = rime.parse_args(["--model", "tiny", "--warmstart-streams", "3", "--segment", "1"])
    assert args.warmstart_mode == "protocol"
    streams = curriculum.make_streams(env.tasks("train"), 3, order="easy_to_hard", segment=1, seed=args.seed)
    fillers = set(warmstart.PROTOCOL_FILLER)
    prev, noted = "", 0
    for t, ep, (tokens, mask) in warmstart.scripted_play(tok, env, streams, args):
        prompt = tok.decode([x for x, m in zip(tokens, mask) if not m])
        episode = prompt.split("## Previous memory")[0]            # the finished task, not the old memory
        m = tok.decode([x for x, m in zip(tokens, mask) if m]).replace(tok.decode([rollout.ChatFormat(tok).end_id]), "").strip()
        assert writer_format_ok(m, prev), m
        for line in (ln for ln in m.split("### Lessons & Pitfalls")[0].splitlines()[1:] if ln.strip()):
            if line in fillers:
                continue
            said = f"{line[2:]}." if line.startswith("- best ") else f": {line[2:]}."
            assert said in episode, line                       # a transcription of this episode, never inferred
            noted += 1
        assert all(alchemy.parse_action(a) for a in ep.actions) and not ep.info.get("invalid")
        prev = m
    assert noted


def test_swebench_rows_reach_rime_with_a_clear_error(tmp_path):
    """--env codebase --swebench FILE evaluates SWE-bench JSONL rows; a row without the fields (or a
    repository that is not available offline) stops the run with one line, before anything is written."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"instance_id": "x__y-1", "repo": "x/y"}) + "\n")
    (tmp_path / "repos").mkdir()
    p = subprocess.run([sys.executable, "rime.py", "--model", "tiny", "--env", "codebase", "--swebench", str(rows),
                        "--swebench-repos", str(tmp_path / "repos"), "--run-dir", str(tmp_path / "r")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("rime.py: error: ") and "row lacks" in p.stderr
    assert not (tmp_path / "r").exists()


def test_report_interval_is_na_without_one():
    """One held-out stream has no CI: nan in memory, null once read back from summary.json
    (--before-from); the report prints n/a instead of crashing."""
    assert rime._ci([-0.1, 0.25]) == "[-0.10, +0.25]"
    assert rime._ci([float("nan"), float("nan")]) == "n/a"
    assert rime._ci([None, None]) == "n/a" and rime._ci(None) == "n/a"


def test_protocol_actor_is_deterministic_valid_and_acts_on_its_notes():
    """The protocol actor: with no notes it explores in a fixed order (the first potion on the table, named
    by its colour, on the first stone), so its replies are a function of the observation and never
    an action the environment refuses; an apply uses a potion up, so the greedy copy of it cannot loop.
    With notes that decide, it follows them (true or not)."""
    import re
    from warmstart import protocol_policy
    env = envs.make("alchemy", num_trials=1)
    applies = 0
    for task in env.tasks("train")[:6]:
        act = protocol_policy("")
        obs, done = env.reset(task), False
        while not done:
            reply = act(obs)
            assert reply == protocol_policy("")(obs)                 # deterministic
            action = rollout.parse_action(reply)
            applies += action.startswith("apply ")
            assert not re.match(r"apply p\d", action), action
            obs, _, done = env.step(action)
            assert not env.info.get("invalid"), (action, obs)
    assert applies
    obs = ("Trial 1 of 1, 20 steps left.\nStones: s1 small blue round (value -3); s2 small purple pointy (value +1)\n"
           "Potions: p1 red, p2 pink\nActions: apply P S | cauldron S | end")
    assert protocol_policy("")(obs) == "<action>apply red s1</action>"
    notes = "### Repository Knowledge\n- large pink\n- best large purple pointy"
    assert protocol_policy(notes)(obs) == \
        "s1 small blue round best large purple pointy need large pink <action>apply pink s1</action>"


def test_warm_start_rehearses_the_readers_rungs(monkeypatch):
    """--warmstart-reading 0.5: half of every warm-start batch is the rows of pretrain.py's last stage (random
    words, the rungs the tasks use, the inference among them), so imitating the protocol cannot silently overwrite the reading; the
    rows carry a loss on their answers only. small's default is 0.4 (4 rows of 10), every other model's 0."""
    import random
    import types
    import pretrain
    assert rime.parse_args(["--model", "small"]).warmstart_reading == 0.4
    assert rime.parse_args(["--model", "tiny"]).warmstart_reading == 0.0
    _, tok = pretrain.load_reader()
    rows = warmstart.reading_rows(warmstart.reading_data(tok, 0), 12, random.Random(0))
    assert len(rows) == 12 and all(0 < sum(m) < len(t) and len(m) == len(t) for t, m in rows)
    answers = [tok.decode([x for x, m in zip(t, mk) if m]) for t, mk in rows]
    assert any("<action>apply " in a for a in answers) and any("<action>" not in a for a in answers)
    import alchemy                       # the inference stage's rung is rehearsed too: " large purple pointy"
    assert any(len(a.split()) == 3 and all(w in sum(alchemy.FEATURES, ()) for w in a.split()) for a in answers)
    monkeypatch.setattr(warmstart, "held_out_check", lambda *a, **k: dict(validity=0.0, score=0.0, writer_ok=0.0, agreement=0.0))
    monkeypatch.setattr(warmstart, "warmstart_rows", lambda *a, **k: [([1, 2, 3], [0, 1, 1])] * 20)
    sizes = []
    learner = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[{"lr": 0.0}]), gen_model=None,
                                    update=lambda b: sizes.append(int((b.lengths > 3).sum())) or {})
    args = rime.parse_args(["--model", "tiny", "--warmstart-steps", "3", "--warmstart-reading", "0.5", "--warmstart-batch", "8"])
    warmstart.warm_start(learner, tok, envs.make("alchemy", num_trials=1), args, lambda r: None)
    assert sizes == [4, 4, 4]           # 4 of each batch of 8 are reading rows (the protocol rows are 3 tokens)
    with pytest.raises(SystemExit):
        rime.parse_args(["--model", "small", "--warmstart-reading", "1.5"])


def test_warm_start_draws_its_share_of_writer_rows(monkeypatch):
    """--warmstart-writer-rows 0.5 of a batch of 8: 4 rows of every batch come from the writer's rows alone (here
    5 tokens long), beside the units (an episode's actor rows, or a writer row); the default 0 draws none there,
    and the shares must leave room for the episodes."""
    import types
    monkeypatch.setattr(warmstart, "held_out_check", lambda *a, **k: dict(validity=0.0, score=0.0, writer_ok=0.0, agreement=0.0))

    def rows(*a, units=None, writers=None, **k):       # 10 episodes: an actor row of 3 tokens, a writer row of 5
        out = []
        for _ in range(10):
            units += [[len(out)], [len(out) + 1]]
            writers.append(len(out) + 1)
            out += [([1, 2, 3], [0, 1, 1]), ([1, 2, 3, 4, 5], [0, 0, 1, 1, 1])]
        return out
    monkeypatch.setattr(warmstart, "warmstart_rows", rows)
    for share, alone in ((0.5, 4), (0.0, 0)):
        batches = []
        learner = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[{"lr": 0.0}]), gen_model=None,
                                        update=lambda b: batches.append(b.lengths.tolist()) or {})
        args = rime.parse_args(["--model", "tiny", "--warmstart-steps", "20", "--warmstart-batch", "8",
                                "--warmstart-writer-rows", str(share)])
        warmstart.warm_start(learner, None, envs.make("alchemy", num_trials=1), args, lambda r: None)
        assert len(batches) == 20 and all(len(b) == 8 for b in batches)
        writer_rows = [sum(n == 5 for n in b) for b in batches]
        assert min(writer_rows) >= alone                  # the units add more, about half of the rest
        assert sum(writer_rows) / 20 == pytest.approx(alone + (8 - alone) / 2, abs=1.0)
    for shares in (("0.5", "0.4", "0.2"), ("0.26", "0.36", "0.36")):     # the second sums to 0.98, rounds to 11 of 10
        with pytest.raises(SystemExit):
            rime.parse_args(["--model", "small", "--warmstart-writer-rows", shares[0], "--warmstart-reading", shares[1],
                             "--warmstart-decisions", shares[2]])


def test_scripted_writers_transcribe_keep_and_infer():
    """warmstart.scripted_writers, played in the loop by rime.py --attribute: transcribing writes what this
    episode showed and nothing older; keeping adds it to the old memory's facts, dropping the oldest until
    the memory fits; the inferring writer adds the best stone the stone values imply (here s2 at -3)."""
    env = envs.make("alchemy")
    task = env.tasks("test")[0]
    first = ("Symbolic Alchemy ...\nTrial 1 of 1, 20 steps left.\nStones: s1 large purple pointy (value +1); "
             "s2 large blue round (value -3)\nPotions: p1 red, p2 yellow\nActions: apply P S | cauldron S | end")
    ep = rollout.Episode(task=task, tokens=[], loss_mask=[], logprobs=[], actions=["apply p2 s2"],
                         observations=[first, "p2 yellow on s2: pointy yellow. s2 is now large blue pointy (value -1)."])
    old = warmstart.protocol_text(["- small red", "- round green"])
    writers = warmstart.scripted_writers(1200, fits=lambda text: text.count("\n- ") <= 5)
    facts = lambda mem: [l for l in mem.split("### Lessons")[0].splitlines() if l.startswith("- ")]
    assert facts(writers["transcribing"](ep, old)) == ["- pointy yellow", warmstart.PROTOCOL_FILLER[0]]
    assert facts(writers["transcribing, keeping"](ep, old)) == ["- small red", "- round green", "- pointy yellow"]
    tight = warmstart.scripted_writers(1200, fits=lambda text: text.count("\n- ") <= 4)
    assert facts(tight["transcribing, keeping"](ep, old)) == ["- round green", "- pointy yellow"]   # the oldest went
    assert facts(writers["transcribing + best inferred"](ep, old)) == ["- pointy yellow", "- best small purple pointy"]
    for write in writers.values():
        assert rewards.writer_format_ok(write(ep, old), old)[0]
    # the warm start's target with --warmstart-writer inferring: the same transcription, the best stone
    # inferred from the writer's own view of the episode (its cut trajectory text), a seen one replaced
    assert facts(warmstart.protocol_memory(ep, 1200, infer=True)) == ["- pointy yellow", "- best small purple pointy"]
    assert warmstart.protocol_memory(ep, 1200) == writers["transcribing"](ep, old)
    # --warmstart-writer thinking: a think block that copies the first state from the writer's prompt, then
    # the infer rung's note on it; the memory after it is the inferring one (no stone was seen at +15)
    reply, memory = warmstart.writer_reply(ep, 1200, "thinking")
    thought, answer = reply.split("</think>")
    assert thought == "<think>\n" + first[first.index("Trial"):] + "\n- best small purple pointy\n"
    assert first[first.index("Trial"):] in rollout.writer_prompt(ep, old, 1200)
    assert answer.strip() == memory == warmstart.protocol_memory(ep, 1200, infer=True)
    assert rollout.ChatFormat(tiny("qwen3", seed=0)[1]).answer(reply).strip() == memory
    assert warmstart.writer_reply(ep, 1200, "inferring") == (memory, memory)
    assert warmstart.writer_reply(ep, 1200, "first-state") == (memory, memory)
    # --writer-task-last: that first state again, the last thing before the writer writes
    assert rollout.writer_prompt(ep, old, 1200, task_last=True).endswith(
        f"## The task as it began\n{first}\n\nWrite the new memory now.")
    assert rollout.writer_prompt(ep, old, 1200).endswith(f"{old}\n\nWrite the new memory now.")
    ep.observations[0] = first.replace("; s2 large blue round (value -3)", "")   # one +1 stone leaves a feature open
    assert "- best unknown\n</think>" in warmstart.writer_reply(ep, 1200, "thinking")[0]


def test_greedy_replies_in_chunks_are_the_replies_of_one_call(monkeypatch):
    """warmstart.greedy_replies bounds its memory by answering `chunk` contexts per generate call: every
    context once, in order, no call larger than the chunk; the model's training mode comes back."""
    calls = []

    def fake(model, tokenizer, contexts, max_new_tokens):
        calls.append(len(contexts))
        assert not model.training
        return [f"apply p1 s{len(c)}" for c in contexts]
    monkeypatch.setattr(rollout, "greedy_actions", fake)
    model = torch.nn.Linear(1, 1).train()
    contexts = [[0] * n for n in range(1, 8)]
    assert warmstart.greedy_replies(model, None, contexts, 8, chunk=3) == [f"apply p1 s{n}" for n in range(1, 8)]
    assert calls == [3, 3, 1] and model.training


def test_before_from_a_run_older_than_the_actor_context_setting(tmp_path, capsys):
    """--before-from reads the other run's config.json: one written before --actor-context existed played the
    whole episode, so it pairs with --actor-context all and is a one-line error with latest."""
    import types
    from model import save
    src = tmp_path / "src"
    save(*tiny("qwen3", seed=0), src / "warmstart")
    base = rime.parse_args(["--init-from", str(src / "warmstart"), "--steps", "0"])
    config = {n: getattr(base, n) for n in rime.EVAL_SETTINGS if n != "actor_context"}
    (src / "config.json").write_text(json.dumps({**config, "steps": 0}))
    (src / "summary.json").write_text(json.dumps({"streams": [["t1"]], "before": {"cumulative_gain": 0.1}}))
    args = rime.parse_args(["--init-from", str(src / "warmstart"), "--before-from", str(src), "--steps", "0"])
    logged = []
    run = types.SimpleNamespace(args=args, streams=[[types.SimpleNamespace(id="t1")]], log=logged.append)
    assert rime.reused_before(run) == {"cumulative_gain": 0.1} and logged[0]["reused_from"] == str(src)
    run.args = rime.parse_args(["--init-from", str(src / "warmstart"), "--before-from", str(src), "--steps", "0",
                                "--actor-context", "latest"])
    with pytest.raises(SystemExit):
        rime.reused_before(run)
    assert "differs in actor_context" in capsys.readouterr().err


def test_branched_writer_groups_compare_memories_from_one_state(monkeypatch):
    """--writer-groups branch: each group's G memories are sampled from one copy's one state (the same
    episode, the same old memory), scored by RIME's reward with the next K tasks played greedily from
    each memory and the copy's own past K, so the advantage follows what the memory does next."""
    from types import SimpleNamespace as NS
    args = rime.parse_args(["--writer-groups", "branch", "--branches", "3", "--group-size", "2", "--k", "2"])
    good, bad = ("### Repository Knowledge\n- large pink\n- best large\n\n### Lessons & Pitfalls\n- a\n- b\n- " + w
                 for w in ("good", "bad"))
    T, tasks = 4, [f"t{i}" for i in range(4)]
    outs = [rime.StreamRollout(tasks=tasks, episodes=[NS(score=0.5 * c) for _ in tasks],
                               memories=[f"old {c} {t}" for t in range(T)]) for c in range(4)]
    asked = []

    def fake_write(model, tok, eps, olds, temperature, seed, **kw):
        asked.append((eps, olds, temperature))
        return [rollout.WriterSample(tokens=[i], loss_mask=[1], logprobs=[0.0], memory=(good, bad)[i % 2],
                                     raw="", status="ok") for i in range(len(eps))]

    played = []

    def fake_play(actor, writer, tok, env, streams, a, *, temperature, seed, memories, **kw):
        played.append((streams, memories, temperature))
        return [rime.StreamRollout(tasks=s, episodes=[NS(score=float("good" in m)) for _ in s])
                for s, m in zip(streams, memories)]

    monkeypatch.setattr(rollout, "write_memory", fake_write)
    monkeypatch.setattr(rime, "play_streams", fake_play)
    rows, parts = rime.branch_rows(None, None, None, None, outs, [0, 0, 1, 1], args, seed=5)
    (eps, olds, temperature), = asked
    assert parts["branch_points"] == 6 and len(eps) == 12 and temperature == args.writer_temperature
    for j in range(6):       # a group shares its episode and old memory, from a copy of its own stream
        assert eps[2 * j] is eps[2 * j + 1] and olds[2 * j] == olds[2 * j + 1]
        c = next(c for c, o in enumerate(outs) if eps[2 * j] in o.episodes)
        assert c // 2 == j // 3
    assert all(t == 0.0 for _, _, t in played)          # the next K tasks are played greedily
    for streams, memories, _ in played:
        for s, m in zip(streams, memories):
            assert 1 <= len(s) <= 2 and m in (good, bad) and s == tasks[tasks.index(s[0]):][:len(s)]
    assert len(rows) == 12 and parts["writer_rows"] == 12 and parts["branch_spread"] == 1.0
    assert all((r[3] > 0) == (r[0][0] % 2 == 0) for r in rows)   # the good memory's rows gain
    # a group whose memories do alike teaches nothing: every memory good -> no rows
    monkeypatch.setattr(rollout, "write_memory", lambda m, t, eps, olds, **kw: [
        rollout.WriterSample(tokens=[i], loss_mask=[1], logprobs=[0.0], memory=good, raw="", status="ok")
        for i in range(len(eps))])
    rows, parts = rime.branch_rows(None, None, None, None, outs, [0, 0, 1, 1], args, seed=5)
    assert rows == [] and parts["writer_groups_dropped"] == 6


def test_the_protocol_actor_plays_the_scripted_note_reader_and_trains_no_actor_rows():
    """--actor protocol: the actor is warmstart.protocol_policy on each stream's memory (where a note decides the
    move it makes it, true or not), the writer is the model, and only the writer's rows are trained."""
    args = rime.parse_args(["--model", "tiny", "--actor", "protocol", "--max-turns", "4", "--max-new-tokens", "4",
                            "--memory-tokens", "8"])
    model, tok, env, base, copies = _streams(args)
    task = copies[0][0]
    # it plays exactly as the scripted protocol on that memory, whatever the model is
    for memory in ("", warmstart.protocol_text(["- large pink", "- best large purple pointy"])):
        eps = rime.run_actor(rime.PROTOCOL, tok, env.clone(), [task], memory, args, temperature=1.0, seed=0)
        ref = rollout.run_scripted(tok, env.clone(), [task], [warmstart.protocol_policy(memory)], memory=[memory],
                                   max_turns=args.max_turns)
        assert eps[0].actions == ref[0].actions and eps[0].score == ref[0].score and eps[0].actions
    # in the stream loop its episodes carry no sampled tokens: rl_rows trains the writer's rows only
    outs = rime.play_streams(rime.PROTOCOL, model, tok, env, copies, args, temperature=1.0, seed=0)
    for c, o in enumerate(outs):
        o.explore = [None] * len(o.tasks)
        for t, ep in enumerate(o.episodes):
            ep.score = 0.1 * (c + 1) * (t + 1)
        for w in o.writes:
            w.memory = f"### Repository Knowledge\n- fact {c}\n- fact two\n\n### Lessons & Pitfalls\n- l {w.raw[:3]!r}\n- m"
            w.status = "ok"
    groups_of = [c // args.group_size for c in range(len(copies))]
    actor, writer, parts = rime.rl_rows(outs, groups_of, args, rollout.WRITER_SYSTEM)
    assert actor == [] and writer and parts["actor_rows"] == 0


def test_writer_next_world_scores_a_memory_by_its_worth_at_the_next_difficulties():
    """--writer-next world (rime.world_next): each next position's score is the mean, over every training task
    of the stream's world at that position's difficulty, of the memory's greedy episode there; a memory whose
    notes are the world's true chemistry is worth more to the note reader than none."""
    import alchemy, pretrain
    args = rime.parse_args(["--model", "tiny", "--actor", "protocol", "--writer-groups", "branch", "--writer-next", "world"])
    env = rime.make_env(args)
    train = env.tasks("train")
    world = [t for t in train if t.group == train[0].group]
    nxt = [[world[7], world[30]]] * 2                 # two next tasks, at difficulties 1 and 5
    d = world[0].data
    chem = alchemy.chemistry_of(d)
    true = [f"- {alchemy.FEATURES[a][b ^ (d['flips'] >> a & 1)]} {colour}"
            for colour, (a, b) in ((c, chem.potion_effect(i)) for i, c in enumerate(alchemy.COLOURS))]
    notes = warmstart.protocol_text(true + ["- best " + alchemy.stone_text(7 ^ d["flips"])])
    _, tok = pretrain.load_reader()
    got = rime.world_next(rime.PROTOCOL, tok, env, nxt, ["", notes], args)
    for scores, memory in zip(got, ["", notes]):
        for task, score in zip(nxt[0], scores):
            pool = [t for t in world if t.difficulty == task.difficulty]
            eps = rime.run_actor(rime.PROTOCOL, tok, env, pool, memory, args, temperature=0.0, seed=0)
            assert len(pool) > 1 and score == pytest.approx(sum(e.score for e in eps) / len(pool))
    assert sum(got[1]) > sum(got[0])


@pytest.mark.parametrize("flags, says", [
    (["--actor", "protocol", "--env", "codebase"], "--actor protocol is Alchemy's"),
    (["--actor", "protocol", "--attribute"], "--attribute replays learned actors"),
    (["--actor", "protocol", "--writer", "frozen"], "trains only the writer"),
    (["--writer-next", "world"], "--writer-next world scores the memories of one state: add --writer-groups branch"),
    (["--writer-next", "all", "--writer-groups", "branch"], "--writer-next must be stream or world"),
])
def test_the_protocol_actor_refuses_what_it_cannot_do(flags, says, capsys):
    with pytest.raises(SystemExit):
        rime.parse_args(["--model", "tiny", *flags])
    assert says in capsys.readouterr().err


def test_rl_rehearsal_trains_the_warm_starts_rows_beside_ppo(tmp_path, monkeypatch):
    """--rl-rehearsal 6 (PPO-ptx): every RL update carries 6 rows' worth of the warm start's mix, trained by
    cross-entropy only (PPO mask 0, so the policy loss is the RL rows' alone) and logged as sft_loss; a
    step draws the same rows however often it is drawn (a resumed run rehearses what it would have); the
    default 0 adds nothing. The flag's misuses are one-line errors."""
    seen = []
    update = rime.Learner.update
    monkeypatch.setattr(rime.Learner, "update", lambda self, b: seen.append(b) or update(self, b))
    args = ["--model", "tiny", "--steps", "2", "--warmstart-streams", "2", "--eval-streams", "1",
            "--eval-segment", "1", "--rl-rehearsal", "6", "--warmstart-decisions", "0.34"]
    run = rime.main([*args, "--run-dir", str(tmp_path / "run")])
    assert len(seen) == 2 and run.mix.counts(6) == dict(reading=0, writers=0, decisions=2, units=4)
    for step, b in enumerate(seen):
        sft = b.sft_mask.sum(1) > 0      # the rehearsed rows: exactly the step's draw, at the batch's end
        rows = rime.rehearsal_rows(run, step)
        assert sft.sum() == len(rows) >= 3 and sft[-len(rows):].all() and not (b.loss_mask[sft] > 0).any()
        assert [b.tokens[i, :b.lengths[i]].tolist() for i in range(len(b) - len(rows), len(b))] == [t for t, _ in rows]
    rl = [r for r in _metrics(str(tmp_path / "run")) if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["sft_loss"] > 0 for r in rl)
    for r, b in zip(rl, seen):           # the response length is the RL rows' alone
        assert r["response_len"] == pytest.approx(float(b.loss_mask.sum() / (b.loss_mask.sum(1) > 0).sum()))
    run.mix = None                       # rebuilt as a resumed run would
    assert rime.rehearsal_rows(run, 1) == rows != rime.rehearsal_rows(run, 0)
    assert any(r in run.mix.decisions for r in rows)      # round(6 * 0.34) = 2 drawn from the notes' decisions
    run.args.rl_rehearsal = 0
    assert rime.rehearsal_rows(run, 1) == []
    for bad in (["--rl-rehearsal", "-1"], ["--rl-rehearsal", "4", "--writer", "frozen"],
                ["--rl-rehearsal", "4", "--actor", "protocol"], ["--rl-rehearsal", "4", "--env", "codebase"],
                ["--rl-rehearsal", "2", "--warmstart-reading", "0.5", "--warmstart-decisions", "0.3"]):
        with pytest.raises(SystemExit):
            rime.parse_args(["--model", "tiny", *bad])
