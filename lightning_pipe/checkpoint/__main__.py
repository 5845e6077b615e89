"""``python -m lightning_pipe.checkpoint``: inspect and consolidate lightning-pipe checkpoint directories.

Examples::

    python -m lightning_pipe.checkpoint inspect checkpoints/last.ckpt
    python -m lightning_pipe.checkpoint consolidate checkpoints/last.ckpt model.ckpt
    python -m lightning_pipe.checkpoint consolidate --with-optimizer checkpoints/last.ckpt model.ckpt
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_pipe.errors import PipelineCheckpointError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_pipe.checkpoint", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate",
        help="write a checkpoint directory as one ordinary Lightning .ckpt (weights, loops, hyperparameters; with"
        " --with-optimizer also optimizer and LR scheduler states)",
    )
    c.add_argument("src", type=Path, help="checkpoint directory saved by PipelineParallelStrategy")
    c.add_argument("dst", type=Path, help="single-file checkpoint to write, e.g. model.ckpt")
    c.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also write optimizer and LR scheduler states in single-device form, so that"
        " `Trainer(strategy='auto').fit(model, ckpt_path=dst)` resumes the run",
    )
    c.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    c.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load trainer.pt with weights_only=False (hyperparameters holding arbitrary objects; trusted files only)",
    )
    i = sub.add_parser("inspect", help="check a checkpoint directory for completeness and print its manifest")
    i.add_argument("src", type=Path)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_pipe.checkpoint import convert

    args = parser().parse_args(argv)
    try:
        if args.command == "inspect":
            print(json.dumps(convert.inspect(args.src), indent=2))
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
