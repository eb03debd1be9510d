"""The CUDA backend against plain PyTorch on the same GPU. Skipped without CUDA.

Several logical devices may share one GPU ("cuda:0,0"): they get their own streams,
so cross-device events and host round trips are exercised even on a one-GPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.dropout_models import ReplayDropout, collect_logs, dropout_model
from support.oracle import (
    assert_grads_close,
    batch,
    mlp,
    mse_sum,
    reference_loss_and_grads,
    train_reference,
)

from roundpipe import RoundPipe, RoundPipeRunConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def gpu_spec(count: int) -> str:
    gpus = torch.cuda.device_count()
    return "cuda:" + ",".join(str(i % gpus) for i in range(count))


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("pin", ["alloc", "register", "off"])
def test_cuda_gradients_match_pytorch(devices, grain, pin):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=5, recompute_grain=grain)
    with RoundPipe(
        model, devices=gpu_spec(devices), model_run_config=config, pin_model=pin
    ) as pipe:
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
    want = reference_loss_and_grads(reference, x, y, 5)
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
    assert_grads_close(model, reference, atol=1e-4)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def test_cuda_async_training_matches_one_step_stale_reference():
    model = mlp()
    batches = [batch(seed) for seed in range(4)]
    reference, reference_losses = train_reference(model, batches, 3, adam, stale=True)
    config = RoundPipeRunConfig(num_microbatch=3)
    with RoundPipe(copy.deepcopy(model), devices=gpu_spec(3), model_run_config=config) as pipe:
        optimizer = adam(pipe.optim_parameters())
        losses = []
        for x, y in batches:
            losses.append(pipe.forward_backward((x,), label=y, loss_fn=mse_sum).item())
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.synchronize()
        assert losses == pytest.approx(reference_losses, rel=1e-4)
        for got, want in zip(pipe.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach(), atol=1e-4, rtol=1e-4)


def test_cuda_recompute_reproduces_dropout_masks_across_devices():
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan="2,2|3,1,1,1,1")
    with RoundPipe(model, devices=gpu_spec(3), model_run_config=config) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        logs = collect_logs(pipe)
    for index, log in logs:
        assert all(torch.equal(a, b) for a, b in zip(log["forward"], log["grad"], strict=True))
        reference[index] = ReplayDropout([m.cpu() for m in log["forward"]])
    reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference, atol=1e-4)


def test_cuda_memory_returns_to_baseline_after_synchronize():
    # cuBLAS keeps a workspace per (handle, stream) in the caching allocator for good:
    # the baseline is taken after a first call has made them.
    x, y = batch()
    with RoundPipe(mlp(), devices=gpu_spec(2)) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(3):
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before


def test_cuda_timeline_records_every_stream():
    x, y = batch()
    with RoundPipe(mlp(), devices=gpu_spec(2)) as pipe:
        pipe.start_timeline()
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        spans = pipe.timeline().spans
    assert {"compute", "act_upload", "weight_upload", "download"} <= {s.stream for s in spans}
    assert all(s.end >= s.start for s in spans)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_two_physical_gpus_match_pytorch():
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    with RoundPipe(model, devices="cuda:0,1", model_run_config=RoundPipeRunConfig(5)) as pipe:
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
    want = reference_loss_and_grads(reference, x, y, 5)
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
    assert_grads_close(model, reference, atol=1e-4)


def test_cuda_a_device_holds_at_most_two_stages_of_weights():
    """Memory is taken when the host allocates: the host must not run ahead of the GPU.
    Eight 4 MB layers, one per stage, on one GPU: at most two stages' weights and
    gradients, plus activations, whatever the issue threads do."""
    torch.manual_seed(0)
    width = 1024
    layer_bytes = (width * width + width) * 4
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
    config = RoundPipeRunConfig(4, execute_plan="1,1,1,1,1,1,1|1,1,1,1,1,1,1,1")
    x, y = torch.randn(16, width), torch.randn(16, width)
    with RoundPipe(model, devices="cuda:0", model_run_config=config) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        for _ in range(3):
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(0) - base
    activations = 16 * 16 * width * 4  # generous: a few microbatches in flight
    assert peak <= 2 * 2 * layer_bytes + activations, f"peak {peak / 2**20:.1f} MiB"


def test_cuda_workers_sharing_a_gpu_share_its_capacity():
    with RoundPipe(mlp(), devices="cuda:0") as one, RoundPipe(mlp(), devices="cuda:0,0") as two:
        alone = one.pool.devices[0].memory_capacity()
        shared = [device.memory_capacity() for device in two.pool]
    assert shared == [alone // 2, alone // 2]


def test_cuda_a_refused_registration_leaves_no_error_for_the_next_kernel():
    """A read-only file mapping cannot be registered for device writes: ``auto`` pins it
    another way (read-only registration or a pinned copy), and the refused call's error
    is not reported by the next kernel launched on this thread."""
    import mmap
    import tempfile

    with tempfile.TemporaryFile() as file:
        file.write(b"\0" * (1 << 20))
        file.flush()
        mapped = mmap.mmap(file.fileno(), 1 << 20, prot=mmap.PROT_READ)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8)
        with RoundPipe(mlp(), devices="cuda:0", pin_model="auto") as pipe:
            pinned = pipe.pool.pin(tensor, "auto")
            assert torch.equal(pinned, tensor)
            y = torch.ones(4, device="cuda") * 2  # a kernel launch, checked
            torch.cuda.synchronize()
            assert float(y.sum()) == 8.0
        del tensor, pinned
        mapped.close()


def test_cuda_device_memory_reports_the_caching_allocators_figures():
    x, y = batch()
    with RoundPipe(mlp(), devices="cuda:0") as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        torch.cuda.synchronize()
        (row,) = pipe.device_memory()
    assert row["reserved"] >= row["allocated"] and row["peak_reserved"] >= row["peak"] > 0
    assert row["alloc_retries"] == torch.cuda.memory_stats(0).get("num_alloc_retries", 0)
