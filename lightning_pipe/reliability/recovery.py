"""Recovery in place: a lost rank replaced while the others keep their processes (docs/reliability.md).

With ``snapshot_every`` (and ``max_restarts``) under Lightning's launcher, the supervisor (:mod:`.restart`) does not
end every rank when one dies: it starts a replacement process for the lost local rank and announces a new
*generation* of the run (a new ``MASTER_PORT``) in the recovery file, which the surviving ranks wait for. Every rank
of the new generation then creates a process group on that port; the survivors restore their own in-memory snapshot
and the replacement its lost predecessor's, sent by the buddy that held it (``lightning_pipe.checkpoint.snapshot``).
Once they agreed, global rank 0 marks the generation recovered; a failure before that mark falls back to today's
restart of every rank from the newest checkpoint on disk.

This module is the process-level part, shared by the supervisor and the ranks: the recovery file, the environment
that tells a rank its generation and whether it replaces a lost one, and the buddy placement.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

#: Set by the supervisor: the recovery file (its presence enables recovery in place), this rank's generation, and
#: (for a replacement) the generation it joins.
RECOVERY_FILE = "LIGHTNING_PIPE_RECOVERY_FILE"
GENERATION = "LIGHTNING_PIPE_GENERATION"
REPLACES = "LIGHTNING_PIPE_REPLACES"
#: Set by the supervisor for a hot spare (``spares``): its index among the spares, until it is given a rank.
SPARE = "LIGHTNING_PIPE_SPARE"
#: Seconds a surviving rank waits for the supervisor's next generation before it gives up (and the run restarts).
WAIT = 60.0


def enabled() -> bool:
    """Whether this rank was started by a supervisor that recovers in place."""
    return bool(os.environ.get(RECOVERY_FILE))


def generation() -> int:
    """This process's generation of the run (0 until a recovery)."""
    value = os.environ.get(GENERATION, "0")
    return int(value) if value.isdigit() else 0


def is_replacement() -> bool:
    """Whether this process was started in place of a lost rank (and has not joined its generation yet)."""
    return bool(os.environ.get(REPLACES))


def is_spare() -> bool:
    """Whether this process is a hot spare waiting for a rank to replace."""
    return bool(os.environ.get(SPARE))


def await_assignment() -> None:
    """Hot spare (``spares``): wait, imported and built, until the supervisor gives it a lost rank's place; then it
    is that rank's replacement in the announced generation. (The supervisor ends the spares it did not use.)"""
    file, index = Path(os.environ[RECOVERY_FILE]), os.environ[SPARE]
    while True:
        data = read(file)
        assigned = data.get("assigned", {}).get(index)
        if assigned is not None:
            generation, rank, port = assigned
            os.environ.update({"LOCAL_RANK": str(rank), REPLACES: str(generation)})
            os.environ.pop(SPARE)
            enter(generation, port)
            return
        time.sleep(0.02)


def joined() -> None:
    """This replacement has joined its generation: a later failure makes it a survivor like the others."""
    os.environ.pop(REPLACES, None)


def buddies(world_size: int, ranks_per_node: int, replicas: Sequence[Sequence[int]] = ()) -> list[int]:
    """The rank that keeps a copy of each rank's snapshot (a permutation: every rank sends one copy and keeps one).

    ``replicas``: for each stage position, the global ranks holding it, by data-parallel rank (empty, or lists of one
    rank: a single pipeline). In order of preference: the same stage position in a further replica (it holds the same
    weights and optimizer state) when that puts every copy on another node; else, with several nodes, the same local
    rank on the next node (a node that dies takes its processes with it, so a copy must not be on it); else the same
    stage position in the next replica; else the next rank.
    """
    nodes = -(-world_size // ranks_per_node)
    columns = [list(c) for c in replicas if len(c) > 1]
    shifted = [_shifted(columns, k, world_size) for k in range(1, len(columns[0]))] if columns else []
    for buddy in shifted:
        if nodes > 1 and all(b // ranks_per_node != r // ranks_per_node for r, b in enumerate(buddy)):
            return buddy
    if nodes > 1:
        return [(r + ranks_per_node) % world_size for r in range(world_size)]
    if shifted:
        return shifted[0]
    return [(r + 1) % world_size for r in range(world_size)]


def _shifted(columns: list[list[int]], k: int, world_size: int) -> list[int]:
    """Each rank's buddy: the same stage position ``k`` replicas further on."""
    buddy = list(range(world_size))
    for column in columns:
        for d, r in enumerate(column):
            buddy[r] = column[(d + k) % len(column)]
    return buddy


def buddy_of(rank: int, world_size: int, ranks_per_node: int, replicas: Sequence[Sequence[int]] = ()) -> int:
    """The rank that keeps a copy of ``rank``'s snapshot (:func:`buddies`)."""
    return buddies(world_size, ranks_per_node, replicas)[rank]


def held_by(rank: int, world_size: int, ranks_per_node: int, replicas: Sequence[Sequence[int]] = ()) -> int:
    """The rank whose snapshot ``rank`` keeps a copy of (the inverse of :func:`buddy_of`)."""
    return buddies(world_size, ranks_per_node, replicas).index(rank)


# ---------------------------------------------------------------------------------------------------- the file
def announce(file: Path, generation: int, port: int, replaced: list[int], spare: Optional[int] = None) -> None:
    """Supervisor: generation ``generation`` of the run rendezvous on ``port`` (atomically replaced); ``spare``: the
    index of the hot spare that takes ``replaced[0]``'s place."""
    data = {**read(file), "generation": generation, "port": port, "replaced": replaced}
    if spare is not None:
        data["assigned"] = {**data.get("assigned", {}), str(spare): [generation, replaced[0], port]}
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(file)


def read(file: Path) -> dict:
    try:
        return dict(json.loads(file.read_text()))
    except (OSError, ValueError):
        return {}


def fall_back(file: Path) -> None:
    """Supervisor: no further generation; surviving ranks waiting for one give up at once (every rank restarts)."""
    data = read(file)
    data["fallback"] = True
    file.write_text(json.dumps(data))


def mark_recovered(generation: int) -> None:
    """Global rank 0 of ``generation``: every rank restored its snapshot; a later failure may be recovered in place."""
    file = os.environ.get(RECOVERY_FILE)
    if file:
        Path(f"{file}.recovered{generation}").touch()


def is_recovered(file: Path, generation: int) -> bool:
    return generation == 0 or Path(f"{file}.recovered{generation}").exists()


def await_generation(after: int, wait: float = WAIT) -> Optional[tuple[int, int]]:
    """Surviving rank: ``(generation, port)`` of the supervisor's next generation after ``after``, or ``None`` when it
    announces none within ``wait`` seconds."""
    file = Path(os.environ[RECOVERY_FILE])
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        data = read(file)
        if data.get("fallback"):
            return None
        if int(data.get("generation", 0)) > after:
            return int(data["generation"]), int(data["port"])
        time.sleep(0.05)
    return None


def enter(generation: int, port: int) -> None:
    """This process now belongs to ``generation``, whose process group rendezvous on ``port``."""
    os.environ[GENERATION] = str(generation)
    os.environ["MASTER_PORT"] = str(port)
