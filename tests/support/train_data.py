"""Data sources for the ``roundpipe train`` data tests, built in code with ``datasets``:
an isolated ``datasets`` cache, and a hub dataset as ``datasets`` caches it after a
download, so that ``load_dataset("org/name")`` works offline (``HF_HUB_OFFLINE=1``)
exactly as it does for a user who loaded it once."""

from __future__ import annotations

import glob
import shutil
from pathlib import Path


def isolate_datasets(monkeypatch, root: Path, offline: bool = True) -> Path:
    """Point ``datasets``' cache at ``root / "datasets-cache"`` (nothing written to the
    user's) and, with ``offline``, turn on ``HF_HUB_OFFLINE`` as the environment
    variable does; -> the cache directory."""
    import datasets
    import huggingface_hub.constants

    cache = root / "datasets-cache"
    cache.mkdir(exist_ok=True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    if offline:
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def cache_hub_dataset(cache: Path, repo_id: str, splits: dict[str, list[dict]]) -> None:
    """Put ``repo_id`` into the ``datasets`` cache ``cache`` as a download of its Parquet
    files leaves it: ``<namespace>___<name>/default/0.0.0/<hash>/``, which
    ``load_dataset(repo_id)`` reads when the hub cannot be reached (``datasets``'
    ``CachedDatasetModuleFactory``). The files are prepared by ``datasets``' own Parquet
    builder, then moved under the name the download would have given them."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    staging = cache.parent / f"staging-{namespace}-{name}"
    files = {}
    for split, rows in splits.items():
        path = staging / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        files[split] = [str(path)]
    builder = Parquet(
        cache_dir=str(staging / "prepared"),
        dataset_name=name,
        config_name="default",
        data_files=files,
        hash="0123456789abcdef",
    )
    builder.download_and_prepare()
    (prepared,) = glob.glob(str(staging / "prepared" / name / "*"))  # default-<data files id>
    target = cache / f"{namespace}___{name}"
    target.mkdir(parents=True)
    shutil.move(prepared, target / "default")
    shutil.rmtree(staging)
