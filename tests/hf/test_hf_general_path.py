"""The general decoder path (``roundpipe.hf.replay``) on decoders built to test it.

A model type outside our own adapter's families, with Llama's layers, takes the general
path: it trains exactly as the model itself, leaves the model and the global RNG as
they were, and a decoder whose code cannot be replayed (the hidden state changed
between layers, values passed from one layer to the next, an epilogue after the final
norm, a mutable argument shared by the layers) is refused by name at ``from_hf``,
before anything is allocated.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.hf_families import COMMON, VOCAB, assert_trains_as_hf  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.hf import UnsupportedModel  # noqa: E402
from roundpipe.hf.replay import Prologue, ReplayedHead, ReplayedLayer  # noqa: E402


class PlainConfig(transformers.LlamaConfig):
    model_type = "roundpipe_test_decoder"


def build(decoder_class=None, **extra):
    """Llama's layers under a model type our own adapter does not know; with
    ``decoder_class``, a decoder whose ``forward`` is that class's."""
    config = PlainConfig(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if decoder_class is not None:
        model.model.__class__ = decoder_class
    return model


def batch(side="left"):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (5, 10), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 6, 2, 5)):
        if pad:
            mask[row, :pad] = 0 if side == "left" else 1
            if side == "right":
                mask[row, 10 - pad :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _run(decoder, input_ids, between=None, end=None, **kwargs):
    hidden = decoder.embed_tokens(input_ids)
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    rotary = decoder.rotary_emb(hidden, positions)
    for layer in decoder.layers:
        hidden = layer(hidden, position_embeddings=rotary, position_ids=positions, **kwargs)
        if between is not None:
            hidden = between(hidden)
    hidden = decoder.norm(hidden)
    return BaseModelOutputWithPast(last_hidden_state=hidden if end is None else end(hidden))


class ScalesBetweenLayers(transformers.LlamaModel):
    def forward(self, input_ids=None, **_):
        return _run(self, input_ids, between=lambda h: h * 0.5)


class ScalesTheIndexedOutput(transformers.LlamaModel):
    """Indexes each layer's output, as decoders whose layers return tuples do."""

    def forward(self, input_ids=None, **_):
        hidden = self.embed_tokens(input_ids)
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rotary)[0] * 0.5
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


class PassesValuesOn(transformers.LlamaModel):
    """Hands each layer's second output to the next layer (as GLM-5's layers hand their
    indexer's top-k on)."""

    def forward(self, input_ids=None, **_):
        hidden = self.embed_tokens(input_ids)
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        carry = None
        for layer in self.layers:
            hidden, carry = layer(hidden, position_embeddings=rotary, carry=carry)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


class ReturnsAValue(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    def forward(self, hidden_states, carry=None, **kwargs):
        hidden = super().forward(hidden_states, **kwargs)
        if carry is not None:
            hidden = hidden + carry
        return hidden, hidden.tanh().mean(dim=-1, keepdim=True)


class ScalesAfterTheNorm(transformers.LlamaModel):
    def forward(self, input_ids=None, **_):
        return _run(self, input_ids, end=lambda h: h * 2)


class SharesAFilledDict(transformers.LlamaModel):
    def forward(self, input_ids=None, **_):
        return _run(self, input_ids, shared_keys_and_values={"first": torch.zeros(1)})


class SharesAnEmptyDict(transformers.LlamaModel):
    def forward(self, input_ids=None, **_):
        return _run(self, input_ids, shared_keys_and_values={})


class WritesIntoTheSharedDict(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """Stores a value in the container every layer is handed, and reads what the
    previous layer stored there (as Gemma 4 E-series layers share keys and values)."""

    def forward(self, hidden_states, shared_keys_and_values=None, **kwargs):
        index = self.self_attn.layer_idx
        before = shared_keys_and_values.get(f"layer {index - 1}")
        if before is not None:
            hidden_states = hidden_states + before
        shared_keys_and_values[f"layer {index}"] = hidden_states.tanh().mean(-1, keepdim=True)
        return super().forward(hidden_states, **kwargs)


def test_a_model_type_outside_the_families_takes_the_general_path_and_trains_exactly():
    model = build()
    with roundpipe.from_hf(model, devices="emulated:1") as pipe:
        kinds = [type(layer) for layer in pipe.model]
    assert kinds == [Prologue, ReplayedLayer, ReplayedLayer, ReplayedLayer, ReplayedHead]
    assert_trains_as_hf(model, batch("left"), RoundPipeRunConfig(num_microbatch=3))


def test_wrapping_changes_neither_the_model_nor_the_global_random_state():
    model = build()
    modules_before = dict(model.model._modules)
    class_before = type(model.model)
    data = batch("right")
    with torch.no_grad():
        logits_before = model(**data).logits
    torch.manual_seed(123)
    with roundpipe.from_hf(model, devices="emulated:1"):
        drawn = torch.rand(3)
    torch.manual_seed(123)
    torch.testing.assert_close(drawn, torch.rand(3))
    assert dict(model.model._modules) == modules_before
    assert type(model.model) is class_before
    with torch.no_grad():
        torch.testing.assert_close(model(**data).logits, logits_before)


def test_logits_without_labels_are_the_models():
    model = build()
    data = batch("left")
    del data["labels"]
    with torch.no_grad():
        want = model(**data).logits
    with roundpipe.from_hf(model, devices="emulated:2") as pipe, torch.no_grad():
        got = pipe(**data)
    real = data["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("decoder_class", "message"),
    [
        (ScalesBetweenLayers, "does more than pass each layer's output to the next"),
        (ScalesTheIndexedOutput, "changes the hidden state between layers 0 and 1"),
        (ScalesAfterTheNorm, "not its final norm of the last layer's output"),
        (SharesAFilledDict, "share an argument of type dict"),
    ],
    ids=[
        "hidden changed",
        "indexed output changed",
        "epilogue",
        "side channel",
    ],
)
def test_a_decoder_that_cannot_be_replayed_is_refused_by_name_before_allocating(
    decoder_class, message
):
    model = build(decoder_class)
    with pytest.raises(UnsupportedModel, match=message) as refused:
        roundpipe.from_hf(model, devices="emulated:1")
    assert "model_type 'roundpipe_test_decoder'" in str(refused.value)


def test_a_model_without_a_layer_list_is_refused_naming_what_it_has():
    model = build()
    model.model.blocks_of_mine = model.model._modules.pop("layers")
    with pytest.raises(UnsupportedModel, match=r"no list of decoder layers in LlamaModel"):
        roundpipe.from_hf(model, devices="emulated:1")


@pytest.mark.parametrize("writes", [False, True], ids=["ignored", "written and read"])
def test_a_container_every_layer_is_handed_carries_what_layers_write_into_it(writes):
    """Its contents travel between stages: a later layer reads what an earlier one
    wrote, and the gradients flow back through them."""
    model = build(SharesAnEmptyDict)
    if writes:
        for layer in model.model.layers:
            layer.__class__ = WritesIntoTheSharedDict
    assert_trains_as_hf(model, batch("left"), RoundPipeRunConfig(num_microbatch=3))


def test_the_router_loss_of_a_moe_model_on_the_general_path_is_refused_not_dropped():
    """transformers adds it to the loss; the general path does not compute it yet."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip
    with pytest.raises(UnsupportedModel, match=r"output_router_logits=True"):
        roundpipe.from_hf(transformers.MixtralForCausalLM(config), devices="emulated:1")


def test_the_model_types_that_tile_are_our_own_adapters_families():
    from roundpipe.core.tiling import TILED_MODEL_TYPES
    from roundpipe.hf.families import FAMILIES

    assert set(FAMILIES) == TILED_MODEL_TYPES


def test_values_a_layer_returns_for_the_next_travel_with_the_hidden_state():
    model = build(PassesValuesOn)
    for layer in model.model.layers:
        layer.__class__ = ReturnsAValue
    assert_trains_as_hf(model, batch("left"), RoundPipeRunConfig(num_microbatch=3))


def test_a_layer_that_returns_fewer_values_than_its_decoder_hands_on_is_refused():
    model = build(PassesValuesOn)  # Llama's layers return the hidden state alone
    with (
        roundpipe.from_hf(model, devices="emulated:1") as pipe,
        pytest.raises(UnsupportedModel, match=r"layer 0 returned 1 value\(s\), but its decoder"),
    ):
        pipe.forward_backward(input_kwargs=batch("right"))


def test_sequence_tiling_on_a_general_path_model_is_refused_naming_it():
    config = RoundPipeRunConfig(seq_chunk_tokens=4)
    with (
        roundpipe.from_hf(build(), devices="emulated:1", model_run_config=config) as pipe,
        pytest.raises(ValueError, match=r"seq_chunk_tokens=4: .*'roundpipe_test_decoder'"),
    ):
        pipe.forward_backward(input_kwargs=batch("right"))
