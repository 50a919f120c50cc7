#!/usr/bin/env python3
"""Shows or changes the metadata (`__metadata__`) of a safetensors file by rewriting its header only.

Every tensor byte stays as it is: the data offsets in a safetensors header count from the end of
the header, so a new header in front of the same bytes is a valid file. The script checks that
the bytes after the new header are identical to the old ones before it replaces the file. It
needs only Python's standard library (no torch), so the committed fixture dumps can be given
mladb's dump metadata (the keys are defined in src/debug/external.rs, `meta_key`) without
regenerating them.

Usage:
    python3 tools/dump_metadata.py FILE                                  # print the metadata
    python3 tools/dump_metadata.py FILE --set KEY=VALUE ... [--drop KEY ...]
    python3 tools/dump_metadata.py FILE --replace --set KEY=VALUE ...    # only the keys given
"""

import argparse
import json
import os
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise SystemExit(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise SystemExit(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(data[8 : 8 + n])
    return header, data[8 + n :]


def encode(header):
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # Pad with spaces so that the tensor data starts 8-byte aligned, as safetensors writes it.
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--drop", action="append", default=[], metavar="KEY")
    ap.add_argument("--replace", action="store_true", help="drop every key not given with --set")
    args = ap.parse_args()

    header, body = read(args.file)
    meta = {} if args.replace else dict(header.get("__metadata__") or {})
    if not (args.set or args.drop or args.replace):
        json.dump(meta, sys.stdout, indent=2, sort_keys=True, ensure_ascii=False)
        print()
        return
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item}: expected KEY=VALUE")
        meta[key] = value
    for key in args.drop:
        meta.pop(key, None)
    header = {k: v for k, v in header.items() if k != "__metadata__"}
    if meta:
        header = {"__metadata__": meta, **header}
    out = encode(header) + body

    (n,) = struct.unpack("<Q", out[:8])
    if out[8 + n :] != body:
        raise SystemExit("internal error: the tensor bytes would change")
    tmp = args.file + ".tmp"
    with open(tmp, "wb") as f:
        f.write(out)
    os.replace(tmp, args.file)
    print(f"{args.file}: metadata {json.dumps(meta, sort_keys=True, ensure_ascii=False)}")


if __name__ == "__main__":
    main()
