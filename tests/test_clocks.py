"""A Jetson's power mode and clocks in every measurement (#66 item 5, ``edgeq.rpc.clocks``): ``edgeq bench`` records
the nvpmodel mode and the GPU, EMC and CPU clocks (and whether each is locked); ``--power-mode NAME|ID`` and
``--lock-clocks`` set them for the run and put them back afterwards, also when the run fails. The device is a real
TVM RPC server on loopback (``edgeq rpc serve --device-profile jetson-orin-nano``) over a sysfs tree laid out as an
Orin's, with stand-ins for JetPack's ``nvpmodel`` and ``jetson_clocks`` that keep their state in files."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import run_cli
from test_rpc import bundle as host_bundle  # noqa: F401 - test_rpc's fixture: a host bundle of resnet_cnn
from edgeq.rpc import clocks

NVPMODEL = """#!/bin/sh
# JetPack's nvpmodel, as far as edgeq uses it: -q prints the mode's name and id, -m ID sets it
state="$EDGEQ_FAKE_JETSON/mode"
case "$1" in
  -q) id=$(cat "$state")
      case "$id" in 0) name=15W ;; 1) name=7W ;; 2) name=MAXN_SUPER ;; esac
      echo "NV Fan Mode:quiet"; echo "NV Power Mode: $name"; echo "$id" ;;
  -m) echo "$2" > "$state"; echo "$2" >> "$EDGEQ_FAKE_JETSON/history" ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
esac
"""
JETSON_CLOCKS = """#!/bin/sh
# JetPack's jetson_clocks: --store FILE saves the clocks' settings, no argument locks them at their maximum,
# --restore FILE puts the saved ones back
root="$EDGEQ_FAKE_JETSON/root"
gpu="$root/sys/class/devfreq/17000000.gpu"; emc="$root/sys/kernel/debug/bpmp/debug/clk/emc"
case "$1" in
  --store) { cat "$gpu/min_freq"; for c in "$root"/sys/devices/system/cpu/cpu*/cpufreq; do cat "$c/scaling_min_freq"; done
             cat "$emc/mrq_rate_locked"; } > "$2" ;;
  --restore) { read g; cat "$gpu/min_freq" > /dev/null; echo "$g" > "$gpu/min_freq"
               for c in "$root"/sys/devices/system/cpu/cpu*/cpufreq; do read v; echo "$v" > "$c/scaling_min_freq"; done
               read e; echo "$e" > "$emc/mrq_rate_locked"; } < "$2" ;;
  "") cat "$gpu/max_freq" > "$gpu/min_freq"
      for c in "$root"/sys/devices/system/cpu/cpu*/cpufreq; do cat "$c/scaling_max_freq" > "$c/scaling_min_freq"; done
      echo 1 > "$emc/mrq_rate_locked" ;;
esac
"""


def fake_jetson(folder: Path) -> dict:
    """An Orin Nano in MAXN_SUPER with its clocks free: sysfs (GPU devfreq in Hz, six cores' cpufreq in kHz, the
    EMC's rate in debugfs) under ``folder/root``, the two commands in ``folder/bin``; the environment to run with."""
    root = folder / "root"
    gpu = root / "sys/class/devfreq/17000000.gpu"
    gpu.mkdir(parents=True)
    for name, hz in (("cur_freq", 612000000), ("min_freq", 306000000), ("max_freq", 1020000000)):
        (gpu / name).write_text(f"{hz}\n")
    for core in range(6):
        cpu = root / f"sys/devices/system/cpu/cpu{core}/cpufreq"
        cpu.mkdir(parents=True)
        for name, khz in (("scaling_cur_freq", 1510400), ("scaling_min_freq", 115200), ("scaling_max_freq", 1728000)):
            (cpu / name).write_text(f"{khz}\n")
    emc = root / "sys/kernel/debug/bpmp/debug/clk/emc"
    emc.mkdir(parents=True)
    (emc / "rate").write_text("3199000000\n")
    (emc / "mrq_rate_locked").write_text("0\n")
    (folder / "mode").write_text("2\n")
    bin_ = folder / "bin"
    bin_.mkdir()
    for name, text in (("nvpmodel", NVPMODEL), ("jetson_clocks", JETSON_CLOCKS)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod((bin_ / name).stat().st_mode | stat.S_IEXEC)
    return {"EDGEQ_FAKE_JETSON": str(folder), "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}


def minimums(folder: Path) -> tuple:
    root = folder / "root/sys"
    return ((root / "class/devfreq/17000000.gpu/min_freq").read_text().strip(),
            (root / "devices/system/cpu/cpu3/cpufreq/scaling_min_freq").read_text().strip(),
            (root / "kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked").read_text().strip())


def test_nvpmodel_query_and_mode_names():
    assert clocks.parse_nvpmodel("NV Fan Mode:quiet\nNV Power Mode: MAXN_SUPER\n2\n") == {"id": 2, "name": "MAXN_SUPER"}
    assert clocks.parse_nvpmodel("nvpmodel: command not found") is None
    modes = [{"id": 0, "name": "15W"}, {"id": 1, "name": "7W"}, {"id": 2, "name": "MAXN_SUPER"}]
    assert clocks.resolve_mode("maxn_super", modes) == 2 and clocks.resolve_mode("1", modes) == 1
    with pytest.raises(clocks.ClockError, match=r"unknown power mode 'MAXN'; this device's: 15W \(0\), 7W \(1\), "
                                                r"MAXN_SUPER \(2\)"):
        clocks.resolve_mode("MAXN", modes)
    with pytest.raises(clocks.ClockError, match="power mode 9 is none of this device's"):
        clocks.resolve_mode("9", modes)


def test_the_state_of_a_jetson_read_from_sysfs_and_nvpmodel(tmp_path, monkeypatch):
    env = fake_jetson(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    state = clocks.read_state({}, str(tmp_path / "root"))
    assert state["nvpmodel"] == {"id": 2, "name": "MAXN_SUPER"}
    assert state["gpu"] == {"mhz": 612.0, "min_mhz": 306.0, "max_mhz": 1020.0, "locked": False}
    assert state["cpu"]["mhz"] == 1510.4 and state["cpu"]["cores"] == 6 and state["cpu"]["locked"] is False
    assert state["emc"] == {"mhz": 3199.0, "locked": False} and state["locked"] is False
    settings = clocks.Settings({"nvpmodel_modes": [{"id": 1, "name": "7W"}, {"id": 2, "name": "MAXN_SUPER"}]})
    assert settings.apply("7W", True) == {"previous_mode": 2, "locked": True}
    locked = clocks.read_state({}, str(tmp_path / "root"))
    assert locked["nvpmodel"]["name"] == "7W" and locked["locked"] is True
    assert clocks.describe(locked) == "7W (nvpmodel 1), GPU 612 MHz locked, EMC 3199 MHz locked, CPU 1510.4 MHz locked"
    settings.restore()
    settings.restore()  # once only
    assert clocks.read_state({}, str(tmp_path / "root"))["nvpmodel"]["name"] == "MAXN_SUPER"
    assert minimums(tmp_path) == ("306000000", "115200", "0")
    # not a Jetson: no nvpmodel, nothing to read, and a mode cannot be set
    monkeypatch.setenv("PATH", "/nonexistent")
    bare = clocks.read_state({}, str(tmp_path / "nothing"))
    assert bare == {"nvpmodel": None, "gpu": None, "cpu": None, "emc": None, "locked": False}
    with pytest.raises(clocks.ClockError, match="cannot set a power mode: no nvpmodel on the device"):
        clocks.Settings({}).apply("7W", False, [{"id": 1, "name": "7W"}])


@pytest.fixture(scope="module")
def jetson(tmp_path_factory):
    """A tracker and an ``edgeq rpc serve`` for jetson-orin-nano over the fake Orin: (tracker, its folder)."""
    from test_rpc import stop, tracker_and_orin

    folder = tmp_path_factory.mktemp("orin")
    addr, procs = tracker_and_orin("orin", folder / "root", env=fake_jetson(folder))
    yield addr, folder
    for proc in procs:
        stop(proc)


def test_bench_records_sets_and_restores_the_mode_and_clocks(jetson, host_bundle):
    addr, folder = jetson
    res = run_cli("bench", host_bundle["archive"], "--rpc", addr, "--key", "orin", "--repeat", "5", "--power", "none",
                  "--json")
    assert res.code == 0, res.stderr
    state = json.loads(res.stdout)["device_state"]
    assert state["nvpmodel"] == {"id": 2, "name": "MAXN_SUPER"} and state["locked"] is False
    assert state["gpu"]["max_mhz"] == 1020.0 and state["emc"]["mhz"] == 3199.0 and state["cpu"]["cores"] == 6
    assert state["set"] == {"power_mode": None, "lock_clocks": False}

    history = folder / "history"
    before = history.read_text().split() if history.exists() else []
    res = run_cli("bench", host_bundle["archive"], "--rpc", addr, "--key", "orin", "--repeat", "5", "--power", "none",
                  "--power-mode", "7w", "--lock-clocks", "--json")
    assert res.code == 0, res.stderr
    state = json.loads(res.stdout)["device_state"]
    assert state["nvpmodel"] == {"id": 1, "name": "7W"} and state["locked"] is True  # what the runs ran under
    assert state["gpu"]["locked"] and state["cpu"]["locked"] and state["emc"]["locked"]
    assert state["set"] == {"power_mode": "7w", "lock_clocks": True, "previous_mode": 2, "locked": True}
    assert (folder / "mode").read_text().strip() == "2"  # and afterwards, as before
    assert minimums(folder) == ("306000000", "115200", "0")
    assert history.read_text().split() == before + ["1", "2"]  # set once, put back once

    table = run_cli("bench", host_bundle["archive"], "--rpc", addr, "--key", "orin", "--repeat", "3", "--power", "none")
    assert table.code == 0 and "MAXN_SUPER (nvpmodel 2), GPU 612 MHz, EMC 3199 MHz" in " ".join(table.stdout.split())


def test_an_unknown_power_mode_is_one_line_and_changes_nothing(jetson, host_bundle):
    addr, folder = jetson
    before = (folder / "history").read_text() if (folder / "history").exists() else ""
    res = run_cli("bench", host_bundle["archive"], "--rpc", addr, "--key", "orin", "--repeat", "3",
                  "--power-mode", "MAXN")
    assert res.code == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == ("edgeq: error: on the device: unknown power mode 'MAXN'; this "
                                                   "device's: 15W (0), 7W (1), MAXN_SUPER (2)")
    assert (folder / "mode").read_text().strip() == "2"
    assert ((folder / "history").read_text() if (folder / "history").exists() else "") == before


def test_the_mode_is_restored_when_the_run_fails(tmp_path, monkeypatch, host_bundle):
    """Here (no RPC): the timed runs fail after the mode is set and the clocks locked; both are back afterwards, and
    the run's error is the one reported."""
    from edgeq.rpc import bench as bench_module

    env = fake_jetson(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def broken(*_args, **_kwargs):
        assert (tmp_path / "mode").read_text().strip() == "1" and minimums(tmp_path)[2] == "1"  # set while it runs
        raise bench_module.BundleError("the model stopped halfway (planted)")

    monkeypatch.setattr(bench_module.contract, "argument_count_problem", broken)  # inside the run, after the set
    monkeypatch.setattr(bench_module, "power_config", lambda manifest: {"nvpmodel_modes": [
        {"id": 1, "name": "7W"}, {"id": 2, "name": "MAXN_SUPER"}]})
    res = run_cli("bench", host_bundle["bundle_dir"], "--repeat", "3", "--power", "none", "--power-mode", "7W",
                  "--lock-clocks")
    assert res.code != 0 and "the model stopped halfway (planted)" in res.stderr
    assert (tmp_path / "mode").read_text().strip() == "2" and minimums(tmp_path) == ("306000000", "115200", "0")


def test_tune_records_each_devices_mode_and_clocks(jetson, tmp_path):
    """``edgeq tune`` reads the mode and clocks of every device of the pool as the search begins (its JSON's
    ``devices.states``, a line a device in the table)."""
    from test_rpc import _conv_model

    addr, _ = jetson
    model = _conv_model(tmp_path / "conv.onnx")
    res = run_cli("tune", model, "--device", "host", "--rpc", addr, "--key", "orin", "--trials", "2",
                  "--records", tmp_path / "tuning.json", "--json")
    assert res.code == 0, res.stderr
    [state] = json.loads(res.stdout)["devices"]["states"]
    assert state["nvpmodel"] == {"id": 2, "name": "MAXN_SUPER"} and state["gpu"]["mhz"] == 612.0
    table = run_cli("tune", model, "--device", "host", "--rpc", addr, "--key", "orin", "--trials", "2",
                    "--records", tmp_path / "tuning.json")
    assert table.code == 0 and "device 1: power mode MAXN_SUPER (nvpmodel 2), GPU 612 MHz" in table.stdout


def test_the_device_is_put_back_when_its_client_goes_away(jetson):
    """A client that set a mode and locked the clocks, then went away without restoring them (killed, its network
    gone): the server's session process puts both back as it ends."""
    import time

    from edgeq.rpc.session import Remote

    addr, folder = jetson
    remote = Remote.open(addr, "orin", 30)
    settle = remote.session.get_function("edgeq.device.settle")
    assert json.loads(settle("7W", 1, "{}")) == {"previous_mode": 2, "locked": True}
    assert (folder / "mode").read_text().strip() == "1" and minimums(folder)[2] == "1"
    del settle, remote  # the session ends with its client
    deadline = time.monotonic() + 30
    while (folder / "mode").read_text().strip() != "2" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (folder / "mode").read_text().strip() == "2" and minimums(folder) == ("306000000", "115200", "0")
