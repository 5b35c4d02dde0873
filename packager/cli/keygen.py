"""edgeq keygen: make an ed25519 key pair for signing bundles."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    parser = sub.add_parser("keygen", help="make an ed25519 key pair for signing bundles",
                            description="Write KEYDIR/edgeq_signing.key (private, 0600) and KEYDIR/edgeq_signing.pub.")
    parser.add_argument("--out", type=Path, required=True, metavar="KEYDIR", help="folder for the key pair")
    parser.add_argument("--json", action="store_true")


def run(args, env) -> int:
    from edgeq.signing import keygen

    private, public, kid = keygen(args.out)
    if args.json:
        print(json.dumps({"private_key": str(private), "public_key": str(public), "key_id": kid}), file=env.stdout)
    else:
        print(f"private key {private} (keep it secret)\npublic key  {public} (key id {kid}): put it on devices and "
              "in fleet files", file=env.stdout)
    return 0
