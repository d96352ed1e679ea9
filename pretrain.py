"""The laptop model learns to read before it meets a task: in-context lookup, from synthetic random data.

    python pretrain.py            # build the reader once (~90 min on 2 cores) and cache it; rerun = reuse
    python pretrain.py --check    # the reading ladder: accuracy per rung on held-out items, beside chance
    python pretrain.py --where    # the reader's HF directory (weights + tokenizer; model.load / load_tokenizer)

Why: memory helps only an agent that can find the fact its state needs in its notes. Pretrained chat
models bring that lookup from pretraining (induction heads); a 1.7M model trained from scratch on task
rows never forms it (measured: sparse single-question lookups stay at chance after 1,500 steps), while
dense multi-query recall forms it in a few hundred steps, and the lookup then transfers to note lines.
So the reader is trained here, like a downloaded checkpoint, on a curriculum of rungs:

  recall        six key-value pairs of one-token words on a line, then every key again, values supervised
  copy          a span of words repeated
  lookup6/12    "- key value" note lines (6 or 12) under the memory header, then "need key" -> " value"
  lookup_cap    the same inside a note at the laptop memory cap, among distractor lines in which the key
                word is followed by other words (stone descriptions, quoted outcomes)
  lookup_action the actor's chat context: notes + a state that names the key ("Goal: make s2 key.")
                -> "need key value <action>apply value s2</action>"
  hop           the actor's chat context on an Alchemy-shaped state: the notes' best stone, stones that
                lack one of its words, the notes' "- word colour" lines -> the note reader's reply
                (alchemy.note_action), a chain of copies before the action: "s1 small purple pointy best
                large purple pointy need large pink <action>apply pink s1</action>"
  history       the hop at a later turn: 1-5 earlier moves, their outcomes and the new states before it, as
                rollout.py renders an episode; only the last reply is scored (the cauldron when a stone is
                already the best, else the hop)
  infer         a state's stones and their values, then "- best" -> " large purple pointy": the best stone
                inferred (a -3 stone has every feature at its bad end, ...), the writer's note before any
                stone has shown +15; Alchemy's feature pairs (the game's vocabulary), random stone maps

The phases advance by mastery at a constant lr (their length is not known in advance); then a cool-down
of 300 steps on the last phase's mix with the lr decaying to 0 (the decay of a warm-up / stable / decay
schedule) settles what the constant lr's noise kept moving; then the inference stage (recipe 10): the
infer rung beside that mix, the same lr shape. `--base` builds it from a finished recipe-9 reader.

Every word is drawn at random from the tokenizer's whole-word tokens and paired at random: no fact of
any Alchemy world, task or answer appears (Alchemy's words are among thousands of pairings, never a
world's). What the reader learns is to read notes it is given and act on what they say; what to write,
when to explore and which facts to keep are left to RL (rime.py).

The reader is a directory in Hugging Face format. `reader_dir()` is the shipped copy in the repository
(weights/reader) when its recipe matches this file's, else the cache ($RIME_CACHE or .cache/reader/
<recipe hash>), built on first use with a progress bar and ETA, checkpointed every 100 steps (a killed
build resumes). metrics.jsonl and ladder.json sit beside the weights.

The loop, the ladder and the cache serve any `Course` (a model, a data class with one method per rung, a
curriculum): READER is this file's; camg_reader.py defines camg.py's reader with the same machinery.

Simplified on purpose: one fixed curriculum (phase weights below), Alchemy's words only in the hop rung's
template and the infer rung's feature pairs; no packing (rows of one step are sorted by length into micro-batches instead).
"""

import functools
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import cli

REPO = Path(__file__).resolve().parent
SHIPPED = REPO / "weights" / "reader"
RECIPE_VERSION = 10         # bump when the data or the model changes: the cache key and the shipped check use it


# -----------------------------------------------------------------------------
# config


@dataclass
class Args:
    """Build (or check) the reader. The defaults are the recipe of the shipped weights."""
    steps: int = 3000            # at most this many optimizer steps (the curriculum ends earlier once mastered)
    batch: int = 64              # items per step
    lr: float = 3e-3             # AdamW learning rate (50 warm-up steps, then constant: lr_at)
    anneal_steps: int = 300      # then the cool-down: this many steps of the last phase's mix, lr decaying to 0
    anneal_lr: float = 1e-3      # the cool-down's peak lr (a fresh AdamW, 20 warm-up steps: anneal_lr_at)
    infer_steps: int = 1000      # then the inference stage: the cool-down's mix plus the infer rung, same lr shape
    seed: int = 0
    micro_tokens: int = 4096     # tokens per micro-batch (a step's items, sorted by length, padded per micro-batch)
    checkpoint_every: int = 100  # steps between resumable checkpoints (out/partial.pt)
    eval_items: int = 200        # held-out items per ladder rung
    target: float = 0.9          # the ladder's bar for every rung the tasks use
    out: str = ""                # build into this dir instead of the cache (e.g. weights/reader to ship it)
    base: str = ""               # build from this finished reader of the previous recipe (curriculum + cool-down):
                                 # only the stages it lacks run (recipe 10 from the recipe-9 weights: docs/reader.md)
    check: bool = False          # print the ladder of the reader (building it first if needed); exit 1 below target
    where: bool = False          # print the reader's directory and exit
    threads: int = 0             # CPU threads (0 = all cores)

    def __post_init__(self):
        for name in ("steps", "batch", "micro_tokens", "eval_items", "checkpoint_every"):
            cli.check(getattr(self, name) >= 1, f"{cli.flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("anneal_steps", "infer_steps"):
            cli.check(getattr(self, name) >= 0, f"{cli.flag(name)} must be >= 0, got {getattr(self, name)}")
        cli.check(not self.base or (Path(self.base) / "recipe.json").is_file(),
                  f"--base {self.base!r}: not a finished reader (no recipe.json there)")
        cli.check(not (self.base and self.out and Path(self.base).resolve() == Path(self.out).resolve()),
                  "--base and --out must differ (the build starts by clearing --out)")
        cli.check_number("lr", self.lr, lo=0, lo_open=True)
        cli.check_number("anneal_lr", self.anneal_lr, lo=0, lo_open=True)
        cli.check_number("target", self.target, lo=0)
        cli.check(self.threads >= 0, f"--threads must be >= 0, got {self.threads}")


def recipe(args: Args, course=None) -> dict:
    """What decides a course's weights (READER's: reader_recipe), as JSON reads it back, so that a stored
    recipe compares equal."""
    return json.loads(json.dumps((course or READER).recipe(args)))


def reader_recipe(args: Args) -> dict:
    """READER's recipe: the data version, the model's shape and the optimiser's settings."""
    return {"version": RECIPE_VERSION, "model": MODEL_SHAPE, "vocab": VOCAB_SIZE,
            "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
            "anneal_steps": args.anneal_steps, "anneal_lr": args.anneal_lr,
            "anneal_seed": ANNEAL_SEED, "infer_steps": args.infer_steps,
            "infer_seed": INFER_SEED, "infer_weight": INFER_WEIGHT,
            "phases": PHASES, "gate_every": GATE_EVERY, "pool_seed": POOL_SEED,
            "pool": POOL, "task_words": TASK_WORDS}


def recipe_key(args: Args, course=None) -> str:
    return hashlib.sha256(json.dumps(recipe(args, course), sort_keys=True).encode()).hexdigest()[:12]


# -----------------------------------------------------------------------------
# the model and its tokenizer

MODEL_SHAPE = dict(hidden_size=192, num_layers=4, intermediate_size=512, max_seq_len=8192)   # 1.7M parameters
VOCAB_SIZE = 2048


@functools.lru_cache(maxsize=1)
def domain_text() -> str:
    """Deterministic sample of what the laptop model reads and writes: scripted Alchemy episodes
    (observations, actions, memories) and the role prompts. The BPE's merges are trained on it, so an
    observation takes ~half the tokens and its words are single tokens."""
    import alchemy
    import rollout
    env = alchemy.AlchemyEnv(num_trials=1, seed=99)
    parts = [rollout.ACTOR_SYSTEM, rollout.WRITER_SYSTEM, rollout.MEMORY_HEADER]
    for task in env.tasks("train")[::9][:40]:
        policy = env.reference_policy(task)
        parts += rollout.scripted_text(env, task, policy)
        parts.append(alchemy.memory_text(policy.knowledge, task.id, env.info.get("score", 0.0)))
    return "\n".join(parts)


def new_model(seed: int):
    """The laptop model with random weights: a 4-layer Qwen3 and its BPE (rime.py's "small" before reading)."""
    from model import build_tokenizer, tiny
    tok = build_tokenizer(VOCAB_SIZE, extra_text=domain_text())
    return tiny("qwen3", seed=seed, tokenizer=tok, **MODEL_SHAPE)


# -----------------------------------------------------------------------------
# the data: one generator per rung, random words, answers masked for the loss

# the templates' own words never serve as keys or values (a "need" or a "best" key would be ambiguous)
TEMPLATE_WORDS = set("""need best is now value on the of apply cauldron end trial stones stones potions actions
steps left blocked good features memory goal make again copy no effect into with what you ve learned so far
repository knowledge lessons pitfalls and a to s p for it in be or""".split())


def word_pool(tokenizer) -> list:
    """The tokenizer's whole-word tokens (" word" is one token), minus the templates' words: what a
    random key or value is drawn from."""
    words = []
    for tok_text in tokenizer.get_vocab():
        w = tokenizer.convert_tokens_to_string([tok_text])
        if w.startswith(" ") and w[1:].isalpha() and w[1:].islower() and len(w) >= 3 and w[1:] not in TEMPLATE_WORDS:
            if tokenizer(w, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(tok_text)]:
                words.append(w[1:])
    return sorted(set(words))


@dataclass
class Item:
    tokens: list          # prompt + answer
    mask: list            # 1 on the tokens the loss and the ladder score
    chance: float         # a uniform guess's exact-match rate


class Data:
    """Items of every rung, drawn from one RNG; the chat rungs are rendered with the tokenizer's template
    exactly as rollout.py renders an actor's first turn."""

    def __init__(self, tokenizer, seed: int):
        import rollout
        self.tok, self.rng = tokenizer, random.Random(seed)
        self.all_words = word_pool(tokenizer)
        assert len(self.all_words) >= 60, f"only {len(self.all_words)} one-token words in the tokenizer: too few keys"
        self.words = self.all_words
        self.fmt = rollout.ChatFormat(tokenizer)
        self.rollout = rollout

    def use_pool(self, size: int) -> None:
        """Draw words from the first `size` of the pool only (0 = all of it), always the same ones: the
        words the tasks' notes are made of (TASK_WORDS) first, then a fixed shuffle of the rest."""
        rest = sorted(set(self.all_words) - set(TASK_WORDS))
        random.Random(POOL_SEED).shuffle(rest)
        order = [w for w in TASK_WORDS if w in self.all_words] + rest
        self.words = order[:size] if size else self.all_words

    def enc(self, text: str) -> list:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def text_item(self, prompt: str, answer: str, chance: float) -> Item:
        p, a = self.enc(prompt), self.enc(answer)
        return Item(p + a, [0] * len(p) + [1] * len(a), chance)

    def chat_item(self, user: str, reply: str, chance: float) -> Item:
        p = self.fmt.prompt(self.rollout.ACTOR_SYSTEM, user)
        a = self.fmt.scripted_reply(reply)
        return Item(p + a, [0] * len(p) + [1] * len(a), chance)

    def sample(self, n: int) -> list:
        return self.rng.sample(self.words, n)

    # --- the rungs

    def recall(self) -> Item:
        ws = self.sample(12)
        keys, values = ws[:6], ws[6:]
        # every word after a space, so a key is the same token in the pairs and in the queries
        tokens = self.enc("recall:" + "".join(f" {k} {v}" for k, v in zip(keys, values)) + " |")
        mask = [0] * len(tokens)
        for i in self.rng.sample(range(6), 6):
            k, v = self.enc(" " + keys[i]), self.enc(" " + values[i])
            tokens += k + v
            mask += [0] * len(k) + [1] * len(v)
        return Item(tokens, mask, (1 / 6) ** 6)

    def copy(self) -> Item:
        ws = self.sample(self.rng.randint(3, 8))
        return self.text_item("copy: " + " ".join(ws) + "\nagain:", " " + " ".join(ws), 0.0)

    def notes(self, n: int):
        """n note pairs with distinct keys; distinct values too when the pool has the words, else values
        drawn from the other words (so a value word may also be another line's key)."""
        if 2 * n <= len(self.words):
            ws = self.sample(2 * n)
            return list(zip(ws[:n], ws[n:]))
        keys = self.sample(n)
        return [(k, self.rng.choice([w for w in self.words if w != k])) for k in keys]

    def lookup(self, n: int) -> Item:
        pairs = self.notes(n)
        k, v = self.rng.choice(pairs)
        lines = "\n".join(f"- {a} {b}" for a, b in pairs)
        return self.text_item(f"{self.rollout.MEMORY_HEADER}\n### Repository Knowledge\n{lines}\n\nneed {k}", f" {v}", 1 / n)

    def lookup6(self) -> Item:
        return self.lookup(6)

    def lookup12(self) -> Item:
        return self.lookup(12)

    def distractors(self, key_words: list, n: int) -> list:
        """Lines in which note keys are followed by other words: stone-like descriptions, quoted outcomes,
        plain lessons (the hard negatives of a lookup by the token before the value)."""
        lines = []
        for _ in range(n):
            kind = self.rng.randrange(3)
            a, b, c = self.sample(3)
            k = self.rng.choice(key_words)
            if kind == 0:
                lines.append(f"- s{self.rng.randint(1, 4)} is now {k} {b} {c} (value {self.rng.choice('-+')}1).")
            elif kind == 1:
                lines.append(f"- p{self.rng.randint(1, 8)} {a} on s{self.rng.randint(1, 4)}: no effect.")
            else:
                lines.append(f"- {a.capitalize()} the {k} {b} before the {c}.")
        return lines

    def lookup_cap(self) -> Item:
        pairs = self.notes(self.rng.randint(4, 8))
        k, v = self.rng.choice(pairs)
        lines = [f"- {a} {b}" for a, b in pairs] + self.distractors([a for a, _ in pairs], self.rng.randint(4, 7))
        self.rng.shuffle(lines)
        lessons = "\n".join(f"- {x.capitalize()} {y} {z}." for x, y, z in (self.sample(3) for _ in range(2)))
        memory = "### Repository Knowledge\n" + "\n".join(lines) + "\n\n### Lessons & Pitfalls\n" + lessons
        return self.text_item(f"{self.rollout.MEMORY_HEADER}\n{memory}\n\nneed {k}", f" {v}", 1 / len(pairs))

    def state_text(self, stones: dict, potions, steps: int = None) -> str:
        """An Alchemy-shaped observation (alchemy.AlchemyEnv's template) with these stones and potions
        (a list of colours numbered from p1, or a dict id -> colour)."""
        st = "; ".join(f"s{i} {' '.join(w)} (value {v:+d})" for i, (w, v) in stones.items()) or "none"
        ids = potions.items() if isinstance(potions, dict) else enumerate(potions, 1)
        po = ", ".join(f"p{i} {c}" for i, c in ids) or "none"
        steps = self.rng.randint(8, 20) if steps is None else steps
        return (f"Trial 1 of 1, {steps} steps left.\nStones: {st}\nPotions: {po}\n"
                "Actions: apply P S | cauldron S | end")

    def world(self):
        """Random stand-ins for Alchemy's words: 3 feature pairs, 6 potion colours, a best stone, the notes."""
        ws = self.sample(12)
        features, colours = [ws[0:2], ws[2:4], ws[4:6]], ws[6:12]
        best = tuple(self.rng.choice(pair) for pair in features)
        values = [w for pair in features for w in pair]
        needs = dict(zip(values, self.rng.sample(colours, 6)))          # feature word -> colour, at random
        return features, colours, best, needs

    def memory(self, needs: dict, best, keep: list, features) -> str:
        """A memory in the writer's shape: "- word colour" notes (as written, or inside quoted outcomes),
        the best stone, distractors and lessons, in random order."""
        lines = []
        for w in keep:
            if self.rng.random() < 0.5:
                lines.append(f"- {w} {needs[w]}")
            else:       # a quoted outcome line: the note inside it, then a stone description
                look = " ".join(self.rng.choice(pair) if w not in pair else w for pair in features)
                lines.append(f"- p{self.rng.randint(1, 8)} {needs[w]} on s{self.rng.randint(1, 4)}: {w} {needs[w]}. "
                             f"s{self.rng.randint(1, 4)} is now {look} (value {self.rng.choice(('-1', '+1', '-3'))}).")
        lines.append("- best " + " ".join(best))
        lines += self.distractors([w for pair in features for w in pair], self.rng.randint(0, 2))
        self.rng.shuffle(lines)
        lessons = "\n".join(f"- {x.capitalize()} {y} {z}." for x, y, z in (self.sample(3) for _ in range(2)))
        return "### Repository Knowledge\n" + "\n".join(lines) + "\n\n### Lessons & Pitfalls\n" + lessons

    def lookup_action(self) -> Item:
        """One stone, which lacks the key word the goal names: the lookup and the action it implies, with no
        choice of stone (that is the hop's). Measured (recipe 5): with three stones and the goal naming
        one of them, the reader got the key and its value right in 97% of items and the stone in a third.
        With one stone (recipe 6) it still writes one fixed id, not the stone's; a phase of its own (recipe 7,
        not shipped) did not form the copy either, which here competes with the hop (docs/reader.md)."""
        features, colours, best, needs = self.world()
        keep = self.rng.sample(list(needs), self.rng.randint(2, 6))
        k = self.rng.choice(keep)
        sid = self.rng.randint(1, 4)
        pair = next(p for p in features if k in p)
        words = tuple(self.rng.choice([w for w in p if w != k]) if p is pair else self.rng.choice(p) for p in features)
        stones = {sid: (words, self.rng.choice((-3, -1, 1)))}
        potions = self.rng.sample(colours, 5) + [needs[k]]
        self.rng.shuffle(potions)
        user = (f"{self.rollout.MEMORY_HEADER}\n{self.memory(needs, best, keep, features)}\n\n"
                f"{self.state_text(stones, potions)}\nGoal: make s{sid} {k}.")
        return self.chat_item(user, f"need {k} {needs[k]} <action>apply {needs[k]} s{sid}</action>", 1 / len(keep))

    def hop(self) -> Item:
        """The note reader's decision (alchemy.note_action) on a random world, in states where the notes
        decide it: one in ten holds a +15 stone (the cauldron), the rest need a lookup (a state the notes
        do not decide is redrawn)."""
        from alchemy import cauldron_text, changed_text, note_action
        cauldron = self.rng.random() < 0.1
        while True:
            features, colours, best, needs = self.world()
            keep = self.rng.sample(list(needs), self.rng.randint(2, 6))
            stones = {}
            for i in range(1, self.rng.randint(1, 4) + 1):
                words = tuple(self.rng.choice(p) for p in features)
                same = sum(a == b for a, b in zip(words, best))
                stones[i] = (words, 15 if same == 3 else 2 * same - 3)
            if cauldron:
                sid = self.rng.choice(list(stones))
                stones[sid] = (best, 15)
            potions = [self.rng.choice(colours) for _ in range(self.rng.randint(4, 8))]
            reply = note_action({w: needs[w] for w in keep}, best, stones, set(potions))
            if reply is not None and reply.startswith("<action>cauldron") == cauldron:
                break
        user = f"{self.rollout.MEMORY_HEADER}\n{self.memory(needs, best, keep, features)}\n\n{self.state_text(stones, potions)}"
        return self.chat_item(user, reply, 1 / (len(set(potions)) * len(stones)))


    def history(self) -> Item:
        """The hop at a later turn: the actor's chat after 1-5 earlier moves in the same random world, each
        move followed by its outcome, the new state and the turn budget as rollout.py renders them; the
        reply must act on the latest state only. Earlier moves are the note reader's where the notes
        decide, else (and half the time anyway) a random potion on a random stone; they carry no loss.
        Three in ten items end on a +15 stone (the cauldron: the cash-in after the move that made it),
        the rest on a lookup; a history whose last state the notes do not decide is redrawn."""
        cauldron = self.rng.random() < 0.3
        while True:
            item = self._history(cauldron)
            if item is not None:
                return item

    def _history(self, cauldron: bool):
        from alchemy import cauldron_text, changed_text, note_action
        features, colours, best, needs = self.world()
        keep = self.rng.sample(list(needs), self.rng.randint(2, 6))
        notes, gives = {w: needs[w] for w in keep}, {c: w for w, c in needs.items()}   # colour -> word it gives
        axis = {w: a for a, pair in enumerate(features) for w in pair}

        def value(words):
            same = sum(a == b for a, b in zip(words, best))
            return 15 if same == 3 else 2 * same - 3
        stones = {}
        for i in range(1, self.rng.randint(1, 3) + 1):
            words = tuple(self.rng.choice(p) for p in features)
            stones[i] = (words, value(words))
        potions = {i: self.rng.choice(colours) for i in range(1, self.rng.randint(5, 9) + 1)}
        turns, steps = 20, self.rng.randint(14, 20)
        user = f"{self.rollout.MEMORY_HEADER}\n{self.memory(needs, best, keep, features)}\n\n{self.state_text(stones, potions, steps)}"
        tokens = self.fmt.prompt(self.rollout.ACTOR_SYSTEM, user)
        for _ in range(self.rng.randint(1, 5)):
            reply = note_action(notes, best, stones, set(potions.values()))
            if reply is None or self.rng.random() < 0.5:
                if not potions:
                    return None
                reply = f"<action>apply {self.rng.choice(list(potions.values()))} s{self.rng.choice(list(stones))}</action>"
            act = reply.split("<action>")[1].split("</action>")[0].split()
            sid = int(act[-1][1:])
            if act[0] == "cauldron":
                words, v = stones.pop(sid)
                outcome = cauldron_text(sid, v, " ".join(words))
            else:
                pid = min(p for p, c in potions.items() if c == act[1])
                colour, (words, _) = potions.pop(pid), stones[sid]
                w = gives[colour]
                if words[axis[w]] == w:
                    outcome = f"p{pid} {colour} on s{sid}: no effect."
                else:
                    words = tuple(w if a == axis[w] else x for a, x in enumerate(words))
                    stones[sid] = (words, value(words))
                    outcome = f"p{pid} {colour} on s{sid}: " + changed_text(w, colour, sid, " ".join(words), stones[sid][1])
            steps, turns = steps - 1, turns - 1
            if not stones:
                return None
            tokens += self.fmt.scripted_reply(reply) + self.fmt.user_turn(
                f"{outcome}\n{self.state_text(stones, potions, steps)}\n{self.rollout.budget_line(turns, 20)}", True)
        final = note_action(notes, best, stones, set(potions.values()))
        if final is None or final.startswith("<action>cauldron") != cauldron:
            return None
        answer = self.fmt.scripted_reply(final)
        return Item(tokens + answer, [0] * len(tokens) + [1] * len(answer),
                    1 / (len(stones) if cauldron else len(set(potions.values())) * len(stones)))


    def infer(self) -> Item:
        """The best stone's look inferred from stones and their values: an observation's state, then the
        note "- best" -> " large purple pointy". The writer's note when no stone has shown +15 yet (measured:
        worth +0.25 a stream over transcribing to the v14 actor, docs/results.md). Alchemy's three feature
        pairs are the game's vocabulary, the same in every world; the stone map (which end of each pair is
        good) and the 2-4 stones are random, and an item is kept only when the values settle all three
        features and no stone is the best itself (+15 would state it: a copy, not the inference). The
        rule to learn: a stone's value is -3 + 2 per feature at its good end (+15 with all three)."""
        from alchemy import stone_text, stone_value
        while True:
            flips = self.rng.randrange(8)                       # look bits ^ flips = the latent corner
            looks = self.rng.sample(range(8), self.rng.randint(2, 4))
            values = {b: stone_value(b ^ flips) for b in looks}
            if 7 ^ flips in values:
                continue
            maps = [m for m in range(8) if all(stone_value(b ^ m) == v for b, v in values.items())]
            if len({7 ^ m for m in maps}) == 1:
                break
        stones = {i: (tuple(stone_text(b).split()), v) for i, (b, v) in enumerate(values.items(), 1)}
        others = [w for w in self.words if w not in FEATURE_WORDS] or self.words   # potions are never feature words
        potions = [self.rng.choice(others) for _ in range(self.rng.randint(3, 8))]
        return self.text_item(f"{self.state_text(stones, potions)}\n- best", " " + stone_text(7 ^ flips), 1 / 8)


# rung -> used by the tasks (the ladder's target applies), in curriculum order
RUNGS = {"recall": False, "copy": True, "lookup6": True, "lookup12": True, "lookup_cap": True,
         "lookup_action": True, "hop": True, "history": True, "infer": True}
STAGE_ONLY = {"infer"}      # rungs only a stage after the curriculum trains: the curriculum's gates leave them out
# The curriculum, by mastery: (phase, words in the pool (0 = all), {rung: weight}, share of --batch, gate).
# A phase ends when every gate rung reaches its accuracy on a 64-item check of the phase's pool (every
# GATE_EVERY steps); the last phase ends when every rung the tasks use reaches --target, or at --steps.
# Dense recall comes first: the lookup forms there (its loss falls from ~1.8 to ~0.4 nats within ~150
# steps, after ~250). Then the lookup moves to note lines, then to notes that must be acted on. The
# last phase's rows are the actor's whole first turn (~4x longer), so its steps take half the items.
# The pool is the 12 words the tasks' notes are made of (TASK_WORDS: a vocabulary, never a pairing;
# every item pairs them at random). Measured, and why not more: over 24 or more words from scratch the
# recall loss stays at the pool's uniform for 700 steps; a recall formed over 12 words and then widened
# to 24 stayed at ~1.7 nats (one of the six values, not which) for 600 steps. Lookups over other words
# are the ladder's "all words" column.
PHASES = [("recall", 12, {"recall": 1.0}, 1.0, {"recall": 0.5}),
          ("notes", 12, {"recall": 0.2, "copy": 0.1, "lookup6": 0.3, "lookup12": 0.15, "lookup_cap": 0.25}, 1.0,
           {"lookup6": 0.8, "lookup12": 0.8, "lookup_cap": 0.8}),     # the last phase goes on training them
          ("acting", 12, {"recall": 0.1, "copy": 0.05, "lookup6": 0.05, "lookup12": 0.05, "lookup_cap": 0.1,
                          "lookup_action": 0.15, "hop": 0.2, "history": 0.3}, 0.5, None)]
POOL = 12                   # the words the reader is trained and checked on
POOL_SEED = 5               # the fixed shuffle of the other words (Data.use_pool)
TASK_WORDS = [w for pair in ("small large".split(), "blue purple".split(), "round pointy".split()) for w in pair] + \
    "red green orange cyan yellow pink".split()     # alchemy.FEATURES and COLOURS (tests check they agree)
FEATURE_WORDS = set(TASK_WORDS[:6])   # the feature pairs' words: the infer rung's stones, never its potions
GATE_EVERY = 50


@dataclass(frozen=True)
class Course:
    """What one reader is taught: its model, its data (one method per rung) and its curriculum. READER is
    rime.py's (Alchemy's words, the constants above); camg_reader.COURSE is camg.py's (random spans of
    CAMG's BPE). Every function below takes a course; none given means READER."""
    name: str                   # the cache's folder: $RIME_CACHE/<name>/<recipe hash>
    shipped: Path               # the copy in the repository, used when its recipe.json is this recipe
    new_model: object           # seed -> (model, tokenizer) with random weights
    data: type                  # the item generator: Data or a subclass
    rungs: dict                 # rung -> used by the tasks (the ladder's target applies), curriculum order
    phases: list                # the curriculum (PHASES' shape)
    pool: int                   # words the rungs draw from (0: the data's whole pool)
    recipe: object              # args -> the recipe dict (READER's: reader_recipe)
    stages: object              # args -> [(name, {rung: weight}, steps, item seed)] after the curriculum
    args: type = None           # its Args (the defaults are the shipped recipe); None: Args
    stage_only: frozenset = frozenset()
    base_stages: tuple = ()     # ((recipe version, stages a finished reader of it has), ...)

    def __post_init__(self):
        object.__setattr__(self, "args", self.args or Args)
        object.__setattr__(self, "base_stages", dict(self.base_stages))


# -----------------------------------------------------------------------------
# training


def batch_tensors(items: list, pad_id: int):
    """Right-padded [B, T] tokens and the loss mask (shifted: mask[t] scores the prediction of token t+1)."""
    T = max(len(it.tokens) for it in items)
    x = torch.full((len(items), T), pad_id, dtype=torch.long)
    m = torch.zeros(len(items), T, dtype=torch.bool)
    for i, it in enumerate(items):
        x[i, :len(it.tokens)] = torch.tensor(it.tokens)
        m[i, :len(it.mask) - 1] = torch.tensor(it.mask[1:], dtype=torch.bool)
    return x, m


def micro_batches(items: list, max_tokens: int) -> list:
    """A step's items sorted by length and cut into micro-batches of at most max_tokens padded tokens."""
    items = sorted(items, key=lambda it: len(it.tokens))
    out, cur = [], []
    for it in items:
        if cur and (len(cur) + 1) * len(it.tokens) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(it)
    return out + [cur] if cur else out


def train_step(model, opt, items: list, pad_id: int, micro_tokens: int) -> float:
    """One optimizer step: the mean answer-token cross-entropy over every item, summed over micro-batches."""
    total = sum(sum(it.mask) for it in items)
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for mb in micro_batches(items, micro_tokens):
        x, m = batch_tensors(mb, pad_id)
        logits = model(x)                                               # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits[m], x[:, 1:][m[:, :-1]], reduction="sum") / total
        loss.backward()
        loss_sum += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss_sum


def lr_at(step: int, args: Args) -> float:
    """Linear warm-up over 50 steps, then constant: the curriculum's length is decided by mastery, not
    fixed in advance, so there is no end for a decay to aim at. The decay comes after it (anneal_lr_at)."""
    return args.lr * min(1.0, (step + 1) / 50)


def anneal_lr_at(i: int, args: Args, steps: int = None) -> float:
    """A stage's lr at its step i: 20 warm-up steps (its AdamW is fresh) to anneal_lr, then linear to 0 at
    its `steps` (the cool-down's: anneal_steps). Measured on the recipe-8 reader (docs/reader.md, "The
    cool-down"): 300 such steps took the hop 0.695 -> 0.92 and 1-of-12 0.680 -> 0.895; at a constant lr
    the gate checks swung 0.47-0.70."""
    steps = args.anneal_steps if steps is None else steps
    return args.anneal_lr * min(1.0, (i + 1) / 20) * (1 - i / steps)


ANNEAL_SEED = 4_242         # + --seed: the cool-down's items (neither the curriculum's stream nor a check's)
INFER_SEED = 7_777          # + --seed: the inference stage's items
INFER_WEIGHT = 0.7          # the infer rung's share of the inference stage's items (the rest: the cool-down's mix)


def stages(args: Args, course=None) -> list:
    """The stages after a course's curriculum, each a fresh AdamW with anneal_lr_at's lr on a fixed mix of
    items: (name, {rung: weight}, steps, item seed)."""
    return (course or READER).stages(args)


def reader_stages(args: Args) -> list:
    """READER's stages: the cool-down settles the curriculum's last phase; the inference stage adds the
    infer rung (recipe 10) while rehearsing that mix."""
    last = PHASES[-1][2]
    mix = {**{r: w * (1 - INFER_WEIGHT) for r, w in last.items()}, "infer": INFER_WEIGHT}
    return [("cool-down", last, args.anneal_steps, ANNEAL_SEED), ("infer", mix, args.infer_steps, INFER_SEED)]


# rime.py's reader; a finished recipe-9 reader has the curriculum and the cool-down (--base builds on it)
READER = Course("reader", SHIPPED, new_model, Data, RUNGS, PHASES, POOL, reader_recipe, reader_stages,
                stage_only=frozenset(STAGE_ONLY), base_stages=((9, 1),))


VALIDATION_SEED = 20_011    # the gate checks' items: neither the training stream (--seed) nor the ladder's


@torch.no_grad()
def ladder(model, tokenizer, num_items: int = 200, seed: int = 10_007, rungs=None, pool: int = None,
           course=None) -> dict:
    """Exact-match accuracy per rung on held-out random items (their own RNG; every word of the pool
    unless `pool` says fewer), teacher-forced: every answer token is the argmax given the ones before,
    which is what greedy decoding would write."""
    was = model.training
    model.eval()
    course = course or READER
    data = course.data(tokenizer, seed)
    data.use_pool(course.pool if pool is None else pool)
    out = {}
    for rung in rungs or course.rungs:
        items = [getattr(data, rung)() for _ in range(num_items)]
        hits = []
        for mb in micro_batches(items, 8192):
            x, m = batch_tensors(mb, tokenizer.pad_token_id)
            pred = model(x).argmax(-1)                                   # [B, T]
            right = (pred[:, :-1] == x[:, 1:]) | ~m[:, :-1]
            hits += right.all(dim=1).tolist()
        out[rung] = {"accuracy": sum(hits) / len(hits), "chance": sum(it.chance for it in items) / len(items),
                     "used": course.rungs[rung], "items": len(items)}
    model.train(was)
    return out


def with_all_words(model, tokenizer, result: dict, num_items: int = 64, course=None) -> dict:
    """result, each rung also measured over the whole word pool ("all_words"): words the reader never
    trained on, i.e. how general its reading is beyond the pool."""
    wide = ladder(model, tokenizer, num_items, seed=30_011, rungs=list(result), pool=0, course=course)
    return {r: {**v, "all_words": wide[r]["accuracy"]} for r, v in result.items()}


def ladder_table(result: dict, target: float, course=None) -> str:
    pool = (course or READER).pool
    lines = [f"| rung | accuracy ({f'{pool}-word pool' if pool else 'held out'}) | chance | used by the tasks | >= target | all words |",
             "|---|---|---|---|---|---|"]
    for rung, r in result.items():
        ok = "yes" if r["accuracy"] >= target else ("no" if r["used"] else "-")
        wide = f"{r['all_words']:.3f}" if "all_words" in r else "n/a"
        lines.append(f"| {rung} | {r['accuracy']:.3f} | {r['chance']:.3f} | {'yes' if r['used'] else 'no'} | {ok} | {wide} |")
    return "\n".join(lines)


def ladder_passes(result: dict, target: float) -> bool:
    return all(r["accuracy"] >= target for r in result.values() if r["used"])


def build(args: Args, out: Path, course=None) -> Path:
    """Train the reader into `out` (HF format + recipe.json + ladder.json + metrics.jsonl): the curriculum,
    then the stages (the cool-down, the inference stage). A killed build resumes from out/partial.pt (every
    --checkpoint-every steps); with --base, the build starts from that reader at the first stage it lacks."""
    from model import save
    course = course or READER
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = course.new_model(args.seed)
    opt = new_optimizer(model, args.lr)
    partial, start, current, cool = out / "partial.pt", 0, 0, None     # current: index into the phases
    data = course.data(tok, args.seed)
    plan = stages(args, course)
    if partial.exists():
        state = torch.load(partial, weights_only=False)
        model.load_state_dict(state["model"])
        start, current, cool = state["step"], state["phase"], state.get("cool")
        if cool is None:                         # still in the curriculum
            opt.load_state_dict(state["opt"])
            data.rng.setstate(state["rng"])
        where = plan[cool.get("stage", 0)][0] if cool else course.phases[current][0]
        print(f"pretrain: resuming {out} at step {start} ({where})")
        if (out / "metrics.jsonl").exists():     # drop the rows of the steps after the checkpoint: they rerun
            rows = [r for r in (out / "metrics.jsonl").read_text().splitlines() if json.loads(r)["step"] <= start]
            (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    elif args.base:
        model, tok, start, current, cool = from_base(args, out, course)
    else:
        print(f"pretrain: building the reader (at most {args.steps} + "
              f"{' + '.join(str(n) for _, _, n, _ in plan)} steps, batch {args.batch}) into {out}; "
              "this runs once and is then reused")
    model.train()
    log = open(out / "metrics.jsonl", "a")
    if cool is None:
        end = curriculum(model, opt, data, tok, args, log, partial, start, current, course)
        cool, start = {"end": end, "stage": 0}, end
    for k in range(cool.get("stage", 0), len(plan)):
        anneal(model, tok, args, log, partial, cool, start, k, course)
        start = cool["end"] + plan[k][2]
        cool = {"end": start, "stage": k + 1}
    log.close()
    result = with_all_words(model, tok, ladder(model, tok, args.eval_items, course=course), course=course)
    save(model, tok, out)
    (out / "ladder.json").write_text(json.dumps(result, indent=2))
    (out / "recipe.json").write_text(json.dumps(recipe(args, course), indent=2))
    partial.unlink(missing_ok=True)
    print(ladder_table(result, args.target, course))
    return out


def from_base(args: Args, out: Path, course=None):
    """Start from --base, a finished reader of an earlier recipe whose curriculum and stages are this
    recipe's first ones (same model, data and settings; only later stages differ): its weights, tokenizer
    and metrics rows; the build goes on at the first stage it lacks."""
    from model import load, load_tokenizer
    course = course or READER
    base = Path(args.base)
    stored = json.loads((base / "recipe.json").read_text())
    done = course.base_stages.get(stored.get("version"))
    mine = {k: v for k, v in recipe(args, course).items() if k in stored and k != "version"}
    if done is None or stored != {**mine, "version": stored["version"]}:
        cli.fail("pretrain.py", f"--base {base}: its recipe is not this recipe's first stages "
                 f"(version {stored.get('version')}, this file builds on {sorted(course.base_stages)})")
    rows = (base / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    end = json.loads(rows[-1])["step"]
    print(f"pretrain: starting from {base} (recipe {stored['version']}, step {end}): "
          f"{', '.join(name for name, _, _, _ in stages(args, course)[done:])} to run")
    return load(base), load_tokenizer(base), end, len(course.phases) - 1, {"end": end, "stage": done}


def new_optimizer(model, lr: float):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def step_items(data, weights: dict, n: int) -> list:
    """n items of a step, each from a rung drawn by `weights` (the curriculum's and the cool-down's draw)."""
    return [getattr(data, r)() for r in data.rng.choices(list(weights), weights=list(weights.values()), k=n)]


def save_partial(partial: Path, **state) -> None:
    tmp = partial.with_name(partial.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, partial)


def curriculum(model, opt, data, tok, args: Args, log, partial: Path, start: int, current: int, course=None) -> int:
    """The phases by mastery, from step `start` in phase `current`; returns the number of steps taken."""
    from tqdm import tqdm
    course = course or READER
    phases = course.phases
    bar = tqdm(range(start, args.steps), desc="pretrain (reading)", initial=start, total=args.steps)
    t0, done, step = time.time(), False, start - 1
    for step in bar:
        name, pool, weights, share, gate = phases[current]
        data.use_pool(pool)
        items = step_items(data, weights, max(1, int(args.batch * share)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = train_step(model, opt, items, tok.pad_token_id, args.micro_tokens)
        bar.set_postfix(phase=name, loss=f"{loss:.3f}")
        row = {"step": step + 1, "phase": name, "loss": loss, "lr": lr_at(step, args), "s": time.time() - t0}
        if (step + 1) % GATE_EVERY == 0:
            # the gate: this phase's rungs (the last phase: every rung the tasks use) on validation items
            bars = gate or {r: args.target for r, used in course.rungs.items() if used and r not in course.stage_only}
            row["gate"] = gate_check(model, tok, list(bars), pool, course)
            bar.write(f"step {step + 1} ({name}): loss {loss:.3f}; " + ", ".join(f"{r} {a:.2f}" for r, a in row["gate"].items()))
            if all(row["gate"][r] >= b for r, b in bars.items()):
                if current + 1 < len(phases):
                    current += 1
                    bar.write(f"step {step + 1}: phase {name} mastered, next: {phases[current][0]}")
                else:
                    done = True
        log.write(json.dumps(row) + "\n")
        log.flush()
        if done:
            bar.write(f"step {step + 1}: every rung the tasks use is at {args.target} or more: done")
            break
        if (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            save_partial(partial, model=model.state_dict(), opt=opt.state_dict(), rng=data.rng.getstate(),
                         step=step + 1, phase=current)
    bar.close()
    return step + 1


def gate_check(model, tok, rungs: list, pool: int, course=None) -> dict:
    """Accuracy per rung on the 64 validation items of the gate checks."""
    check = ladder(model, tok, 64, seed=VALIDATION_SEED, rungs=rungs, pool=pool, course=course)
    return {r: c["accuracy"] for r, c in check.items()}


def anneal(model, tok, args: Args, log, partial: Path, cool: dict, start: int, k: int, course=None) -> None:
    """Stage k of stages(): its steps of its mix with a fresh AdamW whose lr decays to 0 (anneal_lr_at), on
    items of its own seed; `cool` holds the step where the stage began ("end") and, when resuming, its
    optimizer and data state. The curriculum runs at a constant lr (its length is decided by mastery), and
    its last checkpoints swing with that lr's noise; the decay settles them."""
    from tqdm import tqdm
    course = course or READER
    name, weights, steps, seed = stages(args, course)[k]
    pool, share = course.phases[-1][1], course.phases[-1][3]
    opt = new_optimizer(model, args.anneal_lr)
    data = course.data(tok, args.seed + seed)
    data.use_pool(pool)
    if "opt" in cool:
        opt.load_state_dict(cool["opt"])
        data.rng.setstate(cool["rng"])
    end, first = cool["end"], start - cool["end"]
    # the cool-down watches the curriculum's rungs; a later stage also its own
    watched = [r for r, used in course.rungs.items()
               if (used and r not in course.stage_only) or (r in course.stage_only and r in weights)]
    bar = tqdm(range(first, steps), desc=f"pretrain ({name})", initial=first, total=steps)
    t0 = time.time()
    for i in bar:
        items = step_items(data, weights, max(1, int(args.batch * share)))
        lr = anneal_lr_at(i, args, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = train_step(model, opt, items, tok.pad_token_id, args.micro_tokens)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}")
        row = {"step": end + i + 1, "phase": name, "loss": loss, "lr": lr, "s": time.time() - t0}
        if (i + 1) % GATE_EVERY == 0:           # watched, not gated: a stage runs its steps
            row["gate"] = gate_check(model, tok, watched, pool, course)
            bar.write(f"{name} step {i + 1}: loss {loss:.3f}; " + ", ".join(f"{r} {a:.2f}" for r, a in row["gate"].items()))
        log.write(json.dumps(row) + "\n")
        log.flush()
        if (end + i + 1) % args.checkpoint_every == 0 and i + 1 < steps:
            save_partial(partial, model=model.state_dict(), step=end + i + 1, phase=len(course.phases) - 1,
                         cool={"end": end, "stage": k, "opt": opt.state_dict(), "rng": data.rng.getstate()})
    bar.close()


def cache_dir(args: Args, course=None) -> Path:
    course = course or READER
    return Path(os.environ.get("RIME_CACHE") or REPO / ".cache") / course.name / recipe_key(args, course)


def shipped_matches(args: Args, course=None) -> bool:
    course = course or READER
    try:
        return json.loads((course.shipped / "recipe.json").read_text()) == recipe(args, course)
    except (OSError, ValueError):
        return False


def reader_dir(args: Args = None, build_if_missing: bool = True, course=None) -> Path:
    """The reader's HF directory: the shipped weights when their recipe is this file's, else the cache
    (built now if missing and build_if_missing)."""
    course = course or READER
    args = args or course.args()
    if shipped_matches(args, course):
        return course.shipped
    d = cache_dir(args, course)
    if not (d / "recipe.json").exists() and build_if_missing:
        build(args, d, course)
    return d


def load_reader(args: Args = None, course=None):
    """(model, tokenizer) of the reader: rime.py's "small" model starts here (camg.py's from
    camg_reader.COURSE's)."""
    from model import load, load_tokenizer
    d = reader_dir(args, course=course)
    return load(d), load_tokenizer(d)


def main(argv=None, course=None, prog: str = "pretrain.py", doc: str = None):
    course = course or READER
    args = cli.parse(course.args, argv, prog=prog, description=(doc or __doc__).split("\n\n")[0])
    if args.where:
        print(reader_dir(args, build_if_missing=False, course=course))
        return
    if args.out:
        out = Path(args.out)
        if (out / "recipe.json").exists() and json.loads((out / "recipe.json").read_text()) == recipe(args, course):
            print(f"{prog}: {out} already holds this recipe's reader")
        else:
            if out.exists() and not (out / "partial.pt").exists():
                shutil.rmtree(out)
            build(args, out, course)
        d = out
    else:
        d = reader_dir(args, course=course)
    if args.check:
        from model import load, load_tokenizer
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
        model, tok = load(d), load_tokenizer(d)
        result = with_all_words(model, tok, ladder(model, tok, args.eval_items, course=course), course=course)
        print(f"reading ladder of {d} ({args.eval_items} held-out items per rung, target {args.target}):")
        print(ladder_table(result, args.target, course))
        if not ladder_passes(result, args.target):
            print(f"{prog}: a rung the tasks use is under the target", file=sys.stderr)
            sys.exit(1)
    else:
        print(d)


if __name__ == "__main__":
    main(sys.argv[1:])
