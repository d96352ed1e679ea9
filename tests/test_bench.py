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
    cell = bench.Cell("scripted", "alchemy", 7.25, 1.5, 11, 12, 3, [1.0] * 11, [0.8] * 11)
    table = bench.render_table([cell])
    assert "| scripted | alchemy | 7.25 | +1.50 | 11/12 | 3 | measured here |" in table
    for name, reward, gain in bench.PUBLISHED:
        line = next(l for l in table.splitlines() if l.startswith(f"| {name} †"))
        assert f"{reward:.2f}" in line and f"{gain:+.2f}" in line and "reported by the paper, not measured here" in line
    assert "| GPT-6 Astra † | codebase19 | 17.25 | +2.26 |" in table
    assert bench.sparkline([0, 1, 2], 2) == "▁▄█"


def _one_line_error(capsys, fn, msg):
    """fn() stops with the entry points' one error style: exit 2 and `prog: error: ...msg...` on stderr."""
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err
    assert e.value.code == 2 and ": error: " in err and msg in err and "Traceback" not in err, err


def test_bad_config_gets_a_clear_error(tmp_path, capsys):
    for argv, msg in ((["--streams", "nope"], "unknown stream"), (["--attempts", "0"], "--attempts"),
                      (["--policy", str(tmp_path / "none")], "checkpoint dir"), (["--threads", "-1"], "--threads"),
                      (["--temperature", "nan"], "--temperature must be a number"), (["--api", "http://x"], "go together")):
        _one_line_error(capsys, lambda: bench.main(argv), msg)


# ----------------------------------------------------------------------------- resume

def test_resume_after_interruption_reruns_nothing_done(tmp_path, monkeypatch):
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
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
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

    Stub.plan = ["500"] * 1000  # the endpoint is down: every run fails, none is scored 0
    cells = bench.main(argv(tmp_path / "down"))
    assert cells[0].counted == 0 and cells[0].failed == 4
    rows = [json.loads(l) for l in (tmp_path / "down" / "rows.jsonl").read_text().splitlines()]
    assert all(r["failed"] and r["score"] is None and "HTTP 500" in r["reason"] for r in rows)
    # no completed task: no figure, never 0.00
    assert "| api:m | alchemy | n/a | n/a | 0/2 | 4 |" in (tmp_path / "down" / "table.md").read_text()


def test_api_agent_handles_a_context_overflow(server):
    """A server that says the conversation outgrew its context: the agent asks for shorter replies,
    then drops its oldest turns, then ends the episode with its score so far; the server's message
    is kept, and what happened is recorded."""
    agent = bench.ApiAgent(server, "m", timeout=2.0, retries=0, backoff=0.01, max_tokens=512)
    Stub.plan = ["overflow"] * 3                      # 512 -> 256 -> 128 -> 64 tokens, then it fits
    policy = agent.actor("")
    assert policy("obs 1") == "end"
    assert policy.context_log == [f"context full: max_tokens -> {n}" for n in (256, 128, 64)]
    assert policy("obs 2") == "end" and len(Stub.requests[-1]) == 4     # system, obs 1, reply, obs 2
    Stub.plan = ["overflow"] * 2                       # at 64 tokens already: the oldest turn goes
    assert policy("obs 3") == "end"
    assert "context full: dropped the oldest turn" in policy.context_log
    Stub.plan = ["overflow"] * 100                     # nothing left to cut: the episode ends, no error
    assert policy("obs 4") == "" and "episode ended" in policy.context_log[-1]
    n = len(Stub.requests)
    assert policy("obs 5") == "" and len(Stub.requests) == n, "no more calls once the context is full"
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
    """Two variants x 1 seed of the tiny smoke model: the table has their rows and the paper's
    direction; a rerun trains nothing again (the finished runs' summaries are reused)."""
    argv = ["ablations", "--seeds", "1", "--only", "full RIME,--writer frozen", "--results", str(tmp_path),
            "--", "--model", "tiny", "--steps", "1", "--eval-streams", "2", "--max-turns", "3"]
    bench.main(argv)
    out = capsys.readouterr().out
    for name in ("full RIME", "--writer frozen"):
        row = next(l for l in out.splitlines() if l.startswith(f"| {name} |"))
        assert "| 1 |" in row and "±" in row
    assert (tmp_path / "table.md").exists() and (tmp_path / "full_RIME" / "seed0" / "final" / "config.json").exists()
    logs = {p: p.stat().st_size for p in tmp_path.rglob("seed0.log")}
    bench.main(argv)
    assert {p: p.stat().st_size for p in tmp_path.rglob("seed0.log")} == logs, "finished runs are not rerun"
    _one_line_error(capsys, lambda: bench.main(["ablations", "--only", "nothing"]), "--only names none")
