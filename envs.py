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
  `reset()` on the same instance while `env.keep_memory` holds (make()'s option, which says each
  env's default), so files written in one task of a stream are there for the next.
  `memory_files()` returns it as {relative path: text}; `set_memory_files(files)` replaces it
  (blanking and shuffling memory for the ablations go through these two).

What they share lives in workspace.py: `Task`, the memory folder, `Workspace` and `WorkspaceEnv`
(this contract once for every shell env), `ShellTaskEnv` (the step loop of Shop, DeepResearch and
AutoResearch) and `BM25` (the search of the two text environments). The domain files import it from there, and this
file imports them only inside make(): one direction, no circle.
"""

from workspace import (MEMORY_DIR, MEMORY_FILE_BYTES, MEMORY_TOTAL_BYTES, BM25, ShellTaskEnv, Task,  # noqa: F401
                       Workspace, read_memory, read_workspace_file, tokenize, write_memory)
# re-exported for the callers that import them from here (Task above all)

ENV_NAMES = ("alchemy", "codebase", "shop", "coding", "deepresearch", "autoresearch")


def make(name: str, keep_memory: bool | None = None, **kwargs):
    """Build an environment by name. kwargs go to its constructor (e.g. seed, num_worlds).

    keep_memory: whether `.agent_memory/` carries from one task to the next on this instance (and
    its clones): True, files written in one task of a stream are there for the next; False, each
    task starts blank. Either way, set_memory_files() before a reset decides what that task starts
    with. Every env with a file memory takes it; None keeps its default: True for shop,
    deepresearch and autoresearch (their tasks build on the notes), False for coding (a bug fix
    stands alone unless asked). alchemy and codebase have no such option (RIME's memory is the
    writer's text, given in the prompt): ValueError."""
    if name not in ENV_NAMES:
        raise ValueError(f"unknown environment {name!r}; choose one of {', '.join(ENV_NAMES)}")
    if keep_memory is not None and name in ("alchemy", "codebase"):
        raise ValueError(f"{name} has no keep_memory option: RIME's memory is the writer's text, not files")
    # plain if/elif with lazy imports: a user who only runs Alchemy never imports the shell envs
    if name == "alchemy":
        from alchemy import AlchemyEnv
        return AlchemyEnv(**kwargs)
    if name == "codebase":
        from codebase import CodebaseEnv
        return CodebaseEnv(**kwargs)
    if name == "coding":
        from codebase import CodingEnv
        env = CodingEnv(**kwargs)
    elif name == "shop":
        from shop import ShopEnv
        env = ShopEnv(**kwargs)
    elif name == "deepresearch":
        from deepresearch import DeepResearchEnv
        env = DeepResearchEnv(**kwargs)
    else:
        from autoresearch import AutoResearchEnv
        env = AutoResearchEnv(**kwargs)
    if keep_memory is not None:
        env.keep_memory = keep_memory
    return env
