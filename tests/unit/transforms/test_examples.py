"""Golden tests: the seed documents' own rows, mapped by the shipped example
mappings, give exactly the Bigtable layouts the documents show."""
import datetime as dt
import struct

from hypothesis import given, settings, strategies as st

from ddb2bt.pipeline.verify.compare import expected_layout
from ddb2bt.pipeline.testing.fakes import InMemoryBigtable
from ddb2bt.transforms.attrs import from_plain
from ddb2bt.transforms.compiled import compile_mapping
from ddb2bt.transforms.config import load_mapping
from ddb2bt.transforms.mapping import map_change
from ddb2bt.transforms.model import INSERT, MODIFY, REMOVE, ChangeRecord

TS = 1_700_000_000_000


def ms(iso):
    return int(dt.datetime.fromisoformat(iso).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)


def item(**attrs):
    return {k: from_plain(v) for k, v in attrs.items()}


class Replica:
    """Applies changes through a mapping to the in-memory Bigtable."""

    def __init__(self, mapping):
        self.mapping = mapping
        self.bt = InMemoryBigtable()
        self.items = {}
        self.now = TS

    def keys(self, it):
        return {k: it[k] for k in self.mapping.source.key_attributes}

    def put(self, it):
        key = tuple(sorted((k, str(v)) for k, v in self.keys(it).items()))
        old = self.items.get(key)
        self.items[key] = it
        self._apply(ChangeRecord(MODIFY if old else INSERT, self.keys(it), it, old, self._tick()))

    def delete(self, it):
        key = tuple(sorted((k, str(v)) for k, v in self.keys(it).items()))
        old = self.items.pop(key)
        self._apply(ChangeRecord(REMOVE, self.keys(old), None, old, self._tick()))

    def _tick(self):
        self.now += 1000
        return self.now

    def _apply(self, record):
        handed_over = compile_mapping(self.mapping).fallbacks
        for ch in map_change(self.mapping, record):
            self.bt.mutate_rows(ch.table, [(ch.row_key, ch.mutations)])
        # mapped by the compiled mapping itself, not handed to the general engine
        assert compile_mapping(self.mapping).fallbacks == handed_over, record

    def table(self, name=None):
        return self.bt.versions(name or self.mapping.target.table)

    def matches_final_items(self):
        expected = expected_layout(self.mapping, self.items.values())
        for table, rows in expected.items():
            have = self.table(table)
            assert set(have) == set(rows), table
            for row, cols in rows.items():
                assert set(have[row]) == set(cols), (table, row)
                for col, want in cols.items():
                    versions = have[row][col]
                    if want.kind == "single":
                        assert list(versions.values()) == [want.value], (row, col)
                    elif want.kind == "versions":
                        assert versions == want.value, (row, col)
                    else:
                        assert tuple(v for _, v in sorted(versions.items())) == want.value


# --- Example 2 -------------------------------------------------------------------

VIDEOS = load_mapping("examples/videos.yaml")
FORMATS_0123 = {"480": "https://storage.example/0123/480", "720": "https://storage.example/0123/720",
                "1080p": "https://storage.example/0123/1080p"}
VIDEO_SEED = [
    item(pk="0123", sk="Video", UploadDate="2023-09-10T15:21:48", Formats=FORMATS_0123),
    item(pk="0123", sk="VideoComment#98765481", Content="I really like this. Special effects are amazing.",
         CreatedAt="2023-09-10T19:01:15"),
    item(pk="0123", sk="VideoComment#86751345", Content="There seems to be an audio glitch at 1:05.",
         CreatedAt="2023-09-10T16:30:42"),
    item(pk="0123", sk="VideoStatsLikes", Count=3),
    item(pk="0123", sk="VideoStatsViews", Count=156),
    item(pk="0124", sk="Video", UploadDate="2023-09-10T17:03:21",
         Formats={"480": "https://storage.example/0124/480", "720": "https://storage.example/0124/720"}),
    item(pk="0124", sk="VideoComment#97531849", Content="I shared this with all my friends.",
         CreatedAt="2023-10-12T07:08:51"),
    item(pk="0124", sk="VideoComment#87616471",
         Content="The style reminds me of a director but I can't quite place them.", CreatedAt="2023-09-11T09:00:00"),
    item(pk="0124", sk="VideoStats", ViewCount=45),
]


def test_example_2_videos_fold_into_one_row_per_video():
    r = Replica(VIDEOS)
    for it in VIDEO_SEED:
        r.put(it)
    rows = r.table()
    assert sorted(rows) == [b"0123", b"0124"]
    v = rows[b"0123"]
    assert v[("video", b"Formats")] == {
        ms("2023-09-10T15:21:48"): b'{"1080p":"https://storage.example/0123/1080p",'
                                    b'"480":"https://storage.example/0123/480","720":"https://storage.example/0123/720"}'}
    assert list(v[("stats", b"Likes")].values()) == [struct.pack(">q", 3)]
    assert list(v[("stats", b"Views")].values()) == [struct.pack(">q", 156)]
    comments = v[("comments", b"UserComments")]
    newest_first = [comments[t] for t in sorted(comments, reverse=True)]
    assert newest_first == [b"I really like this. Special effects are amazing.",
                            b"There seems to be an audio glitch at 1:05."]
    assert sorted(comments) == [ms("2023-09-10T16:30:42"), ms("2023-09-10T19:01:15")]
    assert list(rows[b"0124"][("stats", b"Views")].values()) == [struct.pack(">q", 45)]
    assert set(rows[b"0124"]) == {("video", b"Formats"), ("stats", b"Views"), ("comments", b"UserComments")}
    r.matches_final_items()


def test_example_2_deleting_a_comment_removes_exactly_its_version_and_the_video_only_its_cells():
    r = Replica(VIDEOS)
    for it in VIDEO_SEED:
        r.put(it)
    r.delete(VIDEO_SEED[2])  # the audio-glitch comment
    comments = r.table()[b"0123"][("comments", b"UserComments")]
    assert list(comments.values()) == [b"I really like this. Special effects are amazing."]
    r.delete(VIDEO_SEED[0])  # the Video item
    row = r.table()[b"0123"]
    assert ("video", b"Formats") not in row
    assert {("stats", b"Likes"), ("stats", b"Views"), ("comments", b"UserComments")} <= set(row)
    r.matches_final_items()


def test_example_2_comment_edit_replaces_its_version():
    r = Replica(VIDEOS)
    r.put(VIDEO_SEED[1])
    edited = dict(VIDEO_SEED[1], Content={"S": "edited"})
    r.put(edited)
    assert list(r.table()[b"0123"][("comments", b"UserComments")].values()) == [b"edited"]


# --- Example 3 -------------------------------------------------------------------

INVOICES = load_mapping("examples/invoices.yaml")
INVOICE_SEED = [
    item(pk="Invoice-0123", sk="Invoice-0123", DateCreated="2023-09-10T15:21:48",
         Details={"discount": 0.10, "sales_tax_usd": "8", "due_date": "2023-10-03.."}),
    item(pk="Invoice-0123", sk="Payment-0680", DateCreated="2023-09-10T15:21:40",
         Details={"amount_usd": 120, "bill_to": "John…", "address": "123 Abc St…"}),
    item(pk="Invoice-0123", sk="Payment-0789", DateCreated="2023-09-10T15:21:31",
         Details={"amount_usd": 120, "bill_to": "Jane…", "address": "13 Xyz St…"}),
    item(pk="Invoice-0124", sk="Invoice-0124", DateCreated="2023-09-09T10:11:28",
         Details={"discount": 0.20, "sales_tax_usd": "11", "due_date": "2023-10-03.."}),
    item(pk="Invoice-0124", sk="Payment-0327", DateCreated="2023-09-09T10:11:10",
         Details={"amount_usd": 180, "bill_to": "Bob…", "address": "321 Cba St…"}),
    item(pk="Invoice-0124", sk="Payment-0275", DateCreated="2023-09-09T10:11:03",
         Details={"amount_usd": 70, "bill_to": "Kate…", "address": "21 Zyx St…"}),
]


def test_example_3_adjacency_list_becomes_one_row_per_invoice():
    r = Replica(INVOICES)
    for it in INVOICE_SEED:
        r.put(it)
    rows = r.table()
    assert sorted(rows) == [b"0123", b"0124"]
    assert rows[b"0123"] == {
        ("Invoice", b"Details"): {ms("2023-09-10T15:21:48"):
                                  b'{"discount":0.1,"due_date":"2023-10-03..","sales_tax_usd":"8"}'},
        ("Payment", b"0680"): {ms("2023-09-10T15:21:40"):
                               '{"address":"123 Abc St…","amount_usd":120,"bill_to":"John…"}'.encode()},
        ("Payment", b"0789"): {ms("2023-09-10T15:21:31"):
                               '{"address":"13 Xyz St…","amount_usd":120,"bill_to":"Jane…"}'.encode()},
    }
    assert set(rows[b"0124"]) == {("Invoice", b"Details"), ("Payment", b"0327"), ("Payment", b"0275")}
    r.delete(INVOICE_SEED[1])
    assert ("Payment", b"0680") not in r.table()[b"0123"]
    r.matches_final_items()


# --- Example 4 -------------------------------------------------------------------

HR = load_mapping("examples/hr_orders.yaml")


def test_example_4_entities_route_by_prefix_and_index_rows_follow_updates_and_deletes():
    r = Replica(HR)
    emp = item(PK="HR-EMPLOYEE#0001", SK="HR-EMPLOYEE#0001", Name="John Smith", HireDate="2021-03-01",
               Warehouse="WAREHOUSE#1", JobTitle="Engineer")
    job = item(PK="HR-EMPLOYEE#0001", SK="JH#2021-03-01", Job={"title": "Engineer", "department": "R&D"})
    order = item(PK="OE-ORDER#O1", SK="OE-ORDER#O1", CustomerID="C1", OrderStatus="OPEN",
                 OrderDate="2023-09-10", Total=99.5)
    line = item(PK="OE-ORDER#O1", SK="ITEM#P1", Line={"product": "P1", "quantity": 2, "price": 49.75})
    product = item(PK="OE-PRODUCT#P1", SK="OE-PRODUCT#P1", Name="Widget", Price=49.75)
    stock = item(PK="OE-PRODUCT#P1", SK="WAREHOUSE#W1", Quantity=120)
    region = item(PK="HR-REGION#1", SK="Europe", Countries=3)
    for it in (emp, job, order, line, product, stock, region):
        r.put(it)
    main = r.table()
    assert main[b"emp#0001"][("jobs", b"2021-03-01")] == {r.now - 5000: b'{"department":"R&D","title":"Engineer"}'}
    assert set(main[b"emp#0001"]) == {("emp", b"Name"), ("emp", b"HireDate"), ("emp", b"Warehouse"),
                                       ("emp", b"JobTitle"), ("jobs", b"2021-03-01")}
    assert set(main[b"order#O1"]) == {("order", q) for q in (b"CustomerID", b"OrderStatus", b"OrderDate", b"Total")} \
        | {("lines", b"P1")}
    assert list(main[b"product#P1"][("inventory", b"W1")].values()) == [struct.pack(">q", 120)]
    assert b"entity#HR-REGION\\#1#Europe" in main
    assert b"idx#emp_by_name#John Smith#HR-EMPLOYEE\\#0001#HR-EMPLOYEE#0001" in main
    assert b"idx#emp_by_warehouse#WAREHOUSE\\#1#HR-EMPLOYEE\\#0001#HR-EMPLOYEE#0001" in main
    assert b"idx#orders_by_customer#C1#2023-09-10#OE-ORDER\\#O1#OE-ORDER#O1" in main
    (open_row,) = r.table("hr_orders_open")
    shard = open_row.split(b"#")[0]
    assert len(shard) == 2 and 0 <= int(shard) < 15  # readable write-sharding prefix
    assert r.table("hr_orders_open")[open_row][("o", b"row")] == {r.now - 4000: b"order#O1"}
    r.matches_final_items()

    # the name changes: the old index row goes, the new one appears
    r.put(dict(emp, Name={"S": "John A. Smith"}))
    names = [k for k in r.table() if k.startswith(b"idx#emp_by_name#")]
    assert names == [b"idx#emp_by_name#John A. Smith#HR-EMPLOYEE\\#0001#HR-EMPLOYEE#0001"]
    # the order ships: it leaves the OPEN index (a sparse, conditional index)
    r.put(dict(order, OrderStatus={"S": "SHIPPED"}))
    assert r.table("hr_orders_open") == {}
    # the employee is deleted: every index row of it goes too
    r.delete(dict(emp, Name={"S": "John A. Smith"}))
    assert not [k for k in r.table() if b"emp_by" in k]
    r.matches_final_items()


# --- convergence over a multi-item-per-row mapping ---------------------------------

video_ops = st.lists(st.tuples(
    st.sampled_from(["0123", "0124"]),
    st.sampled_from(["Video", "VideoStatsLikes", "VideoComment#1", "VideoComment#2", "VideoComment#3"]),
    st.sampled_from(["put", "delete"]),
    st.integers(0, 50),
), max_size=30)


@settings(max_examples=800, deadline=None)
@given(video_ops, st.data())
def test_videos_histories_converge_with_duplicates_and_replays(ops, data):
    items, records, now = {}, [], TS
    for pk, sk, kind, n in ops:
        now += data.draw(st.sampled_from([0, 1000]), label="advance")
        key = item(pk=pk, sk=sk)
        old = items.get((pk, sk))
        if kind == "delete":
            if old is None:
                continue
            del items[(pk, sk)]
            records.append(ChangeRecord(REMOVE, key, None, old, now))
            continue
        if sk == "Video":
            new = item(pk=pk, sk=sk, UploadDate=f"2023-09-10T15:21:{n:02d}", Formats={"480": f"u{n}"})
        elif sk == "VideoStatsLikes":
            new = item(pk=pk, sk=sk, Count=n)
        else:  # each comment has its own CreatedAt second, which an edit may move
            new = item(pk=pk, sk=sk, Content=f"c{n}", CreatedAt=f"2023-09-1{sk[-1]}T00:00:{n:02d}")
        items[(pk, sk)] = new
        records.append(ChangeRecord(MODIFY if old else INSERT, key, new, old, now))
    delivered = [r for r in records for _ in range(data.draw(st.integers(1, 2), label="copies"))]
    if records:
        delivered += records[data.draw(st.integers(0, len(records) - 1), label="replay from"):]
    r = Replica(VIDEOS)
    for rec in delivered:
        r._apply(rec)
    r.items = {k: v for k, v in items.items()}
    r.matches_final_items()
