"""Symbolic Alchemy: RIME's first domain, after DeepMind's `dm_alchemy` (symbolic version).

    env = envs.make("alchemy")                 # AlchemyEnv(seed=0, num_trials=3, ...)
    task = env.tasks("train")[0]               # Task.group = the world; Task.difficulty 0 (easy) .. 5 (hard)
    obs = env.reset(task)
    obs, reward, done = env.step("apply p1 s2")   # also "cauldron s2", "end"
    policy = env.reference_policy(task, knowledge=None)   # infers the chemistry from what it sees

The game (dm_alchemy's rules, checked against its `types/stones_and_potions.py` and `types/graphs.py`):
- A stone shows 3 perceptual features (size, colour, shape) and hides a latent corner of the cube
  {-1, 1}^3. Its value is x + y + z, plus 12 at (1, 1, 1): -3, -1, +1 or +15. The value is shown.
- Stone map: latent = perceptual with a per-world sign flip on each axis (8 maps; dm_alchemy has no
  axis permutation here because the potion map already absorbs it).
- Potions: 6 colours in 3 fixed pairs (red/green, orange/cyan, yellow/pink). The potion map (one of
  48 = 3! axis permutations x 2^3 direction flips) sends each pair to one latent axis and its two
  colours to the two directions along it.
- Graph: the cube edges that exist (undirected). A potion moves a stone one step along its axis only
  if that edge exists and the stone is not already at that end; otherwise nothing happens. A potion
  is used up either way. Every corner stays reachable.
- A trial hands out stones and potions; `apply P S`, `cauldron S` (scores the stone's value and
  removes it), `end`; at most 20 steps; the trial also ends when no stone is left.

What a world fixes and what a task varies (so both "notes transfer" and "difficulty" hold):
- A world (Task.group, e.g. "w03") fixes the stone map, the potion map and a *nested* family of
  graphs: a random spanning tree of the cube (7 edges) plus the other 5 edges in a random order.
- A task of difficulty d (0..5) keeps the tree plus the first 5 - d extra edges (12 edges = easy
  .. 7 = hard) and draws its trials with more stones and fewer potions as d grows (LEVELS). The
  graphs are nested, so an edge found missing in a task is missing in every harder task of the
  world, and the potion and stone maps never change: notes about the chemistry carry over.

Simplified on purpose:
- dm_alchemy removes edges a face at a time ("constraints"); here single edges go, one per
  difficulty level, so difficulty moves in steps of one edge (RIME's scale: 12 kept = easy .. 7 = hard).
- No 45-degree feature rotation (dm_alchemy's hardest level); stones never start at +15.
- A task is one episode of `num_trials` trials (default 3, not the benchmark's 10: 10 trials of ~10
  steps overflow a 135M model's context). The chemistry is fixed in the episode; stones and
  potions are redrawn each trial.

Score of a task = (sum of cauldron values) / (sum over trials of the best value reachable with the
true chemistry, found by exact search: `solve`), clipped to [0, 1]; the optimal play scores 1.
Each cauldron step's reward is the change of that clipped ratio, so an episode's rewards sum to its
score (a negative stone gives a negative reward).
"""

import random
import re
from dataclasses import dataclass

from workspace import Task

FEATURES = (("small", "large"), ("blue", "purple"), ("round", "pointy"))  # axis i: bit 0 / bit 1
FEATURE_NAMES = ("size", "colour", "shape")
COLOURS = ("red", "green", "orange", "cyan", "yellow", "pink")  # pairs (0, 1), (2, 3), (4, 5)
# difficulty -> (cube edges kept, stones per trial, potions per trial)
LEVELS = ((12, 2, 8), (11, 2, 8), (10, 3, 8), (9, 3, 7), (8, 4, 7), (7, 4, 6))
# a cube edge is (lo, axis): it joins vertex lo (bit `axis` clear) and lo | 1 << axis
ALL_EDGES = tuple((lo, a) for a in range(3) for lo in range(8) if not lo >> a & 1)
ACTIONS = "Actions: apply P S | cauldron S | end"
VALID_FORMS = "Use: apply P S (e.g. apply p1 s1) | cauldron S (e.g. cauldron s1) | end."


def stone_value(latent: int) -> int:
    """Value of a latent corner (bit i set = coordinate i is +1): x + y + z, +12 at (1, 1, 1)."""
    return sum(1 if latent >> i & 1 else -1 for i in range(3)) + (12 if latent == 7 else 0)


LATENT_VALUES = tuple(stone_value(v) for v in range(8))


def stone_text(bits: int) -> str:
    return " ".join(FEATURES[i][bits >> i & 1] for i in range(3))


def effect_text(after: int, before: int, colour: str, value: int, sid: int) -> str:
    """What an apply shows, in the words a note uses (perceptual bits): the feature value the potion gave
    right before its colour ("large pink"), so copying it into memory writes the note "- large pink",
    and the stone's new look ("best ..." once it is worth +15, the note for the best stone)."""
    if after == before:
        return "no effect."
    axis = (after ^ before).bit_length() - 1
    return changed_text(FEATURES[axis][after >> axis & 1], colour, sid, stone_text(after), value)


def changed_text(gained: str, colour: str, sid: int, look: str, value: int) -> str:
    """effect_text of an apply that changed the stone, in words (pretrain.py renders its random worlds with it)."""
    best = f", best {look}" if value == 15 else ""
    return f"{gained} {colour}. s{sid} is now {look} (value {value:+d}){best}."


def cauldron_text(sid: int, value: int, look: str) -> str:
    """What putting a stone into the cauldron shows: its value, and its look when it was the best."""
    return f"s{sid} into the cauldron: value {value:+d}" + (f", best {look}." if value == 15 else ".")


def move(vertex: int, axis: int, bit: int, edges) -> int:
    """Where a potion pushing `axis` towards `bit` takes a stone (unchanged if blocked or already there)."""
    if (vertex >> axis & 1) == bit or (vertex & ~(1 << axis), axis) not in edges:
        return vertex
    return vertex ^ (1 << axis)


@dataclass(frozen=True)
class Chemistry:
    flips: int          # stone map: bit i set = perceptual axis i is reversed (latent = perceptual ^ flips)
    perm: tuple         # potion map: colour pair k acts on latent axis perm[k]
    dirs: tuple         # potion map: the first colour of the pair on axis a moves it towards dirs[a] (+-1)
    edges: frozenset    # the cube edges that exist, as (lo, axis)

    def potion_effect(self, colour: int) -> tuple:
        """(latent axis, target bit) that a potion colour pushes towards."""
        axis = self.perm[colour // 2]
        direction = self.dirs[axis] * (1 if colour % 2 == 0 else -1)
        return axis, int(direction > 0)

    def apply(self, latent: int, colour: int) -> int:
        return move(latent, *self.potion_effect(colour), self.edges)


# --- exact search: the best value a set of stones can reach with a set of potions -----------------

def _stone_options(start, counts, edges, values):
    """For one stone: {potions needed (6 counts) -> (best max(0, value) reachable with them, path)}.

    A move type t = axis * 2 + target bit (one per potion effect). Only simple paths are searched:
    the loop-erased version of any walk reaches the same corner with a subset of its potions.
    """
    best = {}
    need, path, seen = [0] * 6, [], {start}

    def dfs(v):
        key = tuple(need)
        contrib = max(0, values[v])  # a stone worth <= 0 is simply not put in the cauldron
        if key not in best or contrib > best[key][0]:
            best[key] = (contrib, list(path))
        for axis in range(3):
            nxt, t = v ^ (1 << axis), axis * 2 + (1 - (v >> axis & 1))
            if nxt in seen or need[t] >= counts[t] or (v & ~(1 << axis), axis) not in edges:
                continue
            need[t] += 1; path.append(t); seen.add(nxt)
            dfs(nxt)
            need[t] -= 1; path.pop(); seen.remove(nxt)

    dfs(start)
    # best first, then fewest potions: the DP below keeps the first of equal plans
    return sorted(best.items(), key=lambda kv: (-kv[1][0], len(kv[1][1])))


def solve(starts: list, counts: list, edges, values) -> tuple:
    """Best total value of stones `starts` with potion counts per move type, and each stone's path.

    Exact: each stone's options are enumerated, then potions are shared out by dynamic programming
    over (stone index, potions left). Works in latent space (true chemistry) or perceptual space
    (the reference policy's beliefs): only `edges` and `values` (8 numbers) differ.
    """
    options = [_stone_options(s, counts, edges, values) for s in starts]
    memo = {}

    def best(i, left):
        if i == len(starts):
            return 0, ()
        if (i, left) not in memo:
            result = (float("-inf"), ())
            for need, (contrib, path) in options[i]:
                if any(n > r for n, r in zip(need, left)):
                    continue
                rest, rest_paths = best(i + 1, tuple(r - n for r, n in zip(left, need)))
                if contrib + rest > result[0]:
                    result = (contrib + rest, (path,) + rest_paths)
            memo[(i, left)] = result
        return memo[(i, left)]

    total, paths = best(0, tuple(counts))
    return total, list(paths)


def trial_optimum(chem: Chemistry, stones: list, potions: list) -> int:
    counts = [0] * 6
    for colour in potions:
        axis, bit = chem.potion_effect(colour)
        counts[axis * 2 + bit] += 1
    return solve(stones, counts, chem.edges, LATENT_VALUES)[0]


# --- worlds and tasks ---------------------------------------------------------------------------

def make_world(rng: random.Random) -> dict:
    """A world's chemistry: stone map, potion map, spanning tree + the other edges in random order."""
    order = list(ALL_EDGES)
    rng.shuffle(order)
    root = list(range(8))

    def find(x):
        while root[x] != x:
            x = root[x]
        return x

    tree, extra = [], []
    for lo, axis in order:  # Kruskal on a shuffled edge list = a random spanning tree
        a, b = find(lo), find(lo | 1 << axis)
        if a != b:
            root[a] = b
            tree.append([lo, axis])
        else:
            extra.append([lo, axis])
    return {"flips": rng.randrange(8), "perm": rng.sample(range(3), 3),
            "dirs": [rng.choice((-1, 1)) for _ in range(3)], "tree": tree, "extra": extra}


def chemistry_of(data: dict) -> Chemistry:
    num_edges = LEVELS[data["difficulty"]][0]
    edges = data["tree"] + data["extra"][: num_edges - len(data["tree"])]
    return Chemistry(data["flips"], tuple(data["perm"]), tuple(data["dirs"]),
                     frozenset((lo, a) for lo, a in edges))


def make_task(seed, world_index, world, split, difficulty, index, tasks_per_level, num_trials):
    rng = random.Random(f"alchemy/{seed}/task/{world_index}/{difficulty}/{index}")
    name = f"w{world_index:02d}"
    data = dict(world, world=name, difficulty=difficulty, trials=[])
    chem = chemistry_of(data)
    _, num_stones, num_potions = LEVELS[difficulty]
    while len(data["trials"]) < num_trials:
        stones = [rng.randrange(7) for _ in range(num_stones)]  # latent 7 (+15) excluded: free points
        potions = [rng.randrange(6) for _ in range(num_potions)]
        if trial_optimum(chem, stones, potions) > 0:  # every trial must be worth playing
            data["trials"].append({"stones": stones, "potions": potions})
    number = difficulty * tasks_per_level + index
    return Task(id=f"alchemy/{name}/t{number:02d}", env="alchemy", difficulty=difficulty,
                group=name, split=split, data=data)


# --- text protocol ------------------------------------------------------------------------------

_ACTION_FORMS = (   # a potion is named by its id (p3) or by its colour (pink: the first potion of that colour)
    ("apply", re.compile(r"apply\s+(?:potion\s+)?(p?\d+|" + "|".join(COLOURS) + r")\s+(?:to\s+|on\s+)?(?:stone\s+)?s?(\d+)")),
    ("cauldron", re.compile(r"(?:cauldron|put)\s+(?:stone\s+)?s?(\d+)(?:\s+in(?:to)?\s+(?:the\s+)?cauldron)?")),
    ("end", re.compile(r"end(?:\s+(?:the\s+)?trial)?")),
)


def parse_action(text: str):
    """'apply p1 s2' -> ('apply', (1, 2)); 'apply pink s2' -> ('apply', ('pink', 2)); 'cauldron s2' ->
    ('cauldron', (2,)); 'end'; else None."""
    text = " ".join(str(text).lower().replace(",", " ").split()).rstrip(".")
    for kind, pattern in _ACTION_FORMS:
        m = pattern.fullmatch(text)
        if m:
            return kind, tuple(g if g in COLOURS else int(g.lstrip("p")) for g in m.groups())
    return None


_STATE = re.compile(r"Trial (\d+) of (\d+), (\d+) steps left\.\nStones: (.*)\nPotions: (.*)\n")
_STONE = re.compile(r"s(\d+) (\w+) (\w+) (\w+) \(value ([+-]\d+)\)")
_POTION = re.compile(r"p(\d+) (\w+)")


def parse_observation(obs: str):
    """The last state block of an observation -> dict, or None once the episode is over.

    {"trial", "num_trials", "steps_left", "stones": {id: (perceptual bits, value)}, "potions": {id: colour}}
    """
    blocks = list(_STATE.finditer(obs))
    if not blocks:
        return None
    trial, num_trials, steps_left, stones_text, potions_text = blocks[-1].groups()
    stones = {}
    for sid, f0, f1, f2, value in _STONE.findall(stones_text):
        bits = sum(FEATURES[i].index(w) << i for i, w in enumerate((f0, f1, f2)))
        stones[int(sid)] = (bits, int(value))
    potions = {int(pid): COLOURS.index(c) for pid, c in _POTION.findall(potions_text) if c in COLOURS}
    return {"trial": int(trial), "num_trials": int(num_trials), "steps_left": int(steps_left),
            "stones": stones, "potions": potions}


# --- the environment ----------------------------------------------------------------------------

_TASKS = {}   # (config, split) -> the tasks: deterministic in the config, read-only once made


class AlchemyEnv:
    """Symbolic Alchemy behind the envs.py contract (see the module docstring for the rules)."""

    def __init__(self, seed: int = 0, num_train_worlds: int = 16, num_test_worlds: int = 4,
                 tasks_per_level: int = 6, num_trials: int = 3, trial_steps: int = 20, actor_context: str = "all"):
        """actor_context: what rollout's agent loop shows the actor at each turn: "all", the episode so far;
        "latest", the memory and the latest observation only (each observation states the whole state:
        stones, potions, steps left)."""
        if min(num_train_worlds, num_test_worlds, tasks_per_level, num_trials) < 1:
            raise ValueError("num_train_worlds, num_test_worlds, tasks_per_level and num_trials must be >= 1")
        if actor_context not in ("all", "latest"):
            raise ValueError(f"actor_context must be 'all' or 'latest', got {actor_context!r}")
        self.actor_context = actor_context
        most_actions = max(stones + potions for _, stones, potions in LEVELS) + 1  # applies + cauldrons + end
        if trial_steps < most_actions:
            raise ValueError(f"trial_steps={trial_steps} cannot fit an optimal trial; use >= {most_actions}")
        self.config = dict(seed=seed, num_train_worlds=num_train_worlds, num_test_worlds=num_test_worlds,
                           tasks_per_level=tasks_per_level, num_trials=num_trials, trial_steps=trial_steps)
        self.trial_steps = trial_steps
        self.max_steps = num_trials * trial_steps
        self.info = {}
        self._done = True

    def tasks(self, split: str) -> list:
        """Worlds 0..num_train-1 are "train", the next num_test are "test"; tasks sorted by world then difficulty.
        Past 16 training worlds the test worlds stay 16..16+num_test-1 and the extra training worlds are
        numbered after them, so a run that trains on more worlds is scored on the same test worlds."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        key = (tuple(sorted(self.config.items())), split)
        if key not in _TASKS:       # shared by every env of this config (clones included): each task is solved exactly
            c = self.config
            n, m = c["num_train_worlds"], c["num_test_worlds"]
            cut = min(n, 16)                 # the first test world
            ids = [*range(cut), *range(cut + m, n + m)] if split == "train" else range(cut, cut + m)
            tasks = []
            for w in ids:
                world = make_world(random.Random(f"alchemy/{c['seed']}/world/{w}"))
                for d in range(len(LEVELS)):
                    for j in range(c["tasks_per_level"]):
                        tasks.append(make_task(c["seed"], w, world, split, d, j,
                                               c["tasks_per_level"], c["num_trials"]))
            _TASKS[key] = tasks
        return list(_TASKS[key])

    def reset(self, task: Task) -> str:
        if not isinstance(task, Task) or task.env != "alchemy":
            raise ValueError(f"AlchemyEnv.reset needs an alchemy Task, got {task!r:.80}")
        self._chem = chemistry_of(task.data)
        self._trials = task.data["trials"]
        self._optima = [trial_optimum(self._chem, t["stones"], t["potions"]) for t in self._trials]
        self._value, self._done = 0, False
        self.info = {"value": 0, "optimal": sum(self._optima), "trial": 1, "score": 0.0, "invalid": 0}
        self._start_trial(0)
        intro = (f"Symbolic Alchemy, {len(self._trials)} trials. A potion may change one feature of a "
                 "stone, and with it the stone's value; it is used up either way. Put stones in the "
                 "cauldron to score their value. The hidden chemistry is the same in every task of "
                 "this world.\n")
        return intro + self._state_text()

    def _start_trial(self, k: int) -> None:
        trial = self._trials[k]
        self._trial, self._trial_value, self._steps_left = k, 0, self.trial_steps
        self._stones = {i + 1: v for i, v in enumerate(trial["stones"])}    # id -> latent corner
        self._potions = {i + 1: c for i, c in enumerate(trial["potions"])}  # id -> colour index
        self.info["trial"] = k + 1

    def _state_text(self) -> str:
        stones = "; ".join(f"s{i} {stone_text(v ^ self._chem.flips)} (value {stone_value(v):+d})"
                           for i, v in self._stones.items()) or "none"
        potions = ", ".join(f"p{i} {COLOURS[c]}" for i, c in self._potions.items()) or "none"
        return (f"Trial {self._trial + 1} of {len(self._trials)}, {self._steps_left} steps left.\n"
                f"Stones: {stones}\nPotions: {potions}\n{ACTIONS}")

    def _score(self) -> float:
        return min(1.0, max(0.0, self._value / self.info["optimal"]))

    def step(self, action: str):
        if self._done:
            return "The episode is over.", 0.0, True
        self._steps_left -= 1  # an invalid action still uses a step
        parsed, reward = parse_action(action), 0.0
        kind, args = parsed if parsed else (None, ())
        if kind == "apply" and isinstance(args[0], str):      # by colour: the first potion of that colour
            ids = [p for p, c in self._potions.items() if COLOURS[c] == args[0]]
            if not ids:
                kind, result = None, f"There is no {args[0]} potion."
            else:
                args = (ids[0], args[1])
        if kind == "apply" and args[0] not in self._potions:
            kind, result = None, f"There is no potion p{args[0]}."
        elif kind in ("apply", "cauldron") and args[-1] not in self._stones:
            kind, result = None, f"There is no stone s{args[-1]}."
        elif parsed is None:
            result = f"Invalid action {str(action)[:40]!r}."
        if kind is None:
            result += " " + VALID_FORMS
            self.info["invalid"] += 1
        elif kind == "apply":
            p, s = args
            colour, before = self._potions.pop(p), self._stones[s]
            self._stones[s] = after = self._chem.apply(before, colour)
            result = f"p{p} {COLOURS[colour]} on s{s}: " + effect_text(after ^ self._chem.flips, before ^ self._chem.flips,
                                                                       COLOURS[colour], stone_value(after), s)
        elif kind == "cauldron":
            latent = self._stones.pop(args[0])
            value = stone_value(latent)
            old = self._score()
            self._value += value
            self._trial_value += value
            reward = self._score() - old
            result = cauldron_text(args[0], value, stone_text(latent ^ self._chem.flips))
        else:
            result = "You end the trial."
        self.info.update(value=self._value, score=self._score())
        trial_over = kind == "end" or not self._stones or self._steps_left <= 0
        if trial_over:
            if kind != "end" and self._stones:
                result += " No steps left."
            result += f" Trial {self._trial + 1} ended with value {self._trial_value:+d}."
            if self._trial + 1 == len(self._trials):
                self._done = True
                return (f"{result} The episode is over: total value {self._value:+d}, "
                        f"score {self._score():.2f}."), reward, True
            self._start_trial(self._trial + 1)
        return f"{result}\n{self._state_text()}", reward, False

    def reference_policy(self, task: Task, knowledge: dict = None, notes: str = None):
        """A scripted actor that learns the chemistry from observations only (never from task.data).

        knowledge: a dict as read from `policy.knowledge` after an earlier task of the same world;
        notes: memory text in the `format_notes` form. Both seed its beliefs; observations win.
        """
        return AlchemyPolicy(knowledge=knowledge, notes=notes)

    def clone(self):
        return AlchemyEnv(**self.config, actor_context=self.actor_context)

    def close(self) -> None:
        pass  # holds no processes or files


def oracle_policy(env: AlchemyEnv):
    """Plays the exact optimum by reading the env's hidden chemistry (tests and upper bounds only)."""
    def act(obs: str) -> str:
        chem, stones, potions = env._chem, env._stones, env._potions
        counts, by_type = [0] * 6, {}
        for pid, colour in potions.items():
            axis, bit = chem.potion_effect(colour)
            counts[axis * 2 + bit] += 1
            by_type.setdefault(axis * 2 + bit, pid)
        ids = list(stones)
        _, paths = solve([stones[s] for s in ids], counts, chem.edges, LATENT_VALUES)
        for sid, path in zip(ids, paths):
            if path:
                return f"apply p{by_type[path[0]]} s{sid}"
        for sid in ids:
            if stone_value(stones[sid]) > 0:
                return f"cauldron s{sid}"
        return "end"
    return act


# --- the reference actor ------------------------------------------------------------------------

class AlchemyPolicy:
    """Reference actor: bookkeeping of what the chemistry can still be + exact planning.

    Beliefs live in perceptual space (what the observation shows), never in the task's data:
      effects: colour -> (feature, bit it sets); a pair's other colour sets the other bit, and
               the three pairs act on three different features;
      flips:   the stone maps consistent with every (features, value) seen, so the expected value
               of each corner is known (exactly once one stone map is left);
      blocked: cube edges where a potion of known effect did nothing.
    Each step: cauldron a +15 stone; else compare (a) the exact plan (`solve`) with the potions of
    known effect against (b) the best experiment with a potion of unknown effect, valued as the
    exact plan after seeing its effect, averaged over the effects still possible (one-step
    lookahead); do the experiment if it is worth at least as much (free experiments teach later
    trials), else the plan's next potion; else cauldron the best positive stone; else end.

    Knowledge API: `policy.knowledge` (a JSON dict, see below) and `policy.notes()` (memory text)
    read out what it has inferred; `AlchemyPolicy(knowledge=...)` / `(notes=...)` seed the next
    task's actor with it. Given the true chemistry it plays optimally (tests check this).
      {"potions": {"red": "large", ...},             # colour -> the feature value it gives a stone
       "good":    {"size": "large", ...},            # the feature values of the +15 corner found so far
       "blocked": ["small blue round <-> large blue round", ...]}   # edges seen to do nothing
    """

    def __init__(self, knowledge: dict = None, notes: str = None):
        self.effects, self.blocked, self.seen, self.pending = {}, set(), {}, []
        self.prior_flips = set(range(8))
        self._last = None  # (trial, stone id, stone bits before, colour) of the last apply
        if knowledge is not None and not isinstance(knowledge, dict):
            raise ValueError(f"knowledge must be a dict like policy.knowledge, got {type(knowledge).__name__}")
        for given in (parse_notes(notes) if notes else None, knowledge):
            if given:
                self._load(given)

    # beliefs -------------------------------------------------------------------------------------

    def _load(self, k: dict) -> None:
        names = {w: (f, b) for f, pair in enumerate(FEATURES) for b, w in enumerate(pair)}
        for colour, value in (k.get("potions") or {}).items():
            if colour in COLOURS and value in names:
                self._learn_effect(COLOURS.index(colour), names[value])
        for feature, value in (k.get("good") or {}).items():
            if value in names:
                f, b = names[value]  # good end has latent bit 1: b ^ flip_f == 1
                self.prior_flips = {m for m in self.prior_flips if (m >> f & 1) == 1 - b}
        for edge in k.get("blocked") or []:
            ends = [_parse_stone_text(x) for x in str(edge).split("<->")]
            if len(ends) == 2 and None not in ends and bin(ends[0] ^ ends[1]).count("1") == 1:
                axis = (ends[0] ^ ends[1]).bit_length() - 1
                self.blocked.add((ends[0] & ~(1 << axis), axis))

    def _learn_effect(self, colour: int, effect: tuple) -> None:
        self.effects[colour] = effect
        for other in list(self.effects):  # drop beliefs the new fact contradicts
            same_pair = other // 2 == colour // 2
            if other != colour and ((same_pair and self.effects[other] != (effect[0], 1 - effect[1]))
                                    or (not same_pair and self.effects[other][0] == effect[0])):
                del self.effects[other]

    def effect(self, colour: int):
        if colour in self.effects:
            return self.effects[colour]
        if colour ^ 1 in self.effects:
            f, b = self.effects[colour ^ 1]
            return f, 1 - b
        return None

    def candidates(self, colour: int) -> list:
        """Effects still possible for a colour of unknown effect (pairs act on distinct features)."""
        taken = {self.effect(c)[0] for c in range(6) if c // 2 != colour // 2 and self.effect(c)}
        features = [f for f in range(3) if f not in taken] or [0, 1, 2]
        return [(f, b) for f in features for b in (0, 1)]

    def flips(self) -> set:
        seen = {m for m in range(8) if all(stone_value(v ^ m) == val for v, val in self.seen.items())}
        return (seen & self.prior_flips) or seen or set(range(8))  # observations beat wrong notes

    @property
    def knowledge(self) -> dict:
        """What has been inferred, in words (JSON-serialisable): feed it to the next task's policy."""
        flips = self.flips()
        good = {FEATURE_NAMES[f]: FEATURES[f][1 - (next(iter(flips)) >> f & 1)]
                for f in range(3) if len({m >> f & 1 for m in flips}) == 1}
        potions = {COLOURS[c]: FEATURES[e[0]][e[1]] for c in range(6) if (e := self.effect(c))}
        blocked = sorted(f"{stone_text(lo)} <-> {stone_text(lo | 1 << a)}" for lo, a in self.blocked)
        return {"potions": potions, "good": good, "blocked": blocked}

    def notes(self) -> str:
        return format_notes(self.knowledge)

    def _observe(self, state: dict) -> None:
        for bits, value in state["stones"].values():
            self.seen[bits] = value
        if self._last and self._last[0] == state["trial"] and self._last[1] in state["stones"]:
            _, sid, before, colour = self._last
            after = state["stones"][sid][0]
            if after != before:
                axis = (after ^ before).bit_length() - 1
                self._learn_effect(colour, (axis, after >> axis & 1))
                self.blocked.discard((before & ~(1 << axis), axis))
            else:
                self.pending.append((before, colour))
        self._last = None
        for before, colour in list(self.pending):  # a no-op explains itself once the effect is known
            if self.effect(colour):
                f, b = self.effect(colour)
                if (before >> f & 1) != b:
                    self.blocked.add((before & ~(1 << f), f))
                self.pending.remove((before, colour))

    # acting --------------------------------------------------------------------------------------

    def __call__(self, obs: str) -> str:
        state = parse_observation(obs)
        if state is None:
            return "end"
        self._observe(state)
        stones, potions, flips = state["stones"], state["potions"], self.flips()
        values = [sum(stone_value(v ^ m) for m in flips) / len(flips) for v in range(8)]
        edges = set(ALL_EDGES) - self.blocked
        for sid, (bits, value) in stones.items():
            if value == 15:
                return f"cauldron s{sid}"
        # 1. the exact plan with the potions whose effect is known ...
        ids = list(stones)
        starts = [stones[s][0] for s in ids]
        known = {pid: self.effect(c) for pid, c in potions.items() if self.effect(c)}
        counts = _counts(known.values())
        plan_value, paths = solve(starts, counts, edges, values)
        # 2. ... unless an experiment with an unknown potion is worth at least as much: its value is
        # the plan value after seeing the effect, averaged over the effects still possible (a
        # one-step lookahead; a potion that shows no effect teaches nothing and is just lost)
        best = None
        tried = set()
        for pid, colour in potions.items():
            if self.effect(colour) or colour in tried:
                continue
            tried.add(colour)
            effects = self.candidates(colour)
            for i, sid in enumerate(ids):
                total = 0.0
                for f, b in effects:
                    after = starts[:i] + [move(starts[i], f, b, edges)] + starts[i + 1:]
                    if after[i] == starts[i]:
                        total += solve(after, counts, edges, values)[0]
                        continue
                    learned = dict(known)  # every other copy of the colour and its pair partner
                    for p, c in potions.items():
                        if p != pid and c // 2 == colour // 2:
                            learned[p] = (f, b if c == colour else 1 - b)
                    total += solve(after, _counts(learned.values()), edges, values)[0]
                if best is None or total / len(effects) > best[0] + 1e-9:
                    best = (total / len(effects), pid, sid)
        # >= : an experiment that costs nothing now still teaches something for later trials
        if best and best[0] >= plan_value - 1e-9:
            return self._apply(state, best[1], best[2], potions)
        for sid, path in zip(ids, paths):
            if path:
                pid = next(p for p, e in known.items() if e == (path[0] // 2, path[0] % 2))
                return self._apply(state, pid, sid, potions)
        # 3. cash in: the most valuable positive stone first
        positive = sorted((-value, sid) for sid, (_, value) in stones.items() if value > 0)
        return f"cauldron s{positive[0][1]}" if positive else "end"

    def _apply(self, state, pid, sid, potions) -> str:
        self._last = (state["trial"], sid, state["stones"][sid][0], potions[pid])
        return f"apply p{pid} s{sid}"


def _counts(effects) -> list:
    counts = [0] * 6
    for f, b in effects:
        counts[f * 2 + b] += 1
    return counts


def _parse_stone_text(text: str):
    words = text.lower().split()
    if len(words) != 3 or any(w not in FEATURES[i] for i, w in enumerate(words)):
        return None
    return sum(FEATURES[i].index(w) << i for i, w in enumerate(words))


def format_notes(knowledge: dict) -> str:
    """Knowledge dict -> memory lines that `parse_notes` reads back (and a model can imitate). Key-adjacent
    wording: each line puts the word an actor looks up right before the word it needs, "- large pink"
    (the potion that makes a stone large is pink), "- best large purple pointy" (the +15 stone)."""
    lines = [f"- {v} {c}" for c, v in (knowledge.get("potions") or {}).items()]
    good = knowledge.get("good") or {}
    if len(good) == 3:
        lines.append("- best " + " ".join(good[name] for name in FEATURE_NAMES))
    elif good:
        lines.append(f"- good features: {', '.join(good[n] for n in FEATURE_NAMES if n in good)}")
    lines += [f"- blocked: {edge}" for edge in knowledge.get("blocked") or []]
    return "\n".join(lines)


def memory_text(knowledge: dict, last_task: str = "", last_score: float = None) -> str:
    """The scripted writer: what the reference actor inferred, as a RIME memory in the writer's
    two-section format (two headers, >= 2 bullets each). `parse_notes` reads it back, so
    the reference actor with this memory starts the next task knowing the chemistry."""
    facts = format_notes(knowledge).splitlines() or ["- No potion effect confirmed yet."]
    if len(facts) < 2:
        facts.append("- Each potion colour has the same effect in every task of this world.")
    lessons = ["- Try each unknown potion colour once on a stone, then plan with the known ones.",
               "- Put a stone in the cauldron only when its value is positive; end the trial after."]
    if knowledge.get("blocked"):
        lessons.append("- A potion that did nothing hit a blocked edge; go around it.")
    if last_score is not None:   # the latest outcome, so an unchanged chemistry is not a verbatim copy
        lessons.append(f"- Last task {last_task}: score {last_score:.2f}.")
    return "### Repository Knowledge\n" + "\n".join(facts) + "\n\n### Lessons & Pitfalls\n" + "\n".join(lessons)


def stream_notes(env: "AlchemyEnv", tasks) -> list:
    """The scripted writer's memory after each task of a stream: the reference actor plays the tasks in
    order, each reading the previous memory, and memory_text writes what it inferred. True notes (a
    yardstick for a learned writer's, e.g. rime.py --attribute); uses env."""
    notes, memory = [], None
    for task in tasks:
        policy = env.reference_policy(task, notes=memory)
        obs, done = env.reset(task), False
        while not done:
            obs, _, done = env.step(policy(obs))[:3]
        memory = memory_text(policy.knowledge, task.id, env.info["score"])
        notes.append(memory)
    return notes


_WORDS = {w: (f, b) for f, pair in enumerate(FEATURES) for b, w in enumerate(pair)}
# "large pink": a feature value right before a potion colour states an effect (stone words never name a
# potion colour, so the pair means nothing else); "Potion pink makes a stone large" is the older wording
_EFFECT = re.compile(r"\b(" + "|".join(_WORDS) + r") (" + "|".join(COLOURS) + r")\b")
_EFFECT_OLD = re.compile(r"potion (\w+) makes (?:a |the )?stones? (\w+)")


def parse_notes(text: str) -> dict:
    """Memory text -> knowledge dict. Lenient: lines it cannot read are ignored, never an error. A later
    statement about a colour wins over an earlier one."""
    text = str(text).lower()
    potions = {c: v for c, v in _EFFECT_OLD.findall(text) if c in COLOURS and v in _WORDS}
    potions.update({c: v for v, c in _EFFECT.findall(text)})
    good = {}
    for m in re.finditer(r"(?:best stone|best|good features?)\s*:?\s*([a-z ,]+)", text):
        for w in re.split(r"[ ,]+", m.group(1)):
            if w in _WORDS:
                good[FEATURE_NAMES[_WORDS[w][0]]] = w
    blocked = [f"{a} <-> {b}" for a, b in re.findall(r"blocked\s*:?\s*(\w+ \w+ \w+)\s*<->\s*(\w+ \w+ \w+)", text)]
    return {"potions": potions, "good": good, "blocked": blocked}


def note_action(needs: dict, best, stones: dict, potions: set):
    """The note reader's move (a protocol, no chemistry): the thought and action of an actor that acts on
    its notes, or None when the notes do not say what to do.
      needs:   feature word -> potion colour, as the notes state them ("- large pink": large -> pink);
      best:    the +15 stone's three words from the notes ("- best large purple pointy"), or None;
      stones:  id -> (three words, value) as the observation shows them; potions: the colours on the table.
    A +15 stone goes into the cauldron. Otherwise the first stone listed (explore_action's stone too)
    needs the best stone's word where they first differ; if the notes name a colour for that word and
    such a potion is on the table, the reply is a chain of copies, each step's key right before its value:
    "s1 small purple pointy best large purple pointy need large pink <action>apply pink s1</action>"
    (the stone's words copied from the observation, the best one's from the notes, the first word where
    the two adjacent triples differ, the colour that follows that word in the notes). Measured
    (docs/reader.md, "The hop as a chain of copies"): fine-tuned on its own, this chain is learned faster
    than a bare "need large pink" after a choice of the most valuable stone, which the reader got wrong."""
    for sid, (_, value) in sorted(stones.items()):
        if value == 15:
            return f"<action>cauldron s{sid}</action>"
    if best is None or not stones:
        return None
    sid, (words, _) = min(stones.items())
    lacking = [b for w, b in zip(words, best) if w != b]
    if not lacking:
        return None
    colour = needs.get(lacking[0])
    if colour is None or colour not in potions:
        return None
    return (f"s{sid} {' '.join(words)} best {' '.join(best)} need {lacking[0]} {colour} "
            f"<action>apply {colour} s{sid}</action>")


def explore_action(stones: dict, potions: list) -> str:
    """The protocol's move where the notes decide nothing, in a fixed order (no chemistry, and greedy-safe:
    every move is valid and uses up a potion, so a copied move never loops):
      stones: id -> (three words, value) as the observation shows them; potions: colours on the table, by id.
    A +15 stone goes into the cauldron; else the first potion on the table is tried on the first stone
    (lowest id) below +15; with no potion left, the first stone worth more than 0 goes into the cauldron,
    else the trial ends. Every choice is the first one listed: a copy from the latest state (measured: a
    warm-started reader picked the "most valuable stone" in about half of the states; note_action takes
    this first stone too)."""
    for sid, (_, value) in sorted(stones.items()):
        if value == 15:
            return f"<action>cauldron s{sid}</action>"
    if not stones:
        return "<action>end</action>"
    if potions:
        return f"<action>apply {potions[0]} s{min(stones)}</action>"
    positive = [sid for sid, (_, value) in sorted(stones.items()) if value > 0]
    return f"<action>cauldron s{positive[0]}</action>" if positive else "<action>end</action>"


def _observed_state(obs: str):
    state = parse_observation(obs)
    if state is None:
        return None
    stones = {sid: (stone_text(bits).split(), value) for sid, (bits, value) in state["stones"].items()}
    return stones, [COLOURS[c] for _, c in sorted(state["potions"].items())]


def protocol_reply(memory: str, obs: str) -> str:
    """The protocol actor's reply: what the notes decide (note_reader_reply), else explore_action."""
    seen = _observed_state(obs)
    if seen is None:
        return "<action>end</action>"
    return note_reader_reply(memory, obs) or explore_action(*seen)


_SEEN_EFFECT = re.compile(r"\bp\d+ (\w+) on s\d+: (\w+) (\w+)\.")
_SEEN_BEST = re.compile(r"\bbest (\w+ \w+ \w+)\.")


def observed_notes(observations) -> list:
    """The notes an episode's observations state, transcribed in their own words and order of first sight:
    "- large pink" for every apply that changed a stone ("p2 pink on s1: large pink. s1 is now ..."), and
    "- best large purple pointy" once a stone showed it is worth +15. What was seen, never inferred: no
    blocked edge, no effect a potion did not show, no fact of an earlier task."""
    notes = []
    for obs in observations:
        for colour, gained, named in _SEEN_EFFECT.findall(obs):
            if named == colour and gained in _WORDS and colour in COLOURS:
                notes.append(f"- {gained} {colour}")
        notes += [f"- best {words}" for words in _SEEN_BEST.findall(obs) if _parse_stone_text(words) is not None]
    return list(dict.fromkeys(notes))


def inferred_best(observations):
    """The note "- best large purple pointy" that the stone values an episode's observations showed imply
    (AlchemyPolicy's bookkeeping: the stone maps consistent with every look and value seen), or None while
    they leave a feature open. An inference, not a transcription: a stone of value -3 has every feature
    at its bad end, one of +1 two at their good end, and a few stones usually settle all three (measured:
    after one task, 0.97 of held-out streams; docs/results.md, "What a memory is worth")."""
    policy = AlchemyPolicy()
    for obs in observations:
        state = parse_observation(obs)
        if state is not None:
            policy._observe(state)
    return _best_note(policy)


def _best_note(policy: "AlchemyPolicy"):
    """The "- best ..." note of what a policy's bookkeeping has settled, or None while a feature is open."""
    good = policy.knowledge["good"]
    return "- best " + " ".join(good[n] for n in FEATURE_NAMES) if len(good) == 3 else None


_LOOK_VALUE = re.compile(r"\b(\w+) (\w+) (\w+) \(value ([+-]\d+)\)")


def inferred_best_in(text: str):
    """inferred_best from a text rather than whole observations: every stone look the text states with its
    value ("s1 small blue round (value -3)" in a Stones line, "s1 is now large blue round (value -1)" in an
    outcome) counts. The writer sees the finished task only as rollout.trajectory_text, whose cut
    observations keep the outcomes' heads but rarely a whole state: the best stone inferred from that text
    is the one a writer can infer from its prompt (the warm start's `--warmstart-writer inferring`)."""
    policy = AlchemyPolicy()
    for *words, value in _LOOK_VALUE.findall(str(text)):
        bits = _parse_stone_text(" ".join(words))
        if bits is not None:
            policy.seen[bits] = int(value)
    return _best_note(policy)


def note_reader_reply(memory: str, obs: str):
    """note_action on Alchemy's words: the notes parsed from memory, the state from the observation."""
    seen = _observed_state(obs)
    if seen is None:
        return None
    notes = parse_notes(memory)
    needs = {}
    for colour, value in notes["potions"].items():
        needs.setdefault(value, colour)
    good = notes["good"]
    best = tuple(good[n] for n in FEATURE_NAMES) if len(good) == 3 else None
    return note_action(needs, best, seen[0], set(seen[1]))


def true_potions(data: dict) -> dict:
    """The world's true potion effects in the words memories use: colour -> the feature value it gives."""
    chem = chemistry_of(data)
    out = {}
    for c, colour in enumerate(COLOURS):
        axis, bit = chem.potion_effect(c)               # latent axis = perceptual axis; latent = perceptual ^ flips
        out[colour] = FEATURES[axis][bit ^ (chem.flips >> axis & 1)]
    return out


def memory_accuracy(memory: str, task: Task) -> tuple:
    """(accuracy, coverage) of the potion effects a memory states, against the task's true chemistry:
    accuracy = share of stated effects that are true (None if it states none), coverage = share of the
    world's 6 effects stated correctly. A diagnostic for logs, never a reward (it reads hidden data)."""
    stated = parse_notes(memory)["potions"]
    truth = true_potions(task.data)
    right = sum(truth[c] == v for c, v in stated.items())
    return (right / len(stated) if stated else None), right / len(truth)
