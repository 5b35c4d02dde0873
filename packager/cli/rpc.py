"""edgeq rpc tracker / edgeq rpc serve: TVM's RPC tracker and server (the device side of bench and tune)."""

from __future__ import annotations

NO_AUTH = ("TVM RPC has no authentication: anyone who can reach the port can run code on the device. "
           "Bind to loopback (the default) and reach devices through SSH tunnels (ssh -L / -R).")


def add_parser(sub) -> None:
    parser = sub.add_parser("rpc", help="run a TVM RPC tracker or device server", description=NO_AUTH)
    rsub = parser.add_subparsers(dest="rpc_cmd", metavar="tracker|serve", required=True)
    tracker = rsub.add_parser("tracker", help="start a tracker", description=f"Start a TVM RPC tracker. {NO_AUTH}")
    tracker.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    tracker.add_argument("--port", type=int, default=9190)
    tracker.add_argument("--port-end", type=int, default=9199)
    serve = rsub.add_parser("serve", help="serve this device to a tracker",
                            description=f"Run a TVM RPC server on this device, registered with a tracker under KEY, "
                                        f"with edgeq's power sampling. {NO_AUTH}")
    serve.add_argument("--tracker", required=True, metavar="HOST:PORT")
    serve.add_argument("--key", required=True, help="device key, e.g. jetson-orin-nano")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=9090)
    serve.add_argument("--port-end", type=int, default=9199)
    serve.add_argument("--device-profile", metavar="DEV", help="this device's profile: its power rails for bench")
    serve.add_argument("--sysfs-root", default="", help="where sysfs is mounted if not at / (containers)")


def run(args, env) -> int:
    from edgeq.rpc.session import parse_addr, run_server, run_tracker

    if args.rpc_cmd == "tracker":
        return run_tracker(args.host, args.port, args.port_end)
    parse_addr(args.tracker)
    if args.device_profile:
        from edgeq.targets import resolve

        resolve(args.device_profile)
    run_server(args.tracker, args.key, args.host, args.port, args.port_end, args.device_profile, args.sysfs_root)
    return 0
