"""Real OpenSSH servers on loopback ports for the fleet tests: one sshd per "device", each with its own host
key, an authorized client key, and its own release root."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip() if path.suffix else Path(f"{path}.pub").read_text().strip()


@dataclasses.dataclass
class SshHost:
    name: str
    dir: Path
    port: int
    client_key: Path
    proc: subprocess.Popen | None = None
    sftp: bool = True  # False: no Subsystem line (minimal images, dropbear without sftp-server)
    extra_config: str = ""  # more sshd_config lines

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def host_key(self) -> Path:
        return self.dir / "host_ed25519"

    def known_hosts_line(self) -> str:
        algo, key = Path(f"{self.host_key}.pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {algo} {key}"

    def start(self) -> None:
        config = self.dir / "sshd_config"
        config.write_text(f"""Port {self.port}
ListenAddress 127.0.0.1
HostKey {self.host_key}
AuthorizedKeysFile {self.dir / 'authorized_keys'}
PidFile {self.dir / 'sshd.pid'}
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin yes
UsePAM no
{"Subsystem sftp internal-sftp" if self.sftp else ""}
LogLevel ERROR
{self.extra_config}
""")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "sshd.log", "ab"), start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.dir / 'sshd.log').read_text()}")
            time.sleep(0.05)
        raise RuntimeError("sshd did not start listening")

    def kill(self) -> None:
        """Kill sshd and every session it serves (sessions call setsid, so walk /proc for descendants)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def new_host_key(self) -> None:
        """Restart with a different host key (a reinstalled or impersonated device)."""
        self.kill()
        for path in (self.host_key, Path(f"{self.host_key}.pub")):
            path.unlink()
        keygen(self.host_key)
        self.start()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def make_hosts(base: Path, count: int, sftp: bool = True, extra_config: str = "") -> tuple[list[SshHost], Path]:
    """``count`` running sshd hosts sharing one client key; returns them and the client key path. ``sftp=False``:
    hosts without the SFTP subsystem; ``extra_config``: more sshd_config lines for each."""
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    base.mkdir(parents=True, exist_ok=True)
    client_key = base / "id_ed25519"
    client_pub = keygen(client_key)
    hosts = []
    for i in range(count):
        d = base / f"host{i}"
        d.mkdir()
        host = SshHost(f"dev{i}", d, free_port(), client_key, sftp=sftp, extra_config=extra_config)
        keygen(host.host_key)
        (d / "authorized_keys").write_text(client_pub + "\n")
        host.root.mkdir()
        host.start()
        hosts.append(host)
    return hosts, client_key
