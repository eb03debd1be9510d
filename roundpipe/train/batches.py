"""Deterministic batches of a :class:`~roundpipe.train.data.Dataset`, by step number.

``Batches(dataset, batch_size, seed, packing=False, pad_id=0).batch(step)`` is a pure
function of the data, the seed and ``step``, so a resumed run needs only the step
number; rows are shuffled per epoch, padded, or packed once into windows of
``dataset.seq_len`` tokens (docs/design.md#batches). A batch of examples with images
carries the model's image inputs for its rows' images, in row order; such examples
are not packed.
"""

from __future__ import annotations

import bisect
import math

import torch

from .chat import IGNORE_INDEX
from .data import Dataset, Example


class Batches:
    """The batches of ``dataset``; see the module docstring."""

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int, packing: bool = False, pad_id: int = 0
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not dataset.examples:
            raise ValueError(f"{dataset.path}: the dataset has no examples to batch")
        self.examples = dataset.examples
        self.seq_len = dataset.seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.packing = packing
        self.pad_id = pad_id
        self.images = dataset.images
        if packing and self.images is not None:
            raise ValueError(
                f"{dataset.path}: --packing with images: examples with images are not packed "
                "yet; drop --packing"
            )
        if packing:
            order = torch.randperm(len(self.examples), generator=seeded_generator(seed)).tolist()
            lengths = [len(self.examples[i].input_ids) for i in order]
            self.rows = [[order[j] for j in window] for window in pack(lengths, self.seq_len)]
        else:
            self.rows = [[i] for i in range(len(self.examples))]
        self.steps_per_epoch = math.ceil(len(self.rows) / batch_size)
        self._epoch_order: tuple[int, list[int]] | None = None

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """The batch of global step ``step`` (0-based, counting across epochs)."""
        rows = [[self.examples[i] for i in self.rows[r]] for r in self._row_indices(step)]
        if self.packing:
            return _packed_batch(rows, self.seq_len, self.pad_id)
        examples = [row[0] for row in rows]
        batch = padded_batch(examples, self.pad_id)
        if self.images is not None and any(example.images for example in examples):
            images = [image for example in examples for image in example.images]
            grids = [grid for example in examples for grid in example.grids]
            batch.update(self.images.inputs(batch["input_ids"], images, grids))
        return batch

    def num_tokens(self, step: int) -> int:
        """Tokens of the examples in batch ``step``, padding excluded."""
        return sum(len(example.input_ids) for example in self._examples_of(step))

    def num_label_tokens(self, step: int) -> int:
        """Tokens with a loss in batch ``step`` (the model's loss is their mean)."""
        return sum(example.num_label_tokens for example in self._examples_of(step))

    def _examples_of(self, step: int) -> list[Example]:
        return [self.examples[i] for r in self._row_indices(step) for i in self.rows[r]]

    def _row_indices(self, step: int) -> list[int]:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            generator = seeded_generator(self.seed + epoch)
            self._epoch_order = epoch, torch.randperm(len(self.rows), generator=generator).tolist()
        return self._epoch_order[1][index * self.batch_size : (index + 1) * self.batch_size]


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit packing: indices into ``lengths`` grouped into windows whose lengths sum
    to at most ``capacity``, visiting ``lengths`` in order and putting each into the
    window with the least room that still fits it (a new window if none does)."""
    windows: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct free sizes of windows with room left
    windows_with_room: dict[int, list[int]] = {}  # free size -> windows
    for index, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"an example of {length} tokens exceeds the window of {capacity}")
        position = bisect.bisect_left(rooms, length)
        if position == len(rooms):
            window, room = len(windows), capacity
            windows.append([])
        else:
            room = rooms[position]
            window = windows_with_room[room].pop()
            if not windows_with_room[room]:
                del windows_with_room[room]
                rooms.pop(position)
        windows[window].append(index)
        room -= length
        if room > 0:
            if room not in windows_with_room:
                bisect.insort(rooms, room)
            windows_with_room.setdefault(room, []).append(window)
    return windows


def seeded_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def padded_batch(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        input_ids[row, :length] = torch.tensor(example.input_ids)
        attention_mask[row, :length] = 1
        labels[row, :length] = torch.tensor(example.labels)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _packed_batch(windows: list[list[Example]], seq_len: int, pad_id: int) -> dict:
    input_ids = torch.full((len(windows), seq_len), pad_id, dtype=torch.long)
    position_ids = torch.empty((len(windows), seq_len), dtype=torch.long)
    labels = torch.full((len(windows), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, window in enumerate(windows):
        start = 0
        for example in window:
            end = start + len(example.input_ids)
            input_ids[row, start:end] = torch.tensor(example.input_ids)
            labels[row, start:end] = torch.tensor(example.labels)
            position_ids[row, start:end] = torch.arange(end - start)
            start = end
        position_ids[row, start:] = torch.arange(seq_len - start)  # the padding's own segment
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
