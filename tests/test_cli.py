"""LightningCLI: the strategy by name and by class path, every argument described, bad values rejected while parsing."""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI

import lightning_pipe
from lightning_pipe import PipelineParallelStrategy
from tests.models import LitMLP

CLASS_PATH = "lightning_pipe.PipelineParallelStrategy"
ARGUMENTS = [name for name in inspect.signature(PipelineParallelStrategy.__init__).parameters if name != "self"]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when sys.argv (pytest's) and `args` are both given.
    monkeypatch.setattr("sys.argv", ["train.py"])


def cli(*args: str) -> LightningCLI:
    return LightningCLI(
        LitMLP, run=False, args=["--trainer.accelerator=cpu", "--trainer.devices=1", *args], save_config_callback=None
    )


def cli_exit(capsys: pytest.CaptureFixture, *args: str, code: int) -> str:
    with pytest.raises(SystemExit) as info:
        cli(*args)
    assert info.value.code == code
    out = capsys.readouterr()
    return out.out + out.err


def strategy_config(tmp_path, **init_args) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": {"class_path": CLASS_PATH, "init_args": init_args}}}))
    return f"--config={path}"


def test_strategy_by_registered_name() -> None:
    assert lightning_pipe.PipelineParallelStrategy.strategy_name == "pipeline"
    trainer = cli("--trainer.strategy=pipeline").trainer
    assert isinstance(trainer.strategy, PipelineParallelStrategy)


def test_strategy_by_class_path_with_every_argument(tmp_path) -> None:
    values = {
        "pipeline_size": 1,
        "schedule": "GPipe",
        "microbatches": 4,
        "microbatch_size": None,
        "stages_per_rank": 1,
        "module": "net",
        "frontend": "modules",
        "blocks": "",
        "split_points": None,
        "balance": [4, 3],
        "process_group_backend": "gloo",
        "timeout": "0:10:00",
        "eval_microbatches": 2,
        "init_weights": None,
        "init_adapter": "adapters/my-lora",
        "init_values": "per_unit",
        "data_parallel": "fsdp",
        "inner_axis": "pp",
        "activation_checkpointing": 2,
        "tensor_parallel": 1,
        "loss_parallel": True,
        "compile": {"mode": "max-autotune-no-cudagraphs"},
        "max_restarts": 0,
        "snapshot_every": 0,
        "spares": 0,
        "async_checkpoint": True,
        "model_plan": {"model.layers": [["hidden_states"], ["hidden_states"]]},
    }
    assert sorted(values) == sorted(ARGUMENTS)  # a new argument needs a line here and in docs/strategy.md
    strategy = cli(strategy_config(tmp_path, **values)).trainer.strategy
    assert isinstance(strategy, PipelineParallelStrategy)
    assert strategy.schedule_name == "GPipe"
    settings = strategy.settings
    assert settings.microbatches == 4
    assert settings.balance == (4, 3)
    assert settings.module == "net"
    assert settings.timeout == timedelta(minutes=10)
    assert (settings.data_parallel, settings.inner_axis, settings.activation_checkpointing) == ("fsdp", "pp", 2)
    assert (settings.tensor_parallel, settings.loss_parallel) == (1, True)
    assert settings.compile == {"mode": "max-autotune-no-cudagraphs"}
    assert settings.model_plan == {"model.layers": (["hidden_states"], ["hidden_states"])}
    assert settings.init_adapter == Path("adapters/my-lora")
    assert settings.init_values == "per_unit"


def test_timeout_accepts_null(tmp_path) -> None:
    assert cli(strategy_config(tmp_path, timeout=None)).trainer.strategy.settings.timeout is None


def test_print_config_lists_every_argument_with_default(capsys, tmp_path) -> None:
    out = cli_exit(capsys, strategy_config(tmp_path, schedule="GPipe"), "--print_config", code=0)
    init_args = yaml.safe_load(out)["trainer"]["strategy"]["init_args"]
    assert list(init_args) == ARGUMENTS
    assert init_args["schedule"] == "GPipe"
    assert init_args["pipeline_size"] == "auto"
    assert init_args["timeout"] == "0:10:00"


def test_help_shows_every_argument_with_type_default_and_text(capsys) -> None:
    out = cli_exit(capsys, f"--trainer.strategy.help={CLASS_PATH}", code=0)
    for name in ARGUMENTS:
        assert f"--trainer.strategy.{name}" in out
    flat = " ".join(out.split())
    # texts from the class docstring's `Arguments:` block
    assert "Processes per pipeline." in flat
    assert "Microbatches per training batch." in flat
    assert "Timeout of collective and point-to-point operations." in flat
    assert "(type: Union[Literal['auto'], PositiveInt], default: auto)" in flat
    assert flat.count("(type: ") >= len(ARGUMENTS)


@pytest.mark.parametrize(
    ("init_args", "key", "message"),
    [
        ({"pipeline_size": -1}, "pipeline_size", "Not of type PositiveInt: does not conform to restriction v>0"),
        ({"pipeline_size": "two"}, "pipeline_size", "Not of type PositiveInt"),
        ({"microbatches": 0}, "microbatches", "Not of type PositiveInt: does not conform to restriction v>0"),
        ({"microbatch_size": 0}, "microbatch_size", "Not of type PositiveInt: does not conform to restriction v>0"),
        ({"stages_per_rank": 0}, "stages_per_rank", "Not of type PositiveInt: does not conform to restriction v>0"),
        (
            {"frontend": "fx"},
            "frontend",
            "Expected a typing.Literal['auto', 'modules', 'dataflow', 'trace']. Got value: fx",
        ),
        ({"eval_microbatches": 0}, "eval_microbatches", "Not of type PositiveInt: does not conform to restriction v>0"),
        ({"balance": [2, 0]}, "balance", "Not of type PositiveInt: 0 does not conform to restriction v>0"),
        ({"split_points": "layers.4"}, "split_points", "Expected a <class 'list'>"),
        ({"timeout": 600}, "timeout", 'Expected a string with form "h:m:s"'),
        ({"data_parallel": "zero"}, "data_parallel", "Expected a typing.Literal['ddp', 'fsdp']. Got value: zero"),
        ({"inner_axis": "tp"}, "inner_axis", "Expected a typing.Literal['dp', 'pp']. Got value: tp"),
        ({"activation_checkpointing": -1}, "activation_checkpointing", "Not of type NonNegativeInt"),
        ({"no_such_argument": 1}, "no_such_argument", "Option 'no_such_argument' is not accepted"),
    ],
)
def test_invalid_value_is_a_parse_error(capsys, tmp_path, init_args, key, message) -> None:
    out = cli_exit(capsys, strategy_config(tmp_path, **init_args), code=2)
    assert 'error: Parser key "trainer.strategy"' in out
    assert key in out
    assert message in out
    assert "Traceback" not in out


def test_invalid_value_on_the_command_line(capsys) -> None:
    out = cli_exit(capsys, f"--trainer.strategy={CLASS_PATH}", "--trainer.strategy.frontend=Foo", code=2)
    assert 'Parser key "frontend"' in out
    assert "Got value: Foo" in out


@pytest.mark.parametrize(
    ("init_args", "message"),
    [
        ({"microbatches": 4, "microbatch_size": 2}, r"Set either `microbatches` \(4\) or `microbatch_size` \(2\)"),
        ({"split_points": ["layers.4"], "balance": [4, 4]}, r"Set either `split_points` or `balance`, not both"),
        ({"schedule": "GPipe", "stages_per_rank": 2}, r"`schedule='GPipe'` runs one stage per rank"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, r"places exactly two stages per rank"),
        # any string may be a CSV path (a schedule of one's own), so an unknown name is the strategy's refusal
        ({"schedule": "Foo"}, r"Unknown `schedule='Foo'`"),
    ],
)
def test_invalid_combination_names_both_arguments(tmp_path, init_args, message) -> None:
    # Combinations cannot be expressed as types: the strategy's own check runs when jsonargparse instantiates it,
    # and its message is carried in jsonargparse's error.
    with pytest.raises(ValueError, match=message):
        cli(strategy_config(tmp_path, **init_args))
