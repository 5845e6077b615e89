"""Fine-tune tiny pretrained Hugging Face directories under the pipeline, starting from them with ``init_weights``.

Usage: hf_pretrained.py WORK CONFIGS_JSON, a list of {"name", "run"} and the run's arguments. WORK holds the
directories ``<family>-<tied|untied>`` (written by the pytest side with ``save_pretrained`` in several shards).
``fine-tune`` ({"schedule", "devices", "directory"}): each rank saves its losses and what it measured while loading;
the run's checkpoint is saved as ``ckpt-<name>``. ``bf16`` (2 ranks): precision ``bf16-true`` weights. ``ckpt-path``:
``validate(ckpt_path=<directory>)``. ``error`` ({"error"}: which): the error message every rank must raise alike.
Each rank saves ``<name>.rank<r>.pt``; a run that raises leaves its traceback in ``<name>.rank<r>.failed`` and the next
one runs (tests/scripts/outcomes.py).
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from safetensors import safe_open

from lightning_pipe import PipelineCheckpointError, PipelineParallelStrategy
from lightning_pipe.models.huggingface import directory as hf
from tests.hf_pretrained import LitPretrained, fine_tune
from tests.models import quiet_trainer
from tests.scripts.outcomes import run_each


def save(obj, out: Path, name: str, rank: int) -> None:
    torch.save(obj, out / f"{name}.rank{rank}.pt")


def fine_tune_run(work: Path, cfg: dict) -> None:
    path = work / cfg["directory"]
    strategy = PipelineParallelStrategy(schedule=cfg["schedule"], init_weights=path)
    model, trainer = fine_tune(path, strategy, devices=cfg["devices"])
    peak = trainer.strategy.memory_report.load_peak
    result = {"losses": model.step_losses, "load_peak": (peak.bytes, peak.rss_bytes)}
    save(result, work, cfg["name"], trainer.global_rank)
    trainer.save_checkpoint(work / f"ckpt-{cfg['name']}")


def stored_values(path: Path, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters' values in the directory (``model.`` attribute; the tied head from the embedding)."""
    directory = hf.read_directory(path)
    values = {}
    for key in module.state_dict():
        name = key.removeprefix("model.")
        name = name if name in directory.files else "model.embed_tokens.weight"
        with safe_open(str(path / directory.files[name]), framework="pt") as f:
            values[key] = f.get_tensor(name)
    return values


def bf16(work: Path, cfg: dict) -> None:
    """bf16-true: the weights follow the Trainer's precision, each rank holding only its stages' tensors."""
    path = work / "llama-tied"
    L.seed_everything(0)
    model = LitPretrained(str(path))
    trainer = quiet_trainer(devices=2, precision="bf16-true", strategy=PipelineParallelStrategy(init_weights=path))
    trainer.validate(model, verbose=False)
    state = model.state_dict()
    values = stored_values(path, model)
    result = {
        "dtypes": sorted({str(v.dtype) for v in state.values() if v.is_floating_point()}),
        "bf16_equal": all(torch.equal(state[k], values[k].to(torch.bfloat16)) for k in state),
        "keys": sorted(state),
    }
    save(result, work, cfg["name"], trainer.global_rank)


def ckpt_path(work: Path, cfg: dict) -> None:
    """validate(ckpt_path=<directory>): the same directory as a checkpoint to evaluate."""
    path = work / "llama-tied"
    L.seed_everything(0)
    model = LitPretrained(str(path))
    trainer = quiet_trainer(devices=2, strategy=PipelineParallelStrategy())
    trainer.validate(model, ckpt_path=path, verbose=False)
    values = stored_values(path, model)
    result = {"ckpt_path_equal": all(torch.equal(v, values[k]) for k, v in model.state_dict().items())}
    save(result, work, cfg["name"], trainer.global_rank)


ERRORS = {  # each error's network: config.json of another directory than the weights' (or, fit-resume, the same)
    "model-type": "qwen2-tied",
    "missing": "llama-untied",
    "unexpected": "llama-6-layers",
    "fit-resume": None,
}


def error(work: Path, cfg: dict) -> None:
    path, name = work / "llama-tied", cfg["error"]
    config = ERRORS[name]
    module = LitPretrained(str(path), **({} if config is None else {"config_path": str(work / config)}))
    L.seed_everything(0)
    strategy = PipelineParallelStrategy(init_weights=None if name == "fit-resume" else path)
    trainer = quiet_trainer(devices=2, max_steps=1, strategy=strategy)
    try:
        trainer.fit(module, ckpt_path=path if name == "fit-resume" else None)
        message = "no error"
    except PipelineCheckpointError as err:
        message = str(err)
    save({"error": message}, work, cfg["name"], trainer.global_rank)


RUNS = {"fine-tune": fine_tune_run, "bf16": bf16, "ckpt-path": ckpt_path, "error": error}


def run(work: Path, cfg: dict) -> None:
    RUNS[cfg["run"]](work, cfg)


def main() -> None:
    work, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    run_each(work, configs, run)


if __name__ == "__main__":
    main()
