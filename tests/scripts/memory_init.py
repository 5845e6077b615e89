"""Meta-device construction under the pipeline: each rank's initial weights and memory report.
Usage: memory_init.py OUT_DIR CONFIGS_JSON  (a list of {"name", "family", "devices"}). A config that raises leaves its
traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py)."""

import json
import sys
from pathlib import Path

import torch

from tests.memory_models import run_meta
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    result = run_meta(cfg["family"], cfg["devices"], schedule=cfg.get("schedule", "1F1B"))
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
