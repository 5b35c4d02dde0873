"""Power readings on the device: tegrastats lines, INA3221 hwmon sysfs files, NVML. Rails come from the
device profile (their names differ between Orin, Xavier and Nano)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import threading
import time

MAX_TRACE_POINTS = 2000  # the power trace over time: longer windows are averaged down to this many points

# "VDD_IN 5002mW/5002mW" (JetPack 5/6) and "POM_5V_IN 2047/2047" (Nano, JetPack 4: no unit)
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?\b")
_NOT_RAILS = {"RAM", "SWAP", "IRAM", "LFB", "EMC_FREQ", "GR3D_FREQ", "APE", "MTS", "NVENC", "NVDEC"}


def parse_tegrastats(line: str, rails: tuple[str, ...] | list[str] = ()) -> dict[str, float]:
    """Instantaneous power in mW per rail from one tegrastats line (only ``rails`` when given)."""
    out = {}
    for name, now, _avg in _RAIL.findall(line):
        if name in _NOT_RAILS or (rails and name not in rails):
            continue
        out[name] = float(now)
    return out


def read_hwmon(pattern: str, rails: dict[str, int] | None = None) -> dict[str, float]:
    """mW per rail from INA3221 hwmon folders: ``in<N>_label`` names a channel, ``in<N>_input`` is its bus
    voltage in mV and ``curr<N>_input`` its current in mA."""
    out = {}
    for folder in sorted(glob.glob(pattern)):
        for label_path in sorted(glob.glob(os.path.join(folder, "in*_label"))):
            channel = re.search(r"in(\d+)_label$", label_path).group(1)
            try:
                with open(label_path) as f:
                    label = f.read().strip()
                with open(os.path.join(folder, f"in{channel}_input")) as f:
                    millivolts = float(f.read().strip())
                with open(os.path.join(folder, f"curr{channel}_input")) as f:
                    milliamps = float(f.read().strip())
            except (OSError, ValueError):
                continue
            if rails and label not in rails:
                continue
            out[label] = millivolts * milliamps / 1000.0
    return out


def read_nvml() -> dict[str, float]:
    import pynvml  # optional: desktop and data-centre GPUs

    pynvml.nvmlInit()
    try:
        return {f"GPU{i}": float(pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())}
    finally:
        pynvml.nvmlShutdown()


def available(source: str, config: dict) -> bool:
    if source == "sysfs":
        return bool(config.get("hwmon_glob")) and bool(read_hwmon(config["hwmon_glob"], config.get("hwmon_rails")))
    if source == "tegrastats":
        return shutil.which(config.get("tegrastats", "tegrastats")) is not None
    if source == "nvml":
        try:
            return bool(read_nvml())
        except Exception:
            return False
    return False


def choose(source: str, config: dict) -> str:
    """``auto``: sysfs (no subprocess, fast), else tegrastats, else NVML, else none."""
    if source != "auto":
        return source
    return next((s for s in ("sysfs", "tegrastats", "nvml") if available(s, config)), "none")


class Sampler:
    """Samples power in a background thread between ``start()`` and ``stop()``."""

    def __init__(self, source: str, config: dict, interval_s: float = 0.02):
        self.source, self.config, self.interval = choose(source, config), config, interval_s
        self.samples: list[dict[str, float]] = []
        self.times: list[float] = []  # seconds after start(), one per sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._t0 = self._t1 = 0.0

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                reading = (read_hwmon(self.config["hwmon_glob"], self.config.get("hwmon_rails"))
                           if self.source == "sysfs" else read_nvml())
            except Exception:
                reading = {}
            if reading:
                self._add(reading)
            self._stop.wait(self.interval)

    def _tegrastats_loop(self) -> None:
        interval_ms = max(10, int(self.interval * 1000))
        self._proc = subprocess.Popen([self.config.get("tegrastats", "tegrastats"), "--interval", str(interval_ms)],
                                      stdout=subprocess.PIPE, text=True)
        for line in self._proc.stdout:
            reading = parse_tegrastats(line, self.config.get("tegrastats_rails", ()))
            if reading:
                self._add(reading)
            if self._stop.is_set():
                break

    def _add(self, reading: dict[str, float]) -> None:
        self.times.append(time.monotonic() - self._t0)
        self.samples.append(reading)

    def start(self) -> "Sampler":
        self._t0 = time.monotonic()
        if self.source != "none":
            target = self._tegrastats_loop if self.source == "tegrastats" else self._read_loop
            self._thread = threading.Thread(target=target, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._t1 = time.monotonic()
        if self._proc is not None:
            self._proc.terminate()
        if self._thread is not None:
            self._thread.join(timeout=2)
        rails = sorted({r for s in self.samples for r in s})
        average = {r: sum(s.get(r, 0.0) for s in self.samples) / len(self.samples) for r in rails} if self.samples else {}
        return {"source": self.source, "samples": len(self.samples), "window_s": round(self._t1 - self._t0, 4),
                "average_mw": average, "trace": trace(self.times, self.samples, rails)}


def trace(times: list[float], samples: list[dict[str, float]], rails: list[str],
          points: int = MAX_TRACE_POINTS) -> dict:
    """Power over time: ``t_s`` (seconds after sampling started) and, per rail, mW at those times (null where
    a reading missed the rail). More samples than ``points`` are averaged in consecutive groups, so a
    long window stays a few thousand numbers."""
    n = len(samples)
    groups = [(i * n // points, (i + 1) * n // points) for i in range(points)] if n > points else [(i, i + 1) for i in range(n)]
    t_s, mw = [], {r: [] for r in rails}
    for lo, hi in groups:
        t_s.append(round(sum(times[lo:hi]) / (hi - lo), 4))
        for rail in rails:
            values = [s[rail] for s in samples[lo:hi] if rail in s]
            mw[rail].append(round(sum(values) / len(values), 1) if values else None)
    return {"t_s": t_s, "mw": mw}
