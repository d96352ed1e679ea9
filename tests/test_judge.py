"""judge.py: heuristic ordering on fixed memory pairs, the LLM judge's parser and retry, and the
two completion backends (a local stub HTTP server, through chat_api.py's client; the tiny model
through generate)."""

import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import chat_api
import judge
from conftest import send_json
from judge import (DIMENSIONS, RETRY, ApiError, HeuristicJudge, LLMJudge, chat, local_complete,
                   openai_complete, parse_reply)

BEFORE = """### Repository Knowledge
- Run the tests with `pytest -x tests/`.
- The CSV exporter lives in `src/tablib/formats/_csv.py`.
- The default timeout is 10 seconds.
### Lessons & Pitfalls
- Read the failing test before editing.
- Keep patches small.
"""

PAIRS = {
    "no_change": BEFORE,
    "whitespace": "\n" + BEFORE.replace("\n", "\n\n").replace("- ", "-   "),
    "reordered": """### Lessons & Pitfalls
* Keep patches small.
* Read the failing test before editing.
### Repository Knowledge
* The default timeout is 10 seconds.
* The CSV exporter lives in `src/tablib/formats/_csv.py`.
* Run the tests with `pytest -x tests/`.
""",
    "paraphrase": """### Repository Knowledge
- Tests are run using `pytest -x tests/`.
- `src/tablib/formats/_csv.py` holds the CSV exporter.
- By default the timeout is 10 seconds.
### Lessons & Pitfalls
- Before editing, read the failing test first.
- Patches should be kept small, and the tests should always be read carefully.
""",
    "vague": BEFORE + "- Be careful with edge cases and always double-check your work.\n",
    "vague_finding": BEFORE + "- The exporter sometimes has problems with headers.\n",
    "specific": BEFORE + "- `Dataset.export('csv')` drops the header row when `headers=None`; "
                         "the bug is in `_csv.py` line 42.\n",
    "corrected": BEFORE.replace("- The default timeout is 10 seconds.",
                                "- The default timeout is 30 seconds (not 10).\n"),
    "wipe": "### Repository Knowledge\n- Nothing yet.\n- TBD.\n"
            "### Lessons & Pitfalls\n- Try harder.\n- Be careful.\n",
    "empty": "",
}


@pytest.fixture(scope="module")
def heuristic():
    j = HeuristicJudge()
    return {k: j.score_parts(BEFORE, a) for k, a in PAIRS.items()}


def test_heuristic_zero_cases(heuristic):
    for k in ("no_change", "whitespace", "reordered", "paraphrase", "vague", "vague_finding",
              "wipe", "empty"):
        assert heuristic[k].score == 0.0, (k, heuristic[k])


def test_heuristic_ordering(heuristic):
    assert heuristic["specific"].score > heuristic["vague_finding"].score
    assert heuristic["specific"].score > heuristic["vague"].score
    assert heuristic["specific"].new_discoveries >= 1
    assert heuristic["specific"].verification_targets == 2      # 4 new checkable tokens
    assert heuristic["corrected"].score > 0.0
    assert heuristic["corrected"].error_correction >= 1
    assert heuristic["wipe"].detail.startswith("wiped prior knowledge")
    for r in heuristic.values():
        assert 0.0 <= r.score <= 1.0
        assert r.score == sum(getattr(r, d) for d in DIMENSIONS) / 8


def test_heuristic_more_cases():
    j = HeuristicJudge()
    # the first memory of a stream: specifics from nothing are discoveries; generic text is not
    first = "### Repository Knowledge\n- `tox -e py311` runs the suite.\n"
    assert j.score("", first) > 0.0
    assert j.score("", "### Lessons & Pitfalls\n- Think step by step.\n- Be careful.\n") == 0.0
    # padding next to a real finding lowers non_redundant_change below a clean finding
    clean = BEFORE + "- `retry()` ignores `stop_after_attempt(3)` when `reraise=True`.\n"
    padded = clean + "- Always be careful.\n- Testing is important.\n"
    assert j.score_parts(BEFORE, clean).non_redundant_change == 2
    assert j.score_parts(BEFORE, padded).non_redundant_change == 1
    assert j.score(BEFORE, clean) > j.score(BEFORE, padded)
    # a correction where a prior command was wrong (a cue word and a changed value)
    fixed = BEFORE.replace("- Run the tests with `pytest -x tests/`.",
                           "- Run the tests with `python -m pytest tests/test_core.py`; "
                           "plain `pytest` fails with an import error.")
    assert j.score_parts(BEFORE, fixed).error_correction >= 1
    # repeating the same number in a longer sentence is not a discovery ("10" is not new)
    assert j.score(BEFORE, BEFORE + "- Remember the timeout: 10 seconds by default.\n") == 0.0
    # deterministic
    assert j.score_parts(BEFORE, padded) == j.score_parts(BEFORE, padded)


# ---------------------------------------------------------------------------------------------
# LLM judge: parser, retry, fallback


def _scripted(replies):
    """A complete() that returns the given replies in turn and records the prompts it saw."""
    seen = []

    def complete(prompt):
        seen.append(prompt)
        r = replies[len(seen) - 1]
        if isinstance(r, Exception):
            raise r
        return r

    return complete, seen


GOOD_REPLY = json.dumps({"new_discoveries": 2, "error_correction": 0,
                         "verification_targets": 1, "non_redundant_change": 2})


def test_llm_judge_valid_reply():
    complete, seen = _scripted([GOOD_REPLY])
    r = LLMJudge(complete).score_parts(BEFORE, PAIRS["specific"])
    assert r.score == pytest.approx(5 / 8) and r.attempts == 1 and not r.fallback
    assert (r.new_discoveries, r.verification_targets) == (2, 1)
    assert len(seen) == 1 and "BEFORE:" in seen[0] and "`headers=None`" in seen[0]
    fenced = "```json\n" + GOOD_REPLY + "\n```"
    assert LLMJudge(_scripted([fenced])[0]).score(BEFORE, "x") == pytest.approx(5 / 8)


def test_llm_judge_no_change_skips_the_call():
    complete, seen = _scripted([])
    assert LLMJudge(complete).score(BEFORE, BEFORE + "\n  \n") == 0.0
    assert seen == []


def test_llm_judge_retry_then_success():
    complete, seen = _scripted(["I think this is pretty good!", GOOD_REPLY])
    r = LLMJudge(complete).score_parts(BEFORE, PAIRS["specific"])
    assert r.attempts == 2 and r.score == pytest.approx(5 / 8)
    assert len(seen) == 2
    assert "I think this is pretty good!" in seen[1] and RETRY.split(":")[0] in seen[1]


def _dims(**kw):
    d = {"new_discoveries": 1, "error_correction": 0, "verification_targets": 0,
         "non_redundant_change": 0}
    return json.dumps({**d, **kw})


@pytest.mark.parametrize("garbage", [
    "", "{", "null", "[1, 2]", '{"new_discoveries": 1}', _dims(new_discoveries=3),
    _dims(error_correction=-1), _dims(verification_targets=True), _dims(new_discoveries="two"),
    _dims(non_redundant_change=1.5), _dims(new_discoveries="1/3"), _dims(new_discoveries=[1, 2]),
    _dims(new_discoveries="4/8"), _dims(new_discoveries=[True]), "[{}, {}]", "\x00\xff" * 50, None, 42, "[" * 100_000,
    "{" + "[" * 100_000 + "}",
])
def test_llm_judge_garbage_scores_zero(garbage, caplog):
    with pytest.raises(ValueError):
        parse_reply(garbage)
    complete, seen = _scripted([garbage, garbage])
    with caplog.at_level("WARNING", logger="judge"):
        r = LLMJudge(complete).score_parts(BEFORE, PAIRS["specific"])
    assert r.score == 0.0 and r.fallback and r.attempts == 2 and len(seen) == 2
    assert "fell back to score 0" in caplog.text


def test_llm_judge_backend_error_scores_zero():
    complete, seen = _scripted([RuntimeError("server down"), TimeoutError("slow")])
    r = LLMJudge(complete).score_parts(BEFORE, "new")
    assert r.score == 0.0 and r.fallback and "backend error" in r.detail and len(seen) == 2


def test_parse_reply_accepts_harmless_shapes():
    # what small models write around a valid answer: [2], "2", "2/2" (of 2), a list of one object
    reply = ('{"new_discoveries": [2], "error_correction": "0", "verification_targets": "2/2", '
             '"non_redundant_change": " 1 "}')
    want = {"new_discoveries": 2, "error_correction": 0, "verification_targets": 2,
            "non_redundant_change": 1}
    assert parse_reply(reply) == want
    assert parse_reply("[" + reply + "]") == want
    assert LLMJudge(_scripted(["[" + reply + "]"])[0]).score(BEFORE, "x") == pytest.approx(5 / 8)


def test_parse_reply_accepts_integral_floats_and_extra_keys():
    reply = ('Here you go: {"new_discoveries": 1.0, "error_correction": 2, '
             '"verification_targets": 0, "non_redundant_change": 1, "why": "ok"}')
    assert parse_reply(reply) == {"new_discoveries": 1, "error_correction": 2,
                                  "verification_targets": 0, "non_redundant_change": 1}


# ---------------------------------------------------------------------------------------------
# openai_complete against a stub server on 127.0.0.1


class _Stub:
    """A chat/completions server that answers from a script: ("ok", text) | ("status", code) |
    ("sleep", seconds) | ("error", code, body: a JSON-able error body) | ("no_json_mode", text):
    a 400 naming response_format if the request asks for it, else text. Records each request's
    path, headers and JSON body."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, dict(self.headers), body))
                kind, arg, *rest = stub.script.pop(0) if stub.script else ("status", 500)
                try:
                    if kind == "no_json_mode" and "response_format" in body:
                        kind, arg, rest = "error", 400, [{"error": {
                            "message": "response_format: json_object is not supported by this server",
                            "type": "invalid_request_error", "param": "response_format", "code": None}}]
                    if kind == "error":
                        send_json(self, arg, rest[0])
                        return
                    if kind == "sleep":
                        time.sleep(arg)
                        kind, arg = "ok", "late"
                    if kind == "status":
                        self.send_response(arg)
                        self.end_headers()
                        self.wfile.write(b'{"error": "stub"}')
                        return
                    send_json(self, 200, {"choices": [{"message": {"role": "assistant", "content": arg}}]})
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client gave up (timeout test)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def fresh_json_mode_memory(monkeypatch):
    # which response formats an endpoint refused, and its failures in a row, are remembered per
    # process: each test starts clean
    monkeypatch.setattr(chat_api, "_FORMAT_RUNG", {})
    monkeypatch.setattr(chat_api, "_FAILURES", {})


def test_openai_complete_success(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    with _Stub([("ok", "hello")]) as stub:
        complete = openai_complete(stub.url + "/", "judge-model", api_key_env="JUDGE_TEST_KEY",
                                   timeout=5, retries=0)
        assert complete("hi there") == "hello"
    path, headers, body = stub.requests[0]
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": "hi there"}]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {     # the judge sends its rubric
        "name": "reply", "strict": True, "schema": judge.RUBRIC_SCHEMA}}


def test_openai_complete_retries_500_then_succeeds(monkeypatch):
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    with _Stub([("status", 500), ("ok", GOOD_REPLY), ("status", 429), ("ok", GOOD_REPLY)]) as stub:
        complete = openai_complete(stub.url, "m", api_key_env="JUDGE_TEST_KEY", timeout=5,
                                   retries=2, backoff=0.01)
        assert complete("hi") == GOOD_REPLY
        assert len(stub.requests) == 2                          # the 500 was retried
        assert LLMJudge(complete).score(BEFORE, PAIRS["specific"]) == pytest.approx(5 / 8)
        assert len(stub.requests) == 4                          # 429 too, inside one judge call
    assert "Authorization" not in stub.requests[0][1]          # no key set: no header


def test_openai_complete_timeout_and_4xx():
    with _Stub([("sleep", 1.0), ("sleep", 1.0)]) as stub:
        complete = openai_complete(stub.url, "m", timeout=0.2, retries=1, backoff=0.01, timeout_per_token=0)
        with pytest.raises(RuntimeError, match="gave up after 2 tries"):   # each try timed out
            complete("hi")
        assert len(stub.requests) == 2
    with _Stub([("status", 400), ("ok", "never")]) as stub:
        complete = openai_complete(stub.url, "m", timeout=5, retries=3, backoff=0.01,
                                   json_mode=False)
        with pytest.raises(RuntimeError, match="HTTP 400"):
            complete("hi")
        assert len(stub.requests) == 1                          # client errors are not retried
        # through the judge, a dead backend is a logged 0, not an exception
        stub.script = [("status", 503), ("status", 503)]
        dead = openai_complete(stub.url, "m", timeout=5, retries=0)
        assert LLMJudge(dead).score_parts(BEFORE, "x").fallback


# ---------------------------------------------------------------------------------------------
# local_complete: chat template + greedy generate


def test_local_complete_wiring(monkeypatch):
    calls = []

    class Tok:
        eos_token_id, unk_token_id = 0, None

        def convert_tokens_to_ids(self, t):
            return 7 if t == "<|im_end|>" else None

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<user>" + messages[0]["content"] + "<assistant>"

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

        def decode(self, ids, skip_special_tokens):
            return "".join(chr(i) for i in ids if i not in (0, 7))

    def fake_generate(model, prompts, max_new_tokens, temperature=1.0, stop_token_ids=(), **kw):
        calls.append((prompts, max_new_tokens, temperature, stop_token_ids))
        return [types.SimpleNamespace(tokens=[ord(c) for c in "{}"] + [7], logprobs=[0.0] * 3,
                                      finish_reason="stop")]

    monkeypatch.setitem(sys.modules, "generate", types.SimpleNamespace(generate=fake_generate))
    complete = local_complete("the-model", Tok(), max_new_tokens=33)
    assert complete("grade") == "{}"
    prompts, max_new, temp, stop = calls[0]
    assert prompts == [[ord(c) for c in "<user>grade<assistant>"]]
    assert (max_new, temp, stop) == (33, 0.0, (0, 7))


def test_local_complete_tiny_model():
    # the real path: tiny random model + offline tokenizer; its reply is garbage -> logged 0
    from model import tiny
    model, tokenizer = tiny(arch="llama", seed=0)   # SmolLM2's family; the fastest prefill on CPU
    complete = local_complete(model, tokenizer, max_new_tokens=4)
    out = complete("Reply with JSON.")
    assert isinstance(out, str)
    assert complete("Reply with JSON.") == out                   # greedy: deterministic
    r = LLMJudge(complete).score_parts(BEFORE, PAIRS["specific"])
    assert r.score == 0.0 and r.fallback and r.attempts == 2


# ---------------------------------------------------------------------------------------------
# chat(): the server's own error message, context overflow, JSON mode fallback

OPENAI_OVERFLOW = {"error": {
    "message": "This model's maximum context length is 2048 tokens. However, you requested 2300 "
               "tokens (1788 in the messages, 512 in the completion). Please reduce the length of "
               "the messages or completion.",
    "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
LLAMACPP_OVERFLOW = {"error": {
    "code": 400, "message": "request (4476 tokens) exceeds the available context size (4096 tokens)",
    "type": "exceed_context_size_error", "n_prompt_tokens": 4476, "n_ctx": 4096}}
VLLM_OVERFLOW = {"object": "error", "message": "This model's maximum context length is 4096 tokens. "
                 "However, you requested 5000 tokens in the messages.", "type": "BadRequestError",
                 "param": None, "code": 400}
NOT_FOUND = {"error": {"message": "The model `gpt-9` does not exist", "type": "invalid_request_error",
                       "param": None, "code": "model_not_found"}}


@pytest.mark.parametrize("body,overflow,text", [
    (OPENAI_OVERFLOW, True, "maximum context length is 2048 tokens"),
    (LLAMACPP_OVERFLOW, True, "exceeds the available context size (4096 tokens)"),
    (VLLM_OVERFLOW, True, "maximum context length is 4096 tokens"),
    (NOT_FOUND, False, "The model `gpt-9` does not exist"),
])
def test_chat_keeps_the_server_message(body, overflow, text):
    with _Stub([("error", 400, body), ("ok", "never")]) as stub:
        with pytest.raises(ApiError) as e:
            chat(stub.url, "m", [{"role": "user", "content": "hi"}], timeout=5, retries=3,
                 backoff=0.01)
        assert len(stub.requests) == 1                             # a 4xx is not retried
    assert text in str(e.value) and text in e.value.message and "HTTP 400" in str(e.value)
    assert e.value.status == 400 and e.value.context_overflow is overflow


def test_chat_overflow_on_a_5xx_is_not_retried_and_the_last_error_is_kept():
    # some llama.cpp versions answer an overflow with a 500: retrying cannot help
    with _Stub([("error", 500, LLAMACPP_OVERFLOW), ("ok", "never")]) as stub:
        with pytest.raises(ApiError) as e:
            chat(stub.url, "m", [{"role": "user", "content": "hi"}], timeout=5, retries=3,
                 backoff=0.01)
        assert len(stub.requests) == 1 and e.value.context_overflow and e.value.status == 500
    busy = {"error": {"message": "server is busy", "type": "server_error", "code": 503}}
    with _Stub([("error", 503, busy), ("error", 503, busy)]) as stub:
        with pytest.raises(ApiError, match="gave up after 2 tries.*server is busy") as e:
            chat(stub.url, "m", [{"role": "user", "content": "hi"}], timeout=5, retries=1,
                 backoff=0.01)
        assert e.value.status == 503 and e.value.message == "server is busy"
        assert not e.value.context_overflow


def test_chat_overflow_in_json_mode_is_not_retried_without_it():
    # an overflow is not a refusal of JSON mode: asking again without it would overflow again
    with _Stub([("error", 400, OPENAI_OVERFLOW), ("ok", "never")]) as stub:
        with pytest.raises(ApiError) as e:
            chat(stub.url, "m", [{"role": "user", "content": "hi"}], timeout=5, json_mode=True)
        assert len(stub.requests) == 1 and e.value.context_overflow


def test_chat_drops_json_mode_for_a_server_that_refuses_it():
    reply = json.dumps({"new_discoveries": 1, "error_correction": 0, "verification_targets": 1,
                        "non_redundant_change": 2})
    with _Stub([("no_json_mode", reply)] * 5) as stub:
        complete = openai_complete(stub.url, "m", timeout=5, retries=0)
        assert complete("grade") == reply           # schema, schema in JSON mode, JSON mode refused: none
        assert complete("grade") == reply                          # remembered: asked without at once
    sent = [body.get("response_format", {}).get("type") for _, _, body in stub.requests]
    assert sent == ["json_schema", "json_object", "json_object", None, None]
    assert "schema" in stub.requests[1][2]["response_format"] and "schema" not in stub.requests[2][2]["response_format"]
    # any other 4xx on the first try with a response format counts as a refusal too (e.g. a 422)
    with _Stub([("error", 422, {"detail": "extra fields not permitted"}), ("ok", reply)]) as stub:
        assert LLMJudge(openai_complete(stub.url, "m2", timeout=5, retries=0)).score(
            BEFORE, "x") == pytest.approx(4 / 8)
        assert [b["response_format"]["type"] for _, _, b in stub.requests] == ["json_schema", "json_object"]


def test_judge_over_http_accepts_harmless_shapes(caplog):
    # the small model behind a llama.cpp server writes [2] and "2/2"; a prose reply falls back
    shaped = '{"new_discoveries": [2], "error_correction": [0], "verification_targets": "2/2", ' \
             '"non_redundant_change": "2"}'
    with _Stub([("ok", shaped), ("ok", "[2]"), ("ok", "I rate it 2.")]) as stub:
        j = LLMJudge(openai_complete(stub.url, "m", timeout=5, retries=0))
        assert j.score(BEFORE, PAIRS["specific"]) == pytest.approx(6 / 8)
        with caplog.at_level("WARNING", logger="judge"):
            r = j.score_parts(BEFORE, PAIRS["specific"])
        assert r.fallback and r.score == 0.0 and "fell back" in caplog.text


def test_eval_agreement_over_an_endpoint(capsys):
    # python judge.py eval --judge openai: the code path the README's figure comes from
    pairs = judge.load_pairs()[:3]
    reply = json.dumps({"new_discoveries": 2, "error_correction": 0, "verification_targets": 0,
                        "non_redundant_change": 0})
    with _Stub([("ok", reply)] * 6) as stub:
        a = judge.agreement(LLMJudge(openai_complete(stub.url, "m", timeout=5, retries=0)),
                            pairs, "openai")
    assert a.n == 3 and a.fallbacks == 0 and all(s == pytest.approx(2 / 8) for _, s in a.scores)
    print(judge.agreement_table([a]))
    assert "| openai | 3 |" in capsys.readouterr().out


def test_eval_cli_prints_the_agreement_table(capsys):
    judge._eval_main(["--judge", "heuristic", "--per-category", "1"])
    out = capsys.readouterr().out
    assert "| heuristic | 20 | 1.00 (0.15) |" in out                # 10 categories x 2 domains
    assert "| cheap | status | 2 |" in out


def test_eval_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"label": "maybe"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: not a labelled pair"):
        judge._eval_main(["--data", str(bad)])
    with pytest.raises(SystemExit, match="needs --url and --api-model"):
        judge._eval_main(["--judge", "openai"])


# ---------------------------------------------------------------------------------------------
# heuristic rules, one at a time (the labelled set in tests/test_judge_labels.py tests them together)

ALCH = """### Repository Knowledge
- Potion red makes a stone pointy.
- Potion yellow makes a stone small.
### Lessons & Pitfalls
- Try each unknown potion colour once.
- Last task alchemy/w00/t04: score 0.61.
"""


@pytest.mark.parametrize("line,kind", [
    ("- Last task alchemy/w00/t05: score 0.90.", "status"),
    ("- Progress: 4/6 tasks resolved, mean reward 0.71.", "status"),
    ("- Keep patches small and simple.", "generic"),              # "small" is English here
    ("- Blocked: small purple round <-> small purple round <-> small purple round.", "repetition"),
    ("- zx_91 qq.vv lorp_3 mmk.k --frob", "stuffing"),
    ("- Known: red green orange cyan yellow pink.", "stuffing"),
    ("- Potion green makes a stone round.", ""),
    ("- Blocked: small blue round <-> small purple round.", ""),
])
def test_heuristic_line_shapes(line, kind):
    assert judge._measure(line).cheap == kind


def test_heuristic_bookkeeping_and_negation():
    j = HeuristicJudge()
    seen = ALCH.replace("pointy.", "pointy (seen in task t04).")
    assert j.score(seen, seen.replace("t04", "t05")) == 0.0         # a new task id is no new fact
    # the same words negated are not a paraphrase: a correction of the old fact
    neg = ALCH.replace("- Potion red makes a stone pointy.",
                       "- Potion red does not make a stone pointy: it makes it round.")
    assert j.score_parts(ALCH, neg).error_correction == 1
    # a correction that keeps the old value in view ("not 10") still needs its cue
    assert j.score_parts(BEFORE, PAIRS["corrected"]).error_correction == 1


def test_heuristic_world_terms_match_alchemy():
    from alchemy import COLOURS, FEATURES
    assert judge.WORLD_TERMS == set(COLOURS) | {w for pair in FEATURES for w in pair}
