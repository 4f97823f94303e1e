"""MutateRows' entry statuses read from the response's bytes in C
(``transforms/decoders_c.c``) must be exactly what the sink's reference loop
(``writer.note_statuses``, through the protobuf library) makes of the same bytes:
for any response a server could send, and for bytes no server sends, where the C
either agrees or leaves the bytes to the library (None) — never a different
answer. The writer itself is run both ways against a channel that answers with
chosen bytes."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ddb2bt.pipeline.clients.bigtable.errors import ENTRY_OK, EntryStatus
from ddb2bt.pipeline.clients.bigtable.wire import WireEntry, mutate_rows_types
from ddb2bt.pipeline.clients.bigtable.writer import GrpcMutationWriter, note_statuses
from ddb2bt.transforms import native

RESPONSE_CLS = mutate_rows_types()[1]
INT32_MAX = 2**31 - 1

def c_reader():
    assert native.NATIVE_BUILT, "the C module was not built (deploy/local/setup.sh builds it with the package)"
    return native.rowwriter_c.mutate_rows_statuses


def by_reference(data: bytes, size: int):
    """The reference's statuses, or the exception it raises."""
    statuses = [None] * size
    try:
        note_statuses(RESPONSE_CLS.FromString(data), statuses)
    except Exception as exc:  # noqa: BLE001 - compared by class below
        return type(exc)
    return statuses


def by_c(data: bytes, size: int):
    statuses = [None] * size
    count = c_reader()(data, statuses, ENTRY_OK, EntryStatus)
    return count, statuses


ENTRY = st.fixed_dictionaries({
    "code": st.one_of(st.just(0), st.just(0), st.integers(1, 16), st.integers(-5, INT32_MAX)),
    "message": st.one_of(st.just(""), st.text(max_size=40)),
    "details": st.booleans(),
    "status": st.booleans(),
})


@st.composite
def responses(draw):
    """A serialized MutateRowsResponse of any entries (indexes in range, repeated
    or not, in any order) and the statuses' size."""
    size = draw(st.integers(1, 40))
    msg = RESPONSE_CLS()
    for spec in draw(st.lists(ENTRY, max_size=40)):
        entry = msg.entries.add(index=draw(st.integers(0, size - 1)))
        if spec["status"] or spec["code"] or spec["message"]:
            entry.status.code = spec["code"]
            entry.status.message = spec["message"]
            if spec["details"]:
                entry.status.details.add(type_url="type.googleapis.com/x", value=b"\x08\x01")
    if draw(st.booleans()):
        msg.rate_limit_info.factor = 0.5
    return msg.SerializeToString(), size


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(responses())
def test_any_response_reads_as_the_reference_reads_it(case):
    data, size = case
    count, statuses = by_c(data, size)
    reference = by_reference(data, size)
    if count is None:
        # left to the library only for what the C does not read: a negative code
        # (past int32 on the wire), a status's details, the rate-limit field
        parsed = RESPONSE_CLS.FromString(data)
        assert (parsed.HasField("rate_limit_info")
                or any(e.status.code < 0 or len(e.status.details) for e in parsed.entries))
        return
    assert statuses == reference
    assert count == len(RESPONSE_CLS.FromString(data).entries)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.booleans()),
                             min_size=1, max_size=4),
       st.integers(0, 3))
def test_damaged_bytes_are_read_as_the_reference_reads_them_or_left_to_it(case, edits, cut):
    """Bytes changed or inserted at random (and cut short): where the C answers,
    the library reads the same bytes to the same statuses; where the library
    refuses them, the C answers None."""
    data, size = case
    raw = bytearray(data)
    for at, byte, insert in edits:
        if insert:  # e.g. a continuation byte: a key or a length written in more bytes
            raw.insert(at % (len(raw) + 1), byte)
        elif raw:
            raw[at % len(raw)] = byte
    damaged = bytes(raw[:len(raw) - cut] if cut < len(raw) else raw)
    count, statuses = by_c(damaged, size)
    if count is None:
        return
    assert statuses == by_reference(damaged, size)


def raw_entry(fields: bytes) -> bytes:
    return b"\x0a" + bytes([len(fields)]) + fields


@pytest.mark.parametrize("data,why", [
    (raw_entry(b"\x08\x05"), "index out of range"),
    (raw_entry(b"\x08\x01\x08\x00"), "index given twice"),
    (raw_entry(b"\x12\x00\x12\x02\x08\x02"), "status given twice (the library merges them)"),
    (raw_entry(b"\x12\x0b\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"), "a negative code"),
    (raw_entry(b"\x12\x06\x08\x80\x80\x80\x80\x08"), "a code past int32"),
    (raw_entry(b"\x12\x04\x12\x02\xc3\x28"), "a message that is not UTF-8"),
    (b"\x0a\x05\x08\x01", "an entry cut short"),
    (b"\x08\x01", "entries of another wire type"),
    (raw_entry(b"\x08\x01\x1b"), "an unknown field (of the group wire type)"),
    (b"\x0a\x84\x80\x80\x80\x80\x00\x04\x08\x01\x12\x00", "a key of 6 bytes (the library refuses over 5)"),
    (raw_entry(b"\x18\x01"), "an unknown field in an entry"),
    (raw_entry(b"\x12\x04\x1a\x02\x0a\x00"), "a status's details"),
    (b"\x1a\x00" + raw_entry(b"\x08\x01"), "the response's rate_limit_info"),
    (b"\x02\x00" + raw_entry(b"\x08\x01"), "field number 0"),
    (raw_entry(b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"), "a varint over 10 bytes"),
])
def test_shapes_the_c_does_not_read_are_left_to_the_library(data, why):
    count, statuses = by_c(data, 3)
    assert count is None, why


def test_known_shapes_are_read_in_c():
    msg = RESPONSE_CLS()
    msg.entries.add(index=0)
    msg.entries.add(index=2).status.code = 14
    msg.entries[1].status.message = "unavailable: try again"
    msg.entries.add(index=1).status.code = 0
    count, statuses = by_c(msg.SerializeToString(), 3)
    assert count == 3
    assert statuses == [ENTRY_OK, ENTRY_OK, EntryStatus(14, "unavailable: try again")]
    assert statuses[0] is ENTRY_OK  # the shared value, not a copy


def test_an_error_raised_by_failed_is_raised():
    msg = RESPONSE_CLS()
    msg.entries.add(index=0).status.code = 3

    def failed(code, message):
        raise RuntimeError("from failed")

    with pytest.raises(RuntimeError, match="from failed"):
        c_reader()(msg.SerializeToString(), [None], ENTRY_OK, failed)


def test_a_list_shortened_by_failed_raises_index_error_not_memory_damage():
    msg = RESPONSE_CLS()
    msg.entries.add(index=1).status.code = 3
    statuses = [None, None]

    def failed(code, message):
        statuses.clear()
        return EntryStatus(code, message)

    with pytest.raises(IndexError):
        c_reader()(msg.SerializeToString(), statuses, ENTRY_OK, failed)


class _AnsweringChannel:
    """A channel whose MutateRows answers with the given serialized responses,
    passed through the writer's own deserializer (None: the bytes as they are)."""

    def __init__(self, answers: list) -> None:
        self.answers = answers

    def unary_stream(self, method, request_serializer=None, response_deserializer=None):
        def call(request, timeout=None, metadata=None):
            return iter([response_deserializer(a) if response_deserializer else a for a in self.answers])
        return call

    def unary_unary(self, method, request_serializer=None, response_deserializer=None):
        return lambda *a, **k: None

    def close(self) -> None:
        pass


def _answers() -> list:
    first, second = RESPONSE_CLS(), RESPONSE_CLS()
    first.entries.add(index=0)
    first.entries.add(index=2).status.code = grpc.StatusCode.NOT_FOUND.value[0]
    first.entries[1].status.message = "no such family"
    second.entries.add(index=3).status.code = 0
    # index 1 is never answered: the writer reports it UNAVAILABLE
    return [first.SerializeToString(), second.SerializeToString(),
            raw_entry(b"\x08\x03\x08\x03")]  # index given twice: the library reads this one


@pytest.mark.parametrize("c_runs", [True, False], ids=["c", "library"])
def test_the_writer_reads_statuses_the_same_with_and_without_the_c(c_runs):
    writer = GrpcMutationWriter("p", "i", channel=_AnsweringChannel(_answers()))
    if not c_runs:
        writer._statuses_c = None  # as where the module is off (DDB2BT_ROW_WRITER=python): the library reads
    assert (writer._statuses_c is not None) == c_runs
    entries = [WireEntry(b"r%d" % i, (), b"") for i in range(4)]
    statuses = writer.mutate_rows("t", entries)
    assert statuses == [ENTRY_OK, EntryStatus(grpc.StatusCode.UNAVAILABLE.value[0], "no status returned for entry"),
                        EntryStatus(grpc.StatusCode.NOT_FOUND.value[0], "no such family"), ENTRY_OK]


def test_an_answer_as_a_message_is_read_by_the_library():
    """A channel (or an interceptor) may hand back messages, not bytes."""
    msg = RESPONSE_CLS()
    msg.entries.add(index=0).status.code = 5
    writer = GrpcMutationWriter("p", "i", channel=_AnsweringChannel([msg]))
    writer._call_encoded = lambda *a, **k: iter([msg])
    assert writer.mutate_rows("t", [WireEntry(b"r", (), b"")]) == [EntryStatus(5, "")]


def test_an_answer_the_library_refuses_breaks_the_stream_as_grpc_did():
    """Bytes no library can read (a key of 6 bytes, whose entry the C read
    before): the writer keeps the statuses of the answers before, counts the
    rest lost with INTERNAL (retryable), as when gRPC's own deserializer failed;
    the C's reading of the refused answer is not kept."""
    good = RESPONSE_CLS()
    good.entries.add(index=0)
    refused = raw_entry(b"\x08\x01\x12\x00") + b"\x0a\x84\x80\x80\x80\x80\x00\x04\x08\x02\x12\x00"
    with pytest.raises(Exception):
        RESPONSE_CLS.FromString(refused)
    for c_runs in (True, False):
        writer = GrpcMutationWriter("p", "i", channel=_AnsweringChannel([good.SerializeToString(), refused]))
        if not c_runs:
            writer._statuses_c = None
        statuses = writer.mutate_rows("t", [WireEntry(b"r%d" % i, (), b"") for i in range(3)])
        lost = EntryStatus(grpc.StatusCode.INTERNAL.value[0], "Exception deserializing response!")
        assert statuses == [ENTRY_OK, lost, lost], c_runs
        assert lost.retryable


def test_a_first_answer_the_library_refuses_is_a_retryable_error():
    from ddb2bt.pipeline.clients.bigtable.errors import BigtableRetryable

    writer = GrpcMutationWriter("p", "i", channel=_AnsweringChannel([b"\x0a\x05\x08\x01"]))
    with pytest.raises(BigtableRetryable, match="INTERNAL"):
        writer.mutate_rows("t", [WireEntry(b"r", (), b"")])
