"""Functions the ``edgeq rpc serve`` process registers for clients: power sampling on the device side,
in the same time window as the latency runs; the power mode and clocks (read, set for a run, restored). Session processes are forked from the server, so they
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

    def merged(config_json: str) -> dict:
        """The client's config (the bundle's device) under this device's own profile, where it has one."""
        return {**json.loads(config_json or "{}"), **(profile_config or {})}

    @tvm_ffi.register_global_func("edgeq.device.state", override=True)
    def device_state(config_json: str) -> str:
        from edgeq.rpc.clocks import read_state

        return json.dumps(read_state(merged(config_json), sysfs_root))

    @tvm_ffi.register_global_func("edgeq.device.settle", override=True)
    def settle(mode: str, lock: int, config_json: str) -> str:
        """--power-mode and --lock-clocks for this session's run; restored by edgeq.device.restore, or when the
        session process ends (the client gone)."""
        from edgeq.rpc.clocks import ClockError, Settings

        settings = Settings(merged(config_json))
        try:
            applied = settings.apply(mode or None, bool(lock))
        except ClockError as err:  # the user's mistake or the device's refusal: one line for the client
            settings.restore()
            return json.dumps({"error": str(err)})
        _active["settings"] = settings
        return json.dumps(applied)

    @tvm_ffi.register_global_func("edgeq.device.restore", override=True)
    def restore() -> str:
        settings = _active.pop("settings", None)
        if settings is not None:
            settings.restore()
        return ""

    @tvm_ffi.register_global_func("edgeq.device.info", override=True)
    def info() -> str:
        import platform

        import tvm

        return json.dumps({"machine": platform.machine(), "tvm": tvm.__version__})
