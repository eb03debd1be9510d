"""The shape of a decoder-only transformer, and the parameter counts that follow from it.

A :class:`ModelSpec` comes from a named preset (the published configs, no hub downloads)
or from any supported Hugging Face config, dense or mixture-of-experts. Which counts
decide memory, uploads and compute, and where LoRA adapters sit:
docs/design.md#model-shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers of a decoder-only transformer."""

    name: str
    hidden_size: int
    intermediate_size: int
    """The dense MLP's width (0 in an all-MoE model)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sliding_window: int | None = None
    window_layers: int = 0
    """How many layers use the sliding window (the rest attend to the whole sequence)."""
    qk_norm: bool = False
    """RMSNorm on every query and key head (Qwen3)."""
    biases: bool = False
    """Biases on every projection, attention sinks (gpt-oss)."""
    sinks: bool = False
    """A learned sink logit per attention head (gpt-oss): its attention runs through
    ``roundpipe.hf.attention``'s sink path."""

    @classmethod
    def from_config(cls, config: Mapping | object, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face config (dict or ``PretrainedConfig``), named by its
        ``_name_or_path``, else ``name``, else its architecture and size
        ("Qwen3ForCausalLM 1.7B"): a saved config.json has no ``_name_or_path``."""
        values = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # type: ignore[arg-type]
        spec = cls._read(values)
        given = values.get("name_or_path") or values.get("_name_or_path") or name
        return replace(spec, name=given or f"{_architecture(values)} {_size(spec.num_params)}")

    @classmethod
    def _read(cls, values: Mapping) -> ModelSpec:
        try:
            hidden, heads = values["hidden_size"], values["num_attention_heads"]
            experts = values.get("num_experts") or values.get("num_local_experts") or 0
            top_k = values.get("num_experts_per_tok") or values.get("experts_per_token") or 0
            if experts and not top_k:
                raise ValueError(
                    f"the MoE config has {experts} experts but no num_experts_per_tok "
                    "(or experts_per_token) entry"
                )
            dense_mlp = values.get("intermediate_size", 0)
            model_type = values.get("model_type", "")
            return cls(
                name="",
                hidden_size=hidden,
                intermediate_size=0 if experts else dense_mlp,
                num_layers=values["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=values.get("num_key_value_heads") or heads,
                head_dim=values.get("head_dim") or hidden // heads,
                vocab_size=values["vocab_size"],
                tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
                num_experts=experts,
                experts_per_token=top_k if experts else 0,
                moe_intermediate_size=(values.get("moe_intermediate_size") or dense_mlp)
                if experts
                else 0,
                sliding_window=values.get("sliding_window"),
                window_layers=_window_layers(values),
                qk_norm=model_type.startswith("qwen3"),
                biases=model_type == "gpt_oss" or bool(values.get("attention_bias", False)),
                sinks=model_type == "gpt_oss",
            )
        except KeyError as missing:
            raise ValueError(f"the model config has no {missing} entry") from None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """q, k, v, o projections (+ biases and sinks, + q/k norm weights)."""
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        params = h * (2 * q + 2 * kv)
        if self.biases:
            params += q + 2 * kv + h + self.num_heads
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    @property
    def expert_params(self) -> int:
        """One expert (or the dense MLP): gate, up and down projections."""
        h, i = self.hidden_size, self.moe_intermediate_size or self.intermediate_size
        return 3 * h * i + (2 * i + h if self.biases else 0)

    @property
    def linear_weight_params(self) -> int:
        """One decoder layer's linear weights, what NF4 quantizes: the attention
        projections (``roundpipe.hf.nf4``) and the MLP's gate, up and down, every
        expert's in an MoE layer (``roundpipe.hf.nf4_experts``); biases, norms and the
        router stay in the model dtype."""
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        if self.is_moe:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size
        else:
            mlp = 3 * h * self.intermediate_size
        return h * (2 * q + 2 * kv) + mlp

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts + (self.num_experts if self.biases else 0)

    @property
    def layer_params(self) -> int:
        """Every parameter of one decoder layer (all experts)."""
        mlp = self.num_experts * self.expert_params + self.router_params if self.is_moe else 0
        dense = 3 * self.hidden_size * self.intermediate_size
        return self.attention_params + (mlp if self.is_moe else dense) + 2 * self.hidden_size

    @property
    def active_layer_params(self) -> int:
        """The parameters one token computes with: attention, router, its top-k experts."""
        if not self.is_moe:
            return self.layer_params
        experts = self.experts_per_token * self.expert_params
        return self.attention_params + self.router_params + experts + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Unique parameters (a tied embedding once), the final norm included."""
        embeddings = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters a token computes with: layers' active ones and the LM head."""
        return self.num_layers * self.active_layer_params + self.embedding_params

    @property
    def upload_params(self) -> int:
        """Parameters uploaded per pass over the pipeline (a tied embedding at both ends)."""
        return self.num_layers * self.layer_params + 2 * self.embedding_params + self.hidden_size

    def lora_layer_params(self, rank: int) -> int:
        """Adapter parameters of one layer: rank x (in + out) per adapted projection."""
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        adapted = [(h, q), (h, kv), (h, kv), (q, h)]
        if not self.is_moe:
            i = self.intermediate_size
            adapted += [(h, i), (h, i), (i, h)]
        return rank * sum(a + b for a, b in adapted)

    def lora_params(self, rank: int) -> int:
        return self.num_layers * self.lora_layer_params(rank)


def _architecture(values: Mapping) -> str:
    architectures = values.get("architectures") or ()
    return architectures[0] if architectures else values.get("model_type") or "decoder"


def _size(num_params: int) -> str:
    """A parameter count as model names spell it: 1.7B, 494M, 86.9K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_params >= scale:
            return f"{num_params / scale:.3g}{suffix}"
    return str(num_params)


def _window_layers(values: Mapping) -> int:
    types = values.get("layer_types")
    if types:
        return sum(t == "sliding_attention" for t in types)
    if values.get("sliding_window") and values.get("use_sliding_window"):
        return values["num_hidden_layers"]
    return 0


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name.lower(): spec
    for spec in (
        ModelSpec("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936, True, qk_norm=True),
        ModelSpec("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, qk_norm=True),
        ModelSpec("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256),
        ModelSpec(
            "gpt-oss-20b",
            2880,
            0,
            24,
            64,
            8,
            64,
            201088,
            num_experts=32,
            experts_per_token=4,
            moe_intermediate_size=2880,
            sliding_window=128,
            window_layers=12,
            biases=True,
            sinks=True,
        ),
        ModelSpec("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, qk_norm=True),
        ModelSpec(
            "Qwen3-30B-A3B",
            2048,
            0,
            48,
            32,
            4,
            128,
            151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
            qk_norm=True,
        ),
        ModelSpec(
            "Qwen3-235B-A22B",
            4096,
            0,
            94,
            64,
            4,
            128,
            151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=1536,
            qk_norm=True,
        ),
    )
}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(s.name for s in MODEL_PRESETS.values())
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {known}; "
            "for any other model give --config path/to/config.json"
        ) from None
