"""``roundpipe.from_hf``: a Hugging Face causal LM trained with its own loss.

``forward_backward(input_kwargs={"input_ids", "attention_mask", "labels"})`` returns
what ``model(**batch).loss`` returns for the whole batch: the mean cross-entropy over
every label token of the batch (labels shifted by one, ``-100`` ignored), not a mean
of microbatch means, and the gradients of that loss. Packed sequences pass
``position_ids`` that restart at 0 for each example instead of an ``attention_mask``;
attention then stays inside each example (as ``transformers`` does it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..cluster import PeerFailure
from ..core.config import RoundPipeRunConfig
from ..model import RoundPipe
from .decoder import IGNORE_INDEX, model_layers
from .families import own_adapter
from .images import (
    ImageLayout,
    check_images,
    image_layout,
    images_refusal,
    split_with_images,
)
from .row_logps import RowLoss, forward_backward_logps, sequence_logps
from .structure import adapted_head_refusal, packing_refusal, text_config, text_model


class HFRoundPipe(RoundPipe):
    """A RoundPipe over a Hugging Face causal LM (build it with ``roundpipe.from_hf``)."""

    max_positions: int | None = None
    packing_refusal: str | None = None
    """Why packed sequences cannot train the model (:func:`.replay.packing_refusal`)."""
    tiles: bool = True
    """Whether the model's layers follow ``seq_chunk_tokens`` (our own adapter's)."""
    image_layout: ImageLayout | None = None
    """How the model's images stand in its batch (:mod:`.images`; ``None``: text only)."""
    image_refusal: str | None = None
    """Why a VLM without an image layout refuses images (:func:`.images.images_refusal`)."""

    @property
    def hf_model(self):
        """The model given to ``from_hf`` (a ``*ForCausalLM`` or a peft model of one)."""
        return self.__dict__["_hf_model"]

    def train(self, mode: bool = True) -> HFRoundPipe:
        """As ``nn.Module.train``, for the layers and ``hf_model`` alike (``eval()`` too)."""
        super().train(mode)
        self.hf_model.train(mode)
        return self

    def save_pretrained(self, path, **kwargs: Any) -> None:
        """Wait for queued work, then write the model as ``transformers`` (or, for a peft
        model, the adapter as ``peft``) loads it with ``from_pretrained``.

        On several nodes it is collective: every node holds the whole model, rank 0
        writes it, and every rank returns once it is written (or raises if it failed)."""
        self.synchronize()
        node = self.node
        if node is None:
            self.hf_model.save_pretrained(path, **kwargs)
            return
        error = None
        if node.rank == 0:
            try:
                self.hf_model.save_pretrained(path, **kwargs)
            except Exception as exc:  # noqa: BLE001 - raised after the others know
                error = exc
        rows = node.comm.gather_ints([error is not None], "save_pretrained")
        if error is not None:
            raise error
        if rows[0][0]:
            raise PeerFailure("save_pretrained failed on rank 0, which writes the model")

    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict | None = None,
        label: Any = None,
        loss_fn=None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
        return_metrics: bool = False,
    ):
        """Forward, loss and backward of the batch ``input_kwargs`` (``input_ids``,
        optional ``attention_mask``, ``labels``); returns the batch's mean token loss,
        and with ``return_metrics`` a dict of what TRL logs with it besides
        (:func:`token_metrics`: ``mean_token_accuracy``, ``correct_tokens``,
        ``label_tokens``; on several nodes, of the global batch)."""
        if input_args or label is not None or loss_fn is not None or return_outputs:
            raise TypeError(
                "a Hugging Face RoundPipe computes the model's own loss: call "
                "forward_backward(input_kwargs={'input_ids': ..., 'attention_mask': ..., "
                "'labels': ...}) without input_args, label, loss_fn or return_outputs"
            )
        batch = self._checked_batch(input_kwargs, training=True, run_config=run_config)
        count = self._global_label_tokens(batch["labels"])

        def mean_over_batch(head: tuple[torch.Tensor, torch.Tensor], _label) -> torch.Tensor:
            return head[0] / count  # head: the summed loss, the correct-token count

        # Each microbatch's loss is its share of the batch's token mean: they add up.
        config = replace(
            self._with_images(batch, run_config) or self.run_config,
            scale_grads=False,
            merge_output=_correct_tokens,
        )
        if not return_metrics:
            return super().forward_backward(
                input_kwargs=batch, loss_fn=mean_over_batch, run_config=config
            )
        loss, correct = super().forward_backward(
            input_kwargs=batch, loss_fn=mean_over_batch, return_outputs=True, run_config=config
        )
        if self.node is not None:
            correct = self.node.sum_over_nodes(correct, "the correct-token count")
        return loss, token_metrics(correct, count)

    def _global_label_tokens(self, labels: torch.Tensor) -> int:
        """The label tokens of the batch; on several nodes, of every node's batch (the
        loss is the mean over the global batch's label tokens)."""
        if self.node is None:
            return _label_tokens(labels)
        local = int((labels[:, 1:] != IGNORE_INDEX).sum())
        count = self.node.sum_over_nodes(local, "the label-token count")
        if count == 0:
            _label_tokens(labels)  # raises, on every rank
        return count

    def eval_loss(self, input_kwargs: dict, return_metrics: bool = False):
        """Without gradients: the loss ``forward_backward`` would return for this batch
        (the mean over its label tokens, the head's loss computed in chunks, so the
        logits of the whole batch never exist at once), and with ``return_metrics`` the
        dict ``forward_backward`` returns (of this process's batch). The weights are not
        changed."""
        batch = self._checked_batch(input_kwargs, training=True)
        count = _label_tokens(batch["labels"])
        rows = batch["input_ids"].shape[0]
        config = replace(
            self._with_images(batch, None) or self.run_config,
            num_microbatch=self.run_config.microbatches_for(len(self.pool), rows),
            merge_output=_summed_heads,
        )
        with torch.no_grad():
            total, correct = self.runtime.forward((), batch, config)
        loss = total / count
        return (loss, token_metrics(correct, count)) if return_metrics else loss

    def sequence_logps(self, input_kwargs: dict) -> torch.Tensor:
        """Without gradients: each row's log-probability, the sum over its label tokens
        (labels shifted by one, ``-100`` ignored) of the log-probability the model gives
        them (float32, one per row; what TRL's ``DPOTrainer`` sums per sequence)."""
        return sequence_logps(self, self._checked_row_batch(input_kwargs, None))

    def forward_backward_logps(
        self,
        input_kwargs: dict,
        loss_fn: RowLoss,
        label: Any = None,
        group_rows: int = 1,
        run_config: RoundPipeRunConfig | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward and backward of a loss of the rows' log-probabilities (a DPO or KTO
        loss: :mod:`roundpipe.preference`): the loss is the sum over microbatches of
        ``loss_fn(logps, label)``, ``logps`` a microbatch's rows' log-probabilities (as
        :meth:`sequence_logps`, with gradients) and ``label`` its rows of ``label`` (a
        tensor or a dict of tensors, rows along dim 0), so each should return its share
        of the batch's loss. ``group_rows`` consecutive rows (2: a preference pair) stay
        in one microbatch. Returns the loss, every row's log-probability and every row's
        count of label tokens the logits' argmax predicts (without gradients)."""
        batch = self._checked_row_batch(input_kwargs, run_config)
        return forward_backward_logps(self, batch, loss_fn, label, group_rows, run_config)

    def _checked_row_batch(self, kwargs: dict | None, run_config) -> dict:
        batch = self._checked_batch(kwargs, training=True, run_config=run_config)
        if "pixel_values" in batch or "position_ids" in batch:
            raise ValueError(
                "sequence log-probabilities are computed per row of a text batch: pass "
                "unpacked rows (no position_ids) without images"
            )
        return batch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``pipe(input_ids=..., attention_mask=...)``: the logits, as the model returns them.

        Under ``torch.no_grad()`` a batch of fewer rows than the pipe's microbatches runs
        as one microbatch per row (a single prompt needs no padding rows)."""
        if args:
            raise TypeError("pass the batch by keyword: pipe(input_ids=..., attention_mask=...)")
        batch = self._checked_batch(kwargs, training=False)
        with_images = self._with_images(batch, None)
        if with_images is not None and torch.is_grad_enabled():
            raise ValueError(
                "logits of a batch with images are computed under torch.no_grad() only; "
                "train with forward_backward"
            )
        if torch.is_grad_enabled():
            return super().forward(**batch)
        rows = batch["input_ids"].shape[0]
        config = replace(
            with_images or self.run_config,
            num_microbatch=self.run_config.microbatches_for(len(self.pool), rows),
        )
        return self.runtime.forward((), batch, config)

    def _with_images(self, batch: dict, run_config: RoundPipeRunConfig | None):
        """The run config that cuts a batch with images into microbatches with their
        rows (:func:`.images.split_with_images`), or ``run_config`` for a text batch."""
        if "pixel_values" not in batch or self.image_layout is None:
            return run_config
        return replace(
            run_config or self.run_config, split_input=split_with_images(self.image_layout)
        )

    def _checked_batch(
        self, kwargs: dict | None, training: bool, run_config: RoundPipeRunConfig | None = None
    ) -> dict:
        tiling = (run_config or self.run_config).seq_chunk_tokens
        if tiling is not None and not self.tiles:
            model_type = self.hf_model.config.model_type
            raise ValueError(
                f"seq_chunk_tokens={tiling}: the layers of model_type {model_type!r} run as "
                "the model's own (roundpipe's general path) and do not tile; only Llama, "
                "Mistral, Qwen2, Qwen3, Qwen3-MoE and GPT-OSS layers do. Leave "
                "seq_chunk_tokens unset"
            )
        batch = {k: v for k, v in (kwargs or {}).items() if v is not None}
        images = self.image_layout.inputs if self.image_layout is not None else ()
        if "pixel_values" in batch and self.image_refusal is not None:
            raise ValueError(self.image_refusal)
        unknown = set(batch) - {"input_ids", "attention_mask", "position_ids", "labels", *images}
        if unknown:
            raise TypeError(
                f"unexpected inputs {sorted(unknown)}: pass input_ids, attention_mask, "
                "position_ids (packed sequences), labels"
                + (f", and images as {', '.join(images)}" if images else "")
            )
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise ValueError(
                "input_ids must be a B×S integer tensor, got "
                + (
                    f"shape {tuple(ids.shape)} {ids.dtype}"
                    if isinstance(ids, torch.Tensor)
                    else repr(type(ids))
                )
            )
        if self.max_positions is not None and ids.shape[1] > self.max_positions:
            raise ValueError(
                f"sequence length {ids.shape[1]} exceeds the model's maximum of "
                f"{self.max_positions} positions"
            )
        mask = batch.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
                raise ValueError(
                    f"attention_mask must have the shape of input_ids {tuple(ids.shape)}"
                )
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError("attention_mask must hold only 0 and 1")
            batch["attention_mask"] = mask.long()
        positions = batch.get("position_ids")
        if positions is not None:
            batch["position_ids"] = self._checked_positions(positions, ids.shape, mask)
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in batch and (
                not isinstance(batch[name], torch.Tensor) or batch[name].shape != ids.shape
            ):
                raise ValueError(f"{name} must have the shape of input_ids {tuple(ids.shape)}")
        if self.image_layout is not None:
            check_images(self.image_layout, batch)
        labels = batch.get("labels")
        if training and labels is None:
            raise ValueError("training needs labels (the targets; -100 marks ignored positions)")
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(ids.shape)}")
            if not training:
                batch.pop("labels")
        return batch

    def _checked_positions(self, positions, shape, mask) -> torch.Tensor:
        if (
            not isinstance(positions, torch.Tensor)
            or positions.shape != shape
            or positions.is_floating_point()
        ):
            raise ValueError(f"position_ids must be an integer tensor of shape {tuple(shape)}")
        if bool((positions < 0).any()) or (
            self.max_positions is not None and bool((positions >= self.max_positions).any())
        ):
            raise ValueError(
                f"position_ids must lie in [0, {self.max_positions}) (the model's positions)"
            )
        restarts = bool((positions[:, 1:] - positions[:, :-1] != 1).any())
        if restarts and self.packing_refusal is not None:
            raise ValueError(self.packing_refusal)
        if restarts and mask is not None:
            # transformers only derives the block-diagonal mask of packed sequences
            # without an attention_mask; with one, attention would cross examples.
            raise ValueError(
                "packed sequences (position_ids that restart) take no attention_mask: "
                "attention is kept inside each example by the position ids alone"
            )
        return positions.long()


def token_metrics(correct: int, label_tokens: int) -> dict[str, float | int]:
    """What TRL's ``SFTTrainer`` logs of a batch besides its loss: the share of its label
    tokens (shifted by one, ``-100`` ignored) that are the logits' argmax."""
    # as TRL divides: tensors of the counts, so a float32 quotient
    accuracy = (torch.tensor(correct) / torch.tensor(label_tokens)).item() if label_tokens else 0.0
    return {
        "mean_token_accuracy": accuracy,
        "correct_tokens": correct,
        "label_tokens": label_tokens,
    }


def _correct_tokens(heads: list) -> int:
    """The merged head outputs of a training call: its correct-token count."""
    return sum(int(correct) for _, correct in heads)


def _summed_heads(heads: list) -> tuple[torch.Tensor, int]:
    """The merged head outputs of an evaluation: the summed loss, the correct tokens."""
    return torch.stack([total.float() for total, _ in heads]).sum(), _correct_tokens(heads)


def _label_tokens(labels: torch.Tensor) -> int:
    count = int((labels[:, 1:] != IGNORE_INDEX).sum())
    if count == 0:
        raise ValueError(
            "the batch has no label token (every label after the first position is "
            "-100), so its mean loss is undefined"
        )
    return count


def from_hf(model, **options) -> HFRoundPipe:
    """``model``, a decoder-only ``*ForCausalLM`` (or a vision-language model's
    ``*ForConditionalGeneration``, trained on text) or a peft model of one (LoRA:
    only the adapters train; the frozen base is uploaded, never downloaded), as an
    :class:`HFRoundPipe` whose parameters keep ``model``'s names."""
    is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    causal_lm = model.get_base_model() if is_peft else model
    if options.get("grad_reduction", "sum") != "sum":
        raise ValueError(
            "a Hugging Face RoundPipe's loss is already the mean over the global batch's "
            "label tokens; across nodes its gradients are summed (grad_reduction='sum')"
        )
    causal_lm = text_model(causal_lm)
    refusal = adapted_head_refusal(causal_lm)
    if refusal is not None:
        raise ValueError(refusal)
    pipe = HFRoundPipe(model_layers(causal_lm), names_from=model, **options)
    pipe.max_positions = _max_positions(causal_lm.config)
    pipe.packing_refusal = packing_refusal(causal_lm)
    pipe.tiles = own_adapter(causal_lm) is not None
    pipe.image_layout = image_layout(causal_lm)
    pipe.image_refusal = None if pipe.image_layout else images_refusal(causal_lm)
    pipe.__dict__["_hf_model"] = model  # not a submodule: its parameters are the layers'
    pipe.training = model.training  # the mode of what was wrapped (eval after from_pretrained)
    return pipe


def _max_positions(config) -> int | None:
    return getattr(text_config(config), "max_position_embeddings", None)
