"""Rewrite readers of a diffusion entry from the old API (``arch.name``, ``arch.predict(...)``) to today's (``arch.record.name``, ``arch.call.predict(...)``).

For merging branches written against the old ``Architecture``: run it on the files they touch, then read the diff.

    python scripts/migrate_entry_api.py 'arch|architecture|self\\.arch' FILE...

The first argument is a regular expression of the names that hold an entry. Record fields and the constant
methods become ``.record.<name>`` (``pipeline_kwargs()`` the field ``pipeline_kwargs``), code methods go to their
role (``call``, ``prompts``, ``sampling``, ``layouts``, ``assembly``; ``call_pipeline`` is ``sampling.draw``).
Entry modules themselves are converted by hand (docs/architecture.md, "Converting an entry in the old shape").
"""
import re, sys
REC = "name pipeline_class denoiser denoiser_class objective text_encoders tokenizers related_pipelines pipeline_settings patch_factor preset_name preset lora_targets codec text conditions trace_frames parts frozen_components video frame_multiple vae_class tokenizer_length image_processor_factor trace_text_tokens".split()
ROLE = {"predict": "call", "trace_inputs": "call", "loss_region": "call", "loss": "call",
        "encode_prompts": "prompts", "tiny_tokenizer": "prompts", "tiny_prompt_processor": "prompts", "load_prompt_processor": "prompts",
        "sample_kwargs": "sampling", "sample_outputs": "sampling", "unpack_latents": "sampling", "call_pipeline": "sampling",
        "original_lora_layout": "layouts", "original_lokr_layout": "layouts",
        "construct_pipeline": "assembly", "tiny_component": "assembly", "tiny_denoiser": "assembly"}
receivers = sys.argv[1]  # the names that hold an entry
for path in sys.argv[2:]:
    s = open(path).read()
    o = s
    recv = rf"(?<![\w.])((?:self\.|task\.|folder\.|run\.|plan\.)?(?:{receivers}))"
    s = re.sub(recv + r"\.pipeline_kwargs\(\)", r"\1.record.pipeline_kwargs", s)
    s = re.sub(recv + r"\.vae_factors\(", r"\1.record.codec.vae_factors(", s)
    s = re.sub(recv + r"\.call_pipeline\(", r"\1.sampling.draw(", s)
    s = re.sub(recv + r"\.(" + "|".join(REC) + r")\b(?!\s*=[^=])", r"\1.record.\2", s)
    s = re.sub(recv + r"\.(" + "|".join(k for k in ROLE if k != "call_pipeline") + r")\b", lambda m: f"{m.group(1)}.{ROLE[m.group(2)]}.{m.group(2)}", s)
    if s != o:
        open(path, "w").write(s)
        print("changed", path)
