"""The catalog of combinations that cannot work (errors) or waste the user's hardware (warnings).

Each rule has a stable id, a severity, the fix, and a link to where the behaviour is
documented, and is run on a config before any process starts (`zeropipe check`, and
`zeropipe train` first). Rules read a `CheckContext`; they never start anything.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from zeropipe.check.planning import activation_heavy, memory_problems, zero3_unneeded
from zeropipe.config.load import offload_problems
from zeropipe.config.optimizers import optimizer_problems
from zeropipe.config.schema import RunConfig

DS_CONFIG_DOCS = "https://www.deepspeed.ai/docs/config-json/"


@dataclass
class Finding:
    rule: str
    severity: str  # "error" or "warning"
    key: str
    message: str
    fix: str
    link: str

    def render(self) -> str:
        return f"{self.severity} {self.rule} {self.key}: {self.message}\n    fix: {self.fix}\n    see: {self.link}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CheckContext:
    config: RunConfig
    accelerator: str  # "cuda" or "cpu"
    world_size: int
    ds_config: dict[str, Any]  # what ZeRO-Pipe will hand to DeepSpeed ("auto" resolved)
    user_ds_config: dict[str, Any] | None = None  # deepspeed.config_file as written, if any
    plan: Any = None  # zeropipe.plan result for the config's own choice, when it could be computed
    problems: list[tuple[str, str]] = field(default_factory=list)  # errors found while building the context
    family_problems: list[tuple[str, str]] = field(default_factory=list)  # what the model family cannot run (its config_problems)
    conflicts: list[tuple[str, str]] = field(default_factory=list)  # YAML values the DeepSpeed JSON overrides
    nodes: Any = None  # the run's NodeLayout when it spans several machines
    node_reports: list[dict] | None = None  # what each node's agent said when probed (zeropipe check), or None
    user_set: dict[str, Any] = field(default_factory=dict)  # memory knobs the user set (Choice field names): fixes keep them or say why not
    hardware: Any = None  # the resolved run's Hardware: the machine (and CPU) the check is for

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    def raw(self, *path: str) -> Any:
        """A value of the user's DeepSpeed JSON (or the generated one)."""
        node: Any = self.user_ds_config if self.user_ds_config is not None else self.ds_config
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node


@dataclass
class Rule:
    id: str
    severity: str
    title: str
    link: str
    check: Callable[[CheckContext], list[tuple[str, str, str]]]  # -> [(key, message, fix)]


RULES: list[Rule] = []


def rule(id: str, severity: str, title: str, link: str):
    def register(check):
        RULES.append(Rule(id, severity, title, link, check))
        return check

    return register


@rule("ZP000", "error", "a setting the model family cannot run", "docs/architecture.md")
def family_cannot_run(ctx: CheckContext):
    return [(key, message, "change the setting as the message says") for key, message in ctx.family_problems]


@rule("ZP001", "error", "pipeline parallelism with ZeRO-2/3", "https://www.deepspeed.ai/tutorials/pipeline/")
def pipeline_with_zero(ctx: CheckContext):
    pipeline = ctx.raw("pipeline")
    if pipeline and ctx.zero_stage >= 2:
        return [("deepspeed.config_file", f"a 'pipeline' block with ZeRO stage {ctx.zero_stage}: DeepSpeed's PipelineEngine refuses ZeRO-2/3", "remove the 'pipeline' block: ZeRO-Pipe trains with the standard engine, where ZeRO-2/3 and offload work")]
    return []


@rule("ZP002", "error", "offload below the ZeRO stage that supports it", DS_CONFIG_DOCS + "#parameter-offloading")
def offload_below_stage(ctx: CheckContext):
    """The config loader's offload check, on the resolved run (the user's JSON included), where the YAML alone did not show it."""
    zero = ctx.ds_config.get("zero_optimization", {})
    devices = [(zero.get(block) or {}).get("device", "none") for block in ("offload_param", "offload_optimizer")]
    found = offload_problems(ctx.zero_stage, *("cpu" if device not in (None, "none") else "none" for device in devices))
    where = f" (or zero_optimization in {ctx.config.deepspeed.config_file})" if ctx.config.deepspeed.config_file else ""
    return [(key, message, f"use ZeRO stage 3: deepspeed.zero_stage: 3{where}, or drop the offload") for key, message in found]


CPU_OPTIMIZERS = {"adam", "adamw", "adagrad", "lion"}


@rule("ZP003", "error", "optimizer DeepSpeed cannot run on the CPU with offload_optimizer", DS_CONFIG_DOCS + "#optimizer-parameters")
def client_optimizer_with_offload(ctx: CheckContext):
    device = (ctx.ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    if device in (None, "none"):
        return []
    optimizer = ctx.ds_config.get("optimizer")
    if optimizer is None:
        return [("deepspeed.config_file", "offload_optimizer with no 'optimizer' block: DeepSpeed 0.17+ refuses a client optimizer with offload", "add an optimizer block (Adam/AdamW) or let ZeRO-Pipe write it (remove the config_file's optimizer: null)")]
    if str(optimizer.get("type", "")).lower() not in CPU_OPTIMIZERS:
        return [("deepspeed.config_file", f"optimizer {optimizer.get('type')!r} has no CPU implementation for offload_optimizer", "use AdamW, Adam, Adagrad or Lion, or set offload_optimizer: none")]
    return []


@rule("ZP041", "error", "an optimizer the ZeRO stage or offload cannot run", "docs/optimizers.md")
def optimizer_with_stage_or_offload(ctx: CheckContext):
    """train.optimizer against the stage and offload the run resolves to (config.optimizers says why each is refused)."""
    device = (ctx.ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    return optimizer_problems(ctx.config.train.optimizer, ctx.zero_stage, offload=device not in (None, "none"))


LOSS_SCALE_KEYS = {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale", "auto_cast"}


@rule("ZP004", "error", "loss-scale keys inside the bf16 block", DS_CONFIG_DOCS + "#bfloat16-training-options")
def loss_scale_in_bf16(ctx: CheckContext):
    bf16 = ctx.raw("bf16") or {}
    keys = sorted(LOSS_SCALE_KEYS & set(bf16)) if isinstance(bf16, dict) else []
    if keys:
        return [("deepspeed.config_file", f"bf16 has {', '.join(keys)}: bf16 needs no loss scaling and DeepSpeed 0.17+ fails with 'Extra inputs are not permitted'", f"delete {', '.join(keys)} from the bf16 block (they belong in fp16)")]
    return []


@rule("ZP005", "error", "fp16 without loss scaling", DS_CONFIG_DOCS + "#fp16-training-options")
def fp16_without_loss_scaling(ctx: CheckContext):
    fp16 = ctx.ds_config.get("fp16") or {}
    if fp16.get("enabled") and fp16.get("loss_scale", 0) == 1:
        return [("deepspeed.fp16.loss_scale", "fp16 with a static loss scale of 1: small gradients underflow to zero and training silently stalls", "set loss_scale: 0 (dynamic loss scaling) or train in bf16")]
    return []


@rule("ZP006", "error", "device_map or low_cpu_mem_usage with DeepSpeed", "https://huggingface.co/docs/transformers/main/en/deepspeed#zero-3")
def device_map_with_deepspeed(ctx: CheckContext):
    kwargs = ctx.config.model.load_kwargs
    found = []
    if kwargs.get("device_map") is not None:
        found.append(("model.load_kwargs.device_map", "device_map spreads layers over GPUs with accelerate, which conflicts with DeepSpeed's own placement", "remove device_map: DeepSpeed places and partitions the model"))
    if kwargs.get("low_cpu_mem_usage") and ctx.zero_stage == 3:
        found.append(("model.load_kwargs.low_cpu_mem_usage", "low_cpu_mem_usage is incompatible with ZeRO-3 (zero.Init already avoids full copies)", "remove low_cpu_mem_usage"))
    return found


@rule("ZP007", "error", "QLoRA that cannot load: no CUDA or bitsandbytes, no adapters, or a storage dtype ZeRO-3 cannot partition", "https://huggingface.co/docs/peft/accelerate/deepspeed#use-peft-qlora-and-deepspeed-with-zero3-for-finetuning-large-models-on-multiple-gpus")
def qlora_quant_storage(ctx: CheckContext):
    quant = ctx.config.model.quantization
    found = []
    if quant is None:
        return found
    if quant.is_fp8:
        return fp8_base_problems(ctx)
    if ctx.config.model.lora is None:
        found.append(("model.quantization", f"a {quant.storage} base cannot be trained by itself", "add model.lora (QLoRA trains adapters on the frozen 4-bit base)"))
    if quant.storage == "int8" and ctx.zero_stage == 3:
        found.append(
            (
                "model.quantization",
                "bitsandbytes' int8 layers keep their scales as attributes of the weight, which ZeRO-3 does not partition or gather",
                "set model.quantization: fp8 (8-bit, partitioned under ZeRO-3), or deepspeed.zero_stage: 2 for int8",
            )
        )
    precision = ctx.config.deepspeed.precision
    if ctx.zero_stage == 3 and quant.quant_storage not in ("auto", precision):
        found.append(
            (
                "model.quantization.quant_storage",
                f"{quant.quant_storage} differs from the model's dtype {precision} (deepspeed.precision): ZeRO-3 partitions the packed 4-bit weights "
                "with the other parameters, which needs them stored in the same dtype",
                f"set quant_storage: auto (or {precision})",
            )
        )
    install = f"pip install 'bitsandbytes>={BITSANDBYTES_CPU_4BIT}' (or pip install 'zeropipe[qlora]')"
    installed = bitsandbytes_version()
    if installed is None:
        found.append(("model.quantization", "bitsandbytes is not installed; QLoRA loads the 4-bit base with it", install))
    elif ctx.accelerator != "cuda" and installed < version_tuple(BITSANDBYTES_CPU_4BIT):
        # CUDA kernels exist in every version; CPU ranks need the CPU 4-bit backend. Neither here: one finding.
        found.append(
            (
                "model.quantization",
                f"this run has no GPU and bitsandbytes {'.'.join(map(str, installed))} has no CPU 4-bit backend (it came in {BITSANDBYTES_CPU_4BIT})",
                f"{install}, remove model.quantization (plain LoRA runs on CPU) or run on a CUDA machine",
            )
        )
    if not ctx.config.model.path and not (ctx.config.model.config or {}).get("pipeline"):  # a diffusion preset is saved as a pipeline folder first
        found.append(("model.quantization", "4-bit loading quantizes pretrained weights; a randomly initialised model.config has none", "set model.path to a pretrained model"))
    return found


@rule("ZP021", "error", "an adapter peft cannot add to a ZeRO-3 partitioned model", "docs/adapters.md")
def adapter_under_zero3(ctx: CheckContext):
    lora = ctx.config.model.lora
    if lora is None or lora.kind != "loha" or ctx.zero_stage != 3:
        return []
    # peft's LoHa sizes its factors from the base layer's weight tensor (LoRA, DoRA and LoKr from the
    # layer's in/out features); ZeRO-3 has partitioned that tensor away by then, so every rank would fail.
    return [(
        "model.lora.kind",
        "peft's LoHa reads each adapted layer's full weight when it adds the adapter, which ZeRO-3 has partitioned by then",
        "use deepspeed.zero_stage 2 (or 0/1) for LoHa, or kind: lokr (LyCORIS's other adapter), which trains under ZeRO-3",
    )]


def fp8_base_problems(ctx: CheckContext) -> list[tuple[str, str, str]]:
    """An fp8 base that cannot train: no adapters (a full fine-tune of quantized weights) or nothing pretrained to quantize."""
    section = ctx.config.model
    found = []
    if section.lora is None:
        found.append(
            (
                "model.quantization",
                f"a full fine-tune cannot update weights stored in {section.quantization.storage}: the quantized base is frozen, only adapters train on it",
                "add model.lora (LoRA on the fp8 base), or remove model.quantization to fine-tune every weight in deepspeed.precision",
            )
        )
    if not section.path and not (section.config or {}).get("pipeline"):
        found.append(("model.quantization", "an fp8 base is quantized from pretrained weights; a randomly initialised model.config has none", "set model.path to a pretrained model"))
    if section.load_kwargs:
        found.append(("model.load_kwargs", "the fp8 base is loaded and quantized by ZeRO-Pipe's streaming loader, which takes no from_pretrained arguments", "remove model.load_kwargs"))
    return found


# The first bitsandbytes whose 4-bit quantisation and matmul run on CPU tensors (its CPU backend).
BITSANDBYTES_CPU_4BIT = "0.47"


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def bitsandbytes_version() -> tuple[int, ...] | None:
    """bitsandbytes' installed version, or None; read from its metadata, not by importing it (which can take seconds)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        return version_tuple(importlib.metadata.version("bitsandbytes"))
    except importlib.metadata.PackageNotFoundError:
        return None


@rule("ZP008", "error", "batch sizes inconsistent with train_batch_size", DS_CONFIG_DOCS + "#batch-size-related-parameters")
def batch_triple(ctx: CheckContext):
    return [(key, message, "set train_batch_size to \"auto\" or to micro-batch x accumulation x ranks") for key, message in ctx.problems if key == "deepspeed.train_batch_size"]


@rule("ZP009", "error", "DeepSpeed rejects a key of its config", DS_CONFIG_DOCS)
def deepspeed_schema(ctx: CheckContext):
    """Run DeepSpeed's own config parser on the whole JSON, before any process starts.

    The blocks with pydantic models of their own (zero_optimization, bf16, fp16) are validated
    first, so that an error names its full key; then ``DeepSpeedConfig`` reads everything else
    (compile, monitors, the batch keys...) as each rank's ``deepspeed.initialize`` would.
    """
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    from deepspeed.runtime.config import DeepSpeedConfig

    # What stopped the JSON from being resolved at all (an "auto" no rule fills, an optimizer train.* cannot describe): said here,
    # with its key; ZP008 says the batch.
    found = [(key, message, "change deepspeed.config_file (or the YAML) as the message says") for key, message in ctx.problems if key != "deepspeed.train_batch_size"]
    if ctx.problems:
        return found  # ds_config is the file as written then, "auto" values and all: DeepSpeed's parser would only repeat it
    whole = copy.deepcopy(ctx.ds_config)
    for block, model in (("zero_optimization", DeepSpeedZeroConfig), ("bf16", DeepSpeedBF16Config), ("fp16", DeepSpeedFP16Config)):
        value = ctx.ds_config.get(block)
        if not isinstance(value, dict):
            continue
        try:
            model(**value)
        except ValidationError as err:
            found += _pydantic_findings(block, err)
            whole.pop(block)  # said once, with its key; the whole parse below looks at the rest
    # DeepSpeed checks train_batch_size against the world size it sees (1 here): ZP008 checks it for the run's ranks. A JSON that gives
    # train_batch_size alone (DeepSpeedExamples' cifar and Megatron configs) keeps it: DeepSpeed derives the micro-batch from it.
    if whole.get("train_micro_batch_size_per_gpu") not in (None, "auto"):
        whole.pop("train_batch_size", None)
    elif isinstance(whole.get("train_batch_size"), int) and isinstance(whole.get("gradient_accumulation_steps"), int):
        # One rank here: the micro-batch DeepSpeed derives is train_batch_size / accumulation, which must divide (ZP008 says so for the run's ranks).
        whole["train_batch_size"] = max(whole["gradient_accumulation_steps"], whole["train_batch_size"] - whole["train_batch_size"] % whole["gradient_accumulation_steps"])
    try:
        DeepSpeedConfig(whole)
    except ValidationError as err:
        block = next((name for name, model in DEEPSPEED_BLOCK_MODELS.items() if model == err.title), err.title)
        found += _pydantic_findings(block, err)
    except Exception as err:  # DeepSpeed's own asserts and ValueErrors: its message is the best we have
        said = str(err).splitlines()[0] if str(err) else ""
        found.append(("deepspeed", f"DeepSpeed's config parser fails on this JSON ({type(err).__name__}: {said}): a value of the wrong type, or a block it does not read as given",
                      "compare deepspeed.config_file with https://www.deepspeed.ai/docs/config-json/ and fix the value"))
    return found


# Top-level blocks of a DeepSpeed JSON and the pydantic model DeepSpeed validates each with (by class name).
DEEPSPEED_BLOCK_MODELS = {
    "compile": "CompileConfig",
    "comms_logger": "CommsLoggerConfig",
    "timers": "DeepSpeedThroughputTimerConfig",
    "tensorboard": "TensorBoardConfig",
    "wandb": "WandbConfig",
    "csv_monitor": "CSVConfig",
    "comet": "CometConfig",
    "hybrid_engine": "HybridEngineConfig",
    "tensor_parallel": "TPTrainingConfig",
}


def _pydantic_findings(block: str, err) -> list[tuple[str, str, str]]:
    found = []
    for error in err.errors():
        key = ".".join(str(part) for part in (block, *error["loc"]))
        if block == "bf16" and error["loc"] and error["loc"][0] in LOSS_SCALE_KEYS:
            continue  # ZP004 says it better
        fix = f"remove {key}" if error["type"] == "extra_forbidden" else f"fix the value of {key}"
        found.append((f"deepspeed: {key}", f"DeepSpeed says: {error['msg']}", fix))
    return found


# Parts of DeepSpeed that ZeRO-Pipe's data-parallel ZeRO engine does not run: a JSON asking for
# one would start and then fail on every rank (or silently train otherwise).
UNSUPPORTED_DEEPSPEED = {
    "tensor_parallel": (
        "automatic tensor parallelism needs the model sharded by DeepSpeed's AutoTP and a data loader that feeds every rank of a TP group the same "
        "batch; ZeRO-Pipe's ranks each read their own batch, so the first step fails with \"Data inconsistency within the TP group\"",
        "remove the tensor_parallel block: ZeRO-3 (zero_optimization.stage 3) shards the parameters over the GPUs instead",
    ),
    # docs/moe.md "Expert parallelism": tried on 2 CPU ranks; with that one call bypassed, a step runs under ZeRO-2 and ZeRO-3.
    "expert_parallel": (
        "DeepSpeed 0.19.8's AutoEP fails in deepspeed.initialize with transformers 5 on every device: deepspeed/module_inject/auto_ep_presets/base.py "
        "line 326 calls registry.get(key, default) on transformers' _CAN_RECORD_REGISTRY, whose get() takes one argument "
        "(TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given)",
        "remove the expert_parallel block: ZeRO-3 with each MoE block gathered whole (model.zero3_leaf_blocks, the default) shards the experts over the GPUs instead",
    ),
}


@rule("ZP020", "error", "a DeepSpeed feature ZeRO-Pipe does not run", DS_CONFIG_DOCS)
def deepspeed_feature_unsupported(ctx: CheckContext):
    """Blocks of the JSON that DeepSpeed accepts but that fail on every rank (or do nothing) under ZeRO-Pipe."""
    found = []
    where = ctx.config.deepspeed.config_file or "deepspeed.overrides"
    for key, (why, fix) in UNSUPPORTED_DEEPSPEED.items():
        value = ctx.ds_config.get(key)
        if value in (None, {}, False, 1) or (isinstance(value, dict) and value.get("enabled") is False):
            continue
        found.append((f"deepspeed: {key}", f"{where} sets {key}: {why}", fix))
    zero = ctx.ds_config.get("zero_optimization") or {}
    for block in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(block), dict) and zero[block].get("device") == "nvme":
            found.append((
                f"deepspeed: zero_optimization.{block}.device",
                f"{where} offloads to NVMe: ZeRO-Pipe neither plans nor checks NVMe offload (it needs nvme_path, an aio block and DeepSpeed's async_io op built, "
                "and fails at start with \"Unable to JIT load the async_io op\" without them)",
                f"set zero_optimization.{block}.device to \"cpu\" (host RAM), or remove the block",
            ))
    return found


@rule("ZP022", "error", "sequence parallelism this run cannot use", "docs/parallel.md")
def sequence_parallel_unsupported(ctx: CheckContext):
    """parallel.sequence_parallel_size (or a DeepSpeed JSON's sequence_parallel_size): what Ulysses needs here."""
    size = ctx.config.parallel.sequence_parallel_size
    if size == 1:
        return []
    key = "parallel.sequence_parallel_size"
    off = f"set {key}: 1"
    from zeropipe.families import family_of

    try:
        family = family_of(ctx.config.model)
    except Exception:  # noqa: BLE001 - ZP000 reports a model the families cannot read
        return []
    refusal = getattr(family, "sequence_parallel_refusal", "its rank task does not split sequences over a group")
    if refusal is not None:
        return [(key, f"sequence parallelism is not supported for this model ({family.name}): {refusal}", off)]
    found = []
    if ctx.config.preference is not None:
        found.append((key, "preference tuning scores whole sequences (chosen against rejected) on one rank; ZeRO-Pipe splits only "
                      "supervised fine-tuning's next-token loss over a group", off + ", or remove the preference section"))
    if ctx.config.data.packing:
        found.append((key, "packed sequences need their example boundaries kept inside attention, and DeepSpeed's Ulysses attention with "
                      "sdpa or eager attends causally over the whole row: examples would see each other", off + ", or set data.packing: false"))
    if ctx.config.model.attn_implementation == "eager":
        found.append(("model.attn_implementation", "DeepSpeed's Ulysses attention refuses eager attention (it needs a 4-D mask the size of "
                      "the whole sequence squared)", "set model.attn_implementation: sdpa"))
    if ctx.world_size % size:
        degrees = [d for d in range(2, ctx.world_size + 1) if ctx.world_size % d == 0]
        found.append((key, f"{ctx.world_size} ranks do not divide into groups of {size}",
                      f"set {key} to one of {', '.join(map(str, degrees)) or '1'}, or run on a multiple of {size} ranks"))
    if ctx.zero_stage != 3:
        found.append(("deepspeed.zero_stage", "sequence parallelism is tested exact under ZeRO-3 only (DeepSpeed divides the gradients "
                      "by different rank counts in its stages; ZeRO-1/2 are not verified against data parallelism yet)", "set deepspeed.zero_stage: 3"))
    elif (ctx.ds_config.get("zero_optimization") or {}).get("reduce_scatter") is False:
        found.append(("deepspeed: zero_optimization.reduce_scatter", "under sequence parallelism ZeRO-Pipe scales the loss for ZeRO-3's "
                      "reduce-scatter of gradients (which divides by every rank); its all-reduce path divides by world / N instead",
                      "remove zero_optimization.reduce_scatter (DeepSpeed's default is true)"))
    own = getattr(family, "sequence_parallel_problems", None)  # a family that checks its own model (diffusion: the entry's plan and heads)
    if own is not None:
        return found + own(ctx.config, size)
    try:
        from zeropipe.models.common import model_config

        text = model_config(ctx.config.model).get_text_config()
        heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    except Exception:  # noqa: BLE001 - a config that cannot be read is reported by the family's own checks
        return found
    if heads % size or (kv_heads % size and size % kv_heads):
        degrees = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        found.append((key, f"Ulysses splits attention heads over the group: the model's {heads} attention heads ({kv_heads} key/value heads) "
                      f"do not split into {size} (the key/value heads must divide by it or divide it)",
                      f"set {key} to one of {', '.join(map(str, degrees)) or '1'}"))
    return found


@rule("ZP010", "error", "precision the hardware cannot run", DS_CONFIG_DOCS + "#bfloat16-training-options")
def precision_on_hardware(ctx: CheckContext):
    precision = ctx.config.deepspeed.precision
    if ctx.accelerator == "cpu" and (ctx.ds_config.get("fp16") or {}).get("enabled"):
        if ((ctx.user_ds_config or {}).get("fp16") or {}).get("enabled") is True:
            where = ctx.config.deepspeed.config_file
            return [("deepspeed.config_file", f"{where} sets fp16.enabled: true, and DeepSpeed does not support fp16 on CPU ranks",
                     f'set "fp16": {{"enabled": false}} in {where} (add "bf16": {{"enabled": true}} for bf16), or remove its fp16 block')]
        return [("deepspeed.precision", "DeepSpeed does not support fp16 on CPU ranks", "set deepspeed.precision: auto, bf16 or fp32")]
    hardware = ctx.hardware
    if ctx.accelerator == "cuda" and precision == "bf16" and hardware is not None and hardware.accelerator == "cuda" and hardware.gpu_bf16_native is False:
        # The hardware's compute capability, not torch.cuda.is_bf16_supported(), which counts emulation.
        return [("deepspeed.precision", f"bf16 needs an Ampere or newer GPU (compute capability 8.0; {hardware.gpu_name or 'these GPUs'} is older)", "set deepspeed.precision: auto (fp16 here) or fp16")]
    return []


@rule("ZP019", "warning", "bf16 or offload on CPU ranks, where they gain nothing", "docs/plan.md#the-recommendation")
def cpu_ranks_gain_nothing(ctx: CheckContext):
    if ctx.accelerator != "cpu":
        return []
    from zeropipe.doctor.facts import cpu_precision

    found = []
    native = ctx.hardware is not None and ctx.hardware.cpu_bf16_native
    if ctx.config.deepspeed.precision == "bf16" and not native:
        found.append(
            (
                "deepspeed.precision",
                f"bf16 on CPU ranks: {cpu_precision(False)[1]}",
                "set deepspeed.precision: auto (fp32 on this CPU); where bf16 itself is the point, add ZP019 to run.accept_warnings",
            )
        )
    offloaded = [name for name in ("offload_optimizer", "offload_param") if getattr(ctx.config.deepspeed, name) == "cpu"]
    if offloaded:
        found.append(
            (
                f"deepspeed.{offloaded[0]}",
                (
                    f"{' and '.join(offloaded)} on CPU ranks saves no memory: a CPU rank's memory is host RAM already, so offloading "
                    "moves bytes from host RAM to host RAM and adds copies (pinned buffers, an fp32 gradient buffer)"
                ),
                (
                    f"set {' and '.join(f'deepspeed.{name}: none' for name in offloaded)} (zeropipe plan never offloads on CPU ranks); "
                    "where offload itself is the point, add ZP019 to run.accept_warnings"
                ),
            )
        )
    return found


@rule("ZP014", "warning", "the YAML and the DeepSpeed JSON disagree", "docs/config.md")
def yaml_and_json_disagree(ctx: CheckContext):
    return [(key, message, "keep the setting in one place: the YAML, or deepspeed.config_file") for key, message in ctx.conflicts]


@rule("ZP011", "error", "the plan exceeds GPU memory or host RAM", "docs/plan.md")
def plan_exceeds_memory(ctx: CheckContext):

    return memory_problems(ctx)


@rule("ZP012", "warning", "ZeRO-3 for a model that fits with ZeRO-1/2", "https://www.deepspeed.ai/tutorials/zero/")
def zero3_for_small_model(ctx: CheckContext):

    return zero3_unneeded(ctx)


@rule("ZP013", "warning", "activations dominate and gradient checkpointing is off", "https://huggingface.co/docs/transformers/main/en/perf_train_gpu_one#gradient-checkpointing")
def activations_dominate(ctx: CheckContext):

    return activation_heavy(ctx)


@rule("ZP030", "error", "a converted config that `zeropipe convert` said cannot train", "docs/migrate.md")
def converted_cannot_train(ctx: CheckContext):
    """The verdict of the conversion travels in the YAML (convert.cannot_train), so that check and train refuse it like the source file."""
    section = ctx.config.convert
    if section is None:
        return []
    return [
        ("convert.cannot_train", f"converted from the {section.tool} config {section.source}, which ZeRO-Pipe cannot train as it is: {reason}",
         "do what the message says, then delete that line of convert.cannot_train")
        for reason in section.cannot_train
    ]
@rule("ZP047", "error", "activation offload without gradient checkpointing", "docs/plan.md#activation-offload")
def activation_offload_needs_checkpointing(ctx: CheckContext):
    # Offload moves the inputs that checkpointed blocks save for their recomputation: without checkpointing there are none
    # (and offloading every saved tensor instead would copy the whole forward's activations over the host link).
    train, model = ctx.config.train, ctx.config.model
    if train.activation_offload and model.gradient_checkpointing is not True:
        setting = "'auto'" if model.gradient_checkpointing == "auto" else "false"
        return [
            (
                "train.activation_offload",
                f"activation offload keeps the checkpointed blocks' inputs in host RAM, but model.gradient_checkpointing is {setting}: "
                "nothing is checkpointed, so nothing would be offloaded",
                "set model.gradient_checkpointing: true, or train.activation_offload: false",
            )
        ]
    return []


def run_rules(ctx: CheckContext, rules: list[Rule] | None = None) -> list[Finding]:
    findings = []
    for item in rules or RULES:
        for key, message, fix in item.check(ctx):
            findings.append(Finding(item.id, item.severity, key, message, fix, item.link))
    return findings




@rule("ZP048", "error", "a tiled loss where the run computes no causal-LM next-token loss", "docs/parallel.md#the-sequence-tiled-loss-paralleltiled_loss")
def tiled_loss_unused(ctx: CheckContext):
    # parallel.tiled_loss: true tiles the causal LM's supervised next-token loss only; elsewhere it would be silently ignored.
    if ctx.config.parallel.tiled_loss is not True:
        return []
    from zeropipe.families import family_of

    try:
        family = family_of(ctx.config.model)
    except Exception:  # noqa: BLE001 - ZP000 reports a model the families cannot read
        return []
    fix = "set parallel.tiled_loss: auto (or false)"
    if not getattr(family, "tiles_its_loss", False):
        return [("parallel.tiled_loss", f"the tiled loss is the causal LM's next-token loss; this model ({family.name}) computes another", fix)]
    if ctx.config.preference is not None or ctx.config.grpo is not None:
        return [("parallel.tiled_loss", "preference tuning and GRPO compute their own losses from per-sequence log-probabilities; the tiled "
                 "loss replaces supervised fine-tuning's next-token loss only", fix)]
    return []
