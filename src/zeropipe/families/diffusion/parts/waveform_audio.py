"""The audio track of a model whose audio VAE takes the waveform itself (MiniMax-H3): ``AudioTrack`` without a mel front-end.

MiniMax-H3's audio VAE (``AutoencoderKLMiniMaxH3Audio``) is mono and encodes a 32 kHz waveform directly (800 samples
per latent, 40 latents a second); the pipeline carries stereo as two batch items of it and packs the two channels'
latents as two channel-major blocks of rows, ``(2 * N, 32)``, normalised per channel by the VAE config's
``latents_mean`` / ``latents_std``, the posterior's mean taken (``MiniMaxH3Ref2VAReferenceEncoderStep``, which encodes a
reference clip's soundtrack exactly so). ``N`` is the pipeline's count for the clip's frames at 24 fps
(``audio_latent_num_frames``). Decoding for samples is ``MiniMaxH3AudioDecodeStep``'s: the rows unpacked to
``(2, 32, N)``, denormalised, decoded into the stereo waveform that is muxed into each mp4. There is no vocoder.

Everything else (the cache, files without sound left out, the rank's ``condition["audio_latents"]``) is ``AudioTrack``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeropipe.families.diffusion.parts.audio_track import AudioTrack, audio_vae_config
from zeropipe.families.diffusion.parts.base import Encoding, Sampling

STEREO = 2  # MINIMAX_H3_AUDIO_CHANNELS: the pipeline's soundtrack is stereo, the VAE mono


def stereo_rows(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mono VAE latents of B clips' two channels, (2B, C, N), as the pipeline's normalised channel-major rows (B, 2N, C)."""
    rows = (latents.transpose(1, 2) - mean.view(1, 1, -1)) / std.view(1, 1, -1)
    return rows.reshape(-1, STEREO * rows.shape[1], rows.shape[2])


def stereo_latents(rows: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``stereo_rows`` undone and denormalised: (B, 2N, C) rows to the (2B, C, N) latents the mono VAE decodes (``MiniMaxH3AfterDenoiseStep``)."""
    batch, length, channels = rows.shape
    latents = rows.reshape(batch * STEREO, length // STEREO, channels).permute(0, 2, 1)
    return latents * std.view(1, -1, 1).to(latents) + mean.view(1, -1, 1).to(latents)


@dataclass(frozen=True)
class WaveformAudioTrack(AudioTrack):
    """A clip's stereo soundtrack encoded by a waveform audio VAE (MiniMax-H3's), a second target of the denoiser.

    Attributes:
        latents_per_second: the audio VAE's latent rate (its sampling rate over its hop, 32000 / 800).
    """

    latents_per_second: int = 40

    silent_reason = "diffusion-pipe trains MiniMax-H3 on them with an empty audio block; here a micro-batch holds clips with sound only"

    def latent_count(self, frames: int, fps: float) -> int:
        """The audio latents the pipeline draws for a clip of this many frames (``audio_latent_num_frames``)."""
        return int(round(frames / fps * self.latents_per_second))

    def load(self, plan, index, bucket, flip):
        """The clip's stereo audio (2, samples) at the audio VAE's rate, over the clip's own time span; a flip mirrors the picture, not the sound."""
        from zeropipe.data.audio import read_audio

        item = plan.items[index]
        config = audio_vae_config(plan.pipeline_dir)
        fps = plan.fps or item.get("fps") or 24.0
        frames = bucket[2] if len(bucket) > 2 else 1
        rate = int(config.get("sampling_rate", 32000))
        return {"waveform": read_audio(item["path"], item.get("start", 0) / fps, frames / fps, rate, STEREO), "latents": self.latent_count(frames, fps)}

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        """Per clip, its normalised channel-major audio rows (2N, C): the posterior's mean of each channel, as the pipeline encodes a soundtrack."""
        vae = encoding.encoder
        config = vae.config
        waveforms = torch.stack([loaded["waveform"] for loaded in encoding.loaded]).to(encoding.device)
        count = encoding.loaded[0]["latents"]
        with torch.no_grad():
            latents = vae.encode(waveforms.reshape(-1, 1, waveforms.shape[-1])).latent_dist.mode().float()
        if latents.shape[2] < count:  # the VAE pads to whole hops; the pipeline's count rounds at the latent grid
            latents = torch.nn.functional.pad(latents, (0, count - latents.shape[2]))
        rows = stereo_rows(latents[:, :, :count], torch.tensor(config.latents_mean).to(latents), torch.tensor(config.latents_std).to(latents))
        return list(rows.cpu())

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {}  # the draw sizes its audio rows by the clip's frames; the VAE decodes on rank 0 only (add_to_samples)

    def add_to_samples(self, sampling: Sampling, outputs: dict[str, torch.Tensor], written: list[dict[str, Any]], folder) -> None:
        """Decode the drawn audio rows into stereo waveforms (``MiniMaxH3AudioDecodeStep``) and mux each into its sample's mp4."""
        from zeropipe.data.audio import loudness, mux_audio

        if "audio_latents" not in outputs:
            return
        audio_vae = sampling.folder.component("audio_vae", torch.float32, sampling.device)
        config = audio_vae.config
        rows = outputs["audio_latents"].to(sampling.device, torch.float32)
        latents = stereo_latents(rows, torch.tensor(config.latents_mean), torch.tensor(config.latents_std))
        with torch.no_grad():
            waveforms = audio_vae.decode(latents).sample.float().reshape(rows.shape[0], STEREO, -1).clamp(-1, 1).cpu().numpy()
        for row, waveform in zip(written, waveforms):
            mux_audio(folder.parent / row["video"], waveform, int(config.sampling_rate))
            row["audio_dbfs"] = round(loudness(waveform), 2)
        del audio_vae
