"""hardware.ssh_options: split into words, and only the allow-listed options reach ssh (issue 26, defect 1).

The same check runs wherever a config names other machines: ``zeropipe train``/``check`` on the
command line (``resolve_layout``), the UI trusted with --trust-multinode, and the ssh command line
itself (``ssh_command``), so a config file from elsewhere cannot make ssh run a command here.
"""

from __future__ import annotations

import pytest

from zeropipe.config.schema import HardwareSection
from zeropipe.errors import ConfigError
from zeropipe.launch.multinode import ssh_command
from zeropipe.launch.nodes import Node, NodeLayout, parse_hostfile_text, resolve_layout, ssh_arguments

PWN = "sh -c 'id > /tmp/pwned.txt'"


@pytest.mark.parametrize(
    "options",
    [
        f"-oProxyCommand={PWN}",
        f"-o ProxyCommand='{PWN}'",
        f"-o 'ProxyCommand {PWN}'",
        "-o proxycommand=nc %h %p",  # ssh's keys are case-insensitive
        "-J attacker@evil.example",
        "-Jattacker@evil.example",
        "-o ProxyJump=attacker@evil.example",
        f"-o PermitLocalCommand=yes -o LocalCommand={PWN}",
        "-o PermitLocalCommand=yes",
        "-F /tmp/attacker_ssh_config",
        "-F/tmp/attacker_ssh_config",
        "-o Include=/tmp/attacker_ssh_config",
        "-o Match=exec",
        "-o KnownHostsCommand=/bin/sh",
        "-o PKCS11Provider=/tmp/evil.so",
        "-E /home/user/.bashrc",
        "-L 8080:localhost:80",
        "-o User=$(id)",  # a value is one plain word: no shell characters
        "-l -oProxyCommand=x",  # a value never starts with '-'
        "evil-host",  # a stray word would become the host (and the real host the command)
        "-p notaport",
    ],
)
def test_anything_outside_the_allow_list_is_refused_naming_the_key(options):
    with pytest.raises(ConfigError) as err:
        ssh_arguments(options)
    assert err.value.problems[0][0] == "hardware.ssh_options"
    # The same refusal when the config is resolved, before any ssh starts.
    with pytest.raises(ConfigError):
        resolve_layout(HardwareSection(nodes=["box1", "box2"], ssh_options=options), 1, {})


def test_the_usual_options_pass_each_as_one_named_option(monkeypatch):
    monkeypatch.setenv("HOME", "/home/trainer")
    arguments = ssh_arguments("-i ~/.ssh/cluster_key -l trainer -p 2222 -o StrictHostKeyChecking=no -oUserKnownHostsFile=/dev/null -o 'ConnectTimeout 5' -q")
    assert arguments == [
        "-o", "IdentityFile=/home/trainer/.ssh/cluster_key", "-o", "User=trainer", "-o", "Port=2222", "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5", "-q",
    ]  # fmt: skip


@pytest.mark.parametrize("host", ["-oProxyCommand=sh -c id", "-oProxyCommand=id", "box1;id", "box 1", "$(id)", ""])
def test_a_host_name_that_is_an_option_or_a_shell_word_is_refused(host, tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_layout(HardwareSection(nodes=["box1", host]), 1, {})
    assert err.value.problems[0][0] == "hardware.nodes[1]"
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"box1 slots=1\n{host} slots=1\n")
    if host.strip() and " " not in host:
        with pytest.raises(ConfigError, match="line 2 does not start with a host name"):
            parse_hostfile_text(hostfile.read_text(), str(hostfile))
    with pytest.raises(ConfigError):
        resolve_layout(HardwareSection(master_addr=host or "-x", nodes=["box1", "box2"]), 1, {})


def test_the_ssh_command_passes_only_checked_options_and_ends_them_before_the_host():
    layout = NodeLayout([Node("box1", 1), Node("box2", 1)], "box1", "ssh", "hardware.nodes", 2222, "-l trainer")
    command = ssh_command(layout, "box2", ["python", "-m", "zeropipe.launch.node"])
    assert command[command.index("--") + 1] == "box2" and ["-o", "User=trainer"] == command[command.index("User=trainer") - 1 : command.index("User=trainer") + 1]
    smuggled = NodeLayout(layout.nodes, "box1", "ssh", "hardware.nodes", None, "-oProxyCommand=id")  # a layout built without resolve_layout
    with pytest.raises(ConfigError):
        ssh_command(smuggled, "box2", ["true"])
    with pytest.raises(ConfigError):
        ssh_command(layout, "-oProxyCommand=id", ["true"])
