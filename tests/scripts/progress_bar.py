"""The progress bars under a 2-stage pipeline: each rank saves what its bar displayed (tests/progress.py).

Usage: progress_bar.py OUT_DIR BARS_JSON  (a list of "tqdm"/"rich"; 1F1B, 2 microbatches).
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.progress import run


def main() -> None:
    out, bars = Path(sys.argv[1]), json.loads(sys.argv[2])
    for bar in bars:
        strategy = lightning_pipe.PipelineParallelStrategy(schedule="1F1B", microbatches=2)
        result = run(bar, out, strategy=strategy, devices=2)
        torch.save(result, out / f"{bar}.rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main()
