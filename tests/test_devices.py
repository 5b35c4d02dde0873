import json

import pytest

from edgeq.errors import DeviceError
from edgeq.targets import profiles, resolve
from edgeq.toolchain import host_triple

JETSONS = ["jetson-orin-nano", "jetson-orin-nx", "jetson-agx-orin", "jetson-agx-thor", "jetson-agx-xavier", "jetson-xavier-nx"]


def test_all_required_profiles_exist_with_the_same_shape():
    table = profiles()
    assert set(JETSONS + ["host", "arm64-cpu"]) <= set(table)
    keys = {frozenset(p.to_dict()) for p in table.values()}
    assert len(keys) == 1  # one shape for all
    for name in JETSONS:
        p = table[name]
        assert p.cuda and p.cuda.arch.startswith("sm_") and p.cuda.version
        assert p.cpu.triple == "aarch64-linux-gnu" and p.cpu.cores > 0 and p.memory_mb > 0
        assert p.software["jetpack"] and p.software["l4t"]
        assert p.power.tegrastats_rails and p.power.nvpmodel_modes and p.power.hwmon_glob
    assert table["arm64-cpu"].cuda is None


def test_orin_is_cortex_a78ae_not_the_builtin_tags_carmel():
    for name in ("jetson-orin-nano", "jetson-orin-nx", "jetson-agx-orin"):
        p = profiles()[name]
        assert p.cpu.mcpu == "cortex-a78ae" and p.cuda.arch == "sm_87"
        target = p.tvm_target()
        assert target.kind.name == "cuda" and str(target.host.attrs["mcpu"]) == "cortex-a78ae"
    assert profiles()["jetson-orin-nano"].cpu.cores == 6


def test_host_profile_is_detected():
    host = profiles()["host"]
    assert host.cpu.triple == host_triple()
    assert host.cpu.mcpu not in ("", "detect") and host.cpu.cores >= 1


def test_family_alias_resolves_and_says_so():
    profile, note = resolve("jetson-orin")
    assert profile.name == "jetson-orin-nano"
    assert "jetson-orin-nano" in note
    with pytest.raises(DeviceError, match="valid devices: .*jetson-orin-nano"):
        resolve("jetson-nano")


def test_cli_devices_table_and_json(cli):
    table = cli("devices")
    assert table.code == 0
    for name in JETSONS:
        assert name in table.stdout
    data = json.loads(cli("devices", "--json").stdout)
    by_name = {d["name"]: d for d in data}
    assert by_name["jetson-agx-thor"]["cuda"]["arch"] == "sm_110"
    assert by_name["jetson-orin-nano"]["power"]["tegrastats_rails"] == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]
    assert by_name["host"]["kind"] == "cpu"
