"""The grouped expert LoRA (finetune/models/expert_lora.py) computes what peft's target_parameters path computes, on the tiny
GPT-OSS in float32: outputs and the gradients of the input, the routing weights and both LoRA factors of both expert
weights, for several routings; its adapter is peft's; it traces whole under torch.compile.

The multi-process runs of tests/test_distributed.py train with it under DDP, FSDP2, ZeRO-2 and ZeRO-3 (their log shows
the grouped path's line)."""

import copy

import pytest
import torch

from finetune.models import expert_lora

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOKENS = 24


def tiny_gpt_oss():
    from transformers import AutoModelForCausalLM

    from finetune.models import tiny

    return AutoModelForCausalLM.from_pretrained(tiny.tiny_model_folder("gpt-oss"), dtype=torch.float32,
                                                experts_implementation="eager")


def adapted(model, r: int, target_modules=("q_proj",)):
    """peft's model with random (not zero) LoRA factors, so that both factors have gradients from the first step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=r, lora_alpha=16, target_modules=list(target_modules), target_parameters=EXPERT_PARAMETERS,
                        init_lora_weights=False)
    return get_peft_model(model, config)


def peft_and_grouped(r: int):
    reference = adapted(tiny_gpt_oss(), r)
    grouped = copy.deepcopy(reference)
    assert expert_lora.install(grouped) == 2  # one per layer
    return reference, grouped


def routing(kind: str, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Top-2 expert indices per token."""
    if kind == "random":
        return torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(TOKENS)])
    if kind == "expert 0 gets no token":
        return torch.stack([1 + torch.randperm(experts - 1, generator=generator)[:2] for _ in range(TOKENS)])
    if kind == "expert 3 gets every token":
        others = torch.randint(0, experts - 1, (TOKENS, 1), generator=generator)
        return torch.cat([torch.full((TOKENS, 1), experts - 1), others], dim=1)
    if kind == "two experts get every token":
        return torch.tensor([[2, 1]] * TOKENS)
    raise ValueError(kind)


def gradients(module) -> dict:
    return {name: parameter.grad.clone() for name, parameter in module.named_parameters() if parameter.grad is not None}


def run_experts(wrapper, hidden, indices, weights):
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    output = wrapper(hidden, indices, weights)
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
    return output.detach(), {"hidden": hidden.grad, "routing weights": weights.grad, **gradients(wrapper)}


def assert_close(actual: dict, expected: dict, tolerance: float) -> None:
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
    for name, tensor in expected.items():
        scale = tensor.abs().max().item() or 1.0
        difference = (actual[name] - tensor).abs().max().item() / scale
        assert difference <= tolerance, f"{name}: relative difference {difference:.2e}"


@pytest.mark.parametrize("r", [8, 3], ids=["r8 grouped_mm", "r3 padded to grouped_mm"])  # r 3: rows not 16-byte aligned
@pytest.mark.parametrize("kind", ["random", "expert 0 gets no token", "expert 3 gets every token",
                                  "two experts get every token"])
def test_grouped_expert_lora_gives_peft_outputs_and_gradients(kind, r, monkeypatch):
    def no_loop(*args):
        raise AssertionError("a GEMM fell back to the per-expert loop (a rank not padded to 16 bytes?)")

    monkeypatch.setattr(torch.ops.finetune, "loop_mm", no_loop)
    monkeypatch.setattr(torch.ops.finetune, "loop_mm_per_expert", no_loop)
    reference, grouped = peft_and_grouped(r)
    wrapper_reference = reference.base_model.model.model.layers[0].mlp.experts
    wrapper_grouped = grouped.base_model.model.model.layers[0].mlp.experts
    assert type(wrapper_grouped) is expert_lora.GroupedExpertsLora
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(TOKENS, wrapper_reference.get_base_layer().hidden_size, generator=generator)
    indices = routing(kind, wrapper_reference.num_experts, generator)
    weights = torch.softmax(torch.randn(TOKENS, 2, generator=generator), dim=-1)

    expected_output, expected = run_experts(wrapper_reference, hidden, indices, weights)
    output, actual = run_experts(wrapper_grouped, hidden, indices, weights)

    assert any("lora_A" in name for name in expected) and any("lora_B" in name for name in expected)
    assert_close({"output": output, **actual}, {"output": expected_output, **expected}, 1e-5)
    if kind == "expert 0 gets no token":
        zero = [name for name, grad in actual.items() if "lora_A" in name and grad.view(4, r, -1)[0].abs().max() > 0]
        assert not zero, f"an expert without tokens has LoRA gradients in {zero}"


def test_the_tiny_gpt_oss_loss_and_every_gradient_equal_peft():
    reference, grouped = peft_and_grouped(8)
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(2))
    losses = []
    for model in (reference, grouped):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0])
    assert_close(gradients(grouped), gradients(reference), 1e-5)


def test_an_adapter_saved_on_either_path_loads_into_the_other_and_merges(tmp_path):
    from peft import PeftModel

    _, grouped = peft_and_grouped(8)
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = grouped(input_ids=ids).logits
    grouped.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_gpt_oss(), tmp_path)  # peft's own path
    with torch.no_grad():
        on_peft_path = loaded(input_ids=ids).logits
        assert expert_lora.install(loaded) == 2
        on_grouped_path = loaded(input_ids=ids).logits
        merged = loaded.merge_and_unload()(input_ids=ids).logits
    for logits in (on_peft_path, on_grouped_path, merged):
        assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32 loop", "bfloat16 grouped_mm"])
def test_the_grouped_experts_trace_whole_under_torch_compile(dtype):
    """fullgraph: no graph break in the experts (the per-expert loop is a custom operator); aot_eager: dynamo and
    AOTAutograd as under inductor, without its C++ build, which takes minutes on a small CPU."""
    _, grouped = peft_and_grouped(8)
    wrapper = grouped.base_model.model.model.layers[0].mlp.experts.to(dtype)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(TOKENS, 64, generator=generator, dtype=dtype)
    indices = routing("random", 4, generator)
    weights = torch.softmax(torch.randn(TOKENS, 2, generator=generator), dim=-1).to(dtype)

    expected_output, expected = run_experts(wrapper, hidden, indices, weights)
    wrapper.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(wrapper, backend="aot_eager", fullgraph=True)
    output, actual = run_experts(compiled, hidden, indices, weights)
    actual = {name.removeprefix("_orig_mod."): grad for name, grad in actual.items()}
    assert_close({"output": output, **actual}, {"output": expected_output, **expected},
                 1e-5 if dtype == torch.float32 else 1e-2)


def test_expert_lora_kernel_peft_keeps_peft_s_path_and_disabled_adapters_give_the_base_model():
    from types import SimpleNamespace

    model = adapted(tiny_gpt_oss(), 8)
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(is_main_process=True))
    assert expert_lora.use_kernel(trainer, "peft") == 0
    assert not any(isinstance(module, expert_lora.GroupedExpertsLora) for module in model.modules())
    assert expert_lora.use_kernel(trainer, "grouped") == 2
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with model.disable_adapter():
            disabled = model(input_ids=ids).logits
        base = tiny_gpt_oss()(input_ids=ids).logits
        adapted_logits = model(input_ids=ids).logits
    assert (disabled - base).abs().max() <= 1e-6 and (adapted_logits - base).abs().max() > 1e-3
