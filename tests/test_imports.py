"""The house plan: which project module may import which (the README's diagram), checked on the source.

Every top-level *.py is parsed (nothing is imported), and every `import x` / `from x import y` of a
project module counts, also those inside functions (a lazy import is still an edge: it only moves
the circle to run time)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in REPO.glob("*.py")}
ENTRY_POINTS = {"rime", "camg", "bench", "speed"}   # programs: imported by no module and no other program
ENVIRONMENTS = {"alchemy", "codebase", "shop", "deepresearch", "autoresearch"}

# What the lower floors may import (project modules only; anything not listed here may import any
# non-entry module). A module missing from this table is a new one: say where it belongs.
ALLOWED = {
    "cli": set(), "benchutil": set(), "curriculum": set(),
    "checkpoint_io": set(), "model_config": set(), "gated_delta": set(),
    "model": {"checkpoint_io", "model_config", "gated_delta"},   # model <- generate <- rollout
    "generate": {"model"},
    "rollout": {"generate", "model"},
    "sandbox_helper": set(),                      # runs inside the sandbox: the standard library only
    "sandbox": {"sandbox_helper"},                # sandbox <- workspace <- the environments <- envs
    "workspace": {"sandbox"},
    **{name: {"workspace", "sandbox"} for name in ENVIRONMENTS},
    "grader": set(),                              # codebase's trust checks of a pytest run: pure
    "codebase_tasks": {"workspace", "grader"},    # codebase's data: repositories, cache, tasks, streams
    "codebase": {"codebase_tasks", "workspace", "sandbox", "grader"},
    "envs": {"workspace"} | ENVIRONMENTS,
    "rewards": set(),                             # pure functions of numbers and tensors
    "chat_api": set(),                            # the HTTP client for OpenAI-compatible endpoints
    "judge": {"generate", "model", "chat_api"},   # pure, but for its optional local and HTTP backends
    "ppo_loss": set(),                            # the PPO objective: pure functions of tensors
    "ppo": {"ppo_loss"},                          # the learner knows nothing of agents or environments
    "warmstart": {"curriculum", "rollout", "ppo", "alchemy", "pretrain", "rewards"},   # pretrain: the reading rehearsed
    "pretrain": {"cli", "alchemy", "rollout", "model"},   # the reader: synthetic data in Alchemy's templates, the ladder
    "attribution": {"rewards", "rollout"},        # RIME's diagnostic: stored memories replayed across actors   # RIME's warm start: scripted rows + sft in the learner
    "published": set(),                           # the papers' published figures: data only
    "ablations": {"cli", "benchutil", "published"},   # runs rime.py / camg.py as subprocesses, never imports them
    "camg_memory": {"rollout", "workspace"},      # camg.py's parts: memory modes and the reset protocol,
    "exchange": {"camg_memory"},                  # the records and the exchange between processes,
    "camg_eval": {"camg_memory", "exchange", "published", "rewards", "rollout"},   # evaluation and summary,
    "camg_worker": {"camg_eval", "camg_memory", "exchange", "envs", "model", "rollout"},   # the rollout side
    "camg_reader": {"pretrain", "camg_worker", "camg_memory", "rollout", "model"},   # camg.py's reader: pretrain's loop
}


def project_imports(path: Path) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return (found & MODULES.keys()) - {path.stem}


GRAPH = {name: project_imports(path) for name, path in MODULES.items()}


def find_cycle(graph: dict):
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from model import load\n    import envs.sub\n")
    assert project_imports(f) == {"model", "envs"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_entry_point_is_imported():
    bad = sorted(f"{m} imports {e}" for m, deps in GRAPH.items() for e in deps & ENTRY_POINTS)
    assert not bad, "entry points are programs, imported by no module: " + "; ".join(bad)


def test_the_layers_of_the_house_plan():
    unplaced = sorted(set(MODULES) - ENTRY_POINTS - ALLOWED.keys())
    assert not unplaced, f"modules not in the house plan (tests/test_imports.py ALLOWED): {unplaced}"
    bad = sorted(f"{m} imports {sorted(GRAPH[m] - ok)}" for m, ok in ALLOWED.items()
                 if m in GRAPH and GRAPH[m] - ok)
    assert not bad, "; ".join(bad)


def test_the_sandbox_helper_needs_only_the_standard_library():
    # sandbox.py starts it with `python -I -S`: neither site-packages nor the project are on its path
    import sys
    tree = ast.parse(MODULES["sandbox_helper"].read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= sys.stdlib_module_names, f"sandbox_helper imports {sorted(names - sys.stdlib_module_names)}"
