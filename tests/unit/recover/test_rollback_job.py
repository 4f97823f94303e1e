"""The reverse job on fakes: rows named by the change stream read back and written
as whole items; garbage collection ignored; the checkpoint moves to the start of a
finished pass and a restart resumes there; a replay writes nothing new."""
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.recover.rollback import (
    APPLIED_META, FRONTIER_META, RollbackJob, RowsBack, changed_rows, reconcile,
)
from ddb2bt.pipeline.sink.dynamodb_writer import WriteOutcome
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.change_records import SOURCE_GC, SOURCE_USER, RowChange, SetCell
from ddb2bt.transforms.inverse_rows import DeleteItem, PutItem

from tests.unit.transforms.test_inverse import CATALOG, CATALOG_SEED, STRINGS, bigtable_of


class FakeDynamoDB:
    """Items by (pk, sk) and the writer's conditional semantics (versions kept apart)."""

    def __init__(self, items=()):
        self.items = {self.key(i): i for i in items}
        self.versions, self.writes = {}, []

    @staticmethod
    def key(item):
        return (item["pk"]["S"], item["sk"]["S"])

    def query(self, attribute, value):
        return [i for i in self.items.values() if i[attribute] == value]

    def write(self, writes):
        written = stale = deletes = 0
        for w in writes:
            key = (w.key["pk"]["S"], w.key["sk"]["S"])
            if self.versions.get(key, -1) >= w.version_us:
                stale += 1
                continue
            self.versions[key] = w.version_us
            self.writes.append(w)
            written += 1
            if isinstance(w, DeleteItem):
                deletes += 1
                self.items.pop(key, None)
            else:
                self.items[key] = w.item
        return WriteOutcome(written, stale, 0.0, deletes)


def change(row, at_us, source=SOURCE_USER):
    return RowChange(row, at_us, 0, source, (SetCell("SKU", b"x", at_us, b""),), "p", "t")


def world(rows, items):
    ddb = FakeDynamoDB(items)
    back = RowsBack(CATALOG, "Catalog", read_rows=lambda keys: {k: rows[k] for k in keys if k in rows},
                    query_partition=ddb.query, writer=ddb, key_types=STRINGS)
    return ddb, back


def test_changed_rows_keep_each_rows_newest_client_change_and_ignore_garbage_collection():
    got = changed_rows([change(b"a", 5), change(b"a", 9), change(b"b", 3, SOURCE_GC), change(b"a", 7)])
    assert got == {b"a": 9}


class FakeFrontier:
    """Read up to ``at`` (µs): a stand-in for the change-stream frontier."""

    def __init__(self, at):
        self.at = at

    def low_watermark_us(self):
        return self.at

    def to_json(self):
        return str(self.at)


def reader(stream, log):
    def read(frontier, end_us):
        log.append((frontier.at, end_us))
        got = [c for c in stream if frontier.at <= c.commit_time_us < end_us]
        frontier.at = end_us
        return got
    return read


def test_passes_write_the_rows_state_back_save_the_frontier_and_a_restart_resumes_there():
    old = CATALOG_SEED[0]
    new = dict(old, Price={"N": "99"})
    rows = bigtable_of(CATALOG, [new, CATALOG_SEED[2]])
    ddb, back = world(rows, [old, CATALOG_SEED[1]])  # DynamoDB: the old item, and one Bigtable no longer holds
    store = StateStore(InMemoryBigtable(), "job", lambda: 1)
    clock = iter(range(1_000, 100_000, 1_000))
    stream = [change(b"hats#fedoras#brandA", 500), change(b"hats#caps#brandB", 600),
              change(b"hats#fedoras#brandA", 700, SOURCE_GC)]
    log, fenced, ticks = [], [], iter(range(100))
    job = RollbackJob(back, reader(stream, log), FakeFrontier, lambda text: FakeFrontier(int(text)), store,
                      lambda: next(clock), fence=lambda: fenced.append(1), clock=lambda: next(ticks),
                      sleep=lambda s: None)
    outcome = job.run(cutover_us=100, until_idle_s=2)
    assert log[0] == (100, 1_000) and fenced  # the first pass: from the cutover to its own start
    assert (outcome.rows, outcome.puts, outcome.deletes, outcome.stale) == (2, 1, 1, 0)
    assert ddb.items == {("hats", "fedoras#brandA"): new}  # a row the stream did not name is not touched
    assert [(type(w), w.key["sk"]["S"], w.version_us) for w in ddb.writes] == [
        (PutItem, "fedoras#brandA", 500), (DeleteItem, "caps#brandB", 600)]
    last = log[-1][1]
    assert store.load_meta(FRONTIER_META) == str(last) and store.load_meta(APPLIED_META) == str(last)
    # a restart resumes at the saved frontier; the same changes replayed from the cutover write nothing
    again = RollbackJob(back, reader(stream, log), FakeFrontier, lambda text: FakeFrontier(int(text)), store,
                        lambda: next(clock), clock=lambda: next(ticks), sleep=lambda s: None)
    before = len(log)
    again.run(cutover_us=100, until_idle_s=1)
    assert log[before][0] == last
    store.save_meta(FRONTIER_META, "")
    replay = again.run(cutover_us=100, until_idle_s=1)
    assert (replay.rows, replay.puts, replay.deletes) == (2, 0, 0)


def test_the_full_reconcile_writes_rows_back_and_deletes_items_whose_row_is_gone():
    rows = bigtable_of(CATALOG, CATALOG_SEED[:1])
    ddb, back = world(rows, CATALOG_SEED)
    outcome = reconcile(back, CATALOG, rows, list(ddb.items.values()), version_us=10)
    assert (outcome.puts, outcome.deletes) == (0, 2)
    assert list(ddb.items) == [("hats", "fedoras#brandA")]


def test_rows_of_one_partition_cost_one_query_per_batch():
    """Both hats rows of the catalog are read back with one Query of the hats
    partition, not one per row; the items written are the same."""
    rows = bigtable_of(CATALOG, CATALOG_SEED[:2])
    ddb, back = world(rows, [])
    queries = []
    query = ddb.query
    back._query = lambda attribute, value: (queries.append(value), query(attribute, value))[1]
    outcome = back.apply({b"hats#fedoras#brandA": 500, b"hats#caps#brandB": 600})
    assert queries == [{"S": "hats"}]
    assert (outcome.rows, outcome.puts) == (2, 2) and set(ddb.items) == {("hats", "fedoras#brandA"),
                                                                          ("hats", "caps#brandB")}
