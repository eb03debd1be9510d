"""The chunked loss's device-memory bound, shown with the emulated device capacity.

The emulator counts what layers compute (logits, what autograd saves) as device
memory from creation to death, as a GPU would. A sequence whose fp32 logits alone
exceed the device trains within it when the loss is computed in chunks, and runs out
of memory when it is not.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe import EmulatedOptions  # noqa: E402

VOCAB, TOKENS = 4096, 2 * 512
LOGITS_BYTES = (TOKENS - 2) * VOCAB * 4  # fp32 logits of every shifted token: 16.7 MB
CAPACITY = 12 * 2**20


def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config)


def batch():
    ids = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def run(chunk_tokens: int):
    hf = model()
    with torch.no_grad():
        want = hf(**batch()).loss
    options = EmulatedOptions(capacity_bytes=CAPACITY)
    with roundpipe.from_hf(hf, devices="emulated:1", emulated_options=options) as pipe:
        pipe.model[-1].chunk_tokens = chunk_tokens
        loss = pipe.forward_backward(input_kwargs=batch())
        pipe.synchronize()
        return loss.detach(), want, pipe.pool.devices[0].max_memory_allocated()


def test_chunked_logits_fit_a_device_the_whole_logits_do_not():
    assert LOGITS_BYTES > CAPACITY
    loss, want, peak = run(chunk_tokens=128)  # 2 MB of logits per chunk
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert peak <= CAPACITY
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        run(chunk_tokens=TOKENS)
