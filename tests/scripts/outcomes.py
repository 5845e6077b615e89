"""Each scenario of a launch leaves its own outcome, so that one failing scenario does not hide the others.

A scenario script runs its configs through :func:`run_each`: a scenario that raises leaves its traceback in
``<name>.rank<r>.failed`` (what ``tests.launch.Launch.ranks`` reports as that scenario's failure) and the launch goes on
with the next scenario. A failure that takes the process down (a rank ended by the watchdog, a crash) leaves the
scenarios after it without outcome; their tests then report the launch's output.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any, Callable


def this_rank() -> int:
    """The global rank, from the process group once there is one, else from the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def run_each(out: Path, configs: list[dict], run: Callable[[Path, dict], Any]) -> None:
    """``run(out, config)`` for each config in order; one that raises writes its traceback and the next one runs."""
    failed: list[str] = []
    for cfg in configs:
        try:
            run(out, dict(cfg))
        except Exception:
            text = traceback.format_exc()
            if failed:  # a broken process group can make a later scenario fail as well: say what came first
                text += f"\n(earlier scenarios of this launch that failed on this rank: {', '.join(failed)})\n"
            (out / f"{cfg['name']}.rank{this_rank()}.failed").write_text(text)
            failed.append(cfg["name"])
