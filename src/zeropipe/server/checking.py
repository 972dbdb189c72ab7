"""What the New-run page shows while the user edits: problems, check findings, the memory plan.

The config is resolved once for this machine (``zeropipe.launch.resolve``), and the checks and
the plan panel read that resolved run. A planner that fails does not take the form down: the
page says "planner unavailable" with the reason. The doctor is imported only when asked for.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.store import RunStore

log = logging.getLogger(__name__)


def check_submission(store: RunStore, raw: dict[str, Any]) -> dict[str, Any]:
    """Validation problems, check findings and the plan of a config, never raising for a bad config."""
    unplanned = {"available": False, "reason": "fix the problems first"}
    try:
        config, absolute = store.validate(raw)
    except ConfigError as err:
        return {"valid": False, "problems": problems_json(err.problems), "findings": [], "plan": unplanned}
    command = command_preview(store, raw, config, absolute)
    from zeropipe.check import check_config

    # Resolved once, for this machine (precision, the DeepSpeed JSON, the hardware): the checks
    # and the plan read the same resolved run, as train's would.
    resolved, unresolved = resolve_for_page(config, store.confinement)
    if isinstance(unresolved.get("refused"), ConfigError):
        # Outside the roots (a DeepSpeed JSON writing elsewhere), a bad hostfile: the launch would be refused the same way.
        return {"valid": False, "problems": problems_json(unresolved["refused"].problems), "findings": [], "plan": unplanned, "command": command}
    try:
        findings = [finding.to_dict() for finding in check_config(resolved or config, hardware=detected_hardware())]
    except ZeroPipeError as err:
        problems = problems_json(err.problems) if isinstance(err, ConfigError) else [{"key": "", "message": str(err)}]
        return {"valid": False, "problems": problems, "findings": [], "plan": unplanned, "command": command}
    except Exception as err:  # noqa: BLE001 - a broken rule must not take the form down; train will say it again
        log.warning("zeropipe check failed: %s", err, exc_info=True)
        findings = [{"rule": "check", "severity": "warning", "key": "", "message": f"the checks could not run ({type(err).__name__}: {err})", "fix": "run zeropipe check on the YAML for details", "link": ""}]
    return {
        "valid": not any(f["severity"] == "error" for f in findings),
        "problems": [],
        "findings": findings,
        "plan": plan_of(resolved) if resolved is not None else unresolved,
        "command": command,
    }


def command_preview(store: RunStore, raw: dict[str, Any], config, absolute: dict[str, Any]) -> dict[str, Any]:
    """The command and config file a launch of this config would write and run (``RunStore.launch_command``)."""
    if not isinstance(raw.get("run"), dict) or not raw["run"].get("name"):
        return {"available": False, "reason": "name the run (run.name): the config file is written as RUNS/configs/NAME.yaml"}
    return {"available": True, **store.launch_command(config, absolute)}


def resolve_for_page(config, confinement=None) -> tuple[Any, dict[str, Any]]:
    """(the resolved run, {}) or (None, the plan panel's reason) when the config cannot be resolved here.

    Resolved confined to the UI's roots, as the launcher will resolve it. A config the launcher
    would refuse when it resolves it (a path of the config or of its DeepSpeed JSON outside the
    roots, a hostfile that is none, ssh options off the allow-list) is the reason's ``refused``
    (a ConfigError); a batch that does not divide over the ranks is the check ZP008's to report.
    """
    try:
        from zeropipe.launch.resolve import resolve_run

        return resolve_run(config, fill_auto_knobs=False, hardware=detected_hardware(), confinement=confinement), {}
    except ConfigError as err:
        if not all(key == "deepspeed.train_batch_size" for key, _ in err.problems):
            return None, {"available": False, "reason": "fix the problems first", "refused": err}
        return None, {"available": False, "reason": f"the planner could not plan this config: {err}"}
    except ZeroPipeError as err:
        return None, {"available": False, "reason": f"the planner could not plan this config: {err}"}
    except Exception as err:  # noqa: BLE001 - the planner is young; its failure must not break the form
        log.warning("resolving the config failed: %s", err, exc_info=True)
        return None, {"available": False, "reason": f"planner unavailable ({type(err).__name__}: {err})"}


def problems_json(problems: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"key": key, "message": message} for key, message in problems]


_hardware: dict[str, Any] = {}
_hardware_lock = threading.Lock()


def detected_hardware():
    """The planner's view of this machine, detected once a minute at most."""
    from zeropipe.plan.hardware import detect_hardware

    with _hardware_lock:
        if not _hardware or time.time() - _hardware["at"] > 60:
            _hardware.update(value=detect_hardware(), at=time.time())
        return _hardware["value"]


def plan_of(resolved) -> dict[str, Any]:
    """The plan panel: the resolved run's plan on the hardware it was resolved for."""
    try:
        result = resolved.plan()
        return {"available": True, "result": to_plain(result), "hardware": to_plain(resolved.hardware)}
    except ZeroPipeError as err:
        return {"available": False, "reason": f"the planner could not plan this config: {err}"}
    except Exception as err:  # noqa: BLE001 - the planner is young; its failure must not break the form
        log.warning("planner failed: %s", err, exc_info=True)
        return {"available": False, "reason": f"planner unavailable ({type(err).__name__}: {err})"}


def to_plain(value: Any) -> Any:
    """A planner object as JSON: its to_dict() when it has one, a dataclass's fields, or itself."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (dict, list, str, int, float, bool)) or value is None:
        return value
    return str(value)


_doctor: dict[str, Any] = {}
_doctor_lock = threading.Lock()


def doctor_report(runs_dir: str, trial_build: bool = False, max_age_seconds: float = 120) -> dict[str, Any]:
    """The doctor's findings (cached for two minutes: it runs nvcc and reads /proc)."""
    try:
        from zeropipe.doctor import run_doctor
    except Exception as err:  # noqa: BLE001
        return {"available": False, "reason": f"doctor unavailable ({type(err).__name__}: {err})"}
    with _doctor_lock:
        fresh = _doctor and time.time() - _doctor["at"] < max_age_seconds and (_doctor["trial_build"] or not trial_build)
        if not fresh:
            try:
                report = run_doctor(runs_dir, trial_build=trial_build)
                _doctor.update(value={"available": True, **to_plain(report)}, at=time.time(), trial_build=trial_build)
            except Exception as err:  # noqa: BLE001
                log.warning("doctor failed: %s", err, exc_info=True)
                return {"available": False, "reason": f"doctor failed ({type(err).__name__}: {err})"}
        return {**_doctor["value"], "checked_at": _doctor["at"]}
