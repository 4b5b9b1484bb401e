"""Reaching the Hugging Face hub: a model, tokenizer or dataset named by hub id.

Every call to the hub goes through `hub_errors`, so a machine without network, a gated model
without HF_TOKEN or a misspelt id stops the job with one line naming the setting and the fix,
not a network library's traceback. The driver makes these calls before Ray starts: the model's
and a tokenizer's download in main.fetch_from_hub, the dataset's file list in validate_before_ray.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raytrain_cpu.config.checks import ConfigError

# What to do instead of reaching the hub, by what the id names.
_MODEL_COPY = "download it where there is network (hf download {repo} --local-dir DIR) and set {key}=DIR"
LOCAL_COPY = {
    "model": _MODEL_COPY,
    "tokenizer": _MODEL_COPY,
    "dataset": "download its parquet files and set data.source=parquet data.path=DIR",
}

# A tokenizer needs none of these.
WEIGHT_FILES = ["*.safetensors", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.onnx", "*.gguf"]


def is_hub_id(name: str) -> bool:
    """'owner/name' that is not a local path (the form transformers loads from the hub)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


@contextmanager
def hub_errors(key: str, repo: str, kind: str = "model") -> Iterator[None]:
    """Turns huggingface_hub's failures for `repo` (set by config key `key`) into a ConfigError."""
    import httpx2
    from huggingface_hub.constants import is_offline_mode
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    local = LOCAL_COPY[kind].format(repo=repo, key=key)
    try:
        yield
    except (HfHubHTTPError, httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        failure: BaseException = e  # LocalEntryNotFoundError is a FileNotFoundError too: caught first
    except FileNotFoundError as e:  # a dataset's file list (HfFileSystem) wraps the hub's answer in one
        if not isinstance(e.__cause__, HfHubHTTPError):
            raise
        failure = e.__cause__
    else:
        return
    # Raised here, outside the handlers: one line, with no network library's traceback chained to it.
    if isinstance(failure, GatedRepoError):  # before RepositoryNotFoundError, its base class
        raise ConfigError(
            f"{key}: the {kind} {repo!r} is gated on the hub and this machine's token may not read it. Accept its "
            f"licence at https://huggingface.co/{'datasets/' * (kind == 'dataset')}{repo} and set HF_TOKEN "
            "(a read token of that account): on a cluster, as the 0600 token file each node reads "
            "(cluster/README.md, 'Hugging Face token'), never in the job's runtime env, which the job table shows."
        )
    if isinstance(failure, RepositoryNotFoundError):
        raise ConfigError(
            f"{key}: no {kind} {repo!r} on the hub (or it is private: set HF_TOKEN). Check the id's spelling."
        )
    if isinstance(failure, HfHubHTTPError):
        raise ConfigError(f"{key}: the hub answered {_reason(failure)} for the {kind} {repo!r}.")
    why = "HF_HUB_OFFLINE is set, and it is not in the cache" if is_offline_mode() else _reason(failure)
    raise ConfigError(
        f"{key}: cannot reach the Hugging Face hub for the {kind} {repo!r} ({why}). Run where the hub is "
        f"reachable (HF_ENDPOINT names a mirror), or {local}."
    )


def _reason(e: BaseException) -> str:
    """The first line of the root failure, with what it is: 'ConnectError: [Errno 111] Connection refused'."""
    while e.__cause__ is not None:  # huggingface_hub wraps a failed connection in LocalEntryNotFoundError
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def download_model(repo: str, cache_dir: Path, revision: str | None = None) -> str:
    """A hub model's config, weights and tokenizer, downloaded once into `cache_dir` (on the
    shared storage, so every worker reads the same files); a later run finds them there, also
    offline (huggingface_hub falls back to its cache when the hub does not answer). `revision`:
    a commit to load exactly (a resumed run's, checkpoint.pinned_revision), else the newest.
    Returns the snapshot's directory, `.../snapshots/<commit>` (snapshot_revision)."""
    from huggingface_hub import snapshot_download

    with hub_errors("model.name_or_path", repo):
        return snapshot_download(
            repo,
            revision=revision,
            cache_dir=str(cache_dir),
            allow_patterns=["*.json", "*.safetensors", "tokenizer*"],
        )


def snapshot_revision(snapshot_dir: str | Path) -> str:
    """The commit a hub snapshot directory holds: huggingface_hub's cache names each by it."""
    p = Path(snapshot_dir)
    if p.parent.name != "snapshots":
        raise ValueError(f"{snapshot_dir} is not a hub cache snapshot (.../snapshots/<commit>)")
    return p.name


def download_tokenizer(repo: str, cache_dir: Path) -> str:
    """A hub tokenizer's files (the repo without its weights) in `cache_dir`; returns their
    directory. A model's own tokenizer is already there once the model is (download_model), so
    a run finds it offline too. Fetched here rather than by transformers, which retries an
    unreachable hub for about 45 s and then raises an OSError of its own."""
    from huggingface_hub import snapshot_download

    with hub_errors("model.tokenizer", repo, "tokenizer"):
        return snapshot_download(repo, cache_dir=str(cache_dir), ignore_patterns=WEIGHT_FILES)
