"""The reference QLoRA model for the NF4 tests: transformers + bitsandbytes + peft on CPU.

``reference_qlora`` loads a saved model directory the way users quantize one
(``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, no double
quantization, as RoundPipe's format) and wraps it with ``peft.get_peft_model``;
``set_adapters`` gives the adapters of any peft model the same non-trivial values
(lora_B starts at zero, which would leave lora_A without a gradient).
"""

from __future__ import annotations

import json
import zlib

import torch

SIZES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    attn_implementation="sdpa",
)
"""Every linear's rows a multiple of the 64-element block: bitsandbytes' AVX-512 CPU
dequantize kernel counts blocks per row, which gives wrong weights for shorter rows
(its CUDA, scalar CPU and reference paths count them over the flat weight, as
RoundPipe does); real models' widths are multiples of 64."""


def build_model(family: str):
    """A tiny Llama, Qwen2 or Qwen3 (tied embeddings) of :data:`SIZES` (seeded)."""
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    if family == "qwen2":  # biased q, k, v projections
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES))
    if family == "qwen3":
        config = transformers.Qwen3Config(**SIZES, tie_word_embeddings=True)
        return transformers.Qwen3ForCausalLM(config)
    raise AssertionError(family)


def reference_qlora(directory, lora, dtype=torch.float32):
    import peft
    import transformers

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=dtype,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=config, dtype=dtype, device_map="cpu"
    )
    for module in model.modules():
        # On AVX512-BF16 CPUs an eval-mode forward repacks the weights into an
        # inference layout, which fails for layers narrower than its tiles; the format
        # compared is the one bitsandbytes quantizes to.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return peft.get_peft_model(model, lora)


def set_adapters(model, scale: float = 0.05) -> None:
    """Every adapter weight of ``model`` set to values drawn from its name."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                values = torch.randn(param.shape, generator=generator) * scale
                param.copy_(values.to(param.dtype))


def adapter_grads(named_parameters) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in named_parameters if "lora_" in name}


def nf4_bytes_of(module) -> tuple[torch.Tensor, torch.Tensor]:
    """The NF4 bytes and scales of a bitsandbytes ``Linear4bit``."""
    weight = module.weight
    return weight.data.reshape(-1), weight.quant_state.absmax


def losses_around_a_checkpoint(open_pipe, checkpoint, batch, load: bool) -> list[float]:
    """The losses of two calls around a step of a pipe from ``open_pipe()`` (AdamW),
    after one step saved at ``checkpoint`` (``load=False``) or after loading it
    (``load=True``); ``batch(seed)`` gives each call's inputs. Equal lists: the resume
    is exact."""
    with open_pipe() as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        if load:
            pipe.load_checkpoint(checkpoint, optimizer=optimizer)
        else:
            pipe.forward_backward(input_kwargs=batch(seed=0))
            pipe.step(step)
            pipe.save_checkpoint(checkpoint, optimizer=optimizer)
        losses = [float(pipe.forward_backward(input_kwargs=batch(seed=1)))]
        pipe.step(step)
        losses.append(float(pipe.forward_backward(input_kwargs=batch(seed=2))))
    return losses


def adapter_config(folder) -> dict:
    """``folder``'s adapter_config.json, its target_modules as a set: peft writes its set
    of targets in the set's iteration order, which hangs on the string hash seed."""
    config = json.loads((folder / "adapter_config.json").read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = set(config["target_modules"])
    return config
