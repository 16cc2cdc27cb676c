"""The MXFP4 dequantization kernel as it was before issue 42 (finetune/models/mxfp4_triton.py at 3dec8cc; 1.38 TB/s on
one H100): the baseline that benchmarks/mxfp4_resident_check.py --kernel_variants times beside the current kernel's
configurations, on the same card in the same call. A 64 x 64 tile of the weight [in, out] per program; each stored byte
is read twice (for its even and its odd value), across rows 1,440 bytes apart.
"""

import torch
import triton
import triton.language as tl

BLOCK_IN, BLOCK_OUT = 64, 64

@triton.jit
def _dequantize_kernel(blocks, scales, weight, inputs, outputs, BLOCK_IN: tl.constexpr, BLOCK_OUT: tl.constexpr):
    # One tile of one expert's weight [in, out], written along `out` (contiguous); the stored bytes [out, in/2] and
    # scales [out, in/32] of the tile are read across, each row's 32 bytes from one 32-byte sector.
    expert = tl.program_id(2).to(tl.int64)
    column = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)[None, :]  # along `out`
    row = tl.program_id(1) * BLOCK_IN + tl.arange(0, BLOCK_IN)[:, None]  # along `in`
    mask = (column < outputs) & (row < inputs)
    byte = tl.load(blocks + expert * outputs * (inputs // 2) + column * (inputs // 2) + row // 2, mask=mask, other=0)
    scale = tl.load(scales + expert * outputs * (inputs // 32) + column * (inputs // 32) + row // 32, mask=mask,
                    other=127)
    code = tl.where(row % 2 == 0, byte & 0x0F, byte >> 4).to(tl.int32)
    # E2M1 -> float32 bits: exponent field e (bias 1) and mantissa bit m; e = 0 is 0 or the subnormal 0.5
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    value = (magnitude | ((code >> 3) << 31)).to(tl.float32, bitcast=True)
    scale_bits = scale.to(tl.int32) << 23
    factor = tl.where(scale == 0, 0x00400000, scale_bits).to(tl.float32, bitcast=True)
    tl.store(weight + expert * inputs * outputs + row * outputs + column,
             (value * factor).to(weight.dtype.element_ty), mask=mask)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [E, out, in/32, 16] and scales [E, out, in/32] -> contiguous weight [E, in, out] of `dtype`."""
    experts, outputs, groups = scales.shape
    inputs = groups * 32
    weight = torch.empty(experts, inputs, outputs, dtype=dtype, device=blocks.device)
    grid = (triton.cdiv(outputs, BLOCK_OUT), triton.cdiv(inputs, BLOCK_IN), experts)
    _dequantize_kernel[grid](blocks.contiguous(), scales.contiguous(), weight, inputs, outputs, BLOCK_IN=BLOCK_IN,
                             BLOCK_OUT=BLOCK_OUT)
    return weight
