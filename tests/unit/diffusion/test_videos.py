"""Video data for video diffusion models: real mp4 files written and read with PyAV, frame buckets, clips, mixed folders."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.data.images import scan_image_folder
from zeropipe.data.videos import (
    VIDEO_SUFFIXES,
    check_frame_buckets,
    clip_starts,
    generate_moving_shapes_dataset,
    load_clip_for_bucket,
    moving_shape_frames,
    probe_video,
    resampled_frames,
    write_video,
)

WAN = architecture_named("wan")


def test_written_clips_are_h264_mp4_files_that_decode_frame_for_frame(tmp_path):
    import random

    frames = moving_shape_frames("square", "red", "blue", "right", (32, 32), 9, random.Random(0))
    path = write_video(tmp_path / "clip.mp4", frames, fps=16)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and container.format.name.startswith("mov,mp4")
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
    assert decoded.shape == (9, 32, 32, 3)
    # Lossy but close: the square moved right, so its centre of red mass moves right frame by frame.
    red = (decoded[..., 0].astype(int) - decoded[..., 2]) > 100
    centres = [np.nonzero(mask)[1].mean() for mask in red]
    assert all(later > earlier for earlier, later in zip(centres, centres[1:]))
    assert probe_video(path) == (32, 32, 9, 16.0)


def test_a_folder_of_clips_and_stills_scans_with_a_broken_video_reported_by_path(tmp_path):
    folder = generate_moving_shapes_dataset(tmp_path / "data", 8, seed=1, resolution=32, frames=9)
    (folder / "truncated.mp4").write_bytes((folder / "clip_00000.mp4").read_bytes()[:400])
    (folder / "truncated.txt").write_text("a clip cut short")
    (folder / "notes.webm").write_text("not a video at all")
    scan = scan_image_folder(folder, video_probe=probe_video, video_suffixes=VIDEO_SUFFIXES)
    videos = [item for item in scan.items if item.path.suffix == ".mp4"]
    stills = [item for item in scan.items if item.path.suffix == ".png"]
    assert len(videos) == 6 and len(stills) == 2
    assert all(item.frames == 9 and item.fps == 16.0 for item in videos) and all(item.frames == 1 for item in stills)
    assert {item.width for item in videos} == {32, 48}  # square and landscape/portrait clips: resolution buckets get used
    assert sorted(bad.path.name for bad in scan.bad) == ["notes.webm", "truncated.mp4"]
    assert all("cannot be decoded" in bad.reason or "no frame" in bad.reason for bad in scan.bad)
    assert videos[0].caption.startswith("a ") and " moving " in videos[0].caption


def test_an_image_model_scan_ignores_videos(tmp_path):
    folder = generate_moving_shapes_dataset(tmp_path / "data", 8, seed=1, resolution=32, frames=9)
    scan = scan_image_folder(folder)
    assert {item.path.suffix for item in scan.items} == {".png"}


def test_clips_are_resampled_to_the_model_frame_rate_and_cropped_to_their_bucket(tmp_path):
    import random

    frames = moving_shape_frames("circle", "white", "black", "down", (48, 32), 33, random.Random(1))
    path = write_video(tmp_path / "fast.mp4", frames, fps=32)
    width, height, count, fps = probe_video(path)
    assert (width, height, count, fps) == (48, 32, 33, 32.0)
    # 33 frames at 32 fps are 17 frames at 16 fps: every other frame.
    assert resampled_frames(count, fps, 16.0) == 17
    clip = load_clip_for_bucket(path, (32, 32, 9), start=4, fps=fps, target_fps=16.0)
    assert clip.pixels.shape == (3, 9, 32, 32) and clip.original_size == (32, 48) and clip.crop_top_left == (0, 8)
    direct = load_clip_for_bucket(path, (32, 32, 17), start=0, fps=fps, target_fps=16.0).pixels
    assert torch.allclose(clip.pixels, direct[:, 4:13])
    with pytest.raises(Exception, match="ended after"):
        load_clip_for_bucket(path, (32, 32, 17), start=8, fps=fps, target_fps=16.0)


def test_an_image_is_a_one_frame_clip(tmp_path):
    folder = generate_moving_shapes_dataset(tmp_path / "data", 4, seed=1, resolution=32, frames=9)
    still = load_clip_for_bucket(folder / "still_00003.png", (32, 32, 1), start=0, fps=0.0, target_fps=16.0)
    assert still.pixels.shape == (3, 1, 32, 32)


def test_frame_buckets_are_the_lengths_the_vae_accepts():
    assert check_frame_buckets([33, 1, 17], WAN.record.codec.accepts_frames, WAN.record.codec.frame_multiple) == [1, 17, 33]
    with pytest.raises(ValueError, match=r"\[16\].*4k\+1 frames \(e\.g\. 1, 5, 9, 13\)"):
        check_frame_buckets([1, 16], WAN.record.codec.accepts_frames, WAN.record.codec.frame_multiple)
    assert not architecture_named("sdxl").record.codec.accepts_frames(5) and architecture_named("sdxl").record.codec.accepts_frames(1)


@pytest.mark.parametrize(
    ("available", "length", "mode", "starts"),
    [(40, 17, "start", [0]), (40, 17, "middle", [11]), (40, 17, "multiple", [0, 12, 23]), (17, 17, "multiple", [0]), (20, 9, "multiple", [0, 6, 11])],
)
def test_clip_modes(available, length, mode, starts):
    assert clip_starts(available, length, mode) == starts
    assert all(0 <= start and start + length <= available for start in starts)


def test_frame_buckets_the_vae_cannot_encode_are_refused_naming_the_key(tmp_path):
    from zeropipe.config.schema import RunConfig
    from zeropipe.errors import ConfigError
    from zeropipe.families.diffusion.prepare import video_clips

    config = RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-wan"}}, "data": {"path": str(tmp_path), "video": {"frame_buckets": [1, 16]}}})
    with pytest.raises(ConfigError) as raised:
        video_clips(config, WAN, [], [])
    assert "data.video.frame_buckets" in str(raised.value) and "4k+1" in str(raised.value)


def test_videos_become_clips_of_the_longest_bucket_they_fill(tmp_path):
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.prepare import video_clips

    config = RunConfig.model_validate(
        {"model": {"config": {"pipeline": "tiny-wan"}}, "data": {"path": str(tmp_path), "video": {"frame_buckets": [1, 9, 17], "clip_mode": "multiple"}}}
    )
    items = [
        {"path": "a.mp4", "caption": "a", "repeats": 1, "width": 32, "height": 32, "frames": 40, "fps": 16.0},  # 40 frames: 3 clips of 17
        {"path": "b.mp4", "caption": "b", "repeats": 1, "width": 32, "height": 32, "frames": 24, "fps": 24.0},  # 16 frames at 16 fps: 2 clips of 9
        {"path": "c.png", "caption": "c", "repeats": 1, "width": 32, "height": 32, "frames": 1, "fps": 0.0},
    ]
    clips, buckets, fps, sample_frames, notes = video_clips(config, WAN, items, [(32, 32)] * 3)
    assert [(clip["path"], clip["start"], bucket[2]) for clip, bucket in zip(clips, buckets)] == [
        ("a.mp4", 0, 17), ("a.mp4", 12, 17), ("a.mp4", 23, 17), ("b.mp4", 0, 9), ("b.mp4", 7, 9), ("c.png", 0, 1)
    ]
    assert fps == 16.0 and sample_frames == 17 and "1 of 1 frame(s), 2 of 9 frame(s), 3 of 17 frame(s) at 16 fps (multiple)" in notes[-1]


@pytest.mark.parametrize("suffix", [".webm", ".mov", ".gif"])
def test_webm_mov_and_gif_clips_are_read_like_mp4(tmp_path, suffix):
    import random

    from PIL import Image

    frames = moving_shape_frames("circle", "red", "blue", "right", (32, 32), 9, random.Random(0))
    path = tmp_path / f"clip{suffix}"
    if suffix == ".gif":
        images = [Image.fromarray(frame) for frame in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=62, loop=0)
    else:
        write_video(path, frames, fps=16)
    width, height, count, fps = probe_video(path)
    assert (width, height, count) == (32, 32, 9) and 15 < fps < 17
    assert load_clip_for_bucket(path, (32, 32, 9), start=0, fps=fps, target_fps=fps).pixels.shape == (3, 9, 32, 32)
