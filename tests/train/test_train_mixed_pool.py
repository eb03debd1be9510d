"""``roundpipe train`` on a mixed pool: ``--devices emulated:N@speeds`` is accepted, the
run reports the devices it found per class and, at the end, the speed measured per
class and the plan; a bad speed list is refused before anything runs."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from roundpipe.cli import main  # noqa: E402
from roundpipe.core.plan import Plan  # noqa: E402

SPEEDS_LINE = re.compile(
    r"pool speeds measured: emulated (\d\.\d\d), emulated@0\.5x (\d\.\d\d); plan (\S+)"
)


def train_output(train_files, tmp_path, capsys, devices: str) -> str:
    """What a 3-step LoRA run on ``devices`` printed."""
    args = ["--model", train_files["model"], "--data", train_files["text"], "--output",
            tmp_path / "out", "--seq-len", "32", "--batch-size", "8", "--steps", "3",
            "--devices", devices]  # fmt: skip
    assert main(["train", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_a_mixed_pool_trains_and_reports_its_classes_speeds_and_plan(train_files, tmp_path, capsys):
    out = train_output(train_files, tmp_path, capsys, "emulated:2@1,0.5")
    assert "devices: 1 x emulated (unlimited), 1 x emulated@0.5x (unlimited)\n" in out
    found = SPEEDS_LINE.search(out)
    assert found is not None, out
    speeds = sorted(float(speed) for speed in found.group(1, 2))
    assert speeds[-1] == 1.0 and 0 < speeds[0] <= 1.0  # relative to the fastest class
    Plan.parse(found.group(3)).validate(4)  # raises unless it covers the model's 4 layers
    assert out.index("devices: ") < out.index("step 1/3") < found.start()


def test_an_equal_pool_reports_its_devices_without_speeds(train_files, tmp_path, capsys):
    out = train_output(train_files, tmp_path, capsys, "emulated:2")
    assert "devices: 2 x emulated (unlimited)\n" in out
    assert "pool speeds measured" not in out


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("emulated:2@fast", "--devices 'emulated:2@fast': write 'cuda' (all GPUs)"),
        ("emulated:4@1,0.5", "speeds lists 2 speeds for 4 devices"),
        ("emulated:2@0", "a device speed must be finite and above 0"),
    ],
)
def test_a_bad_speed_list_exits_2_naming_the_forms(train_files, tmp_path, capsys, devices, message):
    args = ["--model", train_files["model"], "--data", train_files["text"], "--output",
            tmp_path / "out", "--devices", devices]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "'emulated:N@S1,...,SN'" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_lora_dropout_recomputed_on_another_kind_of_device_exits_2(train_files, tmp_path, capsys):
    """The adapters' dropout draws in every layer; on a pool of two kinds the first call
    (plan 2|2,2: forward on device 0, recompute on device 2) recomputes layers on the
    other kind than their forward's: refused, exit 2."""
    args = ["--model", train_files["model"], "--data", train_files["text"], "--output",
            tmp_path / "out", "--seq-len", "32", "--batch-size", "8", "--steps", "3",
            "--devices", "emulated:3@1,0.5,0.5", "--lora-dropout", "0.1"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *map(str, args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "would be recomputed on" in err and "--lora-dropout 0" in err, err
    assert len(err.strip().splitlines()) == 1, err
