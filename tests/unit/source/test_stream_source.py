"""The stream reader's lineage, checkpoint and fault logic over the fake stream."""
import pytest
from prometheus_client import CollectorRegistry

from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable, client_error
from ddb2bt.pipeline.observe.metrics import PipelineMetrics
from ddb2bt.pipeline.clients.retry import RetryPolicy
from ddb2bt.pipeline.control.state import ShardCheckpoint, StateStore
from ddb2bt.pipeline.source.stream_sdf import PartitionTracker
from ddb2bt.pipeline.source.stream_source import (
    LocalTracker, PartitionReader, PartitionRestriction, ReaderOptions, StreamPartition,
    drain, drain_round, plan_starts,
)
from ddb2bt.pipeline.clients.dynamodb import Listing
from ddb2bt.transforms.errors import ChangesLostError, StreamGoneError
from ddb2bt.transforms.model import ChangeRecord, ShardClosed

FAST = RetryPolicy(initial_s=0.001, max_backoff_s=0.002, deadline_s=5.0)


class Clock:
    def __init__(self):
        self.ms = 1_000_000

    def __call__(self):
        return self.ms


def setup(options=None, partitions=1, index=0, client=None):
    client = client or FakeStreamsClient()
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    metrics = PipelineMetrics(CollectorRegistry())
    clock = Clock()
    opts = options or ReaderOptions(retry=FAST, discovery_interval_s=0)
    reader = PartitionReader(client, StreamPartition(client.stream_arn, index, partitions), opts,
                             state.load_checkpoints, metrics, now_ms=clock, sleep=lambda s: None)
    return client, state, metrics, reader, clock


def put(client, shard, n, start=0):
    return [client.put(shard, "INSERT", {"pk": {"S": f"k{start + i}"}}, {"pk": {"S": f"k{start + i}"}})
            for i in range(n)]


def records(elements):
    return [e for e in elements if isinstance(e, ChangeRecord)]


def seqs(elements):
    return [e.position.sequence_number for e in records(elements)]


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def test_child_shards_wait_for_the_parent_to_be_recorded_finished():
    client, state, _, reader, _ = setup()
    client.add_shard("p")
    parent_seqs = put(client, "p", 3)
    c1, c2 = client.split("p", "c1", "c2")
    child_seqs = put(client, "c1", 2, 10) + put(client, "c2", 1, 20)
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    assert seqs(out) == parent_seqs  # children not started: parent not finished yet
    assert isinstance(out[-1], ShardClosed) and out[-1].last_sequence_number == parent_seqs[-1]
    assert sorted(reader.waiting) == ["c1", "c2"]
    out, _ = drain_round(reader, tracker)
    assert records(out) == []  # still waiting: the sink has not recorded the parent finished
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "p", parent_seqs[-1], finished=True)])
    out, _ = drain_round(reader, tracker)
    assert sorted(seqs(out)) == sorted(child_seqs)


def test_child_of_a_parent_gone_from_the_stream_starts_at_once():
    client, _, _, reader, _ = setup()
    client.add_shard("old").listed = False
    client.add_shard("child", parent_id="old")
    s = put(client, "child", 2)
    out, _ = drain_round(reader, LocalTracker())
    assert seqs(out) == s


def test_parent_and_children_in_one_listing_with_pagination():
    client, state, _, reader, _ = setup(client=FakeStreamsClient(describe_page=2))
    for root in ("a", "b", "c"):
        client.add_shard(root)
        put(client, root, 1)
    client.split("a", "a1")
    put(client, "a1", 1)
    out, _ = drain_round(reader, LocalTracker())
    assert {r.position.shard_id for r in records(out)} == {"a", "b", "c"}
    assert client.calls.count("DescribeStream") == 2


def test_every_shard_belongs_to_exactly_one_partition():
    ids = [f"shardId-{i:08d}-{'x' * 8}" for i in range(200)]
    owners = [[i for i in range(3) if StreamPartition("arn", i, 3).owns(s)] for s in ids]
    assert all(len(o) == 1 for o in owners)
    assert {o[0] for o in owners} == {0, 1, 2}


def test_resume_after_checkpoint_uses_after_sequence_number():
    client, state, _, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", 5)
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[1])])
    out, _ = drain_round(reader, LocalTracker())
    assert seqs(out) == s[2:]


def test_finished_shard_in_the_state_table_is_not_read_again():
    client, state, _, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", 2)
    client.close_shard("s")
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[-1], finished=True)])
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    # Not read, and not remembered in the restriction either: the state table records it.
    assert out == [] and tracker.current_restriction().closed == frozenset()
    assert tracker.current_restriction().positions == ()


def test_the_restriction_keeps_only_the_closed_shards_the_state_table_does_not_record():
    """A table with thousands of closed shards: the restriction (committed every
    round) remembers a closed shard only until the sink records it finished."""
    client, state, _, reader, _ = setup()
    finished = [f"old-{i:04d}" for i in range(2000)]
    for shard in finished:
        client.add_shard(shard)
        client.close_shard(shard)
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, shard, "1", finished=True) for shard in finished])
    client.add_shard("s")
    s = put(client, "s", 2)
    client.close_shard("s")
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    assert seqs(out) == s and any(isinstance(e, ShardClosed) for e in out)
    assert tracker.current_restriction().closed == {"s"}, "read to its end, not yet recorded finished"
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[-1], finished=True)])  # the sink's record
    out, _ = drain_round(reader, tracker)
    assert out == [] and tracker.current_restriction().closed == frozenset()
    out, _ = drain_round(reader, tracker)
    assert out == [], "and never read again"


def test_start_latest_skips_existing_records_only_on_the_first_discovery():
    client, _, _, reader, _ = setup(ReaderOptions(start="latest", retry=FAST, discovery_interval_s=0))
    client.add_shard("s")
    put(client, "s", 3)
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    assert records(out) == []
    new = put(client, "s", 2, 100)
    out, _ = drain_round(reader, tracker)
    assert seqs(out) == new


def test_expired_iterator_is_renewed_from_the_last_position():
    client, _, metrics, reader, _ = setup()
    client.page_size = 2
    client.add_shard("s")
    s = put(client, "s", 5)
    tracker = LocalTracker()
    first, _ = drain_round(reader, tracker)
    client.expire_iterators()
    rest = []
    for _ in range(3):
        out, _ = drain_round(reader, tracker)
        rest += out
    assert seqs(first) + seqs(rest) == s  # nothing lost, nothing twice
    assert sample(metrics, "ddb2bt_iterator_refreshes_total", table="Fake") == 1


def test_throttling_and_server_errors_back_off_and_are_counted():
    client, _, metrics, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", 2)
    client.faults = [None, None,  # DescribeStream, GetShardIterator succeed
                     client_error("LimitExceededException"), client_error("ProvisionedThroughputExceededException"),
                     client_error("InternalServerError", status=500)]
    out, _ = drain_round(reader, LocalTracker())
    assert seqs(out) == s
    assert sample(metrics, "ddb2bt_dynamodb_throttles_total", table="Fake", operation="GetRecords") == 3


def test_throttling_beyond_the_deadline_fails():
    client, _, _, reader, _ = setup(ReaderOptions(retry=RetryPolicy(0.001, 0.001, 0.05), discovery_interval_s=0))
    client.add_shard("s")
    client.faults = [client_error("LimitExceededException", operation="DescribeStream")] * 10_000
    with pytest.raises(Exception, match="LimitExceededException"):
        drain_round(reader, LocalTracker())


def test_trimmed_checkpoint_stops_loudly_with_recovery_instructions():
    client, state, _, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", 4)
    client.shards["s"].trimmed_before = 3
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[0])])
    with pytest.raises(ChangesLostError) as err:
        drain_round(reader, LocalTracker())
    assert "LOST" in str(err.value) and "--on-trimmed=restart" in str(err.value)
    assert "ddb2bt migrate --restart" in str(err.value)  # a command that copies the table again


def test_trimmed_with_restart_continues_from_the_oldest_record_and_counts_it():
    client, state, metrics, reader, _ = setup(ReaderOptions(on_trimmed="restart", retry=FAST, discovery_interval_s=0))
    client.add_shard("s")
    s = put(client, "s", 4)
    client.shards["s"].trimmed_before = 3
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[0])])
    out, _ = drain_round(reader, LocalTracker())
    assert seqs(out) == s[3:]
    assert sample(metrics, "ddb2bt_trimmed_restarts_total", table="Fake") == 1


def _quiet_shard_seen_at_head(options=None):
    """A job that applied a quiet shard's records, then polled it at its head
    for a while (docs/design.md §7.8), and recorded what it saw as its readers do."""
    client, state, metrics, reader, clock = setup(options)
    reader = PartitionReader(client, StreamPartition(client.stream_arn, 0, 1), reader._options, state.load_checkpoints,
                             metrics, now_ms=clock, sleep=lambda s: None, load_heads=state.load_shard_heads)
    client.add_shard("s")
    s = put(client, "s", 3)
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    assert seqs(out) == s
    # The sink applies and checkpoints them (sink/batching.py: checkpoint, then on_applied).
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[-1])])
    metrics.lag.on_applied(client.stream_arn, "s", None, 3)
    for _ in range(5):  # empty pages, 1.5 s apart: at the head after 3 s
        clock.ms += 1500
        drain_round(reader, tracker)
    state.save_reader_report(client.stream_arn, "0-1", reader.pending_since(), ended=True, heads=reader.heads())
    return client, state, metrics, s


def _restart(client, state, metrics, clock_ms, options=None):
    clock = Clock()
    clock.ms = clock_ms
    opts = options or ReaderOptions(retry=FAST, discovery_interval_s=0)
    return PartitionReader(client, StreamPartition(client.stream_arn, 0, 1), opts, state.load_checkpoints, metrics,
                           now_ms=clock, sleep=lambda s: None, load_heads=state.load_shard_heads)


def test_a_trimmed_checkpoint_is_lost_when_the_oldest_record_left_is_newer_than_the_last_head_sighting():
    """The stream trimmed past the sighting (as `ddb2bt local trim`, a replaced
    stream or a clock off by hours can): the records after the checkpoint that
    were created before the oldest one left may be gone, however recent the
    sighting. LOST, naming recover."""
    from ddb2bt.pipeline.clients.dynamodb import STREAM_RETENTION_MS
    from ddb2bt.pipeline.source.heads import HEAD_PROOF_MARGIN_S

    client, state, metrics, s = _quiet_shard_seen_at_head()
    head_ms = state.load_shard_heads(client.stream_arn)["s"]
    client.put("s", "INSERT", {"pk": {"S": "gone"}}, created_ms=head_ms + 30_000)  # written while the job is down
    put_at(client, "s", head_ms + 60_000, 2)
    client.shards["s"].trimmed_before = 4  # the checkpoint and the change after it: trimmed
    reader = _restart(client, state, metrics, head_ms + STREAM_RETENTION_MS - HEAD_PROOF_MARGIN_S * 1000 - 1)
    with pytest.raises(ChangesLostError) as err:
        drain_round(reader, LocalTracker())
    assert "LOST" in str(err.value) and "ddb2bt recover" in str(err.value)
    assert "the oldest record the shard still holds is +60 s from it" in str(err.value)


def test_a_trimmed_checkpoint_is_lost_when_the_shard_holds_no_record():
    client, state, metrics, s = _quiet_shard_seen_at_head()
    head_ms = state.load_shard_heads(client.stream_arn)["s"]
    client.shards["s"].trimmed_before = 3  # everything aged out: whatever came after the sighting too
    with pytest.raises(ChangesLostError) as err:
        drain_round(_restart(client, state, metrics, head_ms + 60_000), LocalTracker())
    assert "the shard holds no record now" in str(err.value)


def test_a_trimmed_checkpoint_resumes_when_the_stream_still_holds_a_record_from_before_the_sighting():
    client, state, metrics, s = _quiet_shard_seen_at_head()
    head_ms = state.load_shard_heads(client.stream_arn)["s"]
    # A checkpoint behind what was applied at the sighting: its record aged out,
    # the next one (created before the sighting) is still held, so nothing after
    # the sighting was trimmed.
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[0])])
    client.shards["s"].records[1]["dynamodb"]["ApproximateCreationDateTime"] = _utc(head_ms - 60_000)
    later = put_at(client, "s", head_ms + 60_000, 2)
    client.shards["s"].trimmed_before = 1
    out, _ = drain_round(_restart(client, state, metrics, head_ms + 120_000), LocalTracker())
    assert seqs(out) == s[1:] + later  # from the oldest record held: nothing skipped
    assert sample(metrics, "ddb2bt_trimmed_restarts_total", table="Fake") == 0  # nothing lost


def _utc(ms):
    import datetime as dt
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)


def put_at(client, shard, created_ms, n):
    return [client.put(shard, "INSERT", {"pk": {"S": f"t{created_ms}-{i}"}}, {"pk": {"S": f"t{created_ms}-{i}"}},
                       created_ms=created_ms + i) for i in range(n)]


def test_a_trimmed_checkpoint_is_lost_when_the_head_was_seen_too_long_ago():
    from ddb2bt.pipeline.clients.dynamodb import STREAM_RETENTION_MS
    from ddb2bt.pipeline.source.heads import HEAD_PROOF_MARGIN_S

    client, state, metrics, s = _quiet_shard_seen_at_head()
    head_ms = state.load_shard_heads(client.stream_arn)["s"]
    client.shards["s"].trimmed_before = 3
    reader = _restart(client, state, metrics, head_ms + STREAM_RETENTION_MS - HEAD_PROOF_MARGIN_S * 1000)
    with pytest.raises(ChangesLostError) as err:
        drain_round(reader, LocalTracker())
    assert "LOST" in str(err.value) and "at its head 23.0 h ago" in str(err.value)


def test_one_empty_page_is_not_the_head_and_proves_nothing():
    client, state, metrics, reader, clock = setup()
    reader = PartitionReader(client, StreamPartition(client.stream_arn, 0, 1), reader._options, state.load_checkpoints,
                             metrics, now_ms=clock, sleep=lambda s: None, load_heads=state.load_shard_heads)
    client.add_shard("s")
    s = put(client, "s", 3)
    tracker = LocalTracker()
    drain_round(reader, tracker)
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", s[-1])])
    metrics.lag.on_applied(client.stream_arn, "s", None, 3)
    clock.ms += 10_000
    drain_round(reader, tracker)  # one empty page, however long after
    clock.ms += 1_000
    drain_round(reader, tracker)  # two
    assert reader.heads() == {}
    state.save_reader_report(client.stream_arn, "0-1", reader.pending_since(), heads=reader.heads())
    client.shards["s"].trimmed_before = 3
    with pytest.raises(ChangesLostError):
        drain_round(_restart(client, state, metrics, clock.ms + 1_000), LocalTracker())


def test_records_read_and_not_yet_applied_keep_the_head_unproven():
    client, state, metrics, reader, clock = setup()
    client.add_shard("s")
    put(client, "s", 3)
    tracker = LocalTracker()
    drain_round(reader, tracker)  # read, never applied (no sink)
    for _ in range(5):
        clock.ms += 1500
        drain_round(reader, tracker)
    assert reader.heads() == {}
    metrics.lag.on_applied(client.stream_arn, "s", None, 3)
    for _ in range(3):
        clock.ms += 1500
        drain_round(reader, tracker)
    assert set(reader.heads()) == {"s"}


def test_deleted_stream_is_reported():
    client, _, _, _, _ = setup()
    other = FakeStreamsClient(table="Other")
    reader = PartitionReader(other, StreamPartition(client.stream_arn, 0, 1), ReaderOptions(retry=FAST),
                             lambda *_: {}, None, sleep=lambda s: None)
    with pytest.raises(StreamGoneError):
        drain_round(reader, LocalTracker())


def test_until_idle_ends_only_after_the_idle_period_with_nothing_waiting():
    client, _, _, reader, clock = setup(ReaderOptions(until_idle_s=2, retry=FAST, discovery_interval_s=0))
    client.add_shard("s")
    put(client, "s", 1)
    tracker = LocalTracker()
    _, result = drain_round(reader, tracker)
    assert reader.idle_decision(tracker, result) == "continue"
    _, result = drain_round(reader, tracker)  # at head
    assert reader.idle_decision(tracker, result) == "poll"
    clock.ms += 1500
    _, result = drain_round(reader, tracker)
    assert reader.idle_decision(tracker, result) == "poll"
    clock.ms += 600
    _, result = drain_round(reader, tracker)
    assert reader.idle_decision(tracker, result) == "end"


def test_checkpoint_split_resumes_right_after_the_last_claimed_record():
    """A page is claimed whole, up to its last record, before any of it is
    emitted: a split while the page is being emitted lets the rest of the claimed
    page out, and stops the next page's claim; the residual resumes right after
    the last record emitted, so nothing is lost or read twice."""
    from ddb2bt.pipeline.source.stream_source import GET_RECORDS_LIMIT

    client, _, _, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", GET_RECORDS_LIMIT + 6)  # a full page, then 6 more
    tracker = PartitionTracker(PartitionRestriction())
    gen = reader.read_round(tracker)
    emitted = [next(gen) for _ in range(2)]
    primary, residual = tracker.try_split(0)
    assert primary.done and not residual.done
    assert dict(residual.positions)["s"].after == s[GET_RECORDS_LIMIT - 1]  # the claimed page's last record
    emitted += list(gen)  # the rest of the claimed page; the next page's claim fails: the round stops
    assert seqs(emitted) == s[:GET_RECORDS_LIMIT]
    tracker.check_done()
    reader2 = setup(client=client)[3]
    out, _ = drain_round(reader2, LocalTracker(residual))
    assert seqs(emitted) + seqs(out) == s


def test_a_split_while_a_page_goes_out_spends_no_get_records_on_the_next_page():
    """After a split the rest belongs to the residual: the round stops before
    another GetRecords, whose page could not be claimed and whose call would be
    one of the shard's 5 per second spent for nothing."""
    from ddb2bt.pipeline.source.stream_source import GET_RECORDS_LIMIT

    client, _, _, reader, _ = setup()
    client.add_shard("s")
    put(client, "s", 2 * GET_RECORDS_LIMIT + 6)  # two full pages, then 6 more
    calls = []
    real = client.get_records
    client.get_records = lambda **kw: calls.append(kw["ShardIterator"]) or real(**kw)
    tracker = PartitionTracker(PartitionRestriction())
    gen = reader.read_round(tracker)
    [next(gen) for _ in range(2)]
    assert tracker.try_split(0) is not None
    list(gen)
    assert len(calls) == 1


def test_a_page_is_one_claim():
    """One claim per GetRecords page, naming its last record (the tracker's lock
    and the restriction's copy once per page, not once per record)."""
    from ddb2bt.pipeline.source.stream_source import GET_RECORDS_LIMIT, ClaimRecord

    client, _, metrics, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", GET_RECORDS_LIMIT + 6)
    tracker = LocalTracker()
    out, _ = drain_round(reader, tracker)
    assert seqs(out) == s
    record_claims = [c for c in tracker.claims if isinstance(c, ClaimRecord)]
    assert [c.sequence_number for c in record_claims] == [s[GET_RECORDS_LIMIT - 1], s[-1]]
    assert sample(metrics, "ddb2bt_changes_read_total", table="Fake", event="INSERT") == len(s)


def test_only_checkpoint_splits_are_allowed():
    tracker = PartitionTracker(PartitionRestriction())
    assert tracker.try_split(0.5) is None
    with pytest.raises(ValueError):
        tracker.check_done()


def test_plan_starts_is_pure_lineage_planning():
    listing = Listing({"p": None, "c": "p", "g": "c"})
    part = StreamPartition("arn", 0, 1)
    claims, waiting = plan_starts(listing, part, PartitionRestriction(), {}, "trim_horizon")
    assert [c.shard_id for c in claims] == ["p"] and waiting == ["c", "g"]
    done = {"p": ShardCheckpoint("arn", "p", "9", finished=True)}
    claims, waiting = plan_starts(listing, part, PartitionRestriction(discovered_once=True), done, "latest")
    kinds = {type(c).__name__: c for c in claims}
    assert "ClaimClosed" not in kinds, "recorded finished: nothing to remember"
    assert kinds["ClaimStart"].shard_id == "c" and kinds["ClaimStart"].pos.mode == "trim_horizon"
    assert waiting == ["g"]


def test_a_replaced_stream_is_detected_and_reported():
    from ddb2bt.pipeline.connect.preflight import check_stream_continuity
    from ddb2bt.transforms.errors import PermanentError

    client, state, _, _, _ = setup()
    state.save_checkpoints([ShardCheckpoint(client.stream_arn, "s", "1")])
    new_arn = client.stream_arn.rsplit("/", 1)[0] + "/2025-06-01T00:00:00.000"
    check_stream_continuity(state, client.stream_arn, False)  # same stream: fine
    with pytest.raises(PermanentError, match="stream was replaced.*LOST.*--new-stream"):
        check_stream_continuity(state, new_arn, False)
    check_stream_continuity(state, new_arn, True)  # acknowledged
    # ... once: the job follows the new stream from then on, even before its
    # first record is checkpointed (`migrate --restart`, then `run`).
    check_stream_continuity(state, new_arn, False)
    with pytest.raises(PermanentError, match="ddb2bt migrate --restart"):
        check_stream_continuity(state, new_arn.rsplit("/", 1)[0] + "/2025-07-01T00:00:00.000", False)


def test_vanished_stream_message_says_how_to_recover():
    client, _, _, _, _ = setup()
    other = FakeStreamsClient(table="Other")
    reader = PartitionReader(other, StreamPartition(client.stream_arn, 0, 1), ReaderOptions(retry=FAST),
                             lambda *_: {}, None, sleep=lambda s: None)
    with pytest.raises(StreamGoneError, match="re-enabled stream has a new ARN.*back-fill again"):
        drain_round(reader, LocalTracker())


def test_a_backlog_is_read_in_rounds_of_up_to_pages_per_round_full_pages():
    from ddb2bt.pipeline.source.stream_source import GET_RECORDS_LIMIT, PAGES_PER_ROUND

    client, _, _, reader, _ = setup()
    client.add_shard("a")
    client.add_shard("b")
    backlog = GET_RECORDS_LIMIT * PAGES_PER_ROUND + 5
    a = put(client, "a", backlog)
    b = put(client, "b", 3, start=backlog)
    tracker = LocalTracker()
    first, _ = drain_round(reader, tracker)
    # shard a: every full page until the round's cap; shard b: its one short page
    assert seqs([e for e in first if e.position.shard_id == "a"]) == a[:GET_RECORDS_LIMIT * PAGES_PER_ROUND]
    assert seqs([e for e in first if e.position.shard_id == "b"]) == b
    second, _ = drain_round(reader, tracker)
    assert seqs(second) == a[GET_RECORDS_LIMIT * PAGES_PER_ROUND:]
    # round 1: a reads PAGES_PER_ROUND pages, b one; round 2: a its short rest, b its empty head
    assert client.calls.count("GetRecords") == PAGES_PER_ROUND + 1 + 2


def test_records_travel_in_page_batches_with_markers_between_them_in_order():
    from ddb2bt.pipeline.source.records import batch_records
    from ddb2bt.transforms.model import RecordBatch

    client, _, _, reader, _ = setup()
    client.add_shard("a")
    a = put(client, "a", 5)
    client.close_shard("a")
    out, result = drain_round(reader, LocalTracker())  # the round as the reader yields it
    batched, returned = drain(batch_records(iter(out + ["end"]), size=2))
    assert returned is None  # the inner generator's return value passes through
    kinds = [type(e).__name__ if not isinstance(e, str) else e for e in batched]
    assert kinds == ["RecordBatch", "RecordBatch", "RecordBatch", "ShardClosed", "end"]
    assert [len(b.records) for b in batched[:3]] == [2, 2, 1]
    assert [r.position.sequence_number for b in batched[:3] for r in b.records] == a
    assert all(isinstance(b, RecordBatch) for b in batched[:3])


def test_a_split_mid_round_still_emits_the_claimed_records_as_a_batch():
    from ddb2bt.pipeline.source.records import batch_records

    client, _, _, reader, _ = setup()
    client.add_shard("s")
    client.page_size = 3  # pages of 3: the split falls inside the first
    s = put(client, "s", 6)
    tracker = PartitionTracker(PartitionRestriction())
    inner = reader.read_round(tracker)
    claimed = []

    def claims_then_split():
        for element in inner:  # split after the first page was claimed and two of it yielded
            claimed.append(element)
            if len(claimed) == 2:
                tracker.try_split(0)
            yield element
        return "round result"

    batched, returned = drain(batch_records(claims_then_split(), size=1000))
    assert returned == "round result"
    assert [r.position.sequence_number for b in batched for r in b.records] == s[:3]  # the claimed page


def test_flush_sends_the_records_so_far_and_is_not_an_element():
    from ddb2bt.pipeline.source.records import FLUSH, batch_records

    client, _, _, reader, _ = setup()
    client.add_shard("s")
    s = put(client, "s", 3)
    recs = records(drain_round(reader, LocalTracker())[0])
    out = list(batch_records(iter([recs[0], FLUSH, FLUSH, recs[1], recs[2]]), size=10))
    assert [[r.position.sequence_number for r in b.records] for b in out] == [s[:1], s[1:]]


def test_a_per_record_claim_builds_the_same_restriction_as_the_constructors():
    import pickle

    from ddb2bt.pipeline.source.stream_source import ClaimRecord, ShardPos, apply_claim

    before = PartitionRestriction(positions=(("a", ShardPos(after="1")), ("b", ShardPos(mode="latest"))),
                                  closed=frozenset({"z"}), discovered_once=True, idle_since_ms=5)
    after = apply_claim(before, ClaimRecord("b", "42"))
    expected = PartitionRestriction(positions=(("a", ShardPos(after="1")), ("b", ShardPos(after="42"))),
                                    closed=frozenset({"z"}), discovered_once=True, idle_since_ms=None)
    assert after == expected and hash(after) == hash(expected) and repr(after) == repr(expected)
    assert pickle.loads(pickle.dumps(after)) == expected
    assert dict(after.positions)["b"].iterator_args() == {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER",
                                                         "SequenceNumber": "42"}


def test_a_restarted_job_starts_shards_it_never_checkpointed_at_trim_horizon():
    """A restarted job (not fresh: it has state) reads a shard it never
    checkpointed (a quiet one, or one born while it was down) from the oldest
    record, whatever --start said at its first launch: the changes written
    while it was down are not skipped."""
    listing = Listing({"quiet": None})
    part = StreamPartition("arn", 0, 1)
    (claim,), _ = plan_starts(listing, part, PartitionRestriction(), {}, "latest", fresh=True)
    assert claim.pos.mode == "latest"  # a fresh job: --start applies to its first discovery
    (claim,), _ = plan_starts(listing, part, PartitionRestriction(), {}, "latest", fresh=False)
    assert claim.pos.mode == "trim_horizon"
    client, _, _, reader, _ = setup(ReaderOptions(start="latest", fresh=False, retry=FAST, discovery_interval_s=0))
    client.add_shard("quiet")
    written_while_down = put(client, "quiet", 3)
    out, _ = drain_round(reader, LocalTracker())
    assert seqs(out) == written_while_down


def test_the_start_is_recorded_once_and_latest_is_refused_on_a_job_with_state():
    from ddb2bt.pipeline.connect.preflight import START_MARGIN_MS, settle_start
    from ddb2bt.transforms.errors import ConfigError

    arn = "arn:aws:dynamodb:r:1:table/T/stream/2024"
    state = StateStore(InMemoryBigtable(), "job", lambda: 1)
    first = settle_start(state, arn, "latest", now_ms=5_000_000)
    assert first.fresh and first.mode == "latest"
    with pytest.raises(ConfigError, match="--start.*already run.*TRIM_HORIZON"):
        settle_start(state, arn, "latest", now_ms=6_000_000)
    again = settle_start(state, arn, "trim_horizon", now_ms=6_000_000)
    assert not again.fresh and again.kinesis_from_ms is None  # DynamoDB Streams: TRIM_HORIZON
    kinesis = settle_start(state, arn, "trim_horizon", now_ms=6_000_000, kinesis=True)
    assert kinesis.kinesis_from_ms == 5_000_000 - START_MARGIN_MS  # Kinesis: just before its first start
    # Checkpoints alone (a job from before starts were recorded) make it a restart too.
    other = StateStore(InMemoryBigtable(), "job", lambda: 1)
    other.save_checkpoints([ShardCheckpoint(arn, "s", "7")])
    with pytest.raises(ConfigError, match="--start"):
        settle_start(other, arn, "latest", now_ms=1)
    assert not settle_start(other, arn, "trim_horizon", now_ms=1).fresh


def test_a_held_idle_end_keeps_the_reader_polling_and_the_wait_starts_over_on_release():
    # The demo's writer can pause longer than until_idle_s on a loaded machine; its
    # readers must not end (and the demo compare a table still being written) before
    # it is done, nor end at once on release before reading what it wrote last.
    from ddb2bt.pipeline.source.stream_source import (LocalTracker, PartitionRestriction, ReaderOptions, idle_end,
                                                      hold_idle_end, release_idle_end)

    options = ReaderOptions(until_idle_s=4.0, stop_token="demo-test")
    tracker = LocalTracker(PartitionRestriction(idle_since_ms=0))
    assert idle_end(options, 0, 4_000, False, tracker) == "end"  # nothing held: idle long enough ends
    assert idle_end(options, 0, 4_000, True, tracker) == "poll"  # a shard waits for its parent
    hold_idle_end("demo-test")
    try:
        assert idle_end(options, 0, 60_000, False, tracker) == "poll"
        assert tracker.current_restriction().idle_since_ms == 60_000  # the wait starts over
    finally:
        release_idle_end("demo-test")
    since = tracker.current_restriction().idle_since_ms
    assert idle_end(options, since, 63_999, False, tracker) == "poll"
    assert idle_end(options, since, 64_000, False, tracker) == "end"
    other = ReaderOptions(until_idle_s=4.0, stop_token="another-job")
    hold_idle_end("demo-test")
    try:
        assert idle_end(other, 0, 4_000, False, tracker) == "end"  # a hold is the token's alone
    finally:
        release_idle_end("demo-test")


def _put_big(client, shard, n, chars):
    image = lambda i: {"pk": {"S": f"k{i}"}, "body": {"S": "x" * chars}}  # noqa: E731
    return [client.put(shard, "MODIFY", {"pk": {"S": f"k{i}"}}, image(i), image(i)) for i in range(n)]


def test_a_page_stopped_at_one_megabyte_is_full_the_shard_reads_on_and_its_lag_is_not_zero():
    """AWS stops a GetRecords page at 1,000 records or 1 MB: a page of large
    records cut at 1 MB is a full page — the shard takes its next turn in the
    same round and its oldest unread change is counted as pending — while a
    page short of both bounds still means the shard's head."""
    from ddb2bt.pipeline.source.stream_source import page_is_full

    client, _, _, reader, _ = setup()
    client.add_shard("s")
    big = _put_big(client, "s", 12, 100_000)  # ~200 KB a record: 5 to a page
    tracker = LocalTracker()
    first, result = drain_round(reader, tracker)
    assert seqs(first) == big and not result.at_head
    # pages of 5 and 5 records, each cut at 1 MB, then 2 (400 KB: may have been cut,
    # as the wire form is larger), then the head's empty page
    assert client.calls.count("GetRecords") == 4
    assert reader.pending_since() == {"s": None}  # read to its head
    page = records(first)[:5]
    assert page_is_full(page) and page_is_full(page[:2]) and not page_is_full(page[:1])  # one: 200 KB
    assert not page_is_full([])
    assert page_is_full(records(put(FakeStreamsClient(), "x", 0)) + [page[0]] * 1000)


def test_a_page_cut_before_a_record_larger_than_any_on_it_is_full_too():
    """The record that did not fit may be larger than any on the page: ~50 KB
    records, then one of ~800 KB (both images of a ~400 KB item)."""
    client, _, _, reader, _ = setup()
    client.add_shard("s")
    written = _put_big(client, "s", 18, 25_000) + _put_big(client, "s", 1, 400_000) + _put_big(client, "s", 5, 25_000)
    first, _ = drain_round(reader, LocalTracker())
    assert len(records(first)) == len(written)  # all in one round: no page taken for the head
    assert reader.pending_since() == {"s": None}


def test_a_short_page_of_small_records_and_a_page_without_sizes_still_end_the_shards_turn():
    """Records without SizeBytes (an emulator's 0) are full only at 1,000, as before."""
    from dataclasses import replace

    from ddb2bt.pipeline.source.stream_source import page_is_full

    client, _, _, reader, _ = setup()
    client.add_shard("s")
    small = put(client, "s", 7)
    first, _ = drain_round(reader, LocalTracker())
    assert seqs(first) == small and client.calls.count("GetRecords") == 1
    sizeless = [replace(r, size_bytes=0) for r in records(first)]
    assert not page_is_full(sizeless * 100) and page_is_full(sizeless * 143)  # 700 records, then 1,001


def test_after_a_page_cut_at_one_megabyte_the_shard_is_behind(monkeypatch):
    from ddb2bt.pipeline.source import stream_source

    monkeypatch.setattr(stream_source, "PAGES_PER_ROUND", 1)  # one page a round
    client, _, _, reader, _ = setup()
    client.add_shard("s")
    _put_big(client, "s", 12, 100_000)
    first, result = drain_round(reader, LocalTracker())
    assert len(records(first)) == 5 and not result.at_head
    assert reader.pending_since() == {"s": records(first)[-1].change_ms}  # more follows: not at its head
