"""What the CLI prints of item keys and values: one policy for every command
that shows them (``verify``'s examples, ``dlq list``).

Item keys — and the row keys built from them — are as often personal data as
not (an e-mail as the partition key), and command output ends up in tickets
and CI logs. So keys are redacted unless ``--show-keys``, values unless
``--show-values`` (which shows keys too: a value without its key says
nothing). ``dlq show ID`` prints one dead letter in full by design: naming the
letter is the explicit request.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KEY_REDACTED", "Redaction"]

# Says how to see it, so nobody has to look the option up.
KEY_REDACTED = "<redacted: --show-keys>"


@dataclass(frozen=True)
class Redaction:
    show_keys: bool = False
    show_values: bool = False

    @classmethod
    def from_args(cls, args) -> "Redaction":
        show_values = bool(getattr(args, "show_values", False))
        return cls(show_keys=show_values or bool(getattr(args, "show_keys", False)), show_values=show_values)

    def key(self, text: str) -> str:
        """An item key's value or a row key, as the policy lets it be shown."""
        return text if self.show_keys else KEY_REDACTED
