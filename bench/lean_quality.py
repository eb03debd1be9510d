"""The quality of the lean full fine-tuning settings against fp32 AdamW.

As ``bench/step_mode.py`` does: the demo model (``roundpipe train --demo``, trained to
convergence on its chat set) is fine-tuned on another task (the synthetic arithmetic
chats of ``step_mode.py``), ``--full`` in bf16 (``--precision bf16``, the weights' dtype
on CUDA) at lr 2e-5, with each setting of ``--master-weights`` and
``--optimizer-states``: fp32/fp32 (the default, the baseline), fp32 masters with int8
states, bf16 masters with bf16 states, bf16 masters with int8 states; three seeds each.
It prints the final eval loss of every run and, per setting, the mean over seeds and
its ratio to the baseline's. Every run is a ``roundpipe train`` subprocess on emulated
devices.

    .venv/bin/python bench/lean_quality.py [--steps 100] [--seeds 0,1,2] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from step_mode import final_eval_loss, roundpipe, two_tasks

SETTINGS = {  # name: (--master-weights, --optimizer-states)
    "fp32 masters, fp32 states": ("fp32", "fp32"),
    "fp32 masters, int8 states": ("fp32", "int8"),
    "bf16 masters, bf16 states": ("bf16", "bf16"),
    "bf16 masters, int8 states": ("bf16", "int8"),
}
BASELINE = "fp32 masters, fp32 states"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr", default="2e-5")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="roundpipe-lean-quality-"))
    base, train, held_out = two_tasks(work)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for name, (masters, states) in SETTINGS.items():
        for seed in seeds:
            output = work / f"{masters}-{states}-{seed}"
            started = time.monotonic()
            if not (output / "model.safetensors").exists():  # else finished before
                shutil.rmtree(output, ignore_errors=True)  # a run cut short: again
                roundpipe(
                    "--model", str(base), "--data", str(train), "--eval-data", str(held_out),
                    "--output", str(output), "--steps", str(args.steps), "--batch-size", "16",
                    "--seq-len", "64", "--warmup-steps", "10", "--eval-every", str(args.steps),
                    "--seed", str(seed), "--full", "--lr", args.lr, "--precision", "bf16",
                    "--master-weights", masters, "--optimizer-states", states,
                )  # fmt: skip
            runs.append({"setting": name, "master_weights": masters, "optimizer_states": states,
                         "seed": seed, "eval_loss": final_eval_loss(output),
                         "seconds": round(time.monotonic() - started, 1)})  # fmt: skip
            if not args.json:
                print(f"{name}, seed {seed}: eval loss {runs[-1]['eval_loss']:.4f} "
                      f"({runs[-1]['seconds']:.0f} s)", flush=True)  # fmt: skip
    means = {
        name: statistics.mean(r["eval_loss"] for r in runs if r["setting"] == name)
        for name in SETTINGS
    }
    summary = {name: {"mean": m, "ratio": m / means[BASELINE]} for name, m in means.items()}
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary, "steps": args.steps, "lr": args.lr}))
        return
    print(f"\n| setting | eval loss, seeds {args.seeds} | mean | / baseline |")
    print("| --- | --- | ---: | ---: |")
    for name in SETTINGS:
        losses = ", ".join(f"{r['eval_loss']:.4f}" for r in runs if r["setting"] == name)
        row = summary[name]
        print(f"| {name} | {losses} | {row['mean']:.4f} | {row['ratio']:.4f} |")


if __name__ == "__main__":
    main()
