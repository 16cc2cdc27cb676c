"""GPT-OSS under TRL returns its router logits for the MoE load-balancing loss (`output_router_logits`), which
transformers collects with forward hooks that read a ContextVar: traced inside a compiled decoder layer, each hook
broke the layer into about ten graphs (finetune/patches.py, `defer_output_capture`). Compiled, the layers capture
the same router logits without a break, in one graph per layer type, and train as eager does. In-process, on a tiny
GPT-OSS with LoRA on its attention, compiled by aot_eager (dynamo's graphs and AOTAutograd's forward and backward,
without inductor's C++ build)."""

import gc
import weakref
from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def tiny_gpt_oss_with_lora(checkpointing: bool, reentrant: bool = True):
    """The recipe's adapters: LoRA on the attention and on both expert weights, the experts through this toolkit's
    grouped GEMMs; random LoRA factors, so that every factor has a gradient from the first step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models import expert_lora

    config = AutoConfig.for_model("gpt_oss", hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                                  num_local_experts=4, num_experts_per_tok=2, layer_types=LAYER_TYPES, sliding_window=8,
                                  output_router_logits=True, router_aux_loss_coef=0.9, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                             init_lora_weights=False))
    assert expert_lora.install(model) == len(LAYER_TYPES)
    model.train()
    model.enable_input_require_grads()  # as the toolkit does for compiled LoRA (compilation.one_graph_for_every_layer)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def losses_and_lora_gradients(model, steps: int = 2):
    """The last of `steps` steps' loss (the aux loss in it), aux loss, router logits and LoRA gradients."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    lora = {name: parameter for name, parameter in model.named_parameters() if "lora_" in name}
    for _ in range(steps):
        model.zero_grad()
        output = model(input_ids=ids, labels=ids)
        output.loss.backward()
    gradients = {name: parameter.grad.clone() for name, parameter in lora.items()}
    return output.loss.detach(), output.aux_loss.detach(), len(output.router_logits), gradients


@pytest.mark.parametrize("checkpointing", [False, True], ids=["layers compiled", "compiled inside checkpoints"])
def test_compiled_gpt_oss_layers_capture_router_logits_without_a_graph_break(checkpointing):
    """(a) One graph per layer type, no graph break, inside reentrant checkpoints too (their forward without
    gradients runs the graph of their recomputation, patches._with_gradients_detached); (b) the loss with the aux loss
    in it, the aux loss, and every LoRA gradient as eager computes them, the aux loss's share included: inside
    reentrant checkpoints as transformers' default non-reentrant checkpointing trains it (eager reentrant
    checkpointing loses it, and its gradients differ)."""
    from finetune.models.compilation import CompileEachLayer, CompileInsideCheckpoints
    from finetune.run.speed import compiled_graphs

    eager_loss, eager_aux, eager_layers, eager_gradients = losses_and_lora_gradients(
        tiny_gpt_oss_with_lora(checkpointing, reentrant=False))

    model = tiny_gpt_oss_with_lora(checkpointing)
    compiling = CompileInsideCheckpoints("aot_eager", None) if checkpointing else CompileEachLayer("aot_eager", None)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiling.on_train_begin(None, None, None, model=model)
        loss, aux, layers, gradients = losses_and_lora_gradients(model)
        breaks, graphs = dict(counters["graph_break"]), compiled_graphs()
    finally:
        torch._dynamo.reset()

    assert not breaks, f"graph breaks in the compiled layers: {breaks}"
    assert 0 < graphs <= len(set(LAYER_TYPES)), graphs
    assert layers == eager_layers == len(LAYER_TYPES)
    assert eager_aux > 0
    torch.testing.assert_close(aux, eager_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert eager_gradients.keys() == gradients.keys() and len(gradients) == (4 + 2) * 2 * len(LAYER_TYPES)
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, eager_gradients[name], rtol=1e-4, atol=1e-6, msg=name)
    if checkpointing:
        without_aux = losses_and_lora_gradients(tiny_gpt_oss_with_lora(checkpointing, reentrant=True))[3]
        assert max((without_aux[name] - gradient).abs().max() for name, gradient in gradients.items()) > 1e-4


@pytest.mark.parametrize("offloading", [False, True], ids=["plain", "under activation offloading"])
def test_a_checkpoints_first_pass_runs_the_graph_with_gradients_and_keeps_nothing_of_it(offloading):
    """Without gradients (a reentrant checkpoint's first pass) a compiled layer runs its graph with gradients, the one
    its recomputation needs, and returns outputs with no autograd history: what that graph saved for a backward that
    never comes is freed as the layer returns, also under the hooks that keep offloading away from the layer (which
    once held every output its graph saved, tanh's here, in a reference cycle: GPT-OSS-20B's first passes of all 24
    layers alive at once on one H100, 76.9 GiB instead of 21)."""
    from finetune.patches import _call_keeping_saved_tensors, _with_gradients_detached

    weight = torch.randn(4, 4, requires_grad=True)
    grad_enabled, activations = [], []

    def layer(hidden):
        grad_enabled.append(torch.is_grad_enabled())
        activated = (hidden @ weight).tanh()  # tanh's backward saves its output
        activations.append(weakref.ref(activated))
        return {"hidden": activated, "kept": [hidden @ weight * 2]}

    def compiled_call(function, *args):
        return function(*args)

    call = partial(_call_keeping_saved_tensors, compiled_call) if offloading else compiled_call
    with torch.no_grad():
        output = _with_gradients_detached(call, layer, torch.randn(2, 4))
    assert grad_enabled == [True]
    assert output["hidden"].grad_fn is None and output["kept"][0].grad_fn is None
    assert not output["hidden"].requires_grad
    gc.collect()
    assert activations[0]() is None, "the first pass's graph outlived the layer"


def test_flex_block_masks_compile_once_per_mask_type_for_every_length(monkeypatch):
    """GPT-OSS's flex attention masks, as transformers asks for them (`create_block_mask(..., _compile=True)` in
    masking_utils), for packed rows of three lengths: one graph per mask type (sliding and full), not one for the
    first length and another when it changes; each mask equal to the uncompiled one. Compiled by aot_eager (no C++
    build: 3 s instead of 40)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers import masking_utils

    from finetune.patches import block_masks_compiled_for_every_length

    monkeypatch.setattr(masking_utils, "create_block_mask", create_block_mask)
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="aot_eager"))

    def packed_mask(length: int, window: int | None):
        documents = torch.zeros(1, length, dtype=torch.long)
        documents[0, length // 3:], documents[0, 2 * length // 3:] = 1, 2
        within = masking_utils.sliding_window_causal_mask_function(window) if window else \
            masking_utils.causal_mask_function
        return masking_utils.and_masks(within, masking_utils.packed_sequence_mask_function(documents))

    block_masks_compiled_for_every_length()
    torch._dynamo.reset()
    counters.clear()
    try:
        for length in (200, 333, 520):
            for window in (None, 64):
                mask = masking_utils.create_block_mask(mask_mod=packed_mask(length, window), B=1, H=None,
                                                       Q_LEN=length, KV_LEN=length, device="cpu", _compile=True)
                expected = create_block_mask(packed_mask(length, window), 1, None, length, length, device="cpu")
                assert torch.equal(mask.to_dense(), expected.to_dense()), (length, window)
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
