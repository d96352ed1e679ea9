"""The environments behind one small interface.

RIME's two domains (Symbolic Alchemy, Codebase Adaptation) and CAMG's four (Shop, Coding,
DeepResearch, AutoResearch) all look the same to the agent loop in `rollout.py`:

    env = make("alchemy")              # or "codebase", "shop", "coding", "deepresearch", "autoresearch"
    tasks = env.tasks("train")         # "train" | "test"; each Task has .id and .difficulty
    obs = env.reset(task)              # the task instruction plus the valid action forms
    obs, reward, done = env.step(action_text)
    policy = env.reference_policy(task)  # scripted agent: obs -> action, solves the task

The contract every environment keeps (each lives in its own file, one concept per file):
- `step(action)` takes the text the agent put inside its `<action>...</action>` tag (already
  stripped by rollout.py). An invalid action never raises: it returns an observation that explains
  the valid forms, reward 0, and still uses one step of the budget.
- The rewards of one episode sum to its score, in [0, 1] (1 = best achievable).
- `done` becomes True when the task ends or the action budget `max_steps` is spent.
- `env.info` is a dict of extra numbers for logging about the current episode (for example
  `success`, `resolved`, `f2p_frac`), reset by `reset()`.
- `clone()` returns an independent instance with the same configuration (same worlds, same
  catalogue), so that many episodes run side by side, one instance each.
- `close()` releases what the instance holds (sandbox processes, temporary workspaces).
- Environments with a shell workspace (codebase, coding, shop, deepresearch, autoresearch) have
  `env.workdir` (pathlib.Path) and a memory folder `.agent_memory/` inside it that survives
  `reset()` on the same instance, so files written in one task of a stream are there for the next.
  `memory_files()` returns it as {relative path: text}; `set_memory_files(files)` replaces it
  (blanking and shuffling memory for the ablations go through these two).

What they share lives in workspace.py: `Task`, the memory folder, `Workspace` (this contract once
for the shell envs), `ShellTaskEnv` (the step loop of Shop, DeepResearch and AutoResearch) and
`BM25` (the search of the two text environments). The domain files import it from there, and this
file imports them only inside make(): one direction, no circle.
"""

from workspace import (MEMORY_DIR, MEMORY_FILE_BYTES, MEMORY_TOTAL_BYTES, BM25, ShellTaskEnv, Task,  # noqa: F401
                       Workspace, read_memory, read_workspace_file, tokenize, write_memory)
# re-exported for the callers that import them from here (Task above all)

ENV_NAMES = ("alchemy", "codebase", "shop", "coding", "deepresearch", "autoresearch")


def make(name: str, **kwargs):
    """Build an environment by name. kwargs go to its constructor (e.g. seed, num_worlds)."""
    # plain if/elif with lazy imports: a user who only runs Alchemy never imports the shell envs
    if name == "alchemy":
        from alchemy import AlchemyEnv
        return AlchemyEnv(**kwargs)
    if name == "codebase":
        from codebase import CodebaseEnv
        return CodebaseEnv(**kwargs)
    if name == "coding":
        from codebase import CodingEnv
        return CodingEnv(**kwargs)
    if name == "shop":
        from shop import ShopEnv
        return ShopEnv(**kwargs)
    if name == "deepresearch":
        from deepresearch import DeepResearchEnv
        return DeepResearchEnv(**kwargs)
    if name == "autoresearch":
        from autoresearch import AutoResearchEnv
        return AutoResearchEnv(**kwargs)
    raise ValueError(f"unknown environment {name!r}; choose one of {', '.join(ENV_NAMES)}")
