"""The paper's four simulator cases, and the paper's plans to judge the planner against.

The four dense runs of the RoundPipe paper (docs/design.md#predictions): Qwen3-1.7B,
Llama-3.1-8B, gpt-oss-20b and Qwen3-32B, full fine-tuning on 8× RTX 4090 in fp16 with
fp16 accumulation, 2048-token sequences, global batches of 512, 256, 128 and 128
sequences. Each is priced as ``roundpipe simulate --model`` prices it: one round (one
``forward_backward`` call) of 4 × 8 microbatches, its share of the optimizer step, every
device's usable memory as its budget. The paper's plans for a case are its rule
(:func:`~roundpipe.planning.rules.paper_greedy_plan`) and the best hand-tuned plan with
stages of one size (:func:`~roundpipe.planning.rules.equal_size_plans`, every fused and
stage size that fits the budgets), each judged on the objective at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.plan import Plan
from ..planning.partition import equal_size_plans, fits, paper_greedy_plan, predict_iteration_time
from ..planning.sim.costs import CostModel
from .breakdown import Budget
from .gpus import gpu_preset
from .model_specs import model_preset
from .models import PricedModel, Workload, cost_model

PAPER_RUNS = (("Qwen3-1.7B", 512), ("Llama-3.1-8B", 256), ("gpt-oss-20b", 128), ("Qwen3-32B", 128))
"""Model and global batch (sequences) of the paper's dense runs."""
NUM_GPUS = 8


@dataclass(frozen=True)
class PlanningCase:
    """What the planner sees for one run: costs, pool, microbatches per call, budgets."""

    name: str
    costs: CostModel
    num_devices: int
    num_microbatches: int
    budgets: tuple[int, ...]

    def time(self, plan: Plan, objective: str) -> float:
        """``plan``'s predicted seconds on ``objective`` (rounds of the call's
        microbatches, as the runtime and the predictor run them)."""
        micro = self.num_microbatches
        return predict_iteration_time(
            plan, self.costs, self.num_devices, micro, round_size=micro, objective=objective
        )

    def paper_plans(self, objective: str) -> dict[str, Plan]:
        """The paper's rule, and the hand-tuned equal-size plan fastest on ``objective``
        among those that fit the budgets."""
        layers = self.costs.layers
        equal = [
            p for p in equal_size_plans(layers.num_layers) if fits(p, self.costs, self.budgets)
        ]
        best = min(equal, key=lambda plan: self.time(plan, objective))
        return {"rule": paper_greedy_plan(layers), "equal-size": best}


def paper_cases() -> list[PlanningCase]:
    gpu = gpu_preset("rtx4090")
    budget = Budget(gpu.memory_bytes).available
    cases = []
    for name, batch in PAPER_RUNS:
        work = Workload(seq_len=2048, batch=batch, precision="fp16-acc16")
        model = PricedModel.build(model_preset(name), gpu, work, work.tokens_per_microbatch)
        micro = work.round_microbatches(NUM_GPUS)
        costs = cost_model(model, gpu, work, NUM_GPUS, micro)
        cases.append(PlanningCase(name, costs, NUM_GPUS, micro, (budget,) * NUM_GPUS))
    return cases
