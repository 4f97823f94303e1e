"""Read-only commands answer within ~30 s, even against a stopped stack.

``status``, ``dlq list`` / ``show`` and ``verify``'s set-up are run when
something is wrong, often with both services down. Probed one after the other,
each service's retries add up (DescribeTable's, then Bigtable's: 46 s). So the
services a command needs are probed first, side by side, under ONE budget;
what did not answer is named, and the command fails (or, for ``status``,
goes on without the DynamoDB side, which it can do without).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from ddb2bt.transforms.errors import PermanentError, RetryableError
from ddb2bt.pipeline.clients.bigtable.errors import BigtableUnreachable
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.clients.dynamodb import SourceTableMissing, describe_table
from ddb2bt.pipeline.clients.bigtable.channel import bigtable_endpoint, probe_bigtable
from ddb2bt.pipeline.connect.connections import dynamodb_client

__all__ = ["READ_ONLY_BUDGET_S", "ServiceUnreachable", "Reachability", "check_reachable"]

# The whole probe. With the interpreter's start-up (a few seconds on a loaded
# machine) and the command's own reads, the answer comes within the ~30 s the
# docs promise.
READ_ONLY_BUDGET_S = 20.0
PROBE_SHARE = 0.9


class ServiceUnreachable(PermanentError):
    """A service a read-only command needs did not answer within the budget."""


@dataclass(frozen=True)
class Reachability:
    """What the probe found: ``problems`` maps a service (``Bigtable (…)``,
    ``DynamoDB table T (…)``) to why it did not answer."""

    problems: dict

    @property
    def dynamodb_ok(self) -> bool:
        return not any(name.startswith("DynamoDB") for name in self.problems)


def _probe_bigtable(budget_s: float) -> None:
    probe_bigtable(budget_s)


def _probe_dynamodb(mapping, budget_s: float) -> None:
    describe_table(dynamodb_client(mapping.source.region), mapping.source.table,
                   retry=RetryPolicy(initial_s=0.2, max_backoff_s=2.0, deadline_s=budget_s), metrics_table=mapping.name)


def _dynamodb_name(mapping) -> str:
    import os

    endpoint = os.environ.get("AWS_ENDPOINT_URL_DYNAMODB") or os.environ.get("AWS_ENDPOINT_URL")
    return f"DynamoDB table {mapping.source.table} ({endpoint or mapping.source.region or 'default region'})"


def check_reachable(mappings: list, *, dynamodb: str = "required", budget_s: Optional[float] = None,
                    probes: Optional[dict] = None) -> Reachability:
    """Probe Bigtable and (``dynamodb``: "required", "optional" or "skip") each
    mapping's source table at once; wait at most ``budget_s`` for all of them.
    Raises ServiceUnreachable naming every service that did not answer, unless
    only optional ones failed (then the Reachability says which). A service that
    answers with an error (a missing table, access denied) is reachable: the
    command reports that itself. ``probes`` ({name: fn()}) replaces the real
    probes (tests)."""
    budget_s = READ_ONLY_BUDGET_S if budget_s is None else budget_s
    # The probes' own deadlines end a little before the budget, so what they
    # found (connection refused, …) is what the message says.
    inner_s = budget_s * PROBE_SHARE
    if probes is None:
        probes = {f"Bigtable ({bigtable_endpoint()})": lambda: _probe_bigtable(inner_s)}
        if dynamodb != "skip":
            for mapping in mappings:
                probes.setdefault(_dynamodb_name(mapping), lambda m=mapping: _probe_dynamodb(m, inner_s))
    problems: dict = {}
    lock = threading.Lock()

    def run(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except SourceTableMissing:
            pass  # it answered
        except (RetryableError, ServiceUnreachable, OSError) as exc:
            with lock:
                problems[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        except BigtableUnreachable as exc:
            with lock:
                problems[name] = str(exc)
        except Exception:  # noqa: BLE001 - an answer (access denied), or no credentials: not a matter of
            pass  # reachability; the command itself meets it and says so

    # Daemon threads: one that is still waiting when the budget is spent is left
    # behind (the process ends soon), never waited for.
    threads = {name: threading.Thread(target=run, args=(name, fn), name=f"probe {name}", daemon=True)
               for name, fn in probes.items()}
    for thread in threads.values():
        thread.start()
    import time

    end = time.monotonic() + budget_s
    for name, thread in threads.items():
        thread.join(max(0.0, end - time.monotonic()))
        if thread.is_alive():
            with lock:
                problems.setdefault(name, f"no answer within {budget_s:g}s")
    with lock:
        found = dict(problems)
    fatal = {n: why for n, why in found.items() if not (dynamodb == "optional" and n.startswith("DynamoDB"))}
    if fatal:
        import os

        local = "; is the local stack running? (ddb2bt local up)" if os.environ.get("BIGTABLE_EMULATOR_HOST") else ""
        raise ServiceUnreachable("cannot reach " + "; ".join(f"{n}: {why}" for n, why in sorted(found.items()))
                                 + f" (all probed at once, for at most {budget_s:g}s){local}")
    return Reachability(found)
