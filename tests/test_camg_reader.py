"""camg_reader.py: CAMG's reading data in the real chat template, its ladder, and a short build through
pretrain.py's loop (kill and resume)."""

import json
import re

import pytest
import torch

import camg_memory
import camg_worker
import camg_reader
import envs
import pretrain


@pytest.fixture(scope="module")
def fresh():
    """camg.py's "small" model with random weights and its BPE (what the reader starts from)."""
    return camg_reader.new_model(seed=0)


def answer_of(tok, item) -> str:
    return tok.decode([t for t, m in zip(item.tokens, item.mask) if m], skip_special_tokens=True)


def chat_items(tok, rung: str, seed: int, n: int = 40):
    """n items of a chat rung as (prompt text, reply text)."""
    data = camg_reader.Data(tok, seed=seed)
    for item in (getattr(data, rung)() for _ in range(n)):
        yield tok.decode(item.tokens[:item.mask.index(1)], skip_special_tokens=True), answer_of(tok, item)


def test_items_mask_exactly_the_answer(fresh):
    _, tok = fresh
    data = camg_reader.Data(tok, seed=1)
    for _ in range(20):
        item = data.lookup()
        prompt = tok.decode(item.tokens[:item.mask.index(1)])
        key = prompt.rsplit("need ", 1)[1]
        line = next(ln for ln in prompt.splitlines() if ln.startswith(f"- {key} "))
        assert answer_of(tok, item) == line[len(f"- {key}"):]
        assert item.mask == [0] * item.mask.index(1) + [1] * (len(item.mask) - item.mask.index(1))
        copy = data.copy()
        text = tok.decode(copy.tokens)
        assert answer_of(tok, copy) == text.split("\nagain:")[0][len("copy:"):]


def test_carry_saves_the_named_things_lines_as_the_reference_agents_write_them(fresh):
    _, tok = fresh
    keyed = 0
    for prompt, reply in chat_items(tok, "carry", seed=2):
        action = re.fullmatch(r"<action>(.*)</action>", reply).group(1)
        note = prompt.rsplit("(shown once):", 1)[1].strip()
        if note.startswith("- "):                               # a Shop-shaped note: the named thing's lines
            keyed += 1
            saved = re.findall(r"'(- [^']*)'", action)
            assert saved and all(line in note.splitlines() for line in saved)
            task = prompt.split("Instruction:", 1)[1].split("(note:")[0]
            things = {ln[2:].rsplit(" ", 2)[0] for ln in saved}
            assert len(things) == 1 and re.search(rf" an? {re.escape(things.pop())} that is ", task)   # Shop's frame
        assert action == camg_memory.write_action(re.findall(r"'(- [^']*)'", action))
    assert 15 <= keyed < 40


@pytest.mark.parametrize("rung", ["save", "save_line"])
def test_save_writes_what_the_tasks_save(fresh, rung):
    """The save rungs in the tasks' own shapes: a Shop-shaped note's lines of the thing the task names (save,
    recipe 7's note: a line per attribute) or that thing's one line, whole (save_line, recipe 8's: a line per
    thing, its values repeating across things); a memo's sentence as DeepResearch's reference saves it
    (`- memo: <sentence>`); a lab note's tail after "found the best <w>:" as AutoResearch's does (`- best
    <w>: <tail>`); written by camg_memory.write_action."""
    _, tok = fresh
    kinds, repeats = set(), 0
    for prompt, reply in chat_items(tok, rung, seed=5, n=60):
        action = re.fullmatch(r"<action>(.*)</action>", reply, re.S).group(1)
        saved = re.findall(r"'(- [^']*)'", action)
        assert action == camg_memory.write_action(saved)
        note = prompt.rsplit("(shown once):", 1)[1].strip().removesuffix("assistant").strip()
        if note.startswith("- "):
            kinds.add("keyed")
            lines = note.splitlines()
            assert saved and all(line in lines for line in saved)
            if rung == "save_line":
                thing = re.search(r"Instruction: \S+ an? (.+?) that is ", prompt).group(1)
                assert [ln for ln in lines if ln.startswith(f"- {thing} ")] == saved
                last = [ln.rsplit(" ", 1)[1] for ln in lines]
                repeats += len(set(last)) < len(last)
        elif "Memo (shown once)" in prompt:
            kinds.add("memo")
            assert saved == [f"- memo: {note}"]
        else:
            kinds.add("lab")
            head, tail = note.rsplit(" found the best ", 1)
            w, rest = tail.split(": ", 1)
            assert saved == [f"- best {w}: {rest}"]
    assert kinds == {"keyed", "memo", "lab"} and (rung == "save" or repeats >= 5)


def test_the_line_rungs_are_shops_note_form():
    """A Shop relay task's note holds the goal category's line in save_line's form (Data.line_of), and the
    reference policy carries exactly that line (the rung's words are random; the shape is the task's)."""
    import shop
    env = camg_worker.make_env("shop")
    try:
        task = next(t for t in env.tasks("train") if env.relay_fact(t))
        goal, policy = task.data["goal"], env.reference_policy(task)
        line = camg_reader.Data.line_of(goal["category"], list(goal["options"].items()))
        assert line == shop.note_lines(goal["category"], goal["options"]) and line in task.data["note"].splitlines()
        policy(task.data["note"])
        assert policy.notes()[0] == line
    finally:
        env.close()


@pytest.mark.parametrize("name, shown, saved", [("deepresearch", r"Memo \(shown once\): (.+)", "- memo: {0}"),
                                                ("autoresearch", r"found the best (\w+): (.+)", "- best {0}: {1}")])
def test_the_save_shapes_are_the_environments(name, shown, saved):
    """The save rung's memo and lab note are what DeepResearch's and AutoResearch's relay tasks show, and its
    saved line is what their reference policies carry (the shapes; the words are random in the rung)."""
    import rollout
    env = camg_worker.make_env(name)
    try:
        task = next(t for t in env.tasks("train") if env.relay_fact(t))
        policy = env.reference_policy(task)
        parts = rollout.scripted_text(env, task, policy)
    finally:
        env.close()
    seen = next(m for p in parts if not p.startswith("<action>") for m in [re.search(shown, p)] if m)
    assert saved.format(*seen.groups()) in policy.notes()


@pytest.mark.parametrize("rung", ["reread", "reread_line"])
def test_reread_uses_what_the_file_says(fresh, rung):
    """After the reset's `cat`: the saved value the page asks for is clicked, or the memo's name searched;
    the saved lines are a line per attribute (recipe 7's) or the thing's one line (recipe 8's)."""
    _, tok = fresh
    memos = 0
    for prompt, reply in chat_items(tok, rung, seed=3):
        search = re.fullmatch(r"<action>search\[ (.*)\]</action>", reply)     # the value after a space
        if search:
            memos += 1
            assert re.search(r"\n- memo: .* is " + re.escape(search.group(1)) + r"\.\n", prompt)
            continue
        value = re.fullmatch(r"<action>click\[ (.*)\]</action>", reply).group(1)
        attr = prompt.rsplit("selected: ", 1)[1].split("=none")[0].split()[-1]     # the first not chosen
        saved = prompt.split("$ cat .agent_memory/CONTINUATION.md\n", 1)[1].split("\n\n(exit 0)")[0]
        mine = [ln for ln in saved.splitlines() if re.search(rf" {re.escape(attr)} {re.escape(value)}( |$)", ln)]
        assert mine and (len(mine) == 1 if rung == "reread_line" else all(ln.endswith(f" {attr} {value}") for ln in mine))
        assert f" {value} " in f" {prompt.rsplit(chr(10) + attr + ':', 1)[1].splitlines()[0]} "
    assert 5 <= memos < 30


@pytest.mark.parametrize("name", ["shop", "deepresearch"])
def test_the_reference_policies_write_what_they_read_in_its_own_tokens(name):
    """The reread rung's wording is the reference policies': an argument taken from an observation starts
    as it did where it was read, so it is the same tokens (the BPE spells a word after `[` otherwise than
    after a space): a word read after a space follows `[ ` (one space); Shop's item id, shown as
    `[B12345]`, follows `[`."""
    import camg_worker
    import rollout
    env = camg_worker.make_env(name)
    try:
        task = next(t for t in env.tasks("train") if env.relay_fact(t))
        parts = rollout.scripted_text(env, task, env.reference_policy(task))
    finally:
        env.close()
    actions = [p[len("<action>"):-len("</action>")] for p in parts if p.startswith("<action>")]
    seen = "\n".join(p for p in parts if not p.startswith("<action>"))
    args = [m.group(1) for a in actions for m in [re.fullmatch(r"\w+\[(.*)\]", a)] if m]
    taken = [a for a in args if a.strip() not in ("", "note", "next", "prev", "back")]
    assert taken, actions
    for a in taken:
        first = a.split()[0]
        assert not a.startswith("  ") and (f" {first}" if a.startswith(" ") else f"[{first}") in seen, (a, actions)
    assert name != "shop" or any(not a.startswith(" ") for a in taken), "Shop's reference clicks an item id"


def test_the_data_never_reads_an_environment(fresh, monkeypatch):
    """No task's names, options or answers can reach the pretraining: generating every rung makes no env."""
    _, tok = fresh

    def refuse(*a, **k):
        raise AssertionError("the CAMG reading data made an environment")
    monkeypatch.setattr(envs, "make", refuse)
    data = camg_reader.Data(tok, seed=4)
    for rung in camg_reader.RUNGS:
        for _ in range(5):
            getattr(data, rung)()


def test_a_span_repeats_its_words(fresh):
    """The span rung's point: most of its words follow a word that occurs elsewhere in the span, so that
    copying by the token before is not enough (the keyed carry's note has the same shape)."""
    _, tok = fresh
    data, ambiguous, total = camg_reader.Data(tok, seed=8), 0, 0
    for _ in range(50):
        it = data.span()
        words = tok.decode([t for t, m in zip(it.tokens, it.mask) if m]).split()
        assert len(set(words)) <= 5 and 6 <= len(words) <= 14
        assert tok.decode(it.tokens).endswith("again: " + " ".join(words))
        ambiguous += sum(words.count(w) > 1 for w in words[:-1])
        total += len(words) - 1
    assert ambiguous / total > 0.7


def test_an_untrained_model_is_at_chance(fresh):
    model, tok = fresh
    result = pretrain.ladder(model, tok, num_items=16, course=camg_reader.COURSE)
    assert list(result) == list(camg_reader.RUNGS)
    assert all(r["accuracy"] <= 0.25 for r in result.values())
    table = pretrain.ladder_table(result, 0.9, camg_reader.COURSE)
    assert "| carry |" in table and "held out" in table


def test_a_short_build_runs_resumes_and_is_found_in_the_cache(tmp_path, monkeypatch):
    """The course through pretrain.py's loop: 6 curriculum steps, a 3-step cool-down, a 2-step repeats
    stage, a 2-step keyed stage, a 2-step save stage and a 2-step line stage, killed after step 4 and resumed from its step-3
    checkpoint; the finished reader is found by its recipe in the cache."""
    monkeypatch.setenv("RIME_CACHE", str(tmp_path))
    args = camg_reader.Args(steps=6, anneal_steps=3, repeat_steps=2, keyed_steps=2, save_steps=2, line_steps=2,
                            batch=4, eval_items=2, checkpoint_every=3)
    out = pretrain.cache_dir(args, camg_reader.COURSE)
    assert out.parent.name == "camg_reader"
    real_step, calls = pretrain.train_step, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(*a, **k)
    monkeypatch.setattr(pretrain, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        pretrain.build(args, out, camg_reader.COURSE)
    assert torch.load(out / "partial.pt", weights_only=False)["step"] == 3
    monkeypatch.setattr(pretrain, "train_step", real_step)
    assert pretrain.reader_dir(args, course=camg_reader.COURSE) == out       # resumes the build
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 18))
    assert [r["phase"] for r in rows[6:]] == (["cool-down"] * 3 + ["repeats"] * 2 + ["keyed"] * 2 + ["save"] * 2
                                              + ["line"] * 2)
    assert json.loads((out / "recipe.json").read_text()) == pretrain.recipe(args, camg_reader.COURSE)
    assert set(json.loads((out / "ladder.json").read_text())) == set(camg_reader.RUNGS)
    # the default recipe is another key: RIME's reader and CAMG's never share a cache entry
    assert pretrain.recipe_key(args, camg_reader.COURSE) != pretrain.recipe_key(pretrain.Args())


@pytest.mark.parametrize("version", [5, 6, 7])
def test_an_earlier_reader_is_a_base_for_the_later_stages(tmp_path, monkeypatch, version):
    """--base: a finished recipe-5 reader (the curriculum, the cool-down and the repeats stage), recipe-6
    reader (and the keyed stage) or recipe-7 reader (and the save stage) is where this recipe goes on: the
    build runs only the stages it lacks and ends with the weights of a whole build."""
    monkeypatch.setattr(pretrain, "ladder", lambda model, tok, num_items=0, seed=0, rungs=None, pool=0, course=None: {
        r: {"accuracy": 0.0, "chance": 0.0, "used": u, "items": 0} for r, u in camg_reader.RUNGS.items()})
    kw = dict(steps=4, anneal_steps=2, repeat_steps=2, batch=4, eval_items=2, checkpoint_every=50, threads=1)
    course = camg_reader.COURSE
    pretrain.build(camg_reader.Args(keyed_steps=3, save_steps=2, line_steps=2, **kw), tmp_path / "whole", course)
    lacks = {5: ("keyed", "save", "line"), 6: ("save", "line"), 7: ("line",)}[version]
    base = dict(keyed_steps=0 if version == 5 else 3, save_steps=0 if version < 7 else 2, line_steps=0)
    pretrain.build(camg_reader.Args(**base, **kw), tmp_path / "base", course)
    stored = json.loads((tmp_path / "base" / "recipe.json").read_text())
    (tmp_path / "base" / "recipe.json").write_text(json.dumps(
        {k: v for k, v in stored.items() if not k.startswith(lacks)} | {"version": version}))
    args = camg_reader.Args(keyed_steps=3, save_steps=2, line_steps=2, base=str(tmp_path / "base"), **kw)
    pretrain.build(args, tmp_path / "cont", course)
    rows = [json.loads(r) for r in (tmp_path / "cont" / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows][-8:] == ["repeats"] + ["keyed"] * 3 + ["save"] * 2 + ["line"] * 2
    from model import load
    a, b = load(tmp_path / "whole").state_dict(), load(tmp_path / "cont").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "cont" / "recipe.json").read_text()) == pretrain.recipe(args, course)


def test_the_shipped_reader_is_this_recipe_and_reads():
    """weights/camg_reader is what `camg_reader.py` builds with its defaults (recipe.json matches), loads,
    and does on fresh held-out items what its ladder.json says (64 items a rung, within three standard
    errors of the difference of two binomial rates, at least 0.05): it copies spans well above chance. Its
    other rungs are as measured (docs/camg.md), not a target."""
    course = camg_reader.COURSE
    assert pretrain.shipped_matches(camg_reader.Args(), course), "weights/camg_reader is stale: rebuild it"
    model, tok = camg_reader.load(build_if_missing=False)      # (refuses a reader of another BPE than camg.py's)
    stored = json.loads((course.shipped / "ladder.json").read_text())
    now = pretrain.ladder(model, tok, num_items=64, seed=50_021, course=course)   # not a seed any build trains on
    for rung, r in now.items():
        p, n = stored[rung]["accuracy"], stored[rung]["items"]
        tol = max(0.05, 3 * (p * (1 - p) * (1 / 64 + 1 / n)) ** 0.5)
        assert abs(r["accuracy"] - p) <= tol, (rung, r["accuracy"], p, tol)
    assert now["copy"]["accuracy"] >= 0.8


def test_a_reader_of_another_bpe_is_refused(monkeypatch):
    """camg.py's rollout workers decode with camg_worker's BPE, so a reader built on another (here rime.py's,
    as after a new weights/camg_bpe.json) stops with a clear message instead of garbling every action."""
    monkeypatch.setattr(pretrain, "reader_dir", lambda *a, **k: pretrain.READER.shipped)
    with pytest.raises(SystemExit, match="another BPE"):
        camg_reader.load(build_if_missing=False)


def test_a_new_bpe_is_a_new_recipe(tmp_path, monkeypatch):
    """The reader is built on one BPE: its recipe names the pinned file's hash, so a new
    weights/camg_bpe.json is a new cache entry and makes the shipped reader stale (not silently reused)."""
    key = pretrain.recipe_key(camg_reader.Args(), camg_reader.COURSE)
    other = tmp_path / "bpe.json"
    other.write_bytes(camg_worker.BPE_PATH.read_bytes() + b"\n")
    monkeypatch.setattr(camg_worker, "BPE_PATH", other)
    assert pretrain.recipe_key(camg_reader.Args(), camg_reader.COURSE) != key
    assert not pretrain.shipped_matches(camg_reader.Args(), camg_reader.COURSE)


def test_shops_words_are_few_pieces_in_the_small_bpe():
    """The BPE's text holds a quarter of Shop's training episodes (camg_worker.DOMAIN_EPISODES), so an
    attribute phrase the search copies out of the instruction is ~1.5 words in < 2 tokens (from 8 episodes:
    3.9), and each category and option value is at most 3."""
    import shop
    tok = camg_worker.small_tokenizer()
    pieces = lambda w: len(tok(" " + w, add_special_tokens=False).input_ids)
    phrases = sorted({a for attrs, _ in shop.CATEGORIES.values() for a in attrs})
    assert sum(map(pieces, phrases)) / len(phrases) < 2.0
    values = {v for _, opts in shop.CATEGORIES.values() for vs in opts.values() for v in vs}
    assert max(map(pieces, list(shop.CATEGORIES) + sorted(values))) <= 3


def test_the_small_bpe_is_pinned_and_retrains_deterministically(tmp_path):
    """camg.py's BPE is read from weights/camg_bpe.json, so a change to an environment's wording does not
    change it (and so the shipped reader stays valid); train_small_bpe trains one on today's environment
    text, written as a file that reads back as the same tokenizer."""
    tok = camg_worker.small_tokenizer()
    assert len(tok) == 2048 and tok.get_vocab() == camg_reader.load(build_if_missing=False)[1].get_vocab()
    fresh = camg_worker.train_small_bpe(tmp_path / "bpe.json")
    camg_worker.small_tokenizer.cache_clear()
    try:
        camg_worker.BPE_PATH, old = tmp_path / "bpe.json", camg_worker.BPE_PATH
        again = camg_worker.small_tokenizer()
    finally:
        camg_worker.BPE_PATH = old
        camg_worker.small_tokenizer.cache_clear()
    text = camg_worker.domain_text()[:5000]
    assert again.get_vocab() == fresh.get_vocab() and again.encode(text) == fresh.encode(text)
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
