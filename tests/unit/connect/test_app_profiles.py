"""Replicated Bigtable (issue 22, docs/operations.md "HA instances"): the
app-profile preflight against a fake admin (both routings), and which profile
each call of the writer and the sink goes through when the state has its own
single-cluster profile (--state-app-profile) next to a multi-cluster data one.

A fake admin and a fake gRPC channel: the emulator has no app profiles and no
replication, so it cannot show either."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.connect.connections import BigtableSpec, StateSpec
from ddb2bt.pipeline.connect.preflight import check_app_profiles
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter
from ddb2bt.pipeline.clients.bigtable.admin import MULTI_CLUSTER, SINGLE_CLUSTER, AppProfileFacts, AppProfileUnknown
from ddb2bt.pipeline.sink.sink import BatchingWriter
from ddb2bt.pipeline.control.state import StateStore
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.dofns import map_record
from ddb2bt.transforms.errors import ConfigError
from ddb2bt.transforms.mapping import backfill_record
from ddb2bt.transforms.model import INSERT, ChangeRecord, Guard, SetCell

from tests.unit.cutover.cutover_common import CATALOG, FAST, T, item


class FakeAdmin:
    """``app_profile(id)`` over a dict of AppProfileFacts, recording the lookups."""

    def __init__(self, *profiles: AppProfileFacts) -> None:
        self.profiles = {p.profile_id: p for p in profiles}
        self.asked: list = []

    def app_profile(self, profile_id: str) -> AppProfileFacts:
        self.asked.append(profile_id)
        return self.profiles.get(profile_id, AppProfileFacts(profile_id, exists=False))


HA = AppProfileFacts("ha", routing=MULTI_CLUSTER)
STATE = AppProfileFacts("state", routing=SINGLE_CLUSTER, cluster_id="c1", transactional=True)
NO_TXN = AppProfileFacts("single", routing=SINGLE_CLUSTER, cluster_id="c1", transactional=False)


def test_a_multi_cluster_state_profile_is_refused_naming_it_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_app_profiles("p", "inst", "ha", None, admin=FakeAdmin(HA))
    message = str(err.value)
    assert "'ha'" in message and "multi-cluster routing" in message
    assert "--state-app-profile" in message and "--transactional-writes" in message and "--instance=inst" in message
    assert err.value.field == "--state-app-profile"


def test_no_profile_at_all_checks_the_instance_default_one():
    admin = FakeAdmin(AppProfileFacts("default", routing=MULTI_CLUSTER))
    with pytest.raises(ConfigError, match="'default'.*multi-cluster"):
        check_app_profiles("p", "inst", None, None, admin=admin)
    assert admin.asked == ["default"]


def test_single_cluster_without_transactions_is_refused_with_the_update_command():
    with pytest.raises(ConfigError) as err:
        check_app_profiles("p", "inst", None, "single", admin=FakeAdmin(NO_TXN))
    assert "'single'" in str(err.value) and "single-row transactions" in str(err.value)
    assert "app-profiles update single --instance=inst --route-to=c1 --transactional-writes" in str(err.value)


def test_a_data_profile_on_the_state_profiles_cluster_passes():
    data = AppProfileFacts("data", routing=SINGLE_CLUSTER, cluster_id="c1")
    admin = FakeAdmin(data, STATE)
    assert check_app_profiles("p", "inst", "data", "state", admin=admin) is None
    assert admin.asked == ["state", "data"]
    # one single-cluster transactional profile for everything passes too
    assert check_app_profiles("p", "inst", "state", None, admin=FakeAdmin(STATE)) is None


@pytest.mark.parametrize("data", [HA, AppProfileFacts("other", routing=SINGLE_CLUSTER, cluster_id="c2")],
                         ids=["multi-cluster", "another-cluster"])
def test_data_writes_that_could_land_on_another_cluster_than_the_states_are_refused(data):
    """Two changes of one row written on two clusters (the data profile's, and the
    state profile's while a backfill runs) are not ordered by replication: a later
    delete could be undone by an earlier write replicated from the other cluster."""
    with pytest.raises(ConfigError) as err:
        check_app_profiles("p", "inst", data.profile_id, "state", admin=FakeAdmin(data, STATE))
    assert err.value.field == "target.app_profile"
    assert f"'{data.profile_id}'" in str(err.value) and "--route-to=c1" in str(err.value)


def test_missing_profiles_are_named():
    with pytest.raises(ConfigError, match="'nope'.*does not exist"):
        check_app_profiles("p", "inst", "ha", "nope", admin=FakeAdmin(HA))
    with pytest.raises(ConfigError, match="'gone'.*does not exist") as err:
        check_app_profiles("p", "inst", "gone", "state", admin=FakeAdmin(STATE))
    assert err.value.field == "target.app_profile"


def test_a_service_without_app_profiles_is_a_note_not_a_refusal():
    class NoProfiles:
        def app_profile(self, profile_id):
            raise AppProfileUnknown("unimplemented")

    assert "not checked" in check_app_profiles("p", "inst", "ha", None, admin=NoProfiles())


# --- which profile each call goes through ------------------------------------------

class _Call:
    def __init__(self, channel, kind, serializer, response) -> None:
        self.channel, self.kind, self.serializer, self.response = channel, kind, serializer, response

    def __call__(self, request, timeout=None, metadata=()):
        from google.cloud.bigtable_v2.types import bigtable as bt

        if self.serializer is None:  # pre-encoded: the sink's MutateRows, the guard's and the lease's swaps
            cls = bt.CheckAndMutateRowRequest if self.kind == "CheckAndMutateRow" else bt.MutateRowsRequest
            request = cls.pb().FromString(request)
        self.channel.sent.append((self.kind, request.app_profile_id, dict(metadata)["x-goog-request-params"]))
        return self.response(request)

    def future(self, request, timeout=None, metadata=()):  # the guard's swaps, many in flight
        class _Done:
            def __init__(self, response) -> None:
                self._response = response

            def result(self):
                return self._response

        return _Done(self(request, timeout, metadata))


class RecordingChannel:
    """A gRPC channel that answers every call with success and records the app
    profile each request names."""

    def __init__(self) -> None:
        self.sent: list = []

    def unary_stream(self, method, request_serializer=None, response_deserializer=None):
        from google.cloud.bigtable_v2.types import bigtable as bt

        if method.endswith("MutateRows"):
            def answer(req):
                response = bt.MutateRowsResponse.pb()()
                for i in range(len(req.entries)):
                    response.entries.add(index=i)
                return [response]
            return _Call(self, "MutateRows", request_serializer, answer)
        return _Call(self, "ReadRows", request_serializer, lambda req: [])

    def unary_unary(self, method, request_serializer=None, response_deserializer=None):
        from google.cloud.bigtable_v2.types import bigtable as bt

        return _Call(self, "CheckAndMutateRow", request_serializer,
                     lambda req: bt.CheckAndMutateRowResponse.pb()(predicate_matched=False))

    def close(self) -> None:
        pass


def test_conditional_calls_and_the_state_table_use_the_state_profile_plain_writes_the_data_profile():
    channel = RecordingChannel()
    writer = GrpcMutationWriter("p", "i", "ha", channel=channel, transactional_app_profile="state")
    assert writer.routes_transactional
    cell = [SetCell("f", b"q", b"v", T)]
    writer.mutate_rows("data", [(b"k", cell)])
    writer.mutate_rows("data", [(b"k", cell)], transactional=True)
    writer.check_and_mutate("data", b"k", Guard("m", b"q", T, True, T - 1), cell)
    writer.cells_since("data", [b"k"], "m", T)
    writer.read_cell("state_t", b"k", "f", b"q")
    writer.swap_cell("state_t", b"k", "f", b"q", None, b"v", T)
    writer.route_transactional("state_t")
    writer.mutate_rows("state_t", [(b"k", cell)])
    writer.swap_rows("data", [(b"k", "f", b"item", None, cell, False)], 4)  # the ordering guard's, serialized
    assert [(kind, profile) for kind, profile, _ in channel.sent] == [
        ("MutateRows", "ha"), ("MutateRows", "state"), ("CheckAndMutateRow", "state"), ("ReadRows", "state"),
        ("ReadRows", "state"), ("CheckAndMutateRow", "state"), ("MutateRows", "state"), ("CheckAndMutateRow", "state")]
    # the routing header names the same profile as the request
    assert all(params.endswith(f"app_profile_id={profile}") for _, profile, params in channel.sent)


def test_without_a_state_profile_everything_uses_the_one_profile():
    channel = RecordingChannel()
    writer = GrpcMutationWriter("p", "i", "one", channel=channel)
    assert not writer.routes_transactional
    writer.mutate_rows("data", [(b"k", [SetCell("f", b"q", b"v", T)])], transactional=True)
    writer.check_and_mutate("data", b"k", Guard("m", b"q", T, True, T - 1), [])
    assert {profile for _, profile, _ in channel.sent} == {"one"}


def test_the_specs_route_state_and_lease_through_the_state_profile(monkeypatch):
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", "127.0.0.1:9")  # channels are built, never used
    spec = BigtableSpec("p", "i", app_profile="ha", state_app_profile="state")
    assert spec.state_profile == "state"
    assert BigtableSpec("p", "i", app_profile="ha").state_profile == "ha"
    from ddb2bt.pipeline.control.lease import LeaseSpec, lease_cell

    cell = lease_cell(LeaseSpec(spec, "ddb2bt_state", "job", "tail", "me", 30.0, 10.0))
    assert cell._writer._app_profile == "state"
    store = StateSpec(spec, "job").store()
    assert store._backend._writer._app_profile == "state" and store._backend._app_profile == "state"
    store.close()


class RoutingBigtable(InMemoryBigtable):
    """The in-memory Bigtable as a writer with two profiles: records which rows
    went through the transactional one."""

    routes_transactional = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.routed: list = []  # (table, transactional, [row keys])

    def mutate_rows(self, table_id, entries, transactional=False):
        self.routed.append((table_id, transactional, [k for k, _ in entries]))
        return super().mutate_rows(table_id, entries)


def test_the_sink_sends_marked_tail_rows_and_guarded_backfill_rows_through_the_state_profile():
    bt = RoutingBigtable()
    store = StateStore(bt, "job", lambda: T)
    batcher = BatchingWriter(bt, store, FAST, sleep=lambda s: None)
    plain = item(pk="plain", sk="a", Price=1)
    marked = item(pk="marked", sk="a", Price=2)
    batcher.add(map_record(CATALOG, ChangeRecord(INSERT, item(pk="plain", sk="a"), plain, None, T), lambda: T))
    batcher.add(map_record(CATALOG, ChangeRecord(INSERT, item(pk="marked", sk="a"), marked, None, T), lambda: T,
                           True))
    backfilled = item(pk="old", sk="a", Price=3)
    batcher.add(map_record(CATALOG, backfill_record({"pk": backfilled["pk"], "sk": backfilled["sk"]}, backfilled,
                                                    T + 10_000), lambda: T))
    assert batcher.flush() == []
    target = {(transactional, tuple(keys)) for table, transactional, keys in bt.routed
              if table == "product_catalog"}
    assert (False, (b"plain#a",)) in target
    routed_txn = {k for transactional, keys in target if transactional for k in keys}
    assert b"marked#a" in routed_txn and b"plain#a" not in routed_txn
    # the backfill row is either a guarded batch row (through the state profile) or
    # a conditional one (CheckAndMutateRow, always through it): never a plain data write
    assert b"old#a" not in {k for transactional, keys in target if not transactional for k in keys}
    assert b"old#a" in bt.latest("product_catalog")


def test_a_state_store_closes_the_writer_it_made_and_never_one_it_was_given(monkeypatch):
    """A DoFn's teardown closes its store: a writer made for it (a gRPC channel per
    worker DoFn instance) goes with it; the sink's own writer stays open."""
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", "127.0.0.1:9")  # nothing listens: no call gets far
    spec = StateSpec(BigtableSpec("p", "i"), job="j")
    entry = [(b"r", [SetCell("f", b"q", b"v", 1)])]
    made = spec.store()
    writer = made._backend._writer
    made.close()
    with pytest.raises(ValueError, match="[Cc]hannel closed|closed channel"):
        writer.mutate_rows("t", entry)
    given = spec.bigtable.state_writer(timeout_s=2.0)
    try:
        spec.store(given).close()
        with pytest.raises(Exception) as err:  # still open: the call goes out and finds nobody
            given.mutate_rows("t", entry)
        assert "hannel closed" not in str(err.value) and "closed channel" not in str(err.value)
    finally:
        given.close()


def test_the_sweeps_scans_go_through_the_configured_profiles(monkeypatch):
    """cells_between reads the target through the data profile, the owner-record
    scan the state table through the state profile (replicated instances)."""
    from ddb2bt.pipeline.clients.bigtable import writer as bigtable_writer
    from ddb2bt.pipeline.control import state as state_module
    from ddb2bt.pipeline.control.state import BigtableStateBackend

    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", "127.0.0.1:9")
    seen = []

    class Client:
        def close(self):
            pass

    monkeypatch.setattr(bigtable_writer, "data_client", lambda project: Client())
    monkeypatch.setattr(bigtable_writer, "table_ranges", lambda *a, **k: [(None, None)])
    def iter_table(*a, **k):
        seen.append(k["app_profile"])
        return iter(())

    # the writer's sweep and the state table's scan both read through iter_table
    monkeypatch.setattr(bigtable_writer, "iter_table", iter_table)
    monkeypatch.setattr(state_module, "iter_table", iter_table)
    writer = bigtable_writer.GrpcMutationWriter("p", "i", app_profile="data", transactional_app_profile="txn")
    try:
        assert list(writer.cells_between("t", 0)) == []
        backend = BigtableStateBackend(writer, "p", "i", "ddb2bt_state", app_profile="txn")
        backend._client = Client()
        assert backend.keys_written_since(b"j#ver#", 0) == {}
    finally:
        writer.close()
    assert seen == ["data", "txn"]
