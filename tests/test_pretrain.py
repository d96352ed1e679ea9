"""pretrain.py: the reading data, the ladder, the shipped reader, and a short rebuild (kill and resume)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import alchemy
import pretrain

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fresh():
    """The laptop model with random weights and its tokenizer (what the pretraining starts from)."""
    return pretrain.new_model(seed=0)


def test_items_mask_exactly_the_answer(fresh):
    _, tok = fresh
    data = pretrain.Data(tok, seed=1)
    item = data.lookup6()
    answer = tok.decode([t for t, m in zip(item.tokens, item.mask) if m])
    prompt = tok.decode(item.tokens[:item.mask.index(1)])
    key = prompt.rsplit("need ", 1)[1]
    line = next(ln for ln in prompt.splitlines() if ln.startswith(f"- {key} "))
    assert answer == " " + line.split()[2] and item.chance == pytest.approx(1 / 6)
    hop = data.hop()                           # the actor's whole chat turn, the reply supervised
    reply = tok.decode([t for t, m in zip(hop.tokens, hop.mask) if m], skip_special_tokens=True)
    assert reply.endswith("</action>") and "[Memory of what you've learned so far]" in tok.decode(hop.tokens)
    recall = data.recall()                      # six values supervised, keys given
    assert sum(recall.mask) >= 6


def test_hop_items_follow_the_note_reader(fresh):
    """The hop rung's answer is alchemy.note_action on the item's own random notes and state, and its words
    are the pool's, paired at random: Alchemy's words are never a world's pairing."""
    _, tok = fresh
    data = pretrain.Data(tok, seed=2)
    replies = [tok.decode([t for t, m in zip(it.tokens, it.mask) if m], skip_special_tokens=True)
               for it in (data.hop() for _ in range(40))]
    needs = [r.split(" need ", 1)[1] for r in replies if " need " in r]
    assert len(needs) >= 30 and all(r.split()[1] == r.split("apply ")[1].split()[0] for r in needs)
    used = {w for r in needs for w in r.split()[0:2]}
    assert len(used) > 40 and used <= set(data.words)


def test_the_data_never_reads_a_world(fresh, monkeypatch):
    """No fact of any Alchemy world can reach the pretraining: generating every rung touches no world."""
    _, tok = fresh

    def refuse(*a, **k):
        raise AssertionError("the pretraining data read an Alchemy world")
    monkeypatch.setattr(alchemy, "make_world", refuse)
    monkeypatch.setattr(alchemy, "chemistry_of", refuse)
    monkeypatch.setattr(alchemy.AlchemyEnv, "tasks", refuse)
    data = pretrain.Data(tok, seed=3)
    for rung in pretrain.RUNGS:
        for _ in range(5):
            getattr(data, rung)()


def test_ladder_is_exact_match_and_an_untrained_model_is_at_chance(fresh):
    model, tok = fresh
    result = pretrain.ladder(model, tok, num_items=16, rungs=["lookup6", "hop"])
    assert all(r["accuracy"] <= 0.25 for r in result.values())
    assert not pretrain.ladder_passes(result, 0.9)
    assert "| lookup6 |" in pretrain.ladder_table(result, 0.9)


def test_the_shipped_reader_is_this_recipe_and_reads():
    """weights/reader is what `pretrain.py` builds with its defaults (recipe.json matches), loads with
    model.load / load_tokenizer, and does on fresh held-out items what its ladder.json says (64 items a
    rung, within sampling error): it reads notes (1-of-6 and at the memory cap >= 0.9) and takes the
    Alchemy hop (0.92 on its ladder) and infers the best stone from stone values (1.00, recipe 10). Its
    weaker rungs are as measured (docs/reader.md), not a target."""
    assert pretrain.shipped_matches(pretrain.Args()), "weights/reader is stale: rebuild it (docs/reader.md)"
    assert pretrain.reader_dir(build_if_missing=False) == pretrain.SHIPPED
    model, tok = pretrain.load_reader()
    stored = json.loads((pretrain.SHIPPED / "ladder.json").read_text())
    now = pretrain.ladder(model, tok, num_items=64, seed=50_021)   # not a seed any build trains on
    for rung, r in now.items():
        assert abs(r["accuracy"] - stored[rung]["accuracy"]) <= 0.15, (rung, r["accuracy"], stored[rung]["accuracy"])
    assert now["lookup6"]["accuracy"] >= 0.9 and now["lookup_cap"]["accuracy"] >= 0.85
    assert now["hop"]["accuracy"] >= 0.8                     # 0.92 on the ladder's 200 items (recipes 9 and 10)
    assert now["infer"]["accuracy"] >= 0.9 > now["infer"]["chance"]   # 1.00 (recipe 10's inference stage)


def test_a_short_build_learns_and_resumes_after_a_kill(tmp_path, monkeypatch):
    """The recipe cannot rot: a 12-step curriculum, a 6-step cool-down and a 3-step inference stage run end
    to end, the loss falls, the stages' lr decays, and a build killed in the curriculum (after step 7) and again in the
    cool-down (after step 16) resumes from its step-6 and step-15 checkpoints and logs every step once."""
    args = pretrain.Args(steps=12, anneal_steps=6, infer_steps=3, batch=8, eval_items=4, checkpoint_every=3, lr=3e-3)
    real_step, calls = pretrain.train_step, []

    def dying_at(n):
        def step(*a, **k):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real_step(*a, **k)
        return step
    monkeypatch.setattr(pretrain, "ladder", lambda model, tok, num_items=0, seed=0, rungs=None, pool=0, course=None: {
        r: {"accuracy": 0.0, "chance": 0.0, "used": u, "items": 0} for r, u in pretrain.RUNGS.items()})
    out = tmp_path / "reader"
    monkeypatch.setattr(pretrain, "train_step", dying_at(8))
    with pytest.raises(KeyboardInterrupt):
        pretrain.build(args, out)
    assert torch.load(out / "partial.pt", weights_only=False)["step"] == 6
    calls.clear()
    monkeypatch.setattr(pretrain, "train_step", dying_at(10))          # steps 7..15 run, step 16 dies
    with pytest.raises(KeyboardInterrupt):
        pretrain.build(args, out)
    state = torch.load(out / "partial.pt", weights_only=False)
    assert state["step"] == 15 and state["cool"]["end"] == 12 and "opt" in state["cool"]
    monkeypatch.setattr(pretrain, "train_step", real_step)
    pretrain.build(args, out)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 22))
    assert [r["phase"] for r in rows[12:]] == ["cool-down"] * 6 + ["infer"] * 3
    lrs = [r["lr"] for r in rows[12:18]]
    assert lrs == [pretrain.anneal_lr_at(i, args) for i in range(6)] and lrs[-1] < lrs[0]
    assert [r["lr"] for r in rows[18:]] == [pretrain.anneal_lr_at(i, args, 3) for i in range(3)]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert not (out / "partial.pt").exists() and json.loads((out / "recipe.json").read_text()) == pretrain.recipe(args)
    from model import load, load_tokenizer
    assert load(out).config.hidden_size == pretrain.MODEL_SHAPE["hidden_size"] and load_tokenizer(out).chat_template


def test_the_stages_resume_to_the_same_weights(tmp_path, monkeypatch):
    """A build killed inside the cool-down, or inside the inference stage, ends with the weights of one that
    never stopped (a stage's optimizer and item stream are in its checkpoint)."""
    args = pretrain.Args(steps=4, anneal_steps=6, infer_steps=4, batch=4, eval_items=4, checkpoint_every=2, threads=1)
    monkeypatch.setattr(pretrain, "ladder", lambda model, tok, num_items=0, seed=0, rungs=None, pool=0, course=None: {
        r: {"accuracy": 0.0, "chance": 0.0, "used": u, "items": 0} for r, u in pretrain.RUNGS.items()})
    pretrain.build(args, tmp_path / "whole")
    real_step, calls = pretrain.train_step, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 8:                     # the cool-down's 4th step; its checkpoint is at step 6
            raise KeyboardInterrupt
        return real_step(*a, **k)
    monkeypatch.setattr(pretrain, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        pretrain.build(args, tmp_path / "killed")
    calls[:] = [1]      # the resumed build (cool-down steps 7-10, then the stage) dies at its 7th step:
    with pytest.raises(KeyboardInterrupt):      # step 13, the inference stage's 3rd (checkpoint: step 12)
        pretrain.build(args, tmp_path / "killed")
    assert torch.load(tmp_path / "killed" / "partial.pt", weights_only=False)["cool"]["stage"] == 1
    monkeypatch.setattr(pretrain, "train_step", real_step)
    pretrain.build(args, tmp_path / "killed")
    from model import load
    a, b = load(tmp_path / "whole").state_dict(), load(tmp_path / "killed").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_build_from_a_base_reader_is_the_whole_build(tmp_path, monkeypatch, capsys):
    """--base: a finished reader of the previous recipe (the curriculum and the cool-down, no inference
    stage; recipe 9's recipe.json) is where the build goes on: it runs only the inference stage, keeps the
    base's metrics rows, and ends with the weights of a whole build. A base of another recipe is a
    one-line error."""
    monkeypatch.setattr(pretrain, "ladder", lambda model, tok, num_items=0, seed=0, rungs=None, pool=0, course=None: {
        r: {"accuracy": 0.0, "chance": 0.0, "used": u, "items": 0} for r, u in pretrain.RUNGS.items()})
    kw = dict(steps=4, anneal_steps=4, batch=4, eval_items=4, checkpoint_every=2, threads=1)
    pretrain.build(pretrain.Args(infer_steps=3, **kw), tmp_path / "whole")
    pretrain.build(pretrain.Args(infer_steps=0, **kw), tmp_path / "base")
    stored = json.loads((tmp_path / "base" / "recipe.json").read_text())
    old = {k: v for k, v in stored.items() if not k.startswith("infer")} | {"version": 9}
    (tmp_path / "base" / "recipe.json").write_text(json.dumps(old))
    args = pretrain.Args(infer_steps=3, base=str(tmp_path / "base"), **kw)
    pretrain.build(args, tmp_path / "cont")
    rows = [json.loads(r) for r in (tmp_path / "cont" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 12)) and [r["phase"] for r in rows[8:]] == ["infer"] * 3
    from model import load
    a, b = load(tmp_path / "whole").state_dict(), load(tmp_path / "cont").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "cont" / "recipe.json").read_text()) == pretrain.recipe(args)
    (tmp_path / "base" / "recipe.json").write_text(json.dumps(old | {"anneal_steps": 5}))
    with pytest.raises(SystemExit) as e:
        pretrain.build(args, tmp_path / "other")
    assert e.value.code == 2 and "--base" in capsys.readouterr().err


def test_cli_where_and_bad_flags():
    where = subprocess.run([sys.executable, "pretrain.py", "--where"], cwd=ROOT, capture_output=True, text=True)
    assert where.returncode == 0 and where.stdout.strip() == str(pretrain.SHIPPED)
    bad = subprocess.run([sys.executable, "pretrain.py", "--steps", "0"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--steps must be >= 1" in bad.stderr and "Traceback" not in bad.stderr


def test_task_words_are_alchemys_vocabulary_and_lead_the_pool(fresh):
    """The pool starts with the words Alchemy's notes are made of (a vocabulary, never a pairing)."""
    _, tok = fresh
    assert set(pretrain.TASK_WORDS) == set(alchemy.COLOURS) | {w for pair in alchemy.FEATURES for w in pair}
    data = pretrain.Data(tok, seed=4)
    data.use_pool(pretrain.POOL)
    assert data.words[:12] == pretrain.TASK_WORDS and len(set(data.words)) == pretrain.POOL
    item = data.recall()
    words = tok.decode(item.tokens).split("|")[0].split()[1:]
    assert set(words) <= set(data.words) and len(words) == 12


def latest_state(text: str):
    """(stones id -> (words, value), potion colours) of the last observation in a decoded chat."""
    import re
    obs = text.rsplit("Stones: ", 1)[1]
    stones = {int(i): (tuple(w.split()), int(v)) for i, w, v in
              re.findall(r"s(\d) ([a-z]+ [a-z]+ [a-z]+) \(value ([-+]\d+)\)", obs.split("\n")[0])}
    potions = set(re.findall(r"p\d+ ([a-z]+)", obs.split("Potions: ")[1].split("\n")[0]))
    return stones, potions


def test_history_items_act_on_the_latest_state_only(fresh):
    """The history rung is a later turn: earlier moves and their outcomes are in the context without loss,
    and the supervised reply is the note reader's move on the latest state (its stone, its potions)."""
    _, tok = fresh
    data = pretrain.Data(tok, seed=5)
    data.use_pool(pretrain.POOL)
    kinds = {"cauldron": 0, "need": 0}
    for _ in range(30):
        item = data.history()
        start = item.mask.index(1)
        assert all(item.mask[start:]) and not any(item.mask[:start])      # only the final reply is scored
        context = tok.decode(item.tokens[:start])
        reply = tok.decode(item.tokens[start:], skip_special_tokens=True).strip()
        assert context.count("<action>") >= 1 and context.count("Stones: ") >= 2   # earlier moves, unscored
        stones, potions = latest_state(context)
        best = tuple(context.split("- best ", 1)[1].split("\n")[0].split())
        if reply.startswith("<action>cauldron"):
            kinds["cauldron"] += 1
            sid = int(reply.split(" s")[1].split("<")[0])
            assert stones[sid][1] == 15
            continue
        kinds["need"] += 1
        sid, (words, _) = min(stones.items())                     # the first stone listed
        # the chain of copies: the stone's words, the best stone's, the first word they differ in, its colour
        head, word, colour = reply.split(" need ")[0], *reply.split(" need ")[1].split()[:2]
        assert head == f"s{sid} {' '.join(words)} best {' '.join(best)}"
        assert reply.endswith(f"<action>apply {colour} s{sid}</action>") and colour in potions
        assert word == next(b for w, b in zip(words, best) if w != b)
        assert f"- {word} {colour}" in context or f": {word} {colour}." in context    # the notes say so
    assert kinds["cauldron"] >= 3 and kinds["need"] >= 15


def test_lookup_action_has_one_stone_lacking_the_goal_word(fresh):
    """lookup -> action: the goal names the key, the one stone on the table lacks it (the choice of stone
    is the hop's rung, not this one's)."""
    _, tok = fresh
    data = pretrain.Data(tok, seed=6)
    for _ in range(20):
        item = data.lookup_action()
        start = item.mask.index(1)
        context = tok.decode(item.tokens[:start])
        reply = tok.decode(item.tokens[start:], skip_special_tokens=True).strip()
        stones, _ = latest_state(context)
        goal = context.rsplit("Goal: make s", 1)[1].split(".")[0].split()
        assert list(stones) == [int(goal[0])] and goal[1] not in stones[int(goal[0])][0]
        assert reply.startswith(f"need {goal[1]} ") and reply.endswith(f" s{goal[0]}</action>")
