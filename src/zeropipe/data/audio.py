"""The audio track of clips: read with PyAV, turned into the mel spectrograms an audio VAE encodes, and muxed into samples.

LTX-2 trains video and its sound together: each clip's audio over the clip's time span is
resampled to the audio VAE's rate (16 kHz, stereo), turned into a log-mel spectrogram and
encoded by the audio VAE (``AutoencoderKLLTX2Audio``) into latents cached with the clip's.
Samples are H.264 mp4 files to which the decoded waveform is added as an AAC stream.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from zeropipe.errors import DataError


def has_audio(path: str | Path) -> bool:
    """Whether a media file holds an audio stream (an image or a silent video has none)."""
    import av

    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except (OSError, av.error.FFmpegError, ValueError):
        return False


def read_audio(path: str | Path, start: float, duration: float, sample_rate: int, channels: int = 2) -> torch.Tensor:
    """The audio of ``duration`` seconds from ``start`` of a file: (channels, duration * sample_rate) float32 in [-1, 1].

    Resampled (and up- or down-mixed) by FFmpeg's resampler through PyAV; a track that ends early is
    padded with silence, as LTX-2's trainer pads it.

    Raises:
        DataError: the file has no audio stream or cannot be decoded.
    """
    import av

    layout = "stereo" if channels == 2 else "mono"
    wanted = int(round(duration * sample_rate))
    first = int(round(start * sample_rate))
    chunks: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise DataError(f"{path}: no audio stream: LTX-2 audio-video training needs clips with sound")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate)
            # Decoded from the start: clips are short, and a seek lands on a packet boundary that would have to be found again.
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
                if sum(chunk.shape[1] for chunk in chunks) >= first + wanted:
                    break
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
    except av.error.FFmpegError as err:
        raise DataError(f"{path}: its audio cannot be decoded ({err})") from None
    samples = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), dtype=np.float32)
    samples = samples[:, first : first + wanted]
    if samples.shape[1] < wanted:
        samples = np.pad(samples, ((0, 0), (0, wanted - samples.shape[1])))
    return torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))


def mel_spectrogram(waveform: torch.Tensor, sample_rate: int, mel_bins: int, hop_length: int, n_fft: int = 1024) -> torch.Tensor:
    """Log-mel spectrograms (batch, channels, frames, mel_bins) of waveforms (batch, channels, samples), as LTX-2's audio VAE takes them.

    The magnitude STFT (Hann window of ``n_fft``, centred frames every ``hop_length`` samples) through
    a Slaney mel filter bank up to half the sample rate, then the natural log clamped at 1e-5: LTX-2's
    audio processor. The filter bank is transformers' (``audio_utils.mel_filter_bank``); torchaudio is
    not a dependency.
    """
    from transformers.audio_utils import mel_filter_bank

    batch, channels, samples = waveform.shape
    filters = torch.from_numpy(
        mel_filter_bank(num_frequency_bins=n_fft // 2 + 1, num_mel_filters=mel_bins, min_frequency=0.0, max_frequency=sample_rate / 2,
                        sampling_rate=sample_rate, norm="slaney", mel_scale="slaney")
    ).float()  # (frequencies, mel_bins)
    flat = waveform.reshape(batch * channels, samples).float()
    spectrum = torch.stft(flat, n_fft=n_fft, hop_length=hop_length, win_length=n_fft, window=torch.hann_window(n_fft), center=True, pad_mode="reflect", return_complex=True)
    mel = spectrum.abs().transpose(1, 2) @ filters  # (batch * channels, frames, mel_bins)
    return torch.log(mel.clamp(min=1e-5)).reshape(batch, channels, -1, mel_bins)


def mux_audio(video: Path, waveform: np.ndarray, sample_rate: int) -> None:
    """Add an AAC audio stream (``waveform``: (channels, samples) in [-1, 1]) to an mp4 file, its video stream copied as it is."""
    import av

    channels = waveform.shape[0]
    muxed = video.with_name(video.stem + ".muxing.mp4")
    with av.open(str(video)) as source, av.open(str(muxed), "w") as target:
        video_in = source.streams.video[0]
        video_out = target.add_stream_from_template(video_in)
        audio_out = target.add_stream("aac", rate=sample_rate, layout="stereo" if channels == 2 else "mono")
        for packet in source.demux(video_in):
            if packet.dts is None:
                continue
            packet.stream = video_out
            target.mux(packet)
        planar = np.ascontiguousarray(np.clip(waveform, -1.0, 1.0).astype(np.float32))
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout="stereo" if channels == 2 else "mono")
        frame.sample_rate = sample_rate
        frame.pts = 0
        for packet in audio_out.encode(frame):
            target.mux(packet)
        for packet in audio_out.encode(None):
            target.mux(packet)
    muxed.replace(video)


def audio_latent_frames(duration: float, sample_rate: int, hop_length: int, temporal_factor: int) -> int:
    """The audio latents of a clip of ``duration`` seconds, as LTX2Pipeline sizes them (``audio_num_frames``)."""
    return round(duration * sample_rate / hop_length / float(temporal_factor))


def loudness(waveform: np.ndarray) -> float:
    """The RMS level of a waveform, in dBFS (silence is -inf)."""
    rms = float(np.sqrt(np.mean(np.square(waveform, dtype=np.float64)))) if waveform.size else 0.0
    return 20 * math.log10(rms) if rms > 0 else -math.inf


# A tone per shape: the synthetic clips' sound follows what is seen, so a tiny model has something to learn.
SHAPE_TONES = {"circle": 220.0, "square": 440.0, "triangle": 880.0}


def generate_sounding_shapes_dataset(out_dir: Path, examples: int, seed: int, resolution: int = 32, frames: int = 17, fps: float = 24.0,
                                     sample_rate: int = 16000) -> Path:
    """The moving-shapes clips (``videos.generate_moving_shapes_dataset``, no stills) with a sine tone per shape as their audio track."""
    from zeropipe.data.videos import generate_moving_shapes_dataset

    folder = generate_moving_shapes_dataset(out_dir, examples, seed, resolution=resolution, frames=frames, fps=fps, still_every=0)
    for clip in sorted(folder.glob("clip_*.mp4")):
        caption = clip.with_suffix(".txt").read_text(encoding="utf-8")
        tone = next((hz for shape, hz in SHAPE_TONES.items() if f" {shape}" in caption), 330.0)
        t = np.arange(int(round(sample_rate * frames / fps))) / sample_rate
        wave = (0.4 * np.sin(2 * np.pi * tone * t)).astype(np.float32)
        mux_audio(clip, np.stack([wave, wave]), sample_rate)
    return folder
