"""Logging set-up: text or one JSON object per line, each record tagged with the
pipeline stage it comes from."""
from __future__ import annotations

import json
import logging
import sys

log = logging.getLogger("ddb2bt")

# Logger name prefixes → the stage named in JSON logs (most specific first).
STAGES = (("ddb2bt.pipeline.source", "source"), ("ddb2bt.pipeline.sink", "sink"),
          ("ddb2bt.pipeline.clients.bigtable", "sink"),  # the Bigtable client logged as the sink before its move
          ("ddb2bt.pipeline.cutover.backfill", "backfill"), ("ddb2bt.pipeline.verify.verify", "verify"),
          ("ddb2bt.pipeline.recover.redrive", "redrive"), ("ddb2bt.pipeline.cutover", "migrate"),
          # The modules that moved out of cutover/ (issue 32) log under the stage they had there.
          ("ddb2bt.pipeline.verify", "migrate"), ("ddb2bt.pipeline.recover", "migrate"),
          ("ddb2bt.pipeline.observe.progress", "migrate"), ("ddb2bt.pipeline.control.mapping_change", "migrate"),
          ("ddb2bt.pipeline.source.exports", "migrate"), ("ddb2bt.pipeline.source.snapshot", "backfill"),
          ("ddb2bt.transforms", "mapping"), ("ddb2bt.pipeline.control.lease", "lease"),
          ("ddb2bt.pipeline.clients.retry", "retry"),
          ("ddb2bt.pipeline.local", "local"), ("ddb2bt.pipeline.app.demo", "local"),
          ("ddb2bt.pipeline.app.local_commands", "local"), ("ddb2bt.pipeline.observe.metrics", "metrics"))


def stage_of(logger: str) -> str:
    for prefix, stage in STAGES:
        if logger.startswith(prefix):
            return stage
    return "cli" if logger.startswith("ddb2bt") else "other"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the pipeline stage that logged it."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "stage": stage_of(record.name),
               "logger": record.name, "msg": record.getMessage()}
        table = getattr(record, "table", None)  # set by TableLogger
        if table:
            out["table"] = table
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TableLogger(logging.LoggerAdapter):
    """A logger for one table of a job: every line begins with ``[name]`` (the
    mapping's name, the job's state key) and JSON logs carry it as ``table``, so
    a job of several tables never logs a line that could be any of them."""

    def process(self, msg, kwargs):
        table = self.extra["table"]
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "table": table}
        return f"[{table}] {msg}", kwargs


def table_logger(logger: logging.Logger, table: str):
    """``logger`` naming ``table`` on every line (TableLogger); plain when no name."""
    return TableLogger(logger, {"table": table}) if table else logger


def setup_logging(level: str, fmt: str) -> None:
    import warnings

    # The Bigtable client warns on every connection to the emulator; say it once in our own log.
    warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Beam, gRPC and boto are chatty at INFO and may echo request details.
    for noisy in ("apache_beam", "botocore", "boto3", "urllib3", "google", "grpc", "werkzeug"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
