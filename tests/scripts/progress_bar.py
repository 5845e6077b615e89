"""The progress bars under a 2-stage pipeline: each rank saves what its bar displayed (tests/progress.py).

Usage: progress_bar.py OUT_DIR CONFIGS_JSON  (a list of {"name": "tqdm"|"rich"}; 1F1B, 2 microbatches). Each rank
saves ``<name>.rank<r>.pt``; a bar whose run raises leaves its traceback in ``<name>.rank<r>.failed`` and the next one
runs (tests/scripts/outcomes.py).
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.progress import run
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run_bar)


def run_bar(out: Path, cfg: dict) -> None:
    strategy = lightning_pipe.PipelineParallelStrategy(schedule="1F1B", microbatches=2)
    result = run(cfg["name"], out, strategy=strategy, devices=2)
    torch.save(result, out / f"{cfg['name']}.rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main()
