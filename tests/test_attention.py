"""`attn_implementation: torch_varlen` (finetune/models/attention.py) against a dense reference written out by hand: every
document of a packed row attends causally to itself only, whichever path the row takes."""

from types import SimpleNamespace

import pytest
import torch

from finetune.models import attention

HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_reference(query, key, value, lengths):
    """fp32 softmax attention over the whole packed row with a block-diagonal causal mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(sum(lengths))
    allowed = (document[:, None] == document[None, :]) & (position[:, None] >= position[None, :])
    scores = (query.double() @ key.double().transpose(-1, -2)) * DIM**-0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ value.double()).transpose(1, 2)


def packed_row(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tensors = [torch.randn(1, heads, total, DIM, generator=generator, requires_grad=True)
               for heads in (HEADS, KV_HEADS, KV_HEADS)]
    cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return tensors, {"cu_seq_lens_q": cu_seq_lens, "max_length_q": max(lengths)}


MODULE = SimpleNamespace(is_causal=True, num_key_value_groups=HEADS // KV_HEADS, training=False)


@pytest.mark.parametrize("lengths", [[5, 11, 3, 13], [8, 8, 8, 8], [32]], ids=["uneven", "equal", "one"])
def test_packed_documents_attend_causally_to_themselves_only(lengths):
    (query, key, value), packing = packed_row(lengths)
    out, _ = attention.varlen_attention_forward(MODULE, query, key, value, None, scaling=DIM**-0.5, **packing)
    expected = dense_reference(query, key, value, lengths)
    assert out.shape == (1, sum(lengths), HEADS, DIM)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    out.square().sum().backward()
    grads = [tensor.grad.clone() for tensor in (query, key, value)]
    for tensor in (query, key, value):
        tensor.grad = None
    expected.square().sum().backward()
    for grad, tensor in zip(grads, (query, key, value)):
        torch.testing.assert_close(grad.double(), tensor.grad.double(), atol=1e-4, rtol=1e-4)


def test_equal_length_documents_take_the_batched_sdpa_path(monkeypatch):
    def unexpected(*args, **kwargs):
        raise AssertionError("equal-length documents went through the per-document path")

    monkeypatch.setattr(attention, "block_diagonal_attention", unexpected)
    (query, key, value), packing = packed_row([8, 8, 8, 8])
    out, _ = attention.varlen_attention_forward(MODULE, query, key, value, None, scaling=DIM**-0.5, **packing)
    torch.testing.assert_close(out.double(), dense_reference(query, key, value, [8] * 4), atol=1e-5, rtol=1e-5)


def test_gpt_oss_sinks_are_refused_with_the_fix():
    (query, key, value), packing = packed_row([8, 8])
    with pytest.raises(ValueError, match="flex_attention"):
        attention.varlen_attention_forward(MODULE, query, key, value, None, s_aux=torch.zeros(HEADS), **packing)
