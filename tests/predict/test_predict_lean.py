"""``roundpipe simulate`` predicts host RAM for each lean setting (``--optimizer-states``,
``--master-weights``) and says which setting fits when the run's own does not.

Oracles: the bytes per trained parameter written out by hand for each setting, times the
parameter count transformers gives; torchao's own 8-bit optimizer state for the int8
moments; an exhaustive search over the settings for the suggestion. The defaults must
give today's numbers exactly."""

from __future__ import annotations

import math
from itertools import product

import pytest
from support.predict_models import TINY_LLAMA, json_rows

from roundpipe.cli import main
from roundpipe.predict.breakdown import PINNED_CACHE_BYTES
from roundpipe.predict.gpus import GIB, gpu_preset
from roundpipe.predict.host_settings import LeanSettings, moment_bytes
from roundpipe.predict.lean_fit import lean_fit, leaner_settings
from roundpipe.predict.model_specs import ModelSpec, model_preset
from roundpipe.predict.models import Workload, memory_fit, predict

RTX4090 = gpu_preset("rtx4090")
TINY = TINY_LLAMA
# bytes per trained parameter, by hand: (masters, gradients) by --master-weights and
# AdamW's m and v by --optimizer-states (int8: a byte each and an fp32 scale per 256)
MASTERS = {"fp32": (4, 4), "bf16": (0, 2)}
MOMENTS = {"fp32": 8, "bf16": 4, "int8": 2 + 2 * 4 / 256}
FLAGS = ["--model", "Qwen3-1.7B", "--gpus", "2", "--batch", "4", "--seq-len", "512"]


def _tiny_model():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def _host(settings: LeanSettings, work: Workload | None = None, spec: ModelSpec | None = None):
    work = work or Workload(seq_len=128, batch=4)
    spec = spec or ModelSpec.from_config(TINY)
    work = Workload(**{**work.__dict__, "settings": settings})
    (prediction,) = predict(spec, RTX4090, work, 2, ("roundpipe",))
    return prediction.memory


@pytest.mark.parametrize(
    ("states", "masters"), list(product(("fp32", "bf16", "int8"), ("fp32", "bf16")))
)
def test_each_setting_holds_its_bytes_per_trained_parameter(states, masters):
    params = _tiny_model().num_parameters()
    memory = _host(LeanSettings(states, masters))
    host, plan = memory.host, memory.plan
    master, gradient = MASTERS[masters]
    assert host.terms() == {
        "weights": 2 * params,
        "spare": 2 * params,  # async steps: the spare version whatever the masters
        "masters": master * params,
        "gradients": gradient * params,
        "optimizer_state": math.ceil(MOMENTS[states] * params),
        "saved_activations": (len(plan.backward) - 1) * 4 * 128 * 256 * 2,
        "pinned_buffers": PINNED_CACHE_BYTES,
    }
    per_parameter = (host.total - host.saved_activations - host.pinned_buffers) / params
    assert per_parameter == pytest.approx(4 + master + gradient + MOMENTS[states])


def test_the_leanest_full_fine_tune_holds_8_03_bytes_per_parameter():
    params = _tiny_model().num_parameters()
    host = _host(LeanSettings("int8", "bf16")).host
    assert host.weights + host.spare + host.masters + host.gradients == 6 * params
    assert host.optimizer_state / params == pytest.approx(2.03125)


def test_int8_moments_are_the_bytes_torchao_adamw8bit_keeps():
    subclass = pytest.importorskip("torchao.optim.subclass_8bit")
    model = _tiny_model()
    held = 0
    for param in model.parameters():  # m and v: uint8 codes and an fp32 scale per block
        for signed in (True, False):
            state = subclass.OptimState8bit.zeros(param.shape, signed=signed, block_size=256)
            held += state.codes.nbytes + state.scale.nbytes  # (+ a shared 1 KiB code map)
    assert held == _host(LeanSettings("int8")).host.optimizer_state
    assert held == moment_bytes(model.num_parameters(), "int8")


def test_sharded_hosts_split_the_masters_and_the_moments_of_each_setting():
    params = _tiny_model().num_parameters()
    for states, masters in (("int8", "bf16"), ("bf16", "fp32")):
        work = Workload(seq_len=128, batch=4, optimizer_shards=3)
        host = _host(LeanSettings(states, masters), work).host
        assert host.masters == math.ceil(MASTERS[masters][0] * params / 3)
        assert host.optimizer_state == math.ceil(MOMENTS[states] * params / 3)
        assert host.gradients == MASTERS[masters][1] * params  # stays whole


def test_lora_applies_the_settings_to_the_adapters_only():
    spec = ModelSpec.from_config(TINY)
    adapters = spec.lora_params(8)
    work = Workload(seq_len=128, batch=4, lora_rank=8)
    host = _host(LeanSettings("bf16", "bf16"), work).host
    assert host.weights == 2 * (spec.num_params + adapters)
    assert (host.masters, host.gradients, host.optimizer_state) == (0, 2 * adapters, 4 * adapters)


def test_the_default_flags_give_exactly_the_run_without_them(capsys):
    main(["simulate", *FLAGS, "--host-ram", "16", "--json"])
    plain = json_rows(capsys)
    explicit = ["--optimizer-states", "fp32", "--master-weights", "fp32"]
    main(["simulate", *FLAGS, *explicit, "--host-ram", "16", "--json"])
    assert json_rows(capsys) == plain
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=512, batch=4)
    default = memory_fit(spec, RTX4090, work, 2)
    params = spec.num_params
    assert default.host.total - default.host.saved_activations - PINNED_CACHE_BYTES == 20 * params


def test_json_keeps_every_key_and_adds_the_settings_and_the_host_fit(capsys):
    main(["simulate", *FLAGS, "--host-ram", "256", "--json", "--optimizer-states", "int8"])
    roundpipe, *baselines = json_rows(capsys)
    old = ["schedule", "tokens_per_s", "iteration_time", "gpu_memory", "gpu_budget", "fits"]
    old += ["host_ram", "host_ram_budget", "host_ram_fits", "detail", "max_seq_len"]
    old += ["device_memory", "suggestion"]
    assert set(old) <= set(roundpipe)
    assert list(roundpipe["host_ram"])[:7] == [
        "weights",
        "spare",
        "masters",
        "gradients",
        "optimizer_state",
        "saved_activations",
        "pinned_buffers",
    ]
    assert (roundpipe["optimizer_states"], roundpipe["master_weights"]) == ("int8", "fp32")
    assert roundpipe["quantize"] is None and roundpipe["host_fit"] is None  # it fits
    assert roundpipe["upload_saved_bytes"] is None  # nothing quantized
    assert all("host_fit" not in row for row in baselines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quantize", "nf4"], "--quantize nf4 quantizes a frozen base, which only LoRA"),
        (
            ["--master-weights", "bf16", "--precision", "fp16"],
            "--master-weights bf16 makes the model's own bf16 weights the masters, so it "
            "needs a bf16 model (--precision bf16), got --precision fp16",
        ),
        (["--optimizer-states", "int4"], "invalid choice: 'int4'"),
        (["--master-weights", "fp16"], "invalid choice: 'fp16'"),
        (["--lora", "8", "--quantize", "int4"], "invalid choice: 'int4'"),
    ],
)
def test_bad_settings_exit_2_naming_what_is_allowed(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "Qwen3-1.7B", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_settings_check_refuses_unknown_values():
    with pytest.raises(ValueError, match="--optimizer-states 'fp8': use one of fp32, bf16, int8"):
        LeanSettings("fp8").check("bf16", 0)
    with pytest.raises(ValueError, match="the only quantization is nf4"):
        LeanSettings(quantize="int4").check("bf16", 8)
    LeanSettings("int8", "bf16", "nf4").check("bf16", 8)


def _totals(spec, work, gpus=2) -> dict[LeanSettings, int]:
    """Host RAM of every setting combination the run could switch to (the oracle)."""
    return {
        s: memory_fit(spec, RTX4090, Workload(**{**work.__dict__, "settings": s}), gpus).host.total
        for s in [work.settings, *leaner_settings(work.settings, work.precision, work.lora_rank)]
    }


def _host_gib(available: float) -> str:
    return f"{available / 0.9 / GIB:.6f}"


def test_the_host_fit_is_the_setting_that_saves_least_and_still_fits(capsys):
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=512, batch=4)
    totals = sorted(_totals(spec, work).items(), key=lambda item: -item[1])
    # between each pair of neighbouring totals: the bigger one does not fit, the smaller does
    for (_, too_big), (_, fitting) in zip(totals, totals[1:], strict=False):
        if too_big == fitting:
            continue
        host_gib = _host_gib((too_big + fitting) / 2)
        main(["simulate", *FLAGS, "--host-ram", host_gib, "--schedule", "roundpipe", "--json"])
        host_fit = json_rows(capsys)[0]["host_fit"]
        assert host_fit["fits"] and host_fit["host_ram"] == fitting
        best = min((s for s, t in totals if t == fitting), key=lambda s: _changed(s))
        assert (host_fit["optimizer_states"], host_fit["master_weights"]) == (
            best.optimizer_states,
            best.master_weights,
        )
        assert host_fit["flags"] == best.flags and host_fit["quantize"] is None
        assert f"fits with {best.flags} ({fitting / GIB:.1f} GiB)" in host_fit["text"]


def _changed(settings: LeanSettings) -> int:
    return (settings.optimizer_states != "fp32") + (settings.master_weights != "fp32")


def test_the_text_names_the_ram_needed_and_the_setting_that_fits(capsys):
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=512, batch=4)
    totals = _totals(spec, work)
    leanest = totals[LeanSettings("int8", "bf16")]
    runner_up = totals[LeanSettings("bf16", "bf16")]
    host_gib = _host_gib((leanest + runner_up) / 2)
    main(["simulate", *FLAGS, "--host-ram", host_gib, "--schedule", "roundpipe"])
    out = capsys.readouterr().out
    available = int(float(host_gib) * GIB * 0.9)
    line = (
        f"  host RAM: {totals[LeanSettings()] / GIB:.1f} GiB needed, {available / GIB:.1f} GiB "
        f"usable; fits with --optimizer-states int8 --master-weights bf16 ({leanest / GIB:.1f} GiB)"
    )
    assert line in out.splitlines()
    assert "\nsettings: --optimizer-states fp32 --master-weights fp32" in out
    assert "masters 4 + gradients 4 + optimizer state 8 = 20" in out


def test_when_no_setting_fits_it_gives_the_leanest_and_what_it_needs(capsys):
    spec, work = model_preset("Qwen3-1.7B"), Workload(seq_len=512, batch=4)
    leanest = _totals(spec, work)[LeanSettings("int8", "bf16")]
    main(["simulate", *FLAGS, "--host-ram", _host_gib(leanest * 0.9), "--json"])
    host_fit = json_rows(capsys)[0]["host_fit"]
    assert not host_fit["fits"] and host_fit["host_ram"] == leanest
    assert host_fit["flags"] == "--optimizer-states int8 --master-weights bf16"
    assert host_fit["text"].endswith(
        f"even --optimizer-states int8 --master-weights bf16 needs {leanest / GIB:.1f} GiB"
    )
    lean = ["--optimizer-states", "int8", "--master-weights", "bf16"]
    main(["simulate", *FLAGS, *lean, "--host-ram", _host_gib(leanest * 0.9), "--json"])
    host_fit = json_rows(capsys)[0]["host_fit"]
    assert host_fit["flags"] is None and not host_fit["fits"]
    assert host_fit["text"].endswith(
        "no leaner --optimizer-states, --master-weights or --quantize is left"
    )


def test_an_fp16_model_is_never_told_to_use_bf16_masters():
    spec = model_preset("Qwen3-1.7B")
    work = Workload(seq_len=512, batch=4, precision="fp16")
    choices = leaner_settings(work.settings, "fp16", 0)
    assert {s.master_weights for s in choices} == {"fp32"}
    assert {s.optimizer_states for s in choices} == {"bf16", "int8"}
    memory = memory_fit(spec, RTX4090, work, 2, 8 * 10**9)
    host_fit = lean_fit(spec, RTX4090, work, 2, 8 * 10**9, memory)
    assert host_fit is not None and host_fit.settings.master_weights == "fp32"


def test_a_leaner_run_is_only_offered_leaner_settings():
    choices = leaner_settings(LeanSettings("bf16", "bf16"), "bf16", 8)
    assert set(choices) == {
        LeanSettings("int8", "bf16"),
        LeanSettings("bf16", "bf16", "nf4"),
        LeanSettings("int8", "bf16", "nf4"),
    }


def test_a_lora_run_over_the_host_ram_is_told_to_quantize_the_base(capsys):
    flags = ["simulate", "--model", "Qwen3-32B", "--gpus", "8", "--lora", "16"]
    main([*flags, "--seq-len", "1024", "--host-ram", "64", "--schedule", "roundpipe", "--json"])
    (row,) = json_rows(capsys)
    host_fit = row["host_fit"]
    assert not row["host_ram_fits"] and host_fit["fits"]
    assert host_fit["flags"] == "--quantize nf4"  # adapters' settings save too little
    assert host_fit["host_ram"] < 50 * GIB < row["host_ram"]["total"]
