"""Error taxonomy: every failure is classified once, where it enters, as
retryable (try again later, the data is fine) or permanent (retrying cannot help:
dead-letter the record or stop the job).

Exceptions here pickle (Beam ships them between workers): extra attributes are
carried through ``__reduce__``.
"""
from __future__ import annotations


class Ddb2btError(Exception):
    """Base class of every error this project raises on purpose."""

    def __init__(self, message: str, **attrs: object) -> None:
        super().__init__(message)
        self.message = message
        self._attrs = attrs
        for name, value in attrs.items():
            setattr(self, name, value)

    def __reduce__(self):  # keep extra attributes across pickling
        return (_rebuild, (type(self), self.message, self._attrs))


def _rebuild(cls, message, attrs):
    return cls(message, **attrs)


class RetryableError(Ddb2btError):
    """Transient: the same operation may succeed later (throttling, UNAVAILABLE...)."""


class PermanentError(Ddb2btError):
    """Retrying cannot help: fix the input, the mapping or the environment."""


class ConfigError(PermanentError):
    """A mapping file or option is invalid. ``field`` is the path of the bad field."""

    def __init__(self, message: str, field: str = "", **attrs: object) -> None:
        full = f"{field}: {message}" if field else message
        super().__init__(full, field=field, **attrs)


class MappingError(PermanentError):
    """One record cannot be mapped. ``reason`` is a short stable code used as the
    dead-letter reason (and metric label), ``message`` says what and where."""

    def __init__(self, message: str, reason: str = "unmappable", **attrs: object) -> None:
        super().__init__(message, reason=reason, **attrs)


class ChangesLostError(PermanentError):
    """The stream no longer holds changes we have not applied (trimmed data).
    The only safe recovery is a new backfill."""


class StreamGoneError(PermanentError):
    """The stream or table was deleted or the stream disabled (a re-enabled stream
    has a new ARN and starts empty)."""


class ConfigProblems(ConfigError):
    """Every problem found in one mapping file, in one pass (``problems``: the
    ConfigErrors, each naming its field), so a user fixes them in one round."""

    def __init__(self, message: str, field: str = "", problems: tuple = (), **attrs: object) -> None:
        super().__init__(message, field, problems=tuple(problems), **attrs)

    @classmethod
    def of(cls, problems: list, origin: str) -> "ConfigProblems":
        lines = "\n".join(f"  {p}" for p in problems)
        return cls(f"{len(problems)} problems in {origin}:\n{lines}", problems=tuple(problems))
