"""Pipeline schedules as data: the built-in ones by name, and schedules of one's own given as per-rank actions
(docs/custom-schedules.md). Pure: planning, no process group."""

from lightning_pipe.schedules.custom import Action, CustomSchedule, load_schedule
from lightning_pipe.schedules.export import builtin_schedule, export_schedule, write_schedule

__all__ = ["Action", "CustomSchedule", "builtin_schedule", "export_schedule", "load_schedule", "write_schedule"]
