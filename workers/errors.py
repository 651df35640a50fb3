"""The one error type the engine raises for bad input."""


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
