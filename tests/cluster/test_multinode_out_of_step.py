"""Ranks that call different collective methods (one saves a checkpoint while the other
starts a call) raise a ``PeerFailure`` on every rank naming what each rank did, at the
collective where they diverged, instead of pairing unrelated data; once out of step a
model's next collective raises at once. Where the ranks wait on different groups (a
step on one rank only), both raise within the timeout with the same message.
"""

from __future__ import annotations

import pytest
from support.multinode import launch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.mark.parametrize("method", ["save_checkpoint", "load_checkpoint"])
def test_ranks_calling_different_methods_raise_on_every_rank_naming_both(tmp_path, method):
    """load_checkpoint exchanges two values where forward_backward's check has one."""
    checkpoint = str(tmp_path / "ckpt")
    codes, results, outputs = launch(
        "one_rank_does", 2, tmp_path, method=method, checkpoint=checkpoint, timeout=90
    )
    assert codes == [0, 0], outputs
    for result in results:
        assert result["error"].startswith("PeerFailure: "), result["error"]
        assert f"rank 0: {method} (" in result["error"], result["error"]
        assert "rank 1: forward_backward (the call-start check)" in result["error"]


def test_once_out_of_step_the_next_collective_raises_at_once(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    codes, results, outputs = launch(
        "one_rank_does", 2, tmp_path, method="save_checkpoint", checkpoint=checkpoint
    )
    assert codes == [0, 0], outputs
    for result in results:
        assert "was not attempted" in result["then"], result["then"]
        assert "rank 0: save_checkpoint" in result["then"], result["then"]
        assert result["then_s"] < 5


def test_step_fns_issuing_different_collectives_raise_on_every_rank(tmp_path):
    codes, results, outputs = launch("step_fns_differ", 2, tmp_path, timeout=90)
    assert codes == [0, 0], outputs
    for result in results:
        assert "PeerFailure" in result["error"], result["error"]
        assert "rank 0: step (an all-reduce inside step_fn)" in result["error"]
        assert "rank 1: step (the step_fn status exchange)" in result["error"]


def test_a_step_on_one_rank_only_fails_within_the_timeout_naming_both(tmp_path):
    timeout_s = 6
    codes, results, outputs = launch(
        "step_on_one_rank", 2, tmp_path, timeout_s=timeout_s, timeout=90
    )
    assert codes == [0, 0], outputs
    for result in results:
        assert "PeerFailure" in result["error"], result["error"]
        assert "rank 0: step (the gradient" in result["error"], result["error"]
        assert "rank 1: forward_backward (the call-start check)" in result["error"]
        assert result["seconds"] < timeout_s + 10
