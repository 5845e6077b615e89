"""The scenarios of several scripts in one launch (tests/launch.py ``Shared``): one start of the processes and their
imports for all. Usage: together.py PARTS_JSON, a list of {"script": "parity.py", "out": folder, "configs": [...]}; each
part runs as its script alone would (its ``run`` over its configs, through tests/scripts/outcomes.py ``run_each``), in
order, into its own folder."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from tests.scripts.outcomes import run_each


def main() -> None:
    for part in json.loads(sys.argv[1]):
        script = importlib.import_module(f"tests.scripts.{Path(part['script']).stem}")
        run_each(Path(part["out"]), part["configs"], script.run)


if __name__ == "__main__":
    main()
