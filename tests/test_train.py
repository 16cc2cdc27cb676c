"""Single-process training through the real `accelerate launch`: every recipe, saving, reloading, resuming, merging."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config.files import read_recipe
from finetune.families import family_of
from tests.helpers import ROOT, launch_sft, loss_and_backward, printed_losses, printed_setup

pytestmark = pytest.mark.launches  # its tests start training processes

RECIPES = sorted(ROOT.glob("recipes/*/*.yaml"))

# Runs in a fresh process: loads what a run saved the way a user would, and reports what it found.
RELOAD = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
output = Path(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(output)
report = {"chat_template": bool(tokenizer.chat_template)}
if (output / "adapter_config.json").is_file():
    from peft import PeftModel
    base_path = json.loads((output / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), output)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    report.update(kind="adapter", adapted_tensors=len(lora_b), trained=any(bool(p.abs().sum() > 0) for p in lora_b),
                  expert_adapters=sum("experts" in n for n, _ in model.named_parameters() if "lora_" in n))
    generation = model.base_model.model.generation_config
else:
    model = AutoModelForCausalLM.from_pretrained(output)
    base_path = model.config._name_or_path
    initial = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    initial_state = initial.state_dict()
    report.update(kind="full", trained=any(not torch.equal(t, initial_state[k]) for k, t in model.state_dict().items()))
    generation = model.generation_config
eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
report["stops_at_eos"] = tokenizer.eos_token_id in eos
print(json.dumps(report))
"""


def reload_in_fresh_process(output_dir: Path, initial_model: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RELOAD, str(output_dir), str(initial_model)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def tiny_folder(tiny_model_cache: Path, recipe: Path) -> Path:
    return next(tiny_model_cache.glob(f"{family_of(read_recipe(recipe)['model_name_or_path']).name}-*"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_every_recipe_trains_tiny_on_cpu_and_its_output_reloads_in_a_fresh_process(recipe, tmp_path, tiny_model_cache):
    output_dir = tmp_path / "out"
    result = launch_sft("--config", str(recipe), "--tiny", "--output_dir", str(output_dir), "--max_steps", "30")
    assert result.returncode == 0, result.stderr[-3000:]

    losses = printed_losses(result.stdout)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert printed_setup(result.stdout)["strategy"] == "single"
    assert (output_dir / "loss.png").stat().st_size > 1000

    report = reload_in_fresh_process(output_dir, tiny_folder(tiny_model_cache, recipe))
    assert report["trained"] and report["chat_template"] and report["stops_at_eos"]
    if "lora" in recipe.stem:
        assert report["kind"] == "adapter" and report["adapted_tensors"] > 0
        if "lora_target_parameters" in read_recipe(recipe):
            assert report["expert_adapters"] > 0, "the recipe adapts the experts through target_parameters"
        else:
            assert report["expert_adapters"] == 0
    else:
        assert report["kind"] == "full"


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_under_checkpointing_a_layer_with_a_graph_break_is_still_compiled_once_for_all_layers(family, monkeypatch):
    """Compiled around a checkpoint, a layer with one graph break runs wholly eager (pytorch#139989); compiled inside
    it, the layer's pieces around the break are compiled once and reused by every layer, with the eager gradients."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.compilation import CompileInsideCheckpoints

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 12, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128}
    if family == "gpt_oss":
        shape.update(num_local_experts=4, experts_per_token=2, layer_types=["sliding_attention", "full_attention"] * 6,
                     sliding_window=8)
    config = AutoConfig.for_model(family, **shape)
    mlp_class = type(AutoModelForCausalLM.from_config(config).model.layers[0].mlp)
    forward_without_break = mlp_class.forward

    def forward_with_break(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward_without_break(self, *args, **kwargs)

    monkeypatch.setattr(mlp_class, "forward", forward_with_break)
    ids = torch.randint(0, shape["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    gradients = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        counter = CompileCounterWithBackend("eager")
        if compiled:
            CompileInsideCheckpoints(counter, None).on_train_begin(None, None, None, model=model)
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        gradients.append([parameter.grad for parameter in model.parameters()])
    torch._dynamo.reset()
    assert 0 < counter.frame_count < shape["num_hidden_layers"], "the layer's frames should compile once, not per layer"
    assert counter.op_count > 10 * 2, "the compiled graphs should hold the layer's work"
    for eager, compiled in zip(*gradients):
        torch.testing.assert_close(compiled, eager)


def test_offloading_compiled_checkpoints_moves_only_layer_inputs_and_keeps_the_gradients(monkeypatch):
    """With checkpointing each layer keeps only its input: offloading moves those inputs to the CPU and brings them
    back for the backward, where the layer is recomputed (compiled, inside a reentrant checkpoint) on the device."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune import patches
    from finetune.models.compilation import call

    layers, batch, seq, hidden = 4, 2, 24, 32
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))

    counter = CompileCounterWithBackend("aot_eager")
    compiled_call = torch.compile(call, backend=counter)  # as compilation.CompileInsideCheckpoints compiles it

    def train_step(offloading: bool, keep_recomputation: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.train()
        model.gradient_checkpointing_enable()
        patches.compile_inside_checkpoints(model, compiled_call, offloading=keep_recomputation)
        loss, offloaded = loss_and_backward(model, ids, monkeypatch, offloading)
        assert counter.frame_count > 0, "the layers should run compiled"
        return loss, [parameter.grad for parameter in model.parameters()], offloaded

    loss, gradients, _ = train_step(offloading=False, keep_recomputation=False)
    offloaded_loss, offloaded_gradients, offloaded = train_step(offloading=True, keep_recomputation=True)
    torch.testing.assert_close(offloaded_loss, loss)
    for with_offloading, without in zip(offloaded_gradients, gradients):
        torch.testing.assert_close(with_offloading, without)
    layer_inputs = [entry for entry in offloaded if entry == ("forward", (batch, seq, hidden))]
    assert len(layer_inputs) >= layers, offloaded
    assert not [entry for entry in offloaded if entry[0] == "backward"], "the recomputed layers were offloaded too"

    _, _, unguarded = train_step(offloading=True, keep_recomputation=False)
    torch._dynamo.reset()
    assert [entry for entry in unguarded if entry[0] == "backward"], "the reentrant recomputation meets the hooks"


def test_the_training_loss_never_builds_the_full_vocabulary_logits_and_equals_the_plain_loss(monkeypatch):
    """TRL's SFTTrainer (so every recipe) scores tokens through a fused LM head: tiles of tokens x vocabulary columns
    instead of the (tokens x vocabulary) logits, 8 GiB in fp32 for Llama at batch 8 x 2048. Here with small tiles:
    the same loss and gradients as the model's own loss over the full logits."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 64)
    batch, seq, vocab = 2, 24, 256
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt: not scored

    class LargestTensor(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.numel = max(self.numel, tensor.numel())
            return out

    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer does
        with LargestTensor() as largest:
            loss = model(input_ids=ids, labels=labels, fused_lm_head=fused, use_cache=False).loss
            loss.backward()
        results[fused] = loss.detach(), [p.grad for p in model.parameters()], largest.numel
    (plain_loss, plain_grads, plain_largest), (loss, grads, largest) = results[False], results[True]
    full_logits = batch * seq * vocab
    assert plain_largest >= full_logits > largest, (plain_largest, largest)
    torch.testing.assert_close(loss, plain_loss)
    for fused_grad, plain_grad in zip(grads, plain_grads):
        torch.testing.assert_close(fused_grad, plain_grad)
