import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning.pytorch as L
import torch
import lightning_pipe  # noqa: F401
from tests.models import LitLM

L.seed_everything(0)
model = LitLM()
sched = sys.argv[1] if len(sys.argv) > 1 else "1F1B"
devices = int(sys.argv[2]) if len(sys.argv) > 2 else 2
trainer = L.Trainer(strategy=lightning_pipe.PipelineParallelStrategy(schedule=sched), accelerator="cpu", devices=devices, max_steps=4,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
print("RANK", trainer.global_rank, model.step_losses, sorted(k for k, _ in model.named_parameters())[:3])
