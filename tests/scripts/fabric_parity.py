"""Run the Fabric loop of ``tests/fabric_loop.py`` under several pipeline configurations in one launch; each rank saves
its losses, clip norms and weights per configuration.

Usage: fabric_parity.py OUT_DIR CONFIGS_JSON  (a list of {"name", "schedule", "accumulate", "clip", "meta",
"precision", "weighted", ...}; a refused configuration, last, saves its error);
``save_at`` saves ``<name>-ckpt`` after that step, ``resume`` continues from ``<resume>-ckpt`` in a fresh model.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

import lightning_pipe
from tests.fabric_loop import train, train_litgpt


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for cfg in configs:
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
        if "resume" in cfg:
            cfg["resume_from"] = str(out / f"{cfg['resume']}-ckpt")
        loop = train_litgpt if cfg.get("model") == "litgpt" else train
        rank = fabric.global_rank
        try:
            losses, weights, norms = loop(fabric, cfg, pipelined=True)
        except lightning_pipe.PipelineConfigError as err:  # an expected refusal ends the launch: its last config
            torch.save({"error": str(err)}, out / f"{cfg['name']}.rank{rank}.pt")
            break
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
