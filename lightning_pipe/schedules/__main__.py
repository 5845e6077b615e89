"""``python -m lightning_pipe.schedules export --schedule 1F1B --pipeline-size 2 --microbatches 4 out.csv``: write
the actions of a built-in schedule to a CSV to edit (docs/custom-schedules.md); ``check FILE`` reads one back and
says what it runs, or why it cannot."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.schedules.custom import load_schedule
from lightning_pipe.schedules.export import export_schedule


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.schedules", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a built-in schedule's actions to a CSV")
    export.add_argument("--schedule", required=True, help="a torch schedule by name, e.g. 1F1B or Interleaved1F1B")
    export.add_argument("--pipeline-size", type=int, required=True, help="processes per pipeline")
    export.add_argument("--microbatches", type=int, required=True, help="microbatches per batch")
    export.add_argument("--stages-per-rank", default="auto", help="stages per process ('auto' as the strategy)")
    export.add_argument("path", help="the CSV file to write")
    check = commands.add_parser("check", help="read a schedule's CSV and check it")
    check.add_argument("path", help="the CSV file to read")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            spr = args.stages_per_rank if args.stages_per_rank == "auto" else int(args.stages_per_rank)
            made = export_schedule(args.schedule, args.pipeline_size, args.microbatches, args.path, spr)
        else:
            made = load_schedule(args.path)
    except PipelineConfigError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{args.path}: {made.pipeline_size} ranks, {made.num_stages} stages, {made.microbatches} microbatches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
