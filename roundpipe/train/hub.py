"""``--model`` and ``--revision`` as a local directory: the directory itself, or the
snapshot of a Hugging Face hub id in the user's cache (``huggingface_hub``: its cache,
``HF_HUB_CACHE`` / ``HF_HOME``, its token and ``HF_HUB_OFFLINE``).

Only what a run reads is fetched: the config, generation config, tokenizer and chat
template files, and the safetensors weights (the single file, or the index and then the
shards it lists), never ``.bin`` or other formats a repository also holds
(docs/design.md#the-model-from-the-hub). Each problem is a
:class:`~roundpipe.train.options.UsageError` naming the id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..hf.safetensors_io import INDEX_FILE, SINGLE_FILE
from .options import UsageError

METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files besides the weights a run reads (transformers' config and tokenizer)."""


@dataclass(frozen=True)
class ModelSource:
    """Where ``--model`` lies on disk: ``directory``; for a hub id, the id and the commit
    of the snapshot (``None`` for a local directory)."""

    directory: Path
    hub_id: str | None = None
    commit: str | None = None

    @property
    def name(self) -> str:
        """The model's name in titles: the hub id, or the directory's name."""
        return self.hub_id or self.directory.name

    def describe(self, spelling: str) -> str:
        """``--model`` as the messages name it: the user's spelling, and for a hub id the
        snapshot it resolved to."""
        if self.hub_id is None:
            return f"--model {spelling}"
        return f"--model {spelling} (snapshot {self.directory})"


def is_local(model: str | Path) -> bool:
    """Whether ``model`` names a local directory rather than a hub id: an existing
    directory, or anything a hub id cannot be (an absolute or ``./`` path, ``~``, more
    than one ``/``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    text = str(model)
    if Path(text).expanduser().is_dir() or text.startswith(("/", ".", "~")):
        return True
    try:
        validate_repo_id(text)
    except HFValidationError:
        return True
    return False


def local_spelling(model: str | Path) -> str:
    """``--model`` as ``run.yaml`` keeps it: a local directory made absolute (as it always
    was), a hub id as given (its snapshot changes with the revision it resolves to)."""
    return str(Path(model).expanduser().absolute()) if is_local(model) else str(model)


def resolve_model(model: str | Path, revision: str | None = None) -> ModelSource:
    """The directory holding ``--model``: the local directory, or the snapshot of the hub
    id (downloaded unless cached; offline, the cache alone)."""
    if is_local(model):
        if revision is not None:
            raise UsageError(
                f"--revision {revision} applies to a hub id, but --model {model} is a local "
                "directory (check out the revision there instead)"
            )
        return ModelSource(Path(model).expanduser().absolute())
    hub_id = str(model)
    first = _snapshot(hub_id, revision, [*METADATA_FILES, INDEX_FILE])
    commit = first.name  # pinned: a branch that moves between the two calls is not mixed
    index = first / INDEX_FILE
    weights = [SINGLE_FILE]
    if index.is_file():
        try:
            weights = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise UsageError(f"--model {hub_id}: {index} is damaged ({error!r})") from error
    directory = _snapshot(hub_id, commit, [*METADATA_FILES, INDEX_FILE, *weights])
    return ModelSource(Path(directory), hub_id, commit)


def _snapshot(hub_id: str, revision: str | None, patterns: list[str]) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as hub

    where = f"--model {hub_id}" + (f" --revision {revision}" if revision else "")
    try:
        return Path(
            huggingface_hub.snapshot_download(hub_id, revision=revision, allow_patterns=patterns)
        )
    except hub.RevisionNotFoundError as error:
        raise UsageError(f"{where}: no such revision (branch, tag or commit) on the hub") from error
    except hub.GatedRepoError as error:
        raise UsageError(
            f"{where}: a gated model: accept its terms on huggingface.co and log in "
            "(hf auth login, or HF_TOKEN)"
        ) from error
    except hub.RepositoryNotFoundError as error:
        raise UsageError(
            f"{where}: not a local directory and no such model on the hub (a private one "
            "needs a login: hf auth login, or HF_TOKEN)"
        ) from error
    except hub.LocalEntryNotFoundError as error:
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            raise UsageError(
                f"{where}: not a local directory, and not in the Hugging Face cache {cache} "
                "(HF_HUB_OFFLINE is set: download it there first, or unset HF_HUB_OFFLINE)"
            ) from error
        raise UsageError(
            f"{where}: not a local directory, not in the Hugging Face cache {cache}, and "
            f"the hub cannot be reached ({error.__cause__ or error})"
        ) from error
    except (hub.IncompleteSnapshotError, hub.HfHubHTTPError, OSError) as error:
        raise UsageError(f"{where}: {error}") from error
