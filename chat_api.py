"""The HTTP client for OpenAI-compatible chat endpoints (OpenAI, vLLM, llama.cpp's server), stdlib only.

    check_endpoint("http://127.0.0.1:8000/v1", "model-name")     # once, before any work
    text = chat("http://127.0.0.1:8000/v1", "model-name", [{"role": "user", "content": "hi"}])

`chat` posts one chat/completions request and returns the reply text, retrying what a retry can
fix (timeouts, connection errors, 429 and 5xx, malformed replies) and raising `ApiError` with the
server's own message for what it cannot (other 4xx, a request that outgrew the model's context).
judge.py's `openai_complete` (the LLM judge over HTTP) and bench.py's API agent use it; judge.py
re-exports `chat` and `ApiError`. It imports no other module of the project.

Failing loudly rather than slowly: `check_endpoint` sends one tiny request (no retry), so an
entry point can stop with one line before it loads anything; and a URL whose last `down_after`
tries in a row all failed for want of an answer (no connection, a timeout, a 5xx, a malformed
reply; any 4xx shows the server is alive and resets the count) raises `EndpointDown` at once,
which the callers that otherwise turn an ApiError into a failed row or a fallback let through.

Structured replies: `json_schema=` asks the server to follow a JSON schema. Servers differ in what
they accept, so the request steps down a ladder of response formats, on a refusal, until one is
accepted, and remembers per endpoint where it landed: OpenAI's `json_schema` (OpenAI, vLLM,
llama.cpp's server), `json_object` with a `schema` (llama-cpp-python's server, which refuses the
first with an HTTP 500 that names response_format), plain JSON mode (forces JSON, not the keys),
then no response_format at all.

Timeouts scale with the request: a CPU server reads a long prompt for tens of seconds, and a
request abandoned at a fixed timeout keeps the server busy while its retry queues behind it.
"""

import json
import logging
import os
import re
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

# what servers say when a request outgrows the model's context: OpenAI and llama-cpp-python
# ("This model's maximum context length is 2048 tokens ...", code context_length_exceeded),
# vLLM (the same "maximum context length" text), llama.cpp's server ("request (4476 tokens)
# exceeds the available context size (4096 tokens)", type exceed_context_size_error)
_OVERFLOW_CODES = {"context_length_exceeded", "exceed_context_size_error", "context_window_exceeded"}
_OVERFLOW_TEXT = re.compile(r"context[ _](?:length|size|window)|maximum context|too many tokens|"
                            r"(?:prompt|input) is too long", re.I)
# a refusal that names the structured-output request (else only a 4xx on a call's first try is one)
_FORMAT_TEXT = re.compile(r"response_format|json_schema|json_object|schema", re.I)
CHARS_PER_TOKEN = 4          # a rough, tokenizer-free estimate of a prompt's tokens (English text)


class ApiError(RuntimeError):
    """An OpenAI-compatible endpoint failed for good (after its retries, or a 4xx at once).

    str(e) is the whole reason, with the server's own message when it sent one. Attributes:
    status (the HTTP code, None for a network failure), message (the server's error message,
    "" if none) and context_overflow (True when the server said the request outgrew the model's
    context: the caller should shorten the conversation or end the episode, not retry)."""

    def __init__(self, reason, status=None, message="", context_overflow=False):
        super().__init__(reason)
        self.status, self.message, self.context_overflow = status, message, context_overflow


class EndpointDown(ApiError):
    """The endpoint stopped answering: `down_after` tries in a row failed without an answer.
    Not a failure of one request: whoever runs many of them should stop, not go on failing."""


def _server_error(raw: bytes):
    """An error body -> (message, code-or-type). OpenAI, vLLM and llama.cpp put it in
    {"error": {"message", "code", "type"}}; older vLLM at the top level; else the body as text."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:500], ""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, str):
        return err[:500], ""
    if not isinstance(err, dict):
        return text[:500], ""
    message = err.get("message") or err.get("detail") or text
    codes = [str(err.get(k)) for k in ("code", "type") if err.get(k) is not None]
    return str(message)[:500], ",".join(codes)


def _body(e):
    try:
        return e.read()
    except OSError:                   # the connection closed before the body came
        return b""


def response_formats(json_schema=None, json_mode=False) -> list:
    """The ladder of response_format values a request tries, best first; None = leave it out."""
    ladder = []
    if json_schema is not None:
        ladder += [{"type": "json_schema", "json_schema": {"name": "reply", "strict": True,
                                                           "schema": json_schema}},
                   {"type": "json_object", "schema": json_schema}]
    if json_schema is not None or json_mode:
        ladder.append({"type": "json_object"})
    return ladder + [None]


def request_timeout(timeout, messages, max_tokens, per_token) -> float:
    """`timeout` plus `per_token` seconds for each token the server reads (estimated from the
    characters) and may write."""
    chars = sum(len(str(m.get("content", ""))) for m in messages)
    return timeout + per_token * (chars / CHARS_PER_TOKEN + max_tokens)


# endpoints (url, model) -> the rung of a response-format ladder they accepted after refusing the
# ones above it; later calls start there
_FORMAT_RUNG: dict = {}
# url -> tries in a row that got no answer (see EndpointDown)
_FAILURES: dict = {}


def chat(url, model, messages, *, key_env="OPENAI_API_KEY", timeout=60.0, timeout_per_token=0.0,
         retries=3, backoff=1.0, max_tokens=512, temperature=0.0, json_mode=False, json_schema=None,
         down_after=8) -> str:
    """POST {url}/chat/completions -> the reply text. Raises ApiError (EndpointDown when the
    endpoint stopped answering).

    Timeouts, connection errors, 429/5xx and malformed replies are retried after
    backoff * 2^i s; other 4xx fail at once, with the server's message, and so does a context
    overflow whatever its status (`context_overflow` set: the same request would fail again).
    Each try waits request_timeout(timeout, messages, max_tokens, timeout_per_token) seconds.
    json_mode=True asks for `response_format: {"type": "json_object"}`, json_schema= for replies
    that follow that schema (the ladder of response_formats). When the server refuses a
    response_format (an error that names it, whatever its status, or any other 4xx than a context
    overflow on the call's first try), the same try is sent again with the next rung, and once a lower rung works the
    endpoint (url, model) starts there in later calls of this process. After `down_after` tries
    in a row at this URL (over all calls) failed with no answer, EndpointDown is raised."""
    url = url.rstrip("/")
    url += "" if url.endswith("/chat/completions") else "/chat/completions"
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens,
               "temperature": temperature}
    headers = {"Content-Type": "application/json"}
    if os.environ.get(key_env):
        headers["Authorization"] = f"Bearer {os.environ[key_env]}"
    endpoint = (url, model)
    ladder = response_formats(json_schema, json_mode)
    start = rung = min(_FORMAT_RUNG.get(endpoint, 0), len(ladder) - 1)
    wait = request_timeout(timeout, messages, max_tokens, timeout_per_token)
    error, status, message = "", None, ""
    i = 0
    while i <= retries:
        if i:
            time.sleep(backoff * 2 ** (i - 1))
        fmt = ladder[rung]
        body = payload if fmt is None else dict(payload, response_format=fmt)
        try:
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
            with urllib.request.urlopen(req, timeout=wait) as resp:
                text = json.loads(resp.read().decode())["choices"][0]["message"]["content"] or ""
            _FAILURES[url] = 0
            if rung > start:           # the rungs above were refused: do not ask this endpoint again
                _FORMAT_RUNG[endpoint] = rung
            return text
        except urllib.error.HTTPError as e:  # before URLError: it is one
            message, code = _server_error(_body(e))
            status, error = e.code, f"HTTP {e.code}: {message}" + (f" [{code}]" if code else "")
            overflow = bool(set(code.split(",")) & _OVERFLOW_CODES or _OVERFLOW_TEXT.search(message))
            client_error = e.code != 429 and e.code < 500
            # llama-cpp-python refuses a response_format it does not know with a 500 that names it
            if fmt is not None and not overflow and (_FORMAT_TEXT.search(message) or client_error and i == 0):
                _FAILURES[url] = 0     # the server answered: it is up
                log.warning("%s refused response_format %s (%s); asking with %s", url,
                            fmt["type"], error, (ladder[rung + 1] or {}).get("type", "none"))
                rung += 1
                continue                 # the same try again, one rung down
            if overflow or client_error:
                _FAILURES[url] = 0
                raise ApiError(f"{error} from {url} (not retried)", status=e.code,
                               message=message, context_overflow=overflow) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            status, message, error = None, "", f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, IndexError, TypeError) as e:  # JSONDecodeError is a ValueError
            status, message, error = None, "", f"malformed reply: {e!r}"
        if status != 429:              # a rate limit is an answer, and says to wait
            _FAILURES[url] = _FAILURES.get(url, 0) + 1
        if _FAILURES.get(url, 0) >= down_after:
            raise EndpointDown(f"{url} stopped answering: {_FAILURES[url]} tries in a row failed; "
                               f"last error: {error}", status=status, message=message)
        log.warning("chat try %d/%d failed: %s", i + 1, retries + 1, error)
        i += 1
    raise ApiError(f"gave up after {retries + 1} tries ({url}); last error: {error}",
                   status=status, message=message)


def check_endpoint(url, model, *, key_env="OPENAI_API_KEY", timeout=60.0) -> None:
    """One tiny request (no retry) before any work: raises ApiError with the reason when the
    endpoint cannot serve `model` (nothing listening, a wrong URL or key, a server error)."""
    try:
        chat(url, model, [{"role": "user", "content": "Reply with OK."}], key_env=key_env,
             timeout=timeout, retries=0, max_tokens=1, down_after=1)
    except EndpointDown as e:          # one failed try is all the check makes: say it plainly
        raise ApiError(f"no answer from {url}: {str(e).split('last error: ')[-1]}",
                       status=e.status, message=e.message) from None
    except ApiError as e:
        if e.context_overflow:         # it answered, about a prompt of a few tokens: it is up
            return
        raise
