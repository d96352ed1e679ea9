"""bench.py: metrics on a hand-computed stream, resume after an interruption, the table, the API
client against a local stub server, failures never scored 0, and an end-to-end scripted run."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import alchemy
import bench
import judge
import published
import speed

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- metrics and table

def _row(mode, task, attempt, score, failed=False):
    return {"policy": "p", "stream": "s", "settings": {}, "mode": mode, "task": task, "attempt": attempt,
            "score": None if failed else score, "failed": failed}


def test_metrics_on_a_hand_computed_stream():
    rows = [_row("memory", "a", 0, 1.0), _row("memory", "b", 0, 0.5), _row("memory", "c", 0, None, failed=True),
            _row("scratch", "a", 0, 0.5), _row("scratch", "a", 1, 0.7),
            _row("scratch", "b", 0, 0.0), _row("scratch", "b", 1, None, failed=True),
            _row("scratch", "c", 0, 1.0), _row("scratch", "c", 1, 1.0)]
    cell = bench.summarize("p", "s", ["a", "b", "c"], {bench.row_key(r): r for r in rows}, {})
    # c is dropped (its with-memory run failed), never counted as 0; b's failed attempt is left out of its mean
    assert (cell.counted, cell.total, cell.failed) == (2, 3, 2)
    assert cell.reward == pytest.approx(1.5)
    assert cell.gain == pytest.approx(1.5 - (0.6 + 0.0))
    assert cell.scratch == pytest.approx([0.6, 0.0])
    other = bench.summarize("p", "s", ["a", "b", "c"], {bench.row_key(r): r for r in rows}, {"seed": 1})
    assert other.counted == 0 and other.failed == 0, "rows of other settings must not be reused"


def test_table_marks_published_rows_and_failures():
    cell = bench.Cell("scripted", "alchemy", 7.25, 1.5, 11, 12, 3, [1.0] * 11, [0.8] * 11, writer_failed=2, writes=11)
    table = bench.render_table([cell])
    assert "| scripted | alchemy | 7.25 | +1.50 | 11/12 | 3 | 2/11 | measured here |" in table
    for name, reward, gain, source in published.RIME_CODEBASE19:
        line = next(l for l in table.splitlines() if l.startswith(f"| {name} †"))
        assert f"{reward:.2f}" in line and f"{gain:+.2f}" in line and line.endswith(f"| {source} |")
    assert "| GPT-6 Astra † | codebase19 | 17.25 | +2.26 | 19/19 | - | - | released figures |" in table
    assert "CAMG" not in table, "the CAMG paper's figures come with a camg stream only"
    assert bench.sparkline([0, 1, 2], 2) == "▁▄█"


def test_every_published_row_carries_its_source():
    """Each published row says where it comes from (abstract, released figures, derived), in the data
    and in every printed table; nothing computed here is called "reported"; the abstract's claim is text."""
    assert {r[3] for r in published.RIME_CODEBASE19} <= set(published.SOURCES)
    assert {r["source"] for r in published.CAMG_SUCCESS} | {r[2] for r in published.CAMG_EXTERNAL} <= set(published.SOURCES)
    cells = [bench.Cell("scripted", "camg/shop", 3.0, 0.5, 4, 4, 0, [0.75] * 4, [0.6] * 4)]
    text = bench.render_table(cells)
    marked = [l for l in text.splitlines() if "†" in l and l.startswith("|")]
    assert len(marked) == len(published.RIME_CODEBASE19) + len(published.CAMG_SUCCESS) + len(published.CAMG_EXTERNAL)
    for line in marked:
        source = line.rstrip(" |").rsplit("|", 1)[1].strip()
        assert source.split(";")[0] in published.SOURCES, line
        assert "reported" not in line.lower(), line
    assert "| CompactionRL-4B † | 97.5 | 19.5 | 50.8 | 24.2 | 48.0 | released figures; Avg derived |" in text
    assert "| CAMG-RL-4B, blank saved memory at evaluation † | 67.7 | 12.8 | 50.7 | 30.0 | 40.3 | derived |" in text
    assert "| Qwen3.5-35B-A3B † | competitive with CAMG-RL-4B | competitive with CAMG-RL-4B | abstract |" in text
    assert ("CAMG-RL-4B and CAMG-RL-9B are competitive with Qwen3.5-35B-A3B and Qwen3.5-122B-A10B, respectively"
            in text and "SWE-bench Verified and MLE-bench Lite" in text)
    # a derived figure is what its released parts give
    full, blank = published.camg_row("CAMG-RL-4B")["values"], published.camg_row(
        "CAMG-RL-4B, blank saved memory at evaluation")["values"]
    for env, cost in published.BLANK_COST.items():
        assert blank[env] == pytest.approx(full[env] - cost)
    assert blank["avg"] == pytest.approx(sum(blank[e] for e in published.BLANK_COST) / 4, abs=0.05)


def _one_line_error(capsys, fn, msg):
    """fn() stops with the entry points' one error style: exit 2 and `prog: error: ...msg...` on stderr."""
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err
    assert e.value.code == 2 and ": error: " in err and msg in err and "Traceback" not in err, err


def test_bad_config_gets_a_clear_error(tmp_path, capsys):
    for argv, msg in ((["--streams", "nope"], "unknown stream"), (["--attempts", "0"], "--attempts"),
                      (["--policy", str(tmp_path / "none")], "checkpoint dir"), (["--threads", "-1"], "--threads"),
                      (["--temperature", "nan"], "--temperature must be a number"), (["--api", "http://x"], "go together"),
                      (["--actor-context", "last"], "--actor-context must be all or latest")):
        _one_line_error(capsys, lambda: bench.main(argv), msg)


# ----------------------------------------------------------------------------- resume

def test_resume_after_interruption_reruns_nothing_done(tmp_path, monkeypatch, capsys):
    argv = ["--policy", "scripted", "--stream-len", "3", "--attempts", "2", "--results", str(tmp_path)]
    resets = []
    real_reset = alchemy.AlchemyEnv.reset

    def counting_reset(self, task):
        resets.append(task.id)
        if len(resets) == 5 and interrupt:
            raise KeyboardInterrupt  # the user stops the bench in the middle of the from-scratch part
        return real_reset(self, task)
    monkeypatch.setattr(alchemy.AlchemyEnv, "reset", counting_reset)

    interrupt = True
    with pytest.raises(SystemExit) as e:    # Ctrl-C: one line, no traceback
        bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "bench.py: interrupted; finished rows are kept" in err and "Traceback" not in err
    done = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert len(done) == 4  # 3 with-memory tasks + 1 from-scratch attempt were finished
    with open(tmp_path / "rows.jsonl", "a") as f:
        f.write('{"policy": "scripted", "stream": "alch')  # a line cut by the interruption

    interrupt, resets[:] = False, []
    cells = bench.main(argv)
    assert len(resets) == 3 * 3 - 4, "only the unfinished runs may be rerun"
    # the finished rows equal those of an uninterrupted run (memory resumed from the cached rows)
    fresh = tmp_path / "fresh"
    full = bench.main(argv[:-1] + [str(fresh)])
    assert (cells[0].reward, cells[0].gain, cells[0].counted) == (full[0].reward, full[0].gain, 3)
    again, resets[:] = bench.main(argv), []
    assert resets == [] and again[0].reward == cells[0].reward


# ----------------------------------------------------------------------------- file memory (CAMG)

class NoteEnv:
    """A one-step task that scores 1 when an earlier task left `.agent_memory/note.md`, else 0.5."""
    max_steps = 1

    def __init__(self):
        self.files, self.info = {}, {}

    def reset(self, task):
        return f"Task {task.id}."

    def step(self, action):
        score = 1.0 if "note.md" in self.files else 0.5
        self.files["note.md"] = "the answer is 42"
        return "done", score, True

    def reference_policy(self, task):
        return lambda obs: "read the note"

    def memory_files(self):
        return dict(self.files)

    def set_memory_files(self, files):
        self.files = dict(files)

    def clone(self):
        return NoteEnv()

    def close(self):
        pass


def test_file_memory_kept_with_memory_and_blanked_from_scratch(tmp_path):
    from envs import Task
    tasks = [Task(id=f"notes/{i}", env="notes", difficulty=0, group="g", split="test") for i in range(3)]
    agent = bench.Agent("scripted", "scripted", tokenizer=bench.offline_tokenizer())
    cfg, rows = bench.Config(policy=["scripted"], attempts=2), {}

    class Bar:
        def update(self, n):
            pass
    with open(tmp_path / "rows.jsonl", "a") as out:
        bench.run_cell(agent, "notes", NoteEnv(), tasks, "files", cfg, rows, out, Bar())
    cell = bench.summarize("scripted", "notes", [t.id for t in tasks], rows, {})
    assert cell.with_memory == [0.5, 1.0, 1.0] and cell.scratch == [0.5, 0.5, 0.5]
    assert (cell.reward, cell.gain) == (2.5, 1.0)
    assert rows[bench.row_key(dict(policy="scripted", stream="notes", settings={}, mode="memory", task="notes/0",
                                   attempt=0))]["memory_files"] == {"note.md": "the answer is 42"}


# ----------------------------------------------------------------------------- the API client

class Stub(BaseHTTPRequestHandler):
    plan = []       # what the next requests get: "ok", "500", "slow", "garbage"; then "ok"
    requests = []   # the message lists received

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.requests.append(body["messages"])
        what = Stub.plan.pop(0) if Stub.plan else "ok"
        if what == "500":
            self.send_response(500)
            self.end_headers()
            return
        if what == "overflow":      # what OpenAI-compatible servers send when the prompt outgrows the context
            err = {"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested "
                             "2100 tokens. Please reduce the length of the messages.",
                             "type": "invalid_request_error", "code": "context_length_exceeded"}}
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(err).encode())
            return
        if what == "slow":
            time.sleep(1.0)
        reply = b"{not json" if what == "garbage" else json.dumps(
            {"choices": [{"message": {"content": "Nothing to lose. <action>end</action>"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        try:
            self.wfile.write(reply)
        except OSError:
            pass  # the client timed out and left

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Stub.plan, Stub.requests = [], []
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def _chat(url, **kw):
    return bench.chat(url, "m", [{"role": "user", "content": "hi"}], timeout=0.3, retries=1, backoff=0.01, **kw)


def test_api_success_and_500_then_success(server):
    assert _chat(server).endswith("<action>end</action>")
    Stub.plan = ["500"]
    assert "<action>end</action>" in _chat(server)
    assert len(Stub.requests) == 3


def test_api_timeout_and_malformed_reply_fail_bounded(server):
    for plan, msg in ((["slow", "slow"], "timed out|Timeout"), (["garbage", "garbage"], "malformed")):
        Stub.plan, t0 = plan, time.time()
        with pytest.raises(judge.ApiError, match=msg):
            _chat(server)
        assert time.time() - t0 < 3.0


def test_api_agent_plays_with_its_history_and_failures_are_not_zeros(server, tmp_path):
    def argv(results):
        return ["--api", server, "--api-model", "m", "--stream-len", "2", "--attempts", "1", "--results", str(results),
                "--api-timeout", "0.5", "--api-retries", "0", "--task-retries", "1", "--backoff", "0.01"]
    cells = bench.main(argv(tmp_path))
    assert cells[0].policy == "api:m" and cells[0].counted == 2 and cells[0].failed == 0
    actor_calls = [m for m in Stub.requests if m[0]["content"].startswith("You are an agent")]
    assert [len(m) for m in actor_calls[:3]] == [2, 4, 6], "the agent keeps its chat history within a task"
    assert any(m[0]["content"].startswith("You keep a running") for m in Stub.requests), "the API agent writes memory"

    # the endpoint answers the check, then fails every call: every run fails, none is scored 0, exit 1
    Stub.plan = ["ok"] + ["500"] * 1000
    with pytest.raises(SystemExit) as e:
        bench.main(argv(tmp_path / "down") + ["--api-max-failures", "100"])
    assert e.value.code == 1
    rows = [json.loads(l) for l in (tmp_path / "down" / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["failed"] and r["score"] is None and "HTTP 500" in r["reason"] for r in rows)
    # no completed task: no figure, never 0.00
    assert "| api:m | alchemy | n/a | n/a | 0/2 | 4 |" in (tmp_path / "down" / "table.md").read_text()


def test_api_agent_handles_a_context_overflow(server):
    """A server that says the conversation outgrew its context: the agent drops the older half of
    its turns, asks for shorter replies once no turn is left to drop, then ends the episode with its
    score so far; the server's message is kept, and what happened is recorded."""
    agent = bench.ApiAgent(server, "m", timeout=2.0, retries=0, backoff=0.01, max_tokens=512)
    policy = agent.actor("")
    for i in range(1, 6):
        assert policy(f"obs {i}") == "end"
    assert len(Stub.requests[-1]) == 10                  # system, obs 1, then 4 (reply, observation) pairs
    Stub.plan = ["overflow"]                            # 4 earlier turns (obs 1-5 answered): 2 go at once
    assert policy("obs 6") == "end"
    assert policy.context_log == ["context full: dropped the oldest 2 of 4 earlier turns"]
    sent = Stub.requests[-1]
    assert sent[1]["content"].endswith("obs 1") and [m["content"] for m in sent[3::2]] == ["obs 4", "obs 5", "obs 6"]
    Stub.plan = ["overflow"] * 2                         # 2 of the 3 earlier turns, then the last one
    assert policy("obs 7") == "end" and len(Stub.requests[-1]) == 4 and policy.context_log[-1].startswith(
        "context full: dropped the oldest 1 of 1")
    Stub.plan = ["overflow"] * 3                         # no turn left to drop: shorter replies
    assert policy("obs 8") == "end"
    assert policy.context_log[-3:] == ["context full: dropped the oldest 1 of 1 earlier turns",
                                       "context full: max_tokens -> 256", "context full: max_tokens -> 128"]
    Stub.plan = ["overflow"] * 100                       # nothing left to cut: the episode ends, no error
    assert policy("obs 9") == "" and policy.context_log[-1].startswith("context full: episode ended at turn 9 ")
    n = len(Stub.requests)
    assert policy("obs 10") == "" and len(Stub.requests) == n, "no more calls once the context is full"
    with pytest.raises(judge.ApiError) as e:          # other callers still see the server's own message
        Stub.plan = ["overflow"]
        _chat(server)
    assert e.value.context_overflow and "maximum context length is 2048" in str(e.value)
    # a small endpoint context caps the reply size
    assert bench.ApiAgent(server, "m", max_tokens=512, context=1024).max_tokens == 256


def test_help_lists_the_speed_tables_and_metrics_are_json(tmp_path):
    r = subprocess.run([sys.executable, "bench.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    for name in ("engine", "sandbox", "envs", "ppo", "camg"):
        assert f"python speed.py {name}" in r.stdout
    assert "python bench.py ablations" in r.stdout and "python bench.py camg-ablations" in r.stdout
    assert "--swebench SWEBENCH" in r.stdout and "--swebench-repos SWEBENCH_REPOS" in r.stdout
    import cli
    line = cli.dumps({"a": float("nan"), "b": [float("inf"), 1.5]})
    assert json.loads(line) == {"a": None, "b": [None, 1.5]} and "NaN" not in line


# ----------------------------------------------------------------------------- end to end

def test_scripted_end_to_end_subprocess(tmp_path):
    r = subprocess.run([sys.executable, "bench.py", "--policy", "scripted", "--stream-len", "4", "--attempts", "1",
                        "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    line = next(l for l in table.splitlines() if l.startswith("| scripted | alchemy |"))
    reward = float(line.split("|")[3])
    assert 0 < reward <= 4 and "| 4/4 | 0 |" in line
    assert "with memory" in (tmp_path / "curves.txt").read_text() and "wall time" in r.stdout


def test_component_subcommands_print_tables(capsys):
    speed.main(["sandbox", "--n", "5", "--parallel", "2", "--per-thread", "2"])
    speed.main(["envs", "--which", "alchemy", "--tasks", "3"])
    out = capsys.readouterr().out
    assert "| latency of `true`, median of 5 (ms) |" in out and "| throughput, 2 threads x 2 (cmd/s) |" in out
    oracle = next(l for l in out.splitlines() if l.startswith("| oracle"))
    assert oracle.endswith("| 1.000 |"), "the oracle scores 1 on every task"
    _one_line_error(capsys, lambda: speed.main(["engine", "--models", "gpt2"]), "--models")


def test_bench_hands_speed_benchmarks_to_speed_py():
    # `python bench.py NAME` runs speed.py's benchmark as a program: same table, same error and exit status
    r = subprocess.run([sys.executable, "bench.py", "sandbox", "--n", "3", "--parallel", "1", "--per-thread", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "| latency of `true`, median of 3 (ms) |" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "bench.py", "engine", "--models", "gpt2"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "speed.py engine: error: --models takes qwen3,qwen3_5,smollm2; need 1 <= --min-prompt <= --max-prompt"]


def test_engine_bench_runs_with_breakdown(capsys):
    # the speed table and the breakdown on a tiny setting: same greedy tokens from both engines
    speed.main(["engine", "--models", "qwen3", "--batch-sizes", "2", "--max-prompt", "40", "--new-tokens", "4",
                "--breakdown", "--repeats", "2"])
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("| qwen3 | 29M | 2 |"))
    assert row.endswith("| 1.00 |"), row
    lo, hi = row.split("|")[7].strip().rstrip("x").split("-")   # the spread of the per-repeat ratios
    assert 0 < float(lo) <= float(row.split("|")[6].strip().rstrip("x")) <= float(hi)
    parts = next(l for l in out.splitlines() if l.startswith("| qwen3 | 2 |"))
    cells = [c.strip() for c in parts.strip("|").split("|")]
    assert len(cells) == 8 and all(float(c.rstrip("x")) > 0 for c in cells[2:])


def test_ablations_table_trains_resumes_and_reports(tmp_path, capsys):
    """Two variants x 1 seed of the tiny smoke model, at the smallest sizes rime.py runs (one RL step
    of one 2-task stream, groups of 2, 2-turn tasks, 2 held-out 2-task streams): the table has their
    rows and the paper's direction, the plot is drawn; the variants share the warm start and its
    before-RL evaluation; a rerun trains nothing again (the finished runs' summaries are reused)."""
    import importlib.util
    argv = ["ablations", "--seeds", "1", "--only", "full RIME,--writer frozen", "--results", str(tmp_path),
            "--", "--model", "tiny", "--steps", "1", "--streams-per-step", "1", "--group-size", "2", "--segment", "1",
            "--eval-streams", "2", "--eval-segment", "1", "--max-turns", "2", "--max-new-tokens", "8"]
    bench.main(argv)
    out = capsys.readouterr().out
    for name in ("full RIME", "--writer frozen"):
        row = next(l for l in out.splitlines() if l.startswith(f"| {name} |"))
        assert "| 1 |" in row and "(1 seed)" in row and "±" not in row   # no spread from one seed
    assert (tmp_path / "table.md").exists() and (tmp_path / "full_RIME" / "seed0" / "final" / "config.json").exists()
    if importlib.util.find_spec("matplotlib"):      # the plot is optional: drawn when matplotlib is there
        assert (tmp_path / "ablations.png").stat().st_size > 0
    # the variants share the seed's warm start and its before-RL evaluation of the same weights
    warm = json.loads((tmp_path / "_warmstart" / "seed0" / "summary.json").read_text())
    for run in ("full_RIME", "writer_frozen"):
        config = json.loads((tmp_path / run / "seed0" / "config.json").read_text())
        assert config["init_from"] == str(tmp_path / "_warmstart" / "seed0" / "final")
        summary = json.loads((tmp_path / run / "seed0" / "summary.json").read_text())
        assert summary["rl_effect"]["gain_before"] == warm["rl_effect"]["gain_before"]
        first_eval = next(json.loads(l) for l in open(tmp_path / run / "seed0" / "metrics.jsonl") if '"eval"' in l)
        assert first_eval["reused_from"] == str(tmp_path / "_warmstart" / "seed0")
    logs = {p: p.stat().st_size for p in tmp_path.rglob("seed0.log")}
    bench.main(argv)
    assert {p: p.stat().st_size for p in tmp_path.rglob("seed0.log")} == logs, "finished runs are not rerun"
    # --table-only: the table of what finished, with a variant and a seed that never ran left out, nothing started
    capsys.readouterr()
    bench.main(["ablations", "--seeds", "2", "--table-only", "--only", "full RIME,--writer frozen,--actor frozen",
                "--results", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| full RIME | 1 |" in out and "| --actor frozen | 0 |" in out
    assert not (tmp_path / "actor_frozen").exists() and not (tmp_path / "_warmstart" / "seed1").exists()
    _one_line_error(capsys, lambda: bench.main(["ablations", "--only", "nothing"]), "--only names none")


# ----------------------------------------------------------------------------- one model loader

def test_model_policies_load_through_model_load_named(monkeypatch):
    """bench.py builds no model itself: every model policy goes through model.load_named (the one
    loader of the entry points), "tiny" being the same seeded tiny Qwen3.5 as before."""
    import model
    calls, real = [], model.load_named
    monkeypatch.setattr(model, "load_named", lambda name, seed=0: calls.append((name, seed)) or real(name, seed=seed))
    (agent,) = bench.load_agents(bench.Config(policy=["tiny"], seed=3))
    assert calls == [("tiny", 3)] and agent.kind == "model" and not agent.model.training
    ref, _ = model.tiny("qwen3_5", seed=3)
    assert all(a.equal(b) for a, b in zip(agent.model.state_dict().values(), ref.state_dict().values()))


# ----------------------------------------------------------------------------- SWE-bench rows

def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(repo)})


def _swebench_rows(tmp_path) -> tuple[Path, Path, dict]:
    """A one-commit git repo with a bug (add subtracts) and a SWE-bench row fixing it: (rows file, repos dir, row)."""
    repos = tmp_path / "repos"
    repo = repos / "tinylib"
    (repo / "tests").mkdir(parents=True)
    (repo / "tinylib.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "tests" / "test_keep.py").write_text("def test_keep():\n    assert True\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    row = {"instance_id": "tiny__tinylib-1", "repo": "tiny/tinylib", "base_commit": base,
           "problem_statement": "add(2, 3) returns -1",
           "patch": "--- a/tinylib.py\n+++ b/tinylib.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n"
                    "+    return a + b\n",
           "test_patch": "--- /dev/null\n+++ b/tests/test_add.py\n@@ -0,0 +1,5 @@\n+from tinylib import add\n+\n+\n"
                         "+def test_add():\n+    assert add(2, 3) == 5\n",
           "FAIL_TO_PASS": json.dumps(["tests/test_add.py::test_add"]), "PASS_TO_PASS": ["tests/test_keep.py::test_keep"],
           "test_command": "python -m pytest -p no:cacheprovider", "test_timeout": 60}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    return rows, repos, row


def test_swebench_rows_are_the_codebase_stream(tmp_path):
    """--stream codebase --swebench FILE --swebench-repos DIR benchmarks those rows: the scripted
    agent (the row's gold patch) resolves the issue with memory and from scratch."""
    import codebase
    try:
        codebase.require_cache()      # the sandbox shows the cached test dependencies
    except RuntimeError as e:
        pytest.skip(str(e))
    rows, repos, _ = _swebench_rows(tmp_path)
    cells = bench.main(["--policy", "scripted", "--stream", "codebase", "--swebench", str(rows), "--swebench-repos",
                        str(repos), "--attempts", "1", "--results", str(tmp_path / "out")])
    assert [(c.stream, c.counted, c.total, c.failed, c.gain) for c in cells] == [("codebase", 1, 1, 0, 0.0)]
    assert cells[0].reward > 0.9        # resolved (the score counts the steps taken as well)
    done = [json.loads(l) for l in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert {r["task"] for r in done} == {"codebase/tiny__tinylib-1"} and all(r["success"] for r in done)


def test_swebench_flags_fail_with_one_line(tmp_path, capsys):
    rows, repos, row = _swebench_rows(tmp_path)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(json.dumps({**row, "repo": "tiny/elsewhere"}) + "\n")
    out = ["--policy", "scripted", "--results", str(tmp_path / "out")]
    for argv, msg in (
            (["--stream", "codebase", "--swebench", str(tmp_path / "none.jsonl"), "--swebench-repos", str(repos)],
             "no such file"),
            (["--stream", "codebase", "--swebench", str(rows), "--swebench-repos", str(tmp_path / "nope")],
             "--swebench needs --swebench-repos DIR"),
            (["--stream", "codebase19", "--swebench", str(rows), "--swebench-repos", str(repos)], "give both"),
            (["--stream", "codebase"], "give both"),
            (["--stream", "codebase", "--swebench", str(elsewhere), "--swebench-repos", str(repos)],
             "tiny/elsewhere is not available offline")):
        _one_line_error(capsys, lambda: bench.main(argv + out), msg)
    assert not (tmp_path / "out").exists(), "nothing is written before the streams load"


# ----------------------------------------------------------------------------- the CAMG memory ablations

FAKE_CAMG = '''
import argparse, json, os, sys
from pathlib import Path
p = argparse.ArgumentParser()
p.add_argument("--seed", type=int)
p.add_argument("--run-dir")
p.add_argument("--eval-memory", default="")              # camg.py's: "" = the training's mode
p.add_argument("--train-memory", default="blank")
p.add_argument("--mask-memory-actions", action="store_true")
a, _ = p.parse_known_args()
a.eval_memory = a.eval_memory or a.train_memory
variant = "mask" if a.mask_memory_actions else a.train_memory
with open(os.environ["FAKE_CAMG_CALLS"], "a") as f:
    f.write(f"{variant} {a.seed} {a.eval_memory}\\n")
if os.environ.get("FAKE_CAMG_ARGV"):
    with open(os.environ["FAKE_CAMG_ARGV"], "a") as f:
        f.write(" ".join(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_CAMG_FAIL") == f"{variant}:{a.seed}":
    print("progress...\\nboom: the learner ran out of memory")
    sys.exit(1)
after = {"full": 0.5, "blank": 0.5, "continuation": 0.4, "mask": 0.2}[variant] + 0.01 * a.seed
effect = {"success_before": 0.1, "success_after": after, "delta": after - 0.1, "ci95": [0.0, 0.6], "tasks": 16}
summary = {"rl_effect": effect, "per_env": {"shop": effect},
           "after_by_memory": {m: {"success": after - {"blank": 0.15, "wiped": 0.3}.get(m, 0.0), "per_env": {}}
                               for m in a.eval_memory.split(",")}, "resets": {}, "wall_s": 1.0}
Path(a.run_dir).mkdir(parents=True, exist_ok=True)
(Path(a.run_dir) / "summary.json").write_text(json.dumps(summary))
'''


def test_camg_ablations_table_resumes_and_reports_a_failed_run(tmp_path, monkeypatch, capsys):
    """camg-ablations with a stand-in camg.py that writes summary.json: the table has mean ± std of
    each variant (blank memory and the wiped file read from the full runs' own evaluations, no training of
    their own) beside
    the published average and its source; a failed run is one error line (exit 2) and the others still
    count; a rerun runs only what did not finish."""
    import ablations
    fake = tmp_path / "fake_camg.py"
    fake.write_text(FAKE_CAMG)
    monkeypatch.setitem(ablations.PROGRAMS, "camg", fake)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_CAMG_CALLS", str(calls))
    monkeypatch.setenv("FAKE_CAMG_FAIL", "mask:1")
    root = tmp_path / "abl"
    argv = ["camg-ablations", "--results", str(root)]

    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    errors = [l for l in captured.err.splitlines() if "error:" in l]
    assert "Traceback" not in captured.err and len(errors) == 2, captured.err
    assert errors[0].startswith("bench.py camg-ablations: error: no_memory_gradients seed 1: fake_camg.py exited 1 "
                                "(boom: the learner ran out of memory); log: ")
    assert errors[1].startswith("bench.py camg-ablations: error: 1 run(s) failed")
    made = calls.read_text().splitlines()
    assert sorted(made) == sorted([f"full {s} full,blank,wiped" for s in range(3)] + [f"continuation {s} continuation" for s in range(3)]
                                  + [f"mask {s} full" for s in range(3)]), "3 seeds of 3 runs; blank trains nothing"
    rows = {l.split("|")[1].strip(): l for l in captured.out.splitlines() if l.startswith("| ")}
    assert rows["full"].startswith("| full | 3 | 51.00 ± 1.00 | +41.00 ± 1.00 | - | 54.4 | released figures |")
    assert rows["blank memory at evaluation"].startswith(
        "| blank memory at evaluation | 3 | 36.00 ± 1.00 | n/a | -15.00 ± 0.00 | 40.3 | derived | below full")
    assert rows["CONTINUATION.md wiped at each reset"].startswith(
        "| CONTINUATION.md wiped at each reset | 3 | 21.00 ± 1.00 | n/a | -30.00 ± 0.00 | — | ours | below full")
    assert rows["continuation-only training"].startswith(
        "| continuation-only training | 3 | 41.00 ± 1.00 | +31.00 ± 1.00 | -10.00 ± 0.00 | 41.8 | released figures |")
    assert rows["no gradients through memory actions"].startswith(   # seeds 0 and 2 (seed 1 failed)
        "| no gradients through memory actions | 2 | 21.00 ± 1.41 | +11.00 ± 1.41 | -30.00 ± 0.00 | 21.1 |")
    assert (root / "table.md").read_text().strip() in captured.out

    monkeypatch.delenv("FAKE_CAMG_FAIL")
    calls.write_text("")
    bench.main(argv)
    assert calls.read_text().splitlines() == ["mask 1 full"], "finished runs are never redone"
    out = capsys.readouterr().out
    assert "| no gradients through memory actions | 3 | 21.00 ± 1.00 |" in out
    results = json.loads((root / "results.json").read_text())
    assert results["full"]["seed2"]["success_after"] == pytest.approx(0.52)

    calls.write_text("")
    bench.main(argv[:1] + ["--only", "blank memory at evaluation"] + argv[1:])
    assert calls.read_text() == "" and "| blank memory at evaluation | 3 |" in capsys.readouterr().out
    _one_line_error(capsys, lambda: bench.main(["camg-ablations", "--only", "nothing"]), "--only names none of: full")


def test_camg_ablations_in_the_relay_setting(tmp_path, monkeypatch, capsys):
    """--setting relay runs camg.py's own default (no stream flags): full (evaluated full and wiped) and
    no memory gradients; blank memory and continuation-only training have no row there (nothing is saved
    between tasks), and the table says why."""
    import ablations
    fake = tmp_path / "fake_camg.py"
    fake.write_text(FAKE_CAMG)
    monkeypatch.setitem(ablations.PROGRAMS, "camg", fake)
    calls, argvs = tmp_path / "calls.txt", tmp_path / "argv.txt"
    monkeypatch.setenv("FAKE_CAMG_CALLS", str(calls))
    monkeypatch.setenv("FAKE_CAMG_ARGV", str(argvs))
    bench.main(["camg-ablations", "--setting", "relay", "--seeds", "2", "--jobs", "2", "--results", str(tmp_path / "relay")])
    # the full runs (trained blank, camg.py's default) evaluated full and wiped, the others in the training's mode
    assert sorted(calls.read_text().splitlines()) == ["blank 0 full,wiped", "blank 1 full,wiped", "mask 0 blank", "mask 1 blank"]
    assert not any(f in line for line in argvs.read_text().splitlines() for f in ("--family", "--train-memory",
                                                                                   "--eval-stream-len"))
    out = capsys.readouterr().out
    rows = {l.split("|")[1].strip(): l for l in out.splitlines() if l.startswith("| ")}
    assert set(rows) == {"variant", "full", "CONTINUATION.md wiped at each reset", "no gradients through memory actions"}
    assert rows["CONTINUATION.md wiped at each reset"].startswith(
        "| CONTINUATION.md wiped at each reset | 2 | 20.50 ± 0.71 | n/a | -30.00 ± 0.00 |")
    assert "blank memory at evaluation is the full run itself" in out
    _one_line_error(capsys, lambda: bench.main(["camg-ablations", "--setting", "nothing"]), "invalid choice")
