"""``roundpipe train --report-to``: each ``metrics.jsonl`` row also reaches TensorBoard
and Weights & Biases (offline) through the real libraries, under the names
``transformers``' integrations use; read back with TensorBoard's own event reader and
from the offline run's ``.wandb`` log. Unknown names and missing packages are refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from support.train_cli import COMMON, REPO, RUN_LIMIT_S, metrics, run_train  # noqa: E402

from roundpipe.train.options import UsageError, resolve  # noqa: E402
from roundpipe.train.trackers import RUNS_DIR, open_trackers, tracked_names  # noqa: E402

ROW = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75, "tokens": 90,
       "tokens_per_s": 400.0, "elapsed_s": 1.5, "eval_loss": 2.25}  # fmt: skip


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_history(run_file: Path) -> list[dict]:
    """The ``history`` records of an offline run's ``.wandb`` file (a LevelDB-style log of
    ``Record`` protobufs: 7-byte header, 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, rows = run_file.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):  # FULL and LAST end a record
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_rows_take_trainers_names():
    assert dict(tracked_names(ROW)) == {
        "train/loss": 2.5, "train/learning_rate": 1e-3, "train/grad_norm": 0.75,
        "train/tokens": 90, "train/tokens_per_s": 400.0, "train/elapsed_s": 1.5,
        "eval/loss": 2.25,
    }  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="no tensorboard")
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="no wandb")
def test_a_run_reports_every_row_to_tensorboard_and_wandb(train_files, tmp_path):
    output = tmp_path / "out"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    done = run_train(
        "--model", train_files["model"], "--data", train_files["text"], "--output", output,
        *COMMON, "--steps", "3", "--eval-data", train_files["eval"], "--eval-every", "2",
        "--report-to", "tensorboard,wandb", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = metrics(output)
    want = {name: {r["step"]: value for r in rows for n, value in tracked_names(r) if n == name}
            for name in {n for r in rows for n, _ in tracked_names(r)}}  # fmt: skip
    assert set(want) >= {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss"}
    assert want["eval/loss"].keys() == {2, 3}
    scalars = tensorboard_scalars(output / RUNS_DIR)
    assert {
        tag: {s: pytest.approx(v, rel=1e-6) for s, v in by_step.items()}
        for tag, by_step in scalars.items()
    } == want  # fmt: skip (float32 in the events)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    assert [h["_step"] for h in history] == [1, 2, 3]
    for record in history:
        for name, by_step in want.items():
            if record["_step"] in by_step:
                assert record[name] == by_step[record["_step"]]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="no tensorboard")
def test_a_resumed_run_purges_the_points_logged_after_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing import event_file_loader

    first = open_trackers(["tensorboard"], tmp_path, {})
    for step in range(1, 6):  # interrupted after step 5, its checkpoint at step 3
        first.log(step, {"step": step, "loss": 10.0 + step})
    first.close()
    again = open_trackers(["tensorboard"], tmp_path, {}, resumed_from=3)
    for step in (4, 5):
        again.log(step, {"step": step, "loss": 20.0 + step})
    again.close()
    assert tensorboard_scalars(tmp_path / RUNS_DIR)["train/loss"] == {
        1: 11.0,
        2: 12.0,
        3: 13.0,
        4: 24.0,
        5: 25.0,
    }
    newest = max((tmp_path / RUNS_DIR).glob("events.*"), key=lambda p: p.stat().st_mtime_ns)
    starts = [e.step for e in event_file_loader.EventFileLoader(str(newest)).Load()
              if e.HasField("session_log")]  # fmt: skip
    assert starts == [4]  # the purge mark readers drop the old steps 4 and 5 by


def test_only_rank_0_reports(tmp_path):
    trackers = open_trackers(["tensorboard"], tmp_path, {}, main=False)
    trackers.log(1, ROW)
    trackers.close()
    assert not (tmp_path / RUNS_DIR).exists()


def given(**options) -> dict:
    return {"model": "m", "data": "d.jsonl", "output": Path("out"), **options}


def test_an_unknown_tracker_is_refused_naming_the_valid_ones():
    with pytest.raises(UsageError, match="unknown 'mlflow'.*tensorboard, wandb, trackio"):
        resolve(given(report_to="tensorboard,mlflow"))


def test_an_unknown_name_is_told_before_a_missing_package_and_a_repeated_one_logs_once(
    monkeypatch,
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(UsageError, match="unknown 'mlflow'"):
        resolve(given(report_to="tensorboard,mlflow"))
    options = resolve(given(report_to="wandb,wandb"))
    assert options.trackers() == ["wandb"]


def test_a_tracker_that_fails_to_import_is_one_line_not_a_traceback(monkeypatch, tmp_path):
    import sys

    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("raise RuntimeError('broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with pytest.raises(UsageError, match=r"wandb package is installed but fails to import "
                       r"\(RuntimeError: broken install\)"):  # fmt: skip
        resolve(given(report_to="wandb"))


def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        UsageError,
        match=re.escape(
            "the wandb package is not installed: pip install 'roundpipe-ft[wandb]' "
            "(from a checkout: pip install -e '.[wandb]')"
        ),
    ):
        resolve(given(report_to="wandb"))


TRACKIO_SCRIPT = """
import json, sys
from pathlib import Path
from roundpipe.train.trackers import open_trackers
from trackio.sqlite_storage import SQLiteStorage
trackers = open_trackers(["trackio"], Path(sys.argv[1]), {"lr": 1e-3})
trackers.log(3, json.loads(sys.argv[2]))
trackers.close()
print(json.dumps(SQLiteStorage.get_logs("roundpipe-test", "out")))
"""


def test_trackio_receives_the_rows(tmp_path):
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio (the optional extra) is not installed")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"),
           "TRACKIO_PROJECT": "roundpipe-test", "PYTHONPATH": str(REPO)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "out"), json.dumps(ROW)],
        capture_output=True, text=True, env=env, timeout=RUN_LIMIT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (logged,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert logged["step"] == 3
    assert {k: logged[k] for k in dict(tracked_names(ROW))} == dict(tracked_names(ROW))
