import signal

from zeropipe.launch.diagnose import RankExit, choose_primary, diagnose

GB = 10**9
SURVIVOR_LOG = [
    "Traceback (most recent call last):",
    '  File "deepspeed/comm/torch.py", line 120, in all_reduce',
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer",
]


def test_sigkill_names_rank_signal_and_host_ram():
    exits = [RankExit(0, -signal.SIGKILL, 10.0, ["loading shard 3 of 4"]), RankExit(1, 1, 10.1, SURVIVOR_LOG)]
    text = diagnose(exits, host_ram_peak_bytes=int(63.8 * GB), host_ram_total_bytes=64 * GB).render()
    assert text.startswith("rank 0 was killed by SIGKILL")
    assert "OOM killer" in text and "host RAM peaked at 63.8 of 64.0 GB" in text and "ran out of memory" in text
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
