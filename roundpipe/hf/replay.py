"""The general decoder path: any decoder-only causal LM, its own layers run as they are.

Nothing around the decoder layers is re-implemented. The first stage (:class:`Prologue`)
runs the model's own decoder ``forward`` on a *twin* of the base model whose decoder
layers are stubs that record the exact arguments each layer is called with (the mask
of its layer type from transformers' own builders, the rotary tables of its type or
none, per-layer inputs computed from weights, anything else) and whose final norm is a
stub too. The hidden state the first layer receives, after the model's own embedding
code with its scalars, and those arguments travel together (:class:`Carried`, each
distinct value once); each :class:`ReplayedLayer` calls its layer with its own. The
:class:`ReplayedHead` runs the final norm and then, per chunk of tokens, the causal
LM's own ``forward`` on a twin whose base model is a stub returning the chunk: its head
scalars and soft-caps apply, and the logits of the whole sequence never exist.

Values one layer returns for a later one and containers every layer writes into travel
too (:mod:`.recording`). What a decoder does that cannot be replayed (the hidden state
changed between layers, a final output that is not the final norm's, any other shared
mutable argument) is refused by name when ``from_hf`` records a first batch.

docs/design.md#the-general-decoder-path.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .long_context import chunked_loss, module_state
from .recording import (
    Carried,
    LayerStub,
    NormStub,
    Passed,
    Recorder,
    SharedContainer,
    after_layer,
    carried,
    copy_plain_attributes,
    hidden_of,
    recording,
)
from .structure import (
    Structure,
    UnsupportedModel,
    decoder_layer_modules,
    decoder_of,
    find_structure,
    text_config,
    twin,
    twin_along,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_UNPACKING = r"not enough values to unpack \(expected (\d+), got 1\)"


# -- the RoundPipe layers ----------------------------------------------------------------------


class Prologue(nn.Module):
    """The first stage: the base model's own ``forward`` up to the first decoder layer
    (embedding, its scalars, masks, rotary tables, per-layer inputs), recorded."""

    modifies_inputs = False

    def __init__(self, causal_lm: nn.Module, structure: Structure) -> None:
        super().__init__()
        layers = decoder_layer_modules(causal_lm, structure)
        stubs = nn.ModuleList(LayerStub(layer, i) for i, layer in enumerate(layers))
        children: dict[str, nn.Module] = {structure.layers_name: stubs}
        if structure.norm_name is not None:
            children[structure.norm_name] = NormStub()
        base = getattr(causal_lm, structure.base_name)
        self.base = twin_along(base, structure.decoder_path, children)
        self.model_type: str = cast("PreTrainedModel", causal_lm).config.model_type
        self.has_norm = structure.norm_name is not None
        self.arity = 1
        """How many values the decoder code unpacks from a layer's output (found by
        :meth:`probe`: Bamba's loop takes ``hidden, attention_weights``)."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, **images):
        """``images``: a vision-language model's image inputs (:mod:`.images`), which its
        own code runs through the vision tower and merges into the text."""
        if padding_only_trails(attention_mask, labels):
            attention_mask = None  # no real token attends to a later pad under a causal mask
        with recording(self.arity) as recorder:
            out = self.base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **images,
            )
        self._check(recorder, out)
        return carried(hidden_of(*recorder.calls[0]), recorder, labels, self.model_type)

    def probe(self) -> None:
        """Record a two-token batch on the host, so a decoder the general path cannot
        replay is refused before anything is allocated."""
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            return  # a model still being planned (from_pretrained checks it when loaded)
        ids = torch.zeros((1, 2), dtype=torch.long)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):  # draws nothing of yours
                try:
                    self(ids)
                except ValueError as error:  # the loop unpacks more than the hidden state
                    unpacked = re.fullmatch(_UNPACKING, str(error))
                    if unpacked is None:
                        raise
                    self.arity = int(unpacked.group(1))
                    self(ids)
        except UnsupportedModel:
            raise
        except Exception as error:  # noqa: BLE001 - any failure of the model's own code
            raise UnsupportedModel(
                f"model_type {self.model_type!r}: its decoder does more than pass each "
                "layer's output to the next and the last one's to its final norm (with its "
                f"layers stubbed it failed: {type(error).__name__}: {error}); roundpipe's "
                "general path cannot replay it"
            ) from error

    def _check(self, recorder: Recorder, out) -> None:
        name = f"model_type {self.model_type!r}"
        if not recorder.calls:
            raise UnsupportedModel(f"{name}: its decoder called no layer")
        for i in range(1, len(recorder.calls)):
            if not _is(hidden_of(*recorder.calls[i]), recorder.returned[i - 1]):
                raise UnsupportedModel(
                    f"{name}: its decoder changes the hidden state between layers {i - 1} "
                    f"and {i}, which roundpipe's general path cannot replay"
                )
        last = recorder.returned[-1]
        final = getattr(out, "last_hidden_state", None)
        if self.has_norm:
            fine = _is(recorder.norm_input, last) and _same(final, recorder.norm_output)
        else:
            fine = _same(final, last[0])
        if not fine:
            raise UnsupportedModel(
                f"{name}: its decoder's output is not its final norm of the last layer's "
                "output (an epilogue roundpipe's general path cannot replay)"
            )


def _is(value, passed: Passed) -> bool:
    """``value`` is what a layer stub returned, its hidden state, or a view of that of
    the same shape (Gemma 4 slices the whole sequence before its shared layers)."""
    return value is passed or _same(value, passed[0])


def _same(final, tensor: torch.Tensor) -> bool:
    """``final`` is ``tensor``, or a view of it of the same shape (GPT-2's ``view``)."""
    return final is tensor or (
        isinstance(final, torch.Tensor)
        and final.shape == tensor.shape
        and final.data_ptr() == tensor.data_ptr()
    )


def padding_only_trails(attention_mask, labels) -> bool:
    """In training (labels given), a right-padded batch needs no padding mask in a causal
    decoder: no real token sees a later pad, and the pads' own outputs have no label."""
    return (
        labels is not None
        and attention_mask is not None
        and attention_mask.dim() == 2
        and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    )


class ReplayedLayer(nn.Module):
    """One decoder layer of the model, called with the arguments recorded for it."""

    modifies_inputs = False

    def __init__(self, layer: nn.Module, config) -> None:
        super().__init__()
        self.layer = layer
        self.model_type = config.model_type
        self.keep_writes = getattr(text_config(config), "num_kv_shared_layers", None) != 0
        """Whether what a layer writes into a shared container travels on: not where
        the config says no layer reads it (Gemma 4 without shared layers still stores
        keys and values there, for assistant models outside the model)."""

    def forward(self, state: Carried) -> Carried:
        call, values = state.calls[0], list(state.values)
        opened: dict[int, object] = {}

        def argument(slot: int):
            if isinstance(values[slot], SharedContainer):
                opened.setdefault(slot, values[slot].open())
                return opened[slot]
            return values[slot]

        args = [argument(i) for i in call.positional]
        kwargs = {k: argument(i) for k, i in call.keywords}
        if call.hidden_at == 0:
            out = self.layer(state.hidden, *args, **kwargs)
        else:
            out = self.layer(*args, **{cast(str, call.hidden_at): state.hidden}, **kwargs)
        for slot, container in opened.items():
            values[slot] = values[slot].after(container, self.keep_writes)
        return after_layer(replace(state, values=tuple(values)), out, self.model_type)


class _HiddenOnly(dict):
    """The base model's output as the head stub gives it: ``last_hidden_state``; any
    other field is ``None``."""

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)


class _BaseStub(nn.Module):
    """Stands in for the base model in the head: returns the hidden states it is given,
    and has the base model's plain attributes (Falcon-H1's head reads its multiplier)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        copy_plain_attributes(base, self)

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return _HiddenOnly(last_hidden_state=inputs_embeds)


class ReplayedHead(nn.Module):
    """The final norm, then the causal LM's own head code over chunks of tokens: with
    labels, the summed cross-entropy of the shifted labels and the count of them the
    logits predict (:func:`.long_context.chunked_loss`); without, the logits."""

    modifies_inputs = False

    def __init__(self, causal_lm: nn.Module, structure: Structure, chunk_tokens: int) -> None:
        super().__init__()
        decoder = decoder_of(getattr(causal_lm, structure.base_name), structure)
        self.norm = decoder._modules[structure.norm_name] if structure.norm_name else None
        self.lm = twin(
            causal_lm, {structure.base_name: _BaseStub(getattr(causal_lm, structure.base_name))}
        )
        self.chunk_tokens = chunk_tokens
        self.vocab_size = cast("PreTrainedModel", causal_lm).get_output_embeddings().weight.shape[0]

    def forward(self, state: Carried):
        hidden = state.hidden if self.norm is None else self.norm(state.hidden)
        if state.labels is None:
            return _logits(self.lm, hidden)
        names, tensors = module_state(self.lm)
        logits_of = functools.partial(_lm_logits, self.lm, names)
        return chunked_loss(
            hidden, state.labels, self.chunk_tokens, self.vocab_size, logits_of, *tensors
        )


def _logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return lm(inputs_embeds=hidden, use_cache=False).logits


def _lm_logits(lm, names, hidden, *tensors):
    """A chunk's logits from the causal LM's own head code, its tensors passed in."""
    weights = dict(zip(names, tensors, strict=True))
    inputs = {"inputs_embeds": hidden.unsqueeze(0), "use_cache": False}
    return torch.func.functional_call(lm, weights, (), inputs).logits


def replayed_layers(causal_lm: nn.Module, chunk_tokens: int) -> nn.Sequential:
    """``causal_lm`` as RoundPipe layers on the general path: a :class:`Prologue`, one
    :class:`ReplayedLayer` per decoder layer and a :class:`ReplayedHead`."""
    structure = find_structure(causal_lm)
    _refuse_router_loss(causal_lm.config)
    layers = decoder_layer_modules(causal_lm, structure)
    prologue = Prologue(causal_lm, structure)
    prologue.probe()
    return nn.Sequential(
        prologue,
        *(ReplayedLayer(layer, causal_lm.config) for layer in layers),
        ReplayedHead(causal_lm, structure, chunk_tokens),
    )


def _refuse_router_loss(config) -> None:
    if getattr(text_config(config), "output_router_logits", False):
        raise UnsupportedModel(
            f"model_type {config.model_type!r} asks for the MoE router loss "
            "(output_router_logits=True), which roundpipe computes for Qwen3-MoE and GPT-OSS "
            "only so far; set config.output_router_logits = False to train without it"
        )


def check_replayable(causal_lm: nn.Module) -> None:
    """What ``from_hf`` checks of a general-path model, for one still on the ``meta``
    device (``roundpipe train``'s checks before loading): the prologue's tensors become
    empty host tensors (only their shapes matter to the recording; the embedding's pages
    are never touched but for the rows looked up) and a two-token batch is recorded.
    ``causal_lm`` is left unusable."""
    _refuse_router_loss(causal_lm.config)
    prologue = Prologue(causal_lm, find_structure(causal_lm))
    prologue.to_empty(device="cpu")
    with torch.no_grad():
        for buffer in prologue.buffers():
            buffer.zero_()
    prologue.probe()
