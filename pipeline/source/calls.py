"""A stream reader's remote calls, under one retry policy: each counted (per
operation, labelled by the table's name in the job), boto's errors classified
(throttling and 5xx retried with jittered back-off, bounded), the table named in
what is logged, and the coordinator's lease check between attempts (no retry
loop outlives a lost lease)."""
from __future__ import annotations

from typing import Callable, Optional

from botocore.exceptions import BotoCoreError, ClientError

from ddb2bt.pipeline.clients.dynamodb import StreamThrottled, classify_aws_error, count_api_call
from ddb2bt.pipeline.clients.retry import RetryPolicy, retrying


class StreamCalls:
    """``calls(operation, fn)``: ``fn()`` run as one remote call of ``operation``."""

    def __init__(self, metrics, table: str, retry: RetryPolicy, sleep: Callable[[float], None], where: str,
                 between_attempts: Optional[Callable[[], None]] = None) -> None:
        self._metrics, self._table, self._retry = metrics, table, retry
        self._sleep, self._where, self._between_attempts = sleep, where, between_attempts

    def __call__(self, operation: str, fn: Callable):
        metrics, table = self._metrics, self._table

        def attempt():
            if metrics is not None:
                metrics.aws_api_calls.labels(operation).inc()
            else:
                count_api_call(operation, table)
            try:
                return fn()
            except (ClientError, BotoCoreError) as exc:
                raise classify_aws_error(exc, operation) from exc

        def count(exc: BaseException) -> None:
            if metrics and isinstance(exc, StreamThrottled):
                metrics.dynamodb_throttles.labels(operation).inc()

        # The table in the label: a job of several tables logs which one is failing.
        return retrying(self._retry, f"{operation} of {table}", count, self._sleep, retry_on=(StreamThrottled,),
                        where=self._where, between_attempts=self._between_attempts)(attempt)
