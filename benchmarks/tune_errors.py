"""What benchmarks/tune.py reports beyond the choices: how sure each tuner run said it was, and the tuner's cost model
against the sweep (every swept candidate predicted from the tuner's first trial alone, over its measured step)."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def model_inputs(target: Path | None) -> Any:
    """Keep what the tuner's cost model was last calibrated on (the profile, the balance rule, the trials, the
    message and collective times) in ``target``, to compare the model's predictions with the sweep afterwards
    (:func:`model_errors`). Wrapped at the benchmark level, never in the library."""
    import pickle

    from lightning_pipe.tune import tuner

    if target is None:
        yield
        return
    calibrate = tuner.calibrate
    seen: list[tuple] = []

    def keeping(*args: Any) -> Any:
        seen[:] = [args]
        return calibrate(*args)

    tuner.calibrate = keeping
    try:
        yield
    finally:
        tuner.calibrate = calibrate
        if seen:
            target.write_bytes(pickle.dumps(seen[0]))


def model_errors(out: Path, workload: str, per_run: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """The cost model against the sweep: for each tuner run whose inputs were kept (:func:`_model_inputs`), every
    swept candidate predicted from the tuner's first trial alone (calibrated on it, not corrected by any other) over
    its median step in the same run's sweep."""
    import pickle

    from lightning_pipe.tune.cost import calibrate, predict
    from lightning_pipe.tune.space import Candidate

    found = []
    for run, measured in sorted(per_run.items()):
        kept = out / f"tune-{workload}-{run}.model.pkl"
        if not kept.exists():
            continue
        profile, rule, pipeline_size, trials, transfer, collective = pickle.loads(kept.read_bytes())
        calibration = calibrate(profile, rule, pipeline_size, trials[:1], transfer, collective)
        for key, ms in measured.items():
            settings = {k: v for k, v in json.loads(key).items() if k != "microbatch_size"}
            candidate = Candidate(**{**settings, "compile": bool(settings["compile"])})
            predicted = predict(candidate, profile, rule, pipeline_size, calibration).step * 1e3
            found.append({"run": run, "label": _label(json.loads(key)), "ratio": predicted / ms})
    return found


def sureness_lines(results: dict[str, Any]) -> list[str]:
    sure = [(n, t) for n, w in results["workloads"].items() for t in w["tunes"] if t.get("sureness")]
    if not sure:
        return []
    lines = ["", "How sure each tuner run said its choice was, against the closest other candidate it measured:", ""]
    lines += ["| workload | run | closest other | its step / the choice's [95% interval] | P(choice faster) |"]
    lines += ["|---|---|---|---|---|"]
    for name, t in sure:
        s = t["sureness"]
        interval = f"{s['ratio']:.3f} [{s['interval'][0]:.3f}, {s['interval'][1]:.3f}]" if s["rival"] else "-"
        noisy = " (still within the noise)" if s.get("within_noise") else ""
        lines.append(
            f"| {name} | {t['run']} | {_cell(s['rival'] or '-')} | {interval}{noisy} | {s['probability']:.2f} |"
        )
    return lines


def model_lines(results: dict[str, Any]) -> list[str]:
    errors = {n: w["model"] for n, w in results["workloads"].items() if w.get("model")}
    if not errors:
        return []
    lines = [
        "",
        "The cost model against the sweep: every swept candidate predicted from the tuner's first trial alone"
        " (calibrated on it, no correction by other trials), over its median step in the same run's sweep:",
        "",
        "| workload | predicted / measured: median (range) | worst |",
        "|---|---|---|",
    ]
    for name, found in errors.items():
        ratios = sorted(e["ratio"] for e in found)
        worst = max(found, key=lambda e: abs(math.log(e["ratio"])))
        lines.append(
            f"| {name} | {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
            f" {_cell(worst['label'])}: {worst['ratio']:.2f} |"
        )
    return lines


def _label(settings: dict[str, Any]) -> str:
    from lightning_pipe.tune.space import Candidate

    keys = ("schedule", "microbatches", "stages_per_rank", "activation_checkpointing")
    layout = {k: settings[k] for k in ("pipeline_size", "data_parallel", "tensor_parallel") if k in settings}
    return Candidate(*(settings[k] for k in keys), bool(settings.get("compile")), **layout).label


def _cell(text: str) -> str:
    """``text`` inside a markdown table's cell: a layout's label (``pp=2 ddp tp=1 | 1F1B ...``) has a bar."""
    return text.replace("|", "\\|")
