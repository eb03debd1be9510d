"""A tiny byte-level BPE tokenizer with ChatML special tokens, trained here (no
downloads), for the ``roundpipe.train`` data tests (the ``tokenizer`` fixture in
``conftest.py``)."""

from __future__ import annotations

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "What is two plus three? Two plus three is five.",
    "user assistant system think",
]


def make_tokenizer(chat_template=CHATML, bos=False, appends_eos=False):
    """A byte-level BPE tokenizer; ``bos`` adds ``<s>`` in front and ``appends_eos``
    ``<|endoftext|>`` at the end of every encoding with special tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(CORPUS * 5, trainer)
    if bos or appends_eos:
        single = ("<s> " if bos else "") + "$A" + (" <|endoftext|>" if appends_eos else "")
        ids = [(token, model.token_to_id(token)) for token in ("<s>", "<|endoftext|>")]
        model.post_processor = processors.TemplateProcessing(single=single, special_tokens=ids)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<s>" if bos else None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )
