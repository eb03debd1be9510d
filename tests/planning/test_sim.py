"""The discrete-event simulator: hand-checked timings, bubble accounting, baselines."""

from __future__ import annotations

import pytest

from roundpipe.core.plan import Plan
from roundpipe.core.schedule import lower
from roundpipe.core.timeline import Span
from roundpipe.planning.sim import (
    BASELINES,
    CostModel,
    LayerCosts,
    SimulationError,
    round_schedules,
    simulate_baseline,
    simulate_roundpipe,
    steady_iteration_time,
)
from roundpipe.planning.sim.engine import Dep, Op, run
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.models import MODEL_PRESETS, ModelSpec, Workload, model_preset, predict


def _compute(spans: list[Span]) -> list[Span]:
    return sorted((s for s in spans if s.stream == "compute"), key=lambda s: (s.device, s.start))


def _uniform(layers: int, fwd: float = 1.0, bwd: float = 2.0, **kwargs) -> CostModel:
    return CostModel(LayerCosts.uniform(layers, fwd, bwd), **kwargs)


def test_one_device_one_fused_stage_runs_back_to_back() -> None:
    result = simulate_roundpipe(Plan((), (1,)), _uniform(1), num_devices=1, num_microbatches=3)
    assert result.makespan == pytest.approx(9.0)  # 3 x (forward 1 + backward 2)
    assert result.bubble_ratio == pytest.approx(0.0)
    assert [s.kind for s in _compute(result.timeline.spans)] == ["fused"] * 3


def test_recompute_runs_before_the_incoming_gradient_arrives() -> None:
    # F0 on device 0, fused stage on device 1, backward stage 1 back on device 0.
    result = simulate_roundpipe(Plan((1,), (1, 1)), _uniform(2), 2, 2)
    times = [(s.device, s.kind, s.start, s.end) for s in _compute(result.timeline.spans)]
    assert times == [
        (0, "forward", 0.0, 1.0),
        (0, "forward", 1.0, 2.0),
        (0, "recompute", 2.0, 3.0),  # only needs the saved input
        (0, "backward", 4.0, 6.0),  # waits for the fused stage's gradient (ends at 4)
        (0, "recompute", 6.0, 7.0),
        (0, "backward", 7.0, 9.0),
        (1, "fused", 1.0, 4.0),
        (1, "fused", 4.0, 7.0),
    ]
    assert result.makespan == pytest.approx(9.0)


def test_comm_delays_every_stage_boundary_hop() -> None:
    fast = simulate_roundpipe(Plan((1,), (1, 1)), _uniform(2), 2, 1)
    slow = simulate_roundpipe(Plan((1,), (1, 1)), _uniform(2, comm=0.5), 2, 1)
    # F -> fused -> backward: two hops on the critical path.
    assert slow.makespan == pytest.approx(fast.makespan + 1.0)
    # Each hop is exposed once; the backward stage recomputes layer 0 from the caller's
    # input, which the runtime uploads from the host without a hop.
    assert slow.exposed_comm == pytest.approx(1.0)


def test_weight_upload_precedes_compute_over_the_h2d_link() -> None:
    costs = CostModel(LayerCosts((1.0,), (2.0,), (100,)), h2d_bandwidth=100.0)
    result = simulate_roundpipe(Plan((), (1,)), costs, 1, 1)
    (upload,) = [s for s in result.timeline.spans if s.kind == "upload"]
    assert (upload.start, upload.end) == (0.0, 1.0)
    assert result.makespan == pytest.approx(4.0)
    assert result.bubbles.fill == pytest.approx(0.25)


def test_a_device_holds_at_most_two_stages_of_weights() -> None:
    layer_bytes = 1000
    layers = LayerCosts.uniform(8, 1.0, 2.0, layer_bytes=layer_bytes)
    costs = CostModel(layers, grad_bytes_ratio=0.0)
    result = simulate_roundpipe(Plan((1,) * 7, (1,) * 8), costs, 2, 2)
    assert max(result.peak_memory) == 2 * layer_bytes


def test_job_devices_follow_lower_across_rounds() -> None:
    plan, devices = Plan((2, 2), (1, 1, 1, 1, 1)), 3
    result = simulate_roundpipe(plan, _uniform(5), devices, num_microbatches=7, round_size=3)
    jobs_per_round = len(plan.forward) + len(plan.backward)
    for round_index, schedule in enumerate(round_schedules(plan, devices, 3)):
        assert schedule.devices_of() == lower(plan, devices, schedule.first_device).devices_of()
        for job in schedule.jobs:
            expected = (round_index * jobs_per_round + job.index) % devices
            spans = [s for s in result.timeline.spans if s.label.endswith(f"r{round_index}")]
            ran_on = {s.device for s in spans if s.label.startswith(f"{job} ")}
            assert ran_on == {expected}, (round_index, str(job))


def test_bubble_parts_sum_to_the_idle_fraction() -> None:
    costs = CostModel(LayerCosts.uniform(12, 1.0, 2.0, 3.0, 6.0), comm=0.3)
    results = [simulate_roundpipe(Plan((4, 4, 3), (2,) + (1,) * 11), costs, 4, 6)]
    results += [simulate_baseline(name, costs, 4, 8) for name in BASELINES]
    for result in results:
        b = result.bubbles
        idle = 1 - result.busy / (result.makespan * result.num_devices)
        assert b.fill + b.switch + b.drain + b.steady == pytest.approx(result.bubble_ratio)
        assert result.bubble_ratio == pytest.approx(idle), result.schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("devices", "microbatches"), [(4, 8), (4, 4), (8, 16)])
def test_uniform_baselines_match_the_bubble_formula(name, devices, microbatches) -> None:
    costs = _uniform(2 * devices)
    result = simulate_baseline(name, costs, devices, microbatches, recompute=False)
    assert result.bubble_ratio == pytest.approx((devices - 1) / (microbatches + devices - 1))


def test_baselines_recompute_every_layer_but_the_head() -> None:
    costs = CostModel(LayerCosts.uniform(3, 1.0, 2.0, 5.0, 7.0))
    plain = simulate_baseline("gpipe", costs, 1, 2, recompute=False)
    recomputed = simulate_baseline("gpipe", costs, 1, 2)
    assert plain.makespan == pytest.approx(2 * (3 * 3 + 12))
    assert recomputed.makespan == pytest.approx(plain.makespan + 2 * 3 * 1.0)


def test_interleaved_schedules_have_smaller_bubbles_than_1f1b() -> None:
    costs = _uniform(16)
    one_f_one_b = simulate_baseline("1f1b", costs, 4, 8, recompute=False)
    for name in ("interleaved-1f1b", "looped-bfs"):
        assert simulate_baseline(name, costs, 4, 8, recompute=False).makespan < one_f_one_b.makespan


def test_interleaved_1f1b_rejects_a_microbatch_count_not_a_multiple_of_devices() -> None:
    with pytest.raises(ValueError, match="multiple"):
        simulate_baseline("interleaved-1f1b", _uniform(8), 4, 6)


def test_the_async_steady_state_overlaps_fill_and_drain() -> None:
    costs = CostModel(LayerCosts.uniform(16, 1.0, 2.0, 3.0, 6.0))
    plan = Plan((6, 6, 3), (2, 3, 3, 3, 3, 3))
    result = simulate_roundpipe(plan, costs, 4, 4)
    assert result.iteration_time < result.makespan
    assert result.steady_bubble_ratio < result.bubble_ratio


def test_a_slow_host_optimizer_bounds_the_async_iteration_time() -> None:
    plan = Plan((4, 4), (1, 2, 2, 2, 2))
    slow = CostModel(LayerCosts.uniform(8, 1.0, 2.0, 3.0, 6.0), optimizer_time=500.0)
    assert steady_iteration_time(plan, slow, 4, 4) == pytest.approx(500.0, rel=0.01)


def test_the_sync_optimizer_is_slower_than_the_async_one() -> None:
    plan = Plan((4, 4), (1, 2, 2, 2, 2))
    costs = CostModel(LayerCosts.uniform(8, 1.0, 2.0, 3.0, 6.0), optimizer_time=20.0)
    sync = steady_iteration_time(plan, costs, 4, 4, is_async=False)
    single = simulate_roundpipe(plan, costs, 4, 4)
    assert sync >= single.makespan + 20.0 * 0.1  # at least the last stage's share of the step
    assert steady_iteration_time(plan, costs, 4, 4) < sync


def test_the_engine_reports_a_deadlock_instead_of_hanging() -> None:
    ops = [
        Op("a", 0, "compute", "forward", "a", 1.0, (Dep("b"),)),
        Op("b", 1, "compute", "forward", "b", 1.0, (Dep("a"),)),
    ]
    with pytest.raises(SimulationError, match="deadlocks"):
        run(ops)


def test_layer_costs_reject_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="backward has 1 entries"):
        LayerCosts((1.0, 1.0), (2.0,))


def test_model_spec_from_a_transformers_config_matches_the_preset() -> None:
    transformers = pytest.importorskip("transformers")
    preset = model_preset("Qwen3-8B")
    config = transformers.Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    )
    assert ModelSpec.from_config(config).layer_params == preset.layer_params
    assert preset.num_params == pytest.approx(8.19e9, rel=0.01)


def test_every_named_preset_is_known() -> None:
    assert {"qwen3-1.7b", "qwen3-8b", "llama-3.1-8b", "qwen3-32b"} <= set(MODEL_PRESETS)


def test_model_prediction_puts_roundpipe_ahead_and_within_gpu_memory() -> None:
    work = Workload(seq_len=2048, batch=8)
    predictions = {
        p.schedule: p
        for p in predict(
            model_preset("Qwen3-1.7B"), gpu_preset("rtx4090"), work, 4, ("roundpipe", "1f1b")
        )
    }
    roundpipe = predictions["roundpipe"]
    assert roundpipe.fits and roundpipe.host_ram > 16 * 2e9
    assert roundpipe.tokens_per_s > predictions["1f1b"].tokens_per_s
