"""``model.generate(...)`` inside validation, test and predict steps under the pipeline.

- fast: stages chained in one process, each with its own layers' cache
  (:mod:`lightning_pipe.models.huggingface.generation`), decode as the whole model with its cache (a full-attention
  and a sliding-window family); every refusal names what it refuses;
- slow: a tiny Llama and a sliding-window Mistral generate in ``validation_step`` and ``predict_step`` at 2 processes
  (1F1B), greedy and seeded sampling, left padding: the ids equal one device's, the logged metrics within 1e-5 (one
  launch); extended: Interleaved1F1B at 4 processes.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_pipe.compat.transformers import generation_cache, mask_sizes  # noqa: E402
from lightning_pipe.errors import PipelineUsageError  # noqa: E402
from lightning_pipe.models.huggingface import generation as hf_generate  # noqa: E402
from lightning_pipe.models.huggingface.plan import hf_layout, hf_placeholder  # noqa: E402
from lightning_pipe.models.huggingface.stage import hf_stage_call  # noqa: E402
from lightning_pipe.split.partition import balance_blocks, stage_units  # noqa: E402
from lightning_pipe.split.surgery import prune  # noqa: E402
from lightning_pipe.step.generation import decoding_of  # noqa: E402
from lightning_pipe.step.interception import CallInterceptor  # noqa: E402
from tests.generation_models import LitGenerate, build, run_generation  # noqa: E402
from tests.hf_models import padded_batches  # noqa: E402
from tests.launch import SHARED_FOUR, SHARED_TWO, Launch  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402

TOL = 1e-5


def _stages(model, n):
    layout = hf_layout(model)
    units = stage_units(layout, balance_blocks(len(layout.blocks), n))
    return [prune(copy.deepcopy(model), keep, layout.units, hf_placeholder(model)) for keep in units]


def _chained(stages, kwargs, caches):
    received = None
    for i, stage in enumerate(stages):
        out = hf_stage_call(stage, (), {**kwargs, "past_key_values": caches}, received, i == 0, i == len(stages) - 1)
        received = (out,)
    return out.logits


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("n", [2, 3])
def test_stages_with_their_own_caches_decode_as_the_whole_model(family, n):
    torch.manual_seed(0)
    model = build(family, layers=4).eval()
    stages = _stages(model, n)
    ids, mask, _ = padded_batches(4, 3, "left").tensors
    caches, whole = hf_generate.StageCaches(), generation_cache(model.config)
    with torch.no_grad():
        for step in range(6):  # prefill, then 5 single tokens: past the Mistral window of 5
            length = ids.shape[1]
            new = length if step == 0 else 1
            position = (mask.cumsum(-1) - 1).clamp(min=0)
            kwargs = dict(
                input_ids=ids[:, -new:],
                attention_mask=mask,
                position_ids=position[:, -new:],
                cache_position=torch.arange(length - new, length),
            )
            expected = model(**kwargs, past_key_values=whole, use_cache=True).logits
            got = _chained(stages, kwargs, caches)
            torch.testing.assert_close(got, expected, rtol=TOL, atol=1e-6)
            token = expected[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)


def test_a_stage_cache_answers_for_absent_layers_with_a_held_one_of_the_same_kind():
    model = build("mistral", layers=4)
    later = _stages(model, 2)[1]
    cache = hf_generate.StageCaches().of(later)
    whole = generation_cache(model.config)  # what generate makes for the whole model, in this transformers
    key = torch.zeros(1, 2, 3, 8)
    for layer in (2, 3):
        cache.update(key, key, layer)
    for layer in range(4):
        whole.update(key, key, layer)
    # sliding-window layers (4.56+) or full layers with the window in the masks (4.54-4.55), as generate's own
    assert cache.is_sliding[2:] == whole.is_sliding[2:]
    assert cache.get_seq_length() == whole.get_seq_length() == 3  # layer 0 is another stage's: answered by layer 2
    new = torch.arange(3, 4)
    assert mask_sizes(cache, new, 0) == mask_sizes(whole, new, 0) == (4, 0)


@pytest.mark.parametrize(
    "kwargs,names",
    [
        (dict(num_beams=2), ["beam search", "num_beams=2", "num_beams=1"]),
        (dict(num_beams=2, do_sample=True), ["beam sample", "num_beams=2"]),
        (dict(penalty_alpha=0.6, top_k=4), ["contrastive search", "penalty_alpha=0.6"]),
        (dict(cache_implementation="static"), ["cache_implementation='static'", "cache_implementation=None"]),
        (dict(past_key_values=object()), ["past_key_values", "no `past_key_values`"]),
        (dict(cache=object()), ["with cache:", "no `cache`"]),
    ],
)
def test_generate_modes_a_pipeline_cannot_reproduce_are_refused_by_name(kwargs, names):
    model = build("llama", layers=2)
    with pytest.raises(PipelineUsageError) as err:
        hf_generate.check_generate(model, (), {"max_new_tokens": 3, **kwargs})
    for name in ["LlamaForCausalLM.generate", *names]:
        assert name in str(err.value)


def test_greedy_and_sampling_pass_the_check():
    model = build("llama", layers=2)
    hf_generate.check_generate(model, (), dict(max_new_tokens=3, do_sample=False))
    hf_generate.check_generate(model, (), dict(max_new_tokens=3, do_sample=True, top_k=5))


def test_generate_in_training_step_is_refused():
    with pytest.raises(PipelineUsageError, match="`training_step` called `LlamaForCausalLM.generate"):
        decoding_of(build("llama", layers=2), None, "training_step")


class HandWrittenGPT(torch.nn.Module):
    """A GPT of one's own that takes and returns its per-layer cache (a list of (key, value) per block), with a
    decoding loop of its own."""

    def __init__(self, vocab=16, width=8, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids, cache=None):
        x, new = self.embed(ids), []
        for i, block in enumerate(self.blocks):
            key, value = block(x).chunk(2, -1)
            if cache is not None:
                key, value = torch.cat([cache[i][0], key], 1), torch.cat([cache[i][1], value], 1)
            new.append((key, value))
            x = x + torch.softmax(x @ key.transpose(1, 2), -1) @ value
        return self.head(x), new

    def generate(self, ids, steps):
        return decode_by_hand(self, ids, steps)


def decode_by_hand(network, ids, steps):
    """Greedy decoding with the network's own per-layer cache, as a step would write it."""
    logits, cache = network(ids)
    for _ in range(steps):
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
        logits, cache = network(ids[:, -1:], cache)
    return ids


def test_a_plain_module_with_a_generate_method_is_refused_by_name():
    with pytest.raises(PipelineUsageError) as err:
        decoding_of(HandWrittenGPT(), None, "validation_step")
    for name in [
        "`HandWrittenGPT.generate(...)`",
        "`validation_step`",
        "plain module",
        "which argument and output carry a per-layer cache",
        "`past_key_values`",
        "`cache_position`",
        "call the network once per step",
    ]:
        assert name in str(err.value)


def test_a_step_that_decodes_a_plain_module_by_hand_is_refused_at_its_second_call():
    network = HandWrittenGPT()
    ids = torch.ones(1, 3, dtype=torch.long)
    logits, cache = network(ids)  # one device: the loop runs
    assert decode_by_hand(network, ids, 2).shape == (1, 5)
    interceptor = CallInterceptor(network)
    try:
        interceptor.step_name = "validation_step"
        with pytest.raises(PipelineUsageError) as err:
            with interceptor.responding((logits, cache)):
                decode_by_hand(network, ids, 2)  # a stage answers the first call; the second carries the cache back in
        for name in ["`validation_step` called the pipelined network more than once", "`generate(...)`"]:
            assert name in str(err.value)
    finally:
        interceptor.remove()


def test_generate_outside_a_step_and_after_a_forward_are_refused():
    model = build("llama", layers=2)
    interceptor = CallInterceptor(model)
    try:
        with pytest.raises(PipelineUsageError, match=r"`generate` of the pipelined network \(LlamaForCausalLM\)"):
            model.generate(input_ids=torch.ones(1, 2, dtype=torch.long))
        interceptor.step_name = "validation_step"

        def step():
            model(input_ids=torch.ones(1, 2, dtype=torch.long))
            model.generate(input_ids=torch.ones(1, 2, dtype=torch.long))

        with pytest.raises(PipelineUsageError, match="`validation_step` called `generate` after calling"):
            with interceptor.responding(None):
                step()
        call = interceptor.capture(lambda: model.generate(input_ids=torch.ones(1, 2, dtype=torch.long)))
        assert call.generate
    finally:
        interceptor.remove()
    assert "generate" not in vars(model) and "forward" not in vars(model)


def test_the_interceptor_keeps_the_forward_signature():
    model = build("llama", layers=2)
    interceptor = CallInterceptor(model)
    try:
        import inspect

        assert "logits_to_keep" in inspect.signature(model.forward).parameters
    finally:
        interceptor.remove()


# ------------------------------------------------------------------------------------------------ PEFT models
def test_a_peft_model_generates_through_two_stages_of_one_process_as_one_device():
    import lightning_pipe

    pytest.importorskip("peft")

    def predict(strategy=None):
        torch.manual_seed(0)
        model = LitGenerate(layers=4, tuner="lora")
        return quiet_trainer(devices=1, **({"strategy": strategy} if strategy else {})).predict(model)

    ref = predict()
    got = predict(lightning_pipe.PipelineParallelStrategy(schedule="Interleaved1F1B", stages_per_rank=2))
    assert len(got) == len(ref) == 3
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize(
    "config,kwargs,names",
    [
        ({}, {"adapter_names": ["default"]}, ["adapter_names", "model.set_adapter(name)"]),
        ({"alora_invocation_tokens": [3]}, {}, ["alora_invocation_tokens", "without `alora_invocation_tokens`"]),
    ],
)
def test_generate_of_a_peft_model_with_per_call_adapter_arguments_is_refused(config, kwargs, names):
    peft = pytest.importorskip("peft")
    from lightning_pipe.models.peft import PeftDecoding

    if any(k not in inspect.signature(peft.LoraConfig).parameters for k in config):
        pytest.skip(f"peft {peft.__version__} has no {sorted(config)}")
    model = peft.get_peft_model(build("llama", layers=2), peft.LoraConfig(r=2, target_modules=["q_proj"], **config))
    with pytest.raises(PipelineUsageError) as err:
        PeftDecoding().check(model, (), {"max_new_tokens": 3, **kwargs})
    for name in ["`PeftModel.generate(...)`", *names]:
        assert name in str(err.value)


# ------------------------------------------------------------------------------------------------ multi-process
def _configs(families, schedule, devices, layers):
    return [
        {"name": f"{f}-{schedule}-{mode}", "schedule": schedule, "devices": devices, "family": f}
        | {"sample": mode == "sample", "layers": layers}
        for f in families
        for mode in ("greedy", "sample")
    ]


TWO = _configs(["llama", "mistral"], "1F1B", 2, 4)
#: PEFT models (LoRA with a `modules_to_save` norm; LoHa) generate in validation, test and predict steps
PEFT = [
    {"name": f"llama-{tuner}-1F1B-{mode}", "schedule": "1F1B", "devices": 2, "family": "llama", "layers": 4}
    | {"sample": mode == "sample", "tuner": tuner, "test": True}
    for tuner, mode in (("lora", "greedy"), ("lora", "sample"), ("loha", "greedy"))
]
FOUR = _configs(["llama"], "Interleaved1F1B", 4, 8)


@functools.cache
def reference(family: str, sample: bool, layers: int, tuner: str | None = None, test: bool = False) -> dict:
    return run_generation(family=family, sample=sample, layers=layers, tuner=tuner, test=test)


def _check(launch: Launch, cfg):
    ref = reference(cfg["family"], cfg["sample"], cfg["layers"], cfg.get("tuner"), cfg.get("test", False))
    for rank, got in enumerate(launch.ranks(cfg["name"])):  # fails with the scenario's own traceback
        # every rank ran the same generate loop: every rank holds the one device's ids
        assert len(got["generated"]) == len(ref["generated"])
        for a, b in zip(got["generated"], ref["generated"]):
            assert torch.equal(a, b), (rank, a, b)
        assert got["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=TOL), key
        if rank == 0:
            assert len(got["predictions"]) == len(ref["predictions"])
            for a, b in zip(got["predictions"], ref["predictions"]):
                assert torch.equal(a, b), (a, b)


# Each launch once per module; each scenario has its own test.
SHARED_TWO.part(__name__, "two", "generation.py", [*TWO, *PEFT], timeout=900)


@pytest.fixture(scope="module")
def two(request) -> Launch:
    return SHARED_TWO.launch(request)  # the 2-process launch shared with other modules (tests/launch.py Shared)


SHARED_FOUR.part(__name__, "four", "generation.py", FOUR, timeout=900)


@pytest.fixture(scope="module")
def four(request) -> Launch:
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", TWO, ids=lambda c: c["name"])
def test_generate_in_validation_and_predict_equals_one_device(two, cfg):
    _check(two, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", PEFT, ids=lambda c: c["name"])
def test_generate_of_a_peft_model_in_validation_test_and_predict_equals_one_device(two, cfg):
    _check(two, cfg)
    base = reference(cfg["family"], cfg["sample"], cfg["layers"])
    assert any(not torch.equal(a, b) for a, b in zip(base["generated"], reference(**_peft(cfg))["generated"])), (
        "the adapters change the ids: a stage that skipped them would be seen"
    )


def _peft(cfg):
    return {k: cfg[k] for k in ("family", "sample", "layers", "tuner", "test")}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", FOUR, ids=lambda c: c["name"])
def test_generate_under_interleaved_1f1b_at_four_processes(four, cfg):
    _check(four, cfg)
