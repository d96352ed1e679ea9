"""What camg.py's processes hand each other, and how: the episode record (`Sample`) and the exchange
directory. Every hand-off is a file renamed into place (atomic: nothing reads half a file, and no
process waits in a collective for a slow peer): rollout batches into a bounded queue, weights (state
dict + version) from the learner back to the workers, small records (a batch, evaluation parts)
between train ranks. One launch's processes share one session subdirectory (`session_dir`)."""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from camg_memory import memory_action_masks, reset_outcomes


@dataclass
class Sample:
    """One finished episode on its way from a worker to the learner."""
    env: str
    task_id: str
    version: int                    # the policy version that generated it
    worker: int
    score: float
    success: float
    finish: str                     # "done" | "turns" | "error"
    error: str = ""                 # why it could not run (reset raised, rollout crashed, ...); "" = fine
    env_error: str = ""             # the environment raised on an action: ended there with score 0, trained on
    rows: list = field(default_factory=list)   # (tokens, loss_mask, logprobs, sampling temperature), one per context
    num_turns: int = 0
    num_resets: int = 0
    gen_tokens: int = 0
    gen_s: float = 0.0              # this episode's share of its rollout batch's time
    reset_log: list = field(default_factory=list)   # per context reset: continuation.reset_outcomes' dicts
    memory_tokens: list = field(default_factory=list)   # per row: 1 on the tokens of actions on memory files


def to_samples(episodes, names, version: int, worker: int, batch_s: float, envs_=None) -> list[Sample]:
    """rollout Episodes -> Samples; envs_ (camg_memory.ProtocolEnv per episode) adds the reset outcomes."""
    out = []
    for i, (ep, name) in enumerate(zip(episodes, names)):
        all_rows = ep.rows()
        flags = memory_action_masks([r.loss_mask for r in all_rows], ep.actions)
        kept = [(r, f) for r, f in zip(all_rows, flags) if len(r.tokens) >= 2]
        rows = [(r.tokens, r.loss_mask, r.logprobs, r.temperature) for r, _ in kept]
        resets = reset_outcomes(envs_[i]) if envs_ is not None and hasattr(envs_[i], "resets") else []
        out.append(Sample(env=name, task_id=ep.task.id, version=version, worker=worker, score=float(ep.score),
                          success=0.0 if ep.error or ep.env_error else float(ep.info.get("success", 0.0)),
                          finish=ep.finish, error=ep.error, env_error=ep.env_error, rows=rows, num_turns=ep.num_turns, num_resets=ep.num_resets,
                          gen_tokens=sum(sum(r[1]) for r in rows), gen_s=batch_s / max(len(episodes), 1),
                          reset_log=resets, memory_tokens=[f for _, f in kept]))
    return out


def _write_atomic(path: Path, obj, saver=None) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_bytes(pickle.dumps(obj)) if saver is None else saver(obj, tmp)
    os.replace(tmp, path)           # readers list finished files only


class Exchange:
    """The directory one launch's learner and workers share: queue/ of episode batches, weights, flags."""

    def __init__(self, root, max_queue: int = 4):
        self.root, self.max_queue, self.seq = Path(root), max_queue, 0
        self.queue = self.root / "queue"
        self.queue.mkdir(parents=True, exist_ok=True)

    def queued(self) -> list[Path]:
        return sorted(p for p in self.queue.iterdir() if not p.name.startswith("."))   # oldest first

    def put(self, samples: list, worker: int, keep_waiting=lambda: True) -> bool:
        """Queue one rollout batch, waiting while the queue is full; False if told to stop meanwhile."""
        while len(self.queued()) >= self.max_queue:
            if self.stopped() or not keep_waiting():
                return False
            time.sleep(0.05)
        if self.stopped():          # after STOP nothing new enters the queue: the learner has drained it
            return False
        self.seq += 1
        _write_atomic(self.queue / f"{time.time_ns():020d}-w{worker:03d}-{self.seq:06d}.pkl", samples)
        return True

    def take(self) -> list:
        """Every queued episode, oldest batch first; the files are consumed."""
        out = []
        for p in self.queued():
            out += pickle.loads(p.read_bytes())
            p.unlink()
        return out

    def publish(self, state_dict: dict, version: int) -> None:
        _write_atomic(self.root / f"weights-v{version:06d}.pt",
                      {k: v.detach().cpu() for k, v in state_dict.items()}, torch.save)
        for old in sorted(self.root.glob("weights-v*.pt"))[:-2]:   # a worker may still read the previous one
            old.unlink(missing_ok=True)

    def latest_version(self) -> int:
        found = sorted(self.root.glob("weights-v*.pt"))
        return int(found[-1].stem[len("weights-v"):]) if found else -1

    def load_weights(self, version: int, device):
        try:
            return torch.load(self.root / f"weights-v{version:06d}.pt", map_location=device, weights_only=True)
        except FileNotFoundError:   # replaced by a newer version meanwhile: the caller asks again
            return None

    def write(self, name: str, obj) -> None:     # small records between train ranks: a batch, eval results
        _write_atomic(self.root / name, obj)

    def read(self, name: str):
        return pickle.loads((self.root / name).read_bytes()) if (self.root / name).exists() else None

    def gather(self, name: str, world_size: int) -> list:
        """Rank 0's view of a record every train rank wrote as f"{name}-rank{r}.pkl" (waits for each)."""
        parts = []
        for r in range(world_size):
            while (part := self.read(f"{name}-rank{r}.pkl")) is None:
                time.sleep(0.2)
            parts.append(part)
        return parts

    def stop(self) -> None:
        (self.root / "STOP").touch()

    def stopped(self) -> bool:
        return (self.root / "STOP").exists()


def session_dir(exchange_dir: str, run_dir: str) -> Path:
    """One exchange subdirectory per launch, named alike by all its processes, so an earlier launch's
    leftovers (its STOP flag, its weights) are never taken for this one's."""
    base = Path(exchange_dir or Path(run_dir) / "exchange")
    if os.environ.get("CAMG_SESSION"):                  # plain python: the learner names it for its workers
        return base / os.environ["CAMG_SESSION"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")       # torchrun: every rank has the same parent
    run_id = run_id if run_id != "none" else f"ppid{os.getppid()}"
    return base / f"torchrun-{run_id}-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
