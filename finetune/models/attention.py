"""`attn_implementation: torch_varlen`: variable-length flash attention for packed, padding-free batches, through
PyTorch's own `torch.nn.attention.varlen` kernel (no flash-attn package, nothing to download).

TRL's packing puts several conversations in one row and passes their boundaries (`cu_seq_lens_q`); each one then
attends only to itself and no padding is computed. With sdpa the same rows need a dense block mask over the whole
packed row, which measured 3.8x slower on an H200 (docs/benchmarks.md). Rows that are not packed go through sdpa, and
so do packed rows whose documents all have the same length (pre-packed fixed-length data): they are an ordinary batch,
and sdpa's cuDNN kernel is faster on Hopper than the varlen kernel.
"""

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN_ATTENTION = "torch_varlen"


def _varlen_kernel():
    """torch's varlen_attn and how this version takes causality and grouped-query heads (its signature changed)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


# looked up once: inspecting a signature inside a torch.compile'd layer would break its graph
_KERNEL, _KERNEL_PARAMETERS = _varlen_kernel()


def varlen_attention(query, key, value, cu_seq_lens, max_length: int, scaling: float | None) -> torch.Tensor:
    """(1, heads, tokens, dim) tensors of one packed row -> (1, tokens, heads, dim), causal within each document."""
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    kwargs = {"window_size": (-1, 0)} if "window_size" in _KERNEL_PARAMETERS else {"is_causal": True}
    if groups > 1 and "enable_gqa" in _KERNEL_PARAMETERS:
        kwargs["enable_gqa"] = True
    elif groups > 1:  # older kernels want as many key/value heads as query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if scaling is not None and "scale" in _KERNEL_PARAMETERS:
        kwargs["scale"] = scaling
    cu = cu_seq_lens.to(device=q.device, dtype=torch.int32)
    out = _KERNEL(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_length, max_length, **kwargs)
    return (out[0] if isinstance(out, tuple) else out).unsqueeze(0)


@torch.compiler.disable  # its loop runs once per document: compiled, every new document count would be a new graph
def block_diagonal_attention(query, key, value, cu_seq_lens, scaling: float | None) -> torch.Tensor:
    """The same result as `varlen_attention`, one causal sdpa call per document: the portable path (CPU, tiny
    models) and the reference the kernel is checked against. Tokens after the last document attend to themselves."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu_seq_lens.tolist()
    if bounds[-1] < query.shape[2]:
        bounds.append(query.shape[2])
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=scaling
        )
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def equal_documents_attention(module, query, key, value, documents: int, dropout: float, scaling: float | None):
    """A packed row of `documents` documents of one length is a batch of that many rows: causal sdpa over
    (documents, heads, length, dim), returned as the packed row's (1, tokens, heads, dim)."""
    batch = [tensor.unflatten(2, (documents, -1)).transpose(0, 2).squeeze(2) for tensor in (query, key, value)]
    out, _ = sdpa_attention_forward(module, *batch, None, dropout=dropout, scaling=scaling, is_causal=True)
    return out.flatten(0, 1).unsqueeze(0), None


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The AttentionInterface entry: packed rows through the varlen kernel (on CPU through the block-diagonal mask),
    other rows (right-padded, so causal attention never sees the padding before a real token) through causal sdpa."""
    if kwargs.get("s_aux") is not None or getattr(module, "sliding_window", None):
        raise ValueError(f"{VARLEN_ATTENTION} is plain causal attention: GPT-OSS's sinks and sliding windows need "
                         f"flex_attention")
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
    documents = cu_seq_lens.shape[0] - 1
    max_length = kwargs.get("max_length_q")
    if not isinstance(max_length, (int, torch.SymInt)):  # TRL passes it (symbolic when compiled); this syncs
        max_length = int(cu_seq_lens.diff().max())
    if documents * max_length == query.shape[2]:
        return equal_documents_attention(module, query, key, value, documents, dropout, scaling)
    if not query.is_cuda:
        return block_diagonal_attention(query, key, value, cu_seq_lens, scaling), None
    return varlen_attention(query, key, value, cu_seq_lens, max_length, scaling), None


def register() -> None:
    """Make `attn_implementation="torch_varlen"` known to transformers (before from_pretrained)."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
