"""The acceptance project (tests/project_models.py) under the pipeline with only ``strategy`` and ``devices``; each
rank saves what the user would look at.

Usage: project.py OUT_DIR CONFIGS_JSON  (a list of {"name", "devices", "n_layer"?, "schedule"?, "microbatches"?};
without a schedule the strategy is the string "pipeline", the argument the project gets and nothing else). A config
with "demo" runs one of Lightning's demos instead (tests/demo_models.py): 1 the demo transformer, "boring" BoringModel
(fit, checkpoint, resume, test, predict), "demo-model" DemoModel, "manual" ManualOptimBoringModel (with "every": its
accumulating variant, batches of 4). A config that raises leaves its traceback in ``<name>.rank<r>.failed`` and the
next one runs (tests/scripts/outcomes.py).
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from tests.demo_models import fit_boring, fit_demo_model, fit_demo_transformer, fit_manual
from tests.project_models import run_project
from tests.scripts.outcomes import run_each


def main() -> None:
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(out, configs, run)


def run(out: Path, cfg: dict) -> None:
    name, devices, n_layer, demo = cfg.pop("name"), cfg.pop("devices"), cfg.pop("n_layer", 4), cfg.pop("demo", 0)
    every = cfg.pop("every", 1)
    strategy = lightning_pipe.PipelineParallelStrategy(**cfg) if cfg else "pipeline"
    if demo == "boring":
        found = fit_boring(out / name, strategy=strategy, devices=devices)
    elif demo == "manual":
        found = fit_manual(batch_size=4 if every > 1 else 1, every=every, strategy=strategy, devices=devices)
    elif demo == "demo-model":
        found = fit_demo_model(strategy=strategy, devices=devices)
    elif demo:
        found = fit_demo_transformer(strategy=strategy, devices=devices)
    else:
        found = run_project(out / name, n_layer, strategy=strategy, devices=devices)
    torch.save(found, out / f"{name}.rank{found['global_rank']}.pt")


if __name__ == "__main__":
    main()
