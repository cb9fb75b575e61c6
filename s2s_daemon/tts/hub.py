"""What a failed hub download means, for every engine: the settings are wrong
(``CheckpointError``, exit 78) or the model cannot be had now (``ModelUnavailableError``,
exit 69, which the service manager retries). Imports neither torch nor mlx."""

from __future__ import annotations

from s2s_daemon.tts.engine import CheckpointError, EngineError, ModelUnavailableError


def hub_failure(model: str, revision: str | None, exc: Exception, *, offline: bool, cache: str) -> EngineError:
    """What a failed ``snapshot_download`` means: wrong settings (``CheckpointError``) or not now."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # The hub answers 401/404 for an id that does not exist (or that is private and no token is
    # set): retrying cannot fix a typo, so that is configuration, like a folder that is no checkpoint.
    if isinstance(exc, GatedRepoError):
        return CheckpointError(f"{model!r} is gated on the hub: accept its terms on huggingface.co and set HF_TOKEN")
    if isinstance(exc, RevisionNotFoundError):
        return CheckpointError(f"the hub has no revision {revision!r} of {model!r}")
    if isinstance(exc, RepositoryNotFoundError):
        return CheckpointError(f"the hub has no model {model!r} (or it is private and HF_TOKEN is not set)")
    if isinstance(exc, HFValidationError):
        return CheckpointError(f"{model!r} is not a valid hub id: {exc}")
    if offline:
        return ModelUnavailableError(model, "offline mode is on (HF_HUB_OFFLINE=1)", offline=True, cache=cache)
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    status = getattr(getattr(cause, "response", None), "status_code", None)
    if isinstance(cause, HfHubHTTPError) and status is not None:
        return ModelUnavailableError(model, f"the hub answered HTTP {status}", cache=cache)
    detail = (str(cause).strip().splitlines() or [""])[0]
    return ModelUnavailableError(model, f"the hub cannot be reached ({type(cause).__name__}: {detail})", cache=cache)
