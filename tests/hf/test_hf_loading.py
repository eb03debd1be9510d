"""``roundpipe.from_pretrained``: streaming safetensors loading and the memory-mapped LoRA base.

Oracles: ``transformers.AutoModelForCausalLM.from_pretrained`` (every parameter and
buffer, tying, dtype conversion, logits), ``peft`` (an adapter saved by the pipe
reloads onto the transformers-loaded base with the pipe's logits), ``/proc/self/maps``
(a LoRA base weight lies in a mapping of its checkpoint file) and, in child
processes, the peak host memory of loading a generated ~1.5 GB checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.children.harness import CHILDREN, child_result, finish_child, run_child, start_child

import roundpipe
from roundpipe.devices.cuda import CudaDevicePool
from roundpipe.hf.safetensors_io import CheckpointError, FileMappings, read_header

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.hf_families import VOCAB, build  # noqa: E402  (qwen3: tied embeddings)


def saved(model, directory: Path, sharded: bool = False) -> Path:
    """``model`` written by ``save_pretrained`` (in shards of a few KB if ``sharded``)."""
    model.save_pretrained(directory, **({"max_shard_size": "40KB"} if sharded else {}))
    return directory


def ids_and_mask(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def all_tensors(model) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


@pytest.mark.parametrize(
    "family, sharded, dtype",
    [
        ("llama", False, torch.float32),
        ("llama", True, torch.bfloat16),
        ("qwen3", False, torch.bfloat16),
        ("qwen3", True, torch.float32),
        ("qwen3_moe", True, torch.bfloat16),
        ("gpt_oss", False, torch.float16),
    ],
)
def test_the_streamed_model_equals_transformers_from_pretrained(tmp_path, family, sharded, dtype):
    directory = saved(build(family), tmp_path, sharded)  # the files hold fp32
    if sharded:
        assert (directory / "model.safetensors.index.json").is_file()
    want = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    with roundpipe.from_pretrained(directory, torch_dtype=dtype, devices="emulated:2") as pipe:
        got = pipe.hf_model
        want_tensors, got_tensors = all_tensors(want), all_tensors(got)
        assert list(got_tensors) == list(want_tensors)
        for name, tensor in want_tensors.items():
            assert got_tensors[name].dtype == tensor.dtype, name
            assert torch.equal(got_tensors[name], tensor), name
        tied = got.get_output_embeddings().weight is got.get_input_embeddings().weight
        assert tied == (family == "qwen3")
        assert got.training == want.training
        batch = ids_and_mask()
        with torch.no_grad():
            want_logits = want(**batch).logits
            assert torch.equal(got(**batch).logits, want_logits)
            torch.testing.assert_close(pipe(**batch), want_logits)


def mapped_file_of(address: int) -> str | None:
    """The path of the mapping that holds ``address`` in this process (a file, or a
    pseudo name such as ``[heap]``), if it has one."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def checkpoint_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


def test_lora_base_weights_are_copy_on_write_views_of_the_checkpoint_files(tmp_path):
    directory = saved(build("llama"), tmp_path / "base", sharded=True)
    files = {str(p.resolve()) for p in directory.glob("*.safetensors")}
    before = checkpoint_bytes(directory)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    pipe = roundpipe.from_pretrained(
        directory, torch_dtype=torch.float32, lora=lora, devices="emulated:2"
    )
    with pipe:
        named = list(pipe.hf_model.named_parameters())
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        adapters = [(n, p) for n, p in named if p.requires_grad]
        assert frozen and adapters
        for name, param in frozen:
            assert mapped_file_of(param.data_ptr()) in files, name
        for name, param in adapters:
            assert mapped_file_of(param.data_ptr()) not in files, name
    embedding = pipe.hf_model.get_base_model().model.embed_tokens.weight
    stored = embedding.detach().clone()
    with torch.no_grad():
        embedding.add_(1.0)  # a write goes to a private copy of the pages, not to the file
    assert checkpoint_bytes(directory) == before
    torch.testing.assert_close(embedding.detach(), stored + 1.0)


def test_lora_base_weights_stored_in_another_dtype_are_converted_copies(tmp_path):
    directory = saved(build("llama"), tmp_path)  # fp32 files, a bf16 model
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"])
    with roundpipe.from_pretrained(
        directory, torch_dtype=torch.bfloat16, lora=lora, devices="emulated:1"
    ) as pipe:
        base = pipe.hf_model.get_base_model()
        want = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        weight = base.model.layers[0].mlp.up_proj.weight
        assert weight.dtype == torch.bfloat16
        assert mapped_file_of(weight.data_ptr()) != str((directory / "model.safetensors").resolve())
        assert torch.equal(weight, want.model.layers[0].mlp.up_proj.weight)


def test_lora_adapters_train_and_save_an_adapter_peft_reloads(tmp_path):
    directory = saved(build("qwen3"), tmp_path / "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    batch = {**ids_and_mask(), "labels": ids_and_mask()["input_ids"]}
    with roundpipe.from_pretrained(
        directory, torch_dtype=torch.float32, lora=lora, devices="emulated:2"
    ) as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=2e-2)
        losses = []
        for _ in range(4):
            losses.append(float(pipe.forward_backward(input_kwargs=batch)))
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.save_pretrained(tmp_path / "adapter")
        with torch.no_grad():
            logits = pipe(**ids_and_mask(seed=1))
    assert losses[-1] < losses[0], losses
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        want = reloaded(**ids_and_mask(seed=1)).logits
    torch.testing.assert_close(logits, want)
    with torch.no_grad(), reloaded.disable_adapter():
        base_logits = reloaded(**ids_and_mask(seed=1)).logits
    assert not torch.allclose(want, base_logits)  # the adapter changed the model


def test_a_file_mapped_tensor_is_never_page_locked(tmp_path):
    path = tmp_path / "probe.safetensors"
    save_file({"w": torch.arange(8.0)}, path)
    view = FileMappings().view(read_header(path)["w"])
    assert torch.equal(view, torch.arange(8.0))
    pool = object.__new__(CudaDevicePool)  # pin must return before any CUDA call
    for mode in ("auto", "register", "alloc"):
        assert CudaDevicePool.pin(pool, view, mode) is view


def _drop_tensor(directory: Path) -> None:
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _add_tensor(directory: Path) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(3)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _reshape_tensor(directory: Path) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(31)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _truncate(directory: Path) -> None:
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _corrupt_header(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[9:20] = b"#" * 11
    path.write_bytes(bytes(data))


def _no_safetensors(directory: Path) -> None:
    (directory / "model.safetensors").unlink()


@pytest.mark.parametrize(
    "damage, message",
    [
        (_drop_tensor, r"lacks 1 tensor\(s\) the model needs: model\.norm\.weight"),
        (_add_tensor, r"model\.safetensors hold\(s\) 1 tensor\(s\) .*: model\.extra\.weight"),
        (_reshape_tensor, r"'model\.norm\.weight' in .*model\.safetensors has shape \[31\]"),
        (_truncate, r"model\.safetensors is truncated: tensor '.*' ends at byte \d+"),
        (_corrupt_header, r"model\.safetensors has a corrupt safetensors header"),
        (_no_safetensors, r"has no model\.safetensors and no model\.safetensors\.index\.json"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_tensor(tmp_path, damage, message):
    directory = saved(build("llama"), tmp_path)
    damage(directory)
    with pytest.raises(CheckpointError, match=message):
        roundpipe.from_pretrained(directory, devices="emulated:1")


def test_a_missing_shard_is_named(tmp_path):
    directory = saved(build("llama"), tmp_path, sharded=True)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names the shard {shard.name}, which is missing"):
        roundpipe.from_pretrained(directory, devices="emulated:1")


def test_an_unsupported_model_is_refused_before_its_weights_are_read(tmp_path):
    config = transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=64)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"model_type 't5' is an encoder-decoder model"):
        roundpipe.from_pretrained(tmp_path, devices="emulated:1")


@pytest.mark.slow  # 19 s
def test_loading_a_1_5_gb_checkpoint_stays_within_its_host_memory_bounds(tmp_path):
    """Full model: peak RSS ≤ 1.15 × weights + 1 GB (the imports take ~0.4 GB); the fp32
    masters RoundPipe makes by design on first use are separate tensors (``ensure_masters``
    copies with ``copy=True``, fp32 or not) and add exactly their own bytes.

    LoRA: the base stays in the files' mappings (file pages, not anonymous memory). What
    anonymous memory grows by is what the two emulated devices hold by design — at most
    ``prefetch_stages + 1 = 2`` stages each, one layer a stage here — plus 256 MB of slack
    for the adapters, activations and what the emulator threads' malloc arenas keep.
    """
    directory = tmp_path / "checkpoint"
    try:
        full, lora, weight_bytes = measure_loading(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # 1.5 GB: not left to pytest's tmp dirs
    assert 1.4e9 < weight_bytes < 1.6e9
    gib = 1 << 30
    bound = 1.15 * weight_bytes + gib
    assert full["loaded_peak_rss"] <= bound, full
    assert full["masters_bytes"] == 2 * weight_bytes  # bf16 weights, fp32 masters
    assert full["masters_peak_rss"] <= bound + full["masters_bytes"], full

    assert lora["mapped_bytes"] == weight_bytes  # the whole base is a view of the files
    devices_hold = 2 * 2 * lora["largest_layer_bytes"]
    assert lora["peak_anon"] - lora["baseline_anon"] <= devices_hold + (256 << 20), lora
    assert lora["peak_anon"] < 0.5 * weight_bytes + (300 << 20), lora
    assert lora["loss"] == lora["loss"]  # not NaN: the mapped weights were read


def measure_loading(directory: Path) -> tuple[dict, dict, int]:
    """Generate the checkpoint, then measure the full and the LoRA load in two fresh
    processes at once (each reports its own peak)."""
    generate = os.path.join(CHILDREN, "hf_load_generate.py")
    measure = os.path.join(CHILDREN, "hf_load_measure.py")
    weight_bytes = run_child([generate, str(directory)], 120)
    full = start_child([measure, "full", str(directory)])
    try:
        lora = run_child([measure, "lora", str(directory)], 180)
    finally:
        full_result = finish_child(full, 180)
    return child_result(*full_result, "full load"), lora, weight_bytes["weight_bytes"]
