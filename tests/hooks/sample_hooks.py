"""Escape-hatch hooks used by the tests (module:function in a mapping)."""


def split_name(keys, image):
    """One cell per name part, in the row of the item's id."""
    row = b"person#" + keys["id"]["S"].encode()
    full = image.get("Name", {}).get("S", "")
    return [("people", row, "n", f"part{i}".encode(), part.encode(), None) for i, part in enumerate(full.split())]


def broken(keys, image):
    raise RuntimeError("boom")


def bad_shape(keys, image):
    return [("people", "not-bytes", "n", b"q", b"v", None)]
