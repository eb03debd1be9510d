"""Every architecture of ``support/architectures.py`` against the transformers model itself.

Each is a tiny random model built from transformers' own config class with its quirks
on (windows shorter than the sequence, alternating layer types, multipliers and
soft-caps at real values, MLA, shared experts, Mamba / Gated DeltaNet / short-conv
hybrids, VLMs on text). Two SGD steps through ``from_hf`` on two emulated devices, 5
rows in 3 microbatches: a left-padded batch with a prompt-masked row, then the same
tokens unpadded. The loss is the model's own on the whole batch; the gradients are the
model's own summed over the same microbatches (what gradient accumulation computes; to
1e-4 of each tensor's largest gradient), and close to its whole-batch gradients (a
split alone moves the last bits of fp32 sums: up to 2e-4 of the largest gradient for
the Gated DeltaNet and MoE models, in transformers itself). The architectures the
general path cannot run are refused at ``from_hf``, by ``model_type`` and reason. This
file's lists are the README's table.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.architecture_status import REFUSED, TRAINED, readme_table  # noqa: E402
from support.architectures import ARCHITECTURES, architecture, padded_batch, prompt_masked  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.hf import UnsupportedModel  # noqa: E402

MICROBATCHES = (slice(0, 2), slice(2, 4), slice(4, 5))  # 5 rows in 3, as the runtime splits


def two_batches() -> list[dict]:
    ids = padded_batch()["input_ids"]
    return [prompt_masked(padded_batch(side="left")), {"input_ids": ids, "labels": ids}]


def split_gradients(model, batch: dict) -> dict[str, torch.Tensor | None]:
    """The model's own gradients of the batch-mean loss, summed over :data:`MICROBATCHES`."""
    count = (batch["labels"][:, 1:] != -100).sum()
    for rows in MICROBATCHES:
        part = {key: value[rows] for key, value in batch.items()}
        share = (part["labels"][:, 1:] != -100).sum() / count
        (model(**part, use_cache=False).loss * share).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def assert_gradients_close(got, want, rtol: float) -> None:
    for name, expected in want.items():
        if expected is None:  # vision towers on text, top-k indexers: no gradient
            assert got[name] is None or not got[name].any(), name
            continue
        scale = float(expected.abs().max()) + 1e-6
        torch.testing.assert_close(
            got[name],
            expected,
            rtol=rtol,
            atol=rtol * scale,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("name", TRAINED)
def test_two_steps_equal_the_hugging_face_model(name):
    model = architecture(name).build()
    whole, split = copy.deepcopy(model), copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (whole, split)]
    config = RoundPipeRunConfig(num_microbatch=3)
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        for batch in two_batches():
            loss = pipe.forward_backward(input_kwargs=batch)
            pipe.synchronize()
            want = whole(**batch, use_cache=False).loss
            want.backward()
            torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
            got = {n: p.grad for n, p in model.named_parameters()}
            assert_gradients_close(got, split_gradients(split, batch), rtol=1e-4)
            assert_gradients_close(got, {n: p.grad for n, p in whole.named_parameters()}, 1e-3)
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
            for step in optimizers:
                step.step()
                step.zero_grad()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_architecture_the_general_path_cannot_run_is_refused_by_name(name):
    arch = architecture(name)
    with pytest.raises(UnsupportedModel, match=REFUSED[name]) as refused:
        roundpipe.from_hf(arch.build(), devices="emulated:1")
    assert f"model_type {arch.model_type!r}" in str(refused.value)


def test_every_architecture_is_trained_or_refused():
    assert set(REFUSED) <= {arch.name for arch in ARCHITECTURES}
    assert len(TRAINED) + len(REFUSED) == len(ARCHITECTURES)


def test_the_readme_table_is_the_one_these_tests_check():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- architectures:begin -->\n")[1].split("\n<!-- architectures:end")[0]
    assert block == readme_table(), "run: python bench/model_breadth.py --readme"
