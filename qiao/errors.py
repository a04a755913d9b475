"""Exceptions qiao raises to its users.

Every error names what to fix: the field, the file, or the limit. The API layer maps these to
HTTP status codes; nothing here carries a traceback to a client.
"""


class QiaoError(Exception):
    """Base class of every error qiao raises on purpose."""


class ConfigError(QiaoError, ValueError):
    """A setting or a request field is invalid. The message names the field; `param`, when
    given, is the request field a client sees it as (the API's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(QiaoError):
    """A checkpoint cannot be loaded (missing file, unsupported format or architecture)."""


class QueueFullError(QiaoError):
    """The engine's waiting queue is at its limit; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(QiaoError):
    """The engine is draining, stopped or failed; the request was not (or no longer) served."""


class EngineRestartedError(EngineUnavailableError):
    """The engine process died (or stalled and was killed) with this request in it, or is
    restarting now; retry after a moment."""


class ModelNotFoundError(QiaoError, LookupError):
    """No such model (or version) is served. The message names it."""


class QueueTimeoutError(QiaoError):
    """A request waited in a batcher queue past its timeout and was not run."""


class RequestFailedError(QiaoError):
    """The engine failed on this request (found by retrying its step in halves); it was ended
    alone and the others in its step went on. Its prompt is refused for a while after."""


class RequestTooLargeError(ConfigError):
    """The request does not fit in the engine's memory even alone."""


class CircuitOpenError(EngineUnavailableError):
    """The model version's circuit breaker is open: refused at once, without queueing."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
