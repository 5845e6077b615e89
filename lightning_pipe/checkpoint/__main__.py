"""``python -m lightning_pipe.checkpoint``: inspect, consolidate and export lightning-pipe checkpoint directories.

Examples::

    python -m lightning_pipe.checkpoint inspect checkpoints/last.ckpt
    python -m lightning_pipe.checkpoint consolidate checkpoints/last.ckpt model.ckpt
    python -m lightning_pipe.checkpoint consolidate --with-optimizer checkpoints/last.ckpt model.ckpt
    python -m lightning_pipe.checkpoint export-hf checkpoints/last.ckpt my-model   # for from_pretrained
    python -m lightning_pipe.checkpoint export-hf checkpoints/last.ckpt my-lora --adapter   # a PEFT model's adapters
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_pipe.errors import PipelineCheckpointError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_pipe.checkpoint", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = _conversion(
        sub,
        "consolidate",
        "write a checkpoint directory as one ordinary Lightning .ckpt (weights, loops, hyperparameters; with"
        " --with-optimizer also optimizer and LR scheduler states)",
        "single-file checkpoint to write, e.g. model.ckpt",
    )
    c.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also write optimizer and LR scheduler states in single-device form, so that"
        " `Trainer(strategy='auto').fit(model, ckpt_path=dst)` resumes the run",
    )
    c.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load trainer.pt with weights_only=False (hyperparameters holding arbitrary objects; trusted files only)",
    )
    i = sub.add_parser("inspect", help="check a checkpoint directory for completeness and print its manifest")
    i.add_argument("src", type=Path)
    _export_parser(sub)
    return p


def _conversion(sub: Any, name: str, help: str, dst_help: str) -> argparse.ArgumentParser:
    """A command that converts the checkpoint directory ``src`` into ``dst``."""
    command = sub.add_parser(name, help=help)
    command.add_argument("src", type=Path, help="checkpoint directory saved by PipelineParallelStrategy")
    command.add_argument("dst", type=Path, help=dst_help)
    command.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    return command


def _export_parser(sub: Any) -> None:
    from lightning_pipe.models.files import DEFAULT_SHARD_SIZE, DTYPES

    e = _conversion(
        sub,
        "export-hf",
        "write a checkpoint directory of a transformers network as a Hugging Face model directory (config.json,"
        " safetensors shards and their index) for `from_pretrained`",
        "directory to write (must not exist, unless --overwrite)",
    )
    e.add_argument(
        "--config",
        type=Path,
        help="Hugging Face model directory whose config.json (and generation_config.json) to write, e.g. the one the"
        " run started from. Default: the config recorded in the checkpoint",
    )
    e.add_argument(
        "--attribute",
        help="the LightningModule's attribute holding the network ('' for the module itself). Default: recorded in"
        " the checkpoint, else found from the names",
    )
    e.add_argument(
        "--max-shard-size",
        default=DEFAULT_SHARD_SIZE,
        help=f"largest shard, as for save_pretrained (default {DEFAULT_SHARD_SIZE}; e.g. 500MB, 2GiB)",
    )
    e.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point weights (default: as trained)")
    e.add_argument("--overwrite", action="store_true", help="replace dst if it exists")
    peft = e.add_mutually_exclusive_group()
    peft.add_argument(
        "--adapter",
        action="store_true",
        help="for a PEFT model: write its adapters (adapter_model.safetensors, adapter_config.json) for"
        " `PeftModel.from_pretrained(base, dst)`",
    )
    peft.add_argument(
        "--merge",
        action="store_true",
        help="for a PEFT model: write the model with its adapters merged in (merge_and_unload) for `from_pretrained`",
    )


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_pipe.checkpoint import convert, export

    args = parser().parse_args(argv)
    try:
        if args.command == "inspect":
            print(json.dumps(convert.inspect(args.src), indent=2))
        elif args.command == "export-hf":
            dst = export.export(
                args.src,
                args.dst,
                config=args.config,
                attribute=args.attribute,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                progress=not args.no_progress,
                overwrite=args.overwrite,
                adapter=args.adapter,
                merge=args.merge,
            )
            print(f"wrote {dst}", file=sys.stderr)
        else:
            dst = convert.consolidate(
                args.src,
                args.dst,
                progress=not args.no_progress,
                weights_only=False if args.trust_pickle else None,
                with_optimizer=args.with_optimizer,
            )
            print(f"wrote {dst}", file=sys.stderr)
    except (PipelineCheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
