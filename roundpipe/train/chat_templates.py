"""``--chat-template FILE|NAME``: the chat template of ``roundpipe train`` and ``roundpipe
chat`` when the tokenizer has none (a base model) or the user wants another one: a
Jinja file, or a built-in name (:data:`BUILT_IN`).

The built-in templates render plain conversations (``role`` and ``content``, no tools
or thinking blocks) the way their families mark them up, honour
``add_generation_prompt``, and keep the prefix property :mod:`.chat` reads the
assistant turns off (the rendering of a conversation up to an assistant turn starts with
the rendering of the messages before it plus the generation prompt).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .usage import UsageError

_CHATML_MESSAGES = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)
_CHATML_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' }}"

CHATML = (
    _CHATML_MESSAGES
    + "{%- if add_generation_prompt %}" + _CHATML_GENERATION_PROMPT + "{%- endif %}"
)  # fmt: skip
"""ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""

LLAMA3 = (
    "{{- bos_token if bos_token else '' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama 3's: the BOS token once, then ``<|start_header_id|>role<|end_header_id|>\\n\\n``
and the trimmed content ending in ``<|eot_id|>`` per message."""

QWEN3 = (
    _CHATML_MESSAGES
    + "{%- if add_generation_prompt %}" + _CHATML_GENERATION_PROMPT
    + "{%- if enable_thinking is defined and enable_thinking is false %}"
    + "{{- '<think>\\n\\n</think>\\n\\n' }}"
    + "{%- endif %}"
    + "{%- endif %}"
)  # fmt: skip
"""Qwen3's for plain conversations: ChatML; a generation prompt with
``enable_thinking=False`` opens with the empty thinking block, as Qwen3's own template
does."""

BUILT_IN = {"chatml": CHATML, "llama3": LLAMA3, "qwen3": QWEN3}
"""The chat templates ``--chat-template`` knows by name."""

_PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
]


def apply_chat_template_option(tokenizer: Any, value: str | Path | None) -> None:
    """Set ``tokenizer.chat_template`` to ``--chat-template value`` (a built-in name or a
    Jinja file); ``None`` leaves the tokenizer's own. Raises :class:`UsageError` for a
    name that is no built-in and no readable file, or a template that cannot render a
    conversation."""
    if value is None:
        return
    template = _template_text(str(value))
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # jinja's syntax and render errors, transformers' own
        raise UsageError(
            f"--chat-template {value}: the template cannot render a conversation: {error}"
        ) from error


def template_spelling(value: str | Path | None) -> str | None:
    """``--chat-template`` as ``run.yaml`` keeps it: a built-in name as given, a file
    made absolute (a resumed run or ``roundpipe chat --checkpoint`` may start elsewhere)."""
    if value is None or str(value) in BUILT_IN:
        return None if value is None else str(value)
    return str(Path(value).expanduser().absolute())


def _template_text(value: str) -> str:
    if value in BUILT_IN:
        return BUILT_IN[value]
    path = Path(value).expanduser()
    names = ", ".join(BUILT_IN)
    if not path.exists():
        raise UsageError(
            f"--chat-template {value}: neither a built-in template ({names}) nor a file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--chat-template {value}: cannot be read ({error})") from error
    if not text.strip():
        raise UsageError(f"--chat-template {value}: the file is empty")
    return text
