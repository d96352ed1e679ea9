"""camg.py: smoke runs (one process, two processes, resume), the staleness bound, the episode queue under
failing environments and timed-out commands, credit assignment, memory ablations, config errors.

Fake environments stand in where a test needs an environment that raises or a command that times out;
`rollout.parse_action` is patched so the random tiny model's replies reach env.step() at all."""
import copy
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import camg
import cli
import camg_eval
import camg_memory
import camg_worker
import rollout
from camg_memory import ProtocolEnv, is_memory_action, memory_action_masks, reads_continuation
from envs import Task
from ppo import Learner, make_batch
from sandbox import Sandbox

ROOT = Path(__file__).resolve().parent.parent


def run_camg(*args, timeout=240, launcher=()):
    r = subprocess.run([sys.executable, *launcher, "camg.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"camg.py {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def tiny_cfg(tmp_path, **kw):
    base = dict(model="tiny", run_dir=str(tmp_path / "run"), num_workers=0, env_weights="shop=1", steps=1,
                batch_episodes=2, rollout_batch=2, max_turns=2, max_new_tokens=8, eval_tasks=0)
    return camg.Config(**{**base, **kw})


# ----------------------------------------------------------------------------- fake environments


class FakeEnv:
    """Memory is a dict; each step writes a note and CONTINUATION.md. mode: "ok" | "raise" (step raises on
    tasks with an odd index) | "timeout" (step runs a shell command past its sandbox timeout)."""
    max_steps = 3

    def __init__(self, name="shop", mode="ok", counter=None, registry=None):
        self.name, self.mode, self.counter = name, mode, counter if counter is not None else []
        self.memory, self.info, self.seen_memory, self.registry = {}, {}, [], registry
        if registry is not None:
            registry.append(self)

    def tasks(self, split):
        return [Task(id=f"{self.name}/g{g}/t{k}", env=self.name, difficulty=k, group=f"g{g}", split=split,
                     data={"k": k}) for g in range(3) for k in range(4)]

    def reset(self, task):
        self.task, self.steps, self.info = task, 0, {"success": False}
        self.seen_memory.append(dict(self.memory))      # what this task started with
        self.counter.append(task.id)
        return f"Task {task.id}. Actions: anything."

    def step(self, action):
        self.steps += 1
        if self.mode == "raise" and self.task.data["k"] % 2 == 1:
            raise RuntimeError("boom")
        obs = "ok"
        if self.mode == "timeout":
            with Sandbox(timeout=0.3) as sb:
                r = sb.run("sleep 5")
            assert r.timed_out, "the sandbox should have timed the command out"   # else: a failed episode
            obs = "$ sleep 5\n(timed out)"
        self.memory[f"note-{self.task.group}.md"] = f"seen {self.task.id}"
        self.memory["CONTINUATION.md"] = f"continue {self.task.id}"
        done = self.steps >= 2
        self.info["success"] = done
        return obs, 1.0 if done else 0.0, done

    def clone(self):
        return FakeEnv(self.name, self.mode, self.counter, self.registry)

    def close(self):
        pass

    def memory_files(self):
        return dict(self.memory)

    def set_memory_files(self, files):
        self.memory = dict(files)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's small matmuls run ~4x faster on one thread on a busy 2-core machine (as camg.py)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def actions_always(monkeypatch):
    """Every reply counts as an action, so env.step() runs whatever the random model wrote."""
    monkeypatch.setattr(rollout, "parse_action", lambda reply: reply.strip() or "noop")


# ----------------------------------------------------------------------------- smoke runs (subprocess)


def test_smoke_single_process_then_resume(tmp_path, capsys):
    run = tmp_path / "run"
    out = run_camg("--model", "tiny", "--steps", "2", "--num_workers", "0", "--run_dir", str(run), "--eval-tasks", "2",
                   "--max-turns", "3", "--max-new-tokens", "16", "--batch-episodes", "2", "--rollout-batch", "2")
    metrics = jsonl(run / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2]
    for key in ("score", "approx_kl", "clipfrac", "entropy", "value_loss", "explained_var", "grad_norm",
                "tokens_per_s", "lag_mean", "lag_max", "dropped_stale", "failed"):
        assert key in metrics[-1], key
    assert all(m["lag_max"] == 0 for m in metrics), "inline rollout is synchronous: lag must be 0"
    eps = jsonl(run / "episodes.jsonl")
    assert sum(e["used"] == "train" for e in eps) == 2 * 2
    assert (run / "ckpt").is_dir() and json.loads((run / "config.json").read_text())["steps"] == 2
    table = (run / "eval.md").read_text()
    assert "| Shop | Coding | DeepResearch | AutoResearch | Avg |" in table and "(paper: released figures)" in table
    assert "this run: tiny, after RL (update 2)" in out and "success before RL" in out and "Resets (evaluation" in out
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == {"rl_effect", "per_env", "after_by_memory", "resets", "relay_stages", "wall_s"}
    # relay stages from a real evaluation: every held-out task of the default family is a relay task, each
    # counted once, at one stage, before and after RL (in eval.json for every evaluation too). The default
    # evaluates in the training's memory mode (blank): the first turn the policy was trained on
    relay = summary["relay_stages"]
    assert list(summary["after_by_memory"]) == ["blank"] and "memory blank" in table
    for per_env in (relay["before_rl"], relay["after_rl"]["blank"], *(r["relay_stages"]["blank"] for r in jsonl(run / "eval.json"))):
        assert set(per_env) == {"shop", "deepresearch", "autoresearch"}
        for counts in per_env.values():
            assert counts["relay_episodes"] == 2 and counts["not_relay"] == 0
            assert sum(counts[k] for k in camg_eval.RELAY_STAGES) == 2
    assert "Relay episodes by the first stage" in out and "| before RL | Shop | 2 |" in out
    assert set(summary["rl_effect"]) == {"success_before", "success_after", "delta", "ci95", "tasks"}
    assert set(summary["per_env"]) == {"shop", "deepresearch", "autoresearch"} and summary["rl_effect"]["tasks"] == 6
    assert set(summary["resets"]) == {"episodes", "with_reset", "written_before_reset", "read_after_reset",
                                      "success_with_reset", "success_without_reset"}
    # resume (in-process, to save a start-up): the run dir has a checkpoint, so 3 steps continue at update 3
    cfg = camg.parse_args(["--model", "tiny", "--steps", "3", "--num_workers", "0", "--run_dir", str(run),
                           "--eval_tasks", "0", "--max-turns", "3", "--max-new-tokens", "16", "--batch-episodes", "2",
                           "--rollout-batch", "2"])
    learner = camg.learner_main(cfg, camg.Dist())
    assert learner.version == 3 and [m["update"] for m in jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert len(jsonl(run / "episodes.jsonl")) >= 3 * 2, "resuming must append to the logs, not truncate them"
    # --eval-only leaves the run's summary.json alone: its result goes to summary_eval.json, without a pairing
    kept = (run / "summary.json").read_text()
    cfg = camg.parse_args(["--model", "tiny", "--num_workers", "0", "--run_dir", str(run), "--eval-only",
                           "--eval-tasks", "2", "--max-turns", "3", "--max-new-tokens", "16"])
    camg.learner_main(cfg, camg.Dist())
    assert (run / "summary.json").read_text() == kept
    evaluated = json.loads((run / "summary_eval.json").read_text())
    assert evaluated["rl_effect"] == {} and evaluated["relay_stages"]["before_rl"] is None
    # rerunning the finished run's command evaluates again and pairs with its stored before-RL evaluation
    (run / "summary.json").unlink()
    cfg = camg.parse_args(["--model", "tiny", "--steps", "3", "--num_workers", "0", "--run_dir", str(run),
                           "--eval-tasks", "2", "--max-turns", "3", "--max-new-tokens", "16"])
    camg.learner_main(cfg, camg.Dist())
    assert json.loads((run / "summary.json").read_text())["rl_effect"]["tasks"] == 6
    # ... but not one evaluated otherwise: the weights before RL are gone, so the pairing is refused in one line
    stored = torch.load(run / "eval_before.pkl", weights_only=False)
    assert stored["key"] == camg.before_key(cfg) and stored["results"]
    other = camg.parse_args(["--model", "tiny", "--steps", "3", "--num_workers", "0", "--run_dir", str(run),
                             "--eval-tasks", "2", "--max-turns", "3", "--max-new-tokens", "16", "--eval-memory", "full"])
    with pytest.raises(SystemExit) as e:
        camg.learner_main(other, camg.Dist())
    assert e.value.code == 2 and "eval_before.pkl (held-out success before RL) was made with mode 'blank'" in capsys.readouterr().err
    torch.save(stored["results"], run / "eval_before.pkl")       # a run dir of a camg.py before the key
    for c in (cfg, other):
        with pytest.raises(SystemExit):
            camg.stored_before(stored["results"], c, run / "eval_before.pkl")
    assert camg.stored_before(stored, cfg, run / "eval_before.pkl") == stored["results"]


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


@pytest.mark.parametrize("launcher", [(), TORCHRUN], ids=["spawn", "torchrun"])
def test_smoke_two_processes_async_with_eta_0(tmp_path, launcher):
    """Learner + one rollout process: spawned by `python camg.py`, or rank 1 of `torchrun --nproc_per_node 2`
    (the GPU layout: train group + rollout ranks). With eta = 0 a worker that generated ahead with old
    weights must see those episodes dropped, never trained: every trained episode has lag 0."""
    run = tmp_path / "run"
    run_camg("--model", "tiny", "--steps", "3", "--eta", "0", "--run_dir", str(run), "--eval_tasks", "0",
             "--max-turns", "3", "--max-new-tokens", "16", "--batch-episodes", "2", "--rollout-batch", "2",
             launcher=launcher)
    metrics = jsonl(run / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2, 3] and metrics[-1]["version"] == 3
    eps = jsonl(run / "episodes.jsonl")
    trained = [e for e in eps if e["used"] == "train"]
    assert len(trained) == 3 * 2 and all(e["lag"] == 0 for e in trained)
    assert all(e["lag"] > 0 for e in eps if e["used"] == "stale")
    assert all(e["worker"] == 0 for e in eps), "episodes must come from the spawned worker"
    session = next((run / "exchange").iterdir())
    assert (session / "STOP").exists() and not list((session / "queue").glob("*.pkl")), "queue not drained"


def test_bad_config_is_a_clear_error_before_work(tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{oops")
    for args, words in [(["--eta", "-1"], "--eta"), (["--env-weights", "shop=1,mall=2"], "unknown environment"),
                        (["--eval-memory", "full,forget"], "--eval-memory"),
                        (["--context-budget", "100"], "--context-budget"), (["--steps", "two"], "--steps"),
                        (["--eval-memory", "shuffle", "--eval-tasks", "2", "--eval-stream-len", "2"],
                         "2 or more streams"),
                        (["--resume", "maybe"], "--resume is a switch"), (["--device", "bogus"], "--device must be"),
                        (["--lr", "0"], "--lr must be"), (["--temperature", "-2"], "--temperature must be"),
                        (["--max-turns", "0"], "--max-turns must be >= 1"),
                        (["--family", "long"], "--family must be relay, standard or both"),
                        (["--extra-train-relay", "-1"], "--extra-train-relay must be >= 0"),
                        (["--warmstart-steps", "-2"], "--warmstart-steps must be -1"),
                        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
                        (["--model", str(tmp_path / "no-such-model")], "no such directory"),
                        (["--model", str(corrupt)], "config.json is not valid JSON")]:
        with pytest.raises(SystemExit) as e:
            camg.parse_args(["--model", "tiny", "--run-dir", str(tmp_path / "x"), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and "Traceback" not in err, err
    # the old spellings still parse (one release)
    cfg = camg.parse_args(["--model", "tiny", "--run_dir", str(tmp_path / "y"), "--resume", "false", "--eval_only"])
    assert cfg.run_dir == str(tmp_path / "y") and cfg.resume is False and cfg.eval_only is True
    assert not (tmp_path / "x").exists(), "nothing may be written before the config is checked"


# ----------------------------------------------------------------------------- staleness bound


def test_staleness_bound_drops_old_and_corrects_admissible(tmp_path, actions_always):
    """A straggler worker keeps generating with version-0 weights while the learner moves on. With eta = 1
    at learner version 2: its version-0 episodes are dropped, version-1 episodes are trained with their
    worker's behaviour logprobs, so the decoupled loss corrects them (pi_prox / pi_behav != 1)."""
    torch.manual_seed(0)
    cfg = tiny_cfg(tmp_path, eta=1)
    model, tok = camg.build_model("tiny", "cpu", 0)
    learner = Learner(model, value_head=True, lr=1e-2, entropy_coef=0.1, max_lag=1, gradient_checkpointing=False)
    make = lambda name: FakeEnv(name)                                    # noqa: E731
    straggler = camg.RolloutWorker(cfg, copy.deepcopy(learner.gen_model), tok, worker_id=1, seed=1, make_env=make)
    stale = straggler.rollout_batch()                       # version 0
    fresh = camg.RolloutWorker(cfg, learner.gen_model, tok, worker_id=0, seed=0, make_env=make)
    state, logged = {"buffer": [], "num_stale": 0, "num_failed": 0}, []
    log = lambda s, used: logged.append((s.worker, s.version, used))  # noqa: E731
    mid = None
    for _ in range(2):
        fresh.version = learner.version
        samples = camg.collect(state, learner.version, cfg, fresh.rollout_batch, log)
        learner.update(camg.build_batch(samples, learner, 1.0, 1.0))
        if learner.version == 1:                            # a second worker still holds version 1
            mid = camg.RolloutWorker(cfg, copy.deepcopy(learner.gen_model), tok, worker_id=2, seed=2, make_env=make)
            mid.version = 1
            mid_samples = mid.rollout_batch()
    assert learner.version == 2
    arrivals = [stale, mid_samples]
    batch_samples = camg.collect(state, learner.version, cfg, lambda: arrivals.pop(0) if arrivals else [], log)
    assert {s.worker for s in batch_samples} == {2} and {s.version for s in batch_samples} == {1}
    assert [u for w, v, u in logged if w == 1] == ["stale", "stale"], "version-0 episodes must be dropped"
    batch = camg.build_batch(batch_samples, learner, 1.0, 1.0)
    rows = [lp for s in batch_samples for _, m, lp, _ in s.rows if any(m)]
    for b, lp in enumerate(rows):                            # the worker's behaviour logprobs, untouched
        assert torch.allclose(batch.behav_logprobs[b, :len(lp)], torch.tensor(lp))
    prox = learner.logprobs_of(batch)
    w = torch.exp(prox - batch.behav_logprobs)[batch.loss_mask.bool()]
    assert (w - 1).abs().max() > 1e-3, "the weights moved since version 1: pi_prox / pi_behav must differ from 1"
    stats = learner.update(batch)
    assert stats["num_stale"] == 0 and torch.isfinite(torch.tensor(stats["loss"]))
    # the learner's own guard: a version-0 row handed to update() anyway is masked out, not trained
    old = camg.build_batch(stale, learner, 1.0, 1.0)
    assert learner.update(old)["num_stale"] == len(old)


# ----------------------------------------------------------------------------- queue robustness


def test_queue_survives_raising_env_and_timeouts_without_loss(tmp_path, actions_always):
    """A producer thread (the worker side) and the learner side share a bounded Exchange (max_queue 1).
    Environments raise on half the tasks, or run commands past their timeout. Nothing deadlocks, every
    queued episode reaches the learner, and failed ones carry their reason."""
    cfg = tiny_cfg(tmp_path, env_weights="shop=1,coding=1", max_queue=1, rollout_batch=2)
    resets = []
    make = lambda name: FakeEnv(name, "raise" if name == "shop" else "timeout", resets)   # noqa: E731
    model, tok = camg.build_model("tiny", "cpu", 0)
    worker = camg.RolloutWorker(cfg, model.eval(), tok, seed=3, make_env=make)
    ex = camg.Exchange(tmp_path / "ex", max_queue=1)
    produced, put_ok, crash = [], [], []

    def produce():
        try:
            while not ex.stopped():
                batch = worker.rollout_batch()
                produced.append(batch)
                put_ok.append(ex.put(batch, 0))
        except BaseException as e:  # noqa: BLE001
            crash.append(e)
    t = threading.Thread(target=produce)
    t.start()
    received, t0 = [], time.time()
    while len(received) < 8 and time.time() - t0 < 120:
        received += ex.take()
        time.sleep(0.05)
    ex.stop()
    t.join(timeout=60)
    assert not t.is_alive(), "the producer is stuck (deadlock)"
    assert not crash, crash
    received += ex.take()
    queued = [s for b, ok in zip(produced, put_ok) if ok for s in b]
    assert len(received) >= 8 and [s.task_id for s in received] == [s.task_id for s in queued], "episodes lost"
    assert len(resets) == sum(len(b) for b in produced), "every started episode must come back as a Sample"
    # an env that raised on an action ended the episode with score 0: trained on, not failed (issue 30.5)
    raised = [s for s in received if s.env_error]
    assert raised and all(s.env == "shop" and "boom" in s.env_error and not s.error and s.score == 0.0 and s.rows
                          for s in raised)
    timed = [s for s in received if s.env == "coding"]
    assert timed and all(not s.error and s.score == 1.0 for s in timed), "a timed-out command is an observation"
    # a crash of the whole rollout (e.g. generation) still returns every episode, failed with the reason
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(camg_worker, "run_episodes", lambda *a, **k: (_ for _ in ()).throw(MemoryError("gen")))
        out = worker.rollout_batch()
    assert len(out) == 2 and all(s.error.startswith("rollout: MemoryError") for s in out)


def test_learner_trains_through_failures_and_logs_every_episode(tmp_path, actions_always):
    cfg = tiny_cfg(tmp_path, env_weights="shop=1,coding=1", steps=2, eval_tasks=2, eval_stream_len=1)
    resets = []
    make = lambda name: FakeEnv(name, "raise" if name == "shop" else "ok", resets)   # noqa: E731
    camg.learner_main(cfg, camg.Dist(), make_env=make)
    eps = jsonl(tmp_path / "run" / "episodes.jsonl")
    train_resets = len(resets) - 2 * 2 * 2                 # minus the evaluation episodes (2 per env, before and after RL)
    assert len(eps) == train_resets, "every training episode must appear in episodes.jsonl"
    assert {e["used"] for e in eps} <= {"train", "unused"}, "an episode whose env raised is trained on (score 0)"
    assert all(e["env_error"] == "step: RuntimeError('boom')" and e["score"] == 0.0 for e in eps if e["env_error"])
    assert sum(e["used"] == "train" for e in eps) == 2 * 2 and all(not e["error"] for e in eps)
    m = jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(m) == 2 and m[-1]["grad_norm"] > 0, "rewarded episodes must give a gradient"


# ----------------------------------------------------------------------------- credit and memory


def test_every_segment_gets_the_return_at_its_last_policy_token():
    model, _ = camg.build_model("tiny", "cpu", 0)
    learner = Learner(model, value_head=True, gradient_checkpointing=False)   # value head starts at V = 0
    seg1 = ([5, 6, 7, 8, 9], [0, 1, 1, 0, 0], [0.0, -1.0, -2.0, 0.0, 0.0], 1.0)   # closed by a context reset
    seg2 = ([5, 6, 7, 8], [0, 0, 1, 0], [0.0, 0.0, -0.5, 0.0], 1.0)
    other = ([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], 1.0)
    samples = [camg.Sample("shop", "a", 0, 0, 0.75, 0.0, "done", rows=[seg1, seg2]),
               camg.Sample("shop", "b", 0, 0, 0.25, 0.0, "done", rows=[other])]
    batch = camg.build_batch(samples, learner, gamma=1.0, lam=1.0)
    # gamma = lam = 1 and V = 0: the value target of every policy token is its episode's return
    expect = make_batch([seg1[0], seg2[0], other[0]], [seg1[1], seg2[1], other[1]],
                        returns=[[0, .75, .75, 0, 0], [0, 0, .75, 0], [0, .25, .25]]).returns
    assert torch.allclose(batch.returns, expect)
    assert (batch.advantages[batch.loss_mask == 0] == 0).all()
    a = batch.advantages[batch.loss_mask.bool()]
    assert abs(float(a.mean())) < 1e-5 and abs(float(a.std(unbiased=False)) - 1) < 1e-3, "whitened advantages"
    assert batch.versions.tolist() == [0, 0, 0] and batch.old_values.abs().sum() == 0


def test_whiten_per_env_centres_each_env_on_its_own_mean():
    """--whiten env: each env's policy tokens have mean advantage 0 (an env every episode fails is not pushed
    down as a whole), scaled by the pooled within-env std; global centres over all tokens, where the failing
    env's tokens all go negative."""
    model, _ = camg.build_model("tiny", "cpu", 0)
    learner = Learner(model, value_head=True, gradient_checkpointing=False)   # V = 0: advantage = return
    row = lambda n: ([5] + [6] * n, [0] + [1] * n, [0.0] * (n + 1), 1.0)
    samples = [camg.Sample("autoresearch", "a", 0, 0, 1.0, 1.0, "done", rows=[row(3)]),
               camg.Sample("autoresearch", "b", 0, 0, 0.5, 0.0, "done", rows=[row(2)]),
               camg.Sample("shop", "c", 0, 0, 0.0, 0.0, "done", rows=[row(4)]),
               camg.Sample("shop", "d", 0, 0, 0.0, 0.0, "done", rows=[row(1)])]
    per_env = camg.build_batch(samples, learner, 1.0, 1.0, whiten="env")
    plain = camg.build_batch(samples, learner, 1.0, 1.0)
    assert torch.equal(plain.advantages, camg.build_batch(samples, learner, 1.0, 1.0, whiten="global").advantages)
    on = per_env.loss_mask.bool()
    ar, shop = on[:2], on[2:]
    assert abs(float(per_env.advantages[:2][ar].mean())) < 1e-6
    assert float(per_env.advantages[2:][shop].abs().max()) < 1e-6, "a batch's all-failing env gets no push"
    assert abs(float((per_env.advantages[on] ** 2).mean()) - 1) < 1e-4, "scaled by the pooled std"
    assert float(plain.advantages[2:][shop].max()) < 0, "global: the failing env's tokens are all pushed down"
    assert torch.equal(per_env.returns, plain.returns)
    with pytest.raises(cli.ConfigError, match="--whiten must be global or env"):
        camg.Config(whiten="task")


def test_memory_modes_and_evaluation_ablations(tmp_path, actions_always):
    envs_ = [FakeEnv("shop") for _ in range(3)]
    for i, e in enumerate(envs_):
        e.memory = {f"n{i}.md": str(i), "CONTINUATION.md": f"c{i}"}
    camg_memory.apply_memory_mode(envs_, "shuffle")
    assert [e.memory["CONTINUATION.md"] for e in envs_] == ["c1", "c2", "c0"]
    camg_memory.apply_memory_mode(envs_, "continuation")
    assert all(list(e.memory) == ["CONTINUATION.md"] for e in envs_)
    camg_memory.apply_memory_mode(envs_, "blank")
    assert all(e.memory == {} for e in envs_)
    assert "No saved memory" in camg_memory.memory_note(envs_[0])
    envs_[0].memory = {"prefs.md": "secret"}
    note = camg_memory.memory_note(envs_[0])
    assert ".agent_memory/prefs.md" in note and "secret" not in note, "the note gives paths, never contents"

    streams = camg_eval.eval_streams(FakeEnv(), num_tasks=5, stream_len=2)
    assert [[t.id for t in s] for s in streams] == [["shop/g0/t0", "shop/g0/t1"], ["shop/g1/t0", "shop/g1/t1"],
                                                    ["shop/g2/t0"]]
    model, tok = camg.build_model("tiny", "cpu", 0)
    cfg = tiny_cfg(tmp_path, eval_tasks=4, eval_stream_len=2)
    made = []
    make = lambda name: FakeEnv(name, registry=made)                     # noqa: E731
    seen = {}
    for mode in ("full", "blank", "shuffle", "continuation"):
        made.clear()
        res = camg_eval.evaluate(cfg, model.eval(), tok, mode, make_env=make)
        assert res["shop"]["num"] == 4
        seen[mode] = [e.seen_memory[1] for e in made]       # the memory each stream's 2nd task started with
    assert seen["full"][0] == {"note-g0.md": "seen shop/g0/t0", "CONTINUATION.md": "continue shop/g0/t0"}
    assert seen["blank"] == [{}, {}]
    assert seen["shuffle"][0] == seen["full"][1] and seen["shuffle"][1] == seen["full"][0]
    assert seen["continuation"][0] == {"CONTINUATION.md": "continue shop/g0/t0"}
    text = camg_eval.table2([("this run", res)])
    assert "| this run | 100.0 (n=4) | — | — | — | 100.0 |" in text and text.count("*(paper: ") == 6
    assert "derived" in text and "competitive with" in text, "published rows carry their source, the abstract's claim"


def test_worker_samples_carry_their_temperature():
    """Rows leave the worker as (tokens, loss_mask, logprobs, temperature) and the learner's batch
    scores them at that temperature (a rollout crash here once failed every episode)."""
    from rollout import Episode
    ep = Episode(task=Task("t", "shop", 0, "g", "train"), tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                 logprobs=[0.0, -1.0, -1.0], temperature=0.7, score=0.5)
    (s,) = camg_worker.to_samples([ep], ["shop"], version=0, worker=0, batch_s=1.0)
    assert s.error == "" and s.rows == [([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 0.7)] and s.gen_tokens == 2
    model, _ = camg.build_model("tiny", "cpu", 0)
    learner = Learner(model, value_head=True, gradient_checkpointing=False)
    batch = camg.build_batch([s], learner, gamma=1.0, lam=1.0)
    assert batch.temperatures.tolist() == pytest.approx([0.7])


# ----------------------------------------------------------------------------- the reset protocol


def test_protocol_env_bounds_the_file_and_records_each_reset(tmp_path):
    """Written / empty / missing / stale before a reset (the env's memory_files() call at the reset),
    read or not after it, and CONTINUATION.md cut to MAX_CHARS with the observation saying so."""
    import deepresearch
    env = ProtocolEnv(deepresearch.DeepResearchEnv(relay_per_region=1, tasks_per_region=0), max_chars=50)
    try:
        task = env.tasks("test")[0]
        env.set_memory_files({})
        env.reset(task)
        env.memory_files()                                      # a reset with no file
        obs, _, _ = env.step("shell: printf '%s' " + "x" * 80 + " > .agent_memory/CONTINUATION.md")
        assert "was cut to its first 50 characters" in obs and len(env.env.memory_files()["CONTINUATION.md"]) == 50
        env.memory_files()                                      # a reset after writing it
        env.step("shell: cat .agent_memory/CONTINUATION.md")
        env.step("shell: printf '' > .agent_memory/CONTINUATION.md")
        env.memory_files()                                      # written empty
        assert camg_memory.reset_outcomes(env) == [{"before": "missing", "read": False},
                                                   {"before": "written", "read": True},
                                                   {"before": "empty", "read": False}]
        env.env.set_memory_files({"CONTINUATION.md": "from the last task"})
        env.reset(task)
        env.memory_files()
        assert camg_memory.reset_outcomes(env) == [{"before": "stale", "read": False}], "a new episode, a new record"
    finally:
        env.close()
    assert reads_continuation("shell: tail -n 5 .agent_memory/CONTINUATION.md")
    assert not reads_continuation("shell: printf 'a' > .agent_memory/CONTINUATION.md") and not reads_continuation("search[x]")
    assert is_memory_action("shell: cat .agent_memory/notes.md") and not is_memory_action("shell: ls")


def test_reset_record_matches_rollout_resets_and_memory_tokens_are_marked():
    """Through rollout's own loop: one record per reset (rollout asks memory_files() only at a reset), and
    memory_action_masks flags exactly the tokens of the replies that write or read memory files."""
    cfg = camg.Config(model="tiny", context_budget=700, max_new_tokens=64, max_turns=12)
    _, tok = camg.build_model("tiny", "cpu", 0)
    proto = camg_worker.make_env("deepresearch")
    eps, outcomes = camg_worker.reference_episodes(proto, proto.tasks("test")[:3], tok, cfg)
    assert any(ep.num_resets for ep in eps)
    for ep, out in zip(eps, outcomes):
        assert len(out) == ep.num_resets and all(o["read"] for o in out)
        rows = [r.loss_mask for r in ep.rows()]
        flags = memory_action_masks(rows, ep.actions)
        marked = {tok.decode([t for t, f in zip(r.tokens, fl) if f]) for r, fl in zip(ep.rows(), flags)}
        assert all("CONTINUATION.md" in m for m in marked if m), marked
        assert sum(map(sum, flags)) < sum(map(sum, rows)), "task actions are not memory actions"


def test_mask_memory_actions_zeroes_their_loss_mask():
    model, _ = camg.build_model("tiny", "cpu", 0)
    learner = Learner(model, value_head=True, gradient_checkpointing=False)
    row = ([5, 6, 7, 8, 9, 10], [0, 1, 1, 0, 1, 1], [0.0, -1.0, -1.0, 0.0, -1.0, -1.0], 1.0)
    s = camg.Sample("shop", "a", 0, 0, 1.0, 1.0, "done", rows=[row], memory_tokens=[[0, 1, 1, 0, 0, 0]])
    plain = camg.build_batch([s], learner, 1.0, 1.0)
    masked = camg.build_batch([s], learner, 1.0, 1.0, mask_memory=True)
    assert plain.loss_mask[0].tolist() == [0, 1, 1, 0, 1, 1] and masked.loss_mask[0].tolist() == [0, 0, 0, 0, 1, 1]
    only_memory = camg.Sample("shop", "b", 0, 0, 1.0, 1.0, "done", rows=[row], memory_tokens=[[0, 1, 1, 0, 1, 1]])
    assert camg.build_batch([only_memory], learner, 1.0, 1.0, mask_memory=True) is None
    assert camg.parse_args(["--model", "tiny", "--mask-memory-actions"]).mask_memory_actions


# ----------------------------------------------------------------------------- warm start and summary


def test_warm_start_skips_a_model_that_follows_the_protocol_and_stops_at_the_threshold(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, warmstart_steps=10, warmstart_threshold=0.9)
    model, tok = camg.build_model("tiny", "cpu", 0)
    learner = Learner(model, value_head=True, lr=1e-3, gradient_checkpointing=False)
    rows = [([5, 6, 7, 8], [0, 1, 1, 0]), ([5, 9, 7], [0, 1, 1])]
    monkeypatch.setattr(camg, "warmstart_rows", lambda *a: rows)
    monkeypatch.setattr(camg, "WARMSTART_CHECK_EVERY", 1)
    monkeypatch.setattr(camg, "format_validity", lambda *a: 0.95)
    logged = []
    out = camg.warm_start(cfg, learner, tok, None, logged.append)
    assert out["steps"] == 0 and learner.version == 0, "a model that already follows the protocol is not trained"
    checks = iter([0.0, 0.5, 0.95, 0.99])
    monkeypatch.setattr(camg, "format_validity", lambda *a: next(checks))
    out = camg.warm_start(cfg, learner, tok, None, logged.append)
    assert out == {"validity_before": 0.0, "validity_after": 0.95, "steps": 2} and learner.version == 2
    assert logged[-1]["sft_loss"] > 0 and learner.optimizer.param_groups[0]["lr"] == cfg.lr


def test_the_warm_start_rehearses_the_readers_rungs_in_the_tasks_form(tmp_path, monkeypatch):
    """The rows that keep the reading through the warm start are the reader's last stage's mix: every rung
    the tasks use, the save in the tasks' form (camg_reader's `save`), not recipe 6's `carry`."""
    import camg_reader
    import camg_worker
    import pretrain
    mixes = []
    monkeypatch.setattr(pretrain, "step_items", lambda data, mix, n: mixes.append(mix) or [])
    camg.reading_rows(tiny_cfg(tmp_path, model="reader"), camg_worker.small_tokenizer())(4)
    used = {r for r, u in camg_reader.RUNGS.items() if u}
    assert mixes and used <= set(mixes[0]) and "carry" not in mixes[0]


def test_the_laptop_models_log_their_reading_ladder_around_the_warm_start(tmp_path, monkeypatch):
    """--model small / reader: camg_reader.py's ladder is measured and logged before and after the warm
    start (a rung at chance says which copy a relay episode cannot make); --model reader is "small" after
    the reading pretraining and gets the same auto warm start."""
    import pretrain
    from ppo import Dist
    assert camg.Config().model == "reader"      # the default: the shipped reader
    assert tiny_cfg(tmp_path, model="reader").warmstart_steps == 300 and tiny_cfg(tmp_path, model="small").warmstart_steps == 150
    # the reader's warm start runs cooler: at 5e-3 it took the reader's copy rung 0.98 -> 0.25 (docs/camg.md)
    assert tiny_cfg(tmp_path, model="reader").warmstart_lr == 2e-3 and tiny_cfg(tmp_path, model="small").warmstart_lr == 5e-3
    assert tiny_cfg(tmp_path, model="reader", warmstart_lr=1e-3).warmstart_lr == 1e-3
    # the laptop models' workers sample at 0.5 (at 1.0 RL moved no held-out task: docs/results.md), a checkpoint at 1.0
    assert camg.Config().temperature == 0.5 == tiny_cfg(tmp_path, model="small").temperature == tiny_cfg(tmp_path).temperature
    assert camg.Config(model="smollm2").temperature == 1.0 and tiny_cfg(tmp_path, temperature=0.8).temperature == 0.8
    assert camg.Config().steps == 40
    # evaluation defaults to the training's memory mode, and follows --train-memory
    assert tiny_cfg(tmp_path).eval_modes == ["blank"] and tiny_cfg(tmp_path, train_memory="full").eval_modes == ["full"]
    cfg = tiny_cfg(tmp_path, model="small", warmstart_steps=2)
    model, tok = camg.build_model("small", "cpu", 0)
    learner = Learner(model, value_head=True, lr=1e-3, gradient_checkpointing=False)
    monkeypatch.setattr(camg, "warm_start", lambda *a: {"steps": 2})
    seen = []

    def ladder(model, tok, num_items=200, seed=0, rungs=None, pool=None, course=None):
        seen.append(course)
        return {r: {"accuracy": 0.5, "chance": 0.1, "used": u, "items": num_items} for r, u in course.rungs.items()}
    monkeypatch.setattr(pretrain, "ladder", ladder)
    Path(cfg.run_dir).mkdir(parents=True)
    camg.warm_start_phase(camg.Run(cfg, Dist(device=torch.device("cpu")), None, learner, tok, None))
    rows = [json.loads(r) for r in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["when"] for r in rows] == ["before the warm start", "after the warm start"]
    assert all(r["phase"] == "ladder" and r["carry"] == 0.5 for r in rows)
    assert {c.name for c in seen} == {"camg_reader"}


def test_steps_0_is_the_warm_start_and_its_evaluation(tmp_path, monkeypatch):
    """--steps 0 (as rime.py's): the warm start runs, then the evaluation; the warm-started weights are
    checkpointed, so rerunning the command evaluates them without imitating again."""
    from ppo import Dist
    calls = []

    def fake_warm_start(cfg, learner, tok, make_env, log):
        calls.append(cfg.warmstart_steps)
        return {"validity_before": 0.0, "validity_after": 1.0, "steps": cfg.warmstart_steps}
    monkeypatch.setattr(camg, "warm_start", fake_warm_start)
    cfg = tiny_cfg(tmp_path, steps=0, warmstart_steps=3)
    camg.learner_main(cfg, Dist())
    assert calls == [3] and (tmp_path / "run" / "ckpt").is_dir()
    rows = [json.loads(r) for r in (tmp_path / "run" / "warmstart.jsonl").read_text().splitlines()]
    assert rows[-1] == {"final": True, "validity_before": 0.0, "validity_after": 1.0, "steps": 3}
    camg.learner_main(tiny_cfg(tmp_path, steps=0, warmstart_steps=3), Dist())
    assert calls == [3], "the rerun resumes from the warm-started checkpoint"


def test_warm_start_decays_its_lr_and_rehearses_the_reading(tmp_path, monkeypatch):
    """Each imitation step runs at warmstart_lr * (1 - (step - 1) / steps); with --warmstart-reading 0.5 each
    batch of 4 task rows gets 4 rows of camg_reader.py's rungs (the reading rehearsed), the default for
    --model reader; none for small, and the flag is refused for a model in another BPE."""
    assert tiny_cfg(tmp_path, model="reader").warmstart_reading == 0.5
    # the flag takes a share as typed (its default, -1, is written as an int: it once refused 0.7)
    assert camg.parse_args(["--model", "reader", "--warmstart-reading", "0.7"]).warmstart_reading == 0.7
    assert tiny_cfg(tmp_path, model="small").warmstart_reading == 0.0
    with pytest.raises(cli.ConfigError, match="--model small or reader"):
        tiny_cfg(tmp_path, model="tiny", warmstart_reading=0.5)
    cfg = tiny_cfg(tmp_path, model="small", warmstart_steps=3, warmstart_reading=0.5, warmstart_lr=3e-3)
    model, tok = camg.build_model("small", "cpu", 0)
    learner = Learner(model, value_head=True, lr=1e-3, gradient_checkpointing=False)
    task_rows = [([5, 6, 7, 8], [0, 1, 1, 0])] * 6
    monkeypatch.setattr(camg, "warmstart_rows", lambda *a: task_rows)
    monkeypatch.setattr(camg, "format_validity", lambda *a: 0.0)
    seen, real = [], learner.update

    def update(batch, **kw):
        seen.append((learner.optimizer.param_groups[0]["lr"], batch))
        return real(batch, **kw)
    monkeypatch.setattr(learner, "update", update)
    camg.warm_start(cfg, learner, tok, None, lambda r: None)
    assert [lr for lr, _ in seen] == pytest.approx([3e-3, 2e-3, 1e-3])
    import camg_reader
    for _, batch in seen:
        lengths = sorted(batch.lengths.tolist())
        assert lengths[:4] == [4] * 4 and min(lengths[4:]) > 10 and len(lengths) == 8   # 4 task rows, 4 reading rows
    assert learner.optimizer.param_groups[0]["lr"] == cfg.lr and camg_reader.RUNGS["save_line"]


def test_warmstart_rows_imitate_the_reference_through_resets(tmp_path):
    """The rows are rollout rows of the reference: the continuation file written before a reset and read
    back after it carry sft mask 1 like every other reply."""
    cfg = tiny_cfg(tmp_path, env_weights="deepresearch=1", warmstart_tasks=2, context_budget=700,
                   max_new_tokens=64, max_turns=12)
    _, tok = camg.build_model("tiny", "cpu", 0)
    rows = camg.warmstart_rows(cfg, tok, camg.env_maker(cfg))
    trained = " ".join(tok.decode([t for t, m in zip(toks, mask) if m]) for toks, mask in rows)
    assert len(rows) > 2 and "> .agent_memory/CONTINUATION.md" in trained and "cat .agent_memory/CONTINUATION.md" in trained
    assert "memo[]" in trained and "<action>" in trained


def test_warmstart_rows_with_both_families(tmp_path):
    """--family both (the memory ablations' setting): the standard family's reference policies have no
    notes() to carry; the warm start still builds its rows (it used to stop with an AttributeError)."""
    _, tok = camg.build_model("tiny", "cpu", 0)
    for env in ("deepresearch", "shop"):     # a standard shop policy restarts from the task after a reset
        cfg = tiny_cfg(tmp_path, env_weights=f"{env}=1", warmstart_tasks=6, context_budget=700,
                       max_new_tokens=64, max_turns=12, family="both")
        rows = camg.warmstart_rows(cfg, tok, camg.env_maker(cfg))
        assert len(rows) >= 6 and all(any(mask) for _, mask in rows)


def test_summary_pairs_tasks_and_counts_resets():
    def res(succ, resets):
        return {"success": sum(succ), "score": 0.0, "num": len(succ), "failed": 0,
                "episodes": [{"task": f"t{i}", "success": s, "resets": r} for i, (s, r) in enumerate(zip(succ, resets))]}
    w, m = {"before": "written", "read": True}, {"before": "missing", "read": False}
    before = {"shop": res([0, 0, 1, 0], [[]] * 4), "deepresearch": res([0, 0, 0, 0], [[]] * 4)}
    after = {"shop": res([1, 1, 1, 0], [[w], [w], [], [m]]), "deepresearch": res([1, 0, 0, 0], [[w], [], [], []])}
    s = camg_eval.summary(before, {"full": after, "blank": before}, 12.0)
    assert s["per_env"]["shop"]["delta"] == pytest.approx(0.5) and s["per_env"]["shop"]["tasks"] == 4
    assert s["rl_effect"]["success_before"] == pytest.approx(0.125) and s["rl_effect"]["success_after"] == pytest.approx(0.5)
    assert s["rl_effect"]["delta"] == pytest.approx(0.375) and s["rl_effect"]["tasks"] == 8
    lo, hi = s["rl_effect"]["ci95"]
    assert lo < 0.375 < hi
    assert s["after_by_memory"]["blank"] == {"success": pytest.approx(0.125), "per_env": {"shop": 0.25, "deepresearch": 0.0}}
    r = s["resets"]
    assert r["episodes"] == 8 and r["with_reset"] == pytest.approx(0.5) and r["written_before_reset"] == pytest.approx(0.75)
    assert r["read_after_reset"] == pytest.approx(0.75)
    assert r["success_with_reset"] == pytest.approx(0.75) and r["success_without_reset"] == pytest.approx(0.25)
    assert "| average | 8 |" in camg_eval.effect_table(s)


@pytest.mark.parametrize("name, groups", [("shop", 24), ("deepresearch", 19), ("autoresearch", 16)])
def test_extra_train_relay_adds_training_tasks_and_keeps_the_rest(name, groups):
    """--extra-train-relay N: N more relay tasks per training group (two sampled: the reference
    solves them); the test split and every earlier training task are as they were."""
    base, more = camg_worker.make_env(name), camg_worker.make_env(name, "relay", 2)
    assert [(t.id, t.data) for t in more.tasks("test")] == [(t.id, t.data) for t in base.tasks("test")]
    old = {t.id: t.data for t in base.tasks("train")}
    new = [t for t in more.tasks("train") if t.id not in old]
    assert len(new) == 2 * groups and len({t.id for t in more.tasks("train")}) == len(old) + len(new)
    assert all(old[t.id] == t.data for t in more.tasks("train") if t.id in old)
    assert all(t.difficulty == 3 and t.split == "train" for t in new)
    carried, _ = camg_worker.reference_episodes(more, new[::groups][:2], camg_worker.small_tokenizer(), camg.Config())
    assert len(carried) == 2 and all(ep.info.get("success") for ep in carried)
    assert camg_worker.make_env("coding", "relay", 2).config == camg_worker.make_env("coding", "relay").config
    made = camg_worker.env_maker(camg.Config(extra_train_relay=2))(name)   # what camg.py's workers build
    assert [t.id for t in made.tasks("train")] == [t.id for t in more.tasks("train")]



@pytest.mark.parametrize("name, pool", [("shop", 44), ("deepresearch", 33), ("autoresearch", 22)])
def test_a_larger_evaluation_adds_test_relay_tasks_and_keeps_the_rest(name, pool):
    """--eval-tasks beyond a relay family's test split (44 / 33 / 22): each test group gets more relay
    tasks after its own (the new ones sampled: the reference solves them); the training tasks and the
    earlier test tasks are as they were, so a smaller evaluation takes the same tasks as before."""
    base, more = camg_worker.make_env(name), camg_worker.env_maker(camg.Config(eval_tasks=64))(name)
    assert len(base.tasks("test")) == pool and len(more.tasks("test")) >= 64
    assert [(t.id, t.data) for t in more.tasks("train")] == [(t.id, t.data) for t in base.tasks("train")]
    # the old test tasks first, in order (what format_validity's first four per env are taken from)
    assert [(t.id, t.data) for t in more.tasks("test")[:pool]] == [(t.id, t.data) for t in base.tasks("test")]
    new = more.tasks("test")[pool:]
    assert len({t.id for t in more.tasks("test")}) == len(more.tasks("test"))
    assert all(t.difficulty == 3 and t.split == "test" and "relay" in t.id for t in new)
    # held out as the old ones are: in the test groups only (no training shopper, region or lab)
    assert {t.group for t in new} <= {t.group for t in base.tasks("test")}
    assert not {t.group for t in new} & {t.group for t in more.tasks("train")}
    ids = lambda env, n: [t.id for s in camg_eval.eval_streams(env, n, 1) for t in s]
    assert ids(more, 16) == ids(base, 16) and len(set(ids(more, 64))) == 64
    carried, _ = camg_worker.reference_episodes(more, new[::len(new) // 2][:2], camg_worker.small_tokenizer(),
                                                camg.Config())
    assert len(carried) == 2 and all(ep.info.get("success") for ep in carried)
    assert camg_worker.make_env("coding", "relay", test_tasks=64).config == camg_worker.make_env("coding").config

@pytest.mark.parametrize("train_memory,mode,kept", [("blank", "wiped", False), ("full", "wiped", True),
                                                   ("blank", "full", False), ("blank", "blank", False),
                                                   ("full", "blank", True), ("full", "full", True)])
def test_an_evaluation_shows_the_first_turn_the_policy_trained_on(monkeypatch, train_memory, mode, kept):
    """Whether the first user turn says the folder is kept for later tasks follows the training's memory
    mode, whatever mode is evaluated: a mode changes what the folder holds, not the words. (A policy
    trained with blank and evaluated with full's first turn wrote a note before opening DeepResearch's memo
    in 16 of 16 held-out relay episodes.)"""
    seen = []

    class Stop(Exception):
        pass

    def capture(model, tok, envs_, tasks, memory, **kw):
        seen.extend(memory)
        raise Stop
    monkeypatch.setattr(camg_eval, "run_episodes", capture)
    cfg = camg.Config(model="tiny", env_weights="deepresearch=1", eval_tasks=2, train_memory=train_memory,
                      eval_memory=mode)
    with pytest.raises(Stop):
        camg_eval.evaluate(cfg, None, None, mode, make_env=camg.env_maker(cfg))
    assert seen and all((camg_memory.KEPT.strip() in m) == kept for m in seen)


def test_wiped_mode_deletes_the_file_at_each_reset_and_then_the_reference_fails():
    """--eval-memory wiped: CONTINUATION.md is recorded at a reset, then deleted (only inside an
    episode: not before a task starts); the reference policy, which carries the relay fact in the
    file, then fails every held-out relay task it resets in."""
    import deepresearch
    env = ProtocolEnv(deepresearch.DeepResearchEnv(relay_per_region=1, tasks_per_region=0), wipe_at_reset=True)
    try:
        env.set_memory_files({"CONTINUATION.md": "from the last task"})
        assert "CONTINUATION.md" in env.memory_files(), "before reset(): a task's first note, not a reset"
        env.reset(env.tasks("test")[0])
        env.step("shell: printf 'the memo said' > .agent_memory/CONTINUATION.md")
        assert "CONTINUATION.md" not in env.memory_files() and "CONTINUATION.md" not in env.env.memory_files()
        assert camg_memory.reset_outcomes(env) == [{"before": "written", "read": False}]
        assert env.clone().wipe_at_reset
    finally:
        env.close()
    assert "wiped" in camg_memory.MEMORY_MODES and camg.parse_args(["--eval-memory", "full,wiped"]).eval_modes == ["full", "wiped"]
    proto, cfg, tok = camg_worker.make_env("deepresearch"), camg.Config(), camg_worker.small_tokenizer()
    tasks = proto.tasks("test")[:8]
    envs_ = [ProtocolEnv(proto.clone(), wipe_at_reset=True) for _ in tasks]
    try:
        for e in envs_:
            e.set_memory_files({})
        agents = [camg_memory.CarryingAgent(lambda t=t, e=e: e.reference_policy(t)) for t, e in zip(tasks, envs_)]
        eps = camg_memory.run_reference(tok, envs_, tasks, agents, [camg_memory.memory_note(e, False) for e in envs_],
                                        context_budget=cfg.context_budget, max_turns=cfg.max_turns,
                                        max_new_tokens=cfg.max_new_tokens)
    finally:
        for e in envs_ + [proto]:
            e.close()
    reset = [ep for ep in eps if ep.num_resets]
    assert reset and not any(ep.info.get("success") for ep in reset)
    # its relay stages say why: the fact was written before the reset, then never read back (the file was gone)
    progress = [camg_memory.episode_relay_progress(ep, e) for ep, e in zip(eps, envs_) if ep.num_resets]
    assert progress and set(progress) == {"not_read"}, progress


# ----------------------------------------------------------------------------- relay stages


@pytest.mark.parametrize("name", ["shop", "deepresearch", "autoresearch"])
def test_relay_progress_of_real_reference_episodes(name):
    """At camg.py's preset, the reference policy's relay episodes through rollout's loop: carrying the fact,
    every one that resets after the note wrote it, read it back and (but in Shop, where the options may be
    picked before the reset and the item page stays) used it; starting over after a reset instead, every
    failure is "not written". (In Shop most relay episodes end inside the context when nothing is carried,
    30 of the first 32, so it plays 12: the 9th needs the file.)"""
    cfg, tok = camg.Config(), camg_worker.small_tokenizer()
    for carry in (True, False):
        proto = camg_worker.make_env(name, "relay")
        tasks = proto.tasks("test")[:12 if name == "shop" else 6]
        envs_ = [ProtocolEnv(proto)] + [ProtocolEnv(proto.clone()) for _ in tasks[1:]]
        try:
            for e in envs_:
                e.set_memory_files({})
            agents = [camg_memory.CarryingAgent(lambda t=t, e=e: e.reference_policy(t), carry) for t, e in zip(tasks, envs_)]
            eps = camg_memory.run_reference(tok, envs_, tasks, agents, [camg_memory.memory_note(e, False) for e in envs_],
                                            context_budget=cfg.context_budget, max_turns=cfg.max_turns,
                                            max_new_tokens=cfg.max_new_tokens)
        finally:
            for e in envs_:
                e.close()
        progress = [(bool(ep.info.get("success")), camg_memory.episode_relay_progress(ep, e)) for ep, e in zip(eps, envs_)]
        if carry:
            assert all(ok for ok, _ in progress) and any(p != "no_reset" for _, p in progress), progress
            assert {p for _, p in progress} <= ({"used", "not_used", "no_reset"} if name == "shop" else {"used", "no_reset"})
        else:
            assert any(not ok for ok, _ in progress) and all(p == "not_written" for ok, p in progress if not ok), progress


def shop_relay_record(opened=True, reset=True, written=True, read=True, used=True, note_after_reset=False):
    """A synthetic Shop relay episode (what rollout's Episode and ProtocolEnv record) that passes the
    stages asked for: the note opened, the options written to CONTINUATION.md, a reset, the file read
    back, the options clicked. Returns (fact, actions, observations, reset_turns, notes_at_reset)."""
    import shop
    from workspace import shell_echo
    env = shop.ShopEnv(relay_per_shopper=1, tasks_per_shopper=0)
    task = env.tasks("test")[0]
    fact, goal = env.relay_fact(task), task.data["goal"]
    lines = shop.note_lines(goal["category"], goal["options"])

    def shell(cmd, out):                                    # a shell action and its observation, echo first
        return f"shell: {cmd}", f"{shell_echo(cmd)}\n{out}\n(exit 0)"
    turns = [("search[jacket]", "Results for \"jacket\" (page 1/1):")] if note_after_reset else []
    turns += [("click[note]", task.data["note"]) if opened else ("click[back]", "Page: search")]
    write = f"printf '%s\\n' '{lines}' > .agent_memory/CONTINUATION.md"
    turns += [shell(write if written else "printf 'shopping' > .agent_memory/CONTINUATION.md", "")]
    reset_turns = [len(turns)] if reset else []
    turns += [shell("cat .agent_memory/CONTINUATION.md", lines) if read else shell("ls", "")]
    turns += [(f"click[{v}]", "[B1] ... selected: ...") for v in goal["options"].values()] if used else []
    turns += [("buy", "Bought [B1] ... Reward 0.50")]
    if note_after_reset:
        reset_turns = [1]                                   # a reset before the note: nothing to carry yet
    actions, obs = [a for a, _ in turns], [f"Instruction: {goal['instruction']}"] + [o for _, o in turns]
    notes = [{"CONTINUATION.md": lines if written else "shopping"}] * len(reset_turns)
    env.close()
    return fact, actions, obs, reset_turns, notes


def test_relay_progress_stops_at_the_first_stage_an_episode_fails():
    """Each stage of a synthetic relay episode taken away in turn: the progress says which one it stopped at."""
    from camg_memory import relay_progress
    assert relay_progress(*shop_relay_record()) == "used"
    assert relay_progress(*shop_relay_record(used=False)) == "not_used"
    assert relay_progress(*shop_relay_record(read=False)) == "not_read"
    assert relay_progress(*shop_relay_record(written=False)) == "not_written"
    assert relay_progress(*shop_relay_record(reset=False)) == "no_reset"
    assert relay_progress(*shop_relay_record(note_after_reset=True)) == "no_reset", "the reset must come after the note"
    assert relay_progress(*shop_relay_record(opened=False)) == "not_opened"
    # a command's echo is not its output: writing the options again after the reset is not reading them back
    fact, actions, obs, turns, notes = shop_relay_record()
    from workspace import shell_echo
    again = f"printf '%s\\n' '{notes[0]['CONTINUATION.md']}' > .agent_memory/CONTINUATION.md"
    actions[turns[0]], obs[turns[0] + 1] = f"shell: {again}", f"{shell_echo(again)}\n\n(exit 0)"
    assert relay_progress(fact, actions, obs, turns, notes) == "not_read"
    # no memory file written in this episode (ProtocolEnv leaves out what an earlier task left): not written
    assert relay_progress(fact, *shop_relay_record()[1:4], [{}]) == "not_written"
    # a command that names the file but prints nothing of it (the wiped ablation: the file is gone)
    fact, actions, obs, turns, notes = shop_relay_record()
    obs[turns[0] + 1] = "$ cat .agent_memory/CONTINUATION.md\ncat: .agent_memory/CONTINUATION.md: No such file\n(exit 1)"
    assert relay_progress(fact, actions, obs, turns, notes) == "not_read"


def test_protocol_env_keeps_the_files_written_before_each_reset(tmp_path):
    """notes_at_reset: per reset, the memory files this episode wrote as they stood then (a file left by an
    earlier task does not count; the wiped ablation deletes the file only after it is kept)."""
    import shop
    env = ProtocolEnv(shop.ShopEnv(relay_per_shopper=1, tasks_per_shopper=0), wipe_at_reset=True)
    try:
        env.set_memory_files({"CONTINUATION.md": "- jacket size m", "old.md": "from the last task"})
        env.reset(env.tasks("test")[0])
        env.memory_files()                                      # reset 1: nothing written yet
        env.step("shell: printf 'fresh' > .agent_memory/CONTINUATION.md")
        env.memory_files()                                      # reset 2: written, then wiped
        assert env.notes_at_reset == [{}, {"CONTINUATION.md": "fresh"}]
        assert "CONTINUATION.md" not in env.env.memory_files()
    finally:
        env.close()


def test_relay_facts_of_each_environment():
    """What each env's relay family carries, on a relay task, and None on a task of another family."""
    import autoresearch
    import codebase
    import deepresearch
    import shop
    from camg_memory import has_fact
    s = shop.ShopEnv(relay_per_shopper=1)
    relay, standard = next(t for t in s.tasks("test") if "note" in t.data), s.tasks("test")[0]
    fact = s.relay_fact(relay)
    assert s.relay_fact(standard) is None and fact["source"] == relay.data["note"]
    assert has_fact(fact["values"], shop.note_lines(relay.data["goal"]["category"], relay.data["goal"]["options"]))
    assert not has_fact(fact["values"], "memory")
    d = deepresearch.DeepResearchEnv(relay_per_region=1)
    task = next(t for t in d.tasks("test") if "memo" in t.data)
    fact, person = d.relay_fact(task), re.search(deepresearch.MEMO_RE, task.data["memo"]).group(1)
    assert fact["source"] == task.data["memo"] and d.relay_fact(d.tasks("test")[0]) is None
    assert has_fact(fact["values"], f"- person: {person}") and has_fact(fact["values"], f"answer[{task.data['answer']}]")
    a = autoresearch.AutoResearchEnv(relay_per_group=1, tasks_per_group=0)
    task = a.tasks("test")[0]
    fact = a.relay_fact(task)
    c = a.build(task)[4]["DROP"][1:-1]
    assert fact["source"] == a.lab_note(task) and a.reset(task) and a.step("note")[0] == fact["source"]
    assert has_fact(fact["values"], f"sed -i 's/^DROP = .*/DROP = [{c}]/' train.py") and has_fact(fact["values"], f"column x{c} leaks")
    assert not has_fact(fact["values"], f"DROP = [{(int(c) + 1) % 8}]")
    data = {"relay": True, "location": ["src/tablib/core.py", "Dataset.stack", 12], "FAIL_TO_PASS": ["tests/t.py::a"],
            "PASS_TO_PASS": ["tests/t.py::b"]}
    fact = codebase.CodingEnv.relay_fact(None, Task("coding/x/relay", "coding", 3, "tablib", "test", data))
    assert "Bisect: the failure comes from src/tablib/core.py, function Dataset.stack (line 12)." in fact["source"]
    assert all(has_fact(fact["values"], t) for t in ("grep -n 'def stack' x.py", "nl -ba src/tablib/core.py", "Dataset.stack"))
    assert not has_fact(fact["values"], "stacked core") and codebase.CodingEnv.relay_fact(None, Task("c", "coding", 0, "g", "test", {})) is None
    for e in (s, d, a):
        e.close()


def test_relay_stages_count_each_episode_at_its_first_failed_stage():
    """relay_stages over evaluation results: one count per stage, a success counted as solved, the env's
    non-relay episodes apart, and "n/a" (not zeros) for an env without relay episodes; the summary carries
    them before and after RL, and the report prints them as a table."""
    def res(progress_success):
        eps = [{"task": f"t{i}", "success": s, "resets": [], "relay": p} for i, (p, s) in enumerate(progress_success)]
        return {"success": sum(s for _, s in progress_success), "score": 0.0, "num": len(eps), "failed": 0, "episodes": eps}
    stages = ["not_opened", "no_reset", "not_written", "not_read", "not_used", "used"]
    after = {"shop": res([(p, 0.0) for p in stages] + [("used", 1.0), ("no_reset", 1.0), (None, 1.0)]),
             "deepresearch": res([(None, 0.0), (None, 1.0)])}
    counts = camg_eval.relay_stages(after)
    assert counts["deepresearch"] == "n/a"
    assert counts["shop"] == {"not_opened": 1, "no_reset": 1, "not_written": 1, "not_read": 1, "not_used": 1,
                              "used_wrong": 1, "solved": 2, "relay_episodes": 8, "not_relay": 1, "solved_not_carried": 1}
    before = {"shop": res([("not_opened", 0.0)] * 3), "deepresearch": res([(None, 0.0)] * 2)}
    assert camg_eval.relay_stages(before)["shop"]["not_opened"] == 3 and camg_eval.relay_stages(before)["shop"]["solved"] == 0
    s = camg_eval.summary(before, {"full": after}, 1.0)
    assert s["relay_stages"]["before_rl"]["shop"]["relay_episodes"] == 3 and s["relay_stages"]["after_rl"]["full"] == counts
    text = camg_eval.effect_table(s)
    assert "| before RL | Shop | 3 | 3 | 0 | 0 | 0 | 0 | 0 | 0 |" in text
    assert "| after RL, memory full | Shop | 8 | 1 | 1 | 1 | 1 | 1 | 1 | 2 (1 not carried) |" in text
    assert "| after RL, memory full | DeepResearch | n/a |" in text
    old = {"shop": {**res([]), "episodes": [{"task": "t", "success": 0.0, "resets": []}]}}   # an evaluation from before
    assert camg_eval.relay_stages(old) == {"shop": "n/a"}
