"""``--model ORG/NAME[@REVISION]``: a checkpoint on the Hugging Face Hub, fetched through ``huggingface_hub``.

The standard cache is used (``HF_HOME`` / ``HF_HUB_CACHE``), as are ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` (gated
repositories) and huggingface_hub's own progress bars. Only what the engine reads is downloaded: config.json,
generation_config.json, the tokenizer files and the top-level safetensors weights (the shards
``model.safetensors.index.json`` names when there is one), never pickle weights (``*.bin``, ``*.pth``), GGUF files
or subfolders such as ``original/``. ``config_file`` fetches config.json alone (``models --config ORG/NAME``).
Every failure is a one-line ``MoeOffloadError`` (``_hub_error``).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from ..errors import MoeOffloadError

#: metadata the engine reads: the config, the generation config, the tokenizer, the shard index
META_PATTERNS = ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer*",
                 "special_tokens_map.json", "added_tokens.json", "chat_template.*", "vocab.*", "merges.txt"]
#: never downloaded: anything in a subfolder (``original/``, ...); the patterns above name no pickle or GGUF file
IGNORE_PATTERNS = ["*/*"]
#: weight files the engine does not read, named when a repository holds no safetensors
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl")
FORM = "ORG/NAME[@REVISION]"
_PATHLIKE = re.compile(r"^(/|\.{1,2}(/|$)|~)|\\")


def looks_like_hub_name(name: str) -> bool:
    """Whether ``--model name`` (which is no existing path) is meant as a Hub name: exactly one ``/`` before an
    optional ``@REVISION``, and no path-like start (``/``, ``./``, ``../``, ``~``) or backslash."""
    return not _PATHLIKE.search(name) and name.split("@", 1)[0].count("/") == 1


def parse_hub_name(name: str) -> tuple[str, str | None]:
    """``(repo_id, revision or None)`` of ``ORG/NAME[@REVISION]``.

    Raises:
        MoeOffloadError: a malformed name (an empty part, characters the Hub does not allow in a repository id,
            ``--`` or ``..``, more than 96 characters, an empty revision).
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, at, revision = name.partition("@")
    org, _, model = repo_id.partition("/")
    problem = None
    if not org or not model:
        problem = "the organization and the model name must both be given"
    elif at and not revision.strip():
        problem = "the revision after @ is empty"
    else:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as e:
            problem = str(e).splitlines()[0].rstrip(".")
    if problem:
        raise MoeOffloadError(f"malformed Hugging Face model name {name!r} ({problem}): give {FORM} (letters, digits, "
                              "'-', '_', '.'), or an existing checkpoint directory")
    return repo_id, revision or None


def cache_dir() -> str:
    """The Hugging Face hub cache directory in use (``HF_HUB_CACHE``, else ``HF_HOME``/hub)."""
    from huggingface_hub import constants

    return str(Path(constants.HF_HUB_CACHE).expanduser())


@contextlib.contextmanager
def _progress_bars(show: bool):
    """huggingface_hub's progress bars shown or hidden for the block (restored afterwards)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_disabled:
            enable_progress_bars()


def snapshot(name: str, progress: bool = True) -> Path:
    """The checkpoint directory of ``ORG/NAME[@REVISION]``: its snapshot in the hub cache, downloading what the
    engine reads (config, generation config, tokenizer, top-level safetensors) when it is not cached.

    Raises:
        MoeOffloadError: a malformed name, a repository or revision the Hub does not have, a gated repository without
            (or with an insufficient) token, offline (``HF_HUB_OFFLINE=1``) or the Hub unreachable and the files not
            in the cache (the message names the cache directory), a repository without config.json or without
            safetensors weights (pickle checkpoints are not read), a cached snapshot missing shards.
    """
    from huggingface_hub import snapshot_download

    repo_id, revision = parse_hub_name(name)
    with _progress_bars(progress), _hub_errors(name):
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=META_PATTERNS,
                                        ignore_patterns=IGNORE_PATTERNS))
        if not (folder / "config.json").is_file():
            raise MoeOffloadError(f"{name} has no config.json: not a Hugging Face transformers checkpoint"
                                  f"{_weights_note(repo_id, folder)}")
        shards = _index_shards(folder)
        weights = shards if shards else ["*.safetensors"]
        # pinned to the snapshot's commit: no second look-up of the revision, and the same files as the metadata
        folder = Path(snapshot_download(repo_id, revision=folder.name, allow_patterns=weights,
                                        ignore_patterns=IGNORE_PATTERNS))
    _check_weights(name, repo_id, folder, shards)
    return folder


def config_file(name: str) -> Path:
    """config.json of ``ORG/NAME[@REVISION]`` alone (from the cache, else downloaded): what ``models --config``
    reads to say whether the model is served and how large it is, before any weights are downloaded.

    Raises:
        MoeOffloadError: as ``snapshot`` (a malformed name, unknown repository or revision, gated, offline and not
            cached, no config.json).
    """
    from huggingface_hub import hf_hub_download

    repo_id, revision = parse_hub_name(name)
    with _hub_errors(name):
        return Path(hf_hub_download(repo_id, "config.json", revision=revision))


def _index_shards(folder: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` names (sorted), or [] without an index.

    Raises:
        MoeOffloadError: the index is not valid JSON or has no ``weight_map``.
    """
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise MoeOffloadError(f"{index} is not a safetensors index (no weight_map: {e})") from None


def _check_weights(name: str, repo_id: str, folder: Path, shards: list[str]) -> None:
    """Raise when the snapshot ``folder`` has no safetensors weights (naming any pickle weights the repository
    holds) or misses shards its index names (a partial snapshot read offline).

    Raises:
        MoeOffloadError: as described.
    """
    if shards:
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise MoeOffloadError(f"the cached snapshot of {name} ({folder}) misses {len(missing)} of the "
                                  f"{len(shards)} safetensors shards its index names ({missing[0]}...): download it "
                                  "again with network access (without HF_HUB_OFFLINE=1)")
    elif not any(folder.glob("*.safetensors")):
        raise MoeOffloadError(f"{name} has no *.safetensors weights{_weights_note(repo_id, folder)}; moe-offload "
                              "reads safetensors only (pickle checkpoints such as pytorch_model.bin are not read)")


def _weights_note(repo_id: str, folder: Path) -> str:
    """``" (it holds pytorch_model.bin, ...)"``: the pickle or GGUF weight files of the repository at ``folder``'s
    commit, from the cached listing of the repository (no network) or else the snapshot folder; "" when none."""
    import huggingface_hub
    from huggingface_hub import errors

    listing = getattr(huggingface_hub, "get_cached_repo_tree", None)  # newer huggingface_hub caches the listing
    try:
        files = [f.path for f in listing(repo_id, revision=folder.name)] if listing else None
    except (getattr(errors, "CachedRepoTreeNotFoundError", OSError), OSError, ValueError):
        files = None
    if files is None:
        files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    weights = sorted(f for f in files if f.lower().endswith(PICKLE_SUFFIXES + (".gguf",)))
    if not weights:
        return ""
    more = f", ... ({len(weights)} files)" if len(weights) > 3 else ""
    return f" (it holds {', '.join(weights[:3])}{more})"


@contextlib.contextmanager
def _hub_errors(name: str):
    """huggingface_hub's exceptions raised in the block, as one-line ``MoeOffloadError``s (``hub_error``)."""
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, HfHubHTTPError, OfflineModeIsEnabled

    try:
        yield
    except (EntryNotFoundError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled, OSError) as e:
        raise MoeOffloadError(hub_error(name, e)) from None


def hub_error(name: str, e: Exception) -> str:
    """One line for huggingface_hub's exception ``e`` raised while fetching ``name``: gated (with or without a
    token), unknown repository, unknown revision, no such file, offline or unreachable and not cached (naming the
    cache directory), an incomplete cached snapshot, another HTTP error, a name the Hub refuses."""
    from huggingface_hub import constants, get_token
    from huggingface_hub import errors
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HFValidationError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # a partial cached snapshot (newer huggingface_hub)

    repo_id, _, revision = name.partition("@")
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    where = f"the Hugging Face cache {cache_dir()}"
    if isinstance(e, GatedRepoError):
        if get_token() is None:
            return (f"{repo_id} is a gated repository: accept its conditions on https://huggingface.co/{repo_id} "
                    "and set HF_TOKEN to an access token (or run `hf auth login`)")
        return (f"{repo_id} is a gated repository and your token has no access to it: accept its conditions on "
                f"https://huggingface.co/{repo_id}")
    if isinstance(e, RepositoryNotFoundError):
        return (f"no model repository {repo_id} on the Hugging Face Hub (or it is private and "
                f"{'your token has no access' if get_token() else 'HF_TOKEN is not set'}); give {FORM} or a "
                "checkpoint directory")
    if isinstance(e, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} on the Hugging Face Hub (a branch, tag or commit hash)"
    if incomplete and isinstance(e, incomplete):
        return f"the cached snapshot of {name} in {where} is incomplete and the Hub cannot be reached: {first}"
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        if constants.is_offline_mode():
            return (f"{name} is not in {where} and HF_HUB_OFFLINE=1 forbids downloading it: download it once "
                    "without HF_HUB_OFFLINE, or set HF_HUB_CACHE to the cache that holds it")
        return f"{name} is not in {where} and the Hugging Face Hub cannot be reached ({first})"
    if isinstance(e, EntryNotFoundError):
        return f"{name} has no config.json: not a Hugging Face transformers checkpoint"
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return f"the Hugging Face Hub answered {status or 'an error'} for {name}: {first}"
    if isinstance(e, HFValidationError):
        return f"malformed Hugging Face model name {name!r} ({first}): give {FORM}"
    return f"could not fetch {name} from the Hugging Face Hub ({type(e).__name__}: {first}); cache: {cache_dir()}"
