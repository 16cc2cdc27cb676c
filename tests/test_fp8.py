"""`fp8: true`: refused where it cannot run (no float8 GPU, no torchao, QLoRA, DeepSpeed, not compiled) before any model
loads; where it runs, exactly the decoder layers' linear layers train in float8 and the saved model is plain bf16.

The CPU has no float8 tensor cores, so the refusals that need an FP8 GPU pretend one; the training test runs the real
trainer path after the check (torch 2.13 has a CPU float8 matmul, slow but exact enough for two steps) where torchao
is installed (`pip install -e ".[fp8]"`; not part of `.[test]`, see pyproject.toml): .ci/run installs it after the
suite and runs this file again, so that in CI every test here runs and none is skipped.
"""

import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from finetune.checks import model_folder
from finetune.models import fp8
from finetune.run import arguments, model
from tests.helpers import ROOT, run_sft_in_process

FULL = ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"
LORA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"
QLORA = ROOT / "recipes" / "llama-3.2-3b" / "qlora.yaml"
TINY_LLAMA_LINEARS = {f"model.layers.{layer}.{projection}" for layer in range(2) for projection in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def refusal(arguments: list[str], capfd, monkeypatch) -> str:
    result = run_sft_in_process(arguments, capfd, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_fp8_on_a_machine_without_a_gpu_is_refused_in_one_sentence_naming_the_switch(tmp_path, capfd, monkeypatch):
    sentence = refusal(["--config", str(FULL), "--tiny", "--fp8", "true", "--output_dir", str(tmp_path / "out")],
                       capfd, monkeypatch)
    assert sentence == (f"error: {FULL}: `fp8: true` needs a GPU with float8 tensor cores (compute capability 8.9 "
                        f"or higher: L4, L40S, H100, H200) but this machine has no GPU; remove `fp8: true` to train "
                        f"in bf16.")


@pytest.mark.parametrize("gpu, capability, refused", [
    ("NVIDIA A100-SXM4-80GB", (8, 0), True), ("NVIDIA A10", (8, 6), True),
    ("NVIDIA L4", (8, 9), False), ("NVIDIA H200", (9, 0), False)])
def test_only_gpus_with_float8_tensor_cores_pass_the_hardware_check(gpu, capability, refused, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: gpu)
    problem = fp8.hardware_problem()
    assert (problem == f"the {gpu} here is compute capability {capability[0]}.{capability[1]}") if refused \
        else problem is None


@pytest.mark.parametrize("name, extra, environment, expected", [
    ("QLoRA", ["--config", str(QLORA)], {}, ["cannot train quantized base weights", "QLoRA"]),
    ("DeepSpeed", [], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     ["not DeepSpeed", "accelerate_configs/ddp.yaml or fsdp.yaml"]),
    ("not compiled", [], {}, ["without `torch_compile: true`", "add `torch_compile: true`"]),
])
def test_fp8_where_it_would_not_run_or_not_pay_is_refused_before_the_model_loads(
        name, extra, environment, expected, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(fp8, "hardware_problem", lambda: None)  # as on an H200
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    config = extra[:2] if extra[:1] == ["--config"] else ["--config", str(FULL)]
    sentence = refusal([*config, "--tiny", "--fp8", "true", "--output_dir", str(tmp_path / "out")], capfd, monkeypatch)
    assert "`fp8: true`" in sentence and sentence.endswith("."), sentence
    for words in expected:
        assert words in sentence, sentence


def test_fp8_without_torchao_names_the_extra_to_install(monkeypatch):
    from finetune.errors import UserError
    from finetune.run.arguments import parse_args

    run = parse_args(["--config", str(FULL), "--tiny", "--fp8", "true"])
    run.training.torch_compile = True  # as on a GPU: the CPU's override turns it off
    monkeypatch.setattr(fp8, "hardware_problem", lambda: None)
    for module in ("torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError, as when not installed
    with pytest.raises(UserError) as refused:
        fp8.check(run, str(FULL))
    assert str(refused.value) == (f"{FULL}: `fp8: true` trains through torchao, which is not installed; install it "
                                  f'with `pip install -e ".[fp8]"` or remove `fp8: true`.')


TWO_STEPS = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
             "--max_length", "64", "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "1",
             "--report_to", "none", "--eval_samples_before_after", "0"]


def fp8_trainer(recipe, output_dir, *flags: str, vocabulary_padded: bool = False):
    """The real path after the check: the recipe parsed with `fp8: true`, its tiny Llama loaded, the FinetuneTrainer
    built (which converts) on 8 sample rows. Returns the run, the tiny model's folder and the trainer."""
    from finetune.data import load as data
    from finetune.run import trainer as training

    run = arguments.parse_args(["--config", str(recipe), "--tiny", "--fp8", "true", *flags, "--output_dir", str(output_dir),
                             *TWO_STEPS])
    path = model_folder.resolve_model_path(run)
    tokenizer = model.load_tokenizer(path, run.training.assistant_only_loss)
    train_set, _ = data.load_datasets(run.script, run.training, None, run.finetune, tokenizer=tokenizer)
    llama = model.load_model(run, path)
    if vocabulary_padded:
        llama.resize_token_embeddings(pad_to_multiple_of=16)  # as Llama 3.2's 128,256: LM head sizes suit float8 too
    return run, path, training.build_trainer(run, llama, tokenizer, train_set.select(range(8)), None)


def test_fp8_trains_exactly_the_decoder_linears_in_float8_and_saves_a_plain_bf16_model(tmp_path):
    """Tiny Llama loaded in bf16, converted by the trainer, two optimizer steps, the model saved as TRL saves it."""
    float8_linear = pytest.importorskip("torchao.float8.float8_linear", reason='needs `pip install -e ".[fp8]"`')

    output_dir = tmp_path / "out"
    run, path, trainer = fp8_trainer(FULL, output_dir, "--dtype", "bfloat16", vocabulary_padded=True)

    in_float8 = {name for name, module in trainer.model.named_modules() if isinstance(module, float8_linear.Float8Linear)}
    assert in_float8 == TINY_LLAMA_LINEARS
    assert type(trainer.model.lm_head) is torch.nn.Linear and trainer.model.lm_head.weight.dtype == torch.bfloat16
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    trainer.save_model(str(output_dir))

    saved = load_file(output_dir / "model.safetensors")
    bf16_model = model.load_model(run, path)
    assert set(saved) == set(bf16_model.state_dict()) - {"lm_head.weight"}  # tied to the embeddings, saved once
    assert {(type(tensor), tensor.dtype) for tensor in saved.values()} == {(torch.Tensor, torch.bfloat16)}
    assert json.loads((output_dir / "config.json").read_text()).get("quantization_config") is None
    reloaded = model.load_model(run, str(output_dir))
    assert not any(isinstance(module, float8_linear.Float8Linear) for module in reloaded.modules())
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(parameter, trained[name]) for name, parameter in reloaded.named_parameters())


def test_fp8_lora_computes_the_frozen_base_in_float8_and_trains_only_the_bf16_adapters(tmp_path):
    float8_linear = pytest.importorskip("torchao.float8.float8_linear", reason='needs `pip install -e ".[fp8]"`')
    _, _, trainer = fp8_trainer(LORA, tmp_path / "out")
    before = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainer.train()

    modules = dict(trainer.model.named_modules())
    bases = {name.removesuffix(".base_layer") for name, module in modules.items()
             if isinstance(module, float8_linear.Float8Linear)}
    assert {name.removeprefix("base_model.model.") for name in bases} == TINY_LLAMA_LINEARS
    adapters = [module for name in bases for module in (modules[f"{name}.lora_A.default"], modules[f"{name}.lora_B.default"])]
    assert all(type(adapter) is torch.nn.Linear for adapter in adapters)
    changed = {name for name, parameter in trainer.model.named_parameters() if not torch.equal(parameter, before[name])}
    assert changed and all("lora_" in name for name in changed), sorted(changed)


def test_compiled_float8_backward_skips_the_frozen_base_weight_gradient():
    """Why `fp8` pays with LoRA: Float8Linear's backward computes a weight gradient whatever the weight, but compiled,
    the frozen weight's float8 matmul is dead code; only the input gradient's remains."""
    pytest.importorskip("torchao.float8", reason='needs `pip install -e ".[fp8]"`')
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    float8_matmuls = {}

    def count(kind):
        def compiler(graph, _):
            float8_matmuls[kind] = sum(node.target == torch.ops.aten._scaled_mm.default for node in graph.graph.nodes)
            return make_boxed_func(graph)
        return compiler

    layers = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    convert_to_float8_training(layers.to(torch.bfloat16), config=Float8LinearConfig.from_recipe_name(fp8.SCALING))
    layers.requires_grad_(False)
    layers[0].weight.requires_grad_(True)  # a trained weight: its float8 weight-gradient matmul must stay
    compiled = torch.compile(layers, backend=aot_autograd(fw_compiler=count("forward"), bw_compiler=count("backward")))
    compiled(torch.randn(32, 64, dtype=torch.bfloat16)).float().sum().backward()
    # backward: layer 1's input gradient, layer 0's weight gradient; not layer 1's frozen weight's, not layer 0's input's
    assert float8_matmuls == {"forward": 2, "backward": 2}


def test_fp8_parity_passes_within_one_percent_of_the_bf16_final_loss_and_fails_beyond(tmp_path):
    from benchmarks.fp8_parity import compare, plot, write_curves

    bf16 = [11.9 - 0.05 * step for step in range(200)]
    for scale, passed in ((1.009, True), (1.011, False)):
        report = {"title": "t", "runs": {"bf16": {"losses": bf16}, "fp8": {"losses": [loss * scale for loss in bf16]}}}
        compare(report)
        assert report["passed"] is passed and report["final_rel_diff"] == pytest.approx(scale - 1)
    report["runs"]["fp8"] = {"error": "RuntimeError: out of memory"}
    compare(report)
    assert report["passed"] is False
    write_curves(report, tmp_path)
    assert plot(report, tmp_path / "fp8_parity.png") == str(tmp_path / "fp8_parity.png")
    assert (tmp_path / "fp8_parity.csv").read_text() == "step,bf16,fp8\n"
