"""``roundpipe export --checkpoint RUN/checkpoints/step-N --output DIR [--merge]``.

The oracles: what ``roundpipe train`` wrote at the same step (the model or the adapter:
the same tensors, the same logits through ``transformers`` / ``peft``), and peft's own
``merge_and_unload`` of that adapter on the base in its dtype for ``--merge``. The runs
(a bf16-stored base trained in fp32) are shared with ``test_train_save_dtype.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.train_cli import REPO  # noqa: E402
from support.train_dtype_runs import bf16_runs  # noqa: E402

from roundpipe.cli import main  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [12, 11, 10, 9, 8, 7, 6, 5]])


@pytest.fixture(scope="module")
def runs(train_files, tmp_path_factory):
    return bf16_runs(tmp_path_factory.mktemp("dtype-runs"), train_files["prompt_completion"])


def export(*args) -> None:
    assert main(["export", *map(str, args)]) == 0


def refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", *map(str, args)])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def model_at(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype="auto")


def adapter_at(base, directory):
    return peft.PeftModel.from_pretrained(model_at(base), directory)


def test_a_full_checkpoint_exports_the_model_the_run_saved(runs, tmp_path):
    export("--checkpoint", runs["full"] / "checkpoints" / "step-4", "--output", tmp_path / "m")
    exported, saved = model_at(tmp_path / "m"), model_at(runs["full"])
    assert exported.dtype == torch.bfloat16
    torch.testing.assert_close(exported.state_dict(), saved.state_dict(), rtol=0, atol=0)
    assert torch.equal(logits(exported), logits(saved))
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == (
        runs["full"] / "tokenizer.json"
    ).read_bytes()


def test_a_lora_checkpoint_exports_the_adapter_the_run_saved(runs, tmp_path):
    export("--checkpoint", runs["lora"] / "checkpoints" / "step-4", "--output", tmp_path / "a")
    name = "adapter_model.safetensors"
    assert (tmp_path / "a" / name).read_bytes() == (runs["lora"] / name).read_bytes()
    ours, theirs = (json.loads((d / "adapter_config.json").read_text())
                    for d in (tmp_path / "a", runs["lora"]))  # fmt: skip
    assert set(ours.pop("target_modules")) == set(theirs.pop("target_modules")) and ours == theirs
    base = runs["base"]
    assert torch.equal(
        logits(adapter_at(base, tmp_path / "a")), logits(adapter_at(base, runs["lora"]))
    )


def test_an_earlier_step_exports_that_step(runs, tmp_path):
    export("--checkpoint", runs["lora"] / "checkpoints" / "step-2", "--output", tmp_path / "a")
    at_2 = logits(adapter_at(runs["base"], tmp_path / "a"))
    assert not torch.equal(at_2, logits(adapter_at(runs["base"], runs["lora"])))


def test_merge_folds_the_adapter_into_the_base_in_its_dtype(runs, tmp_path):
    export("--checkpoint", runs["lora"] / "checkpoints" / "step-4", "--output", tmp_path / "m",
           "--merge")  # fmt: skip
    merged = model_at(tmp_path / "m")
    oracle = adapter_at(runs["base"], runs["lora"]).merge_and_unload()
    assert merged.dtype == oracle.dtype == torch.bfloat16
    torch.testing.assert_close(merged.state_dict(), oracle.state_dict(), rtol=0, atol=0)
    assert torch.equal(logits(merged), logits(oracle))


def test_merge_with_save_dtype_converts_the_merged_model(runs, tmp_path):
    export("--checkpoint", runs["lora"] / "checkpoints" / "step-4", "--output", tmp_path / "m",
           "--merge", "--save-dtype", "fp32")  # fmt: skip
    merged = model_at(tmp_path / "m")
    oracle = adapter_at(runs["base"], runs["lora"]).merge_and_unload()
    assert merged.dtype == torch.float32
    for name, tensor in oracle.state_dict().items():
        assert torch.equal(merged.state_dict()[name], tensor.float()), name


def test_a_sharded_checkpoint_exports_from_a_rank_shard(runs, tmp_path):
    """Every rank's weights file holds every trained weight: rank 0's shard is enough."""
    step = runs["lora"] / "checkpoints" / "step-4"
    sharded = tmp_path / "run" / "checkpoints" / "step-4"
    for rank in (0, 1):
        shutil.copytree(step, sharded / f"rank{rank}-of-2")
        state = json.loads((sharded / f"rank{rank}-of-2" / "state.json").read_text())
        state["shard"] = {"rank": rank, "world": 2, "save_id": state.pop("save_id", 7)}
        (sharded / f"rank{rank}-of-2" / "state.json").write_text(json.dumps(state))
    export("--checkpoint", sharded, "--output", tmp_path / "a")
    name = "adapter_model.safetensors"
    assert (tmp_path / "a" / name).read_bytes() == (runs["lora"] / name).read_bytes()


def test_merge_of_a_full_checkpoint_is_refused(runs, tmp_path, capsys):
    err = refused(capsys, "--checkpoint", runs["full"] / "checkpoints" / "step-4", "--output",
                  tmp_path / "m", "--merge")  # fmt: skip
    assert "--merge" in err and "no adapter to merge" in err
    assert not (tmp_path / "m").exists()


def test_a_non_empty_output_is_refused(runs, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("mine")
    err = refused(capsys, "--checkpoint", runs["full"] / "checkpoints" / "step-4", "--output",
                  tmp_path / "m")  # fmt: skip
    assert "exists and is not empty" in err
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["keep.txt"]


def test_a_directory_that_is_no_checkpoint_is_refused(runs, tmp_path, capsys):
    directory = runs["full"] / "checkpoints"  # (a run's --output gives its newest)
    err = refused(capsys, "--checkpoint", directory, "--output", tmp_path / "m")
    assert f"--checkpoint {directory}: not a readable checkpoint" in err


def test_export_is_a_subcommand_of_the_console_script(runs, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "roundpipe", "export", "--checkpoint",
         str(runs["lora"] / "checkpoints" / "step-4"), "--output", str(tmp_path / "a")],
        capture_output=True, text=True, cwd=REPO, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "wrote the LoRA adapter to" in done.stdout


def _fails_while_saving(monkeypatch, error):
    import roundpipe.train.result as result

    def save_result(model, tokenizer, path, *args, **kwargs):
        (path / "partial.safetensors").write_bytes(b"x")
        raise error

    monkeypatch.setattr(result, "save_result", save_result)


@pytest.mark.parametrize(
    "error, code, line",
    [
        (OSError(28, "No space left on device"), 1, "no space left to write"),
        (OSError(27, "File too large"), 1, "would exceed the file-size limit (ulimit -f)"),
        (KeyboardInterrupt(), 130, "interrupted; nothing was written to"),
    ],
)
def test_a_failed_write_is_one_line_and_leaves_nothing(runs, tmp_path, monkeypatch, capsys,
                                                       error, code, line):  # fmt: skip
    _fails_while_saving(monkeypatch, error)
    output = tmp_path / "out"
    step = runs["lora"] / "checkpoints" / "step-4"
    assert main(["export", "--checkpoint", str(step), "--output", str(output)]) == code
    err = capsys.readouterr().err
    assert line in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []  # no output, no staging directory left


def test_an_export_racing_another_to_one_output_keeps_nothing_and_says_so(
    runs, tmp_path, monkeypatch, capsys
):
    import roundpipe.train.result as result

    output = tmp_path / "out"
    real = result.save_result

    def save_result(*args, **kwargs):
        real(*args, **kwargs)
        output.mkdir()  # the other export finished first
        (output / "adapter_model.safetensors").write_bytes(b"theirs")

    monkeypatch.setattr(result, "save_result", save_result)
    step = runs["lora"] / "checkpoints" / "step-4"
    assert main(["export", "--checkpoint", str(step), "--output", str(output)]) == 1
    assert "was written by another export meanwhile" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (output / "adapter_model.safetensors").read_bytes() == b"theirs"


def test_past_the_file_size_limit_a_real_export_exits_1_in_one_line(runs, tmp_path):
    import resource

    output = tmp_path / "out"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # noqa: E731
    done = subprocess.run(
        [sys.executable, "-m", "roundpipe", "export", "--checkpoint",
         str(runs["full"] / "checkpoints" / "step-4"), "--output", str(output)],
        capture_output=True, text=True, cwd=REPO, preexec_fn=limit, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("roundpipe export: error: a file of")
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []
