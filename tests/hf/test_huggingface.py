"""Real model code: a tiny Llama from Hugging Face ``transformers`` (random weights, built
from a config locally), cut into layers, trains under RoundPipe exactly like PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import assert_weights_close
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64


class Embed(nn.Module):
    """Token embedding plus the rotary tables every decoder layer needs."""

    def __init__(self, embed: nn.Embedding, rotary: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        self.rotary = rotary

    def forward(self, ids: torch.Tensor):
        hidden = self.embed(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        cos, sin = self.rotary(hidden, positions)
        return hidden, cos, sin


class Decoder(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, state):
        hidden, cos, sin = state
        out = self.layer(hidden, position_embeddings=(cos, sin), attention_mask=None)
        return (out[0] if isinstance(out, tuple) else out), cos, sin


class Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, state):
        return self.lm_head(self.norm(state[0]))


def tiny_llama() -> tuple[nn.Module, nn.Sequential]:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    inner = model.model
    layers = [Embed(inner.embed_tokens, inner.rotary_emb), *map(Decoder, inner.layers)]
    return model, nn.Sequential(*layers, Head(inner.norm, model.lm_head))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_the_layer_cut_computes_what_the_hugging_face_model_computes():
    model, sequential = tiny_llama()
    ids = torch.randint(0, VOCAB, (3, 12))
    with torch.no_grad():
        torch.testing.assert_close(sequential(ids), model(ids).logits)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_tiny_llama_trains_like_pytorch(grain):
    from roundpipe import RoundPipe, RoundPipeRunConfig

    _, sequential = tiny_llama()
    reference = copy.deepcopy(sequential)
    generator = torch.Generator().manual_seed(3)
    windows = [torch.randint(0, VOCAB, (6, 13), generator=generator) for _ in range(3)]
    plan = "2,2|2,1,1,1,1"
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain, execute_plan=plan)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    with RoundPipe(sequential, devices="emulated:3", model_run_config=config) as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        for window in windows:
            ids, targets = window[:, :-1], window[:, 1:]
            loss = pipe.forward_backward((ids,), label=targets, loss_fn=next_token_loss)
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
            want = next_token_loss(reference(ids), targets)  # the whole batch's mean
            want.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-4)
        pipe.synchronize()
    # AdamW at lr 1e-2 moves an element whose gradient is about its eps by a fraction of
    # the rate on rounding noise alone (2.5e-5 seen under transformers 5.25's kernels).
    assert_weights_close(sequential, reference, atol=1e-4)
