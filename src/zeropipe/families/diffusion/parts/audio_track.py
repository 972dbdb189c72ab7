"""The audio track condition: a clip's sound, denoised jointly with its video (LTX-2).

Each clip's audio over the clip's own time span is read with PyAV, resampled to the audio
VAE's rate, turned into a log-mel spectrogram and encoded by the pipeline's audio VAE
(``audio_vae``); the latents, packed into tokens and normalised by the VAE's statistics as
LTX2Pipeline packs and normalises them, are cached with the clip's video latents (a changed
audio VAE re-encodes them: its fingerprint is part of every key). A micro-batch hands them to the
entry as ``condition["audio_latents"]``, which the entry noises at the video's noise level and
adds to the loss.

A file without an audio track (an image, a silent clip) is left out of the run, with a note
naming it: LTX-2's own trainer (ltx-trainer, ``with_audio``) drops such clips from audio-video
training the same way (its preprocessing writes no audio latents for them and its dataset keeps
only samples with every source).

Samples: the pipeline draws audio latents beside the video (``Sampling.sample_outputs``);
rank 0 decodes them with the audio VAE and the vocoder and muxes the waveform into each mp4.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, Planning, Sampling
from zeropipe.errors import DataError

SHOWN = 3


@lru_cache(maxsize=8)
def audio_vae_config(pipeline_dir: str) -> dict[str, Any]:
    from zeropipe.config.pipeline_index import read_pipeline_index

    return read_pipeline_index(Path(pipeline_dir)).component_config("audio_vae")


def pack_audio_latents(latents: torch.Tensor) -> torch.Tensor:
    """(batch, channels, length, mel) -> (batch, length, channels * mel): LTX2Pipeline._pack_audio_latents without patches."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio_latents(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


@dataclass(frozen=True)
class AudioTrack(Condition):
    """The clip's audio latents, a second target of the denoiser.

    Attributes:
        n_fft: the STFT window of the mel spectrogram the audio VAE encodes.
    """

    n_fft: int = 1024

    entry = "audio"
    key_suffix = "-audio"
    silent_reason = "LTX-2's own trainer leaves such clips out of audio-video training too"  # said in the note on files left out

    # ------------------------------------------------------------------ the launcher
    def problems(self, config, arch):
        if not config.data.cache.latents:
            return [("data.cache.latents", f"a {arch.record.name} model's audio latents are encoded once, with the video's, into the latent cache (the ranks hold no audio VAE): set data.cache.latents: true")]
        return []

    def attach(self, planning: Planning) -> None:
        """Leave out the clips of files without an audio track, as LTX-2's trainer does; refuse the run when none has one.

        Raises:
            DataError: no file of the data has an audio track.
        """
        from zeropipe.data.audio import has_audio

        heard: dict[str, bool] = {}
        for item in planning.items:
            if item["path"] not in heard:
                heard[item["path"]] = has_audio(item["path"])
        silent = sorted(path for path, sound in heard.items() if not sound)
        if len(silent) == len(heard):
            raise DataError(
                f"none of the {len(heard)} file(s) of the data has an audio track ({', '.join(silent[:SHOWN])}{' ...' if len(silent) > SHOWN else ''}): "
                f"{planning.arch.record.name} trains video with its sound: add clips with audio to data.path"
            )
        if silent:
            kept = [(item, bucket) for item, bucket in zip(planning.items, planning.buckets) if heard[item["path"]]]
            planning.items[:] = [item for item, _ in kept]
            planning.buckets[:] = [bucket for _, bucket in kept]
            planning.notes.append(
                f"{len(silent)} file(s) have no audio track and do not train ({', '.join(silent[:SHOWN])}{' ...' if len(silent) > SHOWN else ''}): "
                f"{self.silent_reason}; give them a sound track to train them"
            )

    def fingerprints(self, planning: Planning) -> tuple[str, ...]:
        return (planning.folder.fingerprint("audio_vae"),)

    # ------------------------------------------------------------------ the node's cache filling
    def encoder(self, folder, dtype, device):
        # fp32, as the video VAE: the latents are cached once and read every epoch.
        return folder.component("audio_vae", torch.float32, device)

    def load(self, plan, index, bucket, flip):
        """The clip's audio (channels, samples) at the audio VAE's rate; a flip mirrors the picture, not the sound."""
        from zeropipe.data.audio import read_audio

        item = plan.items[index]
        config = audio_vae_config(plan.pipeline_dir)
        fps = plan.fps or item.get("fps") or 24.0
        frames = bucket[2] if len(bucket) > 2 else 1
        return read_audio(item["path"], item.get("start", 0) / fps, frames / fps, int(config["sample_rate"]), int(config["in_channels"]))

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        """Per clip, its audio latents packed into tokens (length, channels * mel) and normalised, as LTX2Pipeline prepares audio latents."""
        from zeropipe.data.audio import audio_latent_frames, mel_spectrogram

        vae = encoding.encoder
        config = vae.config
        waveform = torch.stack(encoding.loaded).to(encoding.device)
        mel = mel_spectrogram(waveform.cpu(), int(config.sample_rate), int(config.mel_bins), int(config.mel_hop_length), self.n_fft).to(encoding.device)
        with torch.no_grad():
            latents = vae.encode(mel).latent_dist.mean
        # As many latents as the pipeline draws for a clip of this duration (the causal encoder may give one more).
        length = audio_latent_frames(waveform.shape[-1] / int(config.sample_rate), int(config.sample_rate), int(config.mel_hop_length), vae.temporal_compression_ratio)
        if latents.shape[2] < length:
            latents = torch.nn.functional.pad(latents, (0, 0, 0, length - latents.shape[2]))
        tokens = pack_audio_latents(latents[:, :, :length])
        tokens = (tokens - vae.latents_mean.to(tokens)) / vae.latents_std.to(tokens)  # LTX2Pipeline._normalize_audio_latents
        return list(tokens.float().cpu())

    # ------------------------------------------------------------------ a rank
    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        return {"audio_latents": torch.stack(values).to(batch.device, batch.dtype)}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        # LTX2Pipeline sizes and normalises its audio latents by its audio VAE's config and statistics, even for latent output.
        return {"audio_vae": sampling.folder.component("audio_vae", torch.float32, sampling.device)}

    def add_to_samples(self, sampling: Sampling, outputs: dict[str, torch.Tensor], written: list[dict[str, Any]], folder: Path) -> None:
        """Decode the drawn audio latents (audio VAE, then vocoder) and mux each waveform into its sample's mp4."""
        from zeropipe.data.audio import loudness, mux_audio

        if "audio_latents" not in outputs:
            return
        audio_vae = sampling.folder.component("audio_vae", torch.float32, sampling.device)
        vocoder = sampling.folder.component("vocoder", torch.float32, sampling.device)
        with torch.no_grad():
            mel = audio_vae.decode(outputs["audio_latents"].to(sampling.device, torch.float32)).sample
            waveforms = vocoder(mel).float().cpu().numpy()
        rate = int(vocoder.config.output_sampling_rate)
        for row, waveform in zip(written, waveforms):
            mux_audio(folder.parent / row["video"], waveform, rate)
            row["audio_dbfs"] = round(loudness(waveform), 2)
        del audio_vae, vocoder
