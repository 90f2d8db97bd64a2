"""Whether a Hugging Face Hub dataset can be streamed from this machine, asked before a run starts.

Hub sources are streamed (data/sources.py): nothing of them is on disk, so a
run needs the Hub for as long as it reads the corpus. Finding out when the
data is first read would come after the run directory is taken (and, under
`--plan auto`, after minutes of compiles); `hub_unreachable_reason` answers
up front with one metadata request and no data:

* `HF_HUB_OFFLINE` or `HF_DATASETS_OFFLINE` set: offline by the user's
  choice; nothing is sent.
* otherwise `HfApi.dataset_info` with a short timeout: a connection failure,
  an unknown repository and a gated one (needs a token and its terms
  accepted) each come back as a reason in words.
"""

from __future__ import annotations

import os

from .sources import HubSpec

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = ("1", "true", "yes", "on")


def offline_variable() -> str | None:
    """The environment variable that puts this process offline for the Hub (read now, not at import), or None."""
    return next((name for name in OFFLINE_VARIABLES if os.environ.get(name, "").strip().lower() in _TRUE), None)


def hub_unreachable_reason(hub: HubSpec, *, timeout_s: float = 10.0) -> str | None:
    """Why `hub` cannot be streamed from here (a short phrase), or None when the Hub answers for it."""
    variable = offline_variable()
    if variable is not None:
        return f"{variable} is set, so the Hub is not asked"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(hub.repo_id, timeout=timeout_s)
    except GatedRepoError:
        return (f"{hub.repo_id} is gated: accept its terms on the Hub and log in (`hf auth login`) "
                f"on this machine")
    except RepositoryNotFoundError:
        return f"the Hub has no dataset {hub.repo_id} (or it is private)"
    except Exception as error:   # connection refused, no DNS, timeout, proxy: all mean "not from here"
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        return f"the Hub cannot be reached ({reason})"
    return None


LOCAL_CORPUS = "a folder of the dataset's .parquet, .jsonl or .txt files"


def local_copy_advice(hub: HubSpec, fix: str) -> str:
    """What to do instead of streaming `hub` from here: `fix` names the setting or flag that takes the copy."""
    return (f"point it at a local copy with {fix} ({LOCAL_CORPUS}; fetch them where there is a network with "
            f"`hf download {hub.repo_id} --repo-type dataset --local-dir DIR`)")
