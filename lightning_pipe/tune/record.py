"""The tuner's choice on disk: reused by a later run instead of tuning again, and readable by LightningCLI.

``tune()`` writes two files (default ``<default_root_dir>/pipeline_tune.json`` and ``.yaml``):

- the **record** (JSON): the choice, how sure it is, the table, the tuning's own cost, and the fingerprint of what it
  was tuned for. A later ``tune()`` with the same fingerprint returns the recorded choice without running a trial (a
  resumed run, a second script); a different fingerprint (another model size, batch size, world size, device,
  precision, torch version or search space) tunes again.
- a **LightningCLI config** (YAML) holding only the tuned strategy arguments:
  ``python train.py fit --config config.yaml --config pipeline_tune.yaml``; jsonargparse merges its ``init_args``
  into the strategy's, so every other argument keeps its value from the first config. When a chosen layout changed
  the per-replica batch (to keep the global batch), the config also sets ``batch_size`` in the ``model`` or ``data``
  section, where the tuner found it.

Pure apart from reading and writing the two files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_pipe.errors import PipelineConfigError
from lightning_pipe.schedules.names import normal_schedule, schedule_argument
from lightning_pipe.tune.space import Candidate

FORMAT = 1
#: the strategy's class path, as LightningCLI configs name it
STRATEGY_CLASS = "lightning_pipe.PipelineParallelStrategy"


def fingerprint(facts: Mapping[str, Any]) -> str:
    """A short hash of ``facts`` (JSON-serialisable): what the choice depends on."""
    text = json.dumps(dict(facts), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TuneRecord:
    """A tuning's outcome."""

    fingerprint: str
    choice: Candidate
    #: what the fingerprint was made of (for reading, not compared)
    facts: dict[str, Any] = field(default_factory=dict)
    #: the printed table
    table: str = ""
    #: the tuning's own cost: wall and CPU seconds, trials, steps
    cost: dict[str, float] = field(default_factory=dict)
    #: the strategy arguments to apply (the choice's, with the user's ``compile`` options when it compiles)
    settings: dict[str, Any] = field(default_factory=dict)
    #: the per-replica batch a chosen layout set: ``{"section": "model"|"data", "batch_size": n}``, or empty
    batch: dict[str, Any] = field(default_factory=dict)
    #: how sure the choice is (:meth:`lightning_pipe.tune.noise.Sureness.as_dict`; empty in older records)
    sureness: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(dataclasses.replace(self, choice=dataclasses.replace(self.choice, schedule="")))
        # A schedule of one's own as `schedule=` takes it: the CSV path, or the lists.
        data["choice"]["schedule"] = schedule_argument(self.choice.schedule)
        data["format"] = FORMAT
        return json.dumps(data, indent=1, default=str)

    @classmethod
    def from_json(cls, text: str) -> TuneRecord:
        """The record, its choice's schedule as written (a CSV is read once the fingerprint matches: :func:`load`)."""
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError("not a lightning-pipe tuning record of this version")
        data["choice"] = Candidate(**data["choice"])
        return cls(**data)


def cli_config(settings: Mapping[str, Any], batch: Mapping[str, Any] | None = None) -> str:
    """The LightningCLI config (YAML) that sets ``settings`` on the strategy (and ``batch``'s ``batch_size`` in its
    section)."""
    import yaml

    config: dict[str, Any] = {"trainer": {"strategy": {"class_path": STRATEGY_CLASS, "init_args": dict(settings)}}}
    if batch:
        # jsonargparse takes the argument without ``init_args`` whether the model's class is fixed or a subclass.
        config[batch["section"]] = {"batch_size": batch["batch_size"]}
    return yaml.safe_dump(config, sort_keys=False)


def paths(path: Path) -> tuple[Path, Path]:
    """The record (``.json``) and the LightningCLI config (``.yaml``) for ``path`` (either suffix, or none)."""
    base = path.with_suffix("") if path.suffix in (".json", ".yaml", ".yml") else path
    return base.with_suffix(".json"), base.with_suffix(".yaml")


def save(record: TuneRecord, path: Path) -> tuple[Path, Path]:
    """Write the record and its LightningCLI config; return their paths."""
    record_file, config_file = paths(path)
    record_file.parent.mkdir(parents=True, exist_ok=True)
    header = "# Chosen by lightning_pipe.tune: python train.py fit --config <your config> --config this file\n"
    table = "".join(f"# {line}\n" for line in record.table.splitlines())
    config_file.write_text(header + table + cli_config(record.settings, record.batch))
    record_file.write_text(record.to_json())
    return record_file, config_file


def load(path: Path, expected: str) -> TuneRecord | None:
    """The record at ``path`` if it was made for fingerprint ``expected``; ``None`` if there is none or it was made
    for something else (then the caller tunes again). A file that is not a record is an error, not overwritten."""
    record_file, _ = paths(path)
    if not record_file.exists():
        return None
    try:
        record = TuneRecord.from_json(record_file.read_text())
    except (ValueError, TypeError, KeyError) as err:
        raise PipelineConfigError(
            f"{record_file} is not a lightning-pipe tuning record ({err}). Pass another `path` to `tune`, or delete"
            " the file."
        ) from err
    if record.fingerprint != expected:
        return None
    choice = dataclasses.replace(record.choice, schedule=normal_schedule(record.choice.schedule))
    return dataclasses.replace(record, choice=choice)
