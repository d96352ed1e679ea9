"""The exploration judge: how much did the memory learn on this task?

RIME (README, "RIME") pays the actor a bonus for exploring: after a task, a judge compares the
memory *before* and *after* the writer's update (it never sees the trajectory) and scores 4
dimensions, 0-2 each:

    new_discoveries        facts about the task world that were not in memory before
    error_correction       a prior fact that turned out wrong is fixed
    verification_targets   specific things one can check: names, paths, numbers, commands
    non_redundant_change   the change carries information (no rephrasing, no padding, no repeats)

explore = sum / 8, in [0, 1]. Rephrasing, length and generic advice earn nothing; a memory that
deletes useful prior knowledge scores 0. rewards.actor_advantages turns it into the bonus.

Two judges with one interface (`.score(before, after) -> float`, `.score_parts(...) ->
JudgeResult`):
- `LLMJudge(complete)`: the rubric prompt below over any `complete(prompt) -> str`. A reply must
  hold one JSON object; harmless shapes (`[2]`, `"2"`, `"2/2"` for 2) are accepted, a bad reply
  is re-asked once, then the score falls back to 0 (logged), never an exception. Backends:
  `local_complete` (our model through generate.py, greedy) and `openai_complete` (any
  OpenAI-compatible chat/completions endpoint through chat_api.py, stdlib urllib only; it sends
  the rubric's keys as a JSON schema, and steps down to JSON mode, then to plain text, for a
  server that refuses it). A fallback is counted (`JudgeResult.fallback`): rime.py logs the rate
  per update and `judge.py eval` prints it beside the agreement, since a judge that never
  answered looks, by its scores alone, like one that scored 0.
- `HeuristicJudge()`: offline and deterministic, for CPU runs and tests: a documented rule set
  that pays for new, corrected and checkable facts and nothing for status lines, repetition,
  identifier lists, generic advice, paraphrase or wiping (see its docstring and blind spots).

`python judge.py eval --judge heuristic|local|openai` reports a judge's agreement with the
labelled memory updates in tests/data/judge_pairs.jsonl, and its fallbacks (exit 1 when every
call fell back; exit 2, before any pair, when the endpoint does not answer).

Simplification: one prompt per (before, after) pair; no batching of judge calls.
"""

import argparse
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# the HTTP client (chat_api.py), also importable from here: bench.py's API agent takes it from judge
from chat_api import ApiError, EndpointDown, chat, check_endpoint  # noqa: F401

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
earn 0, and so do status or score lines ("Last task: score 0.9"), repeated lines and lists
of names with no statement about them. If AFTER deletes useful knowledge that BEFORE had,
every dimension is 0. If AFTER equals BEFORE, every dimension is 0.

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

# the rubric's reply as a JSON schema: a server that enforces it can only produce a valid reply
RUBRIC_SCHEMA = {"type": "object", "additionalProperties": False, "required": list(DIMENSIONS),
                 "properties": {k: {"type": "integer", "enum": list(range(MAX_PER_DIMENSION + 1))}
                                for k in DIMENSIONS}}

RETRY = """Your previous reply could not be used: {error}.
Reply again with only one JSON object with the integer keys new_discoveries, error_correction,
verification_targets and non_redundant_change, each 0, 1 or 2, and no other text."""
# how much of a bad reply the re-ask quotes: its start shows the wrong keys or values, and the
# whole of a long reply would push the re-ask past a small context (512 tokens)
QUOTE_CHARS = 200


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


def _dimension_value(v):
    """One dimension's value -> int, accepting harmless shapes: 2, 2.0, "2", "2/2" (out of the
    maximum), [2]. Anything else (a bool, 1.5, "two", "4/8", [1, 2]) -> ValueError."""
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.0+)?)\s*(?:/\s*(\d+)\s*)?", v)
        if not m or (m.group(2) is not None and int(m.group(2)) != MAX_PER_DIMENSION):
            raise ValueError(f"not a score: {v!r}")
        v = float(m.group(1))
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_PER_DIMENSION:
        raise ValueError(f"not an integer 0..{MAX_PER_DIMENSION}: {v!r}")
    return v


def parse_reply(text):
    """One JSON object with the 4 dimensions in 0..2 -> dict of ints; else ValueError (reason).

    Strict about content, lenient about harmless shapes: a ```json fence or text around a single
    {...} object, a list holding one object, and values written as `[2]`, `"2"`, `"2/2"` or
    `2.0` are accepted because small models produce them; a missing key, a bool, a fraction or
    an out-of-range value is refused."""
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
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise ValueError("the JSON is not an object")
    dims = {}
    for k in DIMENSIONS:
        if k not in obj:
            raise ValueError(f"missing key {k!r}")
        try:
            dims[k] = _dimension_value(obj[k])
        except ValueError as e:
            raise ValueError(f"{k}: {e}") from None
    return dims


class LLMJudge:
    """The rubric over any `complete(prompt) -> str`. `score` never raises on a bad reply or a
    failing backend: one re-ask (quoting the start of the bad reply), then a logged fallback score
    of 0 (`fallback=True`); a rubric that outgrows the context falls back at once. The exception
    is EndpointDown: the endpoint stopped answering, and the run should stop."""

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
        ask, error, last_bad = prompt, "", ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self.complete(ask)
            except EndpointDown:            # not this pair's failure: the caller stops the run
                raise
            except Exception as e:          # a failing backend must not kill a training run
                error = f"backend error: {type(e).__name__}: {e}"
                log.warning("judge attempt %d/%d failed: %s", attempt, self.max_attempts, error)
                if getattr(e, "context_overflow", False):
                    if ask is prompt:
                        break               # the rubric itself does not fit: a re-ask is longer
                    ask = prompt + "\n\n" + RETRY.format(error=last_bad)  # no quote this time
                continue
            try:
                return _result(parse_reply(reply), attempts=attempt)
            except ValueError as e:
                error, last_bad = f"bad reply: {e}", e
                # the re-ask shows the model the start of its own reply and what was wrong with it
                quoted = str(reply)[:QUOTE_CHARS] + (" ..." if len(str(reply)) > QUOTE_CHARS else "")
                ask = prompt + "\n\n" + quoted + "\n\n" + RETRY.format(error=e)
            log.warning("judge attempt %d/%d failed: %s", attempt, self.max_attempts, error)
        log.warning("judge fell back to score 0 after %d attempts: %s", attempt, error)
        return _result({k: 0 for k in DIMENSIONS}, attempts=attempt, fallback=True, detail=error)


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


def openai_complete(base_url, model, api_key_env="OPENAI_API_KEY", timeout=60.0, retries=3,
                    backoff=1.0, max_tokens=256, temperature=0.0, json_mode=True,
                    timeout_per_token=0.05):
    """complete(prompt) -> str over an OpenAI-compatible `POST {base_url}/chat/completions`
    (base_url like "http://127.0.0.1:8000/v1"), through chat_api.chat. json_mode=True sends
    RUBRIC_SCHEMA as the response format, stepping down to JSON mode and then to plain text for a
    server that refuses it (json_mode=False: plain text). The API key is read from $api_key_env
    at call time (unset: no Authorization header; local vLLM/llama.cpp servers need none); each
    try waits `timeout` s plus `timeout_per_token` s per token (a CPU server reads the ~400-token
    rubric for seconds). Failures raise ApiError (a RuntimeError), which LLMJudge turns into a
    logged fallback, except EndpointDown (the endpoint stopped answering), which it lets through."""
    def complete(prompt):
        return chat(base_url, model, [{"role": "user", "content": prompt}], key_env=api_key_env,
                    timeout=timeout, timeout_per_token=timeout_per_token, retries=retries,
                    backoff=backoff, max_tokens=max_tokens, temperature=temperature,
                    json_schema=RUBRIC_SCHEMA if json_mode else None)

    return complete


# ----------------------------------------------------------------------------------------------
# heuristic judge: a rule set, line by line

# Anchors are what a reader could check. In the codebase domain they are *specific* tokens: code
# spans, paths and file names, identifiers (snake_case, CamelCase, dotted, calls), numbers,
# command-line flags, quoted strings. In Alchemy they are the world's terms, the potion colours
# and the stone features (alchemy.COLOURS and alchemy.FEATURES; tests check the two agree):
# "potion red makes a stone pointy" names nothing a regex would call specific. They are also
# plain English ("keep patches small"), so they count in a line that names a potion or a stone,
# or two of them ("Blocked: small blue round <-> small purple round").
WORLD_TERMS = frozenset(("red", "green", "orange", "cyan", "yellow", "pink",
                         "small", "large", "blue", "purple", "round", "pointy"))
WORLD_OBJECTS = re.compile(r"\b(?:potion|stone)s?\b")
# Alchemy's key-adjacent notes (alchemy.format_notes): "large pink" (pink makes a stone large) and "best
# large purple pointy". Their grammar is the relation between the terms, so each is a statement, not a
# list of terms (tests check these words against alchemy's)
_FEATURE_WORDS = "(?:small|large|blue|purple|round|pointy)"
_NOTE = re.compile(rf"{_FEATURE_WORDS} (?:red|green|orange|cyan|yellow|pink)|best(?: {_FEATURE_WORDS}){{3}}")
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
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)*%?(?:/\d+)?")       # +15, 0.90, 3.2.1, 40%, 4/6
_RELATION_SYMBOLS = {"<->", "->", "=>", "→", "="}
# bookkeeping: which task, trial or step, and its score. Stripped before anything is compared, so
# "(seen in task t05)" after "(seen in task t04)" is not a new fact
_BOOKKEEPING = [
    re.compile(r"\b(?:task|trial|step|turn|attempt|episode|round|iteration)s?\s*(?:#\s*)?"
               r"[\w/.-]*\d[\w/.-]*", re.I),
    re.compile(r"\b(?:score|reward|result|accuracy)s?\s*(?:of|was|is|=|:)?\s*[+-]?\d+(?:\.\d+)?%?",
               re.I),
    re.compile(r"[+-]?\d+(?:\.\d+)?(?:/\d+)?\s+(?:task|trial|step|turn|attempt|episode)s?\b", re.I),
]
# the vocabulary of progress reports (stems, see _stem)
_STATUS_WORDS = """last previous prior latest current task score scored scoring reward result outcome
episode trial step turn attempt total value got achieved reached ended finished completed done
solved resolved unresolved passed failed success successful failure status progress iteration mean
average avg overall best worst far streak perfect points accuracy rate percent took""".split()
# a statement that negates or corrects: it means something else than the same words without it
_CUES = re.compile(r"\b(not|no longer|never|actually|wrong|incorrect|instead|rather than|isn't|"
                   r"doesn't|don't|does not|is not|nothing|no effect|correction)\b", re.I)
# a line that asks to check something specific
_TARGET = re.compile(r"^(?:check|test)\b|\b(?:check|test) (?:that|whether|if)\b|\b(?:verify|confirm|"
                     r"make sure|ensure|expect|assert)\b|\bshould (?:pass|fail|raise|return|give|show)\b",
                     re.I)
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


def _specifics(line_raw):
    """Set of specific tokens in one raw line (normalised: lower case, no backticks)."""
    toks = {_norm(m.group(1)) for m in _CODE.finditer(line_raw)}
    for pat in _SPECIFIC:
        for m in pat.finditer(line_raw):
            tok = _norm(m.group(m.lastindex or 0)).strip(".,;:")
            if tok and tok not in _NOT_SPECIFIC:
                toks.add(tok)
    return toks


def _stem(w):
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") and w.isalpha() else w


_STATUS = {_stem(w) for w in _STATUS_WORDS}


def _occurs(tok, text):
    # token-boundary match at word-character edges, so "30" is not found inside "300"
    left = r"(?<![\w.])" if re.match(r"\w", tok) else ""
    right = r"(?!\w)" if re.search(r"\w$", tok) else ""
    return re.search(left + re.escape(tok) + right, text) is not None


def _jaccard(a, b):
    return len(a & b) / len(a | b) if a | b else 1.0


@dataclass
class _Line:
    """One fact line, measured: what it names and how it is built."""
    key: str                  # the normalised fact (bullets, case, backticks dropped)
    anchors: set              # specific tokens and world terms, bookkeeping stripped
    words: list               # content words in order (stemmed, stop words dropped)
    plain: int                # ordinary words and relation symbols: what relates the anchors
    cue: bool                 # negates or corrects (_CUES)
    target: bool              # asks to check something (_TARGET)
    cheap: str = ""           # why the line carries nothing on its own; "" if it may
    kind: str = ""            # set by the judge: discovery | correction | target | a cheap reason


def _measure(raw):
    """One raw line -> _Line, with its cheap shape if it has one."""
    clean = re.sub(r"^(?:[-*+]|\d+[.)])\s+", "", raw.strip())     # the bullet
    for pat in _BOOKKEEPING:
        clean = pat.sub(" ", clean)
    low = _norm(clean)
    terms = {w for w in re.findall(r"[a-z]+", low) if w in WORLD_TERMS}
    if len(terms) < 2 and not WORLD_OBJECTS.search(low):
        terms = set()
    anchors = _specifics(clean) | terms
    words = [_stem(w.rstrip(".")) for w in re.findall(r"[a-z0-9_./+-]+", low)]
    words = [w for w in words if w not in _STOP and len(w) > 2]
    # tokens: a code span is one anchor, the rest is split on spaces
    anchor_tokens, plain = {_norm(m.group(1)) for m in _CODE.finditer(clean)}, 0
    for tok in _CODE.sub(" ", clean).split():
        bare = tok.strip(".,;:!?()[]{}\"'").lower()
        if bare in terms or _specifics(tok):
            anchor_tokens.add(bare)
        elif tok in _RELATION_SYMBOLS or re.fullmatch(r"[a-z]+(?:'[a-z]+)?", bare):
            plain += 1
    if _NOTE.fullmatch(low.strip(" .")):
        plain = max(plain, 2)                               # a note's grammar relates its terms
    line = _Line(key=_fact_key(raw), anchors=anchors, words=words, plain=plain,
                 cue=bool(_CUES.search(low)), target=bool(_TARGET.search(low)))
    # the cheap shapes, in order; each is defined on the line alone
    stems = {_stem(w) for w in re.findall(r"[a-z]+", low)}
    if not terms and all(_NUMBER.fullmatch(a) for a in anchors) and stems & _STATUS:
        line.cheap = "status"            # "Last task t03: score 0.90", "Task 4 resolved in 7 steps"
    elif not anchors:
        line.cheap = "generic"           # "Be careful with edge cases", "Think step by step"
    elif _repeats(words):
        line.cheap = "repetition"        # "small purple round <-> small purple round <-> ..."
    elif plain < 2 or len(anchor_tokens) > 2 * plain:
        line.cheap = "stuffing"          # "`_csv.py` `stack_cols` zx_91 qq.vv", a list of terms
    return line


def _repeats(words):
    """A phrase of 2+ content words said twice in a row, or a line that is half repeats."""
    n = len(words)
    if n >= 6 and len(set(words)) < n / 2:
        return True
    return any(words[i:i + k] == words[i + k:i + 2 * k]
               for k in range(2, n // 2 + 1) for i in range(n - 2 * k + 1))


def _restates(line, other):
    """`line` says nothing `other` did not: it names no anchor `other` lacks, shares 30% of its
    content words, and neither negates what the other affirms nor turns a fact into a check."""
    return (line.anchors <= other.anchors and bool(line.anchors)
            and _jaccard(set(line.words), set(other.words)) >= 0.3
            and line.cue == other.cue and (not line.target or other.target))


def _same_subject(line, other):
    """Two lines about the same thing: their first two content words agree, or half of all."""
    prefix = 0
    for a, b in zip(line.words, other.words):
        if a != b:
            break
        prefix += 1
    return prefix >= 2 or _jaccard(set(line.words), set(other.words)) >= 0.5, prefix


def _kept(fact, new):
    """A BEFORE fact survives in AFTER: verbatim, or some AFTER line names all its anchors."""
    return fact.key in new or any(fact.anchors <= n.anchors for n in new.values())


def _corrected_fact(line, facts, new):
    """The BEFORE fact that `line` corrects, or None: the closest fact on the same subject
    (longest common start) for which the line names a new anchor, and either that fact is no
    longer kept in AFTER, or the line negates or corrects where the fact did not."""
    subjects = sorted(((prefix, i) for i, f in enumerate(facts)
                       for same, prefix in [_same_subject(line, f)] if same), reverse=True)
    for _, i in subjects:
        f = facts[i]
        if line.anchors - f.anchors and (not _kept(f, new) or line.cue and not f.cue):
            return f
    return None


class HeuristicJudge:
    """An offline, deterministic approximation of the rubric: a rule set over fact lines.

    Each memory is split into fact lines (headers and blanks dropped, bullets stripped). Per
    line it measures the *anchors* (specific tokens: code spans, paths, identifiers, numbers,
    flags, quoted strings; and the Alchemy world's colour and feature words, in a line about a
    potion or a stone or naming two of them), its content words, and how many ordinary words
    relate the anchors. Task, trial and step ids with their scores are stripped first
    (bookkeeping is never a fact).

    A line carries nothing on its own (cheap) if it is:
    - status: it names no world term and no anchor but numbers, and uses the vocabulary of
      progress reports (task, score, resolved, steps, ...);
    - generic: it names no anchor at all ("be careful", "think step by step");
    - repetition: a phrase of 2+ content words said twice in a row, or half its words repeats;
    - stuffing: fewer than 2 ordinary words, or more than twice as many anchors as ordinary
      words: a list of names, not a statement about them.
    Every other line of AFTER that is not in BEFORE is then, in order:
    - repetition, if it restates an earlier added line; restatement (a paraphrase), if it
      restates a BEFORE line: it names no anchor that line lacks and shares 30% of its content
      words, with the same negation and the same fact-or-check form;
    - target, if it asks to check something (check, verify, make sure, should pass, ...);
    - correction, if it is about the same subject as a BEFORE fact (same first two content
      words, or half of all), names an anchor that fact lacks, and either the old fact is gone
      (no AFTER line names all its anchors) or the line negates or corrects (not, actually,
      instead) where the old fact did not;
    - discovery otherwise.
    The dimensions, 0-2 each:
      new_discoveries: discovery lines (1 -> 1, 2+ -> 2);
      error_correction: correction lines (1 -> 1, 2+ -> 2);
      verification_targets: target lines plus anchors of the new lines absent from BEFORE
        (1-2 -> 1, 3+ -> 2);
      non_redundant_change: 2 if every added line is a finding and no prior fact was lost, 1
        otherwise.
    Hard rules: no change (up to whitespace, order and bullet style) -> 0; no finding at all ->
    0; wiping: more than half of BEFORE's facts (its non-cheap lines) lost, neither kept (some
    AFTER line names all their anchors) nor corrected -> 0.

    Blind spots: it cannot tell a true fact from an invented one, so a writer that states new,
    wrong facts in the right shape is paid (so would an LLM judge without the trajectory: the
    memory-accuracy diagnostic against the world's true chemistry is what shows it); a fact in
    plain words with no anchor ("the exporter drops headers") counts as generic; a sentence
    naming junk identifiers between ordinary words counts as a finding; it sees one update, so
    a fact dropped in one update (0) and written again in the next is paid as new.
    """

    def score(self, before, after):
        return self.score_parts(before, after).score

    def score_parts(self, before, after):
        zero = {k: 0 for k in DIMENSIONS}
        if _unchanged(before, after):
            return _result(zero, detail="no change")
        old = {k: _measure(raw) for raw in before.splitlines() if (k := _fact_key(raw))}
        new = {k: _measure(raw) for raw in after.splitlines() if (k := _fact_key(raw))}
        if set(new) == set(old):
            return _result(zero, detail="no change (reordered)")
        facts = [o for o in old.values() if not o.cheap]          # BEFORE's knowledge
        before_text = " \n ".join(old)

        added, corrected = [], set()
        for line in (n for k, n in new.items() if k not in old):
            if line.cheap:
                line.kind = line.cheap
            elif any(_restates(line, a) for a in added if not a.cheap):
                line.kind = "repetition"
            elif any(_restates(line, o) for o in old.values()):
                line.kind = "restatement"
            elif line.target:
                line.kind = "target"
            else:
                fixed = _corrected_fact(line, facts, new)
                line.kind = "discovery" if fixed is None else "correction"
                if fixed is not None:
                    corrected.add(fixed.key)
            added.append(line)

        lost = [o for o in facts if o.key not in corrected and not _kept(o, new)]
        count = {k: sum(a.kind == k for a in added) for k in
                 ("discovery", "correction", "target", "restatement", "repetition", "status",
                  "generic", "stuffing")}
        findings = [a for a in added if a.kind in ("discovery", "correction", "target")]
        fresh = {t for a in findings for t in a.anchors if not _occurs(t, before_text)}
        detail = (" ".join(f"{k}={v}" for k, v in count.items() if v)
                  + f" new_anchors={len(fresh)} lost={len(lost)}/{len(facts)}")
        if facts and len(lost) > len(facts) / 2:
            return _result(zero, detail="wiped prior knowledge: " + detail)
        if not findings:
            return _result(zero, detail="no finding: " + detail)
        checkable = count["target"] + len(fresh)
        dims = {
            "new_discoveries": min(count["discovery"], 2),
            "error_correction": min(count["correction"], 2),
            "verification_targets": 0 if not checkable else (1 if checkable < 3 else 2),
            "non_redundant_change": 2 if len(findings) == len(added) and not lost else 1,
        }
        return _result(dims, detail=detail)


# ----------------------------------------------------------------------------------------------
# agreement with the labelled memory updates (python judge.py eval)

PAIRS_PATH = Path(__file__).resolve().parent / "tests" / "data" / "judge_pairs.jsonl"
CHEAP_MAX = 0.15      # a cheap update must score at most this; a real finding above it


def load_pairs(path=PAIRS_PATH):
    """The labelled set: one JSON object per line with id, domain, category, label ("real" or
    "cheap"), before and after. A malformed line raises ValueError naming it."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
            ok = (isinstance(p, dict) and p.get("label") in ("real", "cheap")
                  and p.get("domain") in ("alchemy", "codebase")
                  and all(isinstance(p.get(k), str) for k in ("id", "category", "before", "after")))
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{path}:{n}: not a labelled pair (id, domain alchemy|codebase, "
                             f"category, label real|cheap, before, after)")
        pairs.append(p)
    return pairs


@dataclass
class Agreement:
    """A judge against the labels: accuracy at `threshold` (real iff score > threshold) and the
    margin min(real) - max(cheap) (positive: some threshold separates the two perfectly)."""
    judge: str
    n: int
    accuracy: float
    min_real: float
    max_cheap: float
    fallbacks: int                 # judge calls that gave no usable reply (scored 0)
    threshold: float
    scores: list = field(default_factory=list)    # (pair, score) in the set's order
    calls: int = 0                 # pairs the judge was asked about (an unchanged pair needs no call)

    @property
    def margin(self):
        return self.min_real - self.max_cheap

    @property
    def fallback_rate(self):
        return self.fallbacks / self.calls if self.calls else 0.0


def agreement(judge, pairs, name="judge", threshold=CHEAP_MAX, progress=None):
    """Score every pair with `judge` (anything with .score_parts) -> Agreement."""
    scores, fallbacks, calls = [], 0, 0
    for i, p in enumerate(pairs):
        r = judge.score_parts(p["before"], p["after"])
        fallbacks += r.fallback
        calls += r.attempts > 0 or r.fallback
        scores.append((p, r.score))
        if progress:
            progress(i + 1, len(pairs), p, r)
    right = sum((s > threshold) == (p["label"] == "real") for p, s in scores)
    real = [s for p, s in scores if p["label"] == "real"]
    cheap = [s for p, s in scores if p["label"] == "cheap"]
    return Agreement(judge=name, n=len(scores), accuracy=right / max(len(scores), 1),
                     min_real=min(real, default=float("nan")),
                     max_cheap=max(cheap, default=float("nan")), fallbacks=fallbacks,
                     threshold=threshold, scores=scores, calls=calls)


def agreement_table(results):
    """Agreement per judge, then per category (mean score, share on the right side)."""
    lines = ["| judge | pairs | accuracy (threshold) | min real | max cheap | margin | fallbacks (of calls) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a in results:
        lines.append(f"| {a.judge} | {a.n} | {a.accuracy:.2f} ({a.threshold:.2f}) | "
                     f"{a.min_real:.3f} | {a.max_cheap:.3f} | {a.margin:+.3f} | "
                     f"{a.fallbacks}/{a.calls} ({a.fallback_rate:.0%}) |")
    cats = list(dict.fromkeys((p["label"], p["category"]) for p, _ in results[0].scores))
    lines += ["", "| label | category | pairs | " + " | ".join(
        f"{a.judge} mean (right)" for a in results) + " |", "|---|---|---:|" + "---:|" * len(results)]
    for label, cat in cats:
        cells = []
        for a in results:
            s = [(p, x) for p, x in a.scores if (p["label"], p["category"]) == (label, cat)]
            right = sum((x > a.threshold) == (label == "real") for _, x in s)
            cells.append(f"{sum(x for _, x in s) / len(s):.3f} ({right}/{len(s)})")
        lines.append(f"| {label} | {cat} | {len(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _eval_main(argv):
    p = argparse.ArgumentParser(prog="judge.py eval",
                                description="agreement of judges with the labelled memory updates")
    p.add_argument("--judge", action="append", choices=("heuristic", "local", "openai"),
                   help="repeat for several (default: heuristic)")
    p.add_argument("--data", default=str(PAIRS_PATH), help="labelled pairs (JSON lines)")
    p.add_argument("--threshold", type=float, default=CHEAP_MAX, help="real iff score > this")
    p.add_argument("--model", default="smollm2", help="local judge: HF checkpoint dir or smollm2")
    p.add_argument("--max-new-tokens", type=int, default=64, help="local judge's reply length")
    p.add_argument("--threads", type=int, default=0,
                   help="local judge: torch CPU threads (0: torch's default; 1 is faster on a busy machine)")
    p.add_argument("--url", default="", help="openai judge: base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-model", default="", help="openai judge: model name at that endpoint")
    p.add_argument("--per-category", type=int, default=0,
                   help="score only the first N pairs of each category in each domain (0: all), "
                        "for slow judges")
    p.add_argument("--verbose", action="store_true", help="print each pair's score")
    args = p.parse_args(argv)
    try:
        pairs = load_pairs(args.data)
    except (OSError, ValueError) as e:
        sys.exit(f"judge.py eval: {e}")
    if args.per_category > 0:
        groups = {}
        for pair in pairs:
            groups.setdefault((pair["domain"], pair["category"]), []).append(pair)
        pairs = [pair for group in groups.values() for pair in group[:args.per_category]]
    results = []
    for name in args.judge or ["heuristic"]:
        if name == "heuristic":
            judge = HeuristicJudge()
        elif name == "openai":
            if not (args.url and args.api_model):
                sys.exit("judge.py eval: --judge openai needs --url and --api-model")
            try:                            # one request before any pair: a dead endpoint is one line
                check_endpoint(args.url, args.api_model)
            except ApiError as e:
                _fail(f"--url {args.url}: {e}")
            judge = LLMJudge(openai_complete(args.url, args.api_model))
        else:
            import torch
            from model import load, load_tokenizer
            if args.threads > 0:
                torch.set_num_threads(args.threads)
            try:
                model, tokenizer = load(args.model).eval(), load_tokenizer(args.model)
            except (OSError, ValueError) as e:    # FileNotFoundError: no such checkpoint
                sys.exit(f"judge.py eval: cannot load the local judge {args.model!r}: {e}")
            judge = LLMJudge(local_complete(model, tokenizer, max_new_tokens=args.max_new_tokens))
            name = f"local ({Path(args.model).name})"
        t0 = time.time()

        def progress(i, n, pair, r, name=name):
            if args.verbose:
                print(f"  {name} {i}/{n} {pair['id']} [{pair['label']}/{pair['category']}] "
                      f"{r.score:.3f} {r.detail}", flush=True)

        try:
            a = agreement(judge, pairs, name, args.threshold, progress)
        except EndpointDown as e:
            _fail(f"{name}: {e}")
        results.append(a)
        # a fallback scores 0, which looks like a judgement: the rate says how much of the
        # agreement is the judge's own
        print(f"{name}: {len(pairs)} pairs in {time.time() - t0:.1f} s; accuracy {a.accuracy:.2f}, "
              f"fallbacks {a.fallbacks}/{a.calls} ({a.fallback_rate:.0%} of the judge's calls)", flush=True)
    print(agreement_table(results))
    dead = [a.judge for a in results if a.calls and a.fallbacks == a.calls]
    if dead:
        print(f"judge.py eval: error: every call of {', '.join(dead)} fell back to 0: its agreement "
              "is the fallback's, not the judge's", file=sys.stderr)
        sys.exit(1)


def _fail(message):
    """An eval that cannot go on: one line, exit 2 (the entry points' error style)."""
    print(f"judge.py eval: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    if sys.argv[1:2] != ["eval"]:
        sys.exit("usage: python judge.py eval [--judge heuristic|local|openai ...] (see --help)")
    logging.basicConfig(level=logging.ERROR)
    try:
        _eval_main(sys.argv[2:])
    except KeyboardInterrupt:
        print("judge.py eval: interrupted", file=sys.stderr)
        sys.exit(130)
