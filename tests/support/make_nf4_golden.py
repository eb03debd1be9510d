"""Write tests/golden/nf4_bitsandbytes.safetensors: bitsandbytes' NF4 of fixed weights.

Needs bitsandbytes (``pip install 'roundpipe-ft[qlora]'``), which the test suite's
environment does not install (it costs every process that builds a peft model ~3 s of
import). ``tests/hf/test_nf4_format.py`` compares ``roundpipe.hf.nf4_format`` with these
bytes everywhere, and with bitsandbytes itself where it is installed.

    .venv/bin/python tests/support/make_nf4_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from support.nf4_cases import DTYPES, SHAPES, bnb_nf4, extreme_weight, weights  # noqa: E402

OUT = HERE.parent / "golden" / "nf4_bitsandbytes.safetensors"


def main() -> None:
    import bitsandbytes
    from bitsandbytes import functional

    tensors: dict[str, torch.Tensor] = {}
    cases = [
        (f"{'x'.join(map(str, s)) or 'scalar'}", weights(s, d), d) for s in SHAPES for d in DTYPES
    ]
    cases += [("extreme", extreme_weight(d), d) for d in DTYPES]
    with torch.compiler.set_stance("force_eager"):
        for name, weight, dtype in cases:
            key = f"{name}/{str(dtype).removeprefix('torch.')}"
            packed, absmax, dense = bnb_nf4(functional, weight)
            tensors[f"{key}/weight"] = weight.contiguous()
            tensors[f"{key}/packed"] = packed.contiguous()
            tensors[f"{key}/absmax"] = absmax.contiguous()
            tensors[f"{key}/dense"] = dense.contiguous()
    save_file(tensors, OUT, metadata={"bitsandbytes": bitsandbytes.__version__})
    print(f"{OUT}: {len(cases)} weights, bitsandbytes {bitsandbytes.__version__}")


if __name__ == "__main__":
    main()
