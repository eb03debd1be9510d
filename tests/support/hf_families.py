"""The tiny Hugging Face models of the ``from_hf`` tests, one per family our own
adapter covers (fp32, hidden 32, 3 layers, a 64-token vocabulary), and the checks
several tests run on them: one call against the model itself, and training steps."""

from __future__ import annotations

import torch
import transformers

import roundpipe
from support import architectures
from support.architectures import hf_loss_and_grads

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="sdpa",
)


def build(family: str):
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    if family == "mistral":  # a window shorter than the sequence: sliding masks matter
        config = transformers.MistralConfig(**COMMON, sliding_window=4, head_dim=8)
        return transformers.MistralForCausalLM(config)
    if family == "qwen2":
        config = transformers.Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
        return transformers.Qwen2ForCausalLM(config)
    if family == "qwen3":
        config = transformers.Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True)
        return transformers.Qwen3ForCausalLM(config)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "gpt_oss":  # sinks, biases, alternating sliding-window layers
        config = transformers.GptOssConfig(
            **{**COMMON, "attn_implementation": "eager"},
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return transformers.GptOssForCausalLM(config)
    raise AssertionError(family)


def padded_batch(rows: int = 5, length: int = 10, side: str = "right", seed: int = 0):
    return architectures.padded_batch(rows, length, side, seed, vocab=VOCAB)


def assert_trains_as_hf(model, batch, config, devices: str = "emulated:2") -> None:
    """One ``forward_backward`` of ``batch`` through ``from_hf(model)`` gives the loss
    and gradients of the Hugging Face model itself (fp32 tolerances)."""
    want, want_grads = hf_loss_and_grads(model, batch, use_cache=False)
    with roundpipe.from_hf(model, devices=devices, model_run_config=config) as pipe:
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-4, atol=1e-6)


def train_both(pipe, reference, batches, lr=1e-3, rtol=1e-5, atol=1e-6, scaler=None):
    """Synchronous AdamW steps on the pipe (through ``scaler`` if given) and on the
    reference; losses compared."""
    optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=lr)
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=lr)

    def update() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()

    for batch in batches:
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.step(update, is_async=False)
        want = reference(**batch).loss
        want.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(loss.detach().float(), want.detach(), rtol=rtol, atol=atol)


def train_steps(pipe, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    losses = []
    for seed in range(steps):
        loss = pipe.forward_backward(input_kwargs=padded_batch(seed=seed))
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        losses.append(float(loss))
    pipe.synchronize()
    return losses
