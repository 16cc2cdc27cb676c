"""The frozen expert GEMM of finetune/models/mxfp4_experts.py (`_chunked_grouped_mm`) as one Triton kernel that reads
the MXFP4 bytes inside the GEMM: each tile decodes its slice of blocks and scales to bf16 in registers (the
dequantizer's own decode, finetune/models/mxfp4_triton.py) and feeds it to the tensor cores with float32
accumulation, so a pass over a projection reads 4.25 bits a weight instead of dequantizing it to bf16 in memory and
reading that back. Importing this module needs triton.

Measured against the chunked path ("dequantize a chunk of experts, then torch._grouped_mm") by
`benchmarks/mxfp4_resident_check.py --fused_gemm`: training takes it where the experts get at most
`families.FUSED_GEMM_MAX_ROWS_PER_EXPERT` rows on average, where it won on the GPU.

Rows of x are sorted by expert and offsets[e] is where expert e's rows end, as torch._grouped_mm takes them. The grid
is a fixed upper bound of row tiles (rows / BLOCK_M + experts) times the output's column tiles; each program finds
its expert and rows from `offsets` on the device (a cumulative sum of the experts' row tiles), so no count is read
back to the host and the kernel can run inside a CUDA graph. Row tiles past the last expert's rows write zeros (the
experts' forward routes every row, so training has none).

The stored layout is [experts, out, in/32, 16] bytes with one scale per 32 values along `in`. The forward product
x·W_e (W_e [in, out]) reduces over `in`: a tile reads, for each of its output columns, a contiguous run of bytes along
the reduction, with its scales. The transposed product x·W_eᵀ (the input gradient) reduces over `out`: a tile reads,
for each step of the reduction, the bytes of its output columns along `in`, where the scale blocks now lie along the
output columns. Both decode along `in`, where bytes and scales are contiguous.
"""

import torch
import triton
import triton.language as tl

from finetune.models.mxfp4_triton import decode, exact_bfloat16

# BLOCK_K (the reduction step of the forward) and BLOCK_N (the output columns of the transposed product) run along
# `in` in whole 32-value scale blocks. The configurations the H100's autotuning picked for GPT-OSS-20B and -120B at 2k,
# 8k and 16k tokens, forward and transposed (docs/results/gptoss120b-2026-12-06d-h100/mxfp4_fused_gemm.json: 128x128x64
# for 20 of the 24 shapes); each configuration costs a kernel compile and a timing in the first step on a new machine,
# so those it never picked are left out: 128x128x128 and 128x256x64, and the 32-wide reduction steps 128x128x32 and
# 256x64x32, which spill no registers (benchmarks/fused_gemm_registers.py) but lost to these at every shape of the next
# lease (docs/results/gptoss120b-2026-12-06e-h100/mxfp4_fused_gemm.json).
CONFIGS = [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps,
                         num_stages=stages)
           for block_m, block_n, block_k, warps, stages in ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4),
                                                            (64, 128, 128, 4, 3), (64, 256, 64, 8, 3))]

# The width of the kernel's table of experts: one compiled kernel serves GPT-OSS-20B's 32 and 120B's 128 experts
EXPERTS_AT_LEAST = 128


# triton.language's own cdiv, zeros, sum and cumsum are @triton.jit functions made when triton is imported, which the
# interpreter of the tests (switched on after that import) cannot call: the kernel uses builtins and this combiner.
@triton.jit
def _add(left, right):
    return left + right


@triton.jit
def _grouped_matmul_kernel(x, blocks, scales, offsets, output, rows, experts, groups, outputs, rows_bucket,
                           TRANSPOSED: tl.constexpr, EXPERTS: tl.constexpr, UPCAST_DOT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    inputs, row_bytes = groups * 32, groups * 16
    if TRANSPOSED:
        reduced, columns = outputs, inputs
    else:
        reduced, columns = inputs, outputs
    # Column tiles vary fastest: the programs that run together share their rows of x and their expert's bytes in L2
    column_tiles = (columns + BLOCK_N - 1) // BLOCK_N
    row_tile = tl.program_id(0) // column_tiles
    column_tile = tl.program_id(0) % column_tiles
    column = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)

    # The expert of this row tile: experts' row tiles laid end to end, empty experts taking none
    expert_index = tl.arange(0, EXPERTS)
    ends = tl.load(offsets + expert_index, mask=expert_index < experts, other=0)
    starts = tl.load(offsets + expert_index - 1, mask=(expert_index > 0) & (expert_index < experts), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.associative_scan(tiles, 0, _add)
    expert = tl.reduce((tile_ends <= row_tile).to(tl.int32), 0, _add)
    chosen = expert_index == expert
    past_experts = expert >= experts  # rows after offsets[-1], or none at all: zeros
    first_row = tl.where(past_experts,
                         tl.load(offsets + experts - 1) + (row_tile - tl.reduce(tiles, 0, _add)) * BLOCK_M,
                         tl.reduce(tl.where(chosen, starts + (row_tile - tile_ends + tiles) * BLOCK_M, 0), 0, _add))
    end_row = tl.where(past_experts, rows, tl.reduce(tl.where(chosen, ends, 0), 0, _add))
    row = first_row + tl.arange(0, BLOCK_M)
    row_mask = row < end_row

    expert_blocks = blocks + expert.to(tl.int64) * outputs * row_bytes
    expert_scales = scales + expert.to(tl.int64) * outputs * groups
    x_rows = x + row.to(tl.int64)[:, None] * reduced
    accumulator = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for step in range(0, tl.where(past_experts, 0, reduced), BLOCK_K):
        reduction = step + tl.arange(0, BLOCK_K)
        activations = tl.load(x_rows + reduction[None, :], mask=row_mask[:, None] & (reduction < reduced)[None, :],
                              other=0.0)
        if TRANSPOSED:  # the bytes of `out` rows `reduction`, along `in` columns `column`
            pair = column_tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            group = column_tile * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            byte = tl.load(expert_blocks + reduction[:, None] * row_bytes + pair[None, :],
                           mask=(reduction < reduced)[:, None] & (pair < row_bytes)[None, :], other=0)
            scale = tl.load(expert_scales + reduction[:, None] * groups + group[None, :],
                            mask=(reduction < reduced)[:, None] & (group < groups)[None, :], other=127)
            weight = decode(byte, scale, BLOCK_K, BLOCK_N)  # [reduction, column]
        else:  # the bytes of `out` rows `column`, along `in` = `reduction`
            pair = step // 2 + tl.arange(0, BLOCK_K // 2)
            group = step // 32 + tl.arange(0, BLOCK_K // 32)
            byte = tl.load(expert_blocks + column[:, None] * row_bytes + pair[None, :],
                           mask=(column < columns)[:, None] & (pair < row_bytes)[None, :], other=0)
            scale = tl.load(expert_scales + column[:, None] * groups + group[None, :],
                            mask=(column < columns)[:, None] & (group < groups)[None, :], other=127)
            weight = tl.trans(decode(byte, scale, BLOCK_N, BLOCK_K))
        if activations.dtype == tl.bfloat16 and not UPCAST_DOT:
            accumulator = tl.dot(activations, exact_bfloat16(weight), accumulator)
        else:  # float32 holds each product of two bf16 values exactly
            accumulator = tl.dot(activations.to(tl.float32), weight, accumulator, input_precision="ieee")
    tl.store(output + row.to(tl.int64)[:, None] * columns + column[None, :],
             accumulator.to(output.dtype.element_ty), mask=row_mask[:, None] & (column < columns)[None, :])


autotuned_kernel = triton.autotune(CONFIGS, key=["rows_bucket", "experts", "groups", "outputs", "TRANSPOSED"],
                                   cache_results=True)(_grouped_matmul_kernel)


def mxfp4_grouped_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                         transposed: bool, config: triton.Config | None = None) -> torch.Tensor:
    """`mxfp4_experts._chunked_grouped_mm` in one kernel: x [rows, in] (transposed: [rows, out]) sorted by expert,
    offsets [experts] int32 cumulative row ends, blocks [E, out, in/32, 16] and scales [E, out, in/32] of the weight
    W [E, in, out] -> x·W_e (transposed: x·W_eᵀ) for each expert's rows, float32 accumulation, x's dtype. By `config`
    or, on the GPU, by the fastest of `CONFIGS` for the shape, the experts and the power of two above the row count."""
    experts, outputs, groups = scales.shape
    rows = x.shape[0]
    columns = groups * 32 if transposed else outputs
    output = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    arguments = (x.contiguous(), blocks.contiguous(), scales.contiguous(), offsets.contiguous(), output, rows, experts,
                 groups, outputs, triton.next_power_of_2(rows))
    # Triton's interpreter (CPU tensors) multiplies bf16 operands as their uint16 bits
    constants = {"TRANSPOSED": transposed, "EXPERTS": max(EXPERTS_AT_LEAST, triton.next_power_of_2(experts)),
                 "UPCAST_DOT": not x.is_cuda}

    def grid(meta):
        return ((triton.cdiv(rows, meta["BLOCK_M"]) + experts) * triton.cdiv(columns, meta["BLOCK_N"]),)

    if config is None and x.is_cuda:
        autotuned_kernel[grid](*arguments, **constants)
        return output
    config = config or CONFIGS[0]  # Triton's interpreter (CPU tensors) cannot time configurations
    _grouped_matmul_kernel[grid(config.kwargs)](*arguments, **constants, num_warps=config.num_warps,
                                                num_stages=config.num_stages, **config.kwargs)
    return output
