"""AutoResearch: improve a training script on a seeded dataset (CAMG, MLE-bench style).

The workspace holds a small tabular classification task and a baseline that is deliberately weak:

    README.md            the task, the baseline's test accuracy, the reward formula
    train.py             logistic regression in numpy with knobs at the top; writes predictions.csv
    data/train.csv       features x0..x7 and the label y
    data/val.csv         the same, for local validation
    data/test.csv        features only: the labels stay in the environment, never on disk

The agent edits and runs code through the shell, then submits:

    env = AutoResearchEnv(seed=0)
    obs = env.reset(env.tasks("test")[0])
    obs, reward, done = env.step("shell: sed -i 's/^STANDARDIZE = .*/STANDARDIZE = True/' train.py")
    obs, reward, done = env.step("run")          # = shell: python train.py (prints val accuracy)
    obs, reward, done = env.step("evaluate")     # scores predictions.csv on the hidden labels; ends

Reward (paid at `evaluate`): `clip((acc - baseline) / (reference - baseline), 0, 1)` where acc is
the test accuracy of predictions.csv, baseline the accuracy of the unchanged train.py and reference
that of a stronger known solution (standardised features, linear or quadratic, chosen on the
validation split, more steps; on relay tasks without the leaking column), both computed in-process
from the same script text when the task is first reset. success = reward >= SUCCESS_THRESHOLD (0.5:
at least half of the known headroom).
Every shell command (and `run`) has a wall-clock budget of `run_timeout` seconds; the episode has
`max_steps` actions (default 20). env.info: success, accuracy, baseline, reference, steps, ...

Difficulty: 0 = mildly mis-scaled linear data (more steps or standardising fixes it);
1 = badly scaled linear data (needs STANDARDIZE); 2 = a quadratic boundary (needs POLY_DEGREE = 2).
Memory: tasks of a group (a "lab") share these failure modes, so the recipe that worked is worth
keeping (it saves runs: one fixed recipe, STANDARDIZE=True POLY_DEGREE=2 EPOCHS=300 LR=0.5, solves
the standard family's tasks without any memory; the relay family below is where memory decides).
The reference policy keeps it in `.agent_memory/notes.md` (`- best recipe: KNOB=value ...`) and,
when the note exists, applies it first instead of trying recipes one by one.

Relay family (`relay_per_group` > 0, difficulty 3; camg.py's laptop preset): the data is of kind 1
(badly scaled linear) or 2 (quadratic), and one column leaks the label: in the training and validation
rows it nearly gives y away, in the test rows it is noise (make_dataset). A model that keeps it
validates well and fails the test, so the known solution leaves it out (`DROP = [c]`). The `note`
action shows, once per episode, which column leaks and the recipe an earlier run found best (the one
the reference accuracy comes from). The reference policy reads the note, README.md, train.py and a
few data rows, then applies the recipe, runs and evaluates; after a context reset the recipe is gone
unless CONTINUATION.md carries it. No fixed recipe solves more than about one task in four (5 of
the 22 held-out ones at best): the leaking column differs from task to task, and the validation
split cannot show which it is (tests/test_autoresearch.py checks a grid of fixed recipes). An agent could still find the column by
analysing the training data (it correlates with y far more than any real feature): a data scientist's
check, not a hole in the grader. `relay_policy`. `extra_train_relay` / `extra_test_relay` add that many relay tasks per
training / test lab (after its own, so every other task stays as it was). `relay_fact` (camg_eval's relay stages): the fact is the leaking column, as the recipe's
`DROP=[c]` or the note's `column xc`.

Simplified on purpose: one model family and one metric (accuracy), small data (1,500 training
rows, 8 columns) so that a run takes well under a second on 2 cores; no leaderboard, no medals.
"""

import re

import numpy as np

from workspace import MEMORY_DIR, ShellTaskEnv, Task, Workspace, read_workspace_file, whole_word

SUCCESS_THRESHOLD = 0.5
NUM_TRAIN, NUM_VAL, NUM_TEST, NUM_COLUMNS = 1500, 500, 1000, 8
ACTIONS_LINE = "Actions: shell: <command> | run | evaluate"
VALID_FORMS = ("Valid actions: shell: <command> (e.g. shell: cat train.py) | run (= python train.py) | "
               "evaluate (scores predictions.csv on the hidden test labels; ends the episode)")

TRAIN_SCRIPT = '''"""Baseline: logistic regression trained by full-batch gradient descent (numpy only).
Edit the settings, run `python train.py` (writes predictions.csv), then use the `evaluate` action."""
import numpy as np

# --- settings
STANDARDIZE = False   # scale each column to mean 0, std 1 (statistics of the training rows)
POLY_DEGREE = 1       # 2 also adds every product x_i * x_j (squares included)
EPOCHS = 20           # full-batch gradient steps
LR = 0.05             # learning rate
L2 = 0.0              # weight decay
DROP = []             # columns to leave out, e.g. [3]


def load(path):
    return np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)


def features(X, stats):
    if STANDARDIZE:
        X = (X - stats[0]) / stats[1]
    if POLY_DEGREE >= 2:
        i, j = np.triu_indices(X.shape[1])
        X = np.hstack([X, X[:, i] * X[:, j]])
    return X


def fit(X, y):
    w, b = np.zeros(X.shape[1]), 0.0
    for _ in range(EPOCHS):
        p = 1 / (1 + np.exp(-np.clip(X @ w + b, -30, 30)))
        g = p - y
        w -= LR * (X.T @ g / len(y) + L2 * w)
        b -= LR * g.mean()
    return w, b


def run(train, val, test):
    keep = lambda A: np.delete(A, DROP, axis=1)   # the columns left in
    X, y = keep(train[:, :-1]), train[:, -1]
    stats = (X.mean(0), X.std(0) + 1e-8)
    w, b = fit(features(X, stats), y)
    predict = lambda A: (features(keep(A), stats) @ w + b > 0).astype(int)
    val_acc = float((predict(val[:, :-1]) == val[:, -1]).mean())
    return predict(test), val_acc


if __name__ == "__main__":
    preds, val_acc = run(load("data/train.csv"), load("data/val.csv"), load("data/test.csv"))
    np.savetxt("predictions.csv", preds, fmt="%d", header="y", comments="")
    print(f"val accuracy {val_acc:.4f}; wrote predictions.csv ({len(preds)} rows)")
'''
# the stronger known solutions; the reference is whichever validates better
REFERENCE_RECIPES = ({"STANDARDIZE": "True", "POLY_DEGREE": "1", "EPOCHS": "300", "LR": "0.5"},
                     {"STANDARDIZE": "True", "POLY_DEGREE": "2", "EPOCHS": "300", "LR": "0.5"})


# --- reward: a pure function

def normalized_score(accuracy: float, baseline: float, reference: float) -> tuple[float, dict]:
    assert reference > baseline, f"reference {reference} must beat baseline {baseline}"
    reward = float(np.clip((accuracy - baseline) / (reference - baseline), 0.0, 1.0))
    return reward, {"accuracy": accuracy, "baseline": baseline, "reference": reference}


def with_settings(script: str, settings: dict) -> str:
    """Rewrite the `NAME = value` lines of the settings block (what `sed -i` does in the shell)."""
    for name, value in settings.items():
        script, n = re.subn(rf"^{name} = [^#\n]*?(\s*#|$)", rf"{name} = {value}\1", script, count=1, flags=re.M)
        assert n == 1, f"setting {name} not found in the script"
    return script


def run_script(script: str, train, val, test):
    """Run the script's `run()` in-process (same text as the workspace's train.py)."""
    namespace = {"__name__": "autoresearch_task"}
    exec(compile(script, "train.py", "exec"), namespace)
    return namespace["run"](train, val, test)


# --- datasets, generated from the task's seed

def make_dataset(seed: int, difficulty: int, leak: bool = False):
    """-> X [N, 8] float, y [N] in {0, 1}, the leaking column (None without `leak`); N = train + val + test.

    leak: one column is recorded after the outcome. In the training and validation rows it nearly gives
    y away, so a model fitted on all columns leans on it and validates well. In the test rows it is
    noise of the same distribution, so that model fails on test; nothing in the features shows which
    column it is there. The fix is to leave it out (DROP), which the lab note of a relay task says."""
    rng = np.random.default_rng(seed)
    n = NUM_TRAIN + NUM_VAL + NUM_TEST
    Z = rng.normal(size=(n, NUM_COLUMNS))
    leaky = int(rng.integers(NUM_COLUMNS)) if leak else None
    R = Z[:, [c for c in range(NUM_COLUMNS) if c != leaky]]   # the columns the label depends on
    if difficulty == 2:   # a quadratic boundary: a product of two columns plus a square
        i, j = rng.choice(R.shape[1], 2, replace=False)
        k = int(rng.integers(R.shape[1]))
        logits = 2 * R[:, i] * R[:, j] + (R[:, k] ** 2 - 1) + 0.25 * R @ rng.normal(size=R.shape[1])
    else:
        logits = R @ rng.normal(size=R.shape[1])
    logits = 3 * logits / logits.std()
    y = (logits + 0.5 * rng.logistic(size=n) > 0).astype(int)
    if leak:
        Z[:, leaky] = 4 * (y - 0.5) + rng.normal(size=n)      # two bumps at +-2: y nearly given away
        Z[NUM_TRAIN + NUM_VAL:, leaky] = rng.permutation(Z[NUM_TRAIN + NUM_VAL:, leaky])   # test: noise
    # mis-scaled columns are what breaks plain gradient descent: mild at 0, severe at 1 and 2
    top = 1.2 if difficulty == 0 else 3.0
    scale = 10 ** rng.uniform(0.3 if difficulty == 0 else 0.0, top, NUM_COLUMNS)
    offset = rng.uniform(-1 if difficulty == 0 else -3, 1 if difficulty == 0 else 3, NUM_COLUMNS) * scale
    X = np.round(Z * scale + offset, 4)
    return X, y, leaky


def to_csv(X, y=None) -> str:
    cols = [f"x{i}" for i in range(X.shape[1])] + (["y"] if y is not None else [])
    rows = [",".join(f"{v:.4f}" for v in x) + (f",{int(t)}" if y is not None else "") for x, t in
            zip(X, y if y is not None else [None] * len(X))]
    return ",".join(cols) + "\n" + "\n".join(rows) + "\n"


# --- the environment

class AutoResearchEnv(ShellTaskEnv):
    VALID_FORMS = VALID_FORMS                # shown after an invalid action
    OUT_OF_ACTIONS = "nothing evaluated"
    def __init__(self, seed: int = 0, num_train_groups: int = 16, num_test_groups: int = 11,
                 tasks_per_group: int = 12, max_steps: int = 20, run_timeout: float = 20.0,
                 relay_per_group: int = 0, extra_train_relay: int = 0, extra_test_relay: int = 0):
        assert tasks_per_group % 3 == 0, "tasks_per_group must be a multiple of 3 (one third per difficulty)"
        self.config = dict(seed=seed, num_train_groups=num_train_groups, num_test_groups=num_test_groups,
                           tasks_per_group=tasks_per_group, max_steps=max_steps, run_timeout=run_timeout,
                           relay_per_group=relay_per_group, extra_train_relay=extra_train_relay,
                           extra_test_relay=extra_test_relay)
        self.seed, self.max_steps, self.run_timeout = seed, max_steps, run_timeout
        self._tasks = {"train": [], "test": []}
        for g in range(num_train_groups + num_test_groups):
            split = "train" if g < num_train_groups else "test"
            for k in range(tasks_per_group):
                difficulty = 3 * k // tasks_per_group
                self._tasks[split].append(Task(
                    id=f"autoresearch/lab{g:02d}/t{k:02d}", env="autoresearch", difficulty=difficulty,
                    group=f"lab{g:02d}", split=split, data={"seed": int(seed * 100_003 + g * 1_000 + k)}))
            extra = extra_train_relay if split == "train" else 0   # seeds 500 + k: the other tasks stay the same
            self._tasks[split] += [self.relay_task(g, k, split) for k in range(relay_per_group + extra)]
        # the extra test tasks after every other (so the first test tasks stay the same, in order)
        self._tasks["test"] += [self.relay_task(g, k, "test") for g in range(num_train_groups, num_train_groups
                                + num_test_groups) for k in range(relay_per_group, relay_per_group + extra_test_relay)]
        self._built = {}  # task id -> (files, hidden labels, baseline, reference, best recipe); built on first reset
        self.workspace = Workspace(run_timeout, obs_chars=2000, keep_tail=True, say_timeout=True)
        self.task, self.info, self.done = None, {}, True

    def relay_task(self, g: int, k: int, split: str) -> Task:
        """Relay task k of lab g: the recipe is in a lab note shown once (seed 500 + k of the lab's)."""
        return Task(id=f"autoresearch/lab{g:02d}/relay{k:02d}", env="autoresearch", difficulty=3,
                    group=f"lab{g:02d}", split=split,
                    data={"seed": int(self.seed * 100_003 + g * 1_000 + 500 + k), "kind": 1 + k % 2, "note": True})

    def build(self, task: Task):
        """Dataset, workspace files, hidden labels and the two reference accuracies of one task."""
        if task.id not in self._built:
            seed = task.data["seed"]
            while True:  # redraw the rare dataset where the baseline already matches the reference
                X, y, leaky = make_dataset(seed, task.data.get("kind", task.difficulty), leak=task.data.get("note", False))
                a, b = NUM_TRAIN, NUM_TRAIN + NUM_VAL
                train, val = np.column_stack([X[:a], y[:a]]), np.column_stack([X[a:b], y[a:b]])
                test_X, test_y = X[b:], y[b:]
                base_pred, _ = run_script(TRAIN_SCRIPT, train, val, test_X)
                baseline = float((base_pred == test_y).mean())
                recipes = [dict(r, DROP=f"[{leaky}]") if leaky is not None else r for r in REFERENCE_RECIPES]
                runs = [run_script(with_settings(TRAIN_SCRIPT, r), train, val, test_X) for r in recipes]
                best = max(range(len(runs)), key=lambda i: runs[i][1])   # model selection on validation, as a person would
                best_pred = runs[best][0]
                reference = float((best_pred == test_y).mean())
                if reference - baseline >= 0.05:
                    break
                seed += 7919
            readme = (f"# Task {task.id}\nBinary classification of `y` from x0..x{NUM_COLUMNS - 1}.\n"
                      f"- data/train.csv ({NUM_TRAIN} rows), data/val.csv ({NUM_VAL} rows): features and label y\n"
                      f"- data/test.csv ({NUM_TEST} rows): features only; labels are hidden\n"
                      "- train.py: the baseline; `python train.py` writes predictions.csv (header y, one 0/1 per row)\n"
                      f"- baseline test accuracy {baseline:.4f}; a stronger known solution reaches {reference:.4f}\n"
                      "- reward = clip((accuracy - baseline) / (reference - baseline), 0, 1), given by `evaluate`\n")
            files = {"README.md": readme, "train.py": TRAIN_SCRIPT, "data/train.csv": to_csv(train[:, :-1], y[:a]),
                     "data/val.csv": to_csv(val[:, :-1], y[a:b]), "data/test.csv": to_csv(test_X)}
            if len(self._built) >= 8:  # a stream touches one task at a time; keep memory flat
                self._built.pop(next(iter(self._built)))
            self._built[task.id] = (files, test_y, baseline, reference, recipes[best])
        return self._built[task.id]

    def lab_note(self, task: Task) -> str | None:
        """What the `note` action of a relay task shows (once); None for a task without a note."""
        if not task.data.get("note"):
            return None
        best = self.build(task)[4]
        return (f"Lab note (shown once): column x{best['DROP'][1:-1]} leaks the label in train and val and is "
                "noise in test. An earlier run found the best recipe: " + " ".join(f"{k}={v}" for k, v in best.items()))

    def relay_fact(self, task: Task) -> dict | None:
        """The fact a relay task carries (camg_memory's relay stages): the leaking column, as the recipe
        writes it (DROP=[c], any spacing) or as the note names it (column xc); None without a note."""
        note = self.lab_note(task)
        if note is None:
            return None
        c = self.build(task)[4]["DROP"][1:-1]
        return {"source": note, "values": [rf"DROP\s*=\s*\[\s*{c}\s*\]|{whole_word(f'column x{c}')}"]}

    # --- episode

    def reset(self, task: Task) -> str:
        assert task.env == "autoresearch", f"AutoResearchEnv got a task of env {task.env!r}"
        files, self.hidden_labels, self.baseline, self.reference, _ = self.build(task)
        self.note = self.lab_note(task)
        self.workspace.clear()  # a fresh copy of the task; only the memory folder carries over
        workdir = self.workdir
        for rel, text in files.items():
            (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
            (workdir / rel).write_text(text)
        self.task, self.done, self.steps = task, False, 0
        self.info = {"success": False, "reward": 0.0, "accuracy": 0.0, "baseline": self.baseline,
                     "reference": self.reference, "steps": 0, "num_shell": 0, "num_runs": 0, "num_invalid": 0}
        return (f"Task: improve train.py so that its test predictions beat the baseline "
                f"(test accuracy {self.baseline:.4f}; reference {self.reference:.4f}). See README.md.\n"
                f"Files: README.md train.py data/train.csv data/val.csv data/test.csv\n{ACTIONS_LINE}\n"
                f"{self.memory_line()}")

    def _act(self, action: str):
        if self.task.data.get("note") and re.fullmatch(r"note(\[\])?", action, re.I):
            shown, self.note = self.note, None
            return shown or "The lab note was shown once already; it is not shown again."
        if re.fullmatch(r"run(\[\])?", action, re.I):
            self.info["num_runs"] += 1
            return self.workspace.shell("python train.py")
        if re.fullmatch(r"evaluate(\[\])?|submit", action, re.I):
            return self._evaluate()
        return self._invalid(f"Unknown action {action[:80]!r}.")

    def _evaluate(self):
        text = read_workspace_file(self.workdir, "predictions.csv", 1 << 20)   # never through a symlink
        if text is None:
            return self._invalid("No predictions.csv (a regular file) in the workspace yet: write it first (e.g. run).")
        lines = [s.strip() for s in text.splitlines() if s.strip()]
        if lines and lines[0].lower() == "y":
            lines = lines[1:]
        if len(lines) != NUM_TEST or any(s not in ("0", "1") for s in lines):
            return self._invalid(f"predictions.csv must hold {NUM_TEST} lines of 0 or 1 (after an optional "
                                 f"header y); found {len(lines)} lines.")
        accuracy = float((np.array([int(s) for s in lines]) == self.hidden_labels).mean())
        reward, parts = normalized_score(accuracy, self.baseline, self.reference)
        self.info.update(parts, reward=reward, success=reward >= SUCCESS_THRESHOLD)
        return (f"Test accuracy {accuracy:.4f} (baseline {self.baseline:.4f}, reference {self.reference:.4f}): "
                f"reward {reward:.2f}."), reward

    # --- scripted reference policy: try known recipes, keep the best in memory, evaluate

    def reference_policy(self, task: Task):
        if task.data.get("note"):
            return relay_policy(task)
        notes = f"{MEMORY_DIR}/notes.md"
        st = {"todo": None, "results": [], "phase": "start"}

        def policy(obs: str) -> str:
            if st["phase"] == "start":
                st["phase"] = "read"
                return f"shell: cat {notes}"
            if st["phase"] == "read":   # the answer to `cat`: a remembered recipe goes first
                m = re.search(r"^- best recipe: (.+)$", obs, re.M)
                known = dict(re.findall(r"(\w+)=(\S+)", m.group(1))) if m else None
                st["todo"] = [known] if known else [dict(r) for r in REFERENCE_RECIPES]
                if known and known.get("POLY_DEGREE") != "2":   # a linear recipe may miss a curved boundary
                    st["todo"].append({**known, "POLY_DEGREE": "2"})
                st["phase"] = "try"
                st["current"] = st["todo"].pop(0)
                return sed(st["current"])
            if st["phase"] == "try":
                m = re.search(r"val accuracy ([\d.]+)", obs)
                st["results"].append((float(m.group(1)) if m else -1.0, st["current"]))
                if st["todo"]:
                    st["current"] = st["todo"].pop(0)
                    return sed(st["current"])
                best_acc, best = max(st["results"], key=lambda r: r[0])
                st["phase"] = "save"
                if best is not st["current"]:  # the last run was not the best: rerun the best one
                    st["current"] = best
                    return sed(best)
            if st["phase"] == "save":
                best_acc, best = max(st["results"], key=lambda r: r[0])
                st["phase"] = "eval"
                recipe = " ".join(f"{k}={v}" for k, v in best.items())
                return (f"shell: printf '%s\\n' '# autoresearch notes' '- best recipe: {recipe}' "
                        f"'- last val accuracy: {best_acc:.4f}' > {notes}")
            return "evaluate"
        return policy


def sed(recipe: dict, copy: bool = False) -> str:
    """The shell action that applies a recipe to train.py and runs it. copy: each value is written after
    the `KNOB=` the lab note and the saved file spell it with (`s/^DROP = .*/DROP=[4]/`), so writing it is a
    copy of the line read back after a reset; otherwise `DROP = [4]`, train.py's own spelling, which the
    standard family's repeated edits match again."""
    edits = " ".join(f"-e 's/^{k} = .*/{k}={v}/'" if copy else f"-e 's/^{k} = [^ ]*/{k} = {v}/'"
                     for k, v in recipe.items())
    return f"shell: sed -i {edits} train.py && python train.py" if edits else "shell: python train.py"


def relay_policy(task: Task):
    """The reference for a relay task: read the lab note, read README.md, train.py and a few data rows,
    apply the note's recipe, run, evaluate. It takes the recipe and its progress from any observation
    that shows them (the note, or a CONTINUATION.md holding the lines notes() gives), so a fresh copy
    after a context reset resumes from the file."""
    st = {"recipe": None, "asked": False, "reads": 0, "ran": False}
    reads = ["shell: cat README.md", "shell: head -n 12 train.py", "shell: head -n 4 data/train.csv"]

    def policy(obs: str) -> str:
        m = re.search(r"best recipe: ((?:\w+=\S+ ?)+)", obs)
        if m and st["recipe"] is None:
            st["recipe"] = dict(re.findall(r"(\w+)=(\S+)", m.group(1)))
        done = re.search(r"^- progress: reads=(\d) ran=(\d)$", obs, re.M)
        if done:
            st["reads"], st["ran"] = max(st["reads"], int(done.group(1))), st["ran"] or done.group(2) == "1"
        st["ran"] = st["ran"] or "val accuracy" in obs
        if st["recipe"] is None and not st["asked"]:
            st["asked"] = True
            return "note"
        if st["reads"] < len(reads):
            st["reads"] += 1
            return reads[st["reads"] - 1]
        return "evaluate" if st["ran"] else sed(st["recipe"] or {}, copy=True)
    policy.notes = lambda: ([f"- best recipe: {' '.join(f'{k}={v}' for k, v in st['recipe'].items())}"]
                            if st["recipe"] else []) + [f"- progress: reads={st['reads']} ran={int(st['ran'])}"]
    return policy
