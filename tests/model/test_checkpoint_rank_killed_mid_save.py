"""A rank killed while several save together never costs the previous checkpoint: the
save commits in two phases, and a load takes the newest save every rank holds."""

from __future__ import annotations

import pytest
import torch
from support.multinode import launch

# where rank 1 dies in the second save: (the save the next load finds, does it warn)
KILLS = {"writing": ("A", False), "swapping": ("A", True), "swapped": ("B", False)}


@pytest.mark.parametrize("kill_at", KILLS)
def test_a_rank_killed_mid_save_leaves_the_newest_complete_set_loadable(tmp_path, kill_at):
    checkpoint = tmp_path / "ckpt"
    (tmp_path / "save").mkdir()
    params = {"checkpoint": str(checkpoint), "phase": "save", "kill_at": kill_at}
    codes, saved, outputs = launch("save_killed", 2, tmp_path / "save", **params)
    assert codes[1] == -9 and codes[0] == 0, outputs
    assert saved[0]["error"].startswith("PeerFailure"), saved[0]["error"]

    (tmp_path / "load").mkdir()
    codes, loaded, outputs = launch(
        "save_killed", 2, tmp_path / "load", checkpoint=str(checkpoint), phase="load"
    )
    assert codes == [0, 0], outputs
    want, warns = KILLS[kill_at]
    for result in loaded:
        assert result["loaded"] == want
        for name, tensor in saved[0]["states"][want].items():
            assert torch.equal(result["states"][want][name], tensor), name
        assert bool(result["warnings"]) == warns, result["warnings"]
        assert result["then"] == "C"  # a save over what the kill left works
    if warns:
        assert "did not complete on every rank" in loaded[0]["warnings"][0]
    assert sorted(p.name for p in checkpoint.iterdir()) == ["rank0-of-2", "rank1-of-2"]
