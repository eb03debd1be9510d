"""Data parallelism across K RoundPipe nodes: predicted tokens/s and scaling efficiency.

Each node runs RoundPipe (:mod:`.models`) on its 1/K of the global batch; the gradients
are reduce-scattered and the updated weights all-gathered by rings over the network,
overlapped with the simulated iteration where the schedule allows
(docs/design.md#predicted-scaling).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..core.plan import PlanError
from ..planning.sim.roundpipe_schedule import simulate_roundpipe
from .gpus import Gpu
from .model_specs import ModelSpec
from .models import (
    ADAM_BYTES,
    Prediction,
    PricedModel,
    Workload,
    cost_model,
    predict,
    roundpipe_plan,
)
from .unit_costs import HALF

BUCKET_BYTES = 25 * 2**20
"""Gradients and weights travel in 25 MiB buckets (PyTorch DDP's default)."""
MESSAGE_LATENCY = 30e-6
"""Seconds per message of a ring step over TCP Ethernet (gloo or NCCL sockets)."""
GRAD_BYTES = {"fp32": 4, "bf16": 2}
SCALING_NODES = (1, 2, 4, 8, 16, 32, 64)
_STAGE_UNITS = re.compile(r"\[(\d+):(\d+)\]")


@dataclass(frozen=True)
class Network:
    """The nodes and what joins them."""

    nodes: int = 1
    gbps: float = 100.0
    """Per node and direction, Gb/s."""
    grad_reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {self.nodes}")
        if not self.gbps > 0:
            raise ValueError(f"--network-gbps must be positive, got {self.gbps}")
        if self.grad_reduce_dtype not in GRAD_BYTES:
            known = ", ".join(GRAD_BYTES)
            raise ValueError(f"--grad-reduce-dtype {self.grad_reduce_dtype!r}: use one of {known}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


@dataclass(frozen=True)
class NodesPrediction:
    """RoundPipe on K nodes: the per-node prediction and what the network adds."""

    node: Prediction
    """One node on its share of the batch, its host stepping 1/K of the masters."""
    nodes: int
    network_gbps: float
    grad_reduce_dtype: str
    tokens_per_s: float
    """Global tokens/s."""
    scaling_efficiency: float
    iteration_time: float
    comm_time: float
    """Seconds the link carries the reduce-scatter and the all-gather per iteration."""
    exposed_comm: float
    """Seconds of ``comm_time`` (and the shard's step) that lengthen the iteration."""
    reduce_bytes: int
    """Bytes each node sends for the reduce-scatter per iteration."""
    gather_bytes: int
    host_ram_per_node: int | None

    def to_dict(self) -> dict:
        row = self.node.to_dict()
        row.update({k: v for k, v in self.__dict__.items() if k != "node"})
        return row


def split_batch(batch: int, nodes: int) -> int:
    """Sequences per node: the global batch must split evenly (the runtime rejects
    uneven per-rank batches)."""
    if batch % nodes:
        raise ValueError(
            f"--batch {batch} does not split evenly over {nodes} nodes; "
            f"give a multiple of {nodes} (e.g. {math.ceil(batch / nodes) * nodes})"
        )
    return batch // nodes


def predict_nodes(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    network: Network,
    host_ram: int | None = None,
    single_node_tokens_per_s: float | None = None,
) -> NodesPrediction:
    """Global tokens/s and scaling efficiency of ``network.nodes`` RoundPipe nodes."""
    k = network.nodes
    local = replace(work, batch=split_batch(work.batch, k), optimizer_shards=k)
    (node,) = predict(spec, gpu, local, num_gpus, ("roundpipe",), host_ram)
    if node.memory is not None and node.memory.plan is None:
        raise PlanError(node.detail)  # nothing to time: the nodes' figures need a plan
    compute = node.iteration_time
    model = PricedModel.build(spec, gpu, local, local.tokens_per_microbatch)
    share = (k - 1) / k
    grad_bytes = GRAD_BYTES[network.grad_reduce_dtype]
    reduce_bytes = int(share * model.trainable * grad_bytes)
    gather_bytes = int(share * model.trainable * HALF)
    reduce_time = _collective_time(model.trainable * grad_bytes, share, network)
    gather_time = _collective_time(model.trainable * HALF, share, network)
    reduce_exposed = 0.0
    if k > 1:
        reduce_exposed = _reduce_tail(model, gpu, local, num_gpus, reduce_time, grad_bytes)
    step = model.trainable * ADAM_BYTES / work.host_bandwidth / k
    room = compute - (reduce_time - reduce_exposed)
    gather_exposed = max(0.0, step + gather_time - room) if k > 1 else 0.0
    iteration = compute + reduce_exposed + gather_exposed
    tokens_per_s = work.batch * work.seq_len / iteration
    single = single_node_tokens_per_s
    if single is None:
        single = node.tokens_per_s if k == 1 else _single_node(spec, gpu, work, num_gpus)
    return NodesPrediction(
        node=node,
        nodes=k,
        network_gbps=network.gbps,
        grad_reduce_dtype=network.grad_reduce_dtype,
        tokens_per_s=tokens_per_s,
        scaling_efficiency=tokens_per_s / (k * single),
        iteration_time=iteration,
        comm_time=reduce_time + gather_time,
        exposed_comm=reduce_exposed + gather_exposed,
        reduce_bytes=reduce_bytes,
        gather_bytes=gather_bytes,
        host_ram_per_node=node.host_ram,
    )


def scaling_table(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    network: Network,
    host_ram: int | None = None,
) -> list[NodesPrediction]:
    """:func:`predict_nodes` for each of ``SCALING_NODES`` that splits the batch."""
    single = _single_node(spec, gpu, work, num_gpus)
    return [
        predict_nodes(spec, gpu, work, num_gpus, replace(network, nodes=k), host_ram, single)
        for k in SCALING_NODES
        if work.batch % k == 0
    ]


def _single_node(spec: ModelSpec, gpu: Gpu, work: Workload, num_gpus: int) -> float:
    return predict(spec, gpu, work, num_gpus, ("roundpipe",))[0].tokens_per_s


def _collective_time(total_bytes: float, share: float, network: Network) -> float:
    """A ring collective over K nodes: (K-1)/K of the bytes each way, and K-1 messages
    per bucket."""
    if share == 0:
        return 0.0
    nodes = round(1 / (1 - share))
    buckets = math.ceil(total_bytes / BUCKET_BYTES)
    latency = buckets * (nodes - 1) * MESSAGE_LATENCY
    return share * total_bytes / network.bytes_per_s + latency


def _reduce_tail(
    model: PricedModel, gpu: Gpu, work: Workload, num_gpus: int, reduce_time: float, grad_bytes: int
) -> float:
    """Seconds the reduce-scatter runs past the iteration's last gradient download, each
    backward stage's share starting once the simulator has downloaded its gradients."""
    microbatches = work.round_microbatches(num_gpus)
    costs = cost_model(model, gpu, work, num_gpus, microbatches)
    plan = roundpipe_plan(costs, gpu, num_gpus, microbatches)
    result = simulate_roundpipe(plan, costs, num_gpus, microbatches, round_size=microbatches)
    final = [
        (span.end, _STAGE_UNITS.search(span.label))
        for span in result.timeline.spans
        if span.kind == "download" and "download_grads" in span.label
    ]
    weights = _trained_share(model)
    end = max(t for t, _ in final)
    link_free = -math.inf
    for ready, units in sorted(final, key=lambda item: item[0]):
        assert units is not None
        stage_share = sum(weights[int(units[1]) : int(units[2])])
        link_free = max(link_free, ready) + reduce_time * stage_share
    return max(0.0, link_free - end)


def _trained_share(model: PricedModel) -> list[float]:
    """Each unit's fraction of the trained parameters: by weight bytes, or the layers'
    adapters alike under LoRA (embedding and head frozen)."""
    if model.frozen:
        layers = len(model.units) - 2
        return [0.0, *[1 / layers] * layers, 0.0]
    total = sum(u.param_bytes for u in model.units)
    return [u.param_bytes / total for u in model.units]
