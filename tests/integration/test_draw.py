"""Draw outside training (the UI's Draw page) with a video model: a tiny Wan pipeline folder, as a full export is, writes a playable clip."""

from __future__ import annotations

from pathlib import Path

import av
import pytest

from zeropipe.families.diffusion.pipelines import build_tiny_pipeline
from zeropipe.families import draw, load_drawing

pytestmark = pytest.mark.integration


def test_a_video_pipeline_draws_a_clip_of_the_frames_asked_for(tmp_path):
    build_tiny_pipeline({"pipeline": "tiny-wan"}, tmp_path / "wan", seed=0)
    loaded = load_drawing(tmp_path / "wan", device="cpu")
    assert loaded.source.family == "diffusion" and str(loaded.device) == "cpu"
    files = draw(loaded, tmp_path / "out", "a red circle moving left", width=32, height=48, steps=2, guidance=4.0, seed=1, frames=5)
    assert files == [{"file": "clip.mp4", "preview": "clip.webp", "kind": "video", "width": 32, "height": 48, "frames": 5}]
    with av.open(str(tmp_path / "out" / "clip.mp4")) as container:
        frames = [frame for frame in container.decode(video=0)]
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 48)
    assert (tmp_path / "out" / "clip.webp").stat().st_size > 0


def test_a_language_model_does_not_draw(tmp_path):
    from tests.e2e.fake_runs import write_run
    from zeropipe.errors import ZeroPipeError

    run = write_run(tmp_path, "text", steps=12)
    with pytest.raises(ZeroPipeError, match="it writes text, it does not draw"):
        load_drawing(Path(run), device="cpu")
