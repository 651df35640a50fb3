"""The errors the engine raises to its callers; each front end maps them to a status."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request was rejected before it touched the engine's state.

    `field` names the offending input (e.g. ``"top_p"``, ``"prompt_token_ids"``) so that
    front ends can map it to a precise client error (gRPC ``INVALID_ARGUMENT``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # picklable across processes (Ray replicas raise it to the proxy)
        return type(self), (self.field, self.message)


class QueueFullError(RuntimeError):
    """The admission queue is full: retry later or elsewhere (gRPC ``RESOURCE_EXHAUSTED``)."""

    def __init__(self, waiting: int, limit: int, what: str = "requests",
                 setting: str = "max_waiting_requests") -> None:
        super().__init__(f"admission queue full: {waiting} {what} waiting "
                         f"({setting}={limit}); retry later")
        self.waiting = waiting
        self.limit = limit
        self.what = what
        self.setting = setting

    def __reduce__(self):
        return type(self), (self.waiting, self.limit, self.what, self.setting)


class EngineShutdownError(RuntimeError):
    """The engine is shutting down: no new requests, running ones end (gRPC ``UNAVAILABLE``)."""

    def __init__(self, message: str = "engine is shutting down; retry on another replica") -> None:
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self),)


class EngineDeadError(EngineShutdownError):
    """The step loop died: this engine serves nothing more. An EngineShutdownError, so front
    ends answer UNAVAILABLE (retry on another replica) while Serve replaces this one."""

    def __init__(self, message: str = "the engine's step loop died; retry on another replica"
                 ) -> None:
        super().__init__(message)

    @classmethod
    def caused_by(cls, cause: BaseException) -> EngineDeadError:
        error = cls(f"the engine's step loop died ({type(cause).__name__}: {cause}); "
                    "retry on another replica")
        error.__cause__ = cause
        return error


class ModelNotFoundError(FileNotFoundError):
    """No model directory, .gguf file or hub id by that name: a user's typo, said in one line
    by the front ends (the CLI exits 2) instead of the hub client's traceback."""

    def __init__(self, model: str, reason: str = "") -> None:
        super().__init__(f"no model directory, .gguf file or hub id named {model!r}"
                         + (f" ({reason})" if reason else ""))
        self.model = model
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.model, self.reason)


class EngineConfigError(ValueError):
    """An engine setting this model cannot run with (e.g. a tensor_parallel_size that does not
    divide its heads), found once the model's config is read: `field` names the setting, and
    the CLI says it in one line (exit 2), as it does a setting out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message

    def __reduce__(self):
        return type(self), (self.field, self.message)
