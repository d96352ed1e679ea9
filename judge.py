"""The exploration judge: how much did the memory learn on this task?

RIME (../shared/DESIGN.md, "Exploration judge") pays the actor a bonus for exploring: after a
task, a judge compares the memory *before* and *after* the writer's update (it never sees the
trajectory) and scores 4 dimensions, 0-2 each:

    new_discoveries        facts about the task world that were not in memory before
    error_correction       a prior fact that turned out wrong is fixed
    verification_targets   specific things one can check: names, paths, numbers, commands
    non_redundant_change   the change carries information (no rephrasing, no padding, no repeats)

explore = sum / 8, in [0, 1]. Rephrasing, length and generic advice earn nothing; a memory that
deletes useful prior knowledge scores 0. rewards.actor_advantages turns it into the bonus.

Two judges with one interface (`.score(before, after) -> float`, `.score_parts(...) ->
JudgeResult`):
- `LLMJudge(complete)`: the rubric prompt below over any `complete(prompt) -> str`. Replies must
  be one JSON object; a bad reply is re-asked once, then the score falls back to 0 (logged),
  never an exception. Backends: `local_complete` (our model through generate.py, greedy) and
  `openai_complete` (any OpenAI-compatible chat/completions endpoint, stdlib urllib only).
- `HeuristicJudge()`: offline and deterministic, for CPU runs and tests; see its docstring for
  what it approximates. It is a stand-in for the LLM judge, not a calibrated replica.

Simplification: one prompt per (before, after) pair; no batching of judge calls.
"""

import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)

DIMENSIONS = ("new_discoveries", "error_correction", "verification_targets",
              "non_redundant_change")
MAX_PER_DIMENSION = 2

RUBRIC = """You are grading how much an agent's memory notes improved after one task.
You see only the memory BEFORE and AFTER the update. Score 4 dimensions, each 0, 1 or 2:

- new_discoveries: facts about the environment or codebase that AFTER states and BEFORE did not
  (0 none, 1 one, 2 several).
- error_correction: a fact in BEFORE that AFTER fixes because it was wrong (0 none, 1 partial,
  2 a clear correction).
- verification_targets: specific, checkable items in the new content: names, file paths,
  numbers, commands, error messages (0 none, 1 some, 2 several).
- non_redundant_change: the change adds information instead of repeating what is there
  (0 a rephrasing or padding, 1 partly new, 2 all new).

Rules: rephrasing, reordering, extra length and generic advice ("be careful", "test more")
earn 0. If AFTER deletes useful knowledge that BEFORE had, every dimension is 0.
If AFTER equals BEFORE, every dimension is 0.

BEFORE:
<<<
{before}
>>>

AFTER:
<<<
{after}
>>>

Reply with only this JSON object and nothing else:
{{"new_discoveries": 0, "error_correction": 0, "verification_targets": 0, "non_redundant_change": 0}}"""

RETRY = """Your previous reply could not be used: {error}.
Reply again with only one JSON object with the integer keys new_discoveries, error_correction,
verification_targets and non_redundant_change, each 0, 1 or 2, and no other text."""


@dataclass
class JudgeResult:
    """The judge's total and its named parts (all logged)."""
    score: float                    # sum of the dimensions / 8, in [0, 1]
    new_discoveries: int = 0
    error_correction: int = 0
    verification_targets: int = 0
    non_redundant_change: int = 0
    attempts: int = 0               # LLM calls made (0: decided without one)
    fallback: bool = False          # True: no usable reply, score forced to 0
    detail: str = ""                # parse error, or what the heuristic counted


def _result(dims, **kw):
    return JudgeResult(score=sum(dims.values()) / (MAX_PER_DIMENSION * len(DIMENSIONS)),
                       **dims, **kw)


def _unchanged(before, after):
    return before.split() == after.split()   # whitespace-only edits are no change


# ----------------------------------------------------------------------------------------------
# LLM judge


def parse_reply(text):
    """One JSON object with the 4 integer dimensions in 0..2 -> dict; else ValueError (reason).

    Strict about content, lenient about wrapping only: a ```json fence or text around a single
    {...} object is tolerated because small models add them; a missing key, a non-integer, a
    bool or an out-of-range value is refused."""
    if not isinstance(text, str):
        raise ValueError(f"reply is {type(text).__name__}, not text")
    s = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", s, flags=re.S)
    if fence:
        s = fence.group(1)
    try:
        obj = json.loads(s)
    except (json.JSONDecodeError, RecursionError):   # RecursionError: "[[[[..." nested too deep
        start, end = s.find("{"), s.rfind("}")
        if start < 0 or end <= start:
            raise ValueError("no JSON object in the reply") from None
        try:
            obj = json.loads(s[start:end + 1])
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"invalid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ValueError("the JSON is not an object")
    dims = {}
    for k in DIMENSIONS:
        if k not in obj:
            raise ValueError(f"missing key {k!r}")
        v = obj[k]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_PER_DIMENSION:
            raise ValueError(f"{k} must be an integer 0..{MAX_PER_DIMENSION}, got {v!r}")
        dims[k] = v
    return dims


class LLMJudge:
    """The rubric over any `complete(prompt) -> str`. `score` never raises on a bad reply or a
    failing backend: one re-ask, then a logged fallback score of 0."""

    def __init__(self, complete, max_attempts=2):
        assert callable(complete), "LLMJudge needs complete: a callable prompt -> str"
        assert max_attempts >= 1, "max_attempts must be >= 1"
        self.complete = complete
        self.max_attempts = max_attempts    # 2 = the first ask plus one retry

    def score(self, before, after):
        return self.score_parts(before, after).score

    def score_parts(self, before, after):
        if _unchanged(before, after):       # no change scores 0 by the rubric: skip the call
            return _result({k: 0 for k in DIMENSIONS}, detail="no change")
        prompt = RUBRIC.format(before=before.strip() or "(empty)", after=after.strip() or "(empty)")
        error = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self.complete(prompt)
            except Exception as e:          # a failing backend must not kill a training run
                error = f"backend error: {type(e).__name__}: {e}"
                log.warning("judge attempt %d/%d failed: %s", attempt, self.max_attempts, error)
                continue
            try:
                return _result(parse_reply(reply), attempts=attempt)
            except ValueError as e:
                error = f"bad reply: {e}"
                # the re-ask shows the model its own reply and what was wrong with it
                prompt = prompt + "\n\n" + str(reply)[:2000] + "\n\n" + RETRY.format(error=e)
            log.warning("judge attempt %d/%d failed: %s", attempt, self.max_attempts, error)
        log.warning("judge fell back to score 0 after %d attempts: %s", self.max_attempts, error)
        return _result({k: 0 for k in DIMENSIONS}, attempts=self.max_attempts, fallback=True,
                       detail=error)


def local_complete(model, tokenizer, max_new_tokens=128):
    """complete(prompt) -> str with our own model: the prompt as one user turn through the
    tokenizer's chat template, greedy decoding with generate.generate, stopped at EOS/<|im_end|>."""
    from generate import generate    # lazy: judge.py stays importable without the engine

    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        stop.add(im_end)

    def complete(prompt):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out = generate(model, [ids], max_new_tokens, temperature=0.0,
                       stop_token_ids=tuple(sorted(stop)))[0]
        return tokenizer.decode(out.tokens, skip_special_tokens=True)

    return complete


class ApiError(RuntimeError):
    """An OpenAI-compatible endpoint failed for good (after its retries, or a 4xx at once)."""


def chat(url, model, messages, *, key_env="OPENAI_API_KEY", timeout=60.0, retries=3, backoff=1.0,
         max_tokens=512, temperature=0.0) -> str:
    """POST {url}/chat/completions -> the reply text. Timeouts, connection errors, 429/5xx and
    malformed replies are retried after backoff * 2^i s; other 4xx fail at once. Raises ApiError."""
    url = url.rstrip("/")
    url += "" if url.endswith("/chat/completions") else "/chat/completions"
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": temperature}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get(key_env):
        headers["Authorization"] = f"Bearer {os.environ[key_env]}"
    error = ""
    for i in range(retries + 1):
        if i:
            time.sleep(backoff * 2 ** (i - 1))
        try:
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read().decode())["choices"][0]["message"]["content"] or ""
        except urllib.error.HTTPError as e:  # before URLError: it is one
            error = f"HTTP {e.code}"
            if e.code != 429 and e.code < 500:
                raise ApiError(f"{error} from {url} (not retried)") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, IndexError, TypeError) as e:  # JSONDecodeError is a ValueError
            error = f"malformed reply: {e!r}"
        log.warning("chat try %d/%d failed: %s", i + 1, retries + 1, error)
    raise ApiError(f"gave up after {retries + 1} tries ({url}); last error: {error}")



def openai_complete(base_url, model, api_key_env="OPENAI_API_KEY", timeout=60.0, retries=3,
                    backoff=1.0, max_tokens=256, temperature=0.0):
    """complete(prompt) -> str over an OpenAI-compatible `POST {base_url}/chat/completions`
    (base_url like "http://127.0.0.1:8000/v1"), through chat() above: the API key is read from
    $api_key_env at call time (unset: no Authorization header; local vLLM/llama.cpp servers need
    none); failures raise ApiError (a RuntimeError), which LLMJudge turns into a logged fallback."""
    def complete(prompt):
        return chat(base_url, model, [{"role": "user", "content": prompt}], key_env=api_key_env,
                    timeout=timeout, retries=retries, backoff=backoff, max_tokens=max_tokens,
                    temperature=temperature)

    return complete


# ----------------------------------------------------------------------------------------------
# heuristic judge

# "specific" tokens are what a reader could check: code spans, paths and file names,
# identifiers (snake_case, CamelCase, dotted, calls), numbers, command-line flags, quoted strings
_CODE = re.compile(r"`([^`\n]+)`")
_SPECIFIC = [
    re.compile(r"(?<![\w/.])/?(?:[\w.~-]+/)+[\w.-]*"),                # paths: src/a.py, tests/
    re.compile(r"\b[A-Za-z_][\w-]*(?:\.[A-Za-z_]\w*)+\b"),            # a.py, mod.func (not e.g.)
    re.compile(r"\b[A-Za-z]*_\w*[A-Za-z0-9]\b"),                      # snake_case, FAIL_TO_PASS
    re.compile(r"\b[a-z]+[A-Z]\w*\b|\b[A-Z][a-z0-9]+[A-Z]\w*\b"),     # camelCase, TypeError
    re.compile(r"\b\w+\(\)"),                                         # calls: retry()
    re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)*%?"),                   # numbers, versions, +15
    re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*"),                      # flags: -x, --tb=short
    re.compile(r'"([^"\n]{2,})"'),                                   # quoted strings
]
_NOT_SPECIFIC = {"e.g", "i.e", "etc", "vs", "and/or", "/"}
_CUES = re.compile(r"\b(not|no longer|never|actually|wrong|incorrect|instead|rather than|"
                   r"isn't|doesn't|don't|does not|is not|fails?|correction)\b")
_STOP = set("""a an the and or but if then else of to in on at by for with from as is are was were
be been being it its this that these those there here do does did done not no can could should
would will may might must have has had i you we they he she them our your their my me us so than
too very just also only into out up down over about after before when while where which who what
why how all any some each every more most other such own same both few one""".split())


def _norm(text):
    return " ".join(text.replace("`", "").lower().split())


def _fact_key(line):
    """One raw line as a normalised fact: bullet marker and trailing punctuation stripped,
    lower case, no backticks; '' for headers and blank lines."""
    s = line.strip()
    if not s or s.startswith("#"):
        return ""
    return _norm(re.sub(r"^(?:[-*+]|\d+[.)])\s+", "", s)).rstrip(".;:, ")


def _facts(memory):
    """The fact lines of a memory -> {normalised fact: raw line}, in order, de-duplicated."""
    out = {}
    for line in memory.splitlines():
        key = _fact_key(line)
        if key and key not in out:
            out[key] = line
    return out


def _specifics(line_raw):
    """Set of specific tokens in one raw line (normalised: lower case, no backticks)."""
    toks = {_norm(m.group(1)) for m in _CODE.finditer(line_raw)}
    for pat in _SPECIFIC:
        for m in pat.finditer(line_raw):
            tok = _norm(m.group(m.lastindex or 0)).strip(".,;:")
            if tok and tok not in _NOT_SPECIFIC:
                toks.add(tok)
    return toks


def _words(line):
    return {w for w in re.findall(r"[a-z0-9_./-]+", line) if w not in _STOP and len(w) > 2}


def _occurs(tok, text):
    # token-boundary match at word-character edges, so "30" is not found inside "300"
    left = r"(?<![\w.])" if re.match(r"\w", tok) else ""
    right = r"(?!\w)" if re.search(r"\w$", tok) else ""
    return re.search(left + re.escape(tok) + right, text) is not None


def _jaccard(a, b):
    return len(a & b) / len(a | b) if a | b else 1.0


class HeuristicJudge:
    """An offline, deterministic approximation of the rubric, line by line.

    What it approximates, per dimension (each 0-2):
    - It splits each memory into fact lines (headers and blanks dropped, bullets stripped,
      lower-cased) and finds the *specific* tokens of each line: code spans, paths and file
      names, identifiers (snake_case, CamelCase, dotted names, `f()`), numbers, flags, quoted
      strings. A token is *new* if it does not occur in BEFORE (token-boundary match).
    - error_correction: an added line that revises a BEFORE line about the same subject
      (content-word Jaccard >= 0.3) where each holds a specific the other lacks (a changed
      value), or where the added line brings a correction cue ("not", "actually", "instead",
      "fails", ...) the old line lacked. 1 such line -> 1, 2+ -> 2.
    - new_discoveries: added lines with a new specific token that are not corrections.
      1 -> 1, 2+ -> 2.
    - verification_targets: distinct new specific tokens over all added lines. 1-2 -> 1, 3+ -> 2.
    - non_redundant_change: 0 if no added line is informative (new specific or correction);
      1 if some added lines are padding (no new specific, no correction) or some prior
      specifics were dropped; 2 if every added line is informative and nothing was dropped.
    Then the hard rules: no change (up to whitespace, line order and bullet style) -> 0; no
    informative line at all (a paraphrase, generic advice, pure length) -> 0; more than half of
    BEFORE's specific tokens gone from AFTER without a correction replacing them (wiping prior
    knowledge) -> 0.
    Blind spots: facts in plain prose with no name, path or number ("the red potion shrinks
    stones") count as generic; a paraphrase that introduces a new identifier counts as new;
    a new fact about the same subject as an old one, with a different value, counts as a
    correction even when both are true.
    """

    def score(self, before, after):
        return self.score_parts(before, after).score

    def score_parts(self, before, after):
        zero = {k: 0 for k in DIMENSIONS}
        if _unchanged(before, after):
            return _result(zero, detail="no change")
        old, new = _facts(before), _facts(after)      # {fact: raw line}
        added = [f for f in new if f not in old]
        if not added and set(new) == set(old):
            return _result(zero, detail="no change (reordered)")
        before_text = " \n ".join(old)
        spec_old = {f: _specifics(raw) for f, raw in old.items()}
        all_old_specifics = set().union(*spec_old.values()) if spec_old else set()

        corrections, discoveries, padding = [], [], []
        new_tokens = set()
        for f in added:
            spec = _specifics(new[f])
            fresh = {t for t in spec if not _occurs(t, before_text)}
            words = _words(f)
            fixed = None
            for o in old:
                if _jaccard(words, _words(o)) < 0.3:
                    continue   # a different subject
                changed_value = bool(spec - spec_old[o]) and bool(spec_old[o] - spec)
                cue = bool(_CUES.search(f)) and not _CUES.search(o)
                if changed_value or cue:
                    fixed = o
                    break
            if fixed is not None:
                corrections.append((fixed, f))
                new_tokens |= fresh
            elif fresh:
                discoveries.append(f)
                new_tokens |= fresh
            else:
                padding.append(f)

        # prior specifics that vanished, except those of lines a correction replaced
        replaced = set().union(*(spec_old[o] for o, _ in corrections)) if corrections else set()
        after_text = " \n ".join(new)
        lost = {t for t in all_old_specifics - replaced if not _occurs(t, after_text)}
        detail = (f"corrections={len(corrections)} discoveries={len(discoveries)} "
                  f"padding={len(padding)} new_specifics={len(new_tokens)} lost={len(lost)}")
        if all_old_specifics and len(lost) > len(all_old_specifics) / 2:
            return _result(zero, detail="wiped prior knowledge: " + detail)
        if not corrections and not discoveries:
            return _result(zero, detail="no informative change: " + detail)
        dims = {
            "new_discoveries": min(len(discoveries), 2),
            "error_correction": min(len(corrections), 2),
            "verification_targets": 0 if not new_tokens else (1 if len(new_tokens) < 3 else 2),
            "non_redundant_change": 1 if (padding or lost) else 2,
        }
        return _result(dims, detail=detail)

