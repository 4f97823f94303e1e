"""`ddb2bt demo`: the whole product on one machine with no cloud account.

Local stack up → ProductCatalog table with a stream → a writer thread applies a
realistic stream of changes at a steady rate → the live pipeline replicates on
the FnApiRunner (in a thread, until the stream has been idle) → summary: changes
replicated, lag, a comparison of every row against DynamoDB, one row read back.

``--kinesis``: the same, read from a Kinesis data stream (docs/kinesis.md). moto
cannot link a table to Kinesis (ministack can, not used here), so the writer thread also plays DynamoDB's part:
after each batch of writes it publishes the table's new changes into a stream of
several shards in the published document shape, shuffled, some twice
(``kinesis_cdc``); the pipeline writes through the ordering
guard and the comparison ignores its clock cells, as `ddb2bt verify` does.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import uuid

from tqdm import tqdm

log = logging.getLogger("ddb2bt.demo")

DEMO_EXAMPLE = "product_catalog"
DEMO_IDLE_S = 4.0  # the pipeline ends this long after the writer is done (it holds the end till then)
PROGRESS_TICK_S = 0.25
# Why the records read differ from the changes written, by AWS emulator.
RECORDS_NOTE = {"moto": "moto emits extra records for some updates",
                "ministack": "as on AWS, a write that changes nothing makes no record"}
# --kinesis: how DynamoDB's Kinesis delivery is played (docs/kinesis.md: records of
# one item may come out of order and more than once).
# Several shards, none split: moto keeps routing puts to a split's closed parent
# (its hash range), where no reader looks once the parent is finished; AWS puts
# them in the children. The split is tested with the records put before the
# reader starts (tests/e2e/test_kinesis_source.py).
KINESIS_SHARDS = 3
KINESIS_PUMP_EVERY = 100  # changes written between two publishes (the readers wait for the writer to finish)
KINESIS_SHUFFLE_WINDOW = 25  # records shuffled together (out of order within this many)
KINESIS_DUPLICATE_SHARE = 0.1  # a tenth of the records delivered twice
KINESIS_PRECISION = "microsecond"  # what docs/kinesis.md tells users to configure


def _histogram_quantile(hist, q: float) -> float:
    """Upper bound of the bucket holding quantile q over every table (what
    Prometheus would report for ``sum by (le)``)."""
    by_le: dict = {}
    for m in hist.collect():
        for s in m.samples:
            if s.name.endswith("_bucket"):
                by_le[float(s.labels["le"])] = by_le.get(float(s.labels["le"]), 0.0) + s.value
    buckets = sorted(by_le.items())
    total = buckets[-1][1] if buckets else 0
    for le, count in buckets:
        if total and count >= q * total:
            return le
    return float("nan")


def run_demo(args) -> int:
    import os

    from ddb2bt.pipeline.local import local_stack
    from ddb2bt.pipeline.clients.bigtable.admin import ensure_mapping_table
    from ddb2bt.pipeline.clients.bigtable.reads import read_table
    from ddb2bt.pipeline.services.jobs import start_metrics_server
    from ddb2bt.pipeline.verify.compare import diff_layout, expected_layout, without_clocks
    from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec, StreamsClientFactory, dynamodb_client
    from ddb2bt.pipeline.graph import LiveJob, add_live_replication, make_pipeline
    from ddb2bt.pipeline.observe.metrics import counter_total as _counter_total, default_metrics
    from ddb2bt.pipeline.connect.preflight import ensure_state_table
    from ddb2bt.pipeline.source.stream_source import ReaderOptions, hold_idle_end, release_idle_end
    from ddb2bt.pipeline.local import workload
    from ddb2bt.pipeline.local.examples import example_path
    from ddb2bt.transforms.config import load_mapping
    from ddb2bt.transforms.encoding import decode

    kinesis = getattr(args, "kinesis", False)
    mapping = load_mapping(example_path(DEMO_EXAMPLE))
    if kinesis:
        mapping = _with_kinesis(mapping)
    with local_stack.LocalStack(log_dir=local_stack.state_dir() / "logs") as stack:
        stack.apply_env()
        print(f"local stack: Bigtable emulator {os.environ['BIGTABLE_EMULATOR_HOST']}, "
              f"DynamoDB ({stack.dynamodb}) {os.environ['AWS_ENDPOINT_URL_DYNAMODB']}")
        metrics = default_metrics()
        url = start_metrics_server(None if args.metrics_port < 0 else args.metrics_port, args.metrics_host)
        if url:
            print(f"metrics: {url}")
        ddb = dynamodb_client()
        stream_arn = workload.create_table(ddb, mapping.source.table)
        ensure_mapping_table(mapping)
        ensure_state_table(mapping.target.project, mapping.target.instance, "ddb2bt_state")
        print(f"created DynamoDB table {mapping.source.table} (stream NEW_AND_OLD_IMAGES) and Bigtable table "
              f"{mapping.target.table}")
        pump = _KinesisPump(mapping, stream_arn) if kinesis else None
        if pump is not None:
            print(f"created Kinesis stream {pump.stream} ({KINESIS_SHARDS} shards); the "
                  "table's changes reach it shuffled and some twice, as Kinesis may deliver them")

        written = [0]
        idle_token = f"demo-{uuid.uuid4().hex}"
        hold_idle_end(idle_token)  # released when the writer is done
        writer_done = threading.Event()
        writer_error: list = []

        def writer() -> None:
            interval = 1.0 / args.rate if args.rate > 0 else 0
            next_at = time.monotonic()
            try:
                for i, op in enumerate(workload.operations(args.seed, args.changes, args.items)):
                    if workload.apply_quietly(ddb, mapping.source.table, op):
                        written[0] += 1
                    if pump is not None and i % KINESIS_PUMP_EVERY == KINESIS_PUMP_EVERY - 1:
                        pump.publish()
                    next_at += interval
                    time.sleep(max(0.0, next_at - time.monotonic()))
                if pump is not None:
                    pump.publish()
            except Exception as exc:  # shown in the summary; the pipeline still drains what was written
                writer_error.append(exc)
            finally:
                writer_done.set()
                # From here the readers may end after DEMO_IDLE_S of quiet: not before,
                # however long the writer paused (a loaded machine, a slow emulator).
                release_idle_end(idle_token)

        job = LiveJob(
            mapping=mapping, stream_arn=stream_arn,
            reader=ReaderOptions(until_idle_s=DEMO_IDLE_S, poll_interval_s=0.2,
                                 discovery_interval_s=5.0, stop_token=idle_token),
            state=StateSpec(BigtableSpec(mapping.target.project, mapping.target.instance), job="demo"),
            client_factory=StreamsClientFactory(),
        )
        if pump is not None:  # read the Kinesis stream, write through the ordering guard (docs/design.md §10)
            job = pump.job(job)
        pipeline_error: list = []

        def run_pipeline() -> None:
            try:
                p = make_pipeline([])
                add_live_replication(p, job)
                p.run().wait_until_finish()
            except Exception as exc:
                pipeline_error.append(exc)

        started = time.monotonic()
        threading.Thread(target=writer, name="writer", daemon=True).start()
        runner = threading.Thread(target=run_pipeline, name="pipeline", daemon=True)
        runner.start()
        max_lag = 0.0
        # On a terminal the bar redraws; in logs (CI) a plain line now and then instead.
        from ddb2bt.pipeline.observe.progress import PLAIN_PROGRESS_EVERY_S

        tty = sys.stderr.isatty()
        last_line = time.monotonic()
        with tqdm(total=args.changes, unit="chg", desc="replicated", dynamic_ncols=True,
                  mininterval=0.5, file=sys.stderr, disable=not tty) as bar:
            while runner.is_alive():
                if not tty and time.monotonic() - last_line >= PLAIN_PROGRESS_EVERY_S:
                    last_line = time.monotonic()
                    print(f"replicated {bar.n} of {written[0]} written changes, lag "
                          f"{metrics.lag.max_lag_seconds():.2f}s", file=sys.stderr, flush=True)
                applied = int(_counter_total(metrics.changes_applied) + _counter_total(metrics.changes_skipped)
                              + _counter_total(metrics.dead_letters))
                lag = metrics.lag.max_lag_seconds()
                max_lag = max(max_lag, lag)
                bar.total = max(written[0], applied, 1)
                bar.n = applied
                bar.set_postfix(written=written[0], lag=f"{lag:.2f}s")
                bar.update(0)
                runner.join(PROGRESS_TICK_S)
        elapsed = time.monotonic() - started
        if pipeline_error:
            print(f"pipeline failed: {pipeline_error[0]}")
            return 1

        items = workload.scan_all(ddb, mapping.source.table)
        actual = read_table(mapping.target.project, mapping.target.instance, mapping.target.table)
        if pump is not None:  # the guard's clock cells are not the mapping's: compared as verify does
            actual = without_clocks(actual)
        diff = diff_layout(expected_layout(mapping, items)[mapping.target.table], actual)
        applied = int(_counter_total(metrics.changes_applied))
        dead = int(_counter_total(metrics.dead_letters))
        read = int(_counter_total(metrics.changes_read))
        print()
        print("summary")
        print(f"  changes written to DynamoDB   {written[0]}" + (f"  (writer stopped: {writer_error[0]})" if writer_error else ""))
        if pump is not None:
            print(f"  Kinesis records published     {pump.published}   (the table's {pump.records} stream records, "
                  f"shuffled within {KINESIS_SHUFFLE_WINDOW}, about {KINESIS_DUPLICATE_SHARE:.0%} twice, over "
                  f"{pump.shards()} shards)")
            print(f"  ordering guard                {_guard_outcomes(metrics)}")
        print(f"  stream records read           {read}   "
              + ("(the duplicates included)" if pump is not None else f"({RECORDS_NOTE[stack.dynamodb]})"))
        print(f"  changes applied to Bigtable   {applied}   dead letters {dead}")
        print(f"  elapsed                       {elapsed:.1f}s (including {DEMO_IDLE_S:.0f}s idle wait at the end)")
        print(f"  end-to-end lag p50 ≤ {_histogram_quantile(metrics.end_to_end_lag, 0.5)}s, "
              f"p99 ≤ {_histogram_quantile(metrics.end_to_end_lag, 0.99)}s; max shard lag seen {max_lag:.2f}s")
        print(f"  items in DynamoDB {len(items)}, rows in Bigtable {len(actual)}: "
              + ("IDENTICAL" if diff.identical else f"DIFFERENT ({diff.summary()})"))
        if items:
            sample = sorted(actual)[0]
            print(f"  row {sample.decode('utf-8', 'replace')!r}:")
            rule = mapping.rules[0]
            for (family, qualifier), versions in sorted(actual[sample].items()):
                column = rule.column_for(qualifier.decode())
                encoding = column.encoding if column else rule.other.encoding
                value = versions[0][1]
                text = shown_value(value if encoding == "auto" else decode(encoding, value))
                print(f"    {family}:{qualifier.decode()} = {text[:70]}{'…' if len(text) > 70 else ''}")
        return 0 if diff.identical and not writer_error else 1


def shown_value(value) -> str:
    """A cell's value as a person reads it: a number's digits, a string in
    quotes, raw bytes (encoding ``auto``) as their text, else JSON; never a
    Python repr (``{'N': '90844'}`` beside ``b'1.4'``)."""
    import base64
    import json

    from decimal import Decimal

    if isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return "0x" + bytes(value).hex()
    if isinstance(value, dict) and len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "N":
            return str(inner)
        if tag == "S":
            return json.dumps(inner, ensure_ascii=False)
        if tag == "B":
            return "base64:" + (inner if isinstance(inner, str) else base64.b64encode(inner).decode())
    return json.dumps(value, ensure_ascii=False, sort_keys=True,
                      default=lambda v: base64.b64encode(v).decode() if isinstance(v, (bytes, bytearray)) else str(v))


def _with_kinesis(mapping):
    """The demo's mapping reading a Kinesis stream named after the table."""
    from dataclasses import replace

    from ddb2bt.transforms.config import KinesisSourceConfig

    stream = f"{mapping.source.table}-cdc"
    return replace(mapping, source=replace(mapping.source, kinesis=KinesisSourceConfig(stream, KINESIS_PRECISION)))


def _guard_outcomes(metrics) -> str:
    """``applied N, stale M, ...`` from ddb2bt_ordering_guard_rows_total."""
    totals: dict = {}
    for m in metrics.ordering_guard.collect():
        for s in m.samples:
            if s.name.endswith("_total"):
                totals[s.labels["outcome"]] = totals.get(s.labels["outcome"], 0) + int(s.value)
    return ", ".join(f"{k} {v}" for k, v in sorted(totals.items())) or "no rows"


class _KinesisPump:
    """Plays DynamoDB's Kinesis delivery: the table's changes since the last
    publish, read from its DynamoDB stream, put into the Kinesis stream out of
    order and some twice."""

    def __init__(self, mapping, stream_arn: str) -> None:
        import boto3

        from ddb2bt.pipeline.connect.connections import StreamsClientFactory

        self.mapping, self.stream_arn, self.stream = mapping, stream_arn, mapping.source.kinesis.stream
        self.kinesis = boto3.client("kinesis")
        self.kinesis.create_stream(StreamName=self.stream, ShardCount=KINESIS_SHARDS)
        self.kinesis.get_waiter("stream_exists").wait(StreamName=self.stream)
        self.streams = StreamsClientFactory()()
        self._after: dict = {}
        self._last_us: dict = {}
        self._round = 0
        self.records = 0  # the table's stream records: what AWS would deliver once each
        self.published = 0

    def publish(self) -> None:
        from ddb2bt.pipeline.local.kinesis_cdc import Disorder, change_document, publish_changes, read_table_changes

        records = read_table_changes(self.streams, self.stream_arn, self._after)
        docs = [change_document(r, self.mapping.source.table, KINESIS_PRECISION, self._last_us) for r in records]
        self._round += 1
        self.records += len(docs)
        self.published += publish_changes(self.kinesis, self.stream, docs, Disorder(
            window=KINESIS_SHUFFLE_WINDOW, duplicate=KINESIS_DUPLICATE_SHARE, seed=self._round))

    def shards(self) -> int:
        return len(self.kinesis.list_shards(StreamName=self.stream)["Shards"])

    def job(self, job):
        """The demo's LiveJob reading the Kinesis stream through the guard."""
        from dataclasses import replace

        from ddb2bt.pipeline.sink.sink import SinkConfig
        from ddb2bt.pipeline.source.kinesis import KinesisClientFactory, resolve_kinesis

        source = resolve_kinesis(self.mapping, self.kinesis)
        return replace(job, stream_arn=source.stream_arn, sink=replace(job.sink or SinkConfig(), ordering_guard=True),
                       client_factory=KinesisClientFactory(self.stream, self.mapping.source.table, None,
                                                           KINESIS_PRECISION))
