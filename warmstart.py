"""RIME's warm start: before RL, teach a small model the protocol with ppo.sft_loss in the RL learner.

    stats = warm_start(learner, tokenizer, env, args, log)     # rime.py's warm_start_phase calls it

Two modes (rime.py --warmstart-mode):
  protocol  (default): only what a pretrained chat model already knows. The actor rows come from the
            protocol actor (the action syntax; it acts on what its memory says, else at random), the
            writer rows from memories in the two-section shape that quote random outcome lines and
            generic lessons: no task knowledge, so RL has to teach the content;
  imitation: the scripted reference actor (env.reference_policy, reading its notes) and the
            scripted writer's memory (alchemy.memory_text of what it inferred): content included.
Rows are rendered exactly as rollouts are (rollout.run_scripted, rollout.writer_prompt), so the
model imitates what it will later see. It stops when held-out format validity reaches
`warmstart_threshold` (a threshold above 1 never stops it: every `warmstart_steps` runs), and is
skipped when the model already follows the protocol.
"""

import dataclasses
import random

import curriculum
import rollout
from ppo import is_rank0, make_batch, print0


GENERIC_LESSONS = ("- Try a potion on a stone and read what changed before planning.",
                   "- Put a stone in the cauldron only when its value is positive.",
                   "- End the trial when no move can raise a stone's value.",
                   "- Use each potion at most once; it is used up either way.",
                   "- Read the stones and potions listed in each observation.")


def random_valid_policy(rng: random.Random):
    """An actor that knows the action syntax and nothing else: a uniform draw among the actions
    valid in the observation (apply P S for every potion and stone, cauldron S, end)."""
    from alchemy import parse_observation

    def act(obs: str) -> str:
        state = parse_observation(obs)
        if state is None:
            return "end"
        options = [f"apply p{p} s{s}" for p in state["potions"] for s in state["stones"]]
        options += [f"cauldron s{s}" for s in state["stones"]] + ["end"]
        return rng.choice(options)
    return act


def protocol_policy(rng: random.Random, memory: str):
    """The protocol actor: where its memory says what to do, it does that (alchemy.note_reader_reply,
    the reading the pretraining taught: "need large pink <action>apply pink s1</action>"), whether the
    memory is true or not; elsewhere a random valid action. It knows no chemistry: a memory of random
    quotes rarely decides anything, so most of its moves are random."""
    from alchemy import note_reader_reply
    explore = random_valid_policy(rng)

    def act(obs: str) -> str:
        return note_reader_reply(memory, obs) or explore(obs)
    return act


def protocol_memory(ep, rng: random.Random) -> str:
    """The memory's two-section shape with no inferred knowledge: lines quoted at random from the
    episode's own observations (what a chat model asked to keep notes would copy, unselected) and
    generic lessons. Which lines are worth keeping is left for RL to learn."""
    lines = [o.strip().splitlines()[0] for o in ep.observations[1:] if o.strip()]   # each action's outcome line
    quoted = rng.sample(lines, min(2, len(lines))) if lines else []
    facts = [f"- {ln}" for ln in quoted] + ["- The hidden chemistry is the same in every task of this world."]
    return ("### Repository Knowledge\n" + "\n".join(facts[:3]) + "\n\n### Lessons & Pitfalls\n"
            + "\n".join(rng.sample(GENERIC_LESSONS, 2)))


def warmstart_rows(tokenizer, env, tasks, args):
    """Scripted streams rendered exactly as rollouts are: actor rows from run_scripted (loss mask on
    the agent's tokens) and writer rows = the writer prompt rollout.write_memory builds + a target
    memory. Two modes:
      protocol  (default): the actor is random_valid_policy and the memory protocol_memory: only the
                action syntax and the memory's shape, no task knowledge (RL has to teach the content);
      imitation: the reference actor (env.reference_policy) and the scripted writer's memory
                (alchemy.memory_text of what it inferred): imitation of the content too."""
    streams = curriculum.make_streams(tasks, args.warmstart_streams, order="easy_to_hard", segment=args.segment,
                                      seed=args.seed)
    rows = []
    for _, ep, writer_row in scripted_play(tokenizer, env, streams, args):
        rows += [(r.tokens, r.loss_mask) for r in ep.rows()]
        rows.append(writer_row)
    return rows


def scripted_play(tokenizer, env, streams, args):
    """The scripted agent along every stream, side by side: yields (t, actor Episode, writer row) per task
    t of each stream, in stream order, where the writer row is (tokens, loss mask) of the writer prompt +
    the scripted memory M(t), which the actor of task t + 1 reads. args.warmstart_mode picks the agent
    (warmstart_rows' docstring)."""
    from alchemy import memory_text
    fmt = rollout.ChatFormat(tokenizer)
    rng = random.Random(f"warmstart/{args.seed}")
    memories = [""] * len(streams)
    envs_ = [env] + [env.clone() for _ in streams[1:]]
    for t in range(len(streams[0])):
        ts = [s[t] for s in streams]
        if args.warmstart_mode == "imitation":
            pols = [env.reference_policy(task, notes=m or None) for task, m in zip(ts, memories)]
        else:
            pols = [protocol_policy(rng, m) for m in memories]
        eps = rollout.run_scripted(tokenizer, envs_, ts, pols, memory=memories)
        for i, (ep, pol) in enumerate(zip(eps, pols)):
            new = (memory_text(pol.knowledge, ep.task.id, ep.score) if args.warmstart_mode == "imitation"
                   else protocol_memory(ep, rng))
            prompt = fmt.prompt(rollout.WRITER_SYSTEM, rollout.writer_prompt(ep, memories[i], args.traj_chars))
            target = fmt.encode(new) + [fmt.end_id]
            yield t, ep, (prompt + target, [0] * len(prompt) + [1] * len(target))
            memories[i] = new
    for e in envs_[1:]:
        e.close()


def reference_match(model, tokenizer, env, streams, args) -> dict:
    """A diagnostic, not a reward: does the actor act on its notes? The scripted reference plays the
    held-out `streams` (each task reading the scripted notes of the tasks before it); in every state it
    met, with its history as the context, the actor replies greedily, and its action is compared with
    the reference's. Split by the reference's memory (with notes: tasks after a stream's first; scratch:
    the first) and by action (apply / cauldron / end). With notes the reference goes straight to the
    potions its plan needs: an actor that reads the notes can follow it there, and one that does not
    falls to chance, a uniform pick among the applies the observation allows ("chance"). An apply is
    also scored in parts: "colour" (a potion of the reference's colour: potions of one colour are
    interchangeable) and "stone", each beside its chance. Returns {"with_notes": {"match", "actions"},
    "with_notes/apply": {..., "chance", "colour", "colour_chance", "stone", "stone_chance"}, ...}."""
    from alchemy import parse_observation
    imitation = dataclasses.replace(args, warmstart_mode="imitation")
    states = []                    # (with_notes | scratch, the reference's action, observed state, context)
    for t, ep, _ in scripted_play(tokenizer, env, streams, imitation):
        contexts = [row.tokens[:span[0]] for row in ep.rows() for span in _spans(row.loss_mask)]
        for turn, (action, context) in enumerate(zip(ep.actions, contexts)):   # reply turn answers observations[turn]
            states.append(("with_notes" if t else "scratch", action, parse_observation(ep.observations[turn]), context))
    was_training = model.training
    model.eval()
    guesses = rollout.greedy_actions(model, tokenizer, [s[3] for s in states], args.max_new_tokens)
    model.train(was_training)
    counts = {}
    for (key, action, state, _), guess in zip(states, guesses):
        kind = action.split()[0] if action.split() else "other"       # apply / cauldron / end
        hits = {"match": guess == action}
        if kind == "apply" and state:
            hits.update(_apply_hits(action, guess, state))
            hits["match"] = hits["colour"] and hits["stone"]     # potions of one colour are interchangeable
        for k in (key, f"{key}/{kind}"):
            c = counts.setdefault(k, {"actions": 0})
            c["actions"] += 1
            for name, v in hits.items():
                c[name] = c.get(name, 0) + v
    return {k: {name: v if name == "actions" else v / c["actions"] for name, v in c.items()}
            for k, c in sorted(counts.items())}


def _apply_hits(action: str, guess: str, state: dict) -> dict:
    """The parts of a reference's `apply P S` that the actor's action gets right: a potion of the same
    colour (any of them) and the same stone, and what a uniform pick gets (whole action, colour, stone)."""
    from alchemy import COLOURS, parse_action
    potions, stones = state["potions"], state["stones"]

    def colour_and_stone(text):     # a potion named by id (p3) or by colour (pink)
        parsed = parse_action(text)
        if not parsed or parsed[0] != "apply":
            return None, None
        p, s = parsed[1]
        return (COLOURS.index(p) if isinstance(p, str) else potions.get(p)), s
    colour, s = colour_and_stone(action)
    g_colour, g_stone = colour_and_stone(guess)
    return {"chance": 1 / (len(potions) * len(stones)),
            "colour": g_colour is not None and g_colour == colour,
            "colour_chance": sum(c == colour for c in potions.values()) / len(potions),
            "stone": g_stone == s, "stone_chance": 1 / len(stones)}


def _spans(mask) -> list:
    """Runs of consecutive 1s in a loss mask (one per agent reply), as index lists."""
    spans, cur = [], []
    for i, v in enumerate(mask):
        if v:
            cur.append(i)
        elif cur:
            spans.append(cur); cur = []
    return spans + [cur] if cur else spans


def format_validity(model, tokenizer, env, tasks, args, turns=6, with_score=False):
    """Share of greedy actor replies on held-out tasks that are valid actions (and the mean score
    those short episodes reach, if with_score)."""
    eps = rollout.run_episodes(model, tokenizer, env, tasks, temperature=0.0, max_turns=turns,
                               max_new_tokens=args.max_new_tokens)
    n = sum(ep.num_turns for ep in eps)
    bad = sum(ep.num_format_errors + int(ep.info.get("invalid", 0)) for ep in eps)
    validity = 1.0 - bad / max(n, 1)
    return (validity, sum(ep.score for ep in eps) / len(eps)) if with_score else validity


def warm_start(learner, tokenizer, env, args, log) -> dict:
    gen = learner.gen_model
    held_out = env.tasks("test")[: 8]
    before, score_before = format_validity(gen, tokenizer, env, held_out, args, with_score=True)
    log({"phase": "warmstart", "step": 0, "validity": before, "score": score_before})
    if before >= args.warmstart_threshold:
        print0(f"warm start skipped: format validity {before:.2f} >= {args.warmstart_threshold}")
        return {"validity_before": before, "validity_after": before, "steps": 0,
                "score_before": score_before, "score_after": score_before}
    rows = warmstart_rows(tokenizer, env, env.tasks("train"), args)
    print0(f"warm start ({args.warmstart_mode}): {len(rows)} rows, {sum(len(r[0]) for r in rows)} tokens; validity {before:.2f}")
    rng = random.Random(args.seed)
    for g in learner.optimizer.param_groups:
        g["lr"] = args.warmstart_lr
    from tqdm import tqdm
    bar = tqdm(range(1, args.warmstart_steps + 1), desc="warm start", disable=not is_rank0())
    validity, step, score_after = before, 0, score_before
    for step in bar:
        batch = rng.sample(rows, min(args.warmstart_batch, len(rows)))
        b = make_batch([r[0] for r in batch], [[0] * len(r[1]) for r in batch], sft_mask=[r[1] for r in batch])
        stats = learner.update(b)
        bar.set_postfix(sft=f"{stats.get('sft_loss', 0):.3f}")
        if step % 25 == 0 or step == args.warmstart_steps:   # the last check is also the final figure
            validity, score_after = format_validity(learner.gen_model, tokenizer, env, held_out, args, with_score=True)
            log({"phase": "warmstart", "step": step, "sft_loss": stats.get("sft_loss"), "validity": validity})
            if validity >= args.warmstart_threshold:
                break
    for g in learner.optimizer.param_groups:
        g["lr"] = args.lr
    log({"phase": "warmstart", "step": step, "validity": validity, "score": score_after, "final": True})
    return {"validity_before": before, "validity_after": validity, "steps": step,
            "score_before": score_before, "score_after": score_after}
