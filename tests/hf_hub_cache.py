"""A Hugging Face Hub cache built in a test's tmp folder, read offline: what `snapshot_download`
left behind after downloading a repository, without the network.

The layout is huggingface_hub's (`HF_HUB_CACHE/models--ORG--NAME/refs/REVISION` holds a commit hash,
`snapshots/COMMIT/` the files). With HF_HUB_OFFLINE, `snapshot_download` resolves the revision
through `refs/` and returns the snapshot folder; the real cache's `blobs/` (which the snapshot's
files link to) is not read there, so the files are plain copies.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def offline_hf_cache(monkeypatch, cache: Path) -> Path:
    """Point huggingface_hub at `cache` with HF_HUB_OFFLINE on: as the environment variables would, and
    on its constants too (read once, when huggingface_hub was first imported)."""
    from huggingface_hub import constants
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
    """Put `folder`'s files in the cache as `repo_id` at `revision`; returns the snapshot folder."""
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()  # any 40 hex digits
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)  # no trailing newline, as huggingface_hub writes it
    return Path(shutil.copytree(folder, repo / "snapshots" / commit))
