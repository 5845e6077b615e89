"""Run the Fabric loop of ``tests/fabric_loop.py`` under several pipeline configurations in one launch; each rank saves
its losses, clip norms and weights per configuration.

Usage: fabric_parity.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "accumulate", "clip", "meta",
"precision", "weighted", ...}; a refused configuration saves its error, any other failure its traceback
(tests/scripts/outcomes.py)); ``save_at`` saves ``<name>-ckpt`` after that step, ``resume`` continues from
``<resume>-ckpt`` in a fresh model; ``checkpoint`` loads the whole model's weights from that file of ``OUT_DIR``.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

import lightning_pipe
from tests.fabric_loop import train, train_litgpt
from tests.scripts.outcomes import run_each


def main() -> None:
    run_each(Path(sys.argv[1]), json.loads(sys.argv[2]), run)


def run(out: Path, cfg: dict) -> None:
    precision = cfg.get("precision", "32-true")
    if cfg.get("by_name"):
        fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=cfg["devices"], precision=precision)
    else:
        options = {k: cfg[k] for k in ("schedule", "frontend", "pipeline_size", "data_parallel") if k in cfg}
        strategy = lightning_pipe.PipelineFabricStrategy(**options)
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=cfg["devices"], precision=precision)
    fabric.launch()
    assert isinstance(fabric.strategy, lightning_pipe.PipelineFabricStrategy)
    if "save_at" in cfg:
        cfg["save_to"] = str(out / f"{cfg['name']}-ckpt")
    if "checkpoint" in cfg:
        cfg["checkpoint"] = str(out / cfg["checkpoint"])
    if "resume" in cfg:
        cfg["resume_from"] = str(out / f"{cfg['resume']}-ckpt")
    loop = train_litgpt if cfg.get("model") == "litgpt" else train
    rank = fabric.global_rank
    try:
        losses, weights, norms = loop(fabric, cfg, pipelined=True)
    except lightning_pipe.PipelineConfigError as err:  # an expected refusal is the configuration's result
        torch.save({"error": str(err)}, out / f"{cfg['name']}.rank{rank}.pt")
        return
    torch.save(
        {
            "losses": losses,
            "weights": weights,
            "norms": norms,
            "stages": list(fabric.strategy.engine.runtime.stages),
        },
        out / f"{cfg['name']}.rank{rank}.pt",
    )
    fabric.strategy.teardown()


if __name__ == "__main__":
    main()
