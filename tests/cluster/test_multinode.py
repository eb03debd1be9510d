"""Several RoundPipe nodes (local processes on gloo) train as one process would on the
concatenated global batch; the oracle is plain PyTorch (``tests/support/oracle.py``).

Tolerance: float64 models, so the only difference from the reference is the order of
the gradient sums (each rank sums its own microbatches, then the ranks are summed),
which moves weights by ~1e-15 relative; we allow 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from support.multinode import launch
from support.oracle import batch, mlp, train_reference, weighted_microbatches

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def reference(
    steps: int,
    shards: int,
    optimizer: str,
    stale: bool,
    scale: float = 1.0,
    size: int = 12,
    scale_grads: bool = True,
):
    """Plain PyTorch on the global batches of ``size`` rows, split into ``shards``
    microbatches (RoundPipe's loss over them: ``oracle.reference_loss_and_grads``)."""
    from support.multinode_scenarios import make_optimizer

    model = mlp().double()
    batches = [tuple(t.double() for t in batch(seed=s, size=size)) for s in range(steps)]

    def loss_scaled(output, label):
        return ((output - label) ** 2).sum() * scale

    optimizer_of = lambda p: make_optimizer(optimizer, p)  # noqa: E731
    return train_reference(model, batches, shards, optimizer_of, stale, loss_scaled, scale_grads)


def assert_state_close(state: dict, model: torch.nn.Module) -> None:
    for name, want in model.state_dict().items():
        torch.testing.assert_close(state[name], want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "world, optimizer, is_async",
    [(2, "adam", False), (3, "sgd", False), (2, "adam", True), (3, "adam", True)],
)
def test_nodes_train_like_one_process_on_the_global_batch(tmp_path, world, optimizer, is_async):
    steps = 4
    codes, results, outputs = launch(
        "train", world, tmp_path, steps=steps, optimizer=optimizer, is_async=is_async
    )
    assert codes == [0] * world, outputs
    want, want_losses = reference(steps, 2 * world, optimizer, stale=is_async)
    for result in results:
        assert result["losses"] == pytest.approx(want_losses, rel=1e-6)  # returned in fp32
        assert_state_close(result["state"], want)


def test_mean_reduction_averages_like_ddp(tmp_path):
    codes, results, outputs = launch(
        "train", 2, tmp_path, steps=3, grad_reduction="mean", scale_grads=False
    )
    assert codes == [0, 0], outputs
    want, want_losses = reference(3, 4, "adam", stale=False, scale=0.5, scale_grads=False)
    for result in results:
        assert result["losses"] == pytest.approx(want_losses, rel=1e-6)  # returned in fp32
        assert_state_close(result["state"], want)


def test_small_buckets_give_the_same_result(tmp_path):
    """One bucket per layer instead of one for the whole model."""
    codes, results, outputs = launch("train", 2, tmp_path, steps=3, bucket_bytes=1)
    assert codes == [0, 0], outputs
    want, _ = reference(3, 4, "adam", stale=False)
    for result in results:
        assert_state_close(result["state"], want)


def test_uneven_microbatch_counts_and_grad_scalers_are_refused_on_every_rank(tmp_path):
    codes, results, outputs = launch("uneven", 2, tmp_path)
    assert codes == [0, 0], outputs
    for result in results:
        assert "same number of microbatches" in result["error"]
        assert "[2, 3]" in result["error"]
        assert "GradScaler" in result["scaler_error"]  # refused across nodes, for now


def test_each_node_holds_its_share_of_masters_and_optimizer_state(tmp_path):
    world = 3
    codes, results, outputs = launch(
        "train", world, tmp_path, steps=1, width=64, depth=26, bucket_bytes=1
    )
    assert codes == [0] * world, outputs
    one_node = sum(p.numel() * 8 for p in mlp(width=64, depth=26).parameters())
    masters = [r["master_bytes"] for r in results]
    adam = [r["optimizer_bytes"] for r in results]
    assert sum(masters) == one_node  # every master is on exactly one node
    assert sum(adam) == 2 * one_node
    for share, state in zip(masters, adam, strict=True):
        assert share <= 1.2 * one_node / world
        assert state <= 2 * 1.2 * one_node / world


def test_a_call_failing_on_one_rank_raises_on_every_rank_and_training_goes_on(tmp_path):
    """Rank 1's batch has the wrong width at step 1: rank 1 raises the shape error,
    rank 0 an error naming rank 1; every rank skips that batch and trains on."""
    codes, results, outputs = launch("train", 2, tmp_path, steps=4, fail_at_step=1)
    assert codes == [0, 0], outputs
    assert len(results[1]["errors"]) == 1 and "mat1 and mat2" in results[1]["errors"][0]
    assert results[0]["errors"] == ["PeerFailure: the call failed on rank(s) [1]"]
    model = mlp().double()
    from support.multinode_scenarios import make_optimizer

    batches = [tuple(t.double() for t in batch(seed=s, size=12)) for s in (0, 2, 3)]
    want, _ = train_reference(model, batches, 4, lambda p: make_optimizer("adam", p))
    for result in results:
        assert_state_close(result["state"], want)


@pytest.mark.parametrize(
    "die_in, is_async, timeout_s",
    [
        ("call", False, 20),
        ("step", False, 20),
        ("step", True, 20),
        pytest.param("hang", False, None, marks=pytest.mark.slow),  # 30 s
    ],
)
def test_a_rank_that_dies_makes_the_others_raise_within_the_timeout(
    tmp_path, die_in, is_async, timeout_s
):
    """Without ``CommOptions(timeout_s=...)`` the process group's timeout (8 s) holds."""
    codes, _, outputs = launch(
        "train",
        3,
        tmp_path,
        steps=3,
        die_at_step=1,
        die_in=die_in,
        is_async=is_async,
        timeout_s=timeout_s,
        pg_timeout_s=8,
        timeout=30 if die_in == "hang" else 60,  # the hung rank is killed at the deadline
    )
    if die_in == "hang":
        assert outputs[2].endswith("<<killed: timeout>>")
        codes[2] = 3
    assert codes[2] == 3  # the node that was lost
    for code, output in zip(codes[:2], outputs[:2], strict=True):
        assert code not in (0, None), output
        assert "PeerFailure" in output and "rank(s) [2] did not answer" in output, output
        assert "<<killed: timeout>>" not in output


@pytest.mark.slow  # 31 s
def test_communication_overlaps_the_backward_and_the_next_iteration(tmp_path):
    """Each bucket collective (two per tensor and step) is delayed by 20 ms. Asynchronous
    steps hide most of it behind the next iteration; in a synchronous step the timeline
    shows gradient reductions that finished while the backward still ran."""
    delay = 0.02
    runs = {}
    for delay_s in (0.0, delay):
        for is_async in (True, False):
            out = tmp_path / f"{delay_s}-{is_async}"
            out.mkdir()
            codes, results, outputs = launch(
                "overlap", 2, out, delay_s=delay_s, kernel_s=0.02, is_async=is_async
            )
            assert codes == [0, 0], outputs
            runs[delay_s, is_async] = results[0]
    total_delay = 2 * runs[delay, True]["buckets"] * delay
    growth = runs[delay, True]["seconds_per_step"] - runs[0.0, True]["seconds_per_step"]
    assert growth < 0.5 * total_delay, (growth, total_delay)

    spans = runs[delay, False]["spans"]
    last_backward = max(end for kind, _, _, end in spans if kind in ("backward", "fused"))
    reduces = [end for kind, label, _, end in spans if "gradient reduce" in label]
    assert len(reduces) == runs[delay, False]["buckets"]
    assert min(reduces) < last_backward


def test_clip_grad_norm_clips_by_the_norm_over_every_nodes_gradients(tmp_path):
    codes, results, outputs = launch("train", 2, tmp_path, steps=3, optimizer="sgd", clip=0.5)
    assert codes == [0, 0], outputs
    from support.multinode_scenarios import make_optimizer

    model = mlp().double()
    opt = make_optimizer("sgd", model.parameters())
    for step in range(3):
        x, y = (t.double() for t in batch(seed=step, size=12))
        for xm, ym, weight in weighted_microbatches(x, y, 4):
            (((model(xm) - ym) ** 2).sum() * weight).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert norm > 0.5  # the clip matters
        opt.step()
        opt.zero_grad()
    for result in results:
        assert_state_close(result["state"], model)


def test_hugging_face_loss_is_the_mean_over_the_global_batchs_label_tokens(tmp_path):
    """The ranks hold different numbers of label tokens; the loss and the gradients are
    those of the model's own loss on the whole global batch."""
    saved = tmp_path / "saved"
    codes, results, outputs = launch("hf", 2, tmp_path, save_to=str(saved))
    assert codes == [0, 0], outputs
    assert [r["written"] for r in results] == [True, True]
    from support.hf_families import build
    from support.multinode_scenarios import hf_batch

    model = build("qwen3").double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(2):
        ids, labels = hf_batch(step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    for result in results:
        assert result["losses"] == pytest.approx(losses, rel=1e-6)
        assert_state_close(result["state"], model)
    reloaded = type(model).from_pretrained(saved, torch_dtype=torch.float64)
    assert_state_close(reloaded.state_dict(), model)


def test_sharded_checkpoints_resume_bit_for_bit_on_the_same_number_of_nodes(tmp_path):
    checkpoint = tmp_path / "ckpt"
    runs = {}
    for phase in ("save", "load"):
        out = tmp_path / phase
        out.mkdir()
        codes, results, outputs = launch("resume", 2, out, checkpoint=str(checkpoint), phase=phase)
        assert codes == [0, 0], outputs
        runs[phase] = results
    assert sorted(p.name for p in checkpoint.iterdir()) == ["rank0-of-2", "rank1-of-2"]
    for saved, loaded in zip(runs["save"], runs["load"], strict=True):
        for name, tensor in saved["state"].items():
            assert torch.equal(tensor, loaded["state"][name]), name

    from roundpipe import RoundPipe

    (checkpoint / "rank1-of-2" / "masters.safetensors").unlink()
    codes, results, outputs = launch(
        "resume", 2, tmp_path / "load", checkpoint=str(checkpoint), phase="broken"
    )
    assert codes == [0, 0], outputs
    assert results[0]["error"] == "PeerFailure: loading the checkpoint failed on rank(s) [1]"
    assert "masters.safetensors" in results[1]["error"]

    single = RoundPipe(mlp(), devices="emulated:1")
    with pytest.raises(FileNotFoundError, match="shards .* several nodes"):
        single.load_checkpoint(checkpoint)
    single.close()
