"""The audio track of Kandinsky 6: a clip's mono sound through MMAudio's mel VAE (``MMAudioVAE``), decoded by its vocoder.

``MMAudioVAE`` takes the mono waveform itself at its ``sample_rate`` (44.1 kHz in the release) and makes the log-mel
spectrogram inside (``mel_converter``), one latent per ``2 * hop_length`` samples (``latent_hop_length``: 1024). The
pipeline's transformer takes the latents as (length, channels) rows scaled by the VAE's ``scaling_factor`` (its
``prepare_audio_latents`` layout; it divides by the factor before decoding), as many as it draws for the clip's span:
``ceil(frames / fps * sample_rate / latent_hop_length)``. The posterior's mean is cached (as ``AudioTrack`` caches LTX-2's).
Samples: the drawn rows divided by the factor, decoded by ``audio_vae`` into a mel spectrogram and by ``vocoder``
(``MMAudioVocoder``, BigVGAN) into the waveform that is muxed into each mp4, as the pipeline decodes its audio.

Everything else (the cache, files without sound left out, the rank's ``condition["audio_latents"]``) is ``AudioTrack``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zeropipe.families.diffusion.parts.audio_track import AudioTrack, audio_vae_config
from zeropipe.families.diffusion.parts.base import Encoding, Sampling


@dataclass(frozen=True)
class MMAudioTrack(AudioTrack):
    """A clip's mono sound encoded by MMAudio's mel VAE (Kandinsky 6's), a second target of the denoiser."""

    silent_reason = "Kandinsky 6 trains video with its sound; a micro-batch here holds clips with sound only"

    def load(self, plan, index, bucket, flip):
        """The clip's mono audio (samples,) at the audio VAE's rate over the clip's own span, and how many latents the pipeline draws for it."""
        from zeropipe.data.audio import read_audio

        item = plan.items[index]
        config = audio_vae_config(plan.pipeline_dir)
        fps = plan.fps or item.get("fps") or 24.0
        frames = bucket[2] if len(bucket) > 2 else 1
        rate = int(config.get("sample_rate", 44_100))
        hop = 2 * int(config.get("hop_length", 512))  # MMAudioVAE.latent_hop_length: the encoder halves the mel frames once
        return {"waveform": read_audio(item["path"], item.get("start", 0) / fps, frames / fps, rate, 1)[0], "latents": math.ceil(frames / fps * rate / hop)}

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        """Per clip, its audio latents (length, channels), scaled by the VAE's ``scaling_factor``: the rows the transformer takes."""
        vae = encoding.encoder
        waveforms = torch.stack([loaded["waveform"] for loaded in encoding.loaded]).to(encoding.device)
        count = encoding.loaded[0]["latents"]
        with torch.no_grad():
            latents = vae.encode(waveforms).latent_dist.mean.float()
        if latents.shape[2] < count:  # the mel front end keeps whole hops only; the pipeline's count rounds up
            latents = torch.nn.functional.pad(latents, (0, count - latents.shape[2]))
        rows = latents[:, :, :count].transpose(1, 2) * float(vae.config.scaling_factor)
        return list(rows.cpu())

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        # The pipeline refuses to draw sound without both (check_inputs), even for latent output; sampling draws sound.
        return {name: sampling.folder.component(name, torch.float32, sampling.device) for name in ("audio_vae", "vocoder")}

    def add_to_samples(self, sampling: Sampling, outputs: dict[str, torch.Tensor], written: list[dict[str, Any]], folder) -> None:
        """Decode the drawn audio rows (audio VAE, then vocoder) as the pipeline decodes them, and mux each waveform into its sample's mp4."""
        from zeropipe.data.audio import loudness, mux_audio

        if "audio_latents" not in outputs:
            return
        audio_vae = sampling.folder.component("audio_vae", torch.float32, sampling.device)
        vocoder = sampling.folder.component("vocoder", torch.float32, sampling.device)
        latents = outputs["audio_latents"].to(sampling.device, torch.float32).transpose(1, 2) / float(audio_vae.config.scaling_factor)
        with torch.no_grad():
            mel = audio_vae.decode(latents).sample
            waveforms = vocoder(mel).sample.float().cpu().numpy()  # (B, 1, samples): mono
        rate = int(audio_vae.config.sample_rate)
        for row, waveform in zip(written, waveforms):
            mux_audio(folder.parent / row["video"], waveform, rate)
            row["audio_dbfs"] = round(loudness(waveform), 2)
        del audio_vae, vocoder
