import signal

from zeropipe.launch.diagnose import RankExit, RunSettings, choose_primary, diagnose
from zeropipe.launch.oom import OomEvidence

GB = 2**30  # GiB, as the diagnosis says
SURVIVOR_LOG = [
    "Traceback (most recent call last):",
    '  File "deepspeed/comm/torch.py", line 120, in all_reduce',
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer",
]


def test_sigkill_names_rank_signal_and_host_ram():
    exits = [RankExit(0, -signal.SIGKILL, 10.0, ["loading shard 3 of 4"]), RankExit(1, 1, 10.1, SURVIVOR_LOG)]
    text = diagnose(exits, host_ram_peak_bytes=int(63.8 * GB), host_ram_total_bytes=64 * GB).render()
    assert text.startswith("rank 0 was killed by SIGKILL")
    assert "OOM killer" in text and "host RAM peaked at 63.8 of 64.0 GiB" in text and "ran out of memory" in text
    assert "rank 1 exited 1" in text and "effects, not causes" in text
    assert "loading shard 3 of 4" in text


def test_survivor_that_is_seen_first_is_not_blamed():
    # Both seen dead in the same poll; rank 1's error is a secondary connection reset.
    exits = [RankExit(0, 1, 5.05, ["ValueError: bad shape for lm_head"]), RankExit(1, 1, 5.0, SURVIVOR_LOG)]
    assert choose_primary(exits).rank == 0
    assert "bad shape for lm_head" in diagnose(exits, 0, GB).render()


def test_known_cause_gets_its_fix():
    log = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    diagnosis = diagnose([RankExit(3, 1, 1.0, log), RankExit(0, -15, 61.0)], 0, GB)
    assert diagnosis.rank == 3
    assert "GPU ran out of memory" in diagnosis.cause and "gradient_checkpointing" in diagnosis.fix


def test_recorded_exception_message_is_the_cause():
    error = {"type": "CheckpointError", "message": "checkpoint step_8 does not match", "user_error": True, "traceback": ""}
    diagnosis = diagnose([RankExit(1, 1, 2.0, [], error)], 0, GB)
    assert diagnosis.cause == "checkpoint step_8 does not match"


def test_only_secondary_errors_say_to_look_elsewhere():
    diagnosis = diagnose([RankExit(1, 1, 2.0, SURVIVOR_LOG)], 0, GB)
    assert "lost contact with another rank" in diagnosis.cause


def test_a_rank_that_could_not_write_why_on_a_full_disk_is_blamed_on_the_disk():
    # Its log is on the full disk too: only a torch.save error made it out.
    log = ["RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0"]
    diagnosis = diagnose([RankExit(1, 1, 2.0, log), RankExit(0, 1, 2.1, SURVIVOR_LOG)], 0, GB, disk_free_bytes=0)
    assert diagnosis.rank == 1
    assert diagnosis.cause.startswith("the disk holding the run directory is full (0.0 MiB free)")
    assert "free space where the run directory lives" in diagnosis.fix
    # With room on the disk the same error is just the error.
    assert "disk" not in diagnose([RankExit(1, 1, 2.0, log)], 0, GB, disk_free_bytes=50 * GB).cause


def test_a_sigkill_the_records_do_not_call_oom_is_not_blamed_on_memory():
    # The case: a ZeRO-3 run whose RAM peaked at 1.7 of 25.3 GB, killed with kill -9.
    no_kill = OomEvidence(killed_pids=set(), cgroup_kills=0, sources=["the kernel log", "the cgroup's OOM-kill count"])
    exits = [RankExit(0, -signal.SIGKILL, 1.0, pid=4242), RankExit(1, 1, 1.1, SURVIVOR_LOG)]
    diagnosis = diagnose(exits, int(1.7 * GB), int(25.3 * GB), oom=no_kill, settings=RunSettings(zero_stage=3, ranks=2))
    assert diagnosis.cause.startswith("not the OOM killer (the kernel log and the cgroup's OOM-kill count record no OOM kill")
    assert "host RAM peaked at 1.7 of 25.3 GiB" in diagnosis.cause
    assert "zero_stage" not in diagnosis.fix


def test_an_oom_kill_in_the_kernel_log_gets_fixes_the_run_does_not_use_yet():
    evidence = OomEvidence(killed_pids={4242}, sources=["the kernel log"])
    exits = [RankExit(0, -signal.SIGKILL, 1.0, pid=4242)]
    diagnosis = diagnose(exits, int(60 * GB), 64 * GB, oom=evidence, settings=RunSettings(zero_stage=3, ranks=4, offload_optimizer=True))
    assert diagnosis.cause.startswith("the kernel's OOM killer killed it (the kernel log record it)")
    assert "zero_stage: 3" not in diagnosis.fix
    assert "hardware.gpus, now 4" in diagnosis.fix and "deepspeed.offload_optimizer" in diagnosis.fix
    # Stage 2 on one rank: partitioned loading is the first fix, fewer ranks is none.
    single = diagnose(exits, int(60 * GB), 64 * GB, oom=evidence, settings=RunSettings(zero_stage=2, ranks=1))
    assert "deepspeed.zero_stage: 3" in single.fix and "fewer ranks" not in single.fix


def test_without_records_the_headroom_decides():
    exits = [RankExit(0, -signal.SIGKILL, 1.0, pid=4242)]
    roomy = diagnose(exits, int(1.7 * GB), int(25.3 * GB), oom=OomEvidence())
    assert roomy.cause.startswith("probably not the OOM killer: host RAM peaked at 1.7 of 25.3 GiB") and "dmesg" in roomy.cause
    # A container's memory limit is the RAM that counts.
    limited = diagnose(exits, int(7.5 * GB), int(64 * GB), oom=OomEvidence(memory_limit_bytes=8 * GB))
    assert limited.cause.startswith("most likely the kernel's OOM killer: host RAM peaked at 7.5 of 8.0 GiB")


def test_the_tail_shown_skips_known_deprecation_noise(tmp_path):
    from zeropipe.launch.supervisor import tail

    log = tmp_path / "rank0.log"
    warning = (
        "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
        "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed.reduce_scatter_single` instead."
    )
    log.write_text("\n".join(["step 1 loss 5.1"] + [warning, "  return func(*args, **kwargs)"] * 300 + ["step 2 loss 4.9", "RuntimeError: boom"]) + "\n")
    assert tail(log) == ["step 1 loss 5.1", "step 2 loss 4.9", "RuntimeError: boom"]


def test_a_gpu_oom_fix_names_only_what_the_run_does_not_use_yet():
    log = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    saving_everything = RunSettings(zero_stage=3, ranks=4, offload_optimizer=True, offload_param=True, micro_batch_size=1, gradient_checkpointing=True)
    fix = diagnose([RankExit(0, 1, 1.0, log)], 0, GB, settings=saving_everything).fix
    assert "micro_batch_size" not in fix and "gradient_checkpointing" not in fix and "zero_stage" not in fix and "offload" not in fix
    assert "already uses every memory saving" in fix
    fix = diagnose([RankExit(0, 1, 1.0, log)], 0, GB, settings=RunSettings(zero_stage=2, micro_batch_size=8, gradient_checkpointing=True)).fix
    assert "lower train.micro_batch_size (now 8)" in fix and "a higher deepspeed.zero_stage (now 2)" in fix
    assert "gradient_checkpointing" not in fix and "offload_param" not in fix
