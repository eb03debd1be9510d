"""Build every architecture of ``architectures`` and check it; one line each.

    .venv/bin/python -m tests.support.check_architectures [NAME ...]

Checks: the config's ``model_type``; every floating parameter and buffer fp32; SDPA
attention where the class supports it, else eager; no dropout; one forward+backward of
the left- and of the right-padded batch gives a finite loss and finite gradients; two
deep copies give bit-identical losses. Noted, not failed: the trainable parameters that
get no gradient (a VLM's vision tower on text; sparse-attention indexers, which their
top-k cuts off from the loss) and a forward that draws random numbers. The times are
build + one forward+backward (right padding), warm and cold (the cold one imports the
modeling code). Exits 1 if any check fails.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

import torch

try:
    from .architectures import ARCHITECTURES, NOT_BUILDABLE, hf_loss_and_grads, padded_batch
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from architectures import ARCHITECTURES, NOT_BUILDABLE, hf_loss_and_grads, padded_batch


def _configs(config):
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


def problems(model, arch) -> tuple[list[str], str]:
    """What is wrong with ``model``, and a note on the trainable parameters that get no
    gradient (the vision tower of a VLM trained on text; indexers trained apart)."""
    found, no_grad = [], {}
    if model.config.model_type != arch.model_type:
        found.append(f"model_type {model.config.model_type}")
    wrong = {
        str(t.dtype)
        for t in [*model.parameters(), *model.buffers()]
        if t.is_floating_point() and t.dtype != torch.float32
    }
    if wrong:
        found.append(f"dtypes {sorted(wrong)}")
    for cfg in _configs(model.config):
        for key, value in cfg.to_diff_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value:
                found.append(f"{cfg.model_type}.{key}={value}")
    attn = model.config.get_text_config()._attn_implementation
    if attn != ("sdpa" if type(model)._supports_sdpa else "eager"):
        found.append(f"attention {attn}")
    for side in ("left", "right"):
        loss, grads = hf_loss_and_grads(model, padded_batch(side=side))
        if not math.isfinite(loss.item()):
            found.append(f"{side}: loss {loss.item()}")
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n in trainable if grads[n] is None]
        if missing:
            no_grad[side] = missing
        bad = [n for n in trainable if grads[n] is not None and not grads[n].isfinite().all()]
        if bad:
            found.append(f"{side}: non-finite grads, e.g. {bad[0]}")
    batch = padded_batch()
    state = torch.get_rng_state()
    a = copy.deepcopy(model)(**batch, use_cache=False).loss
    rng = "" if torch.equal(state, torch.get_rng_state()) else "; the forward draws random numbers"
    b = copy.deepcopy(model)(**batch, use_cache=False).loss
    if not torch.equal(a, b):
        found.append(f"nondeterministic {a.item()} vs {b.item()}")
    if no_grad and no_grad.get("left") != no_grad.get("right"):
        found.append("the parameters without gradient depend on the padding side")
    missing = no_grad.get("left") or no_grad.get("right") or []
    prefixes = sorted({_prefix(n) for n in missing})
    note = f"; no grad: {len(missing)} ({', '.join(prefixes)})" if missing else ""
    return found, note + rng


def _prefix(name: str) -> str:
    """``name`` up to its first module that holds no layer index, with the layer
    indices starred: model.layers.*.self_attn.indexer"""
    parts, out = name.split("."), []
    for part in parts[:-1]:
        out.append("*" if part.isdigit() else part)
        if not part.isdigit() and part not in ("model", "layers", "self_attn", "language_model"):
            break
    return ".".join(out)


def check(arch) -> str:
    try:
        seconds = []
        for _ in range(2):  # cold (imports the modeling code), then warm
            start = time.perf_counter()
            model = arch.build()
            model(**padded_batch(), use_cache=False).loss.backward()
            seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        found, note = problems(model, arch)
    except Exception as error:  # noqa: BLE001 - reported, not raised
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{arch.name:18} {arch.model_type:18} FAIL {type(error).__name__}: {message[:150]}"
    params = sum(p.numel() for p in model.parameters())
    status = ("OK" if not found else "FAIL " + "; ".join(found)) + note
    attn = model.config.get_text_config()._attn_implementation
    return (
        f"{arch.name:18} {arch.model_type:18} {type(model).__name__:38} {params:>8,} "
        f"{attn:5} {seconds[1]:4.2f}s ({seconds[0]:4.2f}s cold) {status}"
    )


def main(names: list[str]) -> int:
    unknown = set(names) - {a.name for a in ARCHITECTURES} - set(NOT_BUILDABLE)
    if unknown:
        print(f"unknown architectures: {sorted(unknown)}")
        return 2
    failed = 0
    warm = ARCHITECTURES[0].build()  # torch's own first-call costs, not any model's
    warm(**padded_batch(), use_cache=False).loss.backward()
    for arch in ARCHITECTURES:
        if names and arch.name not in names:
            continue
        line = check(arch)
        failed += " FAIL" in line
        print(line, flush=True)
    for name, reason in NOT_BUILDABLE.items():
        if not names or name in names:
            print(f"{name:18} NOT_BUILDABLE: {reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
