"""Every rank starts from rank 0's model, as with DDP: ranks whose models were initialised
differently train like one process on the global batch from rank 0's initial
parameters and buffers; a model that differs in shape is refused on every rank.

Oracle: plain PyTorch (``tests/support/oracle.py``) on ``offset_mlp(seed=0)``, float64
(the only difference is the order of the gradient sums; tolerance as in
``test_multinode.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.multinode import launch
from support.multinode_agreement import offset_mlp
from support.oracle import batch, train_reference

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_differently_seeded_ranks_train_like_one_process_from_rank_0s_weights(tmp_path):
    steps = 3
    codes, results, outputs = launch("seeded_by_rank", 2, tmp_path, steps=steps)
    assert codes == [0, 0], outputs
    batches = [tuple(t.double() for t in batch(seed=s, size=12)) for s in range(steps)]
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    want, _ = train_reference(offset_mlp(seed=0), batches, 4, adam)
    assert not torch.equal(offset_mlp(seed=1)[-1].offset, want[-1].offset)  # the buffer too
    for result in results:
        for name, tensor in want.state_dict().items():
            torch.testing.assert_close(result["state"][name], tensor, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("part", ["weight", "buffer"])
def test_a_model_that_differs_in_shape_is_refused_on_every_rank(tmp_path, part):
    codes, results, outputs = launch("model_differs", 2, tmp_path, part=part, timeout=60)
    assert codes == [0, 0], outputs
    for rank, result in enumerate(results):
        assert result["error"].startswith("ValueError: "), result["error"]
        assert f"rank {rank}: ranks [1] wrap a model different from rank 0's" in result["error"]
