"""RIME's warm start: before RL, teach a small model the protocol with ppo.sft_loss in the RL learner.

    stats = warm_start(learner, tokenizer, env, args, log)     # rime.py's warm_start_phase calls it

Two modes (rime.py --warmstart-mode):
  protocol  (default): only what a pretrained chat model already knows. The actor rows come from the
            protocol actor (the action syntax; it acts on what its memory says, else explores in a
            fixed order), the writer rows from an unselective note-taker's memories in the two-section
            shape: the effects the episode's observations stated, in their words, and generic lessons.
            No task knowledge: what to keep across tasks is RL's to learn;
  imitation: the scripted reference actor (env.reference_policy, reading its notes) and the
            scripted writer's memory (alchemy.memory_text of what it inferred): content included.
Rows are rendered exactly as rollouts are (rollout.run_scripted, rollout.writer_prompt), so the
model imitates what it will later see. It stops when held-out format validity (the actor's actions)
and the writer's format rate (its memories' shape) both reach `warmstart_threshold` (a threshold
above 1 never stops it: every `warmstart_steps` runs), and is skipped when the model already follows
the protocol. Its lr decays linearly from `warmstart_lr` to 0 (warmstart_lr_at), and RL then starts a
fresh AdamW (ppo.Learner.reset_optimizer, called by rime.py). For the laptop reader (--model small)
4 rows of every batch of 10 rehearse pretrain.py's reading rungs (--warmstart-reading), so that learning
the protocol does not overwrite the reading, and (protocol mode) 2 are the rare turns where the notes
decide the move (note_decision_rows, --warmstart-decisions). --warmstart-writer-rows gives the writer's rows a
share of their own (about half the episode units are writer rows; this adds more beside them).
"""

import dataclasses
import random

import curriculum
import rollout
from ppo import is_rank0, make_batch, print0


PROTOCOL_LESSONS = ("- Try a potion on a stone and read what changed before planning.",
                    "- Put a stone in the cauldron only when its value is positive.")
PROTOCOL_FILLER = ("- The hidden chemistry is the same in every task of this world.",
                   "- Each potion is used up when applied, whether or not it changes the stone.")


def protocol_policy(memory: str):
    """The protocol actor, deterministic: where its memory says what to do, it does that
    (alchemy.note_reader_reply, the reading the pretraining taught: "s1 small purple pointy best large
    purple pointy need large pink <action>apply pink s1</action>"), whether the memory is true or not;
    elsewhere it explores in a fixed order (alchemy.explore_action: the first potion on the table on the
    first stone). It knows no chemistry, and every move it makes is valid, so its greedy imitation is too."""
    from alchemy import protocol_reply

    def act(obs: str) -> str:
        return protocol_reply(memory, obs)
    return act


def protocol_memory(ep, traj_chars: int, infer: bool = False) -> str:
    """The memory's two-section shape, written by an unselective note-taker: the effects the writer's
    prompt shows this episode's observations stating (rollout.trajectory_text at `traj_chars`),
    transcribed in their words ("- large pink", "- best large purple pointy": alchemy.observed_notes),
    and two generic lessons. It keeps nothing of the previous memory: keeping facts across tasks, fixing
    wrong ones and choosing what fits the cap is left to RL. infer (`--warmstart-writer inferring`): the
    best stone is the one the stone values in that same text imply (alchemy.inferred_best_in, the
    reader's infer rung) whenever they settle it, not only one seen at +15; still this episode's
    content, never a fact of the world the episode did not show."""
    from alchemy import inferred_best_in, observed_notes
    text = rollout.trajectory_text(ep, traj_chars)
    return protocol_text(with_best(observed_notes([text]), inferred_best_in(text) if infer else None))


def writer_reply(ep, traj_chars: int, writer: str = "transcribing") -> tuple:
    """The scripted writer's whole reply and the memory in it, -> (reply, memory). transcribing and
    inferring: the reply is protocol_memory. thinking (`--warmstart-writer thinking`): a think block first
    that copies the task's first state from the writer's prompt (its Trial, Stones, Potions and Actions
    lines, as the trajectory's first observation shows them) and ends with the note "- best ..." those
    stones' values imply, or "- best unknown" when they leave a feature open: the reader's infer rung in
    its own shape (state, then "- best"), taken inside the writer's reply instead of across its long
    prompt. The memory after the block transcribes what the episode showed, with that best stone when no
    stone was seen at +15. Still this episode's content only. first-state (`--warmstart-writer first-state`,
    meant with `--writer-task-last`, whose writer prompt ends with that state): that memory, with no block."""
    if writer not in ("thinking", "first-state"):
        memory = protocol_memory(ep, traj_chars, infer=writer == "inferring")
        return memory, memory
    from alchemy import inferred_best_in, observed_notes
    state = first_state(ep)
    best = inferred_best_in(state)
    facts = observed_notes([rollout.trajectory_text(ep, traj_chars)])
    if best and not any(f.startswith("- best ") for f in facts):
        facts = with_best(facts, best)
    memory = protocol_text(facts)
    if writer == "first-state":
        return memory, memory
    return f"<think>\n{state}\n{best or '- best unknown'}\n</think>\n\n{memory}", memory


def first_state(ep) -> str:
    """The task's first observation from its "Trial" line on (the whole observation if it has none)."""
    obs = ep.observations[0] if ep.observations else ""
    return obs[obs.index("Trial "):] if "Trial " in obs else obs


def with_best(facts: list, best) -> list:
    """The facts with `best` (a "- best ..." note, or None: the facts as they are) in place of any best stone
    they state."""
    return facts if best is None else [f for f in facts if not f.startswith("- best ")] + [best]


def protocol_text(facts: list) -> str:
    """Facts (bullet lines) in the memory's two-section shape, with protocol_memory's filler and lessons."""
    facts = list(facts) + list(PROTOCOL_FILLER[:max(0, 2 - len(facts))])
    return ("### Repository Knowledge\n" + "\n".join(facts) + "\n\n### Lessons & Pitfalls\n"
            + "\n".join(PROTOCOL_LESSONS))


def scripted_writers(traj_chars: int, fits) -> dict:
    """Scripted Alchemy writers to play in the loop with a learned actor (attribution.play_with_writer), each a
    function (episode, old memory) -> memory, from what the warm start teaches to what only inference gives:
      transcribing:        protocol_memory, the warm start's target (what this episode showed, nothing kept);
      transcribing, keeping: the old memory's facts kept, this episode's added (the oldest dropped until the
                           memory `fits`, a predicate on its text: the memory cap);
      transcribing + best inferred: protocol_memory with the best stone the episode's stone values imply
                           (alchemy.inferred_best) in place of a seen one.
    What each is worth to an actor bounds what RL can gain by learning to write like it (docs/results.md)."""
    from alchemy import inferred_best, observed_notes

    def facts_of(memory: str) -> list:
        return [line for line in memory.split("### Lessons")[0].splitlines()
                if line.startswith("- ") and line not in PROTOCOL_FILLER]

    def seen(ep) -> list:           # what protocol_memory transcribes
        return observed_notes([rollout.trajectory_text(ep, traj_chars)])

    def keeping(ep, old: str) -> str:
        facts = list(dict.fromkeys(facts_of(old) + seen(ep)))
        while facts and not fits(protocol_text(facts)):
            facts = facts[1:]
        return protocol_text(facts)

    def inferring(ep, old: str) -> str:
        return protocol_text(with_best(seen(ep), inferred_best(ep.observations)))
    return {"transcribing": lambda ep, old: protocol_memory(ep, traj_chars),
            "transcribing, keeping": keeping, "transcribing + best inferred": inferring}


def warmstart_rows(tokenizer, env, tasks, args, decisions: list | None = None, units: list | None = None,
                   writers: list | None = None):
    """Scripted streams rendered exactly as rollouts are: actor rows from run_scripted (loss mask on
    the agent's tokens) and writer rows = the writer prompt rollout.write_memory builds + a target
    memory. Two modes:
      protocol  (default): the actor is protocol_policy and the memory protocol_memory: the action
                syntax, a fixed exploring order, and the memory's shape transcribing what was seen; no
                task knowledge (RL has to teach what to keep);
      imitation: the reference actor (env.reference_policy) and the scripted writer's memory
                (alchemy.memory_text of what it inferred): imitation of the content too.
    `decisions`, if given, receives note_decision_rows of every episode (protocol mode); `units`, if given,
    the warm start's sampling units as lists of row indices: an episode's actor rows (one, or one a turn where
    the actor sees only the latest observation, env.actor_context == "latest"), and each writer row, so that a
    batch holds as many episodes either way; `writers`, if given, the writer rows' indices."""
    streams = curriculum.make_streams(tasks, args.warmstart_streams, order="easy_to_hard", segment=args.segment,
                                      seed=args.seed)
    rows = []
    for _, ep, writer_row in scripted_play(tokenizer, env, streams, args):
        actor = [(r.tokens, r.loss_mask) for r in ep.rows()]
        if units is not None:
            units += [list(range(len(rows), len(rows) + len(actor))), [len(rows) + len(actor)]]
        if writers is not None:
            writers.append(len(rows) + len(actor))
        rows += actor
        rows.append(writer_row)
        if decisions is not None and args.warmstart_mode == "protocol":
            decisions += note_decision_rows(ep)
    return rows


def note_decision_rows(ep) -> list:
    """The turns of a protocol episode where its notes decide the move (alchemy.note_reader_reply gives the
    chain "s1 ... best ... need large pink <action>apply pink s1</action>"), each as its own row: the
    context up to that reply, the loss on the reply alone. They are rare in the episodes (measured on the
    held-out streams: 34 of 741 states, 5%), so a warm start on whole episodes teaches the actor to explore
    and hardly ever to act on its notes (a warm start without these rows left an actor repeating 0.24 of
    those moves, what exploring gives, against 0.86 elsewhere); the warm start gives them their own share of
    each batch (--warmstart-decisions), and with it the actor repeats 0.79 (docs/results.md, v14)."""
    out, turn = [], 0
    for row in ep.rows():
        for span in _spans(row.loss_mask):
            if notes_decide(ep, turn):
                end = span[-1] + 1
                out.append((row.tokens[:end], [0] * span[0] + [1] * (end - span[0])))
            turn += 1
    return out


def notes_decide(ep, turn: int) -> bool:
    """Whether the notes the episode's actor was given (ep.memory) decide an apply in the state its reply
    `turn` answers (alchemy.note_reader_reply's chain), rather than leaving the move to exploring."""
    from alchemy import note_reader_reply
    return turn < len(ep.observations) and "<action>apply" in (note_reader_reply(ep.memory, ep.observations[turn]) or "")


def reading_data(tokenizer, seed: int):
    """The reader's item generator (pretrain.Data over its word pool), built once per warm start."""
    import pretrain
    data = pretrain.Data(tokenizer, seed)
    data.use_pool(pretrain.POOL)
    return data


def reading_rows(data, n: int, rng: random.Random) -> list:
    """n rows of the reader's own curriculum (the mix of pretrain.py's last stage: notes looked up and acted
    on, and the best stone inferred from stone values, over random words), as (tokens, loss mask):
    rehearsed beside the warm start's rows so that imitating the protocol does not overwrite the reading
    (measured: without them, 150 steps at lr 3e-3 took lookup6 from 1.00 to 0.16 and the hop from 0.52 to
    0.00). Random content: no task knowledge."""
    import pretrain
    weights = {r: w for r, w in pretrain.stages(pretrain.Args())[-1][1].items() if pretrain.RUNGS[r]}
    rungs = rng.choices(list(weights), weights=list(weights.values()), k=n)
    return [(it.tokens, it.mask) for it in (getattr(data, r)() for r in rungs)]


def scripted_play(tokenizer, env, streams, args):
    """The scripted agent along every stream, side by side: yields (t, actor Episode, writer row) per task
    t of each stream, in stream order, where the writer row is (tokens, loss mask) of the writer prompt +
    the scripted reply (writer_reply: the memory M(t), which the actor of task t + 1 reads, after a think
    block with --warmstart-writer thinking). args.warmstart_mode picks the agent (warmstart_rows' docstring)."""
    from alchemy import memory_text
    fmt = rollout.ChatFormat(tokenizer)
    memories = [""] * len(streams)
    envs_ = [env] + [env.clone() for _ in streams[1:]]
    for t in range(len(streams[0])):
        ts = [s[t] for s in streams]
        if args.warmstart_mode == "imitation":
            pols = [env.reference_policy(task, notes=m or None) for task, m in zip(ts, memories)]
        else:
            pols = [protocol_policy(m) for m in memories]
        eps = rollout.run_scripted(tokenizer, envs_, ts, pols, memory=memories)
        for i, (ep, pol) in enumerate(zip(eps, pols)):
            if args.warmstart_mode == "imitation":
                reply = new = memory_text(pol.knowledge, ep.task.id, ep.score)
            else:
                reply, new = writer_reply(ep, args.traj_chars, args.warmstart_writer)
            prompt = fmt.prompt(rollout.WRITER_SYSTEM, rollout.writer_prompt(ep, memories[i], args.traj_chars,
                                                                             args.writer_task_last))
            target = fmt.encode(reply) + [fmt.end_id]
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
        for turn, (action, context) in enumerate(zip(ep.actions, reply_contexts(ep))):   # reply turn answers observations[turn]
            states.append(("with_notes" if t else "scratch", action, parse_observation(ep.observations[turn]), context))
    guesses = greedy_replies(model, tokenizer, [s[3] for s in states], args.max_new_tokens)
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


def note_agreement(model, tokenizer, env, streams, args) -> dict:
    """A diagnostic, not a reward: does the actor act on its notes in the task's own context? The protocol
    pair plays the held-out `streams` (each task reading the protocol memory of the one before); in every
    state where those notes decide an apply (note_decision_rows' turns), the actor replies greedily with
    the protocol's history as its context. Returns {"match": share of those moves it repeats, "explore":
    share where the protocol's move without notes is the same (what an actor ignoring them repeats),
    "states": n}."""
    from alchemy import protocol_reply
    protocol = dataclasses.replace(args, warmstart_mode="protocol")
    wanted, contexts, explore = [], [], []
    for t, ep, _ in scripted_play(tokenizer, env, streams, protocol):
        for turn, (action, context) in enumerate(zip(ep.actions, reply_contexts(ep))):
            if t and notes_decide(ep, turn):
                wanted.append(action)
                contexts.append(context)
                explore.append(rollout.parse_action(protocol_reply("", ep.observations[turn])) == action)
    guesses = greedy_replies(model, tokenizer, contexts, args.max_new_tokens) if contexts else []
    n = max(len(wanted), 1)
    return {"match": sum(g == w for g, w in zip(guesses, wanted)) / n, "explore": sum(explore) / n,
            "states": len(wanted)}


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


def reply_contexts(ep) -> list:
    """The context before each of a scripted episode's replies (token ids), in turn order."""
    return [row.tokens[:span[0]] for row in ep.rows() for span in _spans(row.loss_mask)]


def greedy_replies(model, tokenizer, contexts, max_new_tokens: int, chunk: int = 256) -> list:
    """rollout.greedy_actions in eval mode, `chunk` contexts per call (the KV caches of one call grow with
    it: all ~3,000 states of reference_match on 64 held-out streams in one call took 14 GB), the model's
    mode restored after."""
    was_training = model.training
    model.eval()
    guesses = []
    for i in range(0, len(contexts), chunk):
        guesses += rollout.greedy_actions(model, tokenizer, contexts[i:i + chunk], max_new_tokens)
    model.train(was_training)
    return guesses


def _spans(mask) -> list:
    """Runs of consecutive 1s in a loss mask (one per agent reply), as index lists."""
    spans, cur = [], []
    for i, v in enumerate(mask):
        if v:
            cur.append(i)
        elif cur:
            spans.append(cur); cur = []
    return spans + [cur] if cur else spans


def format_validity(model, tokenizer, env, tasks, args, turns=6, with_score=False, episodes=None):
    """Share of greedy actor replies on held-out tasks that are valid actions (and the mean score
    those short episodes reach, if with_score). `episodes`: already played ones, instead of playing."""
    eps = episodes or rollout.run_episodes(model, tokenizer, env, tasks, temperature=0.0, max_turns=turns,
                                           max_new_tokens=args.max_new_tokens)
    n = sum(ep.num_turns for ep in eps)
    bad = sum(ep.num_format_errors + int(ep.info.get("invalid", 0)) for ep in eps)
    validity = 1.0 - bad / max(n, 1)
    return (validity, sum(ep.score for ep in eps) / len(eps)) if with_score else validity


def writer_validity(model, tokenizer, env, tasks, args, turns=6, episodes=None) -> float:
    """Share of greedy writer memories, written after short greedy held-out episodes from an empty
    memory (`episodes`, or played here), that pass the writer's format gate (rewards.writer_format_ok)
    uncut: the memory's shape, which the warm start teaches beside the action syntax."""
    from rewards import writer_format_ok
    eps = episodes or rollout.run_episodes(model, tokenizer, env, tasks, temperature=0.0, max_turns=turns,
                                           max_new_tokens=args.max_new_tokens)
    ws = rollout.write_memory(model, tokenizer, eps, [""] * len(eps), temperature=0.0, **args.writer_settings())
    return sum(w.status == "ok" and writer_format_ok(w.memory, "")[0] for w in ws) / len(ws)


def protocol_agreement(model, tokenizer, env, tasks, args, turns=24) -> float:
    """Share of the protocol actor's moves that the model's greedy reply repeats exactly, in the states of
    the protocol's own held-out episodes from an empty memory (its history as the context). Validity
    counts any valid action; this counts the protocol's: the cash-in moves (a +15 stone into the
    cauldron, a positive stone once the potions are gone) are rare, and an actor that never makes them
    is valid and scores 0."""
    eps = rollout.run_scripted(tokenizer, env, tasks, [protocol_policy("") for _ in tasks], max_turns=turns)
    pairs = [pair for ep in eps for pair in zip(ep.actions, reply_contexts(ep))]
    guesses = greedy_replies(model, tokenizer, [c for _, c in pairs], args.max_new_tokens)
    wanted = [a for a, _ in pairs]
    return sum(g == w for g, w in zip(guesses, wanted)) / max(len(wanted), 1)


def held_out_check(model, tokenizer, env, tasks, args, turns=6) -> dict:
    """On short greedy held-out episodes (one set for the first three): the actor's validity, the mean
    score, the writer's format rate; and the protocol agreement on the first 4 tasks (protocol mode)."""
    eps = rollout.run_episodes(model, tokenizer, env, tasks, temperature=0.0, max_turns=turns,
                               max_new_tokens=args.max_new_tokens)
    validity, score = format_validity(model, tokenizer, env, tasks, args, with_score=True, episodes=eps)
    out = {"validity": validity, "score": score,
           "writer_ok": writer_validity(model, tokenizer, env, tasks, args, episodes=eps)}
    if args.warmstart_mode == "protocol":
        out["agreement"] = protocol_agreement(model, tokenizer, env, tasks[:4], args)
    return out


def warmstart_lr_at(step: int, args) -> float:
    """The warm start's lr at `step` (1-based): `warmstart_lr`, decaying linearly to 0 over `warmstart_steps`.
    Measured on the laptop reader (docs/results.md): at a constant 3e-3 the 300 steps left the reading
    hop at 0.45 / 0.39 (seeds 0 / 1, from 0.97); decaying, at 0.86 / 0.75, with the same agreement (0.85)."""
    return args.warmstart_lr * (1 - (step - 1) / args.warmstart_steps)


def share_counts(n: int, args) -> dict:
    """Rows of a batch of n that each --warmstart-* share takes, rounded, and the episode units left
    (rime.Args refuses shares that leave none)."""
    c = dict(reading=round(n * args.warmstart_reading), writers=round(n * args.warmstart_writer_rows),
             decisions=round(n * args.warmstart_decisions))
    return {**c, "units": n - sum(c.values())}


class Mix:
    """The warm start's rows and its batch recipe, shared by the warm start and RL's rehearsal of it
    (rime.py --rl-rehearsal). A batch of n rows holds round(n * share) reading rows (pretrain.py's rungs,
    --warmstart-reading), turns where the notes decide (--warmstart-decisions) and writer rows alone
    (--warmstart-writer-rows); the rest are whole episode units (an episode's actor rows, or a writer row).
    `reading` (reading_data) is set by the caller when it draws reading rows."""

    def __init__(self, tokenizer, env, args):
        self.args, self.decisions, self.units, self.writers, self.reading = args, [], [], [], None
        self.rows = warmstart_rows(tokenizer, env, env.tasks("train"), args, decisions=self.decisions,
                                   units=self.units, writers=self.writers)
        self.units = self.units or [[i] for i in range(len(self.rows))]

    def counts(self, n: int) -> dict:
        c = share_counts(n, self.args)
        if not self.decisions:           # imitation mode has none: their share goes to the episodes
            c.update(units=c["units"] + c["decisions"], decisions=0)
        return c

    def draw(self, n: int, rng: random.Random) -> list:
        """n rows' worth as (tokens, loss mask); an episode unit of several actor rows counts as one."""
        c, rows = self.counts(n), self.rows
        batch = [rows[i] for u in rng.sample(self.units, min(c["units"], len(self.units))) for i in u]
        batch += [rows[i] for i in rng.sample(self.writers, min(c["writers"], len(self.writers)))]
        batch += reading_rows(self.reading, c["reading"], rng) if c["reading"] else []
        return batch + rng.sample(self.decisions, min(c["decisions"], len(self.decisions)))


def warm_start(learner, tokenizer, env, args, log) -> dict:
    """SFT on the scripted rows until the held-out check passes: the writer's format rate and the actor's
    protocol agreement (protocol mode) or validity (imitation) both at `warmstart_threshold`."""
    gen = learner.gen_model
    held_out = env.tasks("test")[: 8]
    actor_gate = "agreement" if args.warmstart_mode == "protocol" else "validity"

    def passes(c):
        return min(c[actor_gate], c["writer_ok"]) >= args.warmstart_threshold

    def summary(before, after, steps):
        return {**{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
                "steps": steps}
    first = held_out_check(gen, tokenizer, env, held_out, args)
    log({"phase": "warmstart", "step": 0, **first})
    if passes(first):
        print0(f"warm start skipped: {actor_gate} {first[actor_gate]:.2f} and writer format "
               f"{first['writer_ok']:.2f} >= {args.warmstart_threshold}")
        return summary(first, first, 0)
    mix = Mix(tokenizer, env, args)
    rng = random.Random(args.seed)
    n = mix.counts(args.warmstart_batch)
    print0(f"warm start ({args.warmstart_mode}): {len(mix.rows)} rows, {sum(len(r[0]) for r in mix.rows)} tokens; "
           f"{len(mix.decisions)} turns where the notes decide the move; {n['writers']} of each batch of "
           f"{args.warmstart_batch} from the {len(mix.writers)} writer rows; validity {first['validity']:.2f}")
    if n["reading"]:
        mix.reading = reading_data(tokenizer, rng.randrange(2**31))
        print0(f"warm start: {n['reading']} reading rows (pretrain.py's rungs) rehearsed in each batch of {args.warmstart_batch}")
    from tqdm import tqdm
    bar = tqdm(range(1, args.warmstart_steps + 1), desc="warm start", disable=not is_rank0())
    check, step = first, 0
    for step in bar:
        for g in learner.optimizer.param_groups:
            g["lr"] = warmstart_lr_at(step, args)
        batch = mix.draw(args.warmstart_batch, rng)
        b = make_batch([r[0] for r in batch], [[0] * len(r[1]) for r in batch], sft_mask=[r[1] for r in batch])
        stats = learner.update(b)
        bar.set_postfix(sft=f"{stats.get('sft_loss', 0):.3f}")
        if step % 25 == 0 or step == args.warmstart_steps:   # the last check is also the final figure
            check = held_out_check(learner.gen_model, tokenizer, env, held_out, args)
            log({"phase": "warmstart", "step": step, "sft_loss": stats.get("sft_loss"), **check})
            if passes(check):
                break
    for g in learner.optimizer.param_groups:
        g["lr"] = args.lr
    log({"phase": "warmstart", "step": step, **check, "final": True})
    return summary(first, check, step)
