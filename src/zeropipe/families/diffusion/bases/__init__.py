"""What entries of one model line share, so that no entry imports another: their classes, helpers and, where a
variant is the base entry's record with a few fields changed, that record.

An entry module (``entries/``) names its record; where other entries build on it (Wan's image-to-video and
TI2V variants, SkyReels-V2, Flux Kontext, FLUX.2 [klein], Qwen-Image's edit entries, HunyuanVideo 1.5's and
Kandinsky 5's image-to-video, Cosmos-Predict2's Video2World, LTX-2), its code lives here (``bases/<entry>.py``)
and the entry module takes its record from it. ``unet.py``: the UNet entries' planner trace. ``flux3.py``: FLUX.3's
denoiser call (a modular pipeline's, held to its block), its prompts, sampling and tiny preset, and FLUX.3 [distilled]'s
flow-map call. ``cosmos3.py``: Cosmos 3 Omni's text-to-vision denoiser call, held to its block, for an entry not
written yet (docs/diffusion.md, "Not done yet"). ``minimax_h3.py``: MiniMax-H3's call and two-stream
sampling step, held to its blocks, for an entry not written yet (docs/video.md). ``qwen3_vl_text.py``:
Qwen3VLProcessor's text path, which both modular pipelines' text-encoder blocks read, for machines without torchvision.
"""
