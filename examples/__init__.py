"""The example mappings, shipped with the package (``ddb2bt examples`` lists and copies them)."""
