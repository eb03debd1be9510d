"""``roundpipe train`` and long sequences: the layers tiled (every layer's input saved)
when a microbatch needs it, a clear refusal with the predicted maximum when nothing
fits (docs/design.md#long-context)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from roundpipe.core.tiling import DEFAULT_SEQ_CHUNK_TOKENS
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.model_specs import ModelSpec
from roundpipe.predict.models import Workload, max_seq_len
from roundpipe.train.long_context import CHUNKS, fit_sequences, sequence_setting, tiling_note
from roundpipe.train.ranks import Ranks
from roundpipe.train.usage import UsageError

LLAMA_8B = {  # meta-llama/Llama-3.1-8B's config.json, the shape entries
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
GPU_24GB = 24 * 2**30


def test_short_sequences_keep_the_default_layers():
    setting = sequence_setting(LLAMA_8B, 2048, 1, [GPU_24GB] * 8, "bf16")
    assert setting.seq_chunk_tokens is None and setting.recompute_grain == "stage"


def test_a_sequence_too_long_for_untiled_layers_tiles_them_and_saves_every_input():
    setting = sequence_setting(LLAMA_8B, 131072, 1, [GPU_24GB] * 8, "bf16")
    assert setting.seq_chunk_tokens == DEFAULT_SEQ_CHUNK_TOKENS
    assert setting.recompute_grain == "layer" and setting.finest


def test_a_sequence_near_the_untiled_limit_gets_the_plan_the_prediction_is_of():
    setting = sequence_setting(LLAMA_8B, 40960, 1, [GPU_24GB] * 8, "bf16")
    assert setting.seq_chunk_tokens is None
    assert setting.recompute_grain == "layer" and setting.finest


def test_the_smallest_device_decides():
    small = [GPU_24GB] * 7 + [8 * 2**30]
    with pytest.raises(UsageError, match=r"smallest device \(8\.0 GiB\)"):
        sequence_setting(LLAMA_8B, 131072, 1, small, "bf16")


def test_a_sequence_nothing_fits_is_refused_with_the_predicted_maximum():
    predicted = max_seq_len(  # with the smallest chunk: the longest any setting trains
        ModelSpec.from_config(LLAMA_8B),
        replace(gpu_preset("rtx4090"), memory_bytes=GPU_24GB),
        Workload(2048, 1),
        seq_chunk_tokens=CHUNKS[-1],
    ).max_seq_len
    with pytest.raises(UsageError) as refused:
        sequence_setting(LLAMA_8B, 1 << 20, 1, [GPU_24GB], "bf16")
    message = str(refused.value)
    assert f"the longest sequence predicted to train on it is {predicted} tokens" in message
    assert "lower --seq-len" in message and "roundpipe simulate --max-seq-len" in message
    # two rows per microbatch need twice the tokens; fp32 twice the bytes
    assert sequence_setting(LLAMA_8B, predicted // 2, 1, [GPU_24GB], "bf16").seq_chunk_tokens
    with pytest.raises(UsageError, match=r"2 sequences of .*--microbatches"):
        sequence_setting(LLAMA_8B, predicted // 2 + 512, 2, [GPU_24GB], "bf16")
    with pytest.raises(UsageError):
        sequence_setting(LLAMA_8B, predicted // 2 + 512, 1, [GPU_24GB], "fp32")


def test_unbounded_devices_and_unreadable_configs_change_nothing():
    assert sequence_setting(LLAMA_8B, 1 << 20, 1, [None, None], "bf16").seq_chunk_tokens is None
    assert (
        sequence_setting({"hidden_size": 8}, 1 << 20, 1, [GPU_24GB], "bf16").seq_chunk_tokens
        is None
    )


def _options(seq_len: int, batch_size: int = 1, precision: str = "fp32") -> SimpleNamespace:
    return SimpleNamespace(
        seq_len=seq_len,
        batch_size=batch_size,
        full=True,
        quantize="none",
        precision=precision,
        lora_r=0,
        optimizer_states="fp32",
        master_weights="fp32",
    )


class _Pipe:
    """What fit_sequences reads of an HFRoundPipe."""

    def __init__(self, capacity: int) -> None:
        import roundpipe

        self.pool = [SimpleNamespace(memory_capacity=lambda: capacity)]
        self.hf_model = SimpleNamespace(config=SimpleNamespace(to_dict=lambda: LLAMA_8B))
        self.run_config = roundpipe.RoundPipeRunConfig(num_microbatch=1)
        self.num_layers = LLAMA_8B["num_hidden_layers"] + 2
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_fit_sequences_sets_the_run_config_or_closes_the_pipe_and_refuses():
    pipe = _Pipe(48 * 2**30)
    fit_sequences(pipe, _options(65536), Ranks())  # fp32: 131072 16-bit tokens' bytes
    assert pipe.run_config.seq_chunk_tokens == DEFAULT_SEQ_CHUNK_TOKENS
    assert pipe.run_config.recompute_grain == "layer"
    assert str(pipe.run_config.execute_plan) == ",".join(["1"] * 33) + "|" + ",".join(["1"] * 34)
    assert tiling_note(pipe) == (
        ", one layer per stage tiled in 4096-token chunks, every layer's input saved"
    )
    refused = _Pipe(8 * 2**30)
    with pytest.raises(UsageError):
        fit_sequences(refused, _options(1 << 20), Ranks())
    assert refused.closed
    short = _Pipe(48 * 2**30)
    fit_sequences(short, _options(1024), Ranks())
    assert short.run_config.seq_chunk_tokens is None and tiling_note(short) == ""
    assert not short.closed


@pytest.mark.parametrize("capacity_mib", [40, 60, 100])
def test_what_fit_sequences_chooses_trains_in_the_emulated_capacity(capacity_mib):
    """The oracle is the device: a capacity that counts what layers compute. Each
    capacity gets another setting (tiles of 1024 or 2048 tokens, or no tiles), and one
    step of 8192 tokens trains in it with the loss of an unbounded run."""
    pytest.importorskip("transformers")
    from support.long_context_models import llama, long_batch

    import roundpipe
    from roundpipe import EmulatedOptions, RoundPipeRunConfig

    batch = long_batch(8192, packed=True)
    with roundpipe.from_hf(
        llama(), devices="emulated:1", model_run_config=RoundPipeRunConfig(num_microbatch=1)
    ) as free:
        want = free.forward_backward(input_kwargs=batch).item()
    options = EmulatedOptions(capacity_bytes=capacity_mib * 2**20, count_compute_memory=True)
    pipe = roundpipe.from_hf(
        llama(),
        devices="emulated:1",
        model_run_config=RoundPipeRunConfig(num_microbatch=1),
        emulated_options=options,
    )
    with pipe:
        fit_sequences(pipe, _options(8192, precision="bf16"), Ranks())
        assert pipe.run_config.recompute_grain == "layer"
        loss = pipe.forward_backward(input_kwargs=batch).item()
        assert pipe.device_memory()[0]["peak"] <= capacity_mib * 2**20
    assert loss == pytest.approx(want, rel=1e-2)  # bf16: tiled sums in another order


def test_a_capacity_nothing_fits_is_refused_before_training():
    pytest.importorskip("transformers")
    from support.long_context_models import llama

    import roundpipe
    from roundpipe import EmulatedOptions

    options = EmulatedOptions(capacity_bytes=20 * 2**20, count_compute_memory=True)
    pipe = roundpipe.from_hf(llama(), devices="emulated:1", emulated_options=options)
    with pytest.raises(UsageError, match="does not fit the smallest device"):
        fit_sequences(pipe, _options(8192, precision="bf16"), Ranks())
    assert pipe.runtime.closed


def test_a_model_on_the_general_path_keeps_its_layers_as_they_are():
    """Only our own adapter's layers tile; the general path's are the model's own."""
    gemma = {**LLAMA_8B, "model_type": "gemma3_text"}
    setting = sequence_setting(gemma, 131072, 1, [GPU_24GB] * 8, "bf16")
    assert setting.seq_chunk_tokens is None and not setting.finest


def test_the_longest_sequence_of_a_general_path_model_is_the_untiled_laws():
    gpu = replace(gpu_preset("rtx4090"), memory_bytes=GPU_24GB)
    work = Workload(2048, 1)
    own = ModelSpec.from_config(LLAMA_8B)
    assert own.tiled_layers
    assert not ModelSpec.from_config({**LLAMA_8B, "model_type": "gemma3_text"}).tiled_layers
    general = replace(own, tiled_layers=False)
    untiled = max_seq_len(own, gpu, work, seq_chunk_tokens=None).max_seq_len
    assert max_seq_len(general, gpu, work).max_seq_len == untiled
    assert max_seq_len(own, gpu, work).max_seq_len > untiled
