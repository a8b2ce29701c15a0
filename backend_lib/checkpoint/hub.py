"""Checkpoint locations: a local folder, or a Hugging Face model id resolved through huggingface_hub.

A model's `checkpoint` and `tokenizer` parameters take either

- a folder: absolute, `~/...`, or relative to the model's folder in the repository; or
- a Hub model id, `org/name`, optionally pinned to a revision (a commit, tag or branch) with
  `org/name@<revision>` (`Qwen/Qwen3-8B@9c925d64...`). The id is looked up with
  `huggingface_hub.snapshot_download` in the Hub cache ($HF_HOME / $HF_HUB_CACHE): files already
  there are not fetched again, and with $HF_HUB_OFFLINE=1 nothing is fetched at all (the cache must
  hold the snapshot: `refs/<revision>` or `snapshots/<commit>`). $HF_TOKEN authenticates gated repos.

A value that names an existing folder is always that folder; any other value of the id form is a Hub
id (write `./org/name` for a local folder that does not exist yet). Only what the engine loads is
fetched: configs, safetensors, tokenizer files and chat templates (never pickle weights).
"""
from __future__ import annotations

import os
import re

# What a checkpoint folder needs (backend_lib.checkpoint and backend_lib.tokenizer read nothing else).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.tiktoken", "*.model"]
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<revision>[\w./-]+))?$")


class HubError(ValueError):
    """A Hub id that cannot be resolved; the message names the parameter."""


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when `value` has the form org/name[@revision], else None."""
    m = _ID.match(value.strip())
    if not m or ".." in m["repo"] or "--" in m["repo"]:
        return None
    return m["repo"], m["revision"]


def resolve(value: str, param: str, base_dir: str | None = None) -> str:
    """The local folder for a `checkpoint` / `tokenizer` parameter value (see the module doc)."""
    path = os.path.expanduser(value)
    local = path if os.path.isabs(path) or base_dir is None else os.path.normpath(os.path.join(base_dir, path))
    if os.path.isdir(local):
        return local
    hub_id = None if os.path.isabs(path) else parse_hub_id(value)
    if hub_id is None:
        return local         # a folder that is missing: the loader reports it, naming the parameter
    return download(*hub_id, param=param, local=local)


def download(repo_id: str, revision: str | None, param: str, local: str | None = None) -> str:
    """The snapshot folder of a Hub model in the cache, fetched first unless offline."""
    what = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return _snapshot(repo_id, revision, param, what)
    except HubError as exc:
        if local is None:
            raise
        raise HubError(f"{exc} (nor is there a local folder {local})") from None


def _snapshot(repo_id: str, revision: str | None, param: str, what: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=bool(offline))
    except LocalEntryNotFoundError:
        where = constants.HF_HUB_CACHE
        if offline:
            raise HubError(f"{param}: Hugging Face model {what!r} is not in the Hub cache ({where}) and "
                           f"HF_HUB_OFFLINE is set; download it first (hf download {repo_id}) "
                           f"or unset HF_HUB_OFFLINE") from None
        raise HubError(f"{param}: Hugging Face model {what!r} is not in the Hub cache ({where}) and the Hub "
                       f"cannot be reached; check the network or pre-fill the cache") from None
    except RevisionNotFoundError:
        raise HubError(f"{param}: revision {revision!r} of Hugging Face model {repo_id!r} does not exist") from None
    except GatedRepoError:
        raise HubError(f"{param}: Hugging Face model {repo_id!r} is gated; set HF_TOKEN to an account with "
                       f"access") from None
    except RepositoryNotFoundError:
        raise HubError(f"{param}: {what!r} is neither a local folder nor a Hugging Face model id the Hub "
                       f"knows (private models need HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as exc:
        raise HubError(f"{param}: could not fetch Hugging Face model {what!r}: {exc}") from None
