"""The per-GPU peak-memory model: weights, gradients, optimizer states, activations and buffers under each technique
(DDP, ZeRO-2, FSDP2, ZeRO-3, ZeRO-3 offload). The constants and their measurements: docs/planner.md."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.families import FAMILIES, dequantized_chunk_experts, fused_gemm_takes
from finetune.planner.architecture import (
    BYTES,
    Architecture,
    attention_linears,
    embedding_params,
    expert_weight_values,
    layer_params,
    linear_params_per_layer,
    total_params,
)
from finetune.planner.setup import Setup

GIB = 1024**3


# ---- Calibration constants (each named for what it stands for; docs/planner.md shows the measurements) -------------
SAFETY_MARGIN = 0.90  # a plan fits when its per-GPU peak is at most 90% of the card: allocator spikes, longer rows


FRAGMENTATION = 1.04  # max_memory_reserved / max_memory_allocated of PyTorch's caching allocator (measured 1.00-1.14)


CUDA_CONTEXT_GIB = 0.6  # CUDA context + cuBLAS/cuDNN workspaces: outside the allocator, per process


NCCL_GIB = 0.75  # NCCL communicator buffers when more than one process talks


CHUNKED_LOGPROB_TOKENS = 4096  # TRL's fused LM head: tokens per tile (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE)


CHUNKED_LOGPROB_VOCAB = 32768  # ... and vocabulary columns per tile (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)


OFFLOAD_STASH_TENSORS = 5  # TRL's activation offloading keeps this many tensors on the GPU while they copy to the CPU


DS_BUCKET_ELEMENTS_PER_H2 = 1.0  # accelerate's "auto" reduce_bucket_size = hidden^2 (ZeRO), in elements


DS_PREFETCH_PER_H2 = 0.9  # accelerate's "auto" stage3_prefetch_bucket_size = 0.9 * hidden^2


MXFP4_BYTES_PER_VALUE = 0.5 + 1 / 32  # two FP4 values per byte, and one E8M0 scale byte per block of 32 values


# ---- Trainable parameters ----------------------------------------------------------------------------------------
def lora_targets(a: Architecture, s: Setup) -> dict[str, tuple[int, int]]:
    """The adapted nn.Linear modules of one layer: name -> (in_features, out_features)."""
    shapes = attention_linears(a) | FAMILIES[a.family].mlp_linears(a)
    targets = s.lora_target_modules or ("q_proj", "v_proj")  # peft's default for Llama-like models
    if "all-linear" in targets:
        return shapes
    return {n: shapes[n] for n in shapes if any(t == n or t.endswith("." + n) for t in targets)}


def lora_expert_targets(a: Architecture, s: Setup) -> dict[str, tuple[int, int]]:
    """Adapted 3-D expert parameters (peft target_parameters): name -> (in, out) of one expert."""
    shapes = FAMILIES[a.family].expert_weights(a)
    return {n: shapes[n] for n in shapes if any(t.endswith(n) for t in s.lora_target_parameters)}


def trainable_params(a: Architecture, s: Setup) -> int:
    if s.method == "full":
        return total_params(a)
    r = s.lora_r
    per_layer = sum(r * (i + o) for i, o in lora_targets(a, s).values())
    per_layer += sum(a.experts * r * (i + o) for i, o in lora_expert_targets(a, s).values())
    return a.layers * per_layer


def trainable_bytes(s: Setup, technique: str) -> int:
    """Storage dtype of the trained parameters (and so of their gradients and Adam states)."""
    if s.method == "full":
        # FSDP2 in accelerate upcasts trainable low-precision parameters to fp32 for mixed precision.
        return 4 if technique == "fsdp2" else BYTES.get(s.dtype, 4)
    if s.method == "qlora" or technique in ("zero3", "zero3_offload"):
        return 2  # TRL casts QLoRA adapters to bf16; with ZeRO-3 it asks peft not to upcast them
    return 4  # peft upcasts LoRA adapters to fp32 (autocast_adapter_dtype=True)


def mxfp4_resident(a: Architecture, s: Setup) -> bool:
    """`dequantize_mxfp4: false` on an MXFP4 checkpoint: the experts stay packed on the GPU (finetune/models/
    mxfp4_experts.py), in one process only (finetune/checks/recipe.py's check_mxfp4).

    What grows with the micro-batch's tokens on this path (the 120B recipe checkpoints every layer), in bytes a token
    at GPT-OSS-120B (hidden 2880, expert width 2880, 4 of 128 experts active, 36 layers), and where it is counted:
    - each layer's input, kept by checkpointing: 36 x 5,760 (activation_bytes);
    - the one layer recomputed in the backward, 284,240 (layer_activation_bytes_per_token): attention 64,776; per
      active expert the routed input, gate_up output and the SwiGLU's intermediates, 4 x (5h + 8i) = 149,760 (fitted
      to GPT-OSS-20B); what GroupedLoraMatmul saves for the adapters, per active expert and adapted GEMM its input and
      rank-r projection, 46,128; the experts' weighted sum, 8h = 23,040; the router's fp32 logits, 512; the
      attention adapters' rank-r outputs, 24;
    - that layer's backward transients, 126,720 (activation_bytes);
    - every layer's router logits for the load-balancing loss, 18,432 (router_logits_bytes);
    - at more than 256 routed rows an expert, the dequantized chunk's GEMM output, 5,760, beside the chunk itself
      (0.99 GiB whatever the tokens; mxfp4_dequantized_bytes); at 256 or fewer (the recipe's 4 rows: 256) neither;
    - TRL's fused LM head (loss_buffer_bytes): a tile of at most 4,096 tokens x 32,768 vocabulary columns (0.25 GiB)
      and the hidden state's gradient, 17,280; never the (tokens x vocabulary) logits."""
    return a.mxfp4_experts and not s.dequantize_mxfp4


def frozen_weight_bytes(a: Architecture, s: Setup) -> float:
    """Storage of the base model's weights. QLoRA: nf4 packs two weights per byte, plus one fp32 absmax per 64.
    MXFP4 resident: the experts' weights as the checkpoint stores them (their biases and the rest in the dtype)."""
    params = total_params(a)
    dtype_bytes = BYTES.get(s.dtype, 4)
    if mxfp4_resident(a, s):
        packed = expert_weight_values(a)
        return packed * MXFP4_BYTES_PER_VALUE + (params - packed) * dtype_bytes
    if s.method != "qlora":
        return params * dtype_bytes
    quantized = a.layers * linear_params_per_layer(a)
    return quantized * (0.5 + 4 / 64) + (params - quantized) * dtype_bytes


def optimizer_bytes_per_param(s: Setup, param_bytes: int) -> float:
    """Adam keeps two states (exp_avg, exp_avg_sq) in the parameter's dtype; 8-bit Adam keeps one byte each."""
    name = s.optim.lower()
    if "8bit" in name:
        return 2 + 8 / 2048  # + block-wise fp32 absmax
    if name.startswith("adafactor"):
        return 0.1 * param_bytes  # factored second moment: rows + columns, small
    if name.startswith("sgd"):
        return 0
    return 2 * param_bytes


# ---- Activations ------------------------------------------------------------------------------------------------
# torch.compile'd MoE layers: inductor recomputes the clamped SwiGLU's elementwise intermediates in backward instead of
# saving them. Fitted to one H200 measurement (GPT-OSS-20B attention LoRA, batch 4 x 2048, no checkpointing, compiled:
# 60.6 GiB peak against 83.1 GiB planned for eager, which eager measured at 84.2; docs/benchmarks.md).
COMPILED_EXPERT_SAVED_FRACTION = 0.18


# `fp8: true` (torchao's Float8Linear in compiled layers): the linear layers save float8 copies of their inputs and
# inductor recomputes the elementwise work around them, so a layer saves this fraction of what the compiled bf16 layer
# without liger is counted at. Fitted to one H200 measurement (Llama-3.2-1B full, batch 16 x 2048: 34.5 GiB); batch 8
# (21.5 GiB) and Llama-3.2-3B at batch 4 with 4 accumulation steps (39.8 GiB) are the checks (docs/benchmarks.md).
# Full fine-tuning only: the float8 copies replace inputs kept for weight gradients, which LoRA's frozen base layers
# never keep (Llama-3.2-3B LoRA at 8 x 2048 peaked at 48.7 GiB in fp8, 49.0 in bf16).
COMPILED_FP8_SAVED_FRACTION = 0.475


def layer_activation_bytes_per_token(a: Architecture, s: Setup) -> float:
    """Bytes a decoder layer saves for backward, per token, without checkpointing.

    Dense (Llama), counted with saved-tensor hooks on CPU and confirmed on the H200 within 0.2%:
    8*i (gate, up, silu(gate), silu*up in bf16) + 16*h + 4*attn (the RMSNorms keep fp32 copies of their inputs; q, attention
    output, residuals) + 4*kv (k, v) + 4*heads (fp32 logsumexp of the fused attention) + 8 (two fp32 rstd).
    Liger's SwiGLU recomputes silu(gate) and silu*up in backward: 4*i fewer.
    Frozen base (LoRA, QLoRA): the inputs kept only for weight gradients go (down_proj's input, the norms' and
    o_proj's inputs: 2*i + 8*h, measured); each adapted module with lora_dropout > 0 keeps its dropout output (bf16
    under autocast) and a bool mask: 3 bytes per input feature. With dropout 0 the adapter reads the same tensor.
    MoE (GPT-OSS): the attention part as above with its wider attention, then per *active* expert and token the
    routed input, gate_up output and the clamped SwiGLU's intermediates (5*h + 8*i, fitted to GPT-OSS-20B), the
    router's fp32 logits and the weighted sum.
    """
    h, i = a.hidden, a.intermediate
    attention = 16 * h + 4 * a.attn_dim + 4 * a.kv_dim + 4 * a.heads + 8
    if a.is_moe:
        experts = a.experts_per_token * (5 * h + 8 * i)
        mlp = experts * (COMPILED_EXPERT_SAVED_FRACTION if s.torch_compile else 1) + 4 * a.experts + 8 * h
    else:
        mlp = (4 if s.use_liger_kernel else 8) * i
    lora = 0.0
    if s.method != "full":
        if not a.is_moe:
            lora -= 2 * i + 8 * h
        for in_features, _ in lora_targets(a, s).values():
            if s.lora_dropout > 0:
                lora += in_features * 3
            lora += s.lora_r * 2  # lora_A's output
        if a.is_moe and s.expert_lora_kernel == "grouped":
            # finetune/models/expert_lora.py keeps each adapted expert GEMM's input (in expert order, one row per active
            # expert) and its rank-r projection for the factors' gradients: 8.4 GiB on GPT-OSS-20B at 4 x 2048
            lora += a.experts_per_token * sum(2 * in_features + 2 * s.lora_r
                                              for in_features, _ in lora_expert_targets(a, s).values())
    if s.attn_implementation == "eager":
        attention += 2 * a.heads * s.max_length * 2  # softmax probabilities (and their bf16 copy), per query
    if s.fp8 and not a.is_moe and s.method == "full":
        return (attention + 8 * i) * COMPILED_FP8_SAVED_FRACTION + lora
    return attention + mlp + lora


def adapted_expert_weight_bytes(a: Architecture, s: Setup) -> float:
    """peft's ParamWrapper adds B@A to a 3-D expert weight in the forward: the merged weight is saved per layer.
    The grouped path (finetune/models/expert_lora.py) never forms it."""
    if s.expert_lora_kernel == "grouped":
        return 0.0
    return sum(a.experts * i * o * 2 for i, o in lora_expert_targets(a, s).values())


def mxfp4_dequantized_bytes(a: Architecture, s: Setup) -> float:
    """MXFP4 resident: what finetune/models/mxfp4_experts.py's grouped GEMM holds beside the activations, in the
    forward, the recompute and the backward, one projection of one layer at a time, freed after it:
    - one chunk of experts dequantized: as many whole experts of the projection as the code takes together
      (families.dequantized_chunk_experts, which both call) (120B: 32 experts of gate_up, 2880 x 5760, or
      64 of down, 0.99 GiB in bf16 either way, where the whole projection is 3.96 GiB);
    - with checkpointing and whole projections, a layer's projections kept from its recomputation for its input
      gradients (DequantizePrefetch): the other projection beside the one computed; nothing dequantized ahead
      (families.DEQUANTIZE_AHEAD is false: where it is not, the next chunk comes beside, and this count is short);
    - when the projection takes more than one chunk, the chunk's GEMM output before it is copied into the projection's
      output: its experts' share of the routed rows (tokens x experts_per_token x chunk / experts, routing counted
      even) times the wider of the projection's widths (forward: out, backward: in).
    Nothing where the fused kernel takes the GEMM (families.fused_gemm_takes: few routed rows an expert; torch's CUDA
    wheels bring the triton it needs): it decodes the weights inside its tiles."""
    if not mxfp4_resident(a, s) or fused_gemm_takes(s.tokens * a.experts_per_token, a.experts):
        return 0.0
    dtype_bytes = BYTES.get(s.dtype, 4)
    chunks, outputs = [], []
    for in_features, out_features in FAMILIES[a.family].expert_weights(a).values():
        expert_bytes = in_features * out_features * dtype_bytes
        chunk = dequantized_chunk_experts(expert_bytes, a.experts)
        chunks.append(chunk * expert_bytes)
        if chunk < a.experts:
            rows = s.tokens * a.experts_per_token * chunk / a.experts
            outputs.append(rows * max(in_features, out_features) * dtype_bytes)
    largest, *others = sorted(chunks, reverse=True)
    beside = others[0] if others and not outputs and s.gradient_checkpointing else 0.0
    return largest + beside + max(outputs, default=0.0)


def router_logits_bytes(a: Architecture, s: Setup) -> float:
    """MoE with TRL's load-balancing loss (on for GPT-OSS: its config's router_aux_loss_coef is 0.9; off when the recipe
    sets 0): the model returns every layer's router logits (tokens x experts, in the dtype) to the loss, and the loss
    (transformers' load_balancing_loss_func) saves each layer's softmax of them, as large, for its backward; their
    gradients take the same room from the start of the backward until each layer's turn. Kept through the whole step,
    whatever the checkpointing: 36 x 128 x 2 x 2 bytes a token at 120B (0.14 GiB at 4 x 2,048 tokens)."""
    if not (a.is_moe and s.router_aux_loss):
        return 0.0
    return a.layers * s.tokens * a.experts * BYTES.get(s.dtype, 4) * 2


def activation_bytes(a: Architecture, s: Setup) -> dict[str, float]:
    """Saved for backward at the end of the forward, one layer's recomputation (checkpointing), backward transients,
    and what activation offloading keeps in pinned CPU memory instead of on the GPU."""
    tokens = s.tokens
    per_layer = layer_activation_bytes_per_token(a, s) * tokens + adapted_expert_weight_bytes(a, s)
    outside = tokens * (6 * a.hidden + 8) + router_logits_bytes(a, s)  # embedding output, final norm's fp32 copy,
    # hidden into the LM head; the routers' logits for the load-balancing loss
    layer_input = tokens * 2 * a.hidden  # bf16
    if s.gradient_checkpointing:
        # Each layer keeps only its input; in backward one layer at a time is recomputed. Offloaded, the inputs wait in
        # CPU memory: the GPU holds the last few still copying out (TRL's forward stash; the backward brings one back).
        inputs = a.layers * layer_input
        offloaded = inputs - min(a.layers, OFFLOAD_STASH_TENSORS) * layer_input if s.activation_offloading else 0.0
        saved, recompute = inputs - offloaded + outside, per_layer
    else:
        # `activation_memory_budget` below 1 lets inductor save at most that fraction of a compiled layer's default
        # (it recomputes the cheapest of the rest in backward); counted at the cap. Llama-3.2-3B LoRA at 8 x 2048 on
        # the H200: 0.8 measured 34.7 GiB (bf16) and 34.4 (fp8) against 49.0 at 1, 0.6 measured 32.0.
        if s.torch_compile:
            per_layer *= s.activation_memory_budget
        # Offloaded without checkpointing, every layer's activations go to the CPU and come back one layer at a time.
        inputs, recompute = 0.0, 0.0
        offloaded = (a.layers - 1) * per_layer if s.activation_offloading else 0.0
        saved = a.layers * per_layer - offloaded + outside
    # Backward through one layer holds the gradients of its activations: i-wide ones around the MLP (per active
    # expert for MoE) and h-wide ones, some fp32, around the norms and attention (measured ~26-108 KB/token on Llama).
    width = a.experts_per_token * a.intermediate if a.is_moe else a.intermediate
    transient = tokens * (8 * width + 12 * a.hidden)
    return {"saved": saved, "checkpoint_inputs": inputs, "recompute": recompute, "backward_transient": transient,
            "offloaded_to_cpu": offloaded}


def loss_buffer_bytes(a: Architecture, s: Setup, lm_head_trainable: bool) -> float:
    """TRL's fused LM head never builds (tokens x vocab) logits: one bf16 tile of 4096 x 32768, and in backward
    fp32 accumulators for the hidden-state gradient and, when the head trains, its weight gradient."""
    n = min(s.tokens, CHUNKED_LOGPROB_TOKENS)
    tile = n * min(a.vocab, CHUNKED_LOGPROB_VOCAB) * 2
    grad_hidden = s.tokens * a.hidden * (4 + 2)  # fp32 accumulator, then its bf16 copy
    grad_weight = a.vocab * a.hidden * (4 + 2) if lm_head_trainable else 0
    return tile + grad_hidden + grad_weight


# ---- Techniques --------------------------------------------------------------------------------------------------
TECHNIQUES = ("ddp", "zero2", "fsdp2", "zero3", "zero3_offload")


CONFIG_FILES = {
    "ddp": "accelerate_configs/ddp.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "fsdp2": "accelerate_configs/fsdp.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "zero3_offload": "accelerate_configs/zero3_offload.yaml",
}


LABELS = {"ddp": "DDP", "zero2": "ZeRO-2", "fsdp2": "FSDP2", "zero3": "ZeRO-3", "zero3_offload": "ZeRO-3 offload"}


@dataclass
class Estimate:
    technique: str
    parts: dict[str, float]  # bytes
    allocated: float
    reserved: float
    per_gpu: float
    supported: bool = True
    note: str = ""
    host: float = 0.0  # bytes of host memory per node the technique needs beyond a checkpoint shard

    @property
    def per_gpu_gib(self) -> float:
        return self.per_gpu / GIB


@dataclass(frozen=True)
class Sizes:
    """What every technique's estimate starts from, in parameters and bytes."""

    world: int  # GPUs in total
    parameters: int
    trainable: int
    full: bool
    trainable_bytes: int  # bytes per trainable parameter as the technique keeps it
    frozen_bytes: float  # the frozen base of a LoRA/QLoRA run
    largest_layer_bytes: float  # one decoder layer gathered in bf16 for compute
    root_unit_bytes: float  # FSDP2's root unit (embeddings, LM head, norm) stays gathered forward and backward
    bucket_bytes: float  # DeepSpeed's "auto" reduce bucket
    prefetch_bytes: float  # DeepSpeed's "auto" stage-3 prefetch bucket


def ddp_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """Every GPU holds the whole model, its gradients and optimizer states; the parts and the gradient bytes."""
    weights = sizes.parameters * sizes.trainable_bytes if sizes.full else (
        sizes.frozen_bytes + sizes.trainable * sizes.trainable_bytes)
    parts = {"weights": weights, "optimizer": sizes.trainable * optimizer_bytes_per_param(setup, sizes.trainable_bytes)}
    gradients = sizes.trainable * sizes.trainable_bytes
    if sizes.world > 1:
        parts["ddp_buckets"] = gradients  # DDP's flat all-reduce buckets: a second copy of the gradients
    return parts, gradients


def zero2_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """DeepSpeed bf16: 16-bit weights everywhere; fp32 master weights + Adam states and fp32 gradients of the rank's
    partition; bf16 gradients reduced through buckets into the partition."""
    parts = {
        "weights": sizes.parameters * 2 if sizes.full else sizes.frozen_bytes + sizes.trainable * 2,
        "optimizer": sizes.trainable * (4 + optimizer_bytes_per_param(setup, 4)) / sizes.world,
        "fp32_grad_partition": sizes.trainable * 4 / sizes.world,
        "buckets": 2 * sizes.bucket_bytes,
    }
    return parts, sizes.trainable * 2 / sizes.world


def fsdp2_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """Weights, gradients and optimizer states sharded; the current and the prefetched layer gathered."""
    sharded = sizes.world > 1
    frozen = 0 if sizes.full else sizes.frozen_bytes
    parts = {
        "weights": (frozen + sizes.trainable * sizes.trainable_bytes) / sizes.world,
        "optimizer": sizes.trainable * optimizer_bytes_per_param(setup, sizes.trainable_bytes) / sizes.world,
        "gathered": (2 * sizes.largest_layer_bytes + sizes.root_unit_bytes) if sharded else 0,
    }
    unsharded_to_reduce = 2 * sizes.largest_layer_bytes if sizes.full and sharded else 0
    return parts, sizes.trainable * sizes.trainable_bytes / sizes.world + unsharded_to_reduce


def zero3_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """ZeRO-2's partitions plus 16-bit weights sharded; layers gathered as they run."""
    weights = sizes.parameters * 2 if sizes.full else sizes.frozen_bytes + sizes.trainable * 2
    parts = {
        "weights": weights / sizes.world,
        "optimizer": sizes.trainable * (4 + optimizer_bytes_per_param(setup, 4)) / sizes.world,
        "fp32_grad_partition": sizes.trainable * 4 / sizes.world,
        "gathered": (2 * sizes.largest_layer_bytes + sizes.prefetch_bytes) if sizes.world > 1 else 0,
        "buckets": 2 * sizes.bucket_bytes,
    }
    return parts, sizes.trainable * 2 / sizes.world


def zero3_offload_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """Weights, fp32 master and Adam states live in CPU memory; the GPU gathers layers as it goes."""
    parts = {
        "gathered": 2 * sizes.largest_layer_bytes + sizes.root_unit_bytes + sizes.prefetch_bytes,
        "buckets": 2 * sizes.bucket_bytes,
    }
    return parts, 2 * sizes.bucket_bytes


TECHNIQUE_MEMORY = {"ddp": ddp_memory, "zero2": zero2_memory, "fsdp2": fsdp2_memory, "zero3": zero3_memory,
                    "zero3_offload": zero3_offload_memory}


def host_bytes(a: Architecture, s: Setup, technique: str, sizes: Sizes, gpus_per_node: int) -> float:
    """Host memory one node needs beyond a checkpoint shard (what loading straight onto each GPU, DDP's and ZeRO-2's
    and ZeRO-3's shard-by-shard partitioning, hold). ZeRO-3 offload keeps its processes' partitions of the 16-bit
    weights, fp32 master weights, Adam states and fp32 gradients there; FSDP2 loads the whole model (an MXFP4
    checkpoint dequantized) on one process per node, which sends the others their shards
    (fsdp_cpu_ram_efficient_loading); activation offloading parks each process's activations in pinned memory."""
    share = gpus_per_node / sizes.world
    if technique == "zero3_offload":
        weights = sizes.parameters * 2 if sizes.full else sizes.frozen_bytes + sizes.trainable * 2
        held = (weights + sizes.trainable * (4 + optimizer_bytes_per_param(s, 4) + 4)) * share
    elif technique == "fsdp2":
        held = sizes.parameters * BYTES.get(s.dtype, 4)
    else:
        held = 0.0
    return held + gpus_per_node * activation_bytes(a, s)["offloaded_to_cpu"]


def estimate(a: Architecture, s: Setup, technique: str, world: int, gpus_per_node: int | None = None) -> Estimate:
    """Per-GPU peak for one technique (one of TECHNIQUES) on `world` GPUs in total, `gpus_per_node` of them (all, when
    not given) sharing one host's memory."""
    deepspeed = technique.startswith("zero")
    sizes = Sizes(
        world=max(world, 1),
        parameters=total_params(a),
        trainable=trainable_params(a, s),
        full=s.method == "full",
        trainable_bytes=2 if deepspeed else trainable_bytes(s, technique),
        frozen_bytes=frozen_weight_bytes(a, s),
        largest_layer_bytes=layer_params(a) * 2,
        root_unit_bytes=embedding_params(a) * 2,
        bucket_bytes=DS_BUCKET_ELEMENTS_PER_H2 * a.hidden**2 * 2,
        prefetch_bytes=DS_PREFETCH_PER_H2 * a.hidden**2 * 2,
    )
    supported, note = True, ""
    if s.method == "qlora" and technique in ("fsdp2", "zero3", "zero3_offload"):
        supported, note = False, "4-bit weights cannot be sharded here"
    if mxfp4_resident(a, s) and (technique != "ddp" or sizes.world > 1):
        supported, note = False, "MXFP4-resident experts train in one process only"
    parts, grads = TECHNIQUE_MEMORY[technique](sizes, s)
    if mxfp4_resident(a, s):
        parts["mxfp4_dequantized"] = mxfp4_dequantized_bytes(a, s)

    acts = activation_bytes(a, s)
    # The peak is at one end of the backward pass (see the module docstring):
    #   start: every saved activation + the LM head's loss buffers (its fp32 weight gradient among them);
    #   end:   every gradient + the recomputed layer (checkpointing) + one layer's backward transients.
    # With checkpointing the start also runs the last layer's recomputation before any layer gradient exists.
    start = acts["saved"] + loss_buffer_bytes(a, s, lm_head_trainable=sizes.full)
    if s.gradient_checkpointing:
        start = max(start, acts["saved"] + acts["recompute"] + acts["backward_transient"])
    if s.gradient_accumulation_steps > 1 and not deepspeed:
        # The gradients of the earlier micro-batches are held through this one's forward and backward (DeepSpeed
        # accumulates into its fp32 partition, already counted).
        start += grads
    end = grads + acts["recompute"] + acts["backward_transient"]
    parts["activations_and_grads"] = max(start, end)
    allocated = sum(parts.values())
    reserved = allocated * FRAGMENTATION
    overhead = (CUDA_CONTEXT_GIB + (NCCL_GIB if sizes.world > 1 else 0)) * GIB
    if technique == "zero3_offload":
        overhead += 0.5 * GIB  # pinned staging buffers for the CPU <-> GPU copies
    host = host_bytes(a, s, technique, sizes, min(gpus_per_node or sizes.world, sizes.world))
    return Estimate(technique, parts, allocated, reserved, reserved + overhead, supported, note, host)
