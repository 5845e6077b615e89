"""Train an unmodified Hugging Face causal LM (tests/hf_models.py) under pipeline configurations.
Usage: hf.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "devices", "family", "tie", "side"}, optionally
"layers", "max_steps", "weighted", "pipeline_size", "data_parallel", "balance" and "built"); one launch runs them
all, so the family matrix pays the process start-up once (tests/scripts/outcomes.py ``run_each``: a scenario that
fails leaves its traceback and the next one runs; an expected refusal is saved as the scenario's result).
Parameters sharded over data-parallel replicas (``data_parallel="fsdp"``) are saved whole."""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.hf_models import run_hf
from tests.scripts.outcomes import run_each


def run(out: Path, cfg: dict) -> None:
    strategy = lightning_pipe.PipelineParallelStrategy(
        schedule=cfg["schedule"],
        pipeline_size=cfg.get("pipeline_size", "auto"),
        data_parallel=cfg.get("data_parallel", "ddp"),
        balance=cfg.get("balance", "auto"),
    )
    try:
        result = run_hf(
            strategy,
            devices=cfg["devices"],
            max_steps=cfg.get("max_steps", 4),
            family=cfg["family"],
            tie=cfg["tie"],
            side=cfg["side"],
            layers=cfg.get("layers", 8),
            weighted=cfg.get("weighted", True),
            built=cfg.get("built", "init"),
        )
    except lightning_pipe.PipelineConfigError as err:  # an expected refusal, raised alike on every rank
        torch.save({"error": str(err)}, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")
        return
    # whole tensors: a collective for sharded ones, called by the replicas of a stage in the same key order
    result["state"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in result["state"].items()}
    torch.save(result, out / f"{cfg['name']}.rank{torch.distributed.get_rank()}.pt")


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


if __name__ == "__main__":
    main()
