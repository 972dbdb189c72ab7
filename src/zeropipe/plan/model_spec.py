"""What the memory arithmetic needs to know about a model, counted on the meta device.

Models are built from their config files with ``torch.device("meta")``: every parameter has
a shape and no storage, so Llama-3.1-70B is counted in seconds without a byte of weights.
Nothing is ever downloaded: the catalog ships the config files of popular architectures.

(Just over 600 lines: the causal-LM, vision-language and diffusion counters share the
meta-device machinery here; the diffusion counters are the part to move into a module of their
own once video models add theirs.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from zeropipe.config.pipeline_index import PipelineIndex, is_pipeline_folder, read_pipeline_index
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.models.common import DIFFUSERS_LORA_TARGETS, TRANSFORMERS_LORA_TARGETS, is_lora_target, resolve_lora_targets
from zeropipe.models.adapters import adapter_parameter_sizes
from zeropipe.plan.trace import ActivationTrace

if TYPE_CHECKING:
    import torch

    from zeropipe.config.schema import LoraSection

CATALOG_DIR = Path(__file__).parent / "catalog"

FAMILIES = ("causal_lm", "diffusion_unet", "diffusion_transformer", "unknown")

# Which input a linear layer reads, by its name in transformers' models: adapters on layers that
# read the same input share it when there is no LoRA dropout.
LINEAR_INPUT_GROUPS = {
    "q_proj": "attention input",
    "k_proj": "attention input",
    "v_proj": "attention input",
    "qkv_proj": "attention input",
    "o_proj": "attention output",
    "gate_proj": "MLP input",
    "up_proj": "MLP input",
    "gate_up_proj": "MLP input",
    "down_proj": "MLP output",
}


@dataclass(frozen=True)
class BlockShape:
    """One decoder layer, as the activation formula sees it."""

    hidden: int
    q_dim: int  # heads x head_dim (differs from hidden in Gemma)
    kv_dim: int  # key/value heads x head_dim
    intermediate: int
    heads: int
    gated_mlp: bool = True
    norm_elements: int = 0  # values normalized per token in one layer (2h for Llama, 4h for Gemma 2)
    norm_upcasts_weight: bool = False  # Gemma's (1 + w.float()) keeps the normalized value in fp32
    layernorm: bool = False  # GPT-style LayerNorm instead of RMSNorm
    dropout: float = 0.0
    softmax_fp32: bool = True  # transformers' eager attention computes softmax in fp32


@dataclass(frozen=True)
class LoraShape:
    """The adapters of one decoder layer."""

    r: int
    dropout: bool
    target_modules: tuple[str, ...]
    adapted_inputs: tuple[tuple[str, int, int], ...] = ()  # (input group, in_features, adapters reading it) per layer


@dataclass(frozen=True)
class QuantizedBase:
    """QLoRA's frozen base as bitsandbytes holds it: the linear layers' weights in 4 bits, the rest upcast to fp32.

    transformers quantizes every linear layer but the output head; peft's
    ``prepare_model_for_kbit_training`` then casts every other 16-bit weight (embeddings, the
    output head, norms, biases) to fp32.
    """

    params_4bit: int  # weights of the quantized linear layers
    params_upcast: int  # the other frozen weights, fp32 after prepare_model_for_kbit_training
    double_quant: bool = True


@dataclass(frozen=True)
class FrozenModel:
    name: str
    params: int


@dataclass(frozen=True)
class Fp8Base:
    """A frozen base whose block linear layers are stored in fp8 (``models.quantized``): one byte per weight, a float32 scale per output channel."""

    params_fp8: int  # weights of the linear layers in the repeated blocks
    channels: int  # their output channels: one float32 scale each, whole on every rank
    largest_linear: int  # the largest of those weights: dequantized (float32, then the compute dtype) while it computes
    format: str = "fp8"


@dataclass(frozen=True)
class GenerationShape:
    """GRPO's generation round: the completions sampled per micro-batch, with the whole model gathered (ZeRO-3) and a KV cache."""

    completions_per_example: int  # grpo.num_generations: each prompt of a micro-batch is answered this many times
    completion_tokens: int  # grpo.max_completion_length
    reference_copy: bool = False  # a full fine-tune's KL reference (grpo.beta > 0): a frozen copy of the weights, partitioned under ZeRO-3


@dataclass(frozen=True)
class MoeCounts:
    """A mixture of experts as the planner sees it (``moe_counts``)."""

    experts: int  # routed experts per MoE layer
    active_experts: int  # experts each token goes to (top-k)
    moe_layers: int
    expert_params: int  # every routed expert's weights, all layers
    active_params: int  # the weights one token passes through: everything but the experts it is not routed to
    expert_intermediate: int  # one expert's hidden width
    leaf_params: int  # one MoE block (router and all its experts): what ZeRO-3 gathers at once as a leaf module
    leaf_name: str
    expert_weights: tuple[tuple[str, int, int, int], ...] = ()  # one block's 3-D expert weights: (name, experts, rows, columns)


@dataclass(frozen=True)
class ModelSpec:
    """Counts and shapes of the model being trained, plus the frozen models it needs."""

    name: str
    family: str  # "causal_lm", "diffusion_unet", "diffusion_transformer" or "unknown" (a bare count)
    total_params: int  # the trained model, frozen LoRA base included; frozen extra models are not
    trainable_params: int
    layers: int = 0
    hidden_size: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    largest_layer_params: int = 0  # the most weights one module owns directly: what ZeRO-3 gathers at once
    largest_layer_name: str | None = None
    largest_parameter: int = 0
    parameter_sizes: tuple[int, ...] = ()  # trainable parameters in DeepSpeed's order (for ZeRO-1/2 partitions)
    block: BlockShape | None = None
    lora: LoraShape | None = None
    frozen_models: tuple[FrozenModel, ...] = ()
    cached_models: tuple[FrozenModel, ...] = ()  # frozen models the ranks never load: their outputs are cached
    activation_trace: ActivationTrace | None = None
    source: str = ""
    published_params: int | None = None
    quantizable_params: int = 0  # weights of the linear layers but the output head: what 4-bit loading quantizes
    quantized: QuantizedBase | None = None  # QLoRA (model.quantization): how the frozen base is held
    # Preference tuning: sequences one example is (a pair's chosen and rejected rows; a KTO example and its KL row),
    # and whether each micro-batch also runs a gradient-free forward pass (DPO/KTO with LoRA: the reference, adapters off).
    # Diffusion: the examples the entry's loss calls the denoiser on with gradient per example (the flow-map objective: 2),
    # and whether as many go through it without gradient (its two half jumps).
    sequences_per_example: int = 1
    reference_forward: bool = False
    # Sequence parallelism: the attention heads a diffusion denoiser splits over a group, set by the family's spec builder
    # only where it trains that denoiser split (families/diffusion/sequence_parallel.py); None: not offered.
    sequence_parallel_heads: int | None = None
    ema: bool = False  # train.ema: an fp32 EMA of the trainable weights beside the master weights (engine/ema.py)
    block_linear_params: int = 0  # weights of the linear layers in the repeated blocks: what an fp8 base stores in 8 bits
    block_linear_channels: int = 0
    largest_block_linear: int = 0
    fp8_base: Fp8Base | None = None  # model.quantization: fp8 / fp8_e5m2
    optimizer: str = "adamw"  # train.optimizer: its state bytes per trainable weight (config.optimizers)
    generation: "GenerationShape | None" = None  # GRPO: the policy samples completions inside the loop (grpo:)
    moe: MoeCounts | None = None  # a mixture of experts: total vs active weights, the block ZeRO-3 gathers whole

    def with_fp8_base(self, format: str = "fp8") -> "ModelSpec":
        """This model with its frozen block linears stored in fp8 (a LoRA run's base)."""
        from dataclasses import replace

        return replace(self, fp8_base=Fp8Base(self.block_linear_params, self.block_linear_channels, self.largest_block_linear, format))

    @property
    def frozen_base_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def frozen_model_params(self) -> int:
        return sum(m.params for m in self.frozen_models)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "vocab_size": self.vocab_size,
            "largest_layer_params": self.largest_layer_params,
            "largest_layer_name": self.largest_layer_name,
            "lora": None if self.lora is None else {"r": self.lora.r, "target_modules": list(self.lora.target_modules), "dropout": self.lora.dropout},
            "frozen_models": [{"name": m.name, "params": m.params} for m in self.frozen_models],
            "activation_trace": None if self.activation_trace is None else vars(self.activation_trace),
            "quantized": None if self.quantized is None else vars(self.quantized),
            "fp8_base": None if self.fp8_base is None else vars(self.fp8_base),
            "moe": None if self.moe is None else {key: value for key, value in vars(self.moe).items() if key != "expert_weights"},
            "source": self.source,
        }


# ---------------------------------------------------------------------------------------------
# Entry points


def catalog_names() -> list[str]:
    return sorted(path.stem for path in CATALOG_DIR.glob("*.json"))


def spec_from_catalog(name: str, lora: LoraSection | None = None) -> ModelSpec:
    """A catalog architecture by name (case-insensitive, e.g. ``llama-3.1-8b``, ``sdxl``).

    Raises:
        ZeroPipeError: naming the catalog entries when the name is not one of them.
    """
    key = name.strip().lower()
    aliases = {entry.replace("-", "").replace(".", ""): entry for entry in catalog_names()}
    key = key if (CATALOG_DIR / f"{key}.json").is_file() else aliases.get(key.replace("-", "").replace(".", "").replace("_", ""), key)
    path = CATALOG_DIR / f"{key}.json"
    if not path.is_file():
        raise ZeroPipeError(
            f"{name!r} is not in the catalog ({', '.join(catalog_names())}): give a local model directory or config.json, or --params N"
        )
    entry = json.loads(path.read_text())
    if entry["family"] == "causal_lm":
        spec = _causal_lm_spec(entry["config"], entry["name"], lora)
    else:
        spec = diffusion_specs().catalog_entry(entry, lora)
    return replace(spec, source=f"catalog: {entry['source']}", published_params=entry.get("published_params"))


def spec_from_path(path: str | Path, lora: LoraSection | None = None) -> ModelSpec:
    """A local model: a transformers directory or config.json, a diffusers model directory, or a diffusers pipeline.

    Raises:
        ZeroPipeError: when the path holds no config this can read.
    """
    path = Path(path).expanduser()
    if path.is_dir() and is_pipeline_folder(path):
        return diffusion_specs().pipeline(read_pipeline_index(path, key=None), lora)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ZeroPipeError(f"{path}: no config.json there; give a Hugging Face model directory, its config.json, or a catalog name")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ZeroPipeError(f"{config_file} is not valid JSON (line {err.lineno}: {err.msg})") from None
    if "_class_name" in config:
        spec = diffusion_specs().denoiser_config(path, config, lora)
    else:
        spec = _causal_lm_spec(config, config_file.parent.name, lora)
    return replace(spec, source=f"config: {config_file}")


def spec_from_params(n: float, trainable: float | None = None) -> ModelSpec:
    """A bare parameter count: model states only, no activations (the model's shape is unknown)."""
    total = int(n)
    if total <= 0:
        raise ZeroPipeError(f"--params {n}: give a positive parameter count, e.g. 7.5e9")
    return ModelSpec(
        name="a bare parameter count",
        family="unknown",
        total_params=total,
        trainable_params=int(trainable) if trainable is not None else total,
        source="--params",
    )


# ---------------------------------------------------------------------------------------------
# Causal LMs


def _hf_config(config: dict[str, Any] | Any):
    from transformers import CONFIG_MAPPING

    if not isinstance(config, dict):
        return config
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version",)}
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ZeroPipeError(f"unknown architecture {model_type!r}: transformers {_version('transformers')} has no config class for it")
    return CONFIG_MAPPING[model_type](**fields)


def _build_causal_lm(hf_config):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        except ValueError:
            # Vision-language models (LLaVA...) are not causal LMs to the Auto classes.
            from transformers import AutoModelForImageTextToText

            try:
                return AutoModelForImageTextToText.from_config(hf_config, dtype=torch.bfloat16)
            except ValueError:
                pass
            # Multimodal checkpoints (Gemma 3) name their class in config.architectures.
            for name in getattr(hf_config, "architectures", None) or ():
                cls = getattr(transformers, name, None)
                if cls is not None:
                    return cls._from_config(hf_config, dtype=torch.bfloat16)
            raise


def _causal_lm_spec(config: dict[str, Any] | Any, name: str, lora: LoraSection | None) -> ModelSpec:
    try:
        hf_config = _hf_config(config)
        model = _build_causal_lm(hf_config)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            [("model", f"transformers cannot build this {getattr(config, 'model_type', None) or config.get('model_type')} model: {err}")]
        ) from None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers_list = _decoder_layers(model, text.num_hidden_layers)
    block = _block_shape(text, layers_list[0] if layers_list is not None else None)
    counts = _count(model)
    lora_shape = None
    trainable, sizes = counts["total"], counts["sizes"]
    if lora is not None:
        lora_shape, trainable, sizes = _lora_counts(model, lora, layers_list[0] if layers_list is not None else None, "causal_lm")
    heads = text.num_attention_heads
    spec = ModelSpec(
        name=name,
        family="causal_lm",
        total_params=counts["total"] + (trainable if lora is not None else 0),
        trainable_params=trainable,
        layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_heads=heads,
        vocab_size=text.vocab_size,
        largest_layer_params=counts["largest_layer"],
        largest_layer_name=counts["largest_layer_name"],
        largest_parameter=counts["largest_parameter"],
        parameter_sizes=tuple(sizes),
        block=block,
        lora=lora_shape,
        quantizable_params=_quantizable_params(model),
        **_block_linear_counts(model),
    )
    return with_moe_counts(spec, model, text)


def _block_linear_counts(model, select=None) -> dict[str, int]:
    """The block linears an fp8 base stores in 8 bits (``models.quantized.quantizable_linears``, ``select`` as there), counted on the meta model."""
    from zeropipe.models.quantized import quantizable_linears

    linears = [model.get_submodule(name) for name in quantizable_linears(model, select)]
    return {
        "block_linear_params": sum(m.weight.numel() for m in linears),
        "block_linear_channels": sum(m.out_features for m in linears),
        "largest_block_linear": max((m.weight.numel() for m in linears), default=0),
    }


def _quantizable_params(model) -> int:
    """Weights of the linear layers transformers' bitsandbytes loading quantizes: all but the output head."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output)


def _decoder_layers(model, count: int):
    import torch

    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    # A multimodal model has a vision tower too: prefer the language model's layers.
    candidates.sort(key=lambda item: ("language" not in item[0] and "text" not in item[0], len(item[0])))
    return candidates[0][1] if candidates else None


def _block_shape(text, layer) -> BlockShape:
    hidden, heads = text.hidden_size, text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    norm_elements, gated, layernorm, gemma_norm = 2 * hidden, True, False, False
    if layer is not None:
        names = {n.rsplit(".", 1)[-1] for n, _ in layer.named_modules()}
        gated = bool({"gate_proj", "gate_up_proj"} & names)
        norm_elements = 0
        for module_name, module in layer.named_modules():
            kind = type(module).__name__
            weight = getattr(module, "weight", None)
            if "Norm" not in kind or weight is None or weight.dim() != 1:
                continue
            per_token = weight.numel()
            if module_name.endswith("q_norm"):
                per_token *= heads
            elif module_name.endswith("k_norm"):
                per_token *= kv_heads
            norm_elements += per_token
            layernorm = layernorm or ("LayerNorm" in kind and "RMS" not in kind)
            gemma_norm = gemma_norm or kind.startswith("Gemma")
    return BlockShape(
        hidden=hidden,
        q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim,
        intermediate=intermediate,
        heads=heads,
        gated_mlp=gated,
        norm_elements=norm_elements,
        norm_upcasts_weight=gemma_norm,
        layernorm=layernorm,
        dropout=float(getattr(text, "attention_dropout", 0.0) or 0.0),
    )


def _count(model) -> dict[str, Any]:
    """Parameter totals, sizes in order, and the largest module (by the weights it owns directly)."""
    sizes = [p.numel() for p in model.parameters()]  # parameters() skips tied duplicates, as DeepSpeed does
    largest_layer, largest_name = 0, None
    for name, module in model.named_modules():
        owned = sum(p.numel() for p in module.parameters(recurse=False))
        if owned > largest_layer:
            largest_layer, largest_name = owned, name
    return {
        "total": sum(sizes),
        "sizes": sizes,
        "largest_layer": largest_layer,
        "largest_layer_name": largest_name,
        "largest_parameter": max(sizes, default=0),
    }


def lora_targets(lora: LoraSection, family: str, auto: tuple[str, ...] | str | None = None) -> list[str] | str:
    """model.lora.target_modules resolved: "auto" is ``auto`` (a diffusion entry's own targets, as training resolves them), else the attention projections as the model's library names them."""

    return resolve_lora_targets(lora, auto or (DIFFUSERS_LORA_TARGETS if family.startswith("diffusion") else TRANSFORMERS_LORA_TARGETS))


def _lora_targets(model, lora: LoraSection, family: str, auto=None) -> list[tuple[str, torch.nn.Linear]]:
    import torch

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if lora_targets(lora, family, auto) == "all-linear":
        # As peft does: every linear layer except the output head.
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return [(n, m) for n, m in linears if m is not output]
    resolved = lora_targets(lora, family, auto)
    targets = resolved if isinstance(resolved, str) else list(resolved)
    chosen = [(n, m) for n, m in linears if is_lora_target(n, targets)]
    if not chosen:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
        raise ConfigError(
            [("model.lora.target_modules", f"{targets} match no linear layer of this model; its linear layers are: {', '.join(names)}")]
        )
    return chosen


def _lora_counts(model, lora: LoraSection, layer, family: str, auto=None) -> tuple[LoraShape, int, list[int]]:
    """Adapter weights: r x (in + out) per adapted linear layer, from the layers' shapes."""
    chosen = _lora_targets(model, lora, family, auto)
    sizes: list[int] = []
    for _, linear in chosen:
        sizes += adapter_parameter_sizes(lora, linear.in_features, linear.out_features)
    groups: dict[str, list[int]] = {}
    if layer is not None:
        in_layer = {id(m) for m in layer.modules()}
        for module_name, linear in chosen:
            if id(linear) in in_layer:
                group = LINEAR_INPUT_GROUPS.get(module_name.rsplit(".", 1)[-1], module_name.rsplit(".", 1)[-1])
                entry = groups.setdefault(group, [linear.in_features, 0])
                entry[1] += 1
    resolved = lora_targets(lora, family, auto)
    targets = (resolved,) if isinstance(resolved, str) else tuple(resolved)
    shape = LoraShape(
        r=lora.r,
        dropout=lora.dropout > 0,
        target_modules=targets,
        adapted_inputs=tuple((group, features, count) for group, (features, count) in groups.items()),
    )
    return shape, sum(sizes), sizes


# ---------------------------------------------------------------------------------------------
# Diffusion models


def _diffusers_class(library: str, name: str):
    if library == "transformers":
        import transformers

        module = transformers
    else:
        try:
            import diffusers
        except ImportError:
            raise ZeroPipeError("diffusion models need diffusers: pip install 'diffusers>=0.30'") from None
        module = diffusers
    cls = getattr(module, name, None)
    if cls is None:
        raise ZeroPipeError(f"{library} {_version(library)} has no class {name}: upgrade it or check the config's class name")
    return cls


def _build_component(component: dict[str, Any]):
    import torch

    cls = _diffusers_class(component.get("library", "diffusers"), component["class"])

    def build():
        if component.get("library") == "transformers":
            return cls._from_config(_hf_config(component["config"]), dtype=torch.bfloat16)
        fields = {k: v for k, v in component["config"].items() if not k.startswith("_")}
        # torch's Module.to, not diffusers' override: its warning about fp32-kept modules is moot on meta.
        return torch.nn.Module.to(cls.from_config(fields), torch.bfloat16)

    try:
        with torch.device("meta"):
            return build()
    except RuntimeError as err:
        if "meta" not in str(err):
            raise
        # A constructor that computes a buffer from tensors (diffusers 0.42's MMAudio mel filterbank) met one the meta device
        # context had not made: seen in a test process after a Kandinsky 6 pipeline ran (accelerate's empty-weights context fails
        # the same way), never in a fresh `zeropipe plan`. Built on the CPU instead, which only the small audio models reach.
        with torch.device("cpu"):
            return build()


def video_tokens(config: Any, frames: int, resolution: int, vae_factor: int = 8, vae_temporal_factor: int = 4) -> int:
    """The tokens a video transformer attends over: latent frames x latent height x latent width / patch volume."""
    patch_t, patch_h, patch_w = config.patch_size
    latent_frames = (frames - 1) // vae_temporal_factor + 1
    latent = resolution // vae_factor
    return (latent_frames // patch_t) * (latent // patch_h) * (latent // patch_w)


# ---------------------------------------------------------------------------------------------
# Diffusion models: the family's door


@dataclass(frozen=True)
class DiffusionSpecs:
    """How the planner describes a diffusion model: the builders the diffusion family registers (``families/diffusion/spec.py``).

    The planner knows no diffusion architecture: the family reads a catalog entry, a diffusers model's
    ``config.json`` and a pipeline folder through its entries, and traces the denoiser's activations.
    """

    catalog_entry: Callable[[dict[str, Any], LoraSection | None], ModelSpec]  # a catalog file's entry
    denoiser_config: Callable[[Path, dict[str, Any], LoraSection | None], ModelSpec]  # a unet/ or transformer/ config.json
    pipeline: Callable[[PipelineIndex, LoraSection | None], ModelSpec]  # a pipeline folder


_DIFFUSION_SPECS: list[DiffusionSpecs] = []


def register_diffusion_specs(specs: DiffusionSpecs) -> None:
    """The diffusion family's builders, registered when the family is imported (the last registration wins)."""
    _DIFFUSION_SPECS[:] = [specs]


def diffusion_specs() -> DiffusionSpecs:
    """The registered diffusion builders, asked by the planner for a diffusion catalog entry, config or pipeline folder."""
    if not _DIFFUSION_SPECS:
        raise ZeroPipeError("no diffusion family is loaded to describe this diffusion model: load the families first (zeropipe.families.families(), or import zeropipe.families.diffusion)")
    return _DIFFUSION_SPECS[0]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


__all__ = [
    "BlockShape",
    "FrozenModel",
    "LoraShape",
    "ModelSpec",
    "DiffusionSpecs",
    "catalog_names",
    "diffusion_specs",
    "register_diffusion_specs",
    "spec_from_catalog",
    "spec_from_params",
    "spec_from_path",
]


# ---------------------------------------------------------------------------------------------
# Mixtures of experts


def moe_counts(model, text) -> MoeCounts | None:
    """Total vs active weights of an MoE model (meta device), and its largest sparse block (``models.moe.moe_blocks``)."""
    from zeropipe.models.moe import moe_blocks, moe_shape

    shape = moe_shape(text)
    blocks = moe_blocks(model)
    if shape is None or not blocks:
        return None
    expert_params = sum(p.numel() for _, block in blocks for p in block.experts.parameters())
    leaf_name, leaf = max(blocks, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    total = sum(p.numel() for p in model.parameters())
    active = total - expert_params + expert_params * shape.active // shape.experts
    intermediate = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0)
    return MoeCounts(
        experts=shape.experts,
        active_experts=shape.active,
        moe_layers=len(blocks),
        expert_params=expert_params,
        active_params=active,
        expert_intermediate=intermediate,
        leaf_params=sum(p.numel() for p in leaf.parameters()),
        leaf_name=leaf_name,
        expert_weights=tuple((f"experts.{name}", *p.shape) for name, p in leaf.experts.named_parameters(recurse=False) if p.dim() == 3),
    )


def with_moe_counts(spec: ModelSpec, model, text) -> ModelSpec:
    """The spec of an MoE model: its counts, the MoE block as the largest gather, and the experts' activations.

    - Under ZeRO-3 training registers each sparse block as a leaf (``models.moe.mark_zero3_leaves``):
      the router and every expert of a block are gathered at once, so the block, not the experts'
      module alone, is the largest thing gathered. (Below ZeRO-3 nothing is gathered.)
    - Each token passes through ``active_experts`` experts: the activation formula's MLP is that many
      expert MLPs wide (``BlockShape.intermediate``), whatever the dense ``intermediate_size`` says.
    """
    from zeropipe.models.moe import moe_blocks

    moe = moe_counts(model, text)
    if moe is None:
        return spec
    fields: dict[str, Any] = {"moe": moe}
    if moe.leaf_params > spec.largest_layer_params:
        fields["largest_layer_params"] = moe.leaf_params
        fields["largest_layer_name"] = f"{moe.leaf_name} (an MoE block: router and {moe.experts} experts gathered as one ZeRO-3 leaf)"
    if spec.block is not None and moe.moe_layers == spec.layers:
        # transformers' experts say whether they are gated (use_experts_implementation's has_gate): their gate is a weight, not a module.
        gated = any(getattr(block.experts, "has_gate", "gate_up_proj" in dict(block.experts.named_parameters())) for _, block in moe_blocks(model))
        fields["block"] = replace(spec.block, intermediate=moe.active_experts * moe.expert_intermediate, gated_mlp=gated or spec.block.gated_mlp)
    return replace(spec, **fields)


def with_expert_adapters(spec: ModelSpec, target_parameters: list[str] | str | None, r: int) -> ModelSpec:
    """The spec with LoRA on the experts' 3-D weights too (``model.lora.target_parameters``), counted as peft builds it.

    peft's ``ParamWrapper`` adapts an (experts, a, b) weight with ``lora_A: Linear(in, r x experts)`` and
    ``lora_B: Linear(r x experts, out)``: r x experts x (a + b) weights, in every MoE layer.
    """
    moe = spec.moe
    if not target_parameters or moe is None:
        return spec
    chosen = [w for w in moe.expert_weights if target_parameters == "experts" or any(w[0] == t or t.endswith("." + w[0]) or w[0].endswith(t) for t in target_parameters)]
    sizes = [size for _, experts, rows, columns in chosen for size in (r * experts * rows, r * experts * columns)] * moe.moe_layers
    added = sum(sizes)
    return replace(spec, total_params=spec.total_params + added, trainable_params=spec.trainable_params + added, parameter_sizes=spec.parameter_sizes + tuple(sizes))
