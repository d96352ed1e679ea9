"""The HTTP client for OpenAI-compatible chat endpoints (OpenAI, vLLM, llama.cpp's server), stdlib only.

    text = chat("http://127.0.0.1:8000/v1", "model-name", [{"role": "user", "content": "hi"}])

`chat` posts one chat/completions request and returns the reply text, retrying what a retry can
fix (timeouts, connection errors, 429 and 5xx, malformed replies) and raising `ApiError` with the
server's own message for what it cannot (other 4xx, a request that outgrew the model's context).
judge.py's `openai_complete` (the LLM judge over HTTP) and bench.py's API agent use it; judge.py
re-exports `chat` and `ApiError`. It imports no other module of the project.
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


class ApiError(RuntimeError):
    """An OpenAI-compatible endpoint failed for good (after its retries, or a 4xx at once).

    str(e) is the whole reason, with the server's own message when it sent one. Attributes:
    status (the HTTP code, None for a network failure), message (the server's error message,
    "" if none) and context_overflow (True when the server said the request outgrew the model's
    context: the caller should shorten the conversation or end the episode, not retry)."""

    def __init__(self, reason, status=None, message="", context_overflow=False):
        super().__init__(reason)
        self.status, self.message, self.context_overflow = status, message, context_overflow


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


# endpoints (url, model) that refused response_format: later calls leave it out at once
_NO_JSON_MODE: set = set()


def chat(url, model, messages, *, key_env="OPENAI_API_KEY", timeout=60.0, retries=3, backoff=1.0,
         max_tokens=512, temperature=0.0, json_mode=False) -> str:
    """POST {url}/chat/completions -> the reply text. Raises ApiError.

    Timeouts, connection errors, 429/5xx and malformed replies are retried after
    backoff * 2^i s; other 4xx fail at once, with the server's message, and so does a context
    overflow whatever its status (`context_overflow` set: the same request would fail again). json_mode=True asks for
    `response_format: {"type": "json_object"}` (OpenAI, vLLM and llama.cpp accept it); when the
    server refuses it (a 400 that names response_format, or any other 4xx than a context overflow
    on the first try with it), the request is sent again without it, and once that works the
    endpoint (url, model) is not asked for JSON mode again in this process."""
    url = url.rstrip("/")
    url += "" if url.endswith("/chat/completions") else "/chat/completions"
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens,
               "temperature": temperature}
    headers = {"Content-Type": "application/json"}
    if os.environ.get(key_env):
        headers["Authorization"] = f"Bearer {os.environ[key_env]}"
    endpoint = (url, model)
    use_json = json_mode and endpoint not in _NO_JSON_MODE
    dropped_json = False       # this call left response_format out after a refusal
    error, status, message = "", None, ""
    i = 0
    while i <= retries:
        if i:
            time.sleep(backoff * 2 ** (i - 1))
        body = dict(payload, response_format={"type": "json_object"}) if use_json else payload
        try:
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                text = json.loads(resp.read().decode())["choices"][0]["message"]["content"] or ""
            if dropped_json:       # it worked without: do not ask this endpoint again
                _NO_JSON_MODE.add(endpoint)
            return text
        except urllib.error.HTTPError as e:  # before URLError: it is one
            message, code = _server_error(_body(e))
            status, error = e.code, f"HTTP {e.code}: {message}" + (f" [{code}]" if code else "")
            overflow = bool(set(code.split(",")) & _OVERFLOW_CODES or _OVERFLOW_TEXT.search(message))
            if overflow or (e.code != 429 and e.code < 500):
                if use_json and not overflow and (
                        i == 0 or e.code == 400 and "response_format" in message):
                    log.warning("%s refused JSON mode (%s); asking without it", url, error)
                    use_json, dropped_json = False, True
                    continue             # the same try again, without response_format
                raise ApiError(f"{error} from {url} (not retried)", status=e.code,
                               message=message, context_overflow=overflow) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            status, message, error = None, "", f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, IndexError, TypeError) as e:  # JSONDecodeError is a ValueError
            status, message, error = None, "", f"malformed reply: {e!r}"
        log.warning("chat try %d/%d failed: %s", i + 1, retries + 1, error)
        i += 1
    raise ApiError(f"gave up after {retries + 1} tries ({url}); last error: {error}",
                   status=status, message=message)
