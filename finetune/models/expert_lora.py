"""LoRA on GPT-OSS's 3-D expert weights without ever forming W + B·A.

peft adapts an expert stack W [experts, in, out] through `target_parameters`: its ParamWrapper adds the product of
the two low-rank factors to the whole stack on every forward and autograd then computes the full gradient of that
sum, which LoRA exists to avoid (1.6 GB per layer on GPT-OSS-20B, and a dense weight gradient per expert). Here the
tokens routed to expert e go through y = x·W_e + s·(x·L_e)·R_e, three grouped GEMMs over all experts at once
(`torch._grouped_mm`, the kernel behind transformers' `experts_implementation="grouped_mm"`), and the backward
computes the input and the two factors' gradients, and nothing for the frozen W.

L and R are peft's own lora_A and lora_B, read in the orientation of peft's `ParamWrapper.get_delta_weight`, so the
adapter is peft's: same keys, same shapes, same W + s·L·R when merged. `install` swaps the class of each outermost
ParamWrapper around a GPT-OSS experts module for `GroupedExpertsLora`, whose forward calls this path and otherwise
(adapters disabled or merged, several adapters, expert parallelism) peft's own.
"""

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper

from finetune.errors import say

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _loop_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    output = x.new_zeros(x.shape[0], weight.shape[-1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[expert], out=output[start:end])
        start = end
    return output


def _loop_mm_fake(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[-1])


def _loop_mm_per_expert(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    output = left.new_zeros(offsets.shape[0], left.shape[-1], right.shape[-1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(left[start:end].t(), right[start:end], out=output[expert])
        start = end
    return output


def _loop_mm_per_expert_fake(left, right, offsets):
    return left.new_empty(offsets.shape[0], left.shape[-1], right.shape[-1])


def _has_grouped_mm_layout(matrix: torch.Tensor) -> bool:
    return matrix.stride(-1) == 1 or matrix.stride(-2) == 1


def _grouped_mm_checked(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm needs each matrix row- or column-major. Inductor (torch 2.11) may hand it a LoRA factor in the
    # layout of the permute that made it, "contiguous()" notwithstanding (H200: "Invalid strides/sizes, got
    # [1, 32, 512]"); inside this operator the strides are real, and only such a small factor is copied.
    x = x if _has_grouped_mm_layout(x) else x.contiguous()
    weight = weight if _has_grouped_mm_layout(weight) else weight.contiguous()
    return torch._grouped_mm(x, weight, offs=offsets)


def _grouped_mm_checked_fake(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[-1])


def _grouped_mm_per_expert_checked(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    left = left if left.stride(-1) == 1 else left.contiguous()  # left.t() must be column-major
    right = right if _has_grouped_mm_layout(right) else right.contiguous()
    return torch._grouped_mm(left.t(), right, offs=offsets)


def _grouped_mm_per_expert_checked_fake(left, right, offsets):
    return left.new_empty(offsets.shape[0], left.shape[-1], right.shape[-1])


# Custom operators, so that torch.compile keeps the data-dependent loop out of its graphs instead of breaking them,
# and calls the grouped GEMM with the operands' real strides.
torch.library.custom_op("finetune::grouped_mm", _grouped_mm_checked, mutates_args=(),
                        schema="(Tensor x, Tensor weight, Tensor offsets) -> Tensor")


torch.library.register_fake("finetune::grouped_mm", _grouped_mm_checked_fake)


torch.library.custom_op("finetune::grouped_mm_per_expert", _grouped_mm_per_expert_checked, mutates_args=(),
                        schema="(Tensor left, Tensor right, Tensor offsets) -> Tensor")


torch.library.register_fake("finetune::grouped_mm_per_expert", _grouped_mm_per_expert_checked_fake)


torch.library.custom_op("finetune::loop_mm", _loop_mm, mutates_args=(),
                        schema="(Tensor x, Tensor weight, Tensor offsets) -> Tensor")


torch.library.register_fake("finetune::loop_mm", _loop_mm_fake)


torch.library.custom_op(
    "finetune::loop_mm_per_expert", _loop_mm_per_expert, mutates_args=(),
    schema="(Tensor left, Tensor right, Tensor offsets) -> Tensor",
)


torch.library.register_fake("finetune::loop_mm_per_expert", _loop_mm_per_expert_fake)


TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def bf16_tensor_cores(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 8.0 or more."""
    # get_device_properties, not get_device_capability: dynamo folds the former to a constant
    return torch.cuda.get_device_properties(device).major >= 8


def grouped_mm_runs(reference: torch.Tensor, *widths: int) -> bool:
    """Whether torch._grouped_mm takes these operands: bf16 on a CUDA GPU of compute capability 8.0 or more, or a CPU
    with torch >= 2.10, and every row 16-byte aligned (the kernel's requirement on strides)."""
    if not hasattr(torch, "_grouped_mm") or any(width * reference.element_size() % 16 for width in widths):
        return False
    if reference.device.type == "cuda":
        return reference.dtype == torch.bfloat16 and bf16_tensor_cores(reference.device)
    if reference.device.type == "cpu":
        # inductor lowers grouped_mm for bf16 only
        return TORCH_VERSION >= (2, 10) and (reference.dtype == torch.bfloat16 or not torch.compiler.is_compiling())
    return False


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert, offsets[e] = where expert e's rows end: row i of expert e times weight[e]."""
    if grouped_mm_runs(x, x.shape[-1], weight.shape[-2], weight.shape[-1]):
        return torch.ops.finetune.grouped_mm(x, weight, offsets)
    return torch.ops.finetune.loop_mm(x, weight, offsets)


def grouped_mm_per_expert(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[experts, left width, right width]: for each expert, its rows of `left` transposed times its rows of `right`
    (the weight-gradient shape); experts with no rows get zeros."""
    if grouped_mm_runs(left, left.shape[-1], right.shape[-1]):  # left.t() is column-major: its stride is a row's
        product = torch.ops.finetune.grouped_mm_per_expert(left, right, offsets)
        empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
        return product.masked_fill(empty[:, None, None], 0)  # the kernel need not write an empty expert's block
    return torch.ops.finetune.loop_mm_per_expert(left, right, offsets)


class GroupedLoraMatmul(torch.autograd.Function):
    """y = x·W_e + s·(x·L_e)·R_e for the rows of each expert e; gradients for x, L and R, none for the frozen W.

    x [rows, in] sorted by expert, W [experts, in, out], L [experts, in, r], R [experts, r, out]; L and R may be None
    (an expert weight that is not adapted). With `scales`, W is given as MXFP4 blocks (`weight`) and scales and is
    dequantized inside each frozen GEMM, forward and backward (finetune/models/mxfp4_experts.py)."""

    @staticmethod
    def forward(ctx, x, weight, lora_in, lora_out, offsets, scaling, scales=None):
        output = frozen_mm(x, weight, scales, offsets, transposed=False)
        projected = None
        if lora_in is not None:
            projected = grouped_mm(x, lora_in, offsets)
            output = output + scaling * grouped_mm(projected, lora_out, offsets)
        ctx.save_for_backward(x, weight, lora_in, lora_out, offsets, projected, scales)
        ctx.scaling = scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, lora_in, lora_out, offsets, projected, scales = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_x = grad_in = grad_out = None
        grad_projected = None
        if lora_in is not None:
            grad_projected = ctx.scaling * grouped_mm(grad_output, lora_out.transpose(-2, -1), offsets)
            if ctx.needs_input_grad[3]:
                grad_out = ctx.scaling * grouped_mm_per_expert(projected, grad_output, offsets)
            if ctx.needs_input_grad[2]:
                grad_in = grouped_mm_per_expert(x, grad_projected, offsets)
        if ctx.needs_input_grad[0]:
            grad_x = frozen_mm(grad_output, weight, scales, offsets, transposed=True)
            if grad_projected is not None:
                grad_x = grad_x + grouped_mm(grad_projected, lora_in.transpose(-2, -1), offsets)
        return grad_x, None, grad_in, grad_out, None, None, None


def frozen_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, offsets: torch.Tensor,
              transposed: bool) -> torch.Tensor:
    """x times the frozen W [experts, in, out] (or its transpose): dense, or MXFP4 blocks with their scales."""
    if scales is None:
        return grouped_mm(x, weight.transpose(-2, -1) if transposed else weight, offsets)
    return torch.ops.finetune.mxfp4_grouped_mm(x, weight, scales, offsets, transposed)


def lora_factors(wrapper: ParamWrapper, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(L [experts, in, r], R [experts, r, out], s) with s·L_e·R_e = peft's delta weight of expert e
    (`ParamWrapper.get_delta_weight`): lora_A's rows are expert-major (e·r + k), lora_B's columns rank-major
    (k·E + e)."""
    experts = wrapper.num_experts
    weight_a = wrapper.lora_A[adapter].weight
    weight_b = wrapper.lora_B[adapter].weight
    weight_a = weight_a.reshape(experts, -1, weight_a.shape[-1])  # [experts, r, in_features]
    weight_b = weight_b.reshape(weight_b.shape[0], -1, experts).permute(2, 0, 1)  # [experts, out_features, r]
    if wrapper._did_swap_in_out_features:  # the stack is stored [experts, out_features, in_features]
        lora_in, lora_out = weight_b, weight_a
    else:
        lora_in, lora_out = weight_a.transpose(-2, -1), weight_b.transpose(-2, -1)
    lora_in, lora_out = lora_in.to(dtype), lora_out.to(dtype)
    # torch._grouped_mm needs rows of a multiple of 16 bytes: a rank such as 3 would fall back to a Python loop over
    # the experts (GPT-OSS-120B at r3 on an H100: 2,000 small GEMMs a layer, 6x slower). Zero columns of L and zero
    # rows of R add exact zeros to the product; autograd drops their gradients.
    padding = -lora_in.shape[-1] % (16 // lora_in.element_size())
    if padding:
        lora_in, lora_out = F.pad(lora_in, (0, padding)), F.pad(lora_out, (0, 0, 0, padding))
    return lora_in.contiguous(), lora_out.contiguous(), wrapper.scaling[adapter]


def experts_forward(experts, hidden_states, router_indices, routing_weights, adapters: dict) -> torch.Tensor:
    """GPT-OSS's experts as transformers' grouped_mm implementation computes them (tokens sorted by expert, biases,
    the experts' own gate, routing weights, a deterministic sum over the top-k), with the two expert GEMMs replaced by
    GroupedLoraMatmul. `adapters`: expert weight name -> (L, R, s), for the weights that are adapted."""
    num_experts = experts.num_experts
    top_k = router_indices.shape[-1]
    num_tokens, hidden = hidden_states.shape
    expert_ids, order = torch.sort(router_indices.reshape(-1))
    x = hidden_states[order // top_k]
    sample_weights = routing_weights.reshape(-1)[order]
    counts = torch.histc(expert_ids.float() if x.device.type == "cpu" else expert_ids.int(), bins=num_experts,
                         min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    def project(inputs, name):
        dtype = getattr(experts, name).dtype
        # MXFP4 experts (finetune/models/mxfp4_experts.py) hold blocks and scales beside a placeholder of the compute dtype
        weight, scales = (getattr(experts, f"{name}_blocks"), getattr(experts, f"{name}_scales")) \
            if hasattr(experts, f"{name}_blocks") else (getattr(experts, name), None)
        lora_in, lora_out, scaling = adapters.get(name, (None, None, 1.0))
        output = GroupedLoraMatmul.apply(inputs.to(dtype), weight, lora_in, lora_out, offsets, scaling, scales)
        return output + getattr(experts, f"{name}_bias")[expert_ids] if experts.has_bias else output

    gated = experts._apply_gate(project(x, "gate_up_proj"))  # transformers' private gate: see finetune/patches.py
    weighted = project(gated, "down_proj") * sample_weights.unsqueeze(-1)
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _wrapper_chain(wrapper: ParamWrapper) -> tuple[dict, torch.nn.Module]:
    """The nested ParamWrappers (one per adapted parameter) by parameter name, and the experts module they wrap."""
    chain, module = {}, wrapper
    while isinstance(module, ParamWrapper):
        chain[module.parameter_name] = module
        module = module.base_layer
    return chain, module


def _fits(wrapper: ParamWrapper) -> bool:
    chain, experts = _wrapper_chain(wrapper)
    return (
        set(chain) <= set(EXPERT_WEIGHTS)
        and all(hasattr(experts, name) for name in EXPERT_WEIGHTS)
        and getattr(experts, "is_transposed", False)  # x @ W[e], W [experts, in, out]: GPT-OSS's layout
        and hasattr(experts, "_apply_gate")
        and not any(getattr(experts, name).requires_grad for name in EXPERT_WEIGHTS)
    )


class GroupedExpertsLora(ParamWrapper):
    """peft's outermost ParamWrapper around a GPT-OSS experts module, computing the adapted experts with grouped
    GEMMs (`experts_forward`) instead of parametrizing each expert weight with W + B·A. Same parameters and state
    dict as the ParamWrapper it was; merge, unload and saving stay peft's."""

    def forward(self, hidden_states, *args, **kwargs):
        chain, experts = _wrapper_chain(self)
        active = self.active_adapters
        if (
            self.disable_adapters
            or any(wrapper.merged for wrapper in chain.values())
            or len(active) != 1
            or kwargs
            or getattr(experts, "_is_expert_parallel", False)
        ):
            return super().forward(hidden_states, *args, **kwargs)
        router_indices, routing_weights = args
        dtype = getattr(experts, EXPERT_WEIGHTS[0]).dtype
        adapters = {
            name: lora_factors(wrapper, active[0], dtype)
            for name, wrapper in chain.items() if active[0] in wrapper.lora_A
        }
        return experts_forward(experts, hidden_states, router_indices, routing_weights, adapters)


def install(model: torch.nn.Module) -> int:
    """Switch every fitting expert LoRA of a peft model to the grouped path; returns how many experts modules."""
    wrappers = [module for module in model.modules() if isinstance(module, ParamWrapper)]
    inner = {id(wrapper.base_layer) for wrapper in wrappers}
    outermost = [wrapper for wrapper in wrappers if id(wrapper) not in inner]
    installed = 0
    for module in outermost:
        if not _fits(module):
            continue
        module.__class__ = GroupedExpertsLora
        installed += 1
    return installed


def use_kernel(trainer, kernel: str) -> int:
    """After the trainer has built the peft model: the grouped path for its expert LoRA unless `kernel` is 'peft'.
    Logs how many experts modules take it, the line that shows which path a run took."""
    installed = install(trainer.model) if kernel == "grouped" else 0
    if installed and trainer.accelerator.is_main_process:
        say(f"expert LoRA: grouped GEMMs in {installed} experts modules")
    return installed
