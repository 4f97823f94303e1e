"""`status` and the job commands' last lines say what is so (the cutover issue's
list): a table waiting its turn in a multi-table migrate is not "never
migrated", a backfill nobody runs is not "running", a shard never read is not
"at head", a trimmed checkpoint is found whether or not a reader just reported,
and an interrupted or ended tail is not "still running"."""
from __future__ import annotations

from ddb2bt.pipeline.control.phases import BACKFILLING
from ddb2bt.pipeline.cutover.status import QUEUED_META, Facts, ShardStatus, assess, gather, render
from ddb2bt.pipeline.control.lease import BACKFILL, LEASE_FAMILY, LEASE_QUALIFIER, TAIL, LeaseState
from ddb2bt.pipeline.control.state import ShardCheckpoint, StateStore
from ddb2bt.pipeline.testing.fakes import FakeStreamsClient, InMemoryBigtable
from ddb2bt.transforms.model import SetCell

NOW = 1_700_000_000_000


def facts(**kw) -> Facts:
    base = dict(now_ms=NOW, phase=None, handoff_ms=None, backfill_parts=4, backfill_done_parts=1, backfill_items=10,
                backfill_expected=None, backfill_done_ms=None)
    return Facts(**{**base, **kw})


def hold(bt: InMemoryBigtable, role: str, expires_ms: int) -> None:
    """A lease cell as a holder writes it."""
    state = LeaseState("cli:x", "host", 1, "node", NOW - 60_000, expires_ms, command="migrate")
    bt.write_rows([(f"job#lease#{role}".encode(), [SetCell(LEASE_FAMILY, LEASE_QUALIFIER, state.to_bytes(), NOW)])])


def test_a_table_queued_by_a_running_multi_table_migrate_is_waiting_its_turn_not_never_migrated():
    ready, reasons = assess(facts(queued_ms=NOW - 5_000, tail_held=True), "-m orders.yaml")
    assert not ready and reasons[0].startswith("waiting its turn")
    assert not any("no migration recorded" in r for r in reasons)
    # the migrate that queued it is gone: nothing is waiting any more
    _, reasons = assess(facts(queued_ms=NOW - 5_000, tail_held=False), "-m orders.yaml")
    assert reasons[0] == "no migration recorded for this job: run ddb2bt migrate -m orders.yaml"


def test_a_backfill_nobody_holds_is_stopped_not_running():
    _, reasons = assess(facts(phase=BACKFILLING, backfill_held=False), "-m orders.yaml")
    assert reasons[0] == ("backfill stopped at 1/4 parts (no process holds the job's backfill): rerun "
                          "ddb2bt migrate -m orders.yaml to resume it")
    _, reasons = assess(facts(phase=BACKFILLING, backfill_held=True))
    assert reasons[0] == "backfill running: 1/4 parts done"


def test_gather_reads_the_leases_and_the_queue_mark():
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: NOW)
    f = gather(store, FakeStreamsClient(), None, now_ms=NOW)
    assert (f.backfill_held, f.tail_held, f.queued_ms) == (False, False, None)
    hold(bt, TAIL, NOW + 20_000)
    hold(bt, BACKFILL, NOW - 1)  # expired: its holder was killed
    store.save_meta(QUEUED_META, str(NOW - 5_000))
    f = gather(store, FakeStreamsClient(), None, now_ms=NOW)
    assert (f.backfill_held, f.tail_held, f.queued_ms) == (False, True, NOW - 5_000)


def test_a_shard_never_read_is_not_at_head():
    never = facts(shards=[ShardStatus("shardId-1", None, False, None, None, reported_ago_ms=None)])
    line = next(l for l in render(never) if "shardId-1" in l)
    assert "not read yet" in line and "at head" not in line


def test_a_trimmed_checkpoint_is_reported_even_right_after_its_reader_reported():
    """The holder was killed a moment after its last report; then the stream
    trimmed past its checkpoint. No reader will ever stop loudly on it: status must."""
    client = FakeStreamsClient()
    client.add_shard("s0")
    for i in range(5):
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}})
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: NOW)
    seq = client.shards["s0"].records[1]["dynamodb"]["SequenceNumber"]
    store.save_checkpoints([ShardCheckpoint(client.stream_arn, "s0", seq)])
    store.save_reader_report(client.stream_arn, "0-1", {"s0": None})  # fresh, not ended
    client.shards["s0"].trimmed_before = 4
    f = gather(store, client, client.stream_arn, now_ms=NOW)
    assert [s.trimmed for s in f.shards] == [True]
    ready, reasons = assess(f)
    assert not ready and any(r.startswith("trimmed: 1 shard(s) lost changes") for r in reasons)
    # a running job (its tail lease live, its report fresh) stops loudly itself: not probed
    hold(bt, TAIL, NOW + 20_000)
    client.calls.clear()
    f = gather(store, client, client.stream_arn, now_ms=NOW)
    assert [s.trimmed for s in f.shards] == [False] and "GetShardIterator" not in client.calls


def test_a_trimmed_checkpoint_is_lost_unless_the_stream_still_holds_a_record_from_before_the_head_sighting():
    """docs/design.md §8.2: a checkpoint that aged out lost nothing only when the
    oldest record the shard holds predates the job's last head sighting; status
    must not send the operator to a recovery then, and must otherwise."""
    client = FakeStreamsClient()
    client.add_shard("s0")
    head_ms = NOW - 3_600_000
    for i, created in enumerate((head_ms - 90_000, head_ms - 60_000, head_ms + 60_000)):
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}}, created_ms=created)
    store = StateStore(InMemoryBigtable(), "job", lambda: NOW)
    seq = client.shards["s0"].records[0]["dynamodb"]["SequenceNumber"]
    store.save_checkpoints([ShardCheckpoint(client.stream_arn, "s0", seq)])
    store.save_reader_report(client.stream_arn, "0-1", {"s0": None}, ended=True, heads={"s0": head_ms})
    client.shards["s0"].trimmed_before = 1  # the checkpoint aged out; a record from before the sighting is held
    f = gather(store, client, client.stream_arn, now_ms=NOW)
    assert [s.trimmed for s in f.shards] == [False]
    _, reasons = assess(f)
    assert not any(r.startswith("trimmed") for r in reasons)
    # the stream trimmed past the sighting: what came after it may be gone
    client.shards["s0"].trimmed_before = 2
    assert [s.trimmed for s in gather(store, client, client.stream_arn, now_ms=NOW).shards] == [True]
    # seen at its head too long ago: lost, whatever the stream holds
    client.shards["s0"].trimmed_before = 1
    store.save_reader_report(client.stream_arn, "0-1", {"s0": None}, ended=True, heads={"s0": NOW - 24 * 3_600_000})
    assert [s.trimmed for s in gather(store, client, client.stream_arn, now_ms=NOW).shards] == [True]


def test_an_interrupted_command_does_not_claim_more_than_what_was_acknowledged():
    from ddb2bt.pipeline.signals import INTERRUPTED

    assert "stopped" in INTERRUPTED and "acknowledged is checkpointed" in INTERRUPTED
    assert "state is checkpointed" not in INTERRUPTED


def test_a_migrate_whose_tail_ends_says_the_tail_stopped(monkeypatch, capsys, tmp_path):
    """Without --until-idle the tail runs until stopped; when migrate returns
    anyway, its last line says the tail is not running and how to resume."""
    import ddb2bt.pipeline.app.cli as cli
    from ddb2bt.pipeline.cutover import controller
    from ddb2bt.pipeline.services import replicate  # migrate's service

    seen = {}

    def fake_migrate(jobs, per_table, beam_args, until_idle, dry_run=False, check=None, on_live=lambda: None):
        seen["until_idle"] = until_idle
        on_live()
        return controller.Outcome()

    monkeypatch.setattr(controller, "migrate", fake_migrate)
    monkeypatch.setattr(replicate, "build_live_jobs", lambda args, mappings: [])
    monkeypatch.setattr(replicate, "with_backfill_leases", lambda args, options, states: [])
    monkeypatch.setattr(replicate, "start_metrics_server", lambda port, host: None)
    monkeypatch.setattr(replicate, "summary_at_end", _nothing)
    monkeypatch.setattr(replicate, "continuous_checks", _nothing)
    assert cli.main(["migrate", "--mapping", "example:product_catalog"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert seen["until_idle"] is None
    assert out[0].startswith("migration LIVE; the tail goes on replicating")
    assert out[-1] == "the tail stopped; resume with: ddb2bt run --mapping example:product_catalog"


class _nothing:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_live_job_whose_tail_nobody_holds_is_not_ready_saying_since_when_and_how_to_resume():
    """Ctrl-C releases the tail lease, a SIGKILL lets it lapse (its TTL): either
    way the readers' last reports are still fresh, and the job is not READY."""
    bt = InMemoryBigtable()
    store = StateStore(bt, "job", lambda: NOW)
    hold(bt, TAIL, NOW - 12_000)  # lapsed 12 s ago
    f = gather(store, FakeStreamsClient(), None, now_ms=NOW)
    assert (f.tail_held, f.tail_stopped_ms) == (False, NOW - 12_000)
    ready, reasons = assess(Facts(**{**vars(f), "phase": "LIVE"}), "-m orders.yaml")
    assert not ready
    assert ("the tail is not running (no process holds the job's tail lease since 2023-11-14T22:13:08Z): "
            "resume it with ddb2bt run -m orders.yaml") in reasons
    hold(bt, TAIL, NOW + 20_000)  # running again
    f = gather(store, FakeStreamsClient(), None, now_ms=NOW)
    _, reasons = assess(Facts(**{**vars(f), "phase": "LIVE"}))
    assert (f.tail_held, f.tail_stopped_ms) == (True, None) and not any("tail is not running" in r for r in reasons)


def trimmed_shard_seen_at_its_head(failure: Exception) -> list:
    """``gather``'s trimmed flags for a shard whose checkpoint was trimmed after
    a head sighting, when reading its oldest record raises ``failure``."""
    client = FakeStreamsClient()
    client.add_shard("s0")
    for i, created in enumerate((NOW - 3_700_000, NOW - 3_660_000)):
        client.put("s0", "INSERT", {"pk": {"S": f"k{i}"}}, {"pk": {"S": f"k{i}"}}, created_ms=created)
    store = StateStore(InMemoryBigtable(), "job", lambda: NOW)
    store.save_checkpoints([ShardCheckpoint(client.stream_arn, "s0", client.shards["s0"].records[0]["dynamodb"][
        "SequenceNumber"])])
    store.save_reader_report(client.stream_arn, "0-1", {"s0": None}, ended=True, heads={"s0": NOW - 3_600_000})
    client.shards["s0"].trimmed_before = 1

    def failing(**kw):
        raise failure
    client.get_records = failing
    return [s.trimmed for s in gather(store, client, client.stream_arn, now_ms=NOW).shards]


def test_status_answers_when_the_oldest_record_cannot_be_read_now_and_claims_no_proof():
    from ddb2bt.pipeline.testing.fakes import client_error

    assert trimmed_shard_seen_at_its_head(client_error("ProvisionedThroughputExceededException")) == [True]


def test_a_job_that_was_cut_over_points_at_the_way_back_not_at_a_stopped_tail():
    silent = ShardStatus("s1", None, False, None, None, reported_ago_ms=None)
    ready, reasons = assess(facts(phase="CUT_OVER", shards=[silent]), "-m orders.yaml")
    assert not ready
    assert reasons == ["cut over: forward replication stopped for good, the way back runs; whether switching back is "
                       "READY: ddb2bt rollback status -m orders.yaml"]


def test_status_answers_when_the_oldest_record_read_gets_no_answer_at_all():
    """A timeout or a refused connection (botocore's errors, not an AWS answer)
    proves nothing either: the shard stays trimmed, and status still answers."""
    from botocore.exceptions import ReadTimeoutError

    assert trimmed_shard_seen_at_its_head(ReadTimeoutError(endpoint_url="http://streams.example")) == [True]
