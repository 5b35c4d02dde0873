"""Functions the ``edgeq rpc serve`` process registers for clients: power sampling on the device side,
in the same time window as the latency runs. Session processes are forked from the server, so they
inherit these registrations."""

from __future__ import annotations

import json

_active: dict = {}


def register(profile_config: dict | None = None, sysfs_root: str = "") -> None:
    """``profile_config``: this device's own rails (``edgeq rpc serve --device-profile``), preferred over the
    client's guess; ``sysfs_root``: where sysfs is mounted, when not at / (containers)."""
    import tvm_ffi

    from edgeq.rpc.power import Sampler

    @tvm_ffi.register_global_func("edgeq.power.start", override=True)
    def power_start(source: str, config_json: str) -> str:
        config = dict(profile_config or json.loads(config_json))
        if sysfs_root and config.get("hwmon_glob"):
            config["hwmon_glob"] = sysfs_root.rstrip("/") + config["hwmon_glob"]
        sampler = Sampler(source, config).start()
        _active["sampler"] = sampler
        return sampler.source

    @tvm_ffi.register_global_func("edgeq.power.stop", override=True)
    def power_stop() -> str:
        sampler = _active.pop("sampler", None)
        return json.dumps(sampler.stop() if sampler else {"source": "none", "samples": 0, "average_mw": {}})

    @tvm_ffi.register_global_func("edgeq.device.info", override=True)
    def info() -> str:
        import platform

        import tvm

        return json.dumps({"machine": platform.machine(), "tvm": tvm.__version__})
