"""OutcomeChannel between 2 processes: a sequence of steps exercising every path; each rank saves what it got.

Usage (torchrun, 2 processes): sharing.py OUT_DIR

Rank 1 sends (as the last stage does), rank 0 receives. Steps: the first (object path), the same schema (values point
to point, receive posted at the step's start) twice, a new log key (schema change: object path), a receiver that
skipped ``expect``, an integer beyond float64's exact range (object path, then no known size), and the schema back
again. Each entry: name, the sender's outcome, whether the ranks call ``expect`` at the step's start.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_pipe.step.interception import LoggedValue
from lightning_pipe.step.protocol import Outcome
from lightning_pipe.step.sharing import OutcomeChannel

STEPS = [
    ("first", Outcome(loss=torch.tensor(1.5), key_checksum=7), True),
    ("same", Outcome(loss=torch.tensor(2.5), key_checksum=7), True),
    ("same again", Outcome(loss=torch.tensor(3.5), key_checksum=7), True),
    (
        "new key",
        Outcome(loss=torch.tensor(4.5), logs=[LoggedValue("acc", torch.tensor(0.25), {})], key_checksum=7),
        True,
    ),
    (
        "no expect",
        Outcome(loss=torch.tensor(5.5), logs=[LoggedValue("acc", torch.tensor(0.5), {})], key_checksum=7),
        False,
    ),
    ("huge int", Outcome(loss=torch.tensor(6.5), output={"n": 2**60}, key_checksum=7), True),
    ("after", Outcome(loss=torch.tensor(7.5), key_checksum=7), True),
    ("again", Outcome(loss=torch.tensor(8.5), key_checksum=7), True),
]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    channel = OutcomeChannel(None, src=1, device=torch.device("cpu"))
    got = []
    for name, outcome, expect in STEPS:
        if expect:
            channel.expect()
        got.append((name, channel.share(outcome if rank == 1 else None)))
    channel.close()
    torch.save(
        {"got": got, "object_steps": channel.object_steps, "p2p": channel.point_to_point, "receives": channel.receives},
        out / f"r{rank}.pt",
    )
    # Neither rank leaves before both have everything: a rank that exits with a send unread by its peer makes the
    # peer's pending receive fail with "Connection reset by peer" (as a Trainer's teardown barrier prevents).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
