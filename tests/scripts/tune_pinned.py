"""docs/tuning.md's pinning snippet, run as documented at the top of a script, then ``tune`` at 2 processes.

Usage: tune_pinned.py OUT_DIR. Each rank saves its threads' affinities and the tuner's notes to
OUT_DIR/pinned.rank<r>.pt.
"""

import re
import sys
from pathlib import Path

# The snippet exactly as the page shows it, before torch starts any thread (every rank runs this script).
PAGE = (Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
exec(next(b for b in re.findall(r"```python\n(.*?)```", PAGE, re.S) if "sched_setaffinity" in b))  # noqa: S102

import os  # noqa: E402

import torch  # noqa: E402

import lightning_pipe  # noqa: E402
from lightning_pipe import SearchSpace  # noqa: E402
from tests.models import LitLM, quiet_trainer  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    trainer = quiet_trainer(strategy="pipeline", devices=2, max_steps=2, default_root_dir=str(out))
    space = SearchSpace(schedules=("GPipe", "1F1B"), microbatches=(2,), activation_checkpointing=(0,))
    result = lightning_pipe.tune(trainer, LitLM(n_layers=4), space=space, steps=1, warmup_steps=1, max_trials=2)
    threads = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]
    torch.save({"notes": result.notes, "threads": threads}, out / f"pinned.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
