"""Long sequences: tiled MLP and norms, attention per packed example, and the memory law
they give a decoder layer's backward (docs/design.md#long-context).

Oracles: the Hugging Face model itself (losses and gradients in float32), the same
pipe untiled, and the emulated device's memory counting what layers compute."""

from __future__ import annotations

import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.architectures import hf_loss_and_grads  # noqa: E402
from support.hf_families import assert_trains_as_hf, build  # noqa: E402
from support.long_context_models import llama, long_batch  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import EmulatedOptions, RoundPipeRunConfig  # noqa: E402
from roundpipe.predict.model_specs import ModelSpec  # noqa: E402
from roundpipe.predict.unit_costs import tiled_layer_bytes  # noqa: E402

PLAN = "1,1,1|1,1,1,1"  # embedding, two decoder layers, head: each its own stage
CHUNK = 256


def run(model, batch, chunk: int | None, capacity: int | None = None) -> tuple[float, int]:
    """One training call on one emulated device, a stage per unit, every layer's input
    saved: the loss and the device's peak bytes."""
    config = RoundPipeRunConfig(
        num_microbatch=1, recompute_grain="layer", execute_plan=PLAN, seq_chunk_tokens=chunk
    )
    options = EmulatedOptions(capacity_bytes=capacity, count_compute_memory=True)
    with roundpipe.from_hf(
        model, devices="emulated:1", model_run_config=config, emulated_options=options
    ) as pipe:
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
        return loss.item(), pipe.device_memory()[0]["peak"]


def bytes_per_token(
    tokens: int, packed: bool, chunk: int | None, intermediate: int = 344, family: str = "llama"
):
    """The device's peak less three copies of the weights (a stage's, the prefetched
    one's and the gradients), per token."""
    model = llama(intermediate, family=family)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    _, peak = run(model, long_batch(tokens, packed), chunk)
    return (peak - 3 * weights) / tokens


# -- the model stays transformers' ---------------------------------------------------------
# (tiled packed training against the Hugging Face model: tests/hf/test_hf_packing.py)


def test_tiling_leaves_the_model_as_transformers_runs_and_saves_it(tmp_path):
    model = llama(dtype=torch.float32)
    keys = list(model.state_dict())
    batch = long_batch(600, packed=True, example=200)
    with torch.no_grad():
        before = model(**batch).loss
    with roundpipe.from_hf(
        model,
        devices="emulated:1",
        model_run_config=RoundPipeRunConfig(num_microbatch=1, seq_chunk_tokens=100),
    ) as pipe:
        pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
        pipe.save_pretrained(tmp_path)
    assert list(model.state_dict()) == keys
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # outside RoundPipe: no tiling, the same loss
        torch.testing.assert_close(model(**batch).loss, before)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert list(reloaded.state_dict()) == keys
    copied = pickle.loads(pickle.dumps(model))  # the tiled forwards pickle with it
    with torch.no_grad():
        torch.testing.assert_close(copied(**batch).loss, before)


# -- the memory law -----------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_a_tiled_layers_backward_memory_per_token_does_not_grow_with_the_sequence(packed):
    per_token = [bytes_per_token(s, packed, CHUNK) for s in (4096, 8192, 16384)]
    assert max(per_token) <= 1.10 * min(per_token), per_token


def test_a_tiled_layers_memory_hardly_moves_when_the_mlp_doubles():
    tiled = [bytes_per_token(8192, True, CHUNK, width) for width in (344, 688)]
    assert abs(tiled[1] / tiled[0] - 1) < 0.10, tiled
    untiled = [bytes_per_token(8192, True, None, width) for width in (344, 688)]
    assert untiled[1] / untiled[0] > 1.3, untiled  # what tiling removed


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_windows_and_sinks_need_no_s_by_s_tensor(family):
    """Sliding windows run as blocks of queries, GPT-OSS's sinks through SDPA: the memory
    per token does not grow with S (an S x S mask or score tensor would double it from
    8K to 16K); a block's working set is a constant, which longer sequences amortise."""
    per_token = [bytes_per_token(s, packed, CHUNK, family=family) for s in (8192, 16384)
                 for packed in (False, True)]  # fmt: skip
    assert per_token[2] <= 1.1 * per_token[0] and per_token[3] <= 1.1 * per_token[1]


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_tiled_training_with_windows_and_sinks_equals_the_hugging_face_model(family):
    """Two rows in one microbatch (GPT-OSS's router scores come flattened over both),
    MLPs in chunks of 5 tokens, windows of 4 (Mistral) or of 4 on alternate layers with
    sinks (GPT-OSS, its sinks made nonzero): in fp32, as transformers computes it."""
    model = build(family)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    config = RoundPipeRunConfig(num_microbatch=1, seq_chunk_tokens=5)
    assert_trains_as_hf(model, {"input_ids": ids, "labels": ids.clone()}, config)


def test_a_right_padded_training_batch_needs_no_s_by_s_mask():
    model = llama()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    padded = long_batch(8192, packed=False)
    padded["attention_mask"] = torch.ones_like(padded["input_ids"])
    padded["attention_mask"][:, 6000:] = 0  # the last 2192 tokens are padding
    padded["labels"][:, 6000:] = -100
    _, peak = run(model, padded, CHUNK)
    causal = bytes_per_token(8192, False, CHUNK)
    assert (peak - 3 * weights) / 8192 <= 1.05 * causal  # an S x S mask: +8 KB a token


@pytest.mark.parametrize(
    ("family", "packed"), [("llama", True), ("qwen3", True), ("gpt_oss", False)]
)
def test_the_predicted_law_matches_the_emulated_device(family, packed):
    """The bytes the predictor charges a tiled layer (roundpipe.predict) against what the
    emulated device measured for the same shapes (GPT-OSS unpacked: its sinks' path is
    costliest over one long example)."""
    spec = ModelSpec.from_config(llama(family=family).config)
    for tokens in (8192, 16384):
        measured = bytes_per_token(tokens, packed, CHUNK, family=family) * tokens
        predicted = tiled_layer_bytes(spec, tokens, CHUNK)
        # never under (a run it admits must fit), at most a fifth over (one chunk's
        # working set is counted beside the per-token peak, an upper bound)
        assert 0.95 * measured <= predicted <= 1.2 * measured, (tokens, predicted, measured)


def test_a_sequence_too_long_untiled_trains_tiled_in_the_same_capacity():
    model = llama(dtype=torch.float32)
    batch = long_batch(4096, packed=True)
    untiled_loss, untiled_peak = run(model, batch, None)
    untiled_grads = {name: param.grad for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, tiled_peak = run(model, batch, CHUNK)
    assert tiled_peak < 0.8 * untiled_peak
    capacity = (tiled_peak + untiled_peak) // 2
    with pytest.raises(torch.OutOfMemoryError):
        run(model, batch, None, capacity)
    model.zero_grad(set_to_none=True)
    want, want_grads = hf_loss_and_grads(model, batch, use_cache=False)
    loss, _ = run(model, batch, CHUNK, capacity)
    assert loss == pytest.approx(untiled_loss, rel=1e-5)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(param.grad, untiled_grads[name], rtol=1e-4, atol=1e-6)
