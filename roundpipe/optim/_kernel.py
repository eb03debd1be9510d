"""The 8-bit AdamW step as one C loop over the state blocks, built with the C compiler
that ``torch.compile`` needs on CPU anyway, and loaded with ``ctypes``
(docs/design.md#host-memory).

Per block of 256 values it dequantizes both moments, updates them, takes their maxima,
requantizes them by table (:mod:`roundpipe.optim.quant8`) and updates the parameter: one
pass over memory, where inductor's kernel for the same step makes three. Each line is an
fp32 operation of torchao's step in the order inductor emits it, compiled without
contraction into fused multiply-adds or fast-math, so the results equal torchao's bit
for bit (``tests/optim/test_lean_optimizers.py`` checks). ``ctypes`` releases the GIL for the
call; OpenMP spreads the blocks over ``torch.get_num_threads()`` threads.

The shared object is cached per source and machine under ``~/.cache/roundpipe``; where
no compiler works, :func:`load` returns ``None`` and the caller takes the compiled step.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE float from_bf16(uint16_t h) { return float_of((uint32_t)h << 16); }
INLINE uint16_t to_bf16(float f) {  /* round to nearest even, NaN to 0x7FC0, as c10 */
    const uint32_t u = bits_of(f);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}
/* 16 random bits for element i of a step (splitmix64 of a counter: no generator state). */
INLINE uint32_t random16(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)((z ^ (z >> 31)) >> 48);
}
/* torchao's bf16 stochastic rounding (_fp32_to_bf16_sr) with the random bits given:
   away from zero when the bits fall below the 16 bits rounded off. */
INLINE uint16_t to_bf16_stochastic(float f, uint32_t r) {
    const uint32_t u = bits_of(f);
    return (uint16_t)(((u & 0xFFFF0000u) + (r < (u & 0xFFFFu) ? 0x10000u : 0u)) >> 16);
}
/* mode 0: fp32 parameter; 1: bf16, rounded to nearest; 2: bf16, rounded stochastically. */
INLINE float load_param(const void *param, int64_t i, const int mode) {
    return mode ? from_bf16(((const uint16_t *)param)[i]) : ((const float *)param)[i];
}
INLINE void store_param(void *param, int64_t i, float p, const int mode, uint64_t key) {
    if (mode == 0) ((float *)param)[i] = p;
    else if (mode == 1) ((uint16_t *)param)[i] = to_bf16(p);
    else ((uint16_t *)param)[i] = to_bf16_stochastic(p, random16(key, (uint64_t)i));
}
INLINE uint8_t quantize(float x, const int32_t *codes, const float *inside,
                        int32_t shift, int32_t low, int32_t buckets) {
    const int32_t bits = (int32_t)bits_of(x);
    int32_t b = ((bits & 0x7FFFFFFF) >> shift) - low;
    b = b < 0 ? 0 : b;
    b = b > buckets - 1 ? buckets - 1 : b;
    b += bits < 0 ? buckets : 0;
    return (uint8_t)(codes[b] + (x >= inside[b]));
}

typedef struct {
    uint8_t *codes; float *scale; const float *qmap; const int32_t *table;
    const float *inside; float alpha; int from_end;
} state_t;

/* One block of torchao's step, for one combination of parameter and gradient dtype
   (constants where it is inlined, so that each loop is vectorised). */
INLINE void block_step(void *param, const void *grad, int64_t o, int64_t block,
                       state_t m_state, state_t v_state, float *m, float *v,
                       int32_t shift, int32_t low, int32_t buckets, float lr, float lr_wd,
                       float bias_correction1, float bias_correction2_sqrt, float eps,
                       uint64_t key, const int param_mode, const int grad_bf16) {
    const float m_old_scale = m_state.scale[o / block], v_old_scale = v_state.scale[o / block];
    uint32_t m_max_bits = 0, v_max_bits = 0;  /* |x| compare as their bits */
    #pragma GCC ivdep
    for (int64_t i = 0; i < block; i++) {
        const float g = grad_bf16 ? from_bf16(((const uint16_t *)grad)[o + i])
                                  : ((const float *)grad)[o + i];
        const float m_old = m_state.qmap[m_state.codes[o + i]] * m_old_scale;
        const float v_old = v_state.qmap[v_state.codes[o + i]] * v_old_scale;
        const float g2 = g * g;
        const float m_new = (m_state.from_end ? g : m_old) + (g - m_old) * m_state.alpha;
        const float v_new = (v_state.from_end ? g2 : v_old) + (g2 - v_old) * v_state.alpha;
        m[i] = m_new; v[i] = v_new;
        const uint32_t m_abs = bits_of(m_new) & 0x7FFFFFFFu, v_abs = bits_of(v_new) & 0x7FFFFFFFu;
        m_max_bits = m_abs > m_max_bits ? m_abs : m_max_bits;
        v_max_bits = v_abs > v_max_bits ? v_abs : v_max_bits;
    }
    float m_max = float_of(m_max_bits), v_max = float_of(v_max_bits);
    m_max = m_max > 1e-12f ? m_max : 1e-12f;  /* clip(1e-12) */
    v_max = v_max > 1e-12f ? v_max : 1e-12f;
    m_state.scale[o / block] = m_max; v_state.scale[o / block] = v_max;
    #pragma GCC ivdep  /* the blocks' arrays do not overlap */
    for (int64_t i = 0; i < block; i++) {
        m_state.codes[o + i] = quantize(m[i] / m_max, m_state.table, m_state.inside,
                                        shift, low, buckets);
        v_state.codes[o + i] = quantize(v[i] / v_max, v_state.table, v_state.inside,
                                        shift, low, buckets);
        float p = load_param(param, o + i, param_mode);
        p = p - lr_wd * p;
        const float denom = sqrtf(v[i]) / bias_correction2_sqrt + eps;
        p = p - lr * (m[i] / bias_correction1) / denom;
        store_param(param, o + i, p, param_mode, key);
    }
}

void roundpipe_adamw8bit(
    void *param, int param_mode, const void *grad, int grad_bf16, int64_t n, int64_t block,
    uint8_t *m_codes, float *m_scale, const float *m_qmap, const int32_t *m_table,
    const float *m_inside, uint8_t *v_codes, float *v_scale, const float *v_qmap,
    const int32_t *v_table, const float *v_inside, int32_t shift, int32_t low,
    int32_t buckets, float lr, float weight_decay, float m_alpha, int m_from_end,
    float v_alpha, int v_from_end, float beta1, float beta2, float step, float eps,
    int threads, uint64_t key)
{
    const float lr_wd = lr * weight_decay;
    const float bc1 = 1.0f - powf(beta1, step);
    const float bc2_sqrt = sqrtf(1.0f - powf(beta2, step));
    const state_t ms = {m_codes, m_scale, m_qmap, m_table, m_inside, m_alpha, m_from_end};
    const state_t vs = {v_codes, v_scale, v_qmap, v_table, v_inside, v_alpha, v_from_end};
    const int kind = 2 * param_mode + grad_bf16;
    #pragma omp parallel num_threads(threads)
    {
        float m[block], v[block];
        #pragma omp for schedule(static)
        for (int64_t o = 0; o < n; o += block) {
#define STEP(P, G) block_step(param, grad, o, block, ms, vs, m, v, shift, low, buckets, \
                              lr, lr_wd, bc1, bc2_sqrt, eps, key, P, G)
            switch (kind) {
                case 0: STEP(0, 0); break;
                case 1: STEP(0, 1); break;
                case 2: STEP(1, 0); break;
                case 3: STEP(1, 1); break;
                case 4: STEP(2, 0); break;
                default: STEP(2, 1); break;
            }
        }
    }
}

/* torchao's step with plain moments (fp32, or bf16 rounded to nearest on store). */
INLINE void plain_step(void *param, const void *grad, void *m, void *v, int64_t o,
                       int64_t count, float lr, float lr_wd, float m_alpha, int m_from_end,
                       float v_alpha, int v_from_end, float bias_correction1,
                       float bias_correction2_sqrt, float eps, uint64_t key,
                       const int param_mode, const int grad_bf16, const int state_bf16) {
    #pragma GCC ivdep
    for (int64_t i = o; i < o + count; i++) {
        const float g = grad_bf16 ? from_bf16(((const uint16_t *)grad)[i])
                                  : ((const float *)grad)[i];
        const float m_old = state_bf16 ? from_bf16(((uint16_t *)m)[i]) : ((float *)m)[i];
        const float v_old = state_bf16 ? from_bf16(((uint16_t *)v)[i]) : ((float *)v)[i];
        const float g2 = g * g;
        const float m_new = (m_from_end ? g : m_old) + (g - m_old) * m_alpha;  /* lerp */
        const float v_new = (v_from_end ? g2 : v_old) + (g2 - v_old) * v_alpha;
        if (state_bf16) {
            ((uint16_t *)m)[i] = to_bf16(m_new); ((uint16_t *)v)[i] = to_bf16(v_new);
        } else {
            ((float *)m)[i] = m_new; ((float *)v)[i] = v_new;
        }
        float p = load_param(param, i, param_mode);
        p = p - lr_wd * p;
        const float denom = sqrtf(v_new) / bias_correction2_sqrt + eps;
        p = p - lr * (m_new / bias_correction1) / denom;
        store_param(param, i, p, param_mode, key);
    }
}

void roundpipe_adamw(
    void *param, int param_mode, const void *grad, int grad_bf16, void *m, void *v,
    int state_bf16, int64_t n, float lr, float weight_decay, float m_alpha, int m_from_end,
    float v_alpha, int v_from_end, float beta1, float beta2, float step, float eps,
    int threads, uint64_t key)
{
    const float lr_wd = lr * weight_decay;
    const float bc1 = 1.0f - powf(beta1, step);
    const float bc2_sqrt = sqrtf(1.0f - powf(beta2, step));
    const int kind = 4 * param_mode + 2 * grad_bf16 + state_bf16;
    const int64_t chunk = 1 << 14;
    #pragma omp parallel for num_threads(n > chunk ? threads : 1) schedule(static)
    for (int64_t o = 0; o < n; o += chunk) {
        const int64_t count = n - o < chunk ? n - o : chunk;
#define PLAIN(P, G, S) plain_step(param, grad, m, v, o, count, lr, lr_wd, m_alpha, \
                                  m_from_end, v_alpha, v_from_end, bc1, bc2_sqrt, eps, key, \
                                  P, G, S)
        switch (kind) {
            case 0: PLAIN(0, 0, 0); break;
            case 1: PLAIN(0, 0, 1); break;
            case 2: PLAIN(0, 1, 0); break;
            case 3: PLAIN(0, 1, 1); break;
            case 4: PLAIN(1, 0, 0); break;
            case 5: PLAIN(1, 0, 1); break;
            case 6: PLAIN(1, 1, 0); break;
            case 7: PLAIN(1, 1, 1); break;
            case 8: PLAIN(2, 0, 0); break;
            case 9: PLAIN(2, 0, 1); break;
            case 10: PLAIN(2, 1, 0); break;
            default: PLAIN(2, 1, 1); break;
        }
    }
}
"""

FLAGS = [
    *("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"),
    *("-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"),
]
"""No ``-ffast-math`` and no contraction into fused multiply-adds: every operation
rounds as IEEE fp32, as in the kernel inductor builds for torchao's step. Without traps
and ``errno`` (which change no result) the compiler may vectorise the comparisons and
the square root."""

_lock = threading.Lock()
_loaded: list = []  # [library or None], once tried


def load():
    """The kernels (``roundpipe_adamw8bit``, ``roundpipe_adamw``: ``ctypes`` functions),
    built on first use; ``None`` (with a warning) where they cannot be built."""
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_build())
            except (OSError, subprocess.SubprocessError) as error:
                warnings.warn(
                    f"roundpipe's 8-bit AdamW kernel could not be built ({error}); using "
                    "torchao's compiled step (same results, slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _loaded.append(None)
        return _loaded[0]


def _build():
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC) found")
    machine = f"{platform.machine()} {_cpu_name()} {compiler}"
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, machine]).encode()).hexdigest()[:16]
    directory = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "roundpipe"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / f"roundpipe-{os.getuid()}"
        directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"adamw8bit-{key}.so"
    if not library.exists():
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source = Path(scratch) / "adamw8bit.c"
            source.write_text(SOURCE)
            built = Path(scratch) / "adamw8bit.so"
            subprocess.run(
                [compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(built, library)  # atomic: concurrent builders agree
    loaded = ctypes.CDLL(str(library))
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    options: list[type[ctypes._SimpleCData]] = [f32, f32, f32, i32, f32, i32, f32, f32, f32]
    options += [f32, i32, ctypes.c_uint64]
    state = [p, p, p, p, p]  # codes, scale, qmap, code table, threshold table
    loaded.roundpipe_adamw8bit.argtypes = [p, i32, p, i32, i64, i64, *state, *state]
    loaded.roundpipe_adamw8bit.argtypes += [i32, i32, i32, *options]
    loaded.roundpipe_adamw.argtypes = [p, i32, p, i32, p, p, i32, i64, *options]
    for function in (loaded.roundpipe_adamw8bit, loaded.roundpipe_adamw):
        function.restype = None
    return loaded


def _cpu_name() -> str:
    """The CPU's model and flags (``-march=native`` builds for them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(line for line in lines if line.startswith(("model name", "flags")))
