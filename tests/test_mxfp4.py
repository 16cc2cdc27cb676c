"""GPT-OSS as the hub ships it: the tiny GPT-OSS written with MXFP4 experts the way openai/gpt-oss-* are stored, loaded
by the GPT-OSS LoRA recipe through `--model_name_or_path` (not --tiny) and dequantized on load, trained on the harmony
sample alone, under ZeRO-3 and under FSDP2, its adapter saved and reloaded on the MXFP4 base in a fresh process.

The expected weights come from benchmarks/mxfp4_checkpoints.py's dequantization, written from the format's definition,
not from transformers'; the format itself is pinned by hand-made bytes below.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from benchmarks import mxfp4_checkpoints
from finetune.checks import model_folder
from finetune.run import arguments, model
from tests.helpers import ROOT, free_port
from tests.test_distributed import Run, accelerate_command, assert_setup, launch_env

LORA_FLAGS = [
    "--dataset_name", "data/harmony_sample", "--max_length", "256", "--eval_strategy", "no", "--save_strategy", "no",
    "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
    "--lora_dropout", "0", "--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
    "--chat_template_kwargs", '{"reasoning_effort": "high"}',
]


@pytest.fixture(scope="module")
def mxfp4_folder():
    return mxfp4_checkpoints.tiny_checkpoint()


def test_tiny_checkpoint_stores_its_experts_as_the_hub_does(mxfp4_folder):
    from transformers import AutoConfig

    config = json.loads((mxfp4_folder / "config.json").read_text())
    assert config["quantization_config"] == {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    }
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    weight_map = json.loads((mxfp4_folder / "model.safetensors.index.json").read_text())["weight_map"]
    expected = mxfp4_checkpoints.expected_shapes(AutoConfig.from_pretrained(mxfp4_folder))
    layers = config["num_hidden_layers"]
    stored = {}
    for name, file in weight_map.items():
        with safe_open(str(mxfp4_folder / file), "pt") as shard:
            tensor = shard.get_slice(name)
            stored[name] = (tensor.get_shape(), tensor.get_dtype())
    for layer in range(layers):
        for suffix, shape_and_dtype in expected.items():
            assert stored[f"model.layers.{layer}.{suffix}"] == shape_and_dtype, suffix
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" not in stored
    others = {name: dtype for name, (_, dtype) in stored.items() if not name.endswith(("_blocks", "_scales"))}
    assert set(others.values()) == {"BF16"}, others


def test_reference_dequantization_follows_the_format_definition():
    # One expert, out=1, in=32: byte 0x21 holds 0.5 (low nibble, code 1) then 1.0 (high nibble, code 2); byte 0xF8
    # holds -0.0 (code 8) then -6.0 (code 15); scale byte 128 means 2**1.
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0], blocks[0, 0, 0, 1] = 0x21, 0xF8
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)
    weight = mxfp4_checkpoints.dequantize(blocks, scales)
    assert weight.shape == (1, 32, 1)  # in-memory [experts, in, out]
    assert weight[0, :4, 0].tolist() == [1.0, 2.0, -0.0, -12.0] and not weight[0, 4:].any()
    # Values already on the FP4 grid survive quantize -> dequantize exactly, with the stored transpose.
    grid = torch.tensor(mxfp4_checkpoints.FP4_MAGNITUDES)
    exact = grid[torch.randint(0, 8, (2, 64, 96))] * torch.where(torch.rand(2, 64, 96) < 0.5, -1.0, 1.0) * 2.0**-5
    exact[:, 0, :] = 6 * 2.0**-5  # every block's largest value sets its scale
    blocks, scales = mxfp4_checkpoints.quantize(exact)
    assert blocks.shape == (2, 96, 2, 16) and scales.shape == (2, 96, 2) and blocks.dtype == torch.uint8
    assert torch.equal(mxfp4_checkpoints.dequantize(blocks, scales), exact)


def test_recipe_loading_dequantizes_the_stored_experts_to_the_training_dtype(mxfp4_folder, tmp_path):
    from finetune.checks import recipe as recipe_checks
    from finetune.run import arguments

    run = arguments.parse_args(["--config", "recipes/gpt-oss-20b/lora.yaml", "--model_name_or_path", str(mxfp4_folder),
                             "--output_dir", str(tmp_path / "out")])
    recipe_checks.check(run)
    loaded = model.load_model(run, model_folder.resolve_model_path(run)).state_dict()
    reference = mxfp4_checkpoints.stored_expert_weights(mxfp4_folder)
    assert len(reference) == 2 * json.loads((mxfp4_folder / "config.json").read_text())["num_hidden_layers"]
    for name, weight in reference.items():
        assert loaded[name].dtype == torch.float32, name  # the CPU training dtype (bf16 on a GPU)
        assert torch.equal(loaded[name], weight), name


@pytest.mark.parametrize("strategy_env, on_the_gpu", [({}, True), ({"WORLD_SIZE": "2"}, True),
                                                      ({"ACCELERATE_USE_FSDP": "true"}, False),
                                                      ({"ACCELERATE_USE_DEEPSPEED": "true",
                                                        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, False)])
def test_on_a_gpu_mxfp4_is_dequantized_on_the_process_s_gpu_unless_the_strategy_shards(mxfp4_folder, tmp_path,
                                                                                      monkeypatch, strategy_env,
                                                                                      on_the_gpu):
    from finetune.config.launch_request import read_exported_launch
    from finetune.models import cpu

    run = arguments.parse_args(["--config", "recipes/gpt-oss-20b/lora.yaml", "--model_name_or_path", str(mxfp4_folder),
                             "--output_dir", str(tmp_path / "out")])
    for name, value in strategy_env.items():
        monkeypatch.setenv(name, value)
    run.launch = read_exported_launch()  # what the launch's processes read (parsed as one process, without FSDP's shim)
    monkeypatch.setattr(cpu, "on_cpu", lambda: False)
    kwargs = model.model_init_kwargs(run, str(mxfp4_folder))
    assert kwargs["quantization_config"].dequantize
    assert kwargs.get("device_map") == ({"": 0} if on_the_gpu else None)


# --- The recipe end to end, one launch per strategy, shared by the tests below.

RELOAD = r"""
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config
from finetune.run import generation as inference
adapter = sys.argv[1]
base_path = json.loads(open(f"{adapter}/adapter_config.json").read())["base_model_name_or_path"]
base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
peft_model = PeftModel.from_pretrained(base, adapter)
tokenizer = AutoTokenizer.from_pretrained(adapter)
lora_b = {name: parameter for name, parameter in peft_model.named_parameters() if "lora_B" in name}
answer = inference.answer(peft_model, tokenizer, "What is 2 + 3?", max_new_tokens=4,
                          chat_template_kwargs={"reasoning_effort": "high"})
print(json.dumps({"base": base_path, "lora_b": len(lora_b), "trained": all(bool(p.abs().sum() > 0) for p in lora_b.values()),
                  "expert_adapters": sum("experts" in name for name in lora_b), "answer": answer}))
"""


class Launches:
    def __init__(self, root, folder):
        self.root, self.folder, self.runs = root, folder, {}

    def get(self, config: str | None) -> Run:
        """The recipe on the MXFP4 folder as a user runs it on the hub's checkpoint: no --tiny."""
        key = config or "single"
        if key not in self.runs:
            processes, output_dir = 2 if config else 1, self.root / key
            command = accelerate_command(config, processes, free_port()) + [
                "scripts/sft.py", "--config", "recipes/gpt-oss-20b/lora.yaml", "--model_name_or_path", str(self.folder),
                "--output_dir", str(output_dir), *LORA_FLAGS, "--gradient_accumulation_steps", str(2 // processes)]
            result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600,
                                    check=False)
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output[-6000:]}"
            self.runs[key] = Run(output_dir, output, 0.0)
        return self.runs[key]


@pytest.fixture(scope="module")
def launches(tmp_path_factory, mxfp4_folder):
    return Launches(tmp_path_factory.mktemp("mxfp4-runs"), mxfp4_folder)


def reload_and_generate(output_dir) -> dict:
    result = subprocess.run([sys.executable, "-c", RELOAD, str(output_dir)], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.launches
@pytest.mark.parametrize("config", [
    pytest.param(None, id="single"),
    pytest.param("zero3", marks=pytest.mark.xdist_group("mxfp4-zero3")),
    pytest.param("fsdp", marks=pytest.mark.xdist_group("mxfp4-fsdp")),
])
def test_gpt_oss_recipe_trains_the_mxfp4_checkpoint_and_its_adapter_reloads_on_it(launches, mxfp4_folder, config):
    run = launches.get(config)
    if config:
        assert_setup(run, config)
    else:
        assert run.setup["strategy"] == "single", run.setup
    assert len(run.losses) == 2 and all(map(math.isfinite, run.losses)), run.losses
    saved = json.loads((run.output_dir / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(mxfp4_folder)
    report = reload_and_generate(run.output_dir)
    assert report["base"] == str(mxfp4_folder) and report["trained"], report
    assert report["expert_adapters"] > 0 and report["lora_b"] > report["expert_adapters"], report
    assert isinstance(report["answer"], str)
