"""Error types users see. Each message names the field or input at fault and how to fix it."""
from __future__ import annotations

from tokenfab.model_config import ConfigError


class WeightLoadError(ValueError):
    """Missing, unexpected or mis-shaped weights in a checkpoint; the message lists them."""


class PromptTooLongError(ValueError):
    """A prompt (plus the tokens it may generate) does not fit in max_model_len."""


class UnsupportedError(ValueError):
    """A feature or combination tokenfab does not run (the message says what is supported)."""


class EngineConfigError(ValueError):
    """An engine setting that cannot work with this model or machine (max_model_len, dtype, KV pool size ...)."""


class InvalidRequestError(ValueError):
    """A request field that cannot run (wrong type, out of range, outside the vocabulary ...).

    Attributes:
        param: the request field at fault (``"top_p"``, ``"prompt"``, ``"stop_token_ids"`` ...); the HTTP server
            returns it as the ``param`` of OpenAI's error JSON with status 400.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


USER_ERRORS = (ConfigError, WeightLoadError, PromptTooLongError, UnsupportedError, EngineConfigError,
               InvalidRequestError, FileNotFoundError)


def is_user_error(e: BaseException) -> bool:
    """True when ``e`` is an input problem to report as one line (no stack trace)."""
    return isinstance(e, USER_ERRORS) or getattr(e, "user_error", False)
