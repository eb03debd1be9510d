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

What a decoder does that cannot be replayed (the hidden state changed between layers,
values one layer returns for the next, a final output that is not the final norm's,
a shared mutable argument) is refused by name when the first batch is recorded.

docs/design.md#the-general-decoder-path.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .long_context import loss_chunk_tokens

IGNORE_INDEX = -100
NORM_NAMES = ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f", "final_layer_norm")
LAYER_LIST_NAMES = ("layers", "h", "blocks", "decoder_layers")
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)

_local = threading.local()


class UnsupportedModel(ValueError):
    """A model the general decoder path cannot run, named with what was found."""


@dataclass(frozen=True)
class Structure:
    """Where a causal LM keeps what the general path needs."""

    base_name: str
    """The causal LM's attribute holding its base model (``model``)."""
    decoder_path: tuple[str, ...]
    """Submodule names from the base model down to the decoder that owns the layers
    (empty for most text models, ``("language_model",)`` for a VLM)."""
    layers_name: str
    norm_name: str | None
    num_layers: int


def find_structure(causal_lm: nn.Module) -> Structure:
    """The :class:`Structure` of ``causal_lm``, or :class:`UnsupportedModel` naming its
    ``model_type`` and what was found."""
    config = getattr(causal_lm, "config", None)
    model_type = getattr(config, "model_type", None) or type(causal_lm).__name__
    check_config(config)
    base_name = getattr(causal_lm, "base_model_prefix", "model")
    base = getattr(causal_lm, base_name, None)
    if not isinstance(base, nn.Module) or not hasattr(causal_lm, "get_output_embeddings"):
        raise UnsupportedModel(
            f"model_type {model_type!r}: {type(causal_lm).__name__} has no base model "
            f"{base_name!r} and LM head; pass a *ForCausalLM or *ForConditionalGeneration"
        )
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else base
    path = _path_to(base, decoder)
    if path is None:
        raise UnsupportedModel(
            f"model_type {model_type!r}: its decoder ({type(decoder).__name__}) is not "
            f"inside its base model {base_name!r}"
        )
    layers_name = _layers_name(decoder)
    if layers_name is None:
        children = ", ".join(decoder._modules) or "none"
        raise UnsupportedModel(
            f"model_type {model_type!r}: no list of decoder layers in "
            f"{type(decoder).__name__} (its children: {children})"
        )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text_config, "num_hidden_layers", None) or len(decoder._modules[layers_name])
    return Structure(base_name, path, layers_name, _norm_name(decoder, layers_name), count)


def check_config(config) -> None:
    """Refuse, by its ``model_type``, a config no decoder-only model is built from."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"model_type {config.model_type!r} is an encoder-decoder model; roundpipe "
            "trains decoder-only causal LMs (and vision-language models on text)"
        )


def _path_to(root: nn.Module, target: nn.Module) -> tuple[str, ...] | None:
    if root is target:
        return ()
    for name, module in root.named_modules():
        if module is target:
            return tuple(name.split("."))
    return None


def _layers_name(decoder: nn.Module) -> str | None:
    plan = getattr(getattr(decoder, "config", None), "base_model_pp_plan", None) or {}
    for name in (*plan, *LAYER_LIST_NAMES):
        if isinstance(decoder._modules.get(name), nn.ModuleList):
            return name
    return None


def _norm_name(decoder: nn.Module, layers_name: str) -> str | None:
    plan = list(getattr(getattr(decoder, "config", None), "base_model_pp_plan", None) or {})
    after = plan[plan.index(layers_name) + 1 :] if layers_name in plan else []
    for name in (*after, *NORM_NAMES):
        if isinstance(decoder._modules.get(name), nn.Module):
            return name
    return None


def decoder_layer_modules(causal_lm: nn.Module, structure: Structure) -> list[nn.Module]:
    decoder = _decoder(getattr(causal_lm, structure.base_name), structure)
    return list(decoder._modules[structure.layers_name])[: structure.num_layers]


def _decoder(base: nn.Module, structure: Structure) -> nn.Module:
    module = base
    for name in structure.decoder_path:
        module = module._modules[name]
    return module


# -- twins: the model's own modules under a copy whose children differ ----------------------


def twin(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` (same class, same attributes, the same parameter and
    child objects) whose children ``children`` are replaced; ``module`` is unchanged."""
    copied = copy.copy(module)
    for attr in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        copied.__dict__[attr] = copy.copy(module.__dict__[attr])
    copied._modules.update(children)
    return copied


class _LayerStub(nn.Module):
    """Stands in for decoder layer ``index`` while the prologue runs: records its call and
    returns the hidden state (as a one-tuple that is also usable as the tensor's holder,
    for decoders that index the layer's output)."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.index = index
        for name, value in vars(layer).items():  # e.g. attention_type, layer_type, is_sliding
            if not name.startswith("_") and isinstance(value, _PLAIN) and name != "training":
                setattr(self, name, value)

    def forward(self, *args, **kwargs):
        return _recorder().layer(self.index, args, kwargs)


class _NormStub(nn.Module):
    def forward(self, hidden):
        return _recorder().norm(hidden)


class _Passed(tuple):
    """What a layer stub returns: ``(hidden,)``, so ``output[0]`` is the hidden state."""


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.returned: list[_Passed] = []
        self.norm_input = None
        self.norm_output = None

    def layer(self, index: int, args: tuple, kwargs: dict) -> _Passed:
        if index != len(self.calls):
            raise UnsupportedModel(f"the decoder called layer {index} out of order")
        self.calls.append((args, kwargs))
        hidden = args[0] if args else kwargs.get("hidden_states")
        hidden = hidden[0] if isinstance(hidden, _Passed) else hidden
        passed = _Passed((hidden,))
        self.returned.append(passed)
        return passed

    def norm(self, hidden):
        self.norm_input = hidden
        self.norm_output = hidden[0] if isinstance(hidden, _Passed) else hidden
        return self.norm_output


def _recorder() -> _Recorder:
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        raise RuntimeError("a roundpipe layer stub ran outside its prologue")
    return recorder


@contextlib.contextmanager
def _recording() -> Iterator[_Recorder]:
    outer = getattr(_local, "recorder", None)
    _local.recorder = _Recorder()
    try:
        yield _local.recorder
    finally:
        _local.recorder = outer


# -- what travels between stages -------------------------------------------------------------


@dataclass(frozen=True)
class LayerCall:
    """How to call one layer: where the hidden state goes (a position, or a keyword) and
    the indices into :attr:`Carried.values` of its other arguments."""

    hidden_at: int | str
    positional: tuple[int, ...]
    keywords: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Carried:
    """Between stages: the hidden state, the arguments the remaining layers take (each
    distinct value once) and the labels."""

    hidden: torch.Tensor
    values: tuple
    calls: tuple[LayerCall, ...]
    labels: torch.Tensor | None


def _carried(hidden, recorded: list[tuple[tuple, dict]], labels, model_type: str) -> Carried:
    values: list = []
    index: dict[int, int] = {}

    def slot(value) -> int:
        _check_value(value, model_type)
        if id(value) not in index:
            index[id(value)] = len(values)
            values.append(value)
        return index[id(value)]

    calls = []
    for args, kwargs in recorded:
        if args:
            at, rest, words = 0, args[1:], kwargs
        else:
            at, rest = "hidden_states", ()
            words = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        calls.append(
            LayerCall(
                at,
                tuple(slot(v) for v in rest),
                tuple((k, slot(v)) for k, v in words.items()),
            )
        )
    return Carried(hidden, tuple(values), tuple(calls), labels)


def _check_value(value, model_type: str) -> None:
    """Values that can travel: tensors, plain values, and tuples of them. A mutable
    object shared by the layers is a side channel between them, which stages cannot
    carry."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return
    if type(value) is tuple:
        for item in value:
            _check_value(item, model_type)
        return
    raise UnsupportedModel(
        f"model_type {model_type!r}: its decoder layers share an argument of type "
        f"{type(value).__name__} (a side channel between layers, e.g. shared keys and "
        "values), which pipeline stages cannot carry; roundpipe does not train this "
        "model yet"
    )


def _next(state: Carried, hidden: torch.Tensor) -> Carried:
    """``state`` after its first layer ran: its call gone, values nobody needs dropped."""
    calls = state.calls[1:]
    used = sorted({i for c in calls for i in (*c.positional, *(i for _, i in c.keywords))})
    renumber = {old: new for new, old in enumerate(used)}
    calls = tuple(
        LayerCall(
            c.hidden_at,
            tuple(renumber[i] for i in c.positional),
            tuple((k, renumber[i]) for k, i in c.keywords),
        )
        for c in calls
    )
    return Carried(hidden, tuple(state.values[i] for i in used), calls, state.labels)


# -- the RoundPipe layers ----------------------------------------------------------------------


class Prologue(nn.Module):
    """The first stage: the base model's own ``forward`` up to the first decoder layer
    (embedding, its scalars, masks, rotary tables, per-layer inputs), recorded."""

    modifies_inputs = False

    def __init__(self, causal_lm: nn.Module, structure: Structure) -> None:
        super().__init__()
        base = getattr(causal_lm, structure.base_name)
        layers = decoder_layer_modules(causal_lm, structure)
        decoder = _decoder(base, structure)
        stubs = nn.ModuleList(_LayerStub(layer, i) for i, layer in enumerate(layers))
        children: dict[str, nn.Module] = {structure.layers_name: stubs}
        if structure.norm_name is not None:
            children[structure.norm_name] = _NormStub()
        inner = twin(decoder, children)
        for depth in range(len(structure.decoder_path), 0, -1):  # twins up to the base
            parent = _decoder(base, _at_depth(structure, depth - 1))
            inner = twin(parent, {structure.decoder_path[depth - 1]: inner})
        self.base = inner
        self.model_type = causal_lm.config.model_type
        self.has_norm = structure.norm_name is not None

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        if padding_only_trails(attention_mask, labels):
            attention_mask = None  # no real token attends to a later pad under a causal mask
        with _recording() as recorder:
            out = self.base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        self._check(recorder, out)
        first_args, first_kwargs = recorder.calls[0]
        hidden = first_args[0] if first_args else first_kwargs["hidden_states"]
        return _carried(hidden, recorder.calls, labels, self.model_type)

    def probe(self) -> None:
        """Record a two-token batch on the host, so a decoder the general path cannot
        replay is refused before anything is allocated."""
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            return  # a model still being planned (from_pretrained checks it when loaded)
        ids = torch.zeros((1, 2), dtype=torch.long)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):  # draws nothing of yours
                self(ids)
        except UnsupportedModel:
            raise
        except Exception as error:  # noqa: BLE001 - any failure of the model's own code
            raise UnsupportedModel(
                f"model_type {self.model_type!r}: its decoder's own forward failed with its "
                f"layers stubbed ({type(error).__name__}: {error}); roundpipe's general "
                "path cannot run this model"
            ) from error

    def _check(self, recorder: _Recorder, out) -> None:
        name = f"model_type {self.model_type!r}"
        if not recorder.calls:
            raise UnsupportedModel(f"{name}: its decoder called no layer")
        for i in range(1, len(recorder.calls)):
            args, kwargs = recorder.calls[i]
            hidden = args[0] if args else kwargs.get("hidden_states")
            before = recorder.returned[i - 1]
            if not _is(hidden, before):
                raise UnsupportedModel(
                    f"{name}: its decoder changes the hidden state between layers {i - 1} "
                    f"and {i} (or passes values from one layer to the next), which "
                    "roundpipe's general path cannot replay"
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


def _is(value, passed: _Passed) -> bool:
    return value is passed or value is passed[0]


def _same(final, tensor: torch.Tensor) -> bool:
    """``final`` is ``tensor``, or a view of it of the same shape (GPT-2's ``view``)."""
    return final is tensor or (
        isinstance(final, torch.Tensor)
        and final.shape == tensor.shape
        and final.data_ptr() == tensor.data_ptr()
    )


def _at_depth(structure: Structure, depth: int) -> Structure:
    return Structure(
        structure.base_name,
        structure.decoder_path[:depth],
        structure.layers_name,
        structure.norm_name,
        structure.num_layers,
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

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, state: Carried) -> Carried:
        call, values = state.calls[0], state.values
        args = [values[i] for i in call.positional]
        kwargs = {k: values[i] for k, i in call.keywords}
        if call.hidden_at == 0:
            out = self.layer(state.hidden, *args, **kwargs)
        else:
            out = self.layer(*args, **{call.hidden_at: state.hidden}, **kwargs)
        return _next(state, out[0] if isinstance(out, tuple) else out)


class _HiddenOnly(dict):
    """The base model's output as the head stub gives it: ``last_hidden_state``; any
    other field is ``None``."""

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)


class _BaseStub(nn.Module):
    def forward(self, *args, inputs_embeds=None, **kwargs):
        return _HiddenOnly(last_hidden_state=inputs_embeds)


class ReplayedHead(nn.Module):
    """The final norm, then the causal LM's own head code over chunks of tokens: with
    labels, the summed cross-entropy of the shifted labels; without, the logits."""

    modifies_inputs = False

    def __init__(self, causal_lm: nn.Module, structure: Structure, chunk_tokens: int) -> None:
        super().__init__()
        decoder = _decoder(getattr(causal_lm, structure.base_name), structure)
        self.norm = decoder._modules[structure.norm_name] if structure.norm_name else None
        self.lm = twin(causal_lm, {structure.base_name: _BaseStub()})
        self.chunk_tokens = chunk_tokens
        self.vocab_size = causal_lm.get_output_embeddings().weight.shape[0]

    def forward(self, state: Carried):
        hidden = state.hidden if self.norm is None else self.norm(state.hidden)
        if state.labels is None:
            return _logits(self.lm, hidden)
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = state.labels[:, 1:].reshape(-1)
        total = hidden.new_zeros((), dtype=torch.float32)
        chunk_tokens = loss_chunk_tokens(self.chunk_tokens, self.vocab_size)
        # The head's tensors are passed in, not read from the module: the recompute runs
        # in backward, when RoundPipe has already unbound the layer's device tensors.
        names, tensors = _state(self.lm)
        for start in range(0, targets.numel(), chunk_tokens):
            piece = slice(start, start + chunk_tokens)
            args = (self.lm, names, hidden[piece], targets[piece], *tensors)
            if torch.is_grad_enabled():
                loss = checkpoint(_chunk_loss, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                loss = _chunk_loss(*args)
            total = total + loss
        return total


def _logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return lm(inputs_embeds=hidden, use_cache=False).logits


def _state(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return list(state), list(state.values())


def _chunk_loss(lm, names, hidden, targets, *tensors):
    weights = dict(zip(names, tensors, strict=True))
    logits = torch.func.functional_call(
        lm, weights, (), {"inputs_embeds": hidden.unsqueeze(0), "use_cache": False}
    ).logits
    logits = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def replayed_layers(causal_lm: nn.Module, chunk_tokens: int) -> nn.Sequential:
    """``causal_lm`` as RoundPipe layers on the general path: a :class:`Prologue`, one
    :class:`ReplayedLayer` per decoder layer and a :class:`ReplayedHead`."""
    structure = find_structure(causal_lm)
    layers = decoder_layer_modules(causal_lm, structure)
    prologue = Prologue(causal_lm, structure)
    prologue.probe()
    return nn.Sequential(
        prologue,
        *(ReplayedLayer(layer) for layer in layers),
        ReplayedHead(causal_lm, structure, chunk_tokens),
    )
