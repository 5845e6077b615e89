"""Fine-tune tiny pretrained Hugging Face directories under the pipeline, starting from them with ``init_weights``.

Usage: hf_pretrained.py WORK SCHEDULE DEVICES, or hf_pretrained.py WORK checks (2 ranks). WORK holds the
directories ``<family>-<tied|untied>`` (written by the pytest side with ``save_pretrained`` in several shards). Each
rank saves per directory its losses and what it measured while loading (``<schedule>-<name>.rank<r>.pt``); the run's
checkpoint is saved as ``ckpt-<schedule>-<name>``. ``checks``: precision ``bf16-true`` weights,
``validate(ckpt_path=<directory>)``, and the errors every rank must raise alike (``error-<name>.rank<r>.pt``).
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from safetensors import safe_open

from lightning_pipe import PipelineCheckpointError, PipelineParallelStrategy
from lightning_pipe.models.huggingface import directory as hf
from tests.hf_pretrained import LitPretrained, fine_tune
from tests.models import quiet_trainer

NAMES = ("llama-tied", "llama-untied", "qwen2-tied", "qwen2-untied")


def save(obj, out: Path, name: str, rank: int) -> None:
    torch.save(obj, out / f"{name}.rank{rank}.pt")


def fine_tune_all(work: Path, schedule: str, devices: int) -> None:
    for name in NAMES:
        strategy = PipelineParallelStrategy(schedule=schedule, init_weights=work / name)
        model, trainer = fine_tune(work / name, strategy, devices=devices)
        peak = trainer.strategy.memory_report.load_peak
        result = {"losses": model.step_losses, "load_peak": (peak.bytes, peak.rss_bytes)}
        save(result, work, f"{schedule}-{name}", trainer.global_rank)
        trainer.save_checkpoint(work / f"ckpt-{schedule}-{name}")


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


def checks(work: Path) -> None:
    path = work / "llama-tied"
    # bf16-true: the weights follow the Trainer's precision, each rank holding only its stages' tensors
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
    # validate(ckpt_path=<directory>): the same directory as a checkpoint to evaluate
    L.seed_everything(0)
    model = LitPretrained(str(path))
    trainer = quiet_trainer(devices=2, strategy=PipelineParallelStrategy())
    trainer.validate(model, ckpt_path=path, verbose=False)
    values = stored_values(path, model)
    result["ckpt_path_equal"] = all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    save(result, work, "checks", trainer.global_rank)
    errors = {
        "model-type": LitPretrained(str(path), config_path=str(work / "qwen2-tied")),
        "missing": LitPretrained(str(path), config_path=str(work / "llama-untied")),
        "unexpected": LitPretrained(str(path), config_path=str(work / "llama-6-layers")),
        "fit-resume": LitPretrained(str(path)),
    }
    for name, module in errors.items():
        L.seed_everything(0)
        strategy = PipelineParallelStrategy(init_weights=None if name == "fit-resume" else path)
        trainer = quiet_trainer(devices=2, max_steps=1, strategy=strategy)
        try:
            trainer.fit(module, ckpt_path=path if name == "fit-resume" else None)
            message = "no error"
        except PipelineCheckpointError as err:
            message = str(err)
        save({"error": message}, work, f"error-{name}", trainer.global_rank)


def main() -> None:
    work, schedule = Path(sys.argv[1]), sys.argv[2]
    if schedule == "checks":
        checks(work)
    else:
        fine_tune_all(work, schedule, int(sys.argv[3]))


if __name__ == "__main__":
    main()
