"""``pipe(...)`` of a ``from_hf`` model under ``torch.no_grad()`` on fewer rows than the
pipe's microbatches: the call runs with one microbatch per row and returns the
transformers model's logits (a chat's single prompt needs no padding rows)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.architectures import VOCAB, architecture, padded_batch  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402


@pytest.mark.parametrize(
    ("rows", "microbatches"), [(1, None), (2, 4)], ids=["one-row-default-3", "two-rows-of-4"]
)
def test_no_grad_call_on_fewer_rows_than_microbatches_returns_the_models_logits(rows, microbatches):
    model = architecture("llama").build()
    batch = padded_batch(rows=rows, side="left")
    with torch.no_grad():
        want = model(**batch)
    config = RoundPipeRunConfig(num_microbatch=microbatches)
    with (
        roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe,
        torch.no_grad(),
    ):
        logits = pipe(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], want.logits[valid], rtol=1e-5, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6)
