"""Source tables for `ddb2bt draft` tests: the seed's examples 1-4 and a
single-table design with an overloaded GSI, TTL, sets, maps, lists and 38-digit
decimals. Each is (key schema, indexes, TTL attribute, items), small enough for
the e2e run (tens of items each) and made the same way every time."""
from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Optional

from tests.unit.transforms.test_examples import INVOICE_SEED, VIDEO_SEED, item

NOW_S = 1_700_000_000  # the fixtures' clock (TTL values are relative to it)


@dataclass
class SourceTable:
    label: str
    partition: str
    sort: Optional[str]
    items: list
    key_types: dict = field(default_factory=dict)  # attribute -> S|N|B (keys and index keys)
    gsis: list = field(default_factory=list)  # (name, hash, range or None, projection type, non-key attrs)
    ttl: Optional[str] = None

    def create_table_args(self, name: str) -> dict:
        """boto3 create_table keyword arguments (a NEW_AND_OLD_IMAGES stream)."""
        types = {self.partition: "S", **({self.sort: "S"} if self.sort else {}), **self.key_types}
        schema = [{"AttributeName": self.partition, "KeyType": "HASH"}]
        if self.sort:
            schema.append({"AttributeName": self.sort, "KeyType": "RANGE"})
        needed = {self.partition, self.sort} | {a for g in self.gsis for a in g[1:3]}
        args = {"TableName": name, "KeySchema": schema, "BillingMode": "PAY_PER_REQUEST",
                "AttributeDefinitions": [{"AttributeName": a, "AttributeType": types.get(a, "S")}
                                         for a in sorted(a for a in needed if a)],
                "StreamSpecification": {"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"}}
        if self.gsis:
            args["GlobalSecondaryIndexes"] = [
                {"IndexName": n, "KeySchema": [{"AttributeName": h, "KeyType": "HASH"}]
                 + ([{"AttributeName": r, "KeyType": "RANGE"}] if r else []),
                 "Projection": {"ProjectionType": p, **({"NonKeyAttributes": list(nk)} if nk else {})}}
                for n, h, r, p, nk in self.gsis]
        return args

    def describe(self, name: str, item_count: int = 0) -> dict:
        """What DescribeTable returns for it (for the pure tests)."""
        args = self.create_table_args(name)
        out = {"TableName": name, "KeySchema": args["KeySchema"], "AttributeDefinitions": args["AttributeDefinitions"],
               "ItemCount": item_count or len(self.items), "TableSizeBytes": 100 * len(self.items),
               "StreamSpecification": args["StreamSpecification"]}
        if self.gsis:
            out["GlobalSecondaryIndexes"] = args["GlobalSecondaryIndexes"]
        return out


def product_catalog() -> SourceTable:
    items = [item(pk="hats", sk="fedoras#brandA", Description="Made from high-quality wool", Price=30,
                  Thumbnail="https://storage/fedora-a.jpg"),
             item(pk="hats", sk="fedoras#brandB", Description="Durable water-resistant canvas", Price=28,
                  Thumbnail="https://storage/fedora-b.jpg"),
             item(pk="hats", sk="newsboy#brandB", Description="Add a touch of vintage charm", Price=25,
                  Thumbnail="https://storage/newsboy-b.jpg"),
             item(pk="shoes", sk="sneakers#brandA", Description="Explore the city in style", Price=40,
                  Thumbnail="https://storage/sneakers-a.jpg"),
             item(pk="shoes", sk="sneakers#brandB", Description="Classic features", Price=50,
                  Thumbnail="https://storage/sneakers-b.jpg")]
    items += [item(pk=f"category{i % 7}", sk=f"style{i}#brand{'ABC'[i % 3]}", Description=f"product {i}",
                   Price=10 + i, Thumbnail=f"https://storage/{i}.jpg") for i in range(40)]
    return SourceTable("ProductCatalog", "pk", "sk", items)


def videos() -> SourceTable:
    items = list(VIDEO_SEED)
    for v in range(3):
        vid = f"07{v:02d}"
        items.append(item(pk=vid, sk="Video", UploadDate=f"2023-10-0{v + 1}T10:00:00",
                          Formats={"480": f"https://storage/{vid}/480", "720": f"https://storage/{vid}/720"}))
        items += [item(pk=vid, sk=f"VideoComment#{90000000 + c}", Content=f"comment {c}",
                       CreatedAt=f"2023-10-0{v + 1}T11:{c:02d}:00") for c in range(4)]
        items.append(item(pk=vid, sk="VideoStatsLikes", Count=v))
    return SourceTable("Videos", "pk", "sk", items)


def invoices() -> SourceTable:
    items = list(INVOICE_SEED)
    for n in range(5):
        inv = f"Invoice-09{n:02d}"
        items.append(item(pk=inv, sk=inv, DateCreated=f"2023-09-1{n}T10:00:00",
                          Details={"discount": 0.1, "due_date": "2023-10-03"}))
        items += [item(pk=inv, sk=f"Payment-{n}{p:03d}", DateCreated=f"2023-09-1{n}T11:00:0{p}",
                       Details={"amount_usd": 10 * p, "bill_to": f"customer {p}"}) for p in range(3)]
    return SourceTable("Invoices", "pk", "sk", items)


def hr_orders() -> SourceTable:
    """The seed's example 4: entities by PK prefix, edges in their partition,
    GSI 1 overloaded (GSI1PK/GSI1SK mean something else per entity), GSI 2
    write-sharded (OPEN orders by date over 15 shards)."""
    items = []
    for e in range(6):
        emp = f"HR-EMPLOYEE#{e:04d}"
        items.append(item(PK=emp, SK=emp, Name=f"Employee {e}", HireDate=f"2021-0{e % 9 + 1}-01",
                          Warehouse=f"WAREHOUSE#{e % 3}", JobTitle="Engineer", GSI1PK=f"WAREHOUSE#{e % 3}",
                          GSI1SK=f"Employee {e}"))
        items.append(item(PK=emp, SK=f"JH#2021-0{e % 9 + 1}-01", Job={"title": "Engineer", "department": "R&D"}))
    for o in range(10):
        order = f"OE-ORDER#O{o}"
        status = "OPEN" if o % 2 else "SHIPPED"
        attrs = dict(PK=order, SK=order, CustomerID=f"C{o % 3}", OrderStatus=status, OrderDate=f"2023-09-{10 + o}",
                     Total=Decimal(f"{o}.75"), GSI1PK=f"OE-CUSTOMER#C{o % 3}", GSI1SK=f"2023-09-{10 + o}")
        if status == "OPEN":
            attrs.update(GSI2PK=str(o % 15), GSI2SK=f"2023-09-{10 + o}")
        items.append(item(**attrs))
        items.append(item(PK=order, SK=f"ITEM#P{o % 4}", Line={"product": f"P{o % 4}", "quantity": o + 1}))
    for p in range(4):
        product = f"OE-PRODUCT#P{p}"
        items.append(item(PK=product, SK=product, Name=f"Widget {p}", Price=Decimal(f"{p}9.75")))
        items.append(item(PK=product, SK=f"WAREHOUSE#W{p % 2}", Quantity=100 + p))
    for c in range(3):
        cust = f"OE-CUSTOMER#C{c}"
        items.append(item(PK=cust, SK=cust, Name=f"Customer {c}", AccountRep=f"HR-EMPLOYEE#{c:04d}",
                          GSI1PK="HR-EMPLOYEE#0000", GSI1SK=cust))
    items.append(item(PK="HR-REGION#1", SK="Europe", Countries=3))
    return SourceTable("HROrders", "PK", "SK", items,
                       gsis=[("GSI1", "GSI1PK", "GSI1SK", "ALL", ()),
                             ("GSI2", "GSI2PK", "GSI2SK", "INCLUDE", ("CustomerID", "Total"))])


def single_table() -> SourceTable:
    """Customers and their orders in one table (CUST#…, ORDER#…), an
    overloaded GSI (GSI1PK is an email for a customer, a status#date for an
    order), TTL, sets, maps, lists and 38-digit decimals."""
    items = []
    for c in range(8):
        cust = f"CUST#{c:03d}"
        items.append(item(PK=cust, SK=cust, Email=f"user{c}@example.com", Tier="gold" if c % 2 else "silver",
                          GSI1PK=f"user{c}@example.com", GSI1SK=cust, Balance=Decimal("12345678901234567890.123456789012345678"),
                          Tags={"SS": [f"t{c}", "vip"]}, Scores={"NS": ["1", "2.5", str(c + 10)]},
                          Address={"street": f"{c} Main St", "zip": f"{10000 + c}"},
                          ExpiresAt=NOW_S + 86_400 * (30 + c)))
        for o in range(4):
            order = f"ORDER#2023-09-{10 + o}#{c}{o}"
            items.append(item(PK=cust, SK=order, Status="OPEN" if o % 2 else "SHIPPED",
                              Amount=Decimal(f"{c}{o}.99"), Lines=[{"sku": f"P{o}", "qty": o + 1}, f"gift {o}"],
                              GSI1PK=f"ORDER#{c}{o}", GSI1SK=f"2023-09-{10 + o}",
                              ExpiresAt=NOW_S + 86_400 * (10 + o)))
    # Tags as a real string set, Scores as a number set (item() makes lists of plain values).
    for it in items:
        for name in ("Tags", "Scores"):
            if name in it and "M" in it[name]:
                (tag, members), = it[name]["M"].items()
                it[name] = {tag: [m["S"] for m in members["L"]]}
    return SourceTable("SingleTable", "PK", "SK", items, gsis=[("GSI1", "GSI1PK", "GSI1SK", "KEYS_ONLY", ())],
                       ttl="ExpiresAt")


def all_tables() -> list:
    return [product_catalog(), videos(), invoices(), hr_orders(), single_table()]


# The size of the largest item of shop_table: 163 KB, as in a real catalog
# whose products carry long descriptions (DynamoDB's limit is 400 KB).
LARGE_ITEM_BYTES = 163_000


def shop_table(customers: int = 200, now_s: int = NOW_S) -> SourceTable:
    """A single-table design as a new user writes one: customer profiles
    (CUST#n / PROFILE), their orders (CUST#n / ORDER#…) with a status GSI, carts
    (CART#… / CART) carrying a TTL attribute (TTL enabled), and products
    (PRODUCT#… / DETAILS), a fifth of the items, stored last so that a scan
    reaches them last; the last product is a 163 KB item. Numbers of 38 digits,
    sets, maps, lists, binary, and a nickname that is NULL for some customers
    and an empty string for others."""
    profiles, orders, carts, products = [], [], [], []
    statuses = ("PENDING", "SHIPPED", "SHIPPED", "DELIVERED", "DELIVERED", "DELIVERED")
    for c in range(customers):
        cust = f"CUST#{c:05d}"
        profile = item(PK=cust, SK="PROFILE", Name=f"customer {c}", Email=f"c{c}@example.com",
                       Balance=Decimal(f"{12345678901234567890 + c}.123456789012345678"),
                       Address={"street": f"{c} Main St", "zip": f"{10000 + c}", "geo": {"lat": Decimal("52.5")}},
                       Avatar=bytes([c % 256, 0, 255]))
        profile["Tags"] = {"SS": [f"t{c % 7}", "member"]}
        profile["Nickname"] = {"NULL": True} if c % 3 == 0 else {"S": ""} if c % 3 == 1 else {"S": f"n{c}"}
        profiles.append(profile)
        for o in range(4):
            order = item(PK=cust, SK=f"ORDER#{c * 4 + o:07d}", orderStatus=statuses[(c + o) % len(statuses)],
                         createdAt=f"2026-10-{1 + (c + o) % 28:02d}T10:{o:02d}:00Z", Total=Decimal(f"{c}.{o}9"),
                         Lines=[{"sku": f"P{o}", "qty": o + 1}, {"sku": f"P{o + 1}", "qty": 1}])
            order["Quantities"] = {"NS": [str(o + 1), "10"]}
            orders.append(order)
        carts.append(item(PK=f"CART#{c:05d}", SK="CART", Owner=cust, Coupon="" if c % 2 else "WELCOME",
                          Items=[f"P{c % 9}"], expiresAt=now_s + 86_400 * (2 + c % 5)))
    for p in range(len(profiles + orders + carts) // 4):  # a fifth of the table
        product = item(PK=f"PRODUCT#{p:05d}", SK="DETAILS", Title=f"product {p}", Price=Decimal(f"{p}.95"),
                       Stock=p % 50, Image=bytes([p % 256]) * 8)
        product["Categories"] = {"SS": [f"cat{p % 11}", "all"]}
        products.append(product)
    products[-1]["Description"] = {"S": "x" * LARGE_ITEM_BYTES}
    return SourceTable("Shop", "PK", "SK", profiles + orders + carts + products,
                       gsis=[("bystatus", "orderStatus", "createdAt", "ALL", ())], ttl="expiresAt")
