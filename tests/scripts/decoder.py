"""Train the Llama-style decoder (tests/decoder_models.py) under several pipeline configurations; each rank saves
what it saw. Usage: decoder.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", ...}); a config that raises
leaves its traceback in ``<name>.rank<r>.failed`` and the next one runs (tests/scripts/outcomes.py)."""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.decoder_models import run_decoder
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    strategy = lightning_pipe.PipelineParallelStrategy(schedule=cfg["schedule"])
    result = run_decoder(strategy, devices=cfg["devices"], keyword_mask=cfg.get("keyword", False))
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
