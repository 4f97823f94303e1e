"""The mapping engine: DynamoDB change records → Bigtable row mutations.

Everything in this package except :mod:`ddb2bt.transforms.dofns` is pure Python with no
I/O and no Beam, so the live path, the backfill and verification all apply one
engine, and it is tested exhaustively without any service.

Modules:
  errors    -- the error taxonomy (retryable vs permanent), shared by the pipeline.
  model     -- frozen values passed between stages (ChangeRecord, RowChange, ...).
  attrs     -- DynamoDB AttributeValue helpers and canonical JSON.
  encoding  -- per-column value encoders/decoders (reversible, documented).
  rowkey    -- row-key templates with injective escaping.
  limits    -- Bigtable's hard limits, enforced before anything is written.
  config    -- the mapping file model, loading and validation (fails fast, names the field).
  mapping   -- the pure function ChangeRecord -> tuple[RowChange, ...].
  compiled  -- the mapping compiled into specialised code (what map_change runs).
  dofns     -- thin Beam wrappers around the above.
"""
