"""edgeq mender: wrap a bundle archive in a Mender Artifact (payload type "edgeq") for fleets run by Mender."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "mender", help="wrap a bundle in a Mender Artifact for fleets that update through Mender",
        description="Write a Mender Artifact (format 3, module image, payload type 'edgeq') holding BUNDLE.tar.gz. "
                    "Devices install it with edgeq's update module (/usr/share/mender/modules/v3/edgeq; "
                    "the file is edgeq's templates/mender-update-module), with its verifier in "
                    "/usr/share/edgeq/verifier: --module-files DIR writes both.")
    parser.add_argument("bundle", type=Path, nargs="?", help="the bundle archive (.tar.gz) edgeq package wrote")
    parser.add_argument("-o", "--output", type=Path, help="the artifact to write (default: BUNDLE with .mender for .tar.gz)")
    parser.add_argument("--device-type", action="append", default=[], metavar="T",
                        help="a Mender device type the artifact is for; repeatable (default: the profile's board names "
                             "and the profile's name)")
    parser.add_argument("--artifact-name", metavar="N", help="Mender artifact name (default: the bundle id)")
    parser.add_argument("-k", "--key", type=Path, metavar="KEY.pem",
                        help="sign the artifact for Mender (ArtifactVerifyKey on the device): an ECDSA P-256 or RSA "
                             "private key in PEM; the bundle's own ed25519 signature is checked by the update module")
    parser.add_argument("--pub", type=Path, metavar="KEY",
                        help="ed25519 public key the bundle must be signed with before it is wrapped")
    parser.add_argument("--module-files", type=Path, metavar="DIR",
                        help="write what each device installs once, as a root file system overlay, and stop: "
                             "DIR/usr/share/mender/modules/v3/edgeq and its verifier DIR/usr/share/edgeq/verifier/")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def default_output(bundle: Path) -> Path:
    name = bundle.name[: -len(".tar.gz")] if bundle.name.endswith(".tar.gz") else bundle.stem
    return bundle.with_name(f"{name}.mender")


def run(args, env) -> int:
    from edgeq.errors import UsageError
    from edgeq.mender import MenderArgs, write_artifact, write_module_files

    if args.module_files is not None:
        if args.bundle is not None:
            raise UsageError("--module-files writes the device's update module and stops; give it without a bundle")
        files = write_module_files(args.module_files)
        if args.json:
            print(json.dumps({"module_files": [str(f) for f in files]}, indent=2), file=env.stdout)
        else:
            print("wrote " + ", ".join(str(f) for f in files), file=env.stdout)
        return 0
    if args.bundle is None:
        raise UsageError("give the bundle .tar.gz to wrap (or --module-files DIR)")
    result = write_artifact(MenderArgs(bundle=args.bundle, output=args.output or default_output(args.bundle),
                                       device_types=tuple(args.device_type), artifact_name=args.artifact_name,
                                       key=args.key, bundle_key=args.pub))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2), file=env.stdout)
    else:
        print(f"wrote {result.artifact} ({result.bytes / 1e6:.1f} MB): artifact {result.artifact_name} for "
              f"{', '.join(result.device_types)}; provides {', '.join(f'{k}={v}' for k, v in result.provides.items())}; "
              f"{'signed' if result.signed else 'unsigned'} for Mender", file=env.stdout)
    return 0
