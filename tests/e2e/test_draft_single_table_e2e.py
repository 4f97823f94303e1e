"""`ddb2bt draft` on a single-table design as a new user writes one, against the
emulators: customer profiles, orders with a status GSI, carts with a TTL
attribute (TTL enabled), products a fifth of the table written last (a scan
reaches them last), a 163 KB item, numbers of 38 digits, sets, maps, lists,
binary, a NULL beside an empty string. Every entity type is drafted, `lint`
is silent, no family has an age-based GC, the split points fall in every
range the mapping writes; `migrate` under writes, then `verify` IDENTICAL."""
from __future__ import annotations

import random
import threading
import time

import pytest
import yaml

from ddb2bt.pipeline.app.cli import main as ddb2bt
from ddb2bt.pipeline.clients.bigtable.reads import read_table
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.transforms.encoding import AUTO_NULL
from tests.e2e.test_draft_e2e import TAIL, TARGET, create_requests  # noqa: F401 (a fixture)
from tests.unit.transforms.draft_tables import shop_table
from tests.unit.transforms.test_examples import item

pytestmark = pytest.mark.e2e
WRITES = 150


def put_shop(ddb, name: str) -> list:
    source = shop_table(customers=200, now_s=int(time.time()))  # TTLs days ahead: nothing is reaped meanwhile
    ddb.create_table(**source.create_table_args(name))
    ddb.update_time_to_live(TableName=name, TimeToLiveSpecification={"Enabled": True, "AttributeName": "expiresAt"})
    for start in range(0, len(source.items), 25):  # in the order written: the products last
        ddb.batch_write_item(RequestItems={name: [{"PutRequest": {"Item": it}}
                                                  for it in source.items[start:start + 25]]})
    return source.items


class Writer(threading.Thread):
    """Changes of every kind while migrate runs: order statuses move (their
    index rows move), nicknames flip between NULL and an empty string, carts
    are deleted, products added."""

    def __init__(self, ddb, name: str) -> None:
        super().__init__(daemon=True)
        self.ddb, self.name, self.done_at = ddb, name, None
        self.errors: list = []

    def run(self) -> None:
        rng = random.Random(53)
        try:
            for n in range(WRITES):
                kind = n % 4
                c = rng.randrange(200)
                if kind == 0:
                    self.ddb.update_item(TableName=self.name, Key={"PK": {"S": f"CUST#{c:05d}"},
                                                                   "SK": {"S": f"ORDER#{c * 4:07d}"}},
                                         UpdateExpression="SET orderStatus = :s",
                                         ExpressionAttributeValues={":s": {"S": rng.choice(["SHIPPED", "DELIVERED"])}})
                elif kind == 1:
                    value = {"NULL": True} if n % 8 == 1 else {"S": ""}
                    self.ddb.update_item(TableName=self.name, Key={"PK": {"S": f"CUST#{c:05d}"},
                                                                   "SK": {"S": "PROFILE"}},
                                         UpdateExpression="SET Nickname = :v", ExpressionAttributeValues={":v": value})
                elif kind == 2:
                    self.ddb.delete_item(TableName=self.name, Key={"PK": {"S": f"CART#{c:05d}"}, "SK": {"S": "CART"}})
                else:
                    new = item(PK=f"PRODUCT#new{n:04d}", SK="DETAILS", Title=f"new {n}", Price=n, Stock=1)
                    new["Categories"] = {"SS": ["new"]}
                    self.ddb.put_item(TableName=self.name, Item=new)
                time.sleep(0.03)
        except Exception as exc:  # reported by the test, not lost in the thread
            self.errors.append(exc)
        self.done_at = time.monotonic()


def test_draft_of_a_single_table_design_is_complete_lints_silent_splits_every_range_and_verifies(
        stack, tmp_path, unique, capsys, create_requests):  # noqa: F811
    ddb = dynamodb_client()
    name = f"Shop_{unique}"
    put_shop(ddb, name)
    path, report = tmp_path / "shop.yaml", tmp_path / "report.txt"
    table = name.lower()
    assert ddb2bt(["draft", "--table", name, "--sample", "300", "--out", str(path), "--report", str(report),
                   *TARGET, "--bigtable-table", table]) == 0, capsys.readouterr()
    said = report.read_text()
    assert "where a type may be missing: none" in said, said
    drafted = yaml.safe_load(path.read_text())

    # every entity type drafted, the products and the largest item included
    rules = {r["name"]: r for r in drafted["rules"]}
    assert {"cust_profile", "cust_order", "cart_cart", "product_details", "other"} == set(rules)
    assert "Description" in rules["product_details"]["columns"]  # the 163 KB item's attribute
    assert "largest item read 16" in said  # 163 KB and some
    # Bigtable's schema rules: few short families, no age GC, the index on the items carrying its keys
    assert set(drafted["families"]) == {"d", "idx"}
    assert not any("max_age_seconds" in f for f in drafted["families"].values())
    assert {n for n, r in rules.items() if "indexes" in r} == {"cust_order", "other"}
    assert rules["cust_order"]["indexes"][0]["row_key"].startswith("idx/bystatus/{PK|salt:16}/{orderStatus}/")

    capsys.readouterr()
    assert ddb2bt(["lint", "-m", str(path), "--sample", "1000", "--strict"]) == 0
    assert "0 warning(s)" in capsys.readouterr().out

    create_requests.clear()
    assert ddb2bt(["create-table", "-m", str(path), "--split-from-sample", "--sample", "300"]) == 0
    splits = [s.key for s in next(r for r in create_requests if r["table_id"] == table)["initial_splits"]]
    for prefix in (b"CART#", b"CUST#", b"PRODUCT#", b"idx/bystatus/"):  # every range the mapping writes
        assert any(s.startswith(prefix) for s in splits), (prefix, splits)

    writer = Writer(ddb, name)
    writer.start()
    assert ddb2bt(["migrate", "-m", str(path), "--segments", "2", "--until-idle", "3", *TAIL]) == 0
    ended = time.monotonic()
    writer.join(timeout=120)
    assert not writer.is_alive() and not writer.errors, writer.errors
    if writer.done_at > ended:  # the writer outlasted the job: the tail takes the rest
        assert ddb2bt(["run", "-m", str(path), "--until-idle", "3", *TAIL]) == 0
    capsys.readouterr()
    assert ddb2bt(["verify", "-m", str(path), "--recheck-wait", "0"]) == 0, capsys.readouterr().out
    assert "IDENTICAL" in capsys.readouterr().out

    # a NULL and an empty string are different cells
    rows = read_table("local-project", "local-instance", table, prefix=b"CUST#")
    nicknames = {versions[0][1] for cells in rows.values() for (family, qualifier), versions in cells.items()
                 if qualifier in (b"Nickname", "Nickname")}
    assert {AUTO_NULL, b""} <= nicknames, list(rows.items())[:1]
