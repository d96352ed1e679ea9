"""CAMG's reader: camg.py's laptop model learns to copy spans and read keyed notes before it meets a task.

    python camg_reader.py            # build it once (~4 h at 1 thread) and cache it; rerun = reuse
    python camg_reader.py --check    # its reading ladder: accuracy per rung on held-out random items
    python camg_reader.py --where    # its HF directory (weights + tokenizer; model.load / load_tokenizer)

Why: a relay task is solved only by copying a fact (a shopping option, a person's name, a column) from
the note into CONTINUATION.md before a context reset and from the file into a command after it. The
1.9M model trained from random weights on the reference trajectories learned the protocol's shape but
wrote garbled names (docs/results.md, "CAMG"). Measured in isolation (docs/camg.md, "The reader"): the
same model copies a held-out span of 3-12 random tokens of its whole 2,048-token BPE exactly in 94% of
items after 300 steps of random spans, so the skill is cheap, just never in the task data. So, as for
RIME's reader (pretrain.py, whose training loop, ladder and cache this file reuses as a `Course`):

  copy      a span of random words repeated ("copy: ... again:" -> the words)
  span      the same, the span's words drawn with replacement from 3-5 words, so that the token before a
            position occurs elsewhere in the span: copying by the token before fails there, and the copy
            must keep its place (the keyed carry's note repeats its attribute words the same way)
  lookup    "- thing attr value" note lines (4-17, a thing may have several), then "need thing attr" ->
            " value": the Shop note's shape until recipe 8 (measured beside the others: no hop needs it)
  save_line the actor's chat: a task naming a thing, the action that shows a note, the note; the reply
            saves the thing's line (Shop's note since recipe 8: a line per thing, "- thing attr value attr
            value", its values repeating across things), or a memo's sentence (DeepResearch's `- memo:
            ...`), or a lab note's tail (AutoResearch's `- best recipe: ...`), to CONTINUATION.md as
            camg_memory's reference agents write them: a choice of line, then a copy
  save      the same with recipe 7's Shop note, a line per attribute ("- thing attr value"): measured, and
            still in recipe 7's save stage so that it stays what it was
  carry     the save as recipes 2-6 trained it (its memos after their title in lower case, a shape no
            task has): measured, and still in the earlier stages' mixes so that they stay what they were
  reread    the chat after a context reset: the task, `cat CONTINUATION.md` and the saved lines, then a
            page that asks for one of the thing's attributes (the reply clicks the saved value), or a saved
            memo "... is <name>." (the reply searches for the name); the value follows `[ ` as the
            reference policies write it, so it is the same tokens as where it was read; `reread_line`
            is the same after a save_line (the tasks' form), `reread` after recipe 7's lines

Every word is a random span of the BPE's alphanumeric tokens (a word-start token, then 0-2 pieces): no
environment's names, options or answers are drawn (the templates use the environments' action words).
The course: copying until it passes 0.8, the acting mix, a cool-down, then four stages that decay the lr
again: the repeats stage (span items beside the chat rungs), the keyed stage (mostly carry and reread),
where the two chat rungs rose most, the save stage (the save in the tasks' shapes; docs/camg.md), and the
line stage (the same on Shop's note of a line per thing).
What the reader learns is to find and copy; what to save, when, and what to do with it is left to the
warm start (the reference trajectories) and to RL (camg.py).
"""

import random
import re
import sys
from dataclasses import dataclass

import pretrain
from pretrain import Course, Item

VERSION = 8


@dataclass
class Args(pretrain.Args):
    """Build (or check) CAMG's reader. The defaults are its recipe."""
    steps: int = 1500            # at most this many optimizer steps (the phases end earlier once mastered)
    anneal_steps: int = 200      # then the cool-down (lr decaying to 0 on the last phase's mix)
    infer_steps: int = 0         # (RIME's inference stage: not part of this course)
    repeat_steps: int = 1500     # then the repeats stage (span items beside the acting mix; recipe 4)
    keyed_steps: int = 3000      # then the keyed stage (the chat rungs, most of all the keyed carry; recipe 6)
    save_steps: int = 1000       # then the save stage (the save in the tasks' own form; recipe 7)
    line_steps: int = 1000       # then the line stage (the Shop note of a line per thing; recipe 8)


def new_model(seed: int):
    """camg.py's "small" model with random weights (camg_worker.build_model): a 1.9M Qwen3 and its BPE,
    trained on the environments' text and pinned in weights/camg_bpe.json."""
    import camg_worker
    return camg_worker.build_model("small", "cpu", seed)


_ALNUM = re.compile(r"[A-Za-z0-9]+")


class Data(pretrain.Data):
    """Items of every rung from one RNG. Words are random spans of the tokenizer's alphanumeric tokens;
    the chat rungs are rendered with the chat template as rollout.py renders a CAMG episode."""

    def __init__(self, tokenizer, seed: int):
        import camg_memory
        import rollout
        self.tok, self.rng = tokenizer, random.Random(seed)
        self.fmt, self.rollout, self.memory = rollout.ChatFormat(tokenizer), rollout, camg_memory
        starts, pieces = [], []
        for tok_text, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            text = tokenizer.convert_tokens_to_string([tok_text])
            if text.startswith(" ") and _ALNUM.fullmatch(text[1:]):
                starts.append(text[1:])
            elif _ALNUM.fullmatch(text):
                pieces.append(text)
        assert len(starts) >= 60 and len(pieces) >= 60, "too few alphanumeric tokens in the tokenizer"
        self.all_starts, self.pieces = starts, pieces
        self.starts = starts

    def use_pool(self, size: int) -> None:
        """Word starts from the first `size` of a fixed shuffle (0 = all): the course trains on all."""
        order = sorted(self.all_starts)
        random.Random(pretrain.POOL_SEED).shuffle(order)
        self.starts = order[:size] if size else self.all_starts

    def word(self) -> str:
        return self.rng.choice(self.starts) + "".join(self.rng.choice(self.pieces) for _ in range(self.rng.randint(0, 2)))

    def words(self, n: int) -> list:
        """n distinct random words."""
        out = []
        while len(out) < n:
            w = self.word()
            if w not in out:
                out.append(w)
        return out

    def phrase(self, lo: int, hi: int) -> str:
        return " ".join(self.words(self.rng.randint(lo, hi)))

    # --- the rungs

    def copy(self) -> Item:
        return self.copy_of(self.phrase(2, 8))

    def copy_of(self, ws: str) -> Item:
        return self.text_item("copy: " + ws + "\nagain:", " " + ws, 0.0)

    def span(self) -> Item:
        """A span of 6-14 words drawn with replacement from 3-5 distinct random words, repeated."""
        vocab = self.words(self.rng.randint(3, 5))
        return self.copy_of(" ".join(self.rng.choice(vocab) for _ in range(self.rng.randint(6, 14))))

    def note(self):
        """A Shop-shaped note: 2-9 things with 1-2 attributes each, one "- thing attr value" line per
        attribute (a thing is 1-2 words); returns [(thing, attr, value)] in the note's order."""
        things = [self.phrase(1, 2) for _ in range(self.rng.randint(2, 9))]
        attrs = self.words(4)
        lines = []
        for t in things:
            for a in self.rng.sample(attrs, self.rng.randint(1, 2)):
                lines.append((t, a, self.word()))
        return lines

    def lookup(self) -> Item:
        lines = self.note()
        while len(lines) < 4:
            lines = self.note()
        t, a, v = self.rng.choice(lines)
        text = "\n".join(f"- {x} {y} {z}" for x, y, z in lines)
        return self.text_item(f"Note:\n{text}\n\nneed {t} {a}", f" {v}", 1 / len(lines))

    def task_text(self, thing: str) -> str:
        """A task's first observation that names `thing` where Shop's relay instruction names its category
        ("<verb> a <thing> that is ..."), among random words (no environment's task). Recipe 2 put the
        thing anywhere among random words: only a word the note also holds could tell it apart, and the
        keyed carry was right in 0 of 82 probed items."""
        article = "an" if thing[0].lower() in "aeiou" else "a"
        return (f"Instruction: {self.word()} {article} {thing} that is {self.phrase(1, 3)}; {self.phrase(1, 4)} "
                f"(note: {self.phrase(2, 4)}, shown only once)\nMemory folder: .agent_memory/ (kept across tasks)")

    def first_turn(self, obs: str) -> str:
        m = self.memory
        return self.rollout.first_user_turn(obs, m.NO_MEMORY + m.KEPT)

    SHOW = (("click[note]", "Shopping note"), ("memo[]", "Memo"), ("note", "Lab note"))

    def carry(self) -> Item:
        """The save after a note as recipes 2-6 trained it: the lines of the thing the task names (a Shop
        note), or the memo's one sentence after the note's title in lower case (a shape no task has),
        written by camg_memory.write_action. Measured, no longer the tasks' form: `save`."""
        action, title = self.rng.choice(self.SHOW)
        if self.rng.random() < 0.7:
            thing, note, saved, chance = self.keyed_note(title)
        else:
            thing = self.word()
            sentence = f"{self.phrase(2, 5)} {self.phrase(1, 3)}."
            note, saved, chance = f"{title} (shown once): {sentence}", [f"- {title.lower()}: {sentence}"], 0.0
        return self.saved_after(thing, action, note, self.memory.write_action(saved), chance)

    def save(self) -> Item:
        """The save after a note as recipe 7 trained it: the lines of the thing the task names (a Shop note
        of a line per attribute, `keyed_note`), or the sentence of a memo (DeepResearch's: `- memo: <its
        sentence>`), or the tail of a lab note after "found the best <w>:" (AutoResearch's: `- best <w>:
        <tail>`), written by camg_memory.write_action. Recipe 6's `carry` lost 20 of its 55 memo items on a
        shape no task has (the title in lower case, "- shopping note: ..."), and its keyed saves mostly
        inside a line. Measured, no longer the tasks' form since recipe 8: `save_line`."""
        return self.save_of(self.keyed_note)

    def save_line(self) -> Item:
        """The save as the tasks make it (recipe 8): `save` with the Shop note of a line per thing
        (`keyed_line`), whose save is that one line."""
        return self.save_of(self.keyed_line)

    def save_of(self, keyed) -> Item:
        """A save whose keyed note (70% of items) comes from keyed(title); the rest a memo or a lab note."""
        action, title = self.rng.choice(self.SHOW)
        if self.rng.random() < 0.7:
            thing, note, saved, chance = keyed(title)
        else:
            thing, chance = self.word(), 0.0
            if self.rng.random() < 0.5:
                action, sentence = "memo[]", f"{self.phrase(2, 5)} {self.phrase(1, 3)}."
                note, saved = f"Memo (shown once): {sentence}", [f"- memo: {sentence}"]
            else:
                action, w, tail = "note", self.word(), self.phrase(2, 6)
                note = f"Lab note (shown once): {self.phrase(3, 8)}. {self.phrase(1, 3)} found the best {w}: {tail}"
                saved = [f"- best {w}: {tail}"]
        return self.saved_after(thing, action, note, self.memory.write_action(saved), chance)

    def keyed_note(self, title: str):
        """A Shop-shaped note under `title`, a thing of it, that thing's lines, and the chance of naming it."""
        lines = self.note()
        thing = self.rng.choice(lines)[0]
        note = f"{title} (shown once):\n" + "\n".join(f"- {x} {y} {z}" for x, y, z in lines)
        return thing, note, [f"- {x} {y} {z}" for x, y, z in lines if x == thing], 1 / len({x for x, _, _ in lines})

    def line_note(self) -> dict:
        """A Shop note of recipe 8: 2-10 things (1-2 words), each with 1-2 of 4 attributes, the values drawn
        with replacement from 3-8 words (as a real note's sizes and colours repeat across its things);
        {thing: [(attr, value)]} in the note's order, written one line per thing (`line_of`)."""
        things = list(dict.fromkeys(self.phrase(1, 2) for _ in range(self.rng.randint(2, 10))))
        attrs, values = self.words(4), self.words(self.rng.randint(3, 8))
        return {t: [(a, self.rng.choice(values)) for a in self.rng.sample(attrs, self.rng.randint(1, 2))]
                for t in things}

    @staticmethod
    def line_of(thing: str, pairs: list) -> str:
        """A thing's line: "- thing attr value attr value" (shop.note_lines' form)."""
        return f"- {thing} " + " ".join(f"{a} {v}" for a, v in pairs)

    def keyed_line(self, title: str):
        """keyed_note's recipe-8 form: a note of a line per thing; its save is the named thing's line."""
        note = self.line_note()
        thing = self.rng.choice(list(note))
        text = f"{title} (shown once):\n" + "\n".join(self.line_of(t, p) for t, p in note.items())
        return thing, text, [self.line_of(thing, note[thing])], 1 / len(note)

    def saved_after(self, thing: str, action: str, note: str, write: str, chance: float) -> Item:
        """The chat of a save: a task naming `thing`, the `action` that shows the note, the note; the reply
        is the `write` action (supervised)."""
        tokens = self.fmt.prompt(self.rollout.ACTOR_SYSTEM, self.first_turn(self.task_text(thing)))
        tokens += self.fmt.scripted_reply(f"<action>{action}</action>") + self.fmt.user_turn(note, True)
        answer = self.fmt.scripted_reply(f"<action>{write}</action>")
        return Item(tokens + answer, [0] * len(tokens) + [1] * len(answer), chance)

    def reread(self) -> Item:
        """After a reset: the task, the `cat` of the saved lines, then either an item page asking for one of
        the thing's attributes among other options (the reply clicks the saved value), or, when the file
        holds a memo whose sentence ends "is <name>." (DeepResearch's), the reply searches for the name. The
        value follows `[ ` (a space, as the reference policies write it): the tokens it had in the file.
        The saved lines are recipe 7's, a line per attribute; since recipe 8 the tasks' form: `reread_line`."""
        return self.reread_of(line=False)

    def reread_line(self) -> Item:
        """`reread` of a save in recipe 8's form: the thing's one line (line_note, line_of)."""
        return self.reread_of(line=True)

    def reread_of(self, line: bool) -> Item:
        other = [f"- {self.word()} {self.phrase(1, 3)}"] * self.rng.randint(0, 1)
        if self.rng.random() < 0.3:
            name = self.phrase(1, 2)
            saved = [f"- memo: {self.phrase(2, 5)} is {name}."] + other
            tokens = self.after_reset(self.word(), saved)
            answer = self.fmt.scripted_reply(f"<action>search[ {name}]</action>")
            return Item(tokens + answer, [0] * len(tokens) + [1] * len(answer), 0.0)
        if line:
            note = self.line_note()
            thing = self.rng.choice(list(note))
            mine = note[thing]
        else:
            lines = self.note()
            thing = self.rng.choice(lines)[0]
            mine = [(a, v) for x, a, v in lines if x == thing]
        k = self.rng.randrange(len(mine))          # the page asks for this one; those before it are chosen
        a, v = mine[k]
        saved = [self.line_of(thing, mine)] if line else [f"- {thing} {x} {y}" for x, y in mine]
        tokens = self.after_reset(thing, saved + other)
        item = f"B{self.rng.randint(10000, 99999)}"
        tokens += self.fmt.scripted_reply(f"<action>click[ {item}]</action>")
        offered, n_options = [], 0
        for x, y in mine:                          # Shop's item page: an option line per attribute
            options = self.words(self.rng.randint(2, 5))
            options.insert(self.rng.randint(0, len(options)), y)
            offered.append(f"{x}: {' '.join(options)}")
            n_options = len(options) if x == a else n_options
        chosen = " ".join(f"{x}={y if i < k else 'none'}" for i, (x, y) in enumerate(mine))
        page = (f"[{item}] {self.phrase(2, 5)} | ${self.rng.randint(5, 199)}.{self.rng.randint(10, 99)}\n"
                + "\n".join(offered) + f"\nselected: {chosen}\nActions: click[option value] | buy | click[back]")
        tokens += self.fmt.user_turn(page, True)
        answer = self.fmt.scripted_reply(f"<action>click[ {v}]</action>")
        return Item(tokens + answer, [0] * len(tokens) + [1] * len(answer), 1 / n_options)


    def after_reset(self, thing: str, saved: list) -> list:
        """The tokens of a fresh context after a reset (rollout's): the task naming `thing`, the reset note,
        the `cat` of CONTINUATION.md and its output, the saved lines."""
        path = self.rollout.CONTINUATION_PATH
        reset = self.rollout.reset_note([path])
        tokens = self.fmt.prompt(self.rollout.ACTOR_SYSTEM, self.first_turn(self.task_text(thing)) + "\n\n" + reset)
        tokens += self.fmt.scripted_reply(f"<action>shell: cat {path}</action>")
        return tokens + self.fmt.user_turn(f"$ cat {path}\n" + "\n".join(saved) + "\n\n(exit 0)", True)


# rung -> used by the tasks. lookup is measured, not required: no hop reads a whole note by two keys (the
# save matches the thing the task names, the read after the reset the attribute among the thing's own
# lines), and over random two-word keys whose attributes repeat it stayed at 0.00 for the 150 steps of a
# notes phase while copying was already at 0.83 (docs/camg.md, "The reader"). The chat rungs the hops use
# are `save_line` and `reread_line`; `carry` is the save in the form recipes 2-6 trained (a memo's title in
# lower case) and `save`/`reread` the save and read of recipe 7's Shop note (a line per attribute), measured,
# no longer the tasks' form
RUNGS = {"copy": True, "lookup": False, "carry": False, "reread": False, "span": False, "save": False,
         "save_line": True, "reread_line": True}
# span is the skill under the keyed carry, measured and trained by the repeats stage only: the reader of
# recipe 3 copied a span of distinct words exactly in 0.97 of items, one whose words repeat in 0.39, and
# 92 of 128 of its keyed carries first went wrong after a token the note holds twice (docs/camg.md)
# save is trained by the save stage only (recipe 7), after the stages recipe 6 ran; save_line and reread_line
# by the line stage only (recipe 8), after the stages recipe 7 ran
STAGE_ONLY = {"span", "save", "save_line", "reread_line"}
# (phase, pool (0 = every word), {rung: weight}, share of --batch, gate): copying forms first (measured:
# ~300 steps), then the chat rungs beside it (rows ~4x longer: half the items a step)
PHASES = [("copy", 0, {"copy": 1.0}, 1.0, {"copy": 0.8}),
          ("acting", 0, {"copy": 0.15, "lookup": 0.15, "carry": 0.35, "reread": 0.35}, 0.5, None)]
ANNEAL_SEED = 4_243
# the repeats stage (recipe 4): after the cool-down, span items beside the chat rungs, the lr decaying from
# --anneal-lr. Measured before it was a stage (a one-off probe from the recipe-3 weights, batch 16, lr 1e-3,
# half span items, 0.3 keyed carry): span exact 0.39 -> 0.73 and whole keyed carries 0.00 -> 0.20 in 1,500
# steps, still rising (docs/camg.md)
REPEATS = {"span": 0.4, "copy": 0.1, "carry": 0.3, "reread": 0.2}
REPEAT_SEED = 6_271
# the keyed stage (recipe 6): a second, longer decay weighted to the two chat rungs. Recipe 5's gate checks
# over its repeats stage: carry 0.08 -> 0.45 and reread 0.59 -> 0.67 in 1,500 steps, still rising where its
# lr reached 0, while span and copy were at 1.0 (so they keep a small share, as rehearsal)
KEYED = {"span": 0.1, "copy": 0.1, "carry": 0.5, "reread": 0.3}
KEYED_SEED = 8_191
# the save stage (recipe 7): the keyed stage's mix and decay with the save in the tasks' form in carry's place.
# Measured from the recipe-6 reader, 1,000 steps, 200 held-out items of each (docs/camg.md, "Recipe 7")
SAVES = {"span": 0.1, "copy": 0.1, "save": 0.5, "reread": 0.3}
SAVE_SEED = 99_001
# the line stage (recipe 8): the save stage's mix and decay on Shop notes of a line per thing (shop.note_lines
# since 2026-12-06). Measured from the recipe-7 reader, 300 steps of such a stage, 200 held-out keyed saves
# (docs/camg.md, "Recipe 8"): a line per thing 0.77 -> 0.95, a line per attribute 0.705 -> 0.71
LINES = {"span": 0.1, "copy": 0.1, "save_line": 0.5, "reread_line": 0.3}
LINE_SEED = 99_013


def bpe_hash() -> str:
    """The pinned BPE's identity (weights/camg_bpe.json): a reader is built on one BPE, so a new BPE is a
    new recipe (and a new cache entry)."""
    import hashlib
    import camg_worker
    return hashlib.sha256(camg_worker.BPE_PATH.read_bytes()).hexdigest()[:16]


def recipe(args: Args) -> dict:
    return {"course": "camg_reader", "version": VERSION, "model": "camg_worker small", "bpe": bpe_hash(),
            "steps": args.steps,
            "batch": args.batch, "lr": args.lr, "seed": args.seed, "anneal_steps": args.anneal_steps,
            "anneal_lr": args.anneal_lr, "anneal_seed": ANNEAL_SEED, "phases": PHASES,
            "repeat_steps": args.repeat_steps, "repeat_seed": REPEAT_SEED, "repeats": REPEATS,
            "keyed_steps": args.keyed_steps, "keyed_seed": KEYED_SEED, "keyed": KEYED,
            "save_steps": args.save_steps, "save_seed": SAVE_SEED, "saves": SAVES,
            "line_steps": args.line_steps, "line_seed": LINE_SEED, "lines": LINES,
            "gate_every": pretrain.GATE_EVERY, "pool_seed": pretrain.POOL_SEED}


def stages(args: Args) -> list:
    return [("cool-down", PHASES[-1][2], args.anneal_steps, ANNEAL_SEED),
            ("repeats", REPEATS, args.repeat_steps, REPEAT_SEED),
            ("keyed", KEYED, args.keyed_steps, KEYED_SEED),
            ("save", SAVES, args.save_steps, SAVE_SEED),
            ("line", LINES, args.line_steps, LINE_SEED)]


# recipe 5 = recipe 4 on a new BPE (Shop's words in fewer pieces); a finished recipe-5 reader has this
# recipe's first two stages, a recipe-6 reader its first three, a recipe-7 reader four (--base builds the
# rest on it)
COURSE = Course("camg_reader", pretrain.REPO / "weights" / "camg_reader", new_model, Data, RUNGS, PHASES, 0,
                recipe, stages, args=Args, stage_only=frozenset(STAGE_ONLY), base_stages=((5, 2), (6, 3), (7, 4)))


def load(build_if_missing: bool = True):
    """(model, tokenizer) of CAMG's reader (camg.py --model reader starts here)."""
    import camg_worker
    from model import load as load_dir, load_tokenizer
    d = pretrain.reader_dir(Args(), build_if_missing, COURSE)
    if not (d / "recipe.json").exists():
        raise SystemExit(f"camg_reader: no reader of this recipe at {d}: build it with `python camg_reader.py`")
    tok = load_tokenizer(d)
    if tok.get_vocab() != camg_worker.small_tokenizer().get_vocab():   # the workers decode with this one
        raise SystemExit(f"camg_reader: {d} has another BPE than camg.py's ({camg_worker.BPE_PATH}): "
                         "bump camg_reader.VERSION and rebuild")
    return load_dir(d), tok


if __name__ == "__main__":
    pretrain.main(sys.argv[1:], course=COURSE, prog="camg_reader.py", doc=__doc__)
