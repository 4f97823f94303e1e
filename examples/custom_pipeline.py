"""Your own Beam pipeline around ddb2bt's transforms.

Replicates the ProductCatalog table (examples/product_catalog.yaml) with two
steps of our own between ddb2bt's stages:

* ``add_price_band`` adds a computed attribute ``PriceBand`` (low / mid / high)
  to both images of every change, before mapping; the mapping's
  ``other_attributes`` rule stores it as the cell ``SKU:PriceBand``;
* ``keep_change`` drops one entity type (the ``socks`` category) after mapping;
  dropped changes write nothing, yet their stream positions still advance the
  checkpoints.

Run it on the local stack (emulators on 127.0.0.1)::

    .venv/bin/ddb2bt local up --detach
    eval "$(.venv/bin/ddb2bt local env)"
    .venv/bin/python examples/custom_pipeline.py --until-idle 5

(with the source table created and written to, e.g. by ``ddb2bt demo`` or your
own writer). An installed wheel has it as ``python -m ddb2bt.examples.custom_pipeline``.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from decimal import Decimal
from typing import Optional

from ddb2bt.pipeline import (
    FilterChanges, MapToBigtable, ReaderOptions, ReadDynamoDBStream, StateSpec, TransformChanges,
    WriteToBigtableOrdered,
)
from ddb2bt.pipeline.io import load_mapping_arg, prepare_target
from ddb2bt.transforms.model import ChangeRecord

DROPPED_CATEGORY = "socks"
# Price bands in the catalogue's currency units: below LOW is "low", from HIGH up "high".
LOW, HIGH = Decimal(1_000), Decimal(50_000)


def price_band(item: Optional[dict]) -> Optional[dict]:
    """The image with ``PriceBand`` added (a pure function of the image)."""
    if item is None or "N" not in item.get("Price", {}):
        return item
    price = Decimal(item["Price"]["N"])
    band = "low" if price < LOW else "high" if price >= HIGH else "mid"
    return {**item, "PriceBand": {"S": band}}


def add_price_band(record: ChangeRecord) -> ChangeRecord:
    # Both images alike: a later delete then removes the computed cell too.
    return replace(record, new_image=price_band(record.new_image), old_image=price_band(record.old_image))


def keep_change(record: ChangeRecord) -> bool:
    # Decided on the partition key, which is the same for every version of an item.
    return record.keys.get("pk", {}).get("S") != DROPPED_CATEGORY


def build(p, mapping, stream_arn: str, state: StateSpec, reader: ReaderOptions):
    """The graph: ddb2bt's read, map and write, with our two steps in between.
    Returns the dead-letter PCollection."""
    return (
        p
        | "Read" >> ReadDynamoDBStream(stream_arn, state, reader=reader)
        | "AddPriceBand" >> TransformChanges(add_price_band)
        | "Map" >> MapToBigtable(mapping)
        | "DropSocks" >> FilterChanges(keep_change)
        | "Write" >> WriteToBigtableOrdered(state)
    )


def main(argv: Optional[list] = None) -> int:
    from ddb2bt.pipeline.connect.connections import BigtableSpec, dynamodb_client
    from ddb2bt.pipeline.graph import make_pipeline
    from ddb2bt.pipeline.connect.preflight import resolve_stream

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mapping", default="example:product_catalog",
                        help="mapping file or example:NAME (default %(default)s)")
    parser.add_argument("--until-idle", type=float, default=None,
                        help="stop after this many seconds without changes (default: run until Ctrl-C)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    mapping = load_mapping_arg(args.mapping)
    target = mapping.target
    state = StateSpec(BigtableSpec(target.project, target.instance, target.app_profile), job=f"{mapping.name}_custom")
    prepare_target(mapping, state)
    stream_arn = resolve_stream(mapping, dynamodb_client(mapping.source.region)).stream_arn
    reader = ReaderOptions(until_idle_s=args.until_idle, poll_interval_s=0.2)
    # make_pipeline([]) is the local runner ddb2bt uses (Beam's FnApiRunner);
    # pass --runner=DataflowRunner and its options to run it on Dataflow.
    with make_pipeline([]) as p:
        build(p, mapping, stream_arn, state, reader)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
