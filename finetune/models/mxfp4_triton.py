"""The MXFP4 dequantizer of finetune/models/mxfp4_experts.py as one Triton kernel for the GPU, bit-equal to its torch
reference (`mxfp4_experts.dequantize`) and without its temporaries: reads 4.25 bits per value, writes the weight once.
Importing this module needs triton; mxfp4_experts falls back to the reference without it.

Each program reads a tile of the stored bytes [out, in/2] once, along `in` where they are contiguous, with its 32-value
scales, and writes the tile transposed, along `out` where the weight is contiguous. Which tile size and warp count
keep the GPU's memory busiest is measured once per projection shape (`triton.autotune` over `CONFIGS`;
benchmarks/mxfp4_resident_check.py --kernel_variants times each of them).
"""

import torch
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK_IN": block_in, "BLOCK_OUT": block_out}, num_warps=warps)
           for block_in, block_out, warps in ((64, 64, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4),
                                              (64, 256, 8), (128, 256, 8))]


@triton.jit
def decode(byte, scale, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """Stored bytes [ROWS, COLUMNS/2] and their scale bytes [ROWS, COLUMNS/32] -> the float32 values [ROWS, COLUMNS],
    each exactly the FP4 value times its scale (COLUMNS runs along the weight's `in` axis, as the bytes do)."""
    # E2M1 code = sign bit, then em: 2 exponent bits (bias 1) and 1 mantissa bit. em << 22 as a float32's bits puts
    # them at the bottom of its exponent and the top of its mantissa: the FP4 value times 2**-126 (em = 1, i.e. 0.5,
    # as the subnormal 2**-127), which one exact multiply by 2**126 turns into the value (PTX mul.f32 keeps subnormal
    # inputs). Three integer operations a value (the old decode's selects and masks took twice the instructions),
    # straight from the byte, whose low nibble is the even-indexed value of the pair.
    word = byte.to(tl.uint32)
    low = ((word << 22) & 0x01C00000) | ((word << 28) & 0x80000000)
    high = ((word << 18) & 0x01C00000) | ((word << 24) & 0x80000000)
    value = tl.reshape(tl.join(low, high), (ROWS, COLUMNS)).to(tl.float32, bitcast=True) * 2.0**126
    # The scale byte is the float's exponent field: 0 is the subnormal 2**-127, 255 the reference's infinity
    factor = tl.where(scale == 0, 0x00400000, scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.reshape(tl.reshape(value, (ROWS, COLUMNS // 32, 32)) * factor[:, :, None], (ROWS, COLUMNS))


@triton.jit
def exact_bfloat16(product):
    # Every finite or infinite product fits bf16 exactly (at most two significant bits, float32's exponent range):
    # its upper half is torch's rounding of it, subnormals included (the interpreter's conversion gets them wrong).
    return (product.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequantize_kernel(blocks, scales, weight, groups, outputs, BLOCK_IN: tl.constexpr, BLOCK_OUT: tl.constexpr):
    # Sizes as multiples of `groups` (in/32): the compiler then knows each row of bytes starts and ends 16-byte aligned
    # and vectorizes the loads (`inputs // 2` would not tell it)
    inputs, row_bytes = groups * 32, groups * 16
    expert = tl.program_id(2).to(tl.int64)
    column = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)  # along `out`
    pair = tl.program_id(1) * (BLOCK_IN // 2) + tl.arange(0, BLOCK_IN // 2)  # along the stored bytes of `in`
    group = tl.program_id(1) * (BLOCK_IN // 32) + tl.arange(0, BLOCK_IN // 32)  # along the scales of `in`
    in_columns = (column < outputs)[:, None]
    byte = tl.load(blocks + expert * outputs * row_bytes + column[:, None] * row_bytes + pair[None, :],
                   mask=in_columns & (pair < row_bytes)[None, :], other=0)
    scale = tl.load(scales + expert * outputs * groups + column[:, None] * groups + group[None, :],
                    mask=in_columns & (group < groups)[None, :], other=127)
    product = decode(byte, scale, BLOCK_OUT, BLOCK_IN)
    if weight.dtype.element_ty == tl.bfloat16:
        product = exact_bfloat16(product)
    else:
        product = product.to(weight.dtype.element_ty)
    row = tl.program_id(1) * BLOCK_IN + tl.arange(0, BLOCK_IN)  # along `in`
    tl.store(weight + expert * inputs * outputs + row[:, None] * outputs + column[None, :], tl.trans(product),
             mask=(row < inputs)[:, None] & (column < outputs)[None, :])


autotuned_kernel = triton.autotune(CONFIGS, key=["groups", "outputs"], cache_results=True)(_dequantize_kernel)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               config: triton.Config | None = None) -> torch.Tensor:
    """Blocks [E, out, in/32, 16] and scales [E, out, in/32] -> contiguous weight [E, in, out] of `dtype`, by `config`
    or, on the GPU, by the fastest of `CONFIGS` for the shape."""
    experts, outputs, groups = scales.shape
    weight = torch.empty(experts, groups * 32, outputs, dtype=dtype, device=blocks.device)
    arguments = (blocks.contiguous(), scales.contiguous(), weight, groups, outputs)
    if config is None and blocks.is_cuda:
        autotuned_kernel[lambda meta: grid(meta, experts, groups, outputs)](*arguments)
        return weight
    config = config or CONFIGS[0]  # Triton's interpreter (CPU tensors) cannot time configurations
    _dequantize_kernel[grid(config.kwargs, experts, groups, outputs)](*arguments, num_warps=config.num_warps,
                                                                       **config.kwargs)
    return weight


def grid(meta: dict, experts: int, groups: int, outputs: int) -> tuple[int, int, int]:
    return triton.cdiv(outputs, meta["BLOCK_OUT"]), triton.cdiv(groups * 32, meta["BLOCK_IN"]), experts
