"""The ground floor: clients that talk to the services (Bigtable, DynamoDB and
DynamoDB Streams, AWS credentials) and the one retry policy they share.

Everything above (control, source, sink, cutover, the CLI) stands on these;
they import ``ddb2bt.transforms`` only, never a floor above them, so a client
can be read, tested and reused on its own (docs/how-it-works.md)."""
