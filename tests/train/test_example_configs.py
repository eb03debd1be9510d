"""The configs of ``examples/configs/``: each loads as ``roundpipe train --config`` loads
it (``read_config``, then ``resolve`` with the command line), with our own option
names and values the command accepts; each names itself in the command its comments
give; the Qwen3 LoRA config trains a few steps on the tiny model with only the model,
data, output and sizes given beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from support.train_cli import metrics  # noqa: E402
from support.train_fixtures import build_model_dir, write_data  # noqa: E402

from roundpipe.cli import main  # noqa: E402
from roundpipe.train.options import OPTIONS, TrainOptions, read_config, resolve  # noqa: E402
from roundpipe.train.usage import UsageError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "examples" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
OUR_NAMES = {option.name for option in OPTIONS}
LEAN_KEYS = {"optimizer-states", "master-weights"}


def load_as_train_does(path: Path, model: Path) -> TrainOptions:
    """The options ``roundpipe train --config path --model model`` runs with."""
    return resolve({"model": str(model)}, read_config(path))


def test_there_are_configs_for_each_kind_of_run():
    names = {path.stem for path in CONFIGS}
    assert {"qwen3-8b-lora", "qwen3-8b-full", "llama-3.1-8b-lora", "llama-3.1-8b-full",
            "llama-3.3-70b-qlora", "llama-3.1-8b-long-context",
            "qwen3-8b-two-nodes"} <= names  # fmt: skip


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_loads_as_train_loads_it(path, tmp_path):
    if LEAN_KEYS & set(yaml.safe_load(path.read_text())):
        pytest.importorskip("torchao")
    options = load_as_train_does(path, tmp_path)
    assert options.model == str(tmp_path)
    assert options.data and options.output


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_uses_our_own_option_names(path):
    keys = set(yaml.safe_load(path.read_text()))
    assert keys <= OUR_NAMES, f"not our spelling: {sorted(keys - OUR_NAMES)}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_names_itself_in_the_command_it_gives(path):
    assert f"--config examples/configs/{path.name}" in path.read_text()


def test_the_two_node_config_gives_the_torchrun_line():
    text = (CONFIG_DIR / "qwen3-8b-two-nodes.yaml").read_text()
    assert "torchrun --nnodes 2 --node-rank R" in text
    assert "-m roundpipe train --config examples/configs/qwen3-8b-two-nodes.yaml" in text


@pytest.mark.parametrize(
    ("line", "message"),
    [("lora_rank: 16", "unknown option 'lora_rank'"), ("schedule: cosine-ish", "must be one of")],
)
def test_loading_refuses_an_unknown_key_or_an_invalid_value(tmp_path, line, message):
    config = tmp_path / "bad.yaml"
    config.write_text(f"data: a.jsonl\noutput: out\n{line}\n")
    with pytest.raises(UsageError, match=message):
        load_as_train_does(config, tmp_path)


def test_the_qwen3_lora_config_trains_a_few_steps_on_the_tiny_model(tmp_path):
    model = build_model_dir(tmp_path / "model")
    data = write_data(tmp_path / "chats.jsonl", "messages")
    output = tmp_path / "run"
    sizes = ["--devices", "emulated:2", "--seq-len", "32", "--batch-size", "8", "--steps", "3"]
    code = main(
        ["train", "--config", str(CONFIG_DIR / "qwen3-8b-lora.yaml"), "--model", str(model),
         "--data", str(data), "--output", str(output), *sizes]
    )  # fmt: skip
    assert code == 0
    rows = metrics(output)
    assert [row["step"] for row in rows] == [1, 2, 3] and "eval_loss" in rows[-1]
    resolved = yaml.safe_load((output / "run.yaml").read_text())
    assert (resolved["lora_r"], resolved["lora_dropout"], resolved["packing"]) == (16, 0.05, True)
    assert resolved["eval_split"] == 0.02 and resolved["warmup_ratio"] == 0.03
    adapter = json.loads((output / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (16, 32)
