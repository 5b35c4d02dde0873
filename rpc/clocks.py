"""A Jetson's power mode and clocks, as a measurement must record them (#66): the nvpmodel mode (``nvpmodel -q``),
the GPU, EMC and CPU clocks from sysfs and whether each is locked (its minimum at its maximum, as ``jetson_clocks``
leaves them); and setting a mode or locking the clocks for a run, restored afterwards (``Settings``). Published
Jetson figures are hard to reproduce without these: a mode changes latency by 2x or more.

Runs on the device (``edgeq rpc serve`` registers it: ``edgeq.rpc.device``) or on this machine. Uses only what
JetPack has: the ``nvpmodel`` and ``jetson_clocks`` commands and sysfs (the EMC rate is in debugfs, readable as
root; without it the EMC clock is reported as unknown). Paths are ``DEFAULTS`` (JetPack 6 on Orin) unless the
config passed in names others; ``root`` prefixes them (a container's sysfs, a test's tree).
"""

from __future__ import annotations

import glob
import multiprocessing.util
import os
import re
import shutil
import subprocess
import tempfile

DEFAULTS = {
    # devfreq of the GPU at 17000000 (Orin: 17000000.ga10b in JetPack 5, 17000000.gpu in JetPack 6; Xavier:
    # 17000000.gv11b): cur_freq, min_freq, max_freq in Hz
    "gpu_devfreq_glob": "/sys/class/devfreq/17000000.*",
    "cpufreq_glob": "/sys/devices/system/cpu/cpu[0-9]*/cpufreq",  # scaling_{cur,min,max}_freq in kHz
    "emc_rate": "/sys/kernel/debug/bpmp/debug/clk/emc/rate",  # Hz
    "emc_locked": "/sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked",  # 1 while jetson_clocks holds it
    "nvpmodel": "nvpmodel",
    "jetson_clocks": "jetson_clocks",
}


class ClockError(RuntimeError):
    """The mode or clocks could not be read or set; ``str()`` is one line for the user."""


def _setting(config: dict, key: str) -> str:
    return config.get(key) or DEFAULTS[key]


def _read_number(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def parse_nvpmodel(text: str) -> dict | None:
    """{"id", "name"} from ``nvpmodel -q``: "NV Power Mode: MAXN_SUPER" and the mode's id on the next line."""
    match = re.search(r"NV Power Mode:\s*(\S+)\s*\n\s*(\d+)", text)
    return {"id": int(match.group(2)), "name": match.group(1)} if match else None


def query_mode(config: dict) -> dict | None:
    """The current nvpmodel mode, None where there is no nvpmodel (not a Jetson)."""
    tool = shutil.which(_setting(config, "nvpmodel"))
    if tool is None:
        return None
    done = subprocess.run([tool, "-q"], capture_output=True, text=True, timeout=30)
    return parse_nvpmodel(done.stdout) if done.returncode == 0 else None


def resolve_mode(text: str, modes) -> int:
    """A mode's id from ``--power-mode NAME|ID`` and the profile's modes ([{id, name}]); a name is matched without
    regard to case."""
    known = {int(m["id"]): str(m["name"]) for m in modes or ()}
    if text.strip().isdigit():
        mode = int(text)
        if known and mode not in known:
            raise ClockError(f"power mode {mode} is none of this device's: {_listing(known)}")
        return mode
    for mode, name in known.items():
        if name.lower() == text.strip().lower():
            return mode
    raise ClockError(f"unknown power mode '{text}'; this device's: {_listing(known) or 'none listed (give an id)'}")


def _listing(known: dict) -> str:
    return ", ".join(f"{name} ({mode})" for mode, name in sorted(known.items()))


def _clock(folder: str, cur: str, low: str, high: str, unit: float) -> dict | None:
    values = [_read_number(os.path.join(folder, name)) for name in (cur, low, high)]
    if values[0] is None:
        return None
    mhz = [None if v is None else round(v / unit, 1) for v in values]
    return {"mhz": mhz[0], "min_mhz": mhz[1], "max_mhz": mhz[2],
            "locked": None if None in mhz[1:] else mhz[1] == mhz[2]}


def read_state(config: dict, root: str = "") -> dict:
    """The mode and clocks now: {"nvpmodel": {id, name} | None, "gpu": clock | None, "cpu": clock | None (the
    first core's, "cores": how many; locked only where every core is), "emc": {"mhz", "locked"} | None, "locked":
    True where every clock read is locked}. A clock: {"mhz", "min_mhz", "max_mhz", "locked"}."""
    root = root.rstrip("/")
    gpu = next((c for c in (_clock(folder, "cur_freq", "min_freq", "max_freq", 1e6)
                            for folder in sorted(glob.glob(root + _setting(config, "gpu_devfreq_glob")))) if c), None)
    cores = [c for c in (_clock(folder, "scaling_cur_freq", "scaling_min_freq", "scaling_max_freq", 1e3)
                         for folder in sorted(glob.glob(root + _setting(config, "cpufreq_glob")))) if c]
    cpu = None
    if cores:
        cpu = {**cores[0], "cores": len(cores),
               "locked": None if any(c["locked"] is None for c in cores) else all(c["locked"] for c in cores)}
    rate = _read_number(root + _setting(config, "emc_rate"))
    held = _read_number(root + _setting(config, "emc_locked"))
    emc = None if rate is None else {"mhz": round(rate / 1e6, 1), "locked": None if held is None else held == 1}
    clocks = [c["locked"] for c in (gpu, cpu, emc) if c is not None]
    return {"nvpmodel": query_mode(config), "gpu": gpu, "cpu": cpu, "emc": emc,
            "locked": bool(clocks) and all(clocks)}


def describe(state: dict | None) -> str:
    """One line for a table: the mode, then each clock and whether it is locked."""
    if not state:
        return "not recorded"
    mode = state.get("nvpmodel")
    parts = [f"{mode['name']} (nvpmodel {mode['id']})" if mode else "no nvpmodel"]
    for name in ("gpu", "emc", "cpu"):
        clock = state.get(name)
        if clock:
            parts.append(f"{name.upper()} {clock['mhz']:g} MHz" + (" locked" if clock.get("locked") else ""))
    return ", ".join(parts)


class Settings:
    """A power mode and locked clocks for the length of a run: ``apply`` sets them and remembers what was there,
    ``restore`` puts it back (also registered to run when the process ends, so a device whose client went away
    mid-run is put back when its session ends)."""

    def __init__(self, config: dict):
        self.config = config
        self.previous_mode: int | None = None
        self.stored: str | None = None

    def apply(self, mode_text: str | None, lock: bool, modes=()) -> dict:
        if mode_text:
            mode = resolve_mode(mode_text, modes or self.config.get("nvpmodel_modes", ()))
            now = query_mode(self.config)
            if now is None:
                raise ClockError("cannot set a power mode: no nvpmodel on the device (JetPack's nvpmodel, run as root)")
            if now["id"] != mode:
                self.previous_mode = now["id"]
                self._run(_setting(self.config, "nvpmodel"), "-m", str(mode))
        if lock:
            tool = _setting(self.config, "jetson_clocks")
            if shutil.which(tool) is None:
                raise ClockError("cannot lock the clocks: no jetson_clocks on the device (JetPack's, run as root)")
            fd, self.stored = tempfile.mkstemp(prefix="edgeq-clocks-")
            os.close(fd)
            self._run(tool, "--store", self.stored)
            self._run(tool)
        # also when the process ends first: the server's session is a multiprocessing child, which leaves through
        # os._exit after its finalizers (atexit handlers do not run there), and a plain process runs them at exit
        multiprocessing.util.Finalize(None, self.restore, exitpriority=10)
        return {"previous_mode": self.previous_mode, "locked": lock}

    def restore(self) -> None:
        """What ``apply`` changed, back; once (later calls do nothing)."""
        stored, previous = self.stored, self.previous_mode
        self.stored = self.previous_mode = None
        errors = []
        if stored:
            try:
                self._run(_setting(self.config, "jetson_clocks"), "--restore", stored)
            except ClockError as err:
                errors.append(str(err))
            finally:
                os.unlink(stored)
        if previous is not None:
            try:
                self._run(_setting(self.config, "nvpmodel"), "-m", str(previous))
            except ClockError as err:
                errors.append(str(err))
        if errors:
            raise ClockError("; ".join(errors))

    @staticmethod
    def _run(*cmd: str) -> None:
        tool = shutil.which(cmd[0])
        if tool is None:
            raise ClockError(f"{cmd[0]} not found on the device")
        try:
            done = subprocess.run([tool, *cmd[1:]], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise ClockError(f"{' '.join(cmd)} did not finish in 60 s") from None
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise ClockError(f"{' '.join(cmd)} failed ({done.returncode}): {why[-1] if why else 'no output'} "
                             "(run the server as root)")
