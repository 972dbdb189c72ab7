"""A real OpenSSH server for multi-node tests: two "hosts" on this machine, 127.0.0.1 and 127.0.0.2.

The server listens on a free port of both loopback addresses with a throwaway host key and
accepts one throwaway client key; it runs as the current user (root in CI: sshd needs root
to switch users, and a non-root sshd can only log in as itself, which is all the tests need).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
HOSTS = ("127.0.0.1", "127.0.0.2")


@dataclass
class SshServer:
    port: int
    key: Path
    proc: subprocess.Popen

    @property
    def ssh_options(self) -> str:
        return f"-i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"

    def hardware(self, **extra) -> dict:
        """The hardware section of a run on both hosts, one CPU rank each."""
        return {"gpus": 1, "accelerator": "cpu", "nodes": list(HOSTS), "ssh_port": self.port, "ssh_options": self.ssh_options} | extra

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port_on_both() -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((HOSTS[0], 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as second:
                second.bind((HOSTS[1], port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


def start_sshd(directory: Path, force_command: str | None = None) -> SshServer:
    """Start sshd; ``force_command`` (sshd's ForceCommand) wraps every remote command, the original one in $SSH_ORIGINAL_COMMAND."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True)
    authorized = directory / "authorized_keys"
    authorized.write_text((directory / "client_key.pub").read_text())
    authorized.chmod(0o600)
    port = free_port_on_both()
    config = directory / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                *(f"ListenAddress {host}" for host in HOSTS),
                f"HostKey {directory / 'host_key'}",
                f"AuthorizedKeysFile {authorized}",
                f"PidFile {directory / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "LogLevel ERROR",
                *([f"ForceCommand {force_command}"] if force_command else []),
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    # -D: stays in the foreground, so the test owns the process and stops it.
    proc = subprocess.Popen([SSHD, "-D", "-f", str(config), "-E", str(directory / "sshd.log")])
    server = SshServer(port, directory / "client_key", proc)
    deadline = time.time() + 10
    while time.time() < deadline:
        probe = subprocess.run(
            ["ssh", "-p", str(port), *server.ssh_options.split(), "-o", "BatchMode=yes", HOSTS[1], "true"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"sshd did not accept the test key: {probe.stderr} {(directory / 'sshd.log').read_text()[-2000:]}")
