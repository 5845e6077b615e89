"""Compare the pretrained directory and the exported fine-tuned one with ``from_pretrained`` on held-out bytes.

python examples/hf_finetune/evaluate.py pretrained/tiny-llama fine-tuned/tiny-llama
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import stdlib_windows  # noqa: E402


def held_out_loss(path: Path, batches: int = 8) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    data = stdlib_windows(128, slice(150, 170)).tensors[0][: 8 * batches]
    with torch.no_grad():
        return float(sum(model(input_ids=b, labels=b).loss for b in data.split(8)) / batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", type=Path, nargs="+")
    for path in parser.parse_args().directories:
        print(f"{path}: held-out loss {held_out_loss(path):.3f}")


if __name__ == "__main__":
    main()
