"""Iteration ends of successive rounds, computed job by job without an op graph.

Scoring a plan needs only when each of a few iterations ends. :func:`iteration_ends`
gives exactly what the engine gives for :class:`~roundpipe.planning.sim.rounds.Simulation`'s
op graph (the same floats) by walking the jobs in dispatch order with per-device clocks,
about 10× faster; where the walk cannot tell the engine's order it raises
:class:`Undecided` and the caller replays the graph. Why the walk is exact:
docs/design.md#scoring-walk.
"""

from __future__ import annotations

from ...core.plan import Plan
from ...core.program import plan_chunks
from .costs import CostModel
from .rounds import round_sizes

FORWARD, FUSED, BACKWARD = 0, 1, 2
UNKNOWN = -1.0
"""A time not known yet (every real time is at least 0)."""


class Undecided(Exception):
    """The walk cannot tell the engine's order on a copy engine; replay the graph."""


class _Stage:
    """One job of a round: its kind, layers, and the duration of each of its ops."""

    __slots__ = ("kind", "start", "stop", "chunks", "comm_in", "a", "b", "grads", "step", "saves")

    def __init__(self, kind: int, layers: range, costs: CostModel, saves: list[int]) -> None:
        lc = costs.layers
        self.kind, self.start, self.stop, self.saves = kind, layers.start, layers.stop, saves
        sizes = [lc.param_bytes[i] for i in layers]
        chunks = plan_chunks(sizes, [1] * len(sizes), costs.weight_chunk_bytes)
        chunk_bytes = [sum(end - first for _, first, end in chunk) for chunk in chunks] or [0]
        self.chunks = [costs.upload_time(size) for size in chunk_bytes]
        self.comm_in = 0.0 if layers.start == 0 else costs.comm  # layer 0: the caller's input
        self.grads = self.step = self.b = 0.0
        if kind == FORWARD:
            self.a = lc.stage_forward(layers)
        elif kind == FUSED:
            self.a = lc.stage_forward(layers) + lc.stage_backward(layers)
        else:
            self.a, self.b = lc.stage_recompute(layers), lc.stage_backward(layers)
        if kind != FORWARD:
            self.grads = costs.download_time(lc.stage_param_bytes(layers) * costs.grad_bytes_ratio)
            total = sum(lc.param_bytes)
            share = lc.stage_param_bytes(layers) / total if total else len(layers) / lc.num_layers
            self.step = costs.optimizer_time * share


def iteration_ends(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    *,
    round_size: int,
    is_async: bool,
    stages: dict | None = None,
    followed: bool = True,
) -> list[float]:
    """When the last compute op of each of the first ``iterations`` iterations ends, in a
    run where one more iteration follows (unless not ``followed``), as
    ``Simulation.iteration_ends`` (devices from 0) would say; raises :class:`Undecided`
    where the walk cannot tell. ``stages`` is a cache for :func:`stages_of`."""
    walk = _Walk(plan, costs, num_devices, is_async, stages)
    return walk.run(round_sizes(num_microbatches, round_size), iterations, followed)


def isolated_time(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int,
    stages: dict | None = None,
) -> float:
    """When one iteration from idle, with a synchronous optimizer step and nothing
    following, is over: its last compute op, gradient download or step, whichever ends
    last (the end of every op of ``Simulation``'s graph of that iteration); raises
    :class:`Undecided` where the walk cannot tell."""
    walk = _Walk(plan, costs, num_devices, False, stages)
    (end,) = walk.run(round_sizes(num_microbatches, round_size), 1, followed=False)
    return max(end, walk.host, *walk.dfree)


def stages_of(
    plan: Plan, costs: CostModel, cache: dict | None = None
) -> tuple[list[_Stage], int, list[list[int]]]:
    """A round's jobs in order, how many are forward jobs, and for each job the backward
    stages (their optimizer steps, fused first) that share a layer with it. ``cache``
    keeps stages across plans of one cost model (a planner scores many)."""
    cache = {} if cache is None else cache
    forward, backward = plan.forward_ranges(), plan.backward_ranges()
    starts = {r.start for r in backward[1:]}  # recomputed from their saved input
    jobs = [(FORWARD, r, (*[i for i in r[1:] if i in starts], r.stop)) for r in forward]
    jobs.append((FUSED, backward[0], ()))
    jobs += [(BACKWARD, r, ()) for r in backward[1:]]
    stages = []
    for kind, layers, saves in jobs:
        key = (kind, layers.start, layers.stop, saves)
        stage = cache.get(key)
        if stage is None:
            stage = cache[key] = _Stage(kind, layers, costs, list(saves))
        stages.append(stage)
    overlaps = [
        [q for q, r in enumerate(backward) if r.start < s.stop and s.start < r.stop] for s in stages
    ]
    return stages, len(forward), overlaps


class _Walk:
    def __init__(self, plan, costs, num_devices, is_async, cache) -> None:
        if plan.placed:
            raise Undecided("a placed plan: the walk moves the cursor on from call to call")
        self.stages, self.num_forward, self.overlaps = stages_of(plan, costs, cache)
        self.device_stages = None  # a mixed pool: each device's jobs at its own costs
        if costs.mixed:
            caches = {} if cache is None else cache.setdefault("devices", {})
            self.device_stages = [
                stages_of(plan, costs.on_device(d), caches.setdefault(d, {}))[0]
                for d in range(num_devices)
            ]
        self.comm = costs.comm
        self.n = n = num_devices
        self.is_async = is_async
        self.cfree = [0.0] * n  # compute queue
        self.dfree = [0.0] * n  # device-to-host queue
        self.afree = [0.0] * n  # activation uploads
        self.wfree = [0.0] * n  # weight chunks
        self.busy = [0.0] * n  # the host-to-device copy engine
        self.alast = [UNKNOWN] * n  # start of the last activation upload placed
        self.pending: list[list[tuple[float, float, int, bool]]] = [[] for _ in range(n)]
        self.head = [0] * n
        self.done: list[float] = []  # per job: when it released its device
        self.weights: dict[int, float] = {}  # job -> its last chunk's end
        self.released: set[int] = set()
        self.host = 0.0  # the host optimizer's queue
        self.steps: list[list[float]] = []  # per iteration, per backward stage: step end

    # -- rounds --------------------------------------------------------------------

    def run(self, sizes: list[int], iterations: int, followed: bool) -> list[float]:
        ends: list[float] = []
        loss = UNKNOWN
        x = 0
        # one more iteration follows (its prefetches delay the last one), not walked
        total = iterations + 1 if followed else iterations
        rounds = [(it, k) for it in range(total) for k in range(len(sizes))]
        num_jobs = len(self.stages)
        for index, (iteration, k) in enumerate(rounds[: iterations * len(sizes)]):
            first, last = k == 0, k == len(sizes) - 1
            gate = loss if loss > 0 else 0.0
            if first and not self.is_async and iteration > 0:
                gate = max([gate, *self.steps[iteration - 1]])
            if first:
                self.steps.append([0.0] * (num_jobs - self.num_forward))
                ends.append(0.0)
            following = rounds[index + 1] if index + 1 < len(rounds) else None
            produced: dict[tuple[int, int], list[float]] = {}
            end = 0.0
            for p, stage in enumerate(self.stages):
                if self.device_stages is not None:
                    stage = self.device_stages[x % self.n][p]
                if x not in self.released:
                    self._release(x, p, gate, iteration, late=x >= self.n)
                ahead = p + self.n
                if ahead < num_jobs:
                    self._release(x + self.n, ahead, gate, iteration, late=False)
                elif (
                    following is not None
                    and ahead < 2 * num_jobs
                    and p > self.num_forward
                    and (self.is_async or following[1] != 0)
                ):  # the next round's gate: this round's loss (unless a synchronous step)
                    self._release(x + self.n, ahead - num_jobs, loss, following[0], False)
                job_end, job_loss = self._job(
                    x,
                    stage,
                    sizes[k],
                    gate,
                    produced,
                    p - self.num_forward,
                    iteration if last else -1,
                )
                end = max(end, job_end)
                if stage.kind == FUSED:
                    loss = job_loss
                x += 1
            ends[iteration] = max(ends[iteration], end)
        return ends

    # -- the copy engine -----------------------------------------------------------

    def _release(self, x: int, stage: int, gate: float, iteration: int, late: bool) -> None:
        """Job ``x``'s weight chunks join its device's weight queue."""
        self.released.add(x)
        d = x % self.n
        ready = gate
        if x >= 2 * self.n:  # the job two back on the device has released it
            ready = max(ready, self.done[x - 2 * self.n])
        stale = iteration - 2 if self.is_async else iteration - 1
        if stale >= 0:  # the step that wrote these weights
            steps = self.steps[stale]
            for q in self.overlaps[stage]:
                ready = max(ready, steps[q])
        if late and ready < self.alast[d]:
            raise Undecided(f"job {x}'s weights were ready before an upload already placed")
        chunks = self.stages[stage].chunks
        pending, last = self.pending[d], len(chunks) - 1
        for c, duration in enumerate(chunks):
            pending.append((ready if c == 0 else gate, duration, x, c == last))

    def _chunk(self, d: int) -> None:
        """Start the chunk at the head of device ``d``'s weight queue."""
        ready, duration, x, last = self.pending[d][self.head[d]]
        self.head[d] += 1
        start = self.wfree[d] if self.wfree[d] > self.busy[d] else self.busy[d]
        if ready > start:
            start = ready
        self.wfree[d] = self.busy[d] = end = start + duration
        if last:
            self.weights[x] = end

    def _upload(self, d: int, ready: float, duration: float) -> float:
        """An activation upload ready at ``ready``; chunks that can start first go first."""
        pending, busy, afree = self.pending[d], self.busy, self.afree[d]
        while True:
            start = afree if afree > busy[d] else busy[d]
            if ready > start:
                start = ready
            h = self.head[d]
            if h == len(pending):
                break
            chunk = self.wfree[d] if self.wfree[d] > busy[d] else busy[d]
            if pending[h][0] > chunk:
                chunk = pending[h][0]
            if chunk >= start:  # a tie goes to the activation
                break
            self._chunk(d)
        self.alast[d] = start
        self.afree[d] = busy[d] = end = start + duration
        return end

    # -- jobs ----------------------------------------------------------------------

    def _job(self, x, stage, size, gate, produced, q, step_iteration):
        """Walk job ``x``'s program; returns when its last compute op ends, and (fused)
        when its last loss is home."""
        d = x % self.n
        kind, start, a, b, comm_in = stage.kind, stage.start, stage.a, stage.b, stage.comm_in
        upload = self._upload
        # activation uploads in queue order: per microbatch the input (a backward job's
        # saved input), then the label (fused) or the incoming gradient (backward)
        inputs = produced.get((0, start)) if start > 0 else None
        grads = produced[(1, stage.stop)] if kind == BACKWARD else None
        comm = self.comm
        outputs = [UNKNOWN] * size
        if kind == FORWARD:
            for layer in stage.saves:
                produced[(0, layer)] = outputs
        elif start > 0:
            produced[(1, start)] = outputs
        computed = [UNKNOWN] * size
        cfree, dfree = self.cfree[d], self.dfree[d]
        early: list[float] = []  # ends of the uploads placed while waiting for the weights
        for m in range(size):
            wait = computed[m - 2] if m >= 2 else 0.0  # at most one microbatch ahead
            if kind == FORWARD and 1 <= m <= len(early):
                arrived = early[m - 1]
            elif kind == BACKWARD and m == 1 and len(early) >= 2:
                arrived = early[1]
            elif kind == FUSED and m == 1 and early:
                arrived = early[0]
            else:
                ready = gate
                if inputs is not None and inputs[m] > ready:
                    ready = inputs[m]
                if wait > ready:
                    ready = wait
                arrived = upload(d, ready, comm_in)
            if kind == FUSED:  # the label
                if m == 1 and len(early) == 2:
                    label = early[1]
                else:
                    label = upload(d, gate if gate > wait else wait, 0.0)
                if label > arrived:
                    arrived = label
            if m == 0:  # the first compute op waits for the weights
                weights, early = self._weights(x, d, stage, size, gate, inputs, grads)
                if weights > arrived:
                    arrived = weights
            begin = cfree if cfree > arrived else arrived
            cfree = begin + a
            if kind == BACKWARD:  # recompute, then the backward once the gradient is here
                if m == 0 and early:
                    arrived = early[0]
                elif m == 1 and len(early) == 3:
                    arrived = early[2]
                else:
                    assert grads is not None
                    ready = gate if gate > grads[m] else grads[m]
                    if wait > ready:
                        ready = wait
                    arrived = upload(d, ready, comm)
                begin = cfree if cfree > arrived else arrived
                cfree = begin + b
            computed[m] = cfree
            if kind != BACKWARD or start > 0:  # outputs (fused: the loss, then the gradient)
                if cfree > dfree:
                    dfree = cfree
                outputs[m] = dfree
        end = cfree
        release = cfree if cfree > gate else gate  # (take the gradients and) release
        if kind != FORWARD:
            begin = dfree if dfree > release else release
            dfree = begin + stage.grads
            if step_iteration >= 0:  # the host optimizer steps these layers
                begin = self.host if self.host > dfree else dfree
                self.host = self.steps[step_iteration][q] = begin + stage.step
        self.cfree[d], self.dfree[d] = release, dfree
        self.done.append(release)
        return end, (outputs[-1] if kind == FUSED else UNKNOWN)

    def _weights(self, x, d, stage, size, gate, inputs, grads) -> tuple[float, list[float]]:
        """Job ``x``'s weights, for its first compute op, and the ends of the job's next
        uploads that need no compute of the job, placed as they come: any that can start
        before a remaining chunk goes first."""
        kind = stage.kind
        if kind == FORWARD:  # the input of microbatch 1
            known = [(inputs, 1, 0)] if size > 1 else []
        elif kind == FUSED:  # the input and the label of microbatch 1
            known = [(inputs, 1, 0), (None, 1, 2)] if size > 1 else []
        else:  # the gradient of microbatch 0, the saved input and gradient of microbatch 1
            known = [(grads, 0, 1), (inputs, 1, 0), (grads, 1, 1)][: 2 * size - 1]
        after = {FORWARD: size - 1, FUSED: 2 * size - 2, BACKWARD: 2 * size - 1}[kind]
        more = len(known) < after  # uploads of the job after these
        durations = (stage.comm_in, self.comm, 0.0)
        ends: list[float] = []
        busy, pending = self.busy, self.pending[d]
        while x not in self.weights:
            if len(ends) < len(known):
                source, m, which = known[len(ends)]
                ready = gate if source is None or gate > source[m] else source[m]
                start = self.afree[d] if self.afree[d] > busy[d] else busy[d]
                if ready > start:
                    start = ready
                chunk = self.wfree[d] if self.wfree[d] > busy[d] else busy[d]
                if pending[self.head[d]][0] > chunk:
                    chunk = pending[self.head[d]][0]
                if start <= chunk:  # a tie goes to the activation
                    self.alast[d] = start
                    self.afree[d] = busy[d] = end = start + durations[which]
                    ends.append(end)
                    continue
            elif not more:  # the next upload on the queue is the next job's
                raise Undecided(f"job {x}'s weights race the next job's uploads")
            self._chunk(d)
        return self.weights[x], ends
