"""edgeq rpc tracker / edgeq rpc serve: TVM's RPC tracker and server (the device side of bench and tune)."""

from __future__ import annotations

from pathlib import Path

NO_AUTH = ("TVM RPC has no authentication: anyone who can reach the port can run code on the device. "
           "Bind to loopback (the default) and reach devices through SSH tunnels (ssh -L / -R).")


def add_parser(sub) -> None:
    parser = sub.add_parser("rpc", help="run a TVM RPC tracker or device server", description=NO_AUTH)
    rsub = parser.add_subparsers(dest="rpc_cmd", metavar="tracker|serve", required=True)
    tracker = rsub.add_parser("tracker", help="start a tracker", description=f"Start a TVM RPC tracker. {NO_AUTH}")
    tracker.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    tracker.add_argument("--port", type=int, default=9190, help="first port to try (default 9190)")
    tracker.add_argument("--port-end", type=int, help="first port not to try (default PORT + 10, at most 65536)")
    serve = rsub.add_parser("serve", help="serve this device to a tracker",
                            description=f"Run a TVM RPC server on this device, registered with a tracker under KEY, "
                                        f"with edgeq's power sampling. {NO_AUTH}")
    serve.add_argument("--tracker", required=True, metavar="HOST:PORT")
    serve.add_argument("--key", required=True, help="device key, e.g. jetson-orin-nano")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    serve.add_argument("--port-end", type=int, help="first port not to try (default PORT + 10, at most 65536)")
    serve.add_argument("--timeout", type=float, default=60, help="seconds to wait for the tracker to answer (default 60)")
    serve.add_argument("--device-profile", metavar="DEV", help="this device's profile: its power rails for bench")
    serve.add_argument("--sysfs-root", default="", help="where sysfs is mounted if not at / (containers)")
    serve.add_argument("--cuda-bridge", default="auto", metavar="auto|off|PATH",
                       help="on a CUDA 12 device (JetPack 6), give the pip TVM (CUDA 13 runtime) the GPU through edgeq's "
                            "bridge: PATH is a bundle's runtime/libcudart.so.13; auto (default) builds one here when needed")


def _cuda_bridge(choice: str, env) -> None:
    """Before serving: let TVM reach a CUDA 12 GPU. An explicit bridge must work; auto only warns."""
    from edgeq.errors import ToolchainError
    from edgeq.runtime.bridge import enable_tvm_cuda

    if choice == "off":
        return
    try:
        said = enable_tvm_cuda(None if choice == "auto" else Path(choice), note=lambda m: print(m, file=env.stderr))
    except ToolchainError as err:
        if choice != "auto":
            raise
        print(f"edgeq rpc: warning: the GPU is not served ({err}); pass --cuda-bridge PATH", file=env.stderr)
        return
    if said:
        print(f"edgeq rpc: {said}", file=env.stderr)


def run(args, env) -> int:
    from edgeq.rpc.session import check_server, run_server, run_tracker, wait_for_tracker

    if args.rpc_cmd == "tracker":
        return run_tracker(args.host, args.port, args.port_end)
    check_server(args.tracker, args.key, args.host, args.port, args.port_end, args.timeout)
    if args.device_profile:
        from edgeq.targets import resolve

        resolve(args.device_profile)
    if args.cuda_bridge not in ("auto", "off"):
        from edgeq.runtime.bridge import check_bridge_file

        check_bridge_file(Path(args.cuda_bridge))
    wait_for_tracker(args.tracker, args.timeout)  # all before the bridge is built
    _cuda_bridge(args.cuda_bridge, env)
    run_server(args.tracker, args.key, args.host, args.port, args.port_end, args.device_profile, args.sysfs_root,
               args.timeout)
    return 0
