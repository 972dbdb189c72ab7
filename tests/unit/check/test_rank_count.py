"""A rank count below 1 is one message from `check` and `train`, before anything starts."""

import pytest

from tests.integration.conftest import tiny_run_config, write_config
from zeropipe.cli.main import main
from zeropipe.errors import LaunchError
from zeropipe.launch.supervisor import Supervisor
from zeropipe.rundir import RunDir


@pytest.mark.parametrize("command", ["check", "train"])
@pytest.mark.parametrize("gpus", ["0", "-1"])
def test_no_ranks_is_refused_with_the_key_and_the_fix(tmp_path, capsys, command, gpus):
    config = write_config(tmp_path, tiny_run_config(tmp_path))
    assert main([command, str(config), f"hardware.gpus={gpus}"]) == 2
    err = capsys.readouterr().err
    assert f"hardware.gpus: must be at least 1 (you set {gpus})" in err
    assert "Traceback" not in err and "no problems found" not in err
    assert not (tmp_path / "runs").exists()


def test_the_supervisor_refuses_to_wait_for_no_ranks(tmp_path):
    with pytest.raises(LaunchError, match="at least 1"):
        Supervisor(RunDir(tmp_path), 0, "cpu")
