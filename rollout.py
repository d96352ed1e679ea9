"""The agent loop: chat formatting, action parsing, turns in an environment, context resets,
and the actor / writer roles of RIME, all turned into token-exact training rows.

Protocol (documented once, used by every environment): the agent answers each observation with free
reasoning followed by exactly one action in a tag,

    I should test the red potion first.
    <action>apply p1 s2</action>

and the text inside the last `<action>...</action>` goes to `env.step()`. A reply without a complete
tag gets a format-error observation and still uses a turn.

Token-in/token-out. The row a learner trains on is built from token ids, never from re-tokenised
text: the generated ids (with their behaviour logprobs, loss mask 1) are appended as they came out
of `generate`, and only the environment's text (observations, chat-template glue) is tokenised,
with loss mask 0. So recomputing logprobs over `Episode.tokens` with one forward reproduces the
logprobs the sampler saw (up to float error), which the PPO ratio needs, provided the learner scores
them at the sampler's temperature: every Episode, Segment and WriterSample records it (and top_p).
Each turn's prompt is the previous turn's tokens plus the chat template's rendering of the new user
turn only (ChatFormat): history is never re-rendered, so templates that rewrite earlier turns (the
official Qwen3 / Qwen3.5 ones drop think blocks before the last user query) still give rows that are
exactly what the model saw. The think block: see ChatFormat.

Context budget (CAMG, Section 3): when the next turn would not fit in `context_budget` tokens, the
policy is first asked to save its progress to `.agent_memory/CONTINUATION.md` (a sampled, trained
action like any other), then a *mechanical* reset starts a fresh context holding the task and the
memory file *paths* only; the policy must `cat` them back. The reset itself samples nothing and adds
no training row; the closed context is kept in `Episode.segments` and trained on with the same
return.

The actor's context: the whole episode so far (the paper's, the default), or, where the environment says
so (`env.actor_context == "latest"`, Alchemy's option: its every observation states the whole state),
only the memory and the latest observation: each turn opens a fresh context (system prompt, then the
memory and that observation as the first user turn) and the one before is kept in `Episode.segments`, a
row trained on with the same return. That context holds all the scripted protocol acts on
(`alchemy.protocol_reply(memory, obs)`), and the actor never has to find the latest state after
earlier ones (measured on the laptop model, not the default: docs/reader.md).

RIME roles (Section 3.1): the **actor** sees the memory in its first user turn; the **writer**
(`write_memory`) reads the finished episode (actions and outcomes, truncated to a budget), its
grading feedback and the previous memory, and returns the new memory, which replaces the old one.
The stream loop that alternates them (actor, writer, actor, ...) is rime.py's `play_streams`.

Each turn prefills only its new tokens: generate's saved Prefix of the episode's last turn is passed
back (keep_prefix / prefixes). Simplification: the writer sees observations truncated to a fixed
character budget rather than a learned summary.
"""

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from generate import generate

ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL)
MEMORY_HEADER = "[Memory of what you've learned so far]"
CONTINUATION_PATH = ".agent_memory/CONTINUATION.md"
MEMORY_LIST_CHARS = 1500   # memory file paths a prompt lists, in characters (a flood of files is cut, counted)

ACTOR_SYSTEM = (
    "You are an agent solving a task step by step. After each observation, think briefly, then "
    "reply with exactly one action inside <action>...</action>."
)
WRITER_SYSTEM = (
    "You keep a running, structured memory for an agent that solves a stream of related tasks. "
    "After each task you rewrite the memory so the next task goes better. Reply with exactly two "
    "sections, '### Repository Knowledge' and '### Lessons & Pitfalls', each with at least 2 bullet "
    "points ('- '). Keep confirmed facts even when a task went badly; fix facts proven wrong; be "
    "specific (names, values, commands)."
)
CONTINUATION_PROMPT = (
    "Your context is full and will be reset. Save what you know and what to do next: write "
    f"{CONTINUATION_PATH} now with one shell action, e.g. "
    f"<action>shell: printf '...' > {CONTINUATION_PATH}</action>"
)


# -----------------------------------------------------------------------------
# records

@dataclass
class Segment:
    """One context window as trained on (a reset closes one and opens the next), with the sampling
    settings its logprobs are under: pass them to ppo.make_batch(temperatures=, top_p=)."""
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Episode:
    task: object                      # envs.Task
    tokens: list[int]                 # the current (last) context, exactly as trained on
    loss_mask: list[int]              # 1 where the policy generated the token
    logprobs: list[float]             # behaviour logprob where loss_mask is 1, else 0.0
    score: float = 0.0                # sum of the environment's rewards
    num_turns: int = 0
    num_format_errors: int = 0
    num_resets: int = 0
    num_unsaved_resets: int = 0       # resets with no room left to ask for the continuation file
    reset_turns: list[int] = field(default_factory=list)   # num_turns at each reset: actions[:n] came before it
    done: bool = False
    finish: str = ""                  # "done" | "turns" | "error"
    error: str = ""                   # why an episode could not run (reset raised, ...): not trained on
    env_error: str = ""               # the environment raised on an action: the episode ended there, reward 0
    memory: str = ""                  # the memory the actor was given
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # observations[0] is the task
    segments: list[Segment] = field(default_factory=list)  # contexts closed by resets
    info: dict = field(default_factory=dict)                # env.info at the end
    role: str = "actor"
    reset_pending: bool = False       # the continuation file was requested; reset after this turn
    temperature: float = 1.0          # what the sampler used: logprobs are of softmax(logits / temperature)
    top_p: float = 1.0

    def rows(self) -> list[Segment]:
        """All training rows of this episode: the closed contexts, then the current one."""
        return self.segments + [Segment(self.tokens, self.loss_mask, self.logprobs, self.temperature, self.top_p)]


@dataclass
class WriterSample:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    memory: str            # the new memory (the old one where the reply was unusable)
    raw: str               # the writer's reply as decoded text
    status: str            # "ok" | "empty" | "truncated"
    temperature: float = 1.0   # the sampler's (ppo.make_batch(temperatures=...))


# -----------------------------------------------------------------------------
# chat formatting: token segments for the template's glue, computed once per tokenizer

class ChatFormat:
    """Token ids for a conversation that grows one turn at a time, from the tokenizer's own chat template.

    Turn by turn, never re-rendered: the prompt of turn t is the exact tokens of turn t-1's prompt, the
    reply as sampled, and the *delta* the template renders for the new user turn (the end of the
    assistant message, the user message, the generation prompt). Each delta is cut out of a real render
    of [user, assistant, user(text)], so whatever the template does to a message (ChatML glue, Llama
    headers, Qwen3.5's trimming) is what the model sees. This is also how templates that are not
    prefix-stable are handled: the official Qwen3 / Qwen3.5 templates render the assistant turn after
    the last user query as `<think>\n...</think>\n\n` + content but earlier ones as bare content, so a
    whole-conversation render rewrites history. We never re-render history: rows are exactly what the
    model saw at every turn, which is what the PPO ratio needs (the same choice as SkyRL's
    "accumulate thinking" template), and they differ from a whole-conversation render only there.

    The think block: `enable_thinking` goes to the template (the Qwen3 / Qwen3.5 switch; other templates
    ignore it). False (default) renders the generation prompt with an empty `<think>\n\n</think>\n\n`
    (non-thinking mode); True lets the model think (Qwen3.5 opens `<think>\n` in the prompt). Either
    way the prompt's think tokens and whatever think block the model samples stay in the row, as seen;
    only the text after the last `</think>` (`answer`) is parsed for the action."""

    def __init__(self, tokenizer, enable_thinking: bool = False):
        self.tok = tokenizer
        self.kwargs = {"enable_thinking": enable_thinking}
        a, b, obs = "\x01A\x01", "\x01B\x01", "\x01OBS\x01"
        self.marks = (a, b)
        try:
            base = self.render([{"role": "user", "content": a}, {"role": "assistant", "content": b}], False)
            full = self.render([{"role": "user", "content": a}, {"role": "assistant", "content": b},
                                {"role": "user", "content": obs}], True)
        except Exception as e:  # noqa: BLE001 - a template that cannot render a plain conversation
            raise ValueError(f"the tokenizer's chat template cannot render a user/assistant conversation: {e}") from None
        if b not in base or b not in full or obs not in full:
            raise ValueError("the tokenizer's chat template drops message contents; token-exact turns need them")
        # end of an assistant message after its content, e.g. "<|im_end|>\n" (the same in both branches
        # of Qwen3's think gate, which only changes what comes *before* the content)
        self.assistant_end = base[base.index(b) + len(b):]
        delta = full[full.index(b) + len(b):]
        if not delta.startswith(self.assistant_end):
            raise ValueError(f"the chat template ends an assistant message differently once a user turn "
                             f"follows ({self.assistant_end!r} vs {delta[:40]!r}); unsupported")
        self.user_prefix, self.user_suffix = delta[len(self.assistant_end):].split(obs)  # "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
        # the generation prompt left a think block open (Qwen3.5 thinking): the reply must close it
        self.think_open = self.user_suffix.rstrip().endswith("<think>")
        unk = getattr(tokenizer, "unk_token_id", None)
        ids = [tokenizer.eos_token_id] + [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|eot_id|>")]
        self.eos_ids = sorted({i for i in ids if isinstance(i, int) and i >= 0 and i != unk})
        # the end-of-turn token the template writes (e.g. <|im_end|>) and the text after it ("\n")
        ends = [i for i in self.eos_ids if tokenizer.decode([i]) and tokenizer.decode([i]) in self.assistant_end]
        if not ends:
            raise ValueError(f"no stop token of the tokenizer closes an assistant turn ({self.assistant_end!r})")
        self.end_id = ends[0]
        self.after_eos = self.assistant_end.split(tokenizer.decode([self.end_id]), 1)[1]

    def render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, system: str, user: str) -> list[int]:
        ids = self.tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            tokenize=True, add_generation_prompt=True, **self.kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def user_turn(self, text: str, ended_with_eos: bool) -> list[int]:
        """Tokens that close the assistant turn just generated and open the next one: the template's own
        rendering of a user message `text` after an assistant message, then its generation prompt."""
        a, b = self.marks
        full = self.render([{"role": "user", "content": a}, {"role": "assistant", "content": b},
                            {"role": "user", "content": text}], True)
        delta = full[full.index(b) + len(b) + len(self.assistant_end):]
        return self.encode((self.after_eos if ended_with_eos else self.assistant_end) + delta)

    def close(self, ended_with_eos: bool) -> list[int]:
        """Tokens that end the assistant turn just generated (the last turn of a context)."""
        return self.encode(self.after_eos if ended_with_eos else self.assistant_end)

    def answer(self, reply: str) -> str:
        """The part of a decoded reply after its think block ("" if the block never closed)."""
        if "</think>" in reply:
            return reply.rsplit("</think>", 1)[1]
        return "" if self.think_open or "<think>" in reply else reply

    def scripted_reply(self, text: str) -> list[int]:
        """A scripted agent's reply as the model would write it: the think block closed first when the
        generation prompt left it open, then text and the end-of-turn token."""
        return self.encode(("\n</think>\n\n" if self.think_open else "") + text) + [self.end_id]


def parse_action(reply: str) -> str | None:
    """The text of the last complete <action> tag, stripped; None if there is none."""
    found = ACTION_RE.findall(reply)
    return found[-1].strip() if found else None


def first_user_turn(obs: str, memory: str) -> str:
    return f"{MEMORY_HEADER}\n{memory.strip() or '(empty)'}\n\n{obs}"


def safe_text(text: str) -> str:
    """Text a tokenizer accepts: a lone surrogate (a file name that is not UTF-8, decoded with
    surrogateescape) becomes a backslash escape instead of making the tokenizer raise."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def list_paths(paths: list[str], max_chars: int = MEMORY_LIST_CHARS) -> str:
    """The paths joined by ", ", at most max_chars characters: a flood of files ends in "... and N more"."""
    shown, used = [], 0
    for i, p in enumerate(paths):
        if used + len(p) + 2 > max_chars - 24:   # room for the count
            return ", ".join(shown + [f"... and {len(paths) - i:,} more"])
        shown.append(p)
        used += len(p) + 2
    return ", ".join(shown)


def budget_line(turns_left: int, max_turns: int) -> str:
    return f"[{turns_left} of {max_turns} turns remaining]"


# -----------------------------------------------------------------------------
# the actor: many episodes stepped together

def run_episodes(model, tokenizer, env, tasks, memory="", temperature=1.0, seed=0, *,
                 max_turns=None, max_new_tokens=128, context_budget=None, top_p=1.0,
                 system_prompt=ACTOR_SYSTEM, num_threads=8, enable_thinking=False):
    """Run one episode per task, all at once: every live episode generates its next reply in one
    batched `generate` call, then all their environment steps run in a thread pool.

    env: one environment (cloned for each task after the first; the first task uses env itself, so
         a workspace env keeps its memory folder) or a list with one environment per task.
    memory: the RIME memory text for every task, or a list with one memory per task.
    context_budget: tokens per context; None = the model's max_seq_len. Near it the reset protocol
         above runs (the environment needs a shell, i.e. `shell:` actions, to save the file).
    enable_thinking: the template's think switch (ChatFormat). Each Episode records temperature and
         top_p, and its rows carry them to the learner.
    Returns list[Episode] in the order of tasks.
    """
    fmt = ChatFormat(tokenizer, enable_thinking)
    context_budget = context_budget or model.config.max_seq_len
    # each episode's model state after its last turn: the next turn prefills only the new tokens
    # (its observation), not the whole conversation again. A reset (or a fresh context each turn) starts
    # a new context: the state is keyed by the number of closed contexts so a stale one is never reused.
    saved = {}

    def replies(live_eps, step):
        prefixes = [saved.get(id(ep), (None, None))[1] if saved.get(id(ep), (None,))[0] == len(ep.segments) else None
                    for ep in live_eps]
        outs = generate(model, [ep.tokens for ep in live_eps], max_new_tokens, temperature=temperature,
                        top_p=top_p, stop_token_ids=fmt.eos_ids, seed=None if seed is None else seed * 1000003 + step,
                        prefixes=prefixes, keep_prefix=True)
        for ep, o in zip(live_eps, outs):
            saved[id(ep)] = (len(ep.segments), o.prefix)
        return [(o.tokens, o.logprobs, o.finish_reason == "stop") for o in outs]
    eps = agent_loop(fmt, replies, env, tasks, memory, max_turns=max_turns, max_new_tokens=max_new_tokens,
                context_budget=context_budget, system_prompt=system_prompt, num_threads=num_threads,
                sampling=(temperature, top_p))
    saved.clear()
    return eps


def scripted_text(env, task, policy) -> list[str]:
    """One scripted episode as text, in the protocol's form: the first observation, then each
    `<action>...</action>` and the observation it gave (what a small model's BPE is trained on)."""
    obs, done = env.reset(task), False
    parts = [obs]
    while not done:
        action = policy(obs)
        obs, _, done = env.step(action)
        parts += [f"<action>{action}</action>", obs]
    return parts


def greedy_actions(model, tokenizer, contexts, max_new_tokens: int) -> list:
    """The action the model would take next in each context (token ids ending where an agent reply
    starts), greedy: its parsed <action> text, or "" if the reply has none."""
    outs = generate(model, contexts, max_new_tokens, temperature=0.0, stop_token_ids=ChatFormat(tokenizer).eos_ids)
    return [parse_action(tokenizer.decode(o.tokens)) or "" for o in outs]


def run_scripted(tokenizer, env, tasks, policies, memory="", *, max_turns=None,
                 context_budget=1 << 30, system_prompt=ACTOR_SYSTEM, num_threads=8, enable_thinking=False):
    """The same loop with scripted agents (callables obs -> action, e.g. env.reference_policy, or obs ->
    a whole reply holding its `<action>` tag) in place of the model. A bare action is rendered as
    `<action>...</action>`; each reply ends with the end-of-turn token
    (ChatFormat.scripted_reply), with loss mask 1 and logprob 0.0: exactly the rows a warm start
    imitates, and the scripted rows of the benchmark."""
    fmt = ChatFormat(tokenizer, enable_thinking)
    policies = list(policies)
    assert len(policies) == len(tasks), f"{len(policies)} policies for {len(tasks)} tasks"
    last_obs = {}

    def replies(live_eps, step):
        out = []
        for i in sorted(last_obs):
            reply = policies[i](last_obs[i])      # a bare action, or a whole reply with its <action> tag
            ids = fmt.scripted_reply(reply if "<action>" in reply else f"<action>{reply}</action>")
            out.append((ids, [0.0] * len(ids), True))
        return out
    return agent_loop(fmt, replies, env, tasks, memory, max_turns=max_turns, max_new_tokens=64,
                 context_budget=context_budget, system_prompt=system_prompt,
                 num_threads=num_threads, observe=last_obs)


def agent_loop(fmt, replies, env, tasks, memory, *, max_turns, max_new_tokens, context_budget,
               system_prompt, num_threads, observe=None, sampling=(1.0, 1.0)):
    """The agent loop shared by model and scripted agents. `replies(live_episodes, step)` returns
    one (tokens, logprobs, ended_with_eos) per live episode (replying to episode.tokens); `observe`, if given, is kept as
    {episode index: latest observation} for live episodes (what a scripted agent acts on).
    sampling: (temperature, top_p) of the replies, recorded on every Episode."""
    assert len(tasks) > 0, "run_episodes needs at least one task"
    envs_ = list(env) if isinstance(env, (list, tuple)) else [env] + [env.clone() for _ in tasks[1:]]
    owned = [] if isinstance(env, (list, tuple)) else envs_[1:]
    assert len(envs_) == len(tasks), f"{len(envs_)} environments for {len(tasks)} tasks"
    memories = [safe_text(m) for m in (memory if isinstance(memory, (list, tuple)) else [memory] * len(tasks))]
    max_turns = max_turns or envs_[0].max_steps
    latest = getattr(envs_[0], "actor_context", "all") == "latest"
    pool = ThreadPoolExecutor(max_workers=min(num_threads, len(tasks)))
    tokenizer = fmt.tok

    # --- reset every environment (in threads: workspace set-up can be slow)
    eps = []
    for i, res in enumerate(_gather(pool, lambda i: envs_[i].reset(tasks[i]), range(len(tasks)))):
        ep = Episode(task=tasks[i], tokens=[], loss_mask=[], logprobs=[], memory=memories[i],
                     temperature=sampling[0], top_p=sampling[1])
        if isinstance(res, Exception):
            ep.done, ep.finish, ep.error = True, "error", f"reset: {res!r}"
        else:
            ep.observations.append(safe_text(res))
            _append(ep, fmt.prompt(system_prompt, first_user_turn(ep.observations[0], memories[i])), 0)
            if len(ep.tokens) + max_new_tokens > context_budget:
                ep.done, ep.finish, ep.error = True, "error", "context budget smaller than the task prompt"
        eps.append(ep)

    step = 0
    while True:
        live = [i for i, ep in enumerate(eps) if not ep.done]
        if not live:
            break
        # --- one batched generation for every live episode
        if observe is not None:
            observe.clear()
            observe.update({i: eps[i].observations[-1] for i in live})
        outs = replies([eps[i] for i in live], step)
        step += 1
        texts = {}
        for i, (toks, lps, ended) in zip(live, outs):
            ep = eps[i]
            _append(ep, toks, 1, lps)
            ep.num_turns += 1
            texts[i] = (tokenizer.decode(toks, skip_special_tokens=True), ended)

        # --- environment steps in parallel (a slow shell command does not stall the batch); the action
        # is parsed from the answer after any think block
        def act(i):
            action = parse_action(fmt.answer(texts[i][0]))
            return None if action is None else envs_[i].step(action)
        for i, res in zip(live, _gather(pool, act, live)):
            ep, (reply, ended) = eps[i], texts[i]
            action = parse_action(fmt.answer(reply))
            ep.actions.append(action if action is not None else "")
            if isinstance(res, Exception):   # the environment raised on this action: the episode ends here with
                # reward 0 and is trained on like any other (dropping it would let a policy escape a penalty)
                ep.env_error = f"step: {res!r}"
                res = (f"The environment failed on this action ({type(res).__name__}); the episode ends with "
                       "reward 0.", 0.0, True)
            if res is None:
                ep.num_format_errors += 1
                obs, reward, done = ("Invalid format. End your reply with exactly one action: "
                                     "<action>...</action>"), 0.0, False
            else:
                obs, reward, done = res
                obs = safe_text(obs)
            ep.score += float(reward)
            ep.observations.append(obs)
            if done or ep.num_turns >= max_turns:
                ep.done, ep.finish = True, "done" if done else "turns"
                # close the assistant turn so the row ends on the template's boundary
                _append(ep, fmt.close(ended), 0)
                continue
            text = f"{obs}\n{budget_line(max_turns - ep.num_turns, max_turns)}"
            if latest:   # a fresh context each turn: the memory and this observation, nothing before it
                _append(ep, fmt.close(ended), 0)
                _open_context(fmt, ep, system_prompt, first_user_turn(text, ep.memory), max_new_tokens, context_budget)
                continue
            glue = fmt.user_turn(text, ended)
            ask = fmt.user_turn(f"{text}\n{CONTINUATION_PROMPT}", ended)
            room = context_budget - len(ep.tokens) - max_new_tokens   # what this user turn may take
            # --- context budget (CAMG): if the turn after next would not fit, ask for the
            # continuation file now, while there is still room for the reply that writes it (with
            # less of the observation if the whole one leaves none); the turn after that save
            # request, or when not even a bare request fits, reset mechanically
            if not ep.reset_pending and len(ask) > room:
                ask = _cut_observation(fmt, text, ended, room)
            if ep.reset_pending or ask is None:
                if not ep.reset_pending:
                    ep.num_unsaved_resets += 1          # logged: progress lost without a save
                _append(ep, fmt.close(ended), 0)
                _mechanical_reset(fmt, ep, envs_[i], system_prompt, max_new_tokens, context_budget)
                continue
            if len(ep.tokens) + len(ask) + 2 * max_new_tokens > context_budget:
                glue, ep.reset_pending = ask, True
            _append(ep, glue, 0)
    for i, ep in enumerate(eps):
        ep.info = dict(getattr(envs_[i], "info", {}) or {})
    pool.shutdown()
    for e in owned:
        e.close()
    return eps


def _append(ep, tokens, mask, logprobs=None):
    ep.tokens += tokens
    ep.loss_mask += [mask] * len(tokens)
    ep.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def _gather(pool, fn, items):
    """Map fn over items in the pool; an exception becomes the result instead of propagating."""
    futures = [pool.submit(fn, i) for i in items]
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except Exception as e:  # noqa: BLE001 - an environment error must not kill the batch
            out.append(e)
    return out


def _cut_observation(fmt, text, ended, room):
    """The save request with the observation cut (from its end, marked) so that the user turn takes
    at most `room` tokens, keeping as much of it as fits; None if not even a bare request fits."""
    def turn(n):
        return fmt.user_turn(f"{text[:n]} [cut]\n{CONTINUATION_PROMPT}", ended)
    if len(turn(0)) > room:
        return None
    lo, hi = 0, len(text)                       # the longest prefix that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(turn(mid)) <= room else (lo, mid - 1)
    return turn(lo)


def reset_note(paths: list[str]) -> str:
    """What a fresh context after a reset says after the task: read the file back first, and which files exist."""
    return (f"Your context was reset. First read back what you saved: <action>shell: cat {CONTINUATION_PATH}</action>"
            " Memory files: " + list_paths(paths))


def _mechanical_reset(fmt, ep, env, system_prompt, max_new_tokens, context_budget):
    """Close the current context (kept as a training row) and open a fresh one holding the task
    and the memory file *paths*, never their contents. Samples nothing."""
    ep.num_resets += 1
    ep.reset_turns.append(ep.num_turns)
    ep.reset_pending = False
    files = getattr(env, "memory_files", None)
    paths = sorted(files().keys()) if callable(files) else []
    paths = [safe_text(p if p.startswith(".agent_memory") else f".agent_memory/{p}") for p in paths] or [CONTINUATION_PATH]
    _open_context(fmt, ep, system_prompt, first_user_turn(ep.observations[0], ep.memory) + "\n\n" + reset_note(paths),
                  max_new_tokens, context_budget)


def _open_context(fmt, ep, system_prompt, user, max_new_tokens, context_budget):
    """Close the episode's current context (kept as a training row, `Episode.segments`) and open a fresh
    one: the system prompt and this first user turn."""
    ep.segments.append(Segment(ep.tokens, ep.loss_mask, ep.logprobs, ep.temperature, ep.top_p))
    ep.tokens = fmt.prompt(system_prompt, user)
    ep.loss_mask = [0] * len(ep.tokens)
    ep.logprobs = [0.0] * len(ep.tokens)
    if len(ep.tokens) + max_new_tokens > context_budget:
        ep.done, ep.finish, ep.error = True, "error", "context budget smaller than the task prompt"


# -----------------------------------------------------------------------------
# the writer: rewrite the memory after a task

def trajectory_text(ep: Episode, budget_chars: int = 4000) -> str:
    """The finished task as the writer sees it: every action with its (truncated) outcome.
    Observations are cut first so that actions and results survive the budget: an observation over its
    share keeps its first line (the action's outcome, e.g. Alchemy's "p2 pink on s1: large pink. s1 is
    now ...", up to twice the share), then the head and tail of the rest in what remains of the share."""
    steps = list(zip(ep.actions, ep.observations[1:]))
    per_obs = max(80, (budget_chars - sum(len(a) for a, _ in steps)) // max(1, len(steps)))
    lines = [f"Task: {ep.observations[0][:1000]}" if ep.observations else "Task: (unavailable)"]
    for n, (a, o) in enumerate(steps, 1):
        lines.append(f"Step {n}: <action>{a}</action>\n  -> {_cut_outcome(o, per_obs)}")
    return "\n".join(lines)[: budget_chars + 1000]


def _cut_outcome(o: str, share: int) -> str:
    if len(o) <= share:
        return o
    head, _, rest = o.partition("\n")
    head = head if len(head) <= 2 * share else head[:2 * share] + " ..."
    room = share - len(head)
    if room < 20 or not rest:
        return head + (" ..." if rest else "")
    return head + "\n" + rest[: room // 2] + " ... " + rest[-room // 2:]


def writer_prompt(ep: Episode, old_memory: str, traj_chars: int = 4000, task_last: bool = False) -> str:
    """task_last: the task's first observation again at the end, right before the memory is written (what the
    task began with, next to where a note about it is written; rime.py --writer-task-last)."""
    feedback = f"Score: {ep.score:.2f} (1.0 is best)." + (f" Error: {ep.error}" if ep.error else "")
    began = f"## The task as it began\n{ep.observations[0][:1000]}\n\n" if task_last and ep.observations else ""
    return (f"## Finished task\n{trajectory_text(ep, traj_chars)}\n\n## Grading feedback\n{feedback}\n\n"
            f"## Previous memory\n{old_memory.strip() or '(empty)'}\n\n{began}Write the new memory now.")


def write_memory(model, tokenizer, episodes, old_memories, temperature=1.0, seed=0, *,
                 memory_tokens=2048, max_new_tokens=None, traj_chars=4000, enable_thinking=False, think_tokens=0,
                 task_last=False):
    """The writer role, batched over episodes. Returns one WriterSample per episode.

    Memory is replaced, not appended, and capped at `memory_tokens`. An empty reply keeps the old
    memory (status "empty"); a reply that hits the cap is cut there (status "truncated"). Both are
    logged by the caller and fail the writer's format gate downstream. The memory is the reply's
    answer after any think block (ChatFormat.answer); the row keeps the whole reply, as sampled.
    `think_tokens` is a budget for that block on top of the cap (the reply may run to memory_tokens +
    think_tokens; the answer is still cut at memory_tokens). task_last: writer_prompt's.
    """
    fmt = ChatFormat(tokenizer, enable_thinking)
    max_new_tokens = max_new_tokens or memory_tokens + think_tokens
    prompts = [fmt.prompt(WRITER_SYSTEM, writer_prompt(ep, m, traj_chars, task_last)) for ep, m in zip(episodes, old_memories)]
    outs = generate(model, prompts, max_new_tokens, temperature=temperature,
                    stop_token_ids=fmt.eos_ids, seed=seed)
    samples = []
    for p, out, old in zip(prompts, outs, old_memories):
        raw = tokenizer.decode(out.tokens, skip_special_tokens=True)
        text = fmt.answer(raw).strip()
        status = "ok"
        if not text:
            status, text = "empty", old
        elif out.finish_reason == "length" and len(out.tokens) >= max_new_tokens:
            status = "truncated"
        if max_new_tokens > memory_tokens:           # a think budget: cap the answer (as re-encoded)
            ids, n = fmt.encode(text), memory_tokens
            while len(fmt.encode(text)) > memory_tokens:
                status, text, n = "truncated", tokenizer.decode(ids[:n]).strip(), n - 1
        samples.append(WriterSample(tokens=p + out.tokens, loss_mask=[0] * len(p) + [1] * len(out.tokens),
                                    logprobs=[0.0] * len(p) + out.logprobs, memory=text, raw=raw, status=status,
                                    temperature=temperature))
    return samples
