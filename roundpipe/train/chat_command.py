"""``roundpipe chat``: talk to a model, a ``roundpipe train`` result or one of its
checkpoints, through ``transformers``' ``generate`` and the tokenizer's chat template
(or ``--chat-template``), on one device (a GPU when there is one, else the CPU).

Interactive by default (a user line from stdin, the answer streamed, the conversation
kept; ``/exit`` or end of input ends it), or ``--prompt`` for one answer. A
``checkpoints/step-N`` is loaded as ``roundpipe export`` loads it (an adapter merged
into its base). An answer ends at the template's end of turn (the first special token
after an assistant message's content: ``<|im_end|>``, ``<|eot_id|>``...) or the
model's EOS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import one_line_usage_errors
from .usage import UsageError

DESCRIPTION = """\
Talk to a model: a local directory or hub id, a LoRA adapter of roundpipe train on
its base, or a checkpoint of a run.

  roundpipe chat --model DIR|ORG/NAME [--adapter DIR] [--prompt TEXT]
  roundpipe chat --adapter RUN_OUTPUT          (its base: the one the adapter names)
  roundpipe chat --checkpoint RUN[/checkpoints/step-N]

Without --prompt it reads a message per line from stdin and answers each, keeping
the conversation (/reset forgets it, /exit or Ctrl-D ends). --temperature 0 answers
greedily; by default the model answers as its generation_config.json says (greedily
without one). A base model without a chat template needs --chat-template (a Jinja
file, or chatml, llama3, qwen3). Runs on the GPU if there is one (in the model's
dtype), else on the CPU (in fp32).
"""
EXIT_INTERRUPTED = 130
COMMANDS = {"/exit": "end the chat", "/reset": "forget the conversation"}


def add_chat_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``chat`` on the ``roundpipe`` command's subparsers."""
    parser = commands.add_parser(
        "chat",
        help="talk to a model, a trained adapter or a checkpoint (transformers' generate)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    one_line_usage_errors(parser)
    parser.add_argument("--model", metavar="DIR|ORG/NAME",
                        help="the model: a local directory or a hub id (default: the base "
                             "named by --adapter or the run of --checkpoint)")  # fmt: skip
    parser.add_argument("--revision", default=None, metavar="REV",
                        help="branch, tag or commit of a hub --model")  # fmt: skip
    parser.add_argument("--adapter", type=Path, metavar="DIR",
                        help="a LoRA adapter (a LoRA roundpipe train run's --output)")  # fmt: skip
    parser.add_argument("--checkpoint", type=Path, metavar="DIR",
                        help="a checkpoints/step-N directory of a roundpipe train run, or "
                             "the run's --output (its newest checkpoint)")  # fmt: skip
    parser.add_argument("--chat-template", metavar="FILE|NAME",
                        help="a Jinja chat template file, or chatml, llama3, qwen3 "
                             "(default: the tokenizer's)")  # fmt: skip
    parser.add_argument("--prompt", metavar="TEXT",
                        help="answer this one message and exit")  # fmt: skip
    parser.add_argument("--system", metavar="TEXT",
                        help="a system message opening the conversation")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N",
                        help="the longest answer in tokens (default: 256)")  # fmt: skip
    parser.add_argument("--temperature", type=_non_negative_float, default=None, metavar="T",
                        help="sample at this temperature; 0 answers greedily (default: as "
                             "the model's generation_config.json says, else greedily)")  # fmt: skip
    parser.add_argument("--top-p", type=_probability, default=None, metavar="P",
                        help="sample from the likeliest tokens holding this probability "
                             "(default: the model's generation config)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling (default: unseeded)")  # fmt: skip
    parser.add_argument("--device", default=None,
                        help="where the model runs: cuda, cuda:N or cpu (default: cuda when "
                             "there is a GPU, else cpu)")  # fmt: skip
    parser.set_defaults(run=run_chat, chat_parser=parser)
    return parser


def run_chat(args: argparse.Namespace) -> int:
    """The ``chat`` subcommand: 0; 2 for bad input (one line on stderr); 130 for Ctrl-C."""
    from .quiet import quiet_imports, quiet_transformers

    quiet_imports()
    try:
        with quiet_transformers():
            model, tokenizer = load_chat_model(args)
            session = ChatSession(model, tokenizer, args)
            if args.prompt is not None:
                print(session.answer(args.prompt), flush=True)
                return 0
            session.converse(sys.stdin)
    except UsageError as error:
        args.chat_parser.exit(2, f"roundpipe chat: error: {error}\n")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def load_chat_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (in eval mode, on ``--device``) and its tokenizer, with the chat template
    chosen: ``--chat-template``, else that of the checkpoint's run, else the tokenizer's
    own (the adapter's, saved by the run, before the base model's)."""
    from .chat_templates import apply_chat_template_option
    from .hub import resolve_model

    if args.adapter is not None and args.checkpoint is not None:
        raise UsageError("give --adapter or --checkpoint, not both (each holds trained weights)")
    device = _device(args.device)
    if args.checkpoint is not None:
        model, tokenizer = _checkpoint_model(args.checkpoint, args.model, args.revision)
    else:
        spelling = args.model or _adapter_base(args.adapter)
        source = resolve_model(spelling, args.revision)
        model = _pretrained(source.directory, source.describe(spelling), device)
        tokenizer_dir = source.directory
        if args.adapter is not None:
            model = _with_adapter(model, args.adapter, source.describe(spelling))
            tokenizer_dir = args.adapter if _has_tokenizer(args.adapter) else tokenizer_dir
        tokenizer = _tokenizer(tokenizer_dir)
    apply_chat_template_option(tokenizer, args.chat_template)
    if not tokenizer.chat_template:
        raise UsageError(
            "the tokenizer has no chat template (a base model?): give --chat-template "
            "with a Jinja file or a built-in name (chatml, llama3, qwen3)"
        )
    if device.type == "cpu":
        model = model.float()  # half precision is slow or unsupported on CPUs
    return model.to(device).eval(), tokenizer


class ChatSession:
    """A conversation with ``model``: the history of messages and how to answer."""

    def __init__(self, model: Any, tokenizer: Any, args: argparse.Namespace) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.system = args.system
        self.history: list[dict] = self._opening()
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.options = _sampling(args)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        if args.seed is not None:
            import torch

            torch.manual_seed(args.seed)

    def _opening(self) -> list[dict]:
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def answer(self, message: str, streamer: Any = None) -> str:
        """The model's answer to ``message``, which joins the history with it."""
        import torch

        messages = [*self.history, {"role": "user", "content": message}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        length = inputs["input_ids"].shape[1]
        if self.max_positions is not None and length >= self.max_positions:
            raise UsageError(
                f"the conversation is {length} tokens, the model's maximum is "
                f"{self.max_positions} positions (/reset starts a new one)"
            )
        limit = self.options["max_new_tokens"]
        if self.max_positions is not None:
            limit = min(limit, self.max_positions - length)
        inputs = inputs.to(self.model.device)
        with torch.no_grad():
            output = self.model.generate(
                **inputs,
                **{**self.options, "max_new_tokens": limit},
                eos_token_id=self.stop_ids,
                pad_token_id=_pad_id(self.tokenizer, self.stop_ids),
                streamer=streamer,
            )
        reply = self.tokenizer.decode(output[0, length:], skip_special_tokens=True).strip()
        self.history = [*messages, {"role": "assistant", "content": reply}]
        return reply

    def converse(self, lines) -> None:
        """Answer each line of ``lines`` (stdin) until ``/exit`` or its end, streaming
        each answer to stdout."""
        from transformers import TextStreamer

        interactive = lines.isatty()
        if interactive:
            commands = ", ".join(f"{name} to {what}" for name, what in COMMANDS.items())
            print(f"roundpipe chat: type a message ({commands}; Ctrl-D ends)", file=sys.stderr)
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        while True:
            line = _read_line(lines, interactive)
            if line is None or line.strip() == "/exit":
                return
            if line.strip() == "/reset":
                self.history = self._opening()
                continue
            if not line.strip():
                continue
            try:
                self.answer(line.rstrip("\n"), streamer)
            except UsageError as error:  # the conversation is too long: say so, go on
                print(f"roundpipe chat: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokens that end an answer: the template's end of turn (the first special
    token its rendering puts after an assistant message's content), then the model's
    and the tokenizer's EOS."""
    from .chat import special_token_ids

    marker = "\x00answer\x00"
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    after = rendered.partition(marker)[2]
    special = special_token_ids(tokenizer)
    turn_end = [t for t in tokenizer.encode(after, add_special_tokens=False) if t in special][:1]
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [eos]
    candidates = [*turn_end, *eos, tokenizer.eos_token_id]
    return list(dict.fromkeys(t for t in candidates if t is not None))


def _read_line(lines, interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            print(file=sys.stderr)
            return None
    line = lines.readline()
    return line or None


def _sampling(args: argparse.Namespace) -> dict:
    """``generate``'s options: greedy for ``--temperature 0``; sampling when
    ``--temperature`` or ``--top-p`` is given; else the model's generation config."""
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.temperature == 0:
        return {**options, "do_sample": False}
    given = {"temperature": args.temperature, "top_p": args.top_p}
    given = {key: value for key, value in given.items() if value is not None}
    return {**options, "do_sample": True, **given} if given else options


def _pad_id(tokenizer: Any, stop_ids: list[int]) -> int | None:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"--device {name}: not a device ({error})") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this machine has no CUDA GPU (use --device cpu)")
    return device


def _pretrained(directory: Path, flag: str, device):
    import torch
    import transformers

    if not directory.is_dir():
        raise UsageError(f"{flag}: no such directory")
    if (directory / "adapter_config.json").is_file() and not (directory / "config.json").is_file():
        raise UsageError(f"{flag}: a LoRA adapter, not a model: pass it as --adapter")
    if not (directory / "config.json").is_file():
        raise UsageError(f"{flag}: not a Hugging Face model directory (no config.json)")
    dtype = torch.float32 if device.type == "cpu" else "auto"
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{flag}: the model cannot be loaded: {error}") from error


def _adapter_config(adapter: Path):
    import peft

    if not adapter.is_dir():
        raise UsageError(f"--adapter {adapter}: no such directory")
    if not (adapter / "adapter_config.json").is_file():
        raise UsageError(
            f"--adapter {adapter}: not a peft adapter (no adapter_config.json); the "
            "--output of a --full run is a model: pass it as --model"
        )
    try:
        return peft.PeftConfig.from_pretrained(str(adapter))
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--adapter {adapter}: adapter_config.json: {error}") from error


def _adapter_base(adapter: Path | None) -> str:
    """``--model`` when it is not given: the base model named in the adapter's config."""
    if adapter is None:
        raise UsageError("give --model (a model directory or hub id), --adapter or --checkpoint")
    base = _adapter_config(adapter).base_model_name_or_path
    if not base:
        raise UsageError(f"--adapter {adapter}: names no base model; give --model")
    return base


def _with_adapter(model, adapter: Path, base_flag: str):
    """``model`` with the LoRA adapter in ``adapter``; one that does not fit it (another
    base: its modules, shapes or layers differ) is refused."""
    import peft

    _adapter_config(adapter)
    refusal = f"--adapter {adapter} does not fit {base_flag} (an adapter of another model?)"
    try:
        fitted = peft.PeftModel.from_pretrained(model, str(adapter))
    except (RuntimeError, ValueError, KeyError) as error:
        reason = str(error).strip().splitlines()[0]
        raise UsageError(f"{refusal}: {reason}") from error
    saved = set(peft.utils.load_peft_weights(str(adapter), device="cpu"))
    expected = set(peft.get_peft_model_state_dict(fitted))
    if saved != expected:
        stray, missing = sorted(saved - expected), sorted(expected - saved)
        raise UsageError(f"{refusal}: weights not in the model {stray[:2]}, "
                         f"missing {missing[:2]}")  # fmt: skip
    return fitted


def _has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer_config.json").is_file()


def _tokenizer(directory: Path):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{directory}: the tokenizer cannot be loaded: {error}") from error


def _checkpoint_model(checkpoint: Path, spelling: str | None, revision: str | None):
    """The model of a run's checkpoint (or of the newest checkpoint of a run's
    ``--output``) as ``roundpipe export --merge`` loads it (an adapter merged into its
    base), and the tokenizer as the run used it. The base is the run's ``--model``, or
    ``spelling`` (the base where it lies on this machine)."""
    from .checkpoints import newest_of_run
    from .export import read_run_checkpoint, run_tokenizer, trained_model, trained_weights
    from .hub import resolve_model

    newest = newest_of_run(checkpoint)
    if newest is not None:
        print(f"roundpipe chat: the newest checkpoint of {checkpoint}: {newest[0]}",
              file=sys.stderr)  # fmt: skip
        checkpoint = newest[0]
    options, where = read_run_checkpoint(checkpoint.absolute())
    if spelling is None:
        spelling, revision = options.model, options.revision
    assert spelling is not None
    source = resolve_model(spelling, revision)
    if not source.directory.is_dir():
        raise UsageError(
            f"{source.describe(spelling)}: no such directory (the base model of the run of "
            f"--checkpoint {checkpoint}; give --model where it lies on this machine)"
        )
    weights = trained_weights(where)
    model = trained_model(source.directory, options, weights, merge=not options.full)
    return model, run_tokenizer(source.directory, options)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
