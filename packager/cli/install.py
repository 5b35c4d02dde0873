"""edgeq install: verify a bundle archive and install it under a release root (what flash does per device)."""

from __future__ import annotations

import json
from pathlib import Path

from edgeq.errors import BundleError, UsageError


def add_parser(sub) -> None:
    parser = sub.add_parser("install", help="verify and install a bundle archive into a release root",
                            description="Verify BUNDLE.tar.gz and unpack it into ROOT/releases/<bundle-id>/, then point "
                                        "ROOT/current at it atomically. Refuses older releases of the same model.")
    parser.add_argument("bundle", type=Path, nargs="?", help="bundle .tar.gz")
    parser.add_argument("--root", type=Path, required=True, help="release root, e.g. /opt/edgeq")
    parser.add_argument("--pub", type=Path, metavar="KEY", help="public key the bundle must be signed with")
    parser.add_argument("--allow-downgrade", action="store_true", help="install an older release than the current one")
    parser.add_argument("--repair-state", action="store_true",
                        help="rebuild ROOT/state.json (anti-rollback floors) from the installed releases that verify "
                             "(with --pub: that are signed by it), then stop; the others are listed as skipped")
    parser.add_argument("--json", action="store_true")


def run(args, env) -> int:
    from edgeq.templates.safebundle import BundleRefused, install, repair_state
    from edgeq.signing import load_public_key

    if args.repair_state:
        try:
            state = repair_state(args.root, load_public_key(args.pub) if args.pub else None)
        except BundleRefused as err:
            raise BundleError(f"cannot repair {args.root}: {err}") from None
        except OSError as err:
            raise BundleError(f"cannot repair {args.root}: {err.strerror}") from None
        skipped = "".join(f"; skipped {s['release']}: {s['reason']}" for s in state["skipped"])
        print(json.dumps(state) if args.json else f"rebuilt {args.root / 'state.json'}: "
              + (", ".join(f"{n} release {m['release']}" for n, m in state["models"].items()) or "no releases")
              + skipped, file=env.stdout)
        return 0
    if args.bundle is None:
        raise UsageError("give the bundle .tar.gz to install (or --repair-state)")
    key = load_public_key(args.pub) if args.pub else None
    try:
        result = install(args.bundle, args.root, key, args.allow_downgrade)
    except BundleRefused as err:
        raise BundleError(f"{args.bundle}: refused: {err}") from None
    except OSError as err:
        raise BundleError(f"cannot install into {args.root}: {err.strerror}") from None
    if args.json:
        print(json.dumps(result), file=env.stdout)
    else:
        state = "already current" if result["already"] else "installed"
        print(f"{state}: {result['bundle_id']} (release {result['release']}) at {result['path']}", file=env.stdout)
    return 0
