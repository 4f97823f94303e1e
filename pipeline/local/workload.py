"""A realistic, seeded stream of changes to the ProductCatalog table (Example 1):
inserts, updates that add and remove attributes, deletes, re-inserts, bursts of
changes to one item within one second, large values and unicode. Shared by the
demo, the end-to-end tests and the benchmarks."""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Iterator, Optional

CATEGORIES = ("hats", "shoes", "shirts", "bags", "socks", "coats")
STYLES = ("fedoras", "newsboy", "sneakers", "boots", "polo", "tote", "wool", "trench")
BRANDS = ("brandA", "brandB", "brandC", "brandÄ", "品牌D")
WORDS = ("wool", "canvas", "vintage", "charm", "durable", "city", "style", "classic", "naïve", "café", "日本", "🙂")
LARGE_VALUE_CHARS = 200_000  # well under DynamoDB's 400 KB item limit, large for a cell


@dataclass(frozen=True)
class Op:
    kind: str  # put | update | remove_attrs | delete
    key: dict
    item: Optional[dict] = None  # for put
    set_attrs: Optional[dict] = None  # for update
    remove_attrs: tuple = ()


def product_key(rng: random.Random, population: int) -> dict:
    n = rng.randrange(population)
    cat = CATEGORIES[n % len(CATEGORIES)]
    sk = f"{STYLES[(n // len(CATEGORIES)) % len(STYLES)]}#{BRANDS[n % len(BRANDS)]}#{n:05d}"
    return {"pk": {"S": cat}, "sk": {"S": sk}}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def random_item(rng: random.Random, key: dict) -> dict:
    item = dict(key)
    item["Description"] = {"S": _text(rng, rng.randint(3, 20))}
    item["Price"] = {"N": str(rng.randint(1, 100_000))}
    item["Thumbnail"] = {"S": f"https://storage.example.com/{''.join(rng.choices(string.ascii_lowercase, k=10))}.png"}
    if rng.random() < 0.3:
        item["Color"] = {"SS": sorted({rng.choice(("red", "blue", "green", "黒")) for _ in range(3)})}
    if rng.random() < 0.2:
        item["Rating"] = {"N": f"{rng.randint(0, 5)}.{rng.randint(0, 9)}"}
    if rng.random() < 0.01:
        item["Manual"] = {"S": "x" * LARGE_VALUE_CHARS}
    return item


def operations(seed: int, count: int, population: int = 200) -> Iterator[Op]:
    """``count`` operations over ``population`` products; bursts on one key keep
    several changes to one item inside one second."""
    rng = random.Random(seed)
    i = 0
    while i < count:
        key = product_key(rng, population)
        burst = rng.choice((1, 1, 1, 2, 3)) if rng.random() < 0.2 else 1
        for _ in range(min(burst, count - i)):
            roll = rng.random()
            if roll < 0.45:
                yield Op("put", key, item=random_item(rng, key))
            elif roll < 0.70:
                attrs = {"Price": {"N": str(rng.randint(1, 100_000))}}
                if rng.random() < 0.5:
                    attrs["Stock"] = {"N": str(rng.randint(0, 500))}
                if rng.random() < 0.3:
                    attrs["Description"] = {"S": _text(rng, 5)}
                yield Op("update", key, set_attrs=attrs)
            elif roll < 0.85:
                yield Op("remove_attrs", key, remove_attrs=tuple(rng.sample(("Thumbnail", "Stock", "Color", "Rating"), 2)))
            else:
                yield Op("delete", key)
            i += 1


def apply(dynamodb, table: str, op: Op) -> None:
    """Apply one operation with the low-level boto3 client."""
    if op.kind == "put":
        dynamodb.put_item(TableName=table, Item=op.item)
    elif op.kind == "update":
        names = {f"#a{i}": name for i, name in enumerate(op.set_attrs)}
        values = {f":v{i}": value for i, value in enumerate(op.set_attrs.values())}
        expr = "SET " + ", ".join(f"#a{i} = :v{i}" for i in range(len(op.set_attrs)))
        dynamodb.update_item(TableName=table, Key=op.key, UpdateExpression=expr,
                             ExpressionAttributeNames=names, ExpressionAttributeValues=values)
    elif op.kind == "remove_attrs":
        names = {f"#r{i}": name for i, name in enumerate(op.remove_attrs)}
        dynamodb.update_item(TableName=table, Key=op.key, UpdateExpression="REMOVE " + ", ".join(names),
                             ExpressionAttributeNames=names,
                             ConditionExpression="attribute_exists(pk)")
    elif op.kind == "delete":
        dynamodb.delete_item(TableName=table, Key=op.key)


def apply_quietly(dynamodb, table: str, op: Op) -> bool:
    """Apply; a REMOVE on a missing item is a no-op (False), not an error."""
    from botocore.exceptions import ClientError

    try:
        apply(dynamodb, table, op)
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException":
            return False
        raise


def create_table(dynamodb, table: str, partition: str = "pk", sort: Optional[str] = "sk") -> str:
    """Create a pay-per-request table with a NEW_AND_OLD_IMAGES stream; returns its stream ARN."""
    attrs = [{"AttributeName": partition, "AttributeType": "S"}]
    schema = [{"AttributeName": partition, "KeyType": "HASH"}]
    if sort:
        attrs.append({"AttributeName": sort, "AttributeType": "S"})
        schema.append({"AttributeName": sort, "KeyType": "RANGE"})
    desc = dynamodb.create_table(
        TableName=table, AttributeDefinitions=attrs, KeySchema=schema, BillingMode="PAY_PER_REQUEST",
        StreamSpecification={"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"},
    )["TableDescription"]
    return desc["LatestStreamArn"]


def scan_all(dynamodb, table: str) -> list:
    from ddb2bt.pipeline.clients.dynamodb import scan_items

    return list(scan_items(dynamodb, table))
