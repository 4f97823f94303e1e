"""Writes tests/conformance/incremental/ (run: python tests/conformance/make_incremental_fixtures.py tests/conformance/incremental): DynamoDB incremental exports in the published layout (docs/recover.md#the-incremental-export-format)."""
import gzip, hashlib, io, json, os, shutil, sys
root = sys.argv[1]
ACCOUNT = "123456789012"

def S(v): return {"S": v}
def N(v): return {"N": str(v)}

def gz(lines):
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        for l in lines:
            f.write((json.dumps(l, separators=(",", ":")) + "\n").encode())
    return buf.getvalue()

def export(name, export_id, table, frm, to, files, view="NEW_AND_OLD_IMAGES", etype="INCREMENTAL_EXPORT",
           start="2023-11-15T01:00:00.000Z", end="2023-11-15T01:07:00.000Z", summary=True):
    base = os.path.join(root, name, "AWSDynamoDB")
    d = os.path.join(base, export_id)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "_started"), "w").close()
    if not summary:
        return
    manifest_lines, total = [], 0
    for fname, lines in files:
        data = gz(lines)
        os.makedirs(os.path.join(base, "data"), exist_ok=True)   # incremental exports share AWSDynamoDB/data/
        open(os.path.join(base, "data", fname), "wb").write(data)
        md5 = hashlib.md5(data).hexdigest()
        manifest_lines.append({"itemCount": len(lines), "md5Checksum": md5, "etag": md5,
                               "dataFileS3Key": f"AWSDynamoDB/data/{fname}"})
        total += len(lines)
    with open(os.path.join(d, "manifest-files.json"), "w") as f:
        for m in manifest_lines:
            f.write(json.dumps(m) + "\n")
    summ = {"version": "2023-08-01",
            "exportArn": f"arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/{table}/export/{export_id}",
            "startTime": start, "endTime": end,
            "tableArn": f"arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/{table}",
            "tableId": "0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d", "s3Bucket": "catalog-exports", "s3Prefix": None,
            "s3SseAlgorithm": "AES256", "s3SseKmsKeyId": None,
            "manifestFilesS3Key": f"AWSDynamoDB/{export_id}/manifest-files.json",
            "billedSizeBytes": 10485760, "itemCount": total, "outputFormat": "DYNAMODB_JSON",
            "exportType": etype, "exportFromTime": frm, "exportToTime": to, "outputView": view}
    json.dump(summ, open(os.path.join(d, "manifest-summary.json"), "w"), indent=2)
    open(os.path.join(d, "manifest-summary.checksum"), "w").write(hashlib.md5(json.dumps(summ).encode()).hexdigest())

def line(keys, new=None, old=None, us=0):
    out = {"Metadata": {"WriteTimestampMicros": N(us)}, "Keys": keys}
    if new is not None: out["NewImage"] = new
    if old is not None: out["OldImage"] = old
    return out

def k(pk, sk): return {"pk": S(pk), "sk": S(sk)}
def img(pk, sk, **a):
    d = k(pk, sk); d.update(a); return d

# Window 1: 2023-11-14T20:00:00Z (1699992000) -> 22:00:00Z (1699999200)
w1 = [
  ("a1b2c3d4e5f6a7b8c9d0e1f2a3.json.gz", [
    # modified, an attribute removed (Label) and a set member removed
    line(k("hats", "fedora#1"), img("hats", "fedora#1", Count=N(3), Tags={"SS": ["felt"]}),
         img("hats", "fedora#1", Count=N(2), Label=S("x"), Tags={"SS": ["felt", "wool"]}), 1699995600123456),
    # deleted: only its old image
    line(k("shoes", "b"), None, img("shoes", "b", Count=N(7), Label=S("boot")), 1699996000654321),
    # changed here and again in window 2
    line(k("hats", "beret"), img("hats", "beret", Count=N(1), Label=S("red")),
         img("hats", "beret", Count=N(0)), 1699997000000001),
  ]),
  ("b1c2d3e4f5a6b7c8d9e0f1a2b3.json.gz", []),  # an empty partition: an empty file
]
# Window 2: 22:00:00Z -> 2023-11-15T00:00:00Z (1700006400)
w2 = [
  ("c1d2e3f4a5b6c7d8e9f0a1b2c3.json.gz", [
    line(k("hats", "beret"), img("hats", "beret", Count=N(2), Attrs={"M": {"size": N(56)}}),
         img("hats", "beret", Count=N(1), Label=S("red")), 1700001000500000),
    # inserted (no old image): a re-insert of a key deleted in window 1
    line(k("shoes", "b"), img("shoes", "b", Count=N(8)), None, 1700002000000000),
  ]),
]
shutil.rmtree(root, ignore_errors=True)
export("two_windows", "01699999300000-e1f2a3b4", "Catalog", "2023-11-14T20:00:00.000Z", "2023-11-14T22:00:00.000Z",
       w1, start="2023-11-14T22:10:00.000Z", end="2023-11-14T22:16:00.000Z")
export("two_windows", "01700006500000-f2a3b4c5", "Catalog", "2023-11-14T22:00:00.000Z", "2023-11-15T00:00:00.000Z",
       w2)
# The window before window 1 (19:45 -> 20:00), nothing changed in it: window 1
# holds the job's last applied change, so the boundary sweep reads a little
# before 20:00 and judges what it finds there against this window's lines.
export("lookback", "01699992100000-a1b2c3d4", "Catalog", "2023-11-14T19:45:00.000Z", "2023-11-14T20:00:00.000Z",
       [("d1e2f3a4b5c6d7e8f9a0b1c2d3.json.gz", [])], start="2023-11-14T20:10:00.000Z", end="2023-11-14T20:16:00.000Z")
# A hole: window 2 starts an hour after window 1 ends.
export("hole", "01699999300000-a0a0a0a0", "Catalog", "2023-11-14T20:00:00.000Z", "2023-11-14T22:00:00.000Z", w1)
export("hole", "01700006500000-b0b0b0b0", "Catalog", "2023-11-14T23:00:00.000Z", "2023-11-15T00:00:00.000Z", w2)
# Another table's window.
export("other_table", "01699999300000-c0c0c0c0", "Orders", "2023-11-14T20:00:00.000Z", "2023-11-14T22:00:00.000Z", w1)
# NEW_IMAGE view: deletions carry no old image.
export("new_image_view", "01699999300000-d0d0d0d0", "Catalog", "2023-11-14T20:00:00.000Z",
       "2023-11-14T22:00:00.000Z", w1, view="NEW_IMAGE")
# Still running: _started, no manifest yet.
export("still_running", "01699999300000-e0e0e0e0", "Catalog", "", "", [], summary=False)
