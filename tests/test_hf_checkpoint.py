"""Hugging Face model directories in one process: reading one into a rank's stages (names, ties, dtypes, ``.bin``,
pieces of a large tensor, every error), and exporting a checkpoint directory for ``from_pretrained`` (shards, ties,
config, dtype, atomic replacement, every error). The multi-process runs are in tests/test_hf_pretrained.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

from lightning_pipe import PipelineCheckpointError  # noqa: E402
from lightning_pipe.checkpoint import export, io, save  # noqa: E402
from lightning_pipe.checkpoint import format as fmt  # noqa: E402
from lightning_pipe.checkpoint.__main__ import main as cli  # noqa: E402
from lightning_pipe.models import kind_of  # noqa: E402
from lightning_pipe.models.huggingface import directory as hf  # noqa: E402
from lightning_pipe.models.huggingface import export as hf_export  # noqa: E402
from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder  # noqa: E402
from lightning_pipe.split.surgery import prune  # noqa: E402
from tests.hf_models import build  # noqa: E402
from tests.hf_pretrained import probe_logits, save_pretrained  # noqa: E402

TOPO = io.Topology(0, 1, 0, 1, 0, 1, 1, "1F1B")


class Holder(nn.Module):
    """A LightningModule's role: the network under the attribute ``model``."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.model = network


def _fresh(family: str = "llama", tie: bool = True, layers: int = 8, seed: int = 123) -> Holder:
    torch.manual_seed(seed)
    return Holder(build(family, tie, layers))


def _load(path: Path, holder: nn.Module, strict: bool = True, aliases=None) -> None:
    topo = io.Topology(0, 1, 0, 1, 0, 1, 1, "1F1B", aliases=aliases or {})
    io.load_weights(path, topo, holder, network_prefix="model.", strict=strict)


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("tie", [True, False])
def test_sharded_safetensors_load_exactly_with_ties(tmp_path, tie):
    path = save_pretrained(tmp_path / "d", "llama", tie)
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / hf.SAFETENSORS_INDEX).is_file()
    holder = _fresh(tie=tie)
    _load(path, holder)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert _same(holder.model, pretrained)
    assert (holder.model.lm_head.weight is holder.model.model.embed_tokens.weight) == tie


def _save_bin(path: Path, model: nn.Module, shards: int) -> Path:
    """The older torch.save format (``save_pretrained(safe_serialization=False)`` of transformers 4.x; 5.x writes
    safetensors only): ``pytorch_model.bin``, or shards with their index."""
    path.mkdir()
    model.config.save_pretrained(path)
    state = model.state_dict()
    names = list(state)
    if shards == 1:
        torch.save(state, path / hf.BIN)
        return path
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: state[n] for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / hf.BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_single_file_bin_and_sharded_bin(tmp_path):
    reference = _fresh("qwen2", tie=False, seed=5).model
    for shards in (1, 3):
        path = _save_bin(tmp_path / str(shards), reference, shards)
        holder = _fresh("qwen2", tie=False)
        _load(path, holder)
        assert _same(holder.model, reference)


def test_a_stage_reads_only_its_tensors_and_the_tied_head_from_the_embedding(tmp_path):
    path = save_pretrained(tmp_path / "d", "llama", True)
    holder = _fresh()
    layout = hf_layout(holder.model)
    last = [*layout.blocks[4:], *layout.post]
    prune(holder.model, last, layout.units, placeholder=hf_placeholder(holder.model))
    aliases = {"model.lm_head.weight": "model.model.embed_tokens.weight"}  # tied across stages: stored once
    groups = io.tie_groups(holder, aliases)
    plan = hf.plan_load(path, io.model_state(holder), holder.model, kind_of(holder.model), "model.", groups)
    assert "model.embed_tokens.weight" in plan.targets and "lm_head.weight" not in plan.directory.files
    assert not any(name.startswith(("model.layers.0.", "model.layers.3.")) for name in plan.targets)
    read = hf.copy_into(plan)
    assert read == sum(t.numel() * t.element_size() for t in io.model_state(holder).values())
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(holder.model.lm_head.weight, pretrained.model.embed_tokens.weight)
    assert torch.equal(holder.model.model.layers[7].mlp.up_proj.weight, pretrained.model.layers[7].mlp.up_proj.weight)


def test_weights_take_the_models_dtype_and_large_tensors_are_read_in_pieces(tmp_path, monkeypatch):
    path = save_pretrained(tmp_path / "d", "llama", False)
    monkeypatch.setattr(hf, "READ_BYTES", 1000)  # every weight matrix in row ranges, each through its own mapping
    holder = _fresh(tie=False).to(torch.bfloat16)  # what precision="bf16-true" does before the load
    _load(path, holder)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(path)  # float32, as saved
    expected = {k: v.to(torch.bfloat16) for k, v in pretrained.state_dict().items()}
    assert all(torch.equal(v, expected[k]) for k, v in holder.model.state_dict().items())


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-true", torch.bfloat16)])
def test_the_trainers_precision_decides_the_dtype_not_the_config(tmp_path, precision, dtype):
    torch.manual_seed(0)
    build("llama", True).to(torch.bfloat16).save_pretrained(tmp_path / "d")  # config.json: "bfloat16", as published
    config = transformers.AutoConfig.from_pretrained(tmp_path / "d")
    network = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert network.lm_head.weight.dtype == torch.bfloat16  # from_config follows config.json
    holder = Holder(network)
    io.load_weights(tmp_path / "d", TOPO, holder, network_prefix="model.", strict=True, precision=precision)
    stored = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "d").state_dict()
    for key, value in holder.model.state_dict().items():
        assert value.dtype == dtype and torch.equal(value, stored[key].to(dtype)), key


def test_pieces_cut_large_tensors_into_rows():
    sizes = [("a", 4, 400), ("b", 1, 100), ("c", 10, 1000), ("d", 1, 50)]
    assert list(hf.pieces(sizes, 500)) == [
        [("a", None), ("b", None)],
        *[[("c", (start, start + 5))] for start in (0, 5)],
        [("d", None)],
    ]
    assert list(hf.pieces([("one-row", 1, 900)], 500)) == [[("one-row", None)]]


def _base_variants(base: str):
    """A transformers task model's disk names for a base model under ``base`` (the kind's rule, without a model)."""

    def names(name: str):
        yield name
        yield name[len(base) + 1 :] if name.startswith(base + ".") else f"{base}.{name}"

    return names


def test_resolve_names_strips_the_attribute_ties_and_base_prefix():
    stored = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    groups = [["model.model.embed_tokens.weight", "model.lm_head.weight"]]
    found, unread = hf.resolve_names(
        ["model.model.embed_tokens.weight", "model.lm_head.weight", "model.model.norm.weight", "model.extra"],
        stored,
        network_prefix="model.",
        groups=groups,
        disk_names=_base_variants("model"),
    )
    assert found == {
        "model.model.embed_tokens.weight": "model.embed_tokens.weight",
        "model.lm_head.weight": "model.embed_tokens.weight",  # the tie's first stored name, on every rank
        "model.model.norm.weight": "model.norm.weight",
    }
    assert unread == {"lm_head.weight"}
    # a base model's directory (no "model." inside) into the task model
    found, _ = hf.resolve_names(
        ["model.model.norm.weight"], {"norm.weight"}, network_prefix="model.", disk_names=_base_variants("model")
    )
    assert found == {"model.model.norm.weight": "norm.weight"}


def test_base_model_directory_into_a_task_model_names_the_missing_head(tmp_path):
    torch.manual_seed(0)
    base = build("llama", False).model  # LlamaModel: names without "model."
    base.save_pretrained(tmp_path / "base")
    holder = _fresh(tie=False)
    head = holder.model.lm_head.weight.detach().clone()
    with pytest.raises(PipelineCheckpointError, match=r"the model's 'model.lm_head.weight' are not in it.*strict_load"):
        _load(tmp_path / "base", holder)
    with pytest.warns(UserWarning, match=r"'model.lm_head.weight' are not in it.*keep the model's own initialisation"):
        _load(tmp_path / "base", holder, strict=False)
    assert torch.equal(holder.model.model.norm.weight, base.norm.weight) and torch.equal(
        holder.model.lm_head.weight, head
    )


def test_unexpected_weights_are_named(tmp_path):
    path = save_pretrained(tmp_path / "d", "llama", False)
    with pytest.raises(
        PipelineCheckpointError, match=r"it holds 'model.layers.6.input_layernorm.weight', .* and \d+ more"
    ):
        _load(path, _fresh(tie=False, layers=6))


def test_directory_errors(tmp_path):
    holder = _fresh()
    cases = {}
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / hf.CONFIG).write_text("{}")
    cases["config-only"] = r"holds no weights lightning-pipe can read\. Expected model.safetensors"
    (tmp_path / "tf").mkdir()
    (tmp_path / "tf" / "tf_model.h5").write_bytes(b"x")
    cases["tf"] = r"\(tf_model.h5: TensorFlow or Flax weights\)"
    path = save_pretrained(tmp_path / "gone", "llama", True)
    gone = sorted(path.glob("model-*.safetensors"))[1]
    gone.unlink()
    cases["gone"] = rf"lists shards that are not in the directory: '{gone.name}'.*incomplete"
    path = save_pretrained(tmp_path / "index", "llama", True)
    (path / hf.SAFETENSORS_INDEX).write_text('{"weight_map": [1]}')
    cases["index"] = r"model.safetensors.index.json is not a weight index .*: its 'weight_map' is list\."
    path = save_pretrained(tmp_path / "corrupt", "llama", True, max_shard_size="10MB")
    (path / hf.SAFETENSORS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    cases["corrupt"] = r"model.safetensors cannot be read as safetensors .* corrupted or truncated\?"
    path = _save_bin(tmp_path / "bin", holder.model, 1)
    (path / hf.BIN).write_bytes(b"not a zip")
    cases["bin"] = r"pytorch_model.bin cannot be read .*corrupted or truncated\?"
    cases["qwen2"] = r"holds a 'qwen2' model \(its config.json\) but the network is a LlamaForCausalLM \('llama'\)"
    save_pretrained(tmp_path / "qwen2", "qwen2", True)
    path = save_pretrained(tmp_path / "wide", "llama", True)
    config = json.loads((path / hf.CONFIG).read_text())
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, "intermediate_size": 48}))
    wide.save_pretrained(path, max_shard_size="40KB")
    cases["wide"] = (
        r"shape mismatch: 'model.layers.0.mlp.gate_proj.weight' is \[48, 32\] in the directory but \[64, 32\]"
    )
    for name, pattern in cases.items():
        with pytest.raises(
            PipelineCheckpointError,
            match=rf"(?s)Cannot load.*Hugging Face model directory '.*{name}'.*{pattern}.*\(rank 0\)",
        ):
            _load(tmp_path / name, holder)


def test_a_read_that_fails_midway_is_reported_by_every_rank(tmp_path, monkeypatch):
    path = save_pretrained(tmp_path / "d", "llama", True)

    def unreadable(file, names, targets, assign):
        raise OSError(f"Input/output error: {file.name}")

    monkeypatch.setattr(hf, "_copy_safetensors", unreadable)
    pattern = r"(?s)Reading the Hugging Face model directory .* failed:.*OSError: Input/output error: model-0000"
    with pytest.raises(PipelineCheckpointError, match=pattern):
        _load(path, _fresh())


def test_resuming_fit_from_a_directory_is_refused(tmp_path):
    path = save_pretrained(tmp_path / "d", "llama", True)
    holder = _fresh()
    with pytest.raises(
        PipelineCheckpointError,
        match=r"'.*/d' is a Hugging Face.*weights only.*`PipelineParallelStrategy\(init_weights='.*/d'\)`",
    ):
        io.load(path, TOPO, holder, [torch.optim.SGD(holder.parameters(), lr=0.1)], strict=True)


def test_a_pipeline_checkpoint_directory_is_not_taken_for_a_hugging_face_one(tmp_path):
    path = save_pretrained(tmp_path / "d", "llama", True)
    assert io.pretrained_files(path).name == "transformers"
    (path / "lightning_pipe.json").write_text("{}")
    assert io.pretrained_files(path) is None and io.pretrained_files(path / hf.CONFIG) is None


# ---------------------------------------------------------------------------------------------------- export
def _checkpoint(path: Path, holder: Holder, aliases=None, record: bool = True) -> Path:
    """A checkpoint directory as the strategy saves it, written by one process."""
    topo = io.Topology(0, 1, 0, 1, 0, 1, 1, "1F1B", aliases=aliases or {})
    state = {"state_dict": io.model_state(holder, topo.aliases), "global_step": 3}
    network_record = kind_of(holder.model).record(holder.model, "model") if record else None
    writer = save.CheckpointWriter(lambda: topo)
    writer.save(state, path, "0", "tests.Holder", None, resume_point={}, network_record=network_record)
    return path


@pytest.mark.parametrize("tie", [True, False])
def test_export_round_trip_through_from_pretrained(tmp_path, tie):
    holder = _fresh(tie=tie)
    aliases = {"model.lm_head.weight": "model.model.embed_tokens.weight"} if tie else {}
    src = _checkpoint(tmp_path / "ckpt", holder, aliases)
    assert export.export(src, tmp_path / "out", max_shard_size="40KB") == tmp_path / "out"
    out = tmp_path / "out"
    index = json.loads((out / hf_export.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == hf_export.shard_files(len(files)) and len(files) > 1
    assert ("lm_head.weight" in index["weight_map"]) != tie
    sizes = sum((out / f).stat().st_size for f in files)
    assert index["metadata"]["total_size"] < sizes < index["metadata"]["total_size"] + 2000 * len(files)
    config = json.loads((out / hf.CONFIG).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] == tie
    assert (out / hf.GENERATION_CONFIG).is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert _same(loaded, holder.model)
    torch.testing.assert_close(probe_logits(loaded), probe_logits(holder.model), rtol=0, atol=0)
    assert not list(tmp_path.glob("out.tmp-*"))


def test_export_one_file_bf16_with_the_config_of_a_directory_and_overwrite(tmp_path, capsys):
    original = save_pretrained(tmp_path / "original", "qwen2", False)
    holder = _fresh("qwen2", tie=False)
    holder.value_head = nn.Linear(3, 1)  # the LightningModule's own parameters: not part of the export
    src = _checkpoint(tmp_path / "ckpt", holder, record=False)
    (tmp_path / "out").mkdir()
    args = ["export-hf", str(src), str(tmp_path / "out"), "--config", str(original), "--dtype", "bfloat16"]
    assert cli([*args, "--no-progress"]) == 1
    assert "exists. Export to a new directory, or pass `--overwrite`" in capsys.readouterr().err
    assert cli([*args, "--no-progress", "--overwrite", "--max-shard-size", "1GB"]) == 0
    assert "left out the entries outside 'model.': 'value_head.bias', 'value_head.weight'" in capsys.readouterr().err
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [hf.CONFIG, hf.GENERATION_CONFIG, hf.SAFETENSORS]
    with safe_open(str(out / hf.SAFETENSORS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    config = json.loads((out / hf.CONFIG).read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)  # bfloat16 (5.x), or float32 (4.x)
    expected = {k: v.to(torch.bfloat16) for k, v in holder.model.state_dict().items()}
    assert all(torch.equal(v.to(torch.bfloat16), expected[k]) for k, v in loaded.state_dict().items())


def test_a_failed_export_leaves_the_previous_directory(tmp_path, monkeypatch):
    src = _checkpoint(tmp_path / "ckpt", _fresh())
    export.export(src, tmp_path / "out")
    before = sorted(p.name for p in (tmp_path / "out").iterdir())

    def broken(f, tensor):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "write_tensor", broken)
    with pytest.raises(OSError, match="disk full"):
        export.export(src, tmp_path / "out", overwrite=True, max_shard_size="40KB")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


def test_export_errors(tmp_path, monkeypatch):
    src = _checkpoint(tmp_path / "ckpt", _fresh())
    bare = _checkpoint(tmp_path / "bare", _fresh(), record=False)
    small = save_pretrained(tmp_path / "small", "llama", True, layers=6)
    other = _checkpoint(tmp_path / "other", Holder(nn.Linear(2, 2)), record=False)
    (tmp_path / "empty").mkdir()
    cases = [
        (dict(src=bare), r"records no Hugging Face config \(saved by tests.Holder .*\).* Pass `--config`"),
        (dict(config=tmp_path / "empty"), r"`--config '.*empty'` has no config.json"),
        (dict(config=small), r"as a LlamaForCausalLM: the checkpoint holds 'model.layers.6.input_layernorm.weight'"),
        (
            dict(src=bare, config=small, attribute="net"),
            r"model has 'model.embed_tokens.weight', .* which the checkpoint lacks",
        ),
        (dict(src=other, config=small), r"No entry of .* has a name of the config's model; pass .*--attribute model"),
        (dict(max_shard_size="5 parsecs"), r"`max_shard_size='5 parsecs'` is not a size"),
        (dict(max_shard_size=0), r"`max_shard_size=0` is not a size"),
        (dict(dtype="int8"), r"`dtype='int8'` is not one of \['bfloat16', 'float16', 'float32'\]"),
        (
            dict(adapter=True),
            r"`--adapter` exports a PEFT model's adapters, but '.*ckpt' records no PEFT model.*`--adapter`",
        ),
        (dict(merge=True), r"`--merge` exports a PEFT model's adapters, but '.*ckpt' records no PEFT model"),
    ]
    for kwargs, pattern in cases:
        kwargs = {"src": src, **kwargs}
        with pytest.raises(PipelineCheckpointError, match=pattern):
            export.export(kwargs.pop("src"), tmp_path / "out", **kwargs)
    manifest = json.loads((src / "lightning_pipe.json").read_text())
    manifest[fmt.NETWORK_RECORD]["config"]["architectures"] = ["NoSuchForCausalLM"]
    (src / "lightning_pipe.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineCheckpointError, match=r"names the architecture 'NoSuchForCausalLM', which this"):
        export.export(src, tmp_path / "out")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(PipelineCheckpointError, match=r"needs transformers: `pip install 'lightning-pipe\[hf\]'`"):
        export.export(src, tmp_path / "out")
    with pytest.raises(PipelineCheckpointError, match=r"'x' has dtype torch.complex64, which safetensors cannot"):
        hf_export.safetensors_header([hf_export.Entry("x", "x", (2,), torch.complex64)])


def test_plan_shards_and_sizes():
    entries = [hf_export.Entry(n, n, (s,), torch.float32) for n, s in [("a", 10), ("b", 20), ("c", 100), ("d", 5)]]
    shards = hf_export.plan_shards(entries, 160)
    assert [[e.name for e in shard] for shard in shards] == [["a", "b"], ["c"], ["d"]]
    assert hf_export.shard_files(3)[1] == "model-00002-of-00003.safetensors" and hf_export.shard_files(1) == [
        hf.SAFETENSORS
    ]
    assert [hf_export.parse_size(s) for s in (123, "5GB", "500MB", "2GiB", "1.5KB")] == [
        123,
        5 * 10**9,
        5 * 10**8,
        2**31,
        1500,
    ]


@pytest.mark.parametrize(
    "old,names",
    [
        ("huggingface", ["read_directory", "plan_load", "copy_into", "is_hf_directory", "RECORD", "PRECISION_DTYPES"]),
        (
            "hf_export",
            ["export", "plan_entries", "plan_shards", "shard_files", "INDEX", "DTYPES", "DEFAULT_SHARD_SIZE"],
        ),
        ("peft_adapters", ["load_adapters", "adapter_directory", "saved_name", "check_config", "ADAPTER_CONFIG"]),
        ("peft_export", ["export", "refuse_plain_export", "refuse_not_peft", "PEFT"]),
    ],
)
def test_the_old_checkpoint_paths_keep_working_with_a_deprecation(old, names):
    import importlib
    import sys

    sys.modules.pop(f"lightning_pipe.checkpoint.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"lightning_pipe.checkpoint.{old} moved"):
        module = importlib.import_module(f"lightning_pipe.checkpoint.{old}")
    assert all(hasattr(module, name) for name in names)


def test_the_old_plan_load_of_a_directory(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from lightning_pipe.checkpoint import huggingface as old

    path = save_pretrained(tmp_path / "d", "llama", True)
    holder = _fresh()
    plan = old.plan_load(path, io.model_state(holder), holder, "model.", {})
    assert old.copy_into(plan) > 0 and old.is_hf_directory(path)
