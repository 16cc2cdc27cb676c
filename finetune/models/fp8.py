"""FP8 training (`fp8: true`): the decoder layers' linear layers compute in float8 through torchao's `Float8Linear`
(dynamic tensorwise scaling: one scale per tensor, the fastest of torchao's recipes on an H200 at 1B and 3B), while the
LM head, the embeddings and the norms stay in bf16. The weights themselves stay bf16 parameters (only the matmuls'
operands are cast, each step), so the optimizer, checkpoints and the saved model are those of a bf16 run.

With LoRA the frozen base layers compute in float8 and the adapters in bf16 (peft wraps the Float8Linear like any
linear layer). Float8Linear's backward computes a weight gradient even for a frozen weight, but compiled (which `fp8`
requires) the unused gradient's matmul is dropped from the backward graph. QLoRA is refused: its 4-bit layers
subclass nn.Linear, and the conversion would swap them for float8 layers that cannot read packed 4-bit weights.

The switch is a recipe key rather than accelerate's own FP8 path (`mixed_precision: fp8` with torchao as backend):
that path lives in the accelerate config file, so FP8 would need one file per strategy, and the Trainer overrides it
with `mixed_precision=bf16` whenever the recipe says `bf16: true`; on a GPU without float8 it falls back to fp16 with
a warning instead of stopping; and it leaves the first linear layer in bf16 and wraps FSDP2's weights in float8
all-gather tensors, neither of which a Trainer-built Accelerator lets a recipe change.
"""

import torch

from finetune.errors import UserError

# Float8 tensor cores: Ada Lovelace (L4, L40S, RTX 40xx: 8.9) and Hopper (H100, H200: 9.0) onwards; torchao's float8
# matmul (torch._scaled_mm) needs them. A100 (8.0), A10 (8.6) and older have none.
FLOAT8_CAPABILITY = (8, 9)


SCALING = "tensorwise"


INSTALL = 'pip install -e ".[fp8]"'


def hardware_problem() -> str | None:
    """Why this machine cannot train in float8, or None when its GPU can."""
    if not torch.cuda.is_available():
        return "this machine has no GPU"
    capability = torch.cuda.get_device_capability()
    if capability < FLOAT8_CAPABILITY:
        return f"the {torch.cuda.get_device_name()} here is compute capability {capability[0]}.{capability[1]}"
    return None


def check(run, source: str) -> None:
    """Refuse `fp8: true` where it cannot run or would not pay, before any model is loaded."""
    if not run.finetune.fp8:
        return
    if run.model.load_in_4bit or run.model.load_in_8bit:
        raise UserError(f"{source}: `fp8: true` cannot train quantized base weights (`load_in_4bit`/`load_in_8bit`, "
                        f"QLoRA); remove one of the two.")
    if run.launch.strategy.startswith("zero"):
        raise UserError(f"{run.launch.config_file}: `fp8: true` trains under DDP or FSDP2, not DeepSpeed; launch "
                        f"with accelerate_configs/ddp.yaml or fsdp.yaml instead.")
    problem = hardware_problem()
    if problem:
        raise UserError(f"{source}: `fp8: true` needs a GPU with float8 tensor cores (compute capability 8.9 or "
                        f"higher: L4, L40S, H100, H200) but {problem}; remove `fp8: true` to train in bf16.")
    if not run.training.torch_compile:
        raise UserError(f"{source}: `fp8: true` without `torch_compile: true` is slower than bf16 (the float8 casts "
                        f"are fused into the matmuls' neighbours only when compiled); add `torch_compile: true`.")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError(f"{source}: `fp8: true` trains through torchao, which is not installed; install it with "
                        f"`{INSTALL}` or remove `fp8: true`.") from None


def convert_linear_layers(model: torch.nn.Module) -> list[str]:
    """Swap every linear layer but the LM head for torchao's Float8Linear, in place; returns the swapped names.
    Layers whose sizes are not multiples of 16 stay as they are: the float8 matmul cannot take them."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lm_head = model.get_output_embeddings()
    converted = []

    def in_float8(linear: torch.nn.Linear, name: str) -> bool:
        wanted = linear is not lm_head and linear.in_features % 16 == 0 and linear.out_features % 16 == 0
        if wanted:
            converted.append(name)
        return wanted

    convert_to_float8_training(model, module_filter_fn=in_float8,
                               config=Float8LinearConfig.from_recipe_name(SCALING))
    return converted
