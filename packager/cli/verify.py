"""edgeq verify: check a bundle's signature, file hashes and shape without trusting it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from edgeq.errors import BundleError


def add_parser(sub) -> None:
    parser = sub.add_parser("verify", help="verify a bundle's signature and files",
                            description="Verify a bundle directory or .tar.gz: manifest shape, every file's size and "
                                        "SHA-256, no extra files, and with --pub the ed25519 signature.")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--pub", type=Path, metavar="KEY", help="public key the bundle must be signed with")
    parser.add_argument("--json", action="store_true")


def run(args, env) -> int:
    from edgeq.templates.safebundle import BundleRefused, open_bundle
    from edgeq.signing import load_public_key

    key = load_public_key(args.pub) if args.pub else None
    with tempfile.TemporaryDirectory(prefix="edgeq-verify-") as tmp:
        try:
            _, manifest = open_bundle(args.bundle, tmp, key)
        except BundleRefused as err:
            raise BundleError(f"{args.bundle}: refused: {err}") from None
    result = {"bundle": str(args.bundle), "bundle_id": manifest.bundle_id, "release": manifest.release,
              "files": len(manifest.files), "signature": "verified" if key else "not checked (no --pub)"}
    if args.json:
        print(json.dumps(result), file=env.stdout)
    else:
        print(f"ok: {result['bundle_id']} (release {result['release']}): {result['files']} files match the manifest; "
              f"signature {result['signature']}", file=env.stdout)
    return 0
