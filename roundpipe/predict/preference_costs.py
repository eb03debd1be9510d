"""The price of a preference-tuning step (DPO, KTO) on RoundPipe: ``roundpipe simulate
--method dpo|kto``.

A step is the policy's forward+backward, priced as SFT over the step's rows
(:func:`~.models.predict`), plus forward-only passes priced by the simulator's
forward-only rounds (:func:`~roundpipe.planning.sim.forward_pass.forward_pass_time`)
through the policy's plan:

- DPO, ``batch`` B pairs: the policy over 2B sequences, chosen and rejected of a pair in
  one microbatch (so a microbatch holds 2B/M rows); the reference over the same 2B.
- KTO, B examples: the policy over B sequences, a forward-only policy pass over the B
  KL rows, the reference over 2B (each example's completion and KL row together).

The reference of a LoRA policy is the same pipe with the adapters off, every step: the
base weights uploaded again, no second host copy (its host RAM is the SFT run's). A full
fine-tune's reference log-probabilities are computed once before training, by one
forward-only pass over the dataset, and kept on the host at
``REFERENCE_BYTES_PER_EXAMPLE``: nothing per step, a price per example instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.plan import Plan
from ..planning.sim.forward_pass import forward_pass_time
from .gpus import Gpu
from .model_costs import PricedModel, Workload, cost_model
from .model_specs import ModelSpec
from .models import Prediction, predict
from .unit_costs import HALF

METHODS = ("sft", "dpo", "kto")
"""``--method``: what a step trains."""
REFERENCE_BYTES_PER_EXAMPLE = 8
"""Host bytes of one example's precomputed reference: two fp32 log-probabilities (DPO:
chosen and rejected; KTO: completion and KL row)."""
PER_EXAMPLES = 1000
"""The precomputed reference's pass is priced per this many examples."""


@dataclass(frozen=True)
class PreferenceStep:
    """One preference step of ``examples`` pairs (DPO) or examples (KTO), in seconds.

    ``policy`` is RoundPipe's prediction of the policy's forward+backward over the step's
    rows (its memory, plan and fit are the step's); the forward-only times are ``None``
    when no plan fits the GPUs."""

    method: str
    examples: int
    seq_len: int
    lora: bool
    policy: Prediction
    reference_s: float | None
    """Per step: the adapters-off pass (LoRA), 0 (full: precomputed)."""
    kl_s: float | None
    """KTO's forward-only policy pass over the KL rows (``None`` for DPO)."""
    precompute_s: float | None
    """Full fine-tunes: the one reference pass, seconds per ``PER_EXAMPLES`` examples."""

    @property
    def policy_sequences(self) -> int:
        """The sequences the policy trains on each step (DPO: chosen and rejected)."""
        return 2 * self.examples if self.method == "dpo" else self.examples

    @property
    def step_s(self) -> float | None:
        if self.reference_s is None:
            return None
        return self.policy.iteration_time + self.reference_s + (self.kl_s or 0.0)

    @property
    def unit(self) -> str:
        return "pairs" if self.method == "dpo" else "examples"

    def prediction(self) -> Prediction:
        """The policy's prediction with the whole step's speed; no longest sequence (the
        SFT answer at batch 1 is not a preference step's)."""
        step = self.step_s
        if not step:
            return replace(self.policy, max_seq_len=None)
        tokens_per_s = self.policy_sequences * self.seq_len / step
        return replace(
            self.policy, tokens_per_s=tokens_per_s, iteration_time=step, max_seq_len=None
        )

    def to_dict(self) -> dict:
        step = self.step_s
        row = {
            "method": self.method,
            "policy_s": None if step is None else self.policy.iteration_time,
            "reference_s": self.reference_s,
            f"{self.unit}_per_s": self.examples / step if step else None,
            "policy_sequences": self.policy_sequences,
            "reference": "adapters_off" if self.lora else "precomputed",
            "reference_precompute_s_per_1000": self.precompute_s,
            "reference_host_bytes_per_example": 0 if self.lora else REFERENCE_BYTES_PER_EXAMPLE,
        }
        if self.method == "kto":
            row["kl_s"] = self.kl_s
        return row

    def lines(self) -> list[str]:
        """The step split into its passes, and how the reference is obtained."""
        step = self.step_s
        if step is None:
            return []
        rows = self.policy_sequences
        reference_rows = 2 * self.examples
        reference = (
            f"reference {self.reference_s:.3g} s (forward only, {reference_rows} sequences)"
            if self.lora
            else "reference 0 s (precomputed)"
        )
        kl = (
            ""
            if self.kl_s is None
            else f" + KL {self.kl_s:.3g} s (policy forward only, {self.examples} sequences)"
        )
        split = (
            f"{self.method} step {step:.3g} s = policy {self.policy.iteration_time:.3g} s "
            f"(forward+backward, {rows} sequences){kl} + {reference}; "
            f"{self.examples / step:.3g} {self.unit}/s"
        )
        if self.lora:
            how = (
                "reference: the same pipe with the LoRA adapters off each step (the base "
                "weights uploaded again; no second copy in host RAM)"
            )
        else:
            how = (
                f"reference: precomputed once before training, one forward-only pass over "
                f"the dataset: {self.precompute_s:.3g} s per {PER_EXAMPLES:,} {self.unit}; "
                f"host RAM {REFERENCE_BYTES_PER_EXAMPLE} bytes per {self.unit[:-1]} beyond "
                f"the table (multiply by the dataset's size)"
            )
        return [split, how]


def batch_text(method: str, batch: int) -> str:
    """How ``--batch`` reads under ``method``, for the header line."""
    if method == "dpo":
        return f"{batch} pairs (DPO: {2 * batch} sequences a step)"
    if method == "kto":
        return f"{batch} examples (KTO: {batch} sequences, {batch} KL rows a step)"
    return str(batch)


def predict_preference(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    method: str,
    host_ram: int | None = None,
) -> PreferenceStep:
    """One ``method`` step of ``work.batch`` pairs (DPO) or examples (KTO), microbatches
    of ``work.microbatch_size`` of them: the policy as SFT over the step's rows, the
    reference and (KTO) KL passes forward-only through the policy's plan."""
    if method not in ("dpo", "kto"):
        raise ValueError(f"--method {method!r} is not a preference method: give dpo or kto")
    (policy,) = predict(
        spec, gpu, policy_workload(method, work), num_gpus, ("roundpipe",), host_ram
    )
    lora = work.lora_rank > 0
    plan = None if policy.memory is None else policy.memory.plan
    if plan is None:
        return PreferenceStep(method, work.batch, work.seq_len, lora, policy, None, None, None)
    # the reference is the base (adapters off; a full fine-tune's initial weights) over
    # twice the rows: a pair's chosen and rejected, or an example and its KL row
    base = replace(_doubled(work), lora_rank=0)
    reference = forward_pass_seconds(spec, gpu, base, num_gpus, plan)
    kl = forward_pass_seconds(spec, gpu, work, num_gpus, plan) if method == "kto" else None
    if lora:
        return PreferenceStep(method, work.batch, work.seq_len, True, policy, reference, kl, None)
    precompute = reference / work.batch * PER_EXAMPLES
    return PreferenceStep(method, work.batch, work.seq_len, False, policy, 0.0, kl, precompute)


def policy_workload(method: str, work: Workload) -> Workload:
    """The rows the policy trains on each step: ``work`` for SFT and KTO; for DPO both
    sequences of each of its ``batch`` pairs, a pair's two in one microbatch."""
    return _doubled(work) if method == "dpo" else work


def _doubled(work: Workload) -> Workload:
    return replace(work, batch=2 * work.batch, microbatch_size=2 * work.microbatch_size)


def forward_pass_seconds(
    spec: ModelSpec, gpu: Gpu, work: Workload, num_gpus: int, plan: Plan
) -> float:
    """Seconds of one forward-only pass over ``work``'s batch through ``plan``: its rounds
    simulated (:func:`forward_pass_time`), each at least the host memory's time."""
    model = PricedModel.build(spec, gpu, work, work.tokens_per_microbatch)
    round_microbatches = work.round_microbatches(num_gpus)
    costs = cost_model(model, gpu, work, num_gpus, round_microbatches)
    simulated = forward_pass_time(
        plan, costs, num_gpus, round_microbatches, round_size=round_microbatches
    )
    round_s = max(simulated, forward_host_round_time(model, work, plan, round_microbatches))
    return round_s * work.num_microbatches / round_microbatches


def forward_host_round_time(
    model: PricedModel, work: Workload, plan: Plan, round_size: int
) -> float:
    """Seconds the host memory needs per forward-only round: every weight read once for
    its upload, and each microbatch's hidden states downloaded and uploaded again at each
    of the ``len(plan.forward)`` boundaries between the round's forward jobs (the
    forward half of :func:`~.model_costs.host_round_time`)."""
    boundary = work.tokens_per_microbatch * model.spec.hidden_size * HALF
    hops = round_size * len(plan.forward) * 2 * boundary
    return (hops + model.upload_bytes) / work.host_bandwidth
