"""The dropout rule of mixed pools: a layer that draws random numbers must not be
recomputed on another kind of device than the one that ran its forward (on CUDA the
masks depend on the GPU model), and nothing else is refused."""

from __future__ import annotations

import pytest
from torch import nn

from roundpipe.core.plan import Plan
from roundpipe.core.schedule import lower, lower_unfused
from roundpipe.runtime.mixed_pool import (
    MixedPoolDropoutError,
    check_recompute_classes,
    layers_drawing_random,
)


class Attention(nn.Module):
    """Like a Hugging Face attention module: dropout applied functionally, its
    probability kept in a float attribute."""

    def __init__(self, attention_dropout: float) -> None:
        super().__init__()
        self.attention_dropout = attention_dropout
        self.proj = nn.Linear(4, 4)


def block(inner: nn.Module) -> nn.Module:
    """A layer holding ``inner`` one level down, as decoder blocks hold their dropouts."""
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(inner))


def test_layers_with_dropout_above_zero_draw_random_numbers():
    layers = [
        block(nn.Dropout(0.0)),
        block(nn.Dropout(0.1)),
        nn.Linear(4, 4),
        block(Attention(0.1)),
        block(Attention(0.0)),
        nn.Dropout2d(0.2),
    ]
    assert layers_drawing_random(layers) == frozenset({1, 3, 5})


def test_layers_in_eval_mode_draw_nothing():
    layers = [block(nn.Dropout(0.5)).eval(), block(Attention(0.1)).eval()]
    assert layers_drawing_random(layers) == frozenset()
    layers[0][1].train()  # only the inner module's mode counts
    assert layers_drawing_random(layers) == frozenset({0})


# "2,2|3,1,1,1,1" on 2 devices: F0@0[0:2] F1@1[2:4] X0@0[4:7] B1@1[3:4] B2@0[2:3]
# B3@1[1:2] B4@0[0:1]: layers 0 and 3 are recomputed on the device of their forward,
# layers 1 and 2 on the other one; layers 4-6 run fused.
PLAN = Plan.parse("2,2|3,1,1,1,1")
MIXED = ["fast", "slow"]


def test_a_drawing_layer_recomputed_on_another_class_is_refused():
    schedule = lower(PLAN, 2, 0)
    with pytest.raises(MixedPoolDropoutError) as caught:
        check_recompute_classes(schedule, MIXED, frozenset({2}))
    message = str(caught.value)
    assert "layer 2 ran forward on 'slow' and would be recomputed on 'fast'" in message
    assert "attention_dropout = 0" in message and "nn.Dropout p=0" in message
    assert "devices of one kind" in message and "this layer in the fused stage" in message
    assert isinstance(caught.value, ValueError)


def test_every_mismatched_layer_is_named_with_its_two_classes():
    schedule = lower(PLAN, 2, 0)
    with pytest.raises(MixedPoolDropoutError) as caught:
        check_recompute_classes(schedule, MIXED, frozenset(range(7)))
    message = str(caught.value)
    assert "layer 1 ran forward on 'fast' and would be recomputed on 'slow'" in message
    assert "layer 2 ran forward on 'slow' and would be recomputed on 'fast'" in message
    assert "these layers in the fused stage" in message
    assert "layer 0 " not in message and "layer 3 " not in message


def test_mismatched_layers_are_listed_with_consecutive_ones_as_a_range():
    # F0@0[0:4] X0@1[4:5] B1@0[3:4] B2@1[2:3] B3@0[1:2] B4@1[0:1]
    schedule = lower(Plan.parse("4|1,1,1,1,1"), 2, 0)
    with pytest.raises(MixedPoolDropoutError, match=r"layers 0, 2 ran forward on 'a'"):
        check_recompute_classes(schedule, ["a", "b"], frozenset(range(5)))
    # F0@0[0:4] X0@1[4:5] B1@0[2:4] B2@1[0:2]
    schedule = lower(Plan.parse("4|1,2,2"), 2, 0)
    with pytest.raises(MixedPoolDropoutError, match=r"layers 0-1 ran forward on 'a'"):
        check_recompute_classes(schedule, ["a", "b"], frozenset(range(5)))


def test_layers_recomputed_on_the_class_of_their_forward_pass():
    schedule = lower(PLAN, 2, 0)
    check_recompute_classes(schedule, MIXED, frozenset({0, 3}))
    check_recompute_classes(schedule, MIXED, frozenset({4, 5, 6}))  # fused: no recompute
    # F0@0[0:2] F1@1[2:4] X0@2 B1@3[3:4] B2@0[2:3] B3@1[1:2] B4@2[0:1]: layers 0 and 3
    # are recomputed on another device of their forward's class
    check_recompute_classes(lower(PLAN, 4, 0), ["a", "b", "a", "b"], frozenset({0, 3}))


def test_nothing_is_refused_on_an_equal_pool_or_without_dropout():
    schedule = lower(PLAN, 2, 0)
    check_recompute_classes(schedule, ["same", "same"], frozenset(range(7)))
    check_recompute_classes(schedule, MIXED, frozenset())


def test_unfused_schedules_check_every_recomputed_layer():
    # F0@0[0:2] F1@1[2:4] F2@0[4:7] B0@1[4:7] ...: the fused layers are recomputed too
    schedule = lower_unfused(PLAN, 2, 0, with_backward=True)
    with pytest.raises(MixedPoolDropoutError, match=r"layer 5 ran forward on 'fast'"):
        check_recompute_classes(schedule, MIXED, frozenset({5}))


def test_classes_must_name_every_device_of_the_schedule():
    with pytest.raises(ValueError, match="one per device"):
        check_recompute_classes(lower(PLAN, 3, 0), MIXED, frozenset({1}))
