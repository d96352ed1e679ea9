"""Against an OpenAI-compatible server that behaves like a small llama.cpp one (a stub on 127.0.0.1
in a thread): a prompt longer than its context is a 400, so the writer retries shorter and its
failures are counted; the judge's fallbacks reach the metrics; a dead endpoint stops every entry
point at once (exit 2); one that stops answering mid-run stops the run; and the actor's trimming
keeps the prompt's start stable so that the server's prefix cache holds."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import bench
import chat_api
import judge
import rime
from conftest import send_json
from rollout import WRITER_SYSTEM, Episode, writer_prompt

GOOD_JUDGE = json.dumps({"new_discoveries": 2, "error_correction": 0, "verification_targets": 1,
                         "non_redundant_change": 2})
MEMORY = "### Repository Knowledge\n- red potion: small\n- blue potion: pointy\n\n### Lessons & Pitfalls\n- a\n- b"
# llama-cpp-python's answer to a prompt longer than its context
OVERFLOW = {"error": {"message": "This model's maximum context length is 512 tokens. However, you requested "
                                 "2412 tokens (2412 in the messages, 0 in the completion). Please reduce the length "
                                 "of the messages or completion.", "type": "invalid_request_error",
                      "param": "messages", "code": "context_length_exceeded"}}


class Server:
    """A chat/completions stub. A request whose messages hold more than `context_chars` characters
    gets OVERFLOW (so does every writer request with overflow_writer=True); else the reply
    follows the system prompt: the actor answers `<action>end</action>`, the writer MEMORY, and a
    judge prompt gets `judge_reply`. `plan` answers the next requests first ("500" or "ok");
    response_format types in `refuse` get llama-cpp-python's 500 that names response_format. `requests` keeps
    (body, HTTP status) of each request."""

    def __init__(self, context_chars=10 ** 9, judge_reply=GOOD_JUDGE, overflow_writer=False, plan=(), refuse=()):
        self.context_chars, self.judge_reply, self.overflow_writer = context_chars, judge_reply, overflow_writer
        self.plan, self.refuse, self.requests = list(plan), set(refuse), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = server.answer(body)
                server.requests.append((body, status))
                send_json(self, status, reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, body):
        what = self.plan.pop(0) if self.plan else ""
        if what == "500":
            return 500, {"error": {"message": "stub failure", "type": "server_error"}}
        fmt = (body.get("response_format") or {}).get("type")
        if fmt in self.refuse:          # what llama-cpp-python's server answers (its validation error, as a 500)
            return 500, {"error": {"message": "1 validation error: {'type': 'literal_error', 'loc': ('body', "
                                              "'response_format', 'type'), 'msg': \"Input should be 'text' or "
                                              "'json_object'\"}", "type": "internal_server_error"}}
        messages = body["messages"]
        writer = messages[0]["content"] == WRITER_SYSTEM
        if sum(len(m["content"]) for m in messages) > self.context_chars or (writer and self.overflow_writer):
            return 400, OVERFLOW
        if writer:
            text = MEMORY
        elif "BEFORE:" in messages[0]["content"]:
            text = self.judge_reply
        else:
            text = "I try. <action>end</action>"
        return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def fresh_endpoint_memory(monkeypatch):
    # response formats and failure counts are remembered per process: each test starts clean
    monkeypatch.setattr(chat_api, "_FORMAT_RUNG", {})
    monkeypatch.setattr(chat_api, "_FAILURES", {})


def _dead_url():
    """A loopback port with nothing listening: a connection there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def _bench_argv(url, results, *extra):
    return ["--api", url, "--api-model", "m", "--stream-len", "2", "--attempts", "1", "--results", str(results),
            "--api-timeout", "5", "--api-retries", "0", "--task-retries", "1", "--backoff", "0.01", *extra]


def _episode(steps=60):
    obs = ["Task: make the stone large and pointy. " * 10] + [f"step {i}: the stone is small and round. " * 4
                                                             for i in range(steps)]
    return Episode(task=None, tokens=[], loss_mask=[], logprobs=[], score=0.5,
                   actions=[f"apply red to stone {i}" for i in range(steps)], observations=obs)


def _one_line_error(capsys, code, fn):
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err
    assert e.value.code == code and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- the writer

def test_writer_overflow_is_retried_shorter():
    ep = _episode()
    full = len(WRITER_SYSTEM) + len(writer_prompt(ep, "", 1200))
    half = len(WRITER_SYSTEM) + len(writer_prompt(bench._writer_view(ep, 600), "", 600))
    assert half < full / 2, "a halved budget must halve the prompt, whatever the episode's length"
    with Server(context_chars=(full + half) // 2) as srv:
        agent = bench.ApiAgent(srv.url, "m", timeout=5, retries=0, traj_chars=1200)
        assert agent.write(ep, "") == MEMORY
    sizes = [sum(len(m["content"]) for m in body["messages"]) for body, _ in srv.requests]
    assert [status for _, status in srv.requests] == [400, 200] and sizes[1] < sizes[0] / 2
    assert ep.info["context"] == ["writer: context full: trajectory cut to 600 chars"]


def test_writer_failures_are_counted_and_traj_chars_reaches_the_api_agent(tmp_path, capsys):
    with Server(overflow_writer=True) as srv:
        cells = bench.main(_bench_argv(srv.url, tmp_path, "--traj-chars", "400"))
    writes = [body for body, _ in srv.requests if body["messages"][0]["content"] == WRITER_SYSTEM]
    assert len(writes) == 2 * 3, "400 -> 200 -> 100 characters, then the writer gives up: 3 tries per task"
    c = cells[0]
    assert (c.counted, c.failed, c.writer_failed, c.writes) == (2, 0, 2, 2)
    out = capsys.readouterr().out
    assert "| 0 | 2/2 | measured here |" in out, "the table counts the writer's failures"
    assert "the writer failed on 2 of 2 tasks" in out and "maximum context length is 512" in out
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    memory_rows = [r for r in rows if r["mode"] == "memory"]
    assert all("maximum context length" in r["writer_error"] for r in memory_rows)
    assert memory_rows[0]["context"][-1] == "writer: context full: trajectory cut to 100 chars"
    assert {r["settings"]["traj_chars"] for r in rows} == {400}


# ----------------------------------------------------------------------------- the judge

def test_judge_fallbacks_are_counted_in_the_metrics():
    outs = [SimpleNamespace(memories=["", MEMORY, MEMORY], writes=[SimpleNamespace(memory=m)
                                                                   for m in (MEMORY, MEMORY, MEMORY + "\n- c")])]
    with Server(judge_reply='{"new_discoveries": 5}') as srv:
        metrics = rime.judge_memories(judge.LLMJudge(judge.openai_complete(srv.url, "m", retries=0)), outs)
    assert metrics == {"judge_calls": 2, "judge_fallback": 1.0}, "the unchanged memory needs no call"
    assert outs[0].explore == [0.0, 0.0, 0.0]
    with Server() as srv:
        metrics = rime.judge_memories(judge.LLMJudge(judge.openai_complete(srv.url, "m", retries=0)), outs)
    assert metrics == {"judge_calls": 2, "judge_fallback": 0.0} and outs[0].explore[0] == pytest.approx(5 / 8)
    assert rime.judge_memories(None, outs) == {"judge_calls": 0, "judge_fallback": 0.0} and outs[0].explore[0] is None


def test_judge_reask_fits_a_small_context_and_asks_for_the_schema():
    rubric = len(judge.RUBRIC.format(before="(empty)", after=MEMORY))
    long_bad = '{"score": "great"} ' + "x" * 5000      # quoting all of it would overflow
    with Server(context_chars=rubric + 600, judge_reply=long_bad) as srv:
        r = judge.LLMJudge(judge.openai_complete(srv.url, "m", retries=0)).score_parts("", MEMORY)
    assert r.fallback and r.attempts == 2 and "bad reply" in r.detail
    assert [status for _, status in srv.requests] == [200, 200], "the re-ask must fit where the first ask did"
    fmt = srv.requests[0][0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == judge.RUBRIC_SCHEMA


def test_the_judge_lands_on_a_format_the_server_takes_and_stays_there():
    """llama-cpp-python's server refuses OpenAI's json_schema but takes a schema in JSON mode."""
    with Server(refuse={"json_schema"}) as srv:
        j = judge.LLMJudge(judge.openai_complete(srv.url, "m", retries=0))
        assert j.score("", MEMORY) == pytest.approx(5 / 8) and j.score("", MEMORY + "\n- c") == pytest.approx(5 / 8)
    sent = [body["response_format"] for body, _ in srv.requests]
    assert [f["type"] for f in sent] == ["json_schema", "json_object", "json_object"]
    assert sent[1]["schema"] == sent[2]["schema"] == judge.RUBRIC_SCHEMA


def test_judge_eval_prints_the_fallback_rate_and_fails_when_every_call_fell_back(capsys):
    argv = ["--judge", "openai", "--url", "", "--api-model", "m", "--per-category", "1"]
    with Server(judge_reply="I rate it highly.") as srv:
        argv[3] = srv.url
        err = _one_line_error(capsys, 1, lambda: judge._eval_main(argv))
    assert "every call of openai fell back to 0" in err
    with Server() as srv:
        argv[3] = srv.url
        judge._eval_main(argv)
    out = capsys.readouterr().out
    assert "openai: 20 pairs" in out and "fallbacks 0/" in out and "| 0/" in out


# ----------------------------------------------------------------------------- total failure

def test_a_dead_endpoint_fails_fast_with_exit_2(tmp_path, capsys):
    dead, t0 = _dead_url(), time.time()
    err = _one_line_error(capsys, 2, lambda: bench.main(_bench_argv(dead, tmp_path / "b")))
    assert err.startswith(f"bench.py: error: --api {dead}: no answer from") and err.count("\n") == 1
    assert not (tmp_path / "b").exists(), "nothing is written before the endpoint answers"
    err = _one_line_error(capsys, 2, lambda: judge._eval_main(["--judge", "openai", "--url", dead, "--api-model", "m"]))
    assert err.startswith("judge.py eval: error: --url") and "no answer" in err
    err = _one_line_error(capsys, 2, lambda: rime.main(["--model", "tiny", "--judge", "openai", "--judge-url", dead,
                                                        "--judge-api-model", "m", "--run-dir", str(tmp_path / "r")]))
    assert err.startswith("rime.py: error: --judge-url") and "no answer" in err
    assert not (tmp_path / "r").exists()
    assert time.time() - t0 < 10, "a dead endpoint is one refused connection per entry point, not minutes of retries"


def test_an_endpoint_that_stops_answering_stops_the_run(tmp_path, capsys):
    with Server(plan=["ok"] + ["500"] * 100) as srv:    # answers the check, then fails every call
        err = _one_line_error(capsys, 2, lambda: bench.main(_bench_argv(srv.url, tmp_path, "--api-max-failures", "3")))
    assert len(srv.requests) == 1 + 3, "3 tries in a row without an answer stop the run"
    assert "stopped answering: 3 tries in a row failed" in err and "rows so far" in err
    rows = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["failed"], "the first task's two tries failed; then it stopped"
    assert "| api:m | alchemy | n/a | n/a | 0/2 | 1 |" in (tmp_path / "table.md").read_text()


# ----------------------------------------------------------------------------- long prompts

def test_trimming_drops_half_the_turns_and_keeps_a_stable_prefix():
    """A context of ~2,000 characters and 200-character observations: once full, the agent drops
    the older half of its turns in one block, so most turns extend the previous prompt (what the
    server's prefix cache reuses) instead of shifting it by one turn every time; replies keep
    their full length while there are turns to drop."""
    with Server(context_chars=2000) as srv:
        policy = bench.ApiAgent(srv.url, "m", timeout=5, retries=0).actor("")
        for i in range(30):
            assert policy(f"obs {i}: " + "the stone is small, round and blue. " * 5) == "end"
    sent = [body for body, status in srv.requests if status == 200]
    assert len(sent) == 30 and all(body["max_tokens"] == 512 for body, _ in srv.requests)
    extends = [b["messages"][:len(a["messages"])] == a["messages"] for a, b in zip(sent, sent[1:])]
    drops = [line for line in policy.context_log if "dropped" in line]
    assert len(drops) == extends.count(False) and 2 <= len(drops) <= 6, policy.context_log
    assert all(" of " in line and int(line.split("oldest ")[1].split()[0]) >= 2 for line in drops[1:])
    assert extends.count(True) >= 3 * len(drops), "the prompt's start stays the same for several turns"


def test_request_timeout_scales_with_the_prompt():
    messages = [{"role": "user", "content": "x" * 4000}]            # ~1,000 tokens
    assert chat_api.request_timeout(60.0, messages, 512, 0.05) == pytest.approx(60 + 0.05 * 1512)
    assert chat_api.request_timeout(60.0, messages, 512, 0.0) == 60.0
