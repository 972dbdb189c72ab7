"""Diffusion models (SDXL, SD 1.x, SD3, Flux, Wan video...): a denoiser trained from a diffusers pipeline directory.

Detected by ``model_index.json`` in model.path or ``pipeline:`` in an inline model.config.
What differs between diffusion architectures is not here but in their entries
(:mod:`zeropipe.families.diffusion.entries`); this module is the family's side: config
problems checked before any process starts, the launcher's data and cache plan
(:mod:`zeropipe.families.diffusion.prepare`), the rank task
(:class:`~zeropipe.families.diffusion.task.DiffusionTask`), the planner's spec and the export.
"""

from __future__ import annotations

from pathlib import Path

from zeropipe.config.pipeline_index import is_pipeline_folder, read_pipeline_index
from zeropipe.config.schema import ModelSection, RunConfig
from zeropipe.families.diffusion.entries import architecture_for_pipeline, task_problem
from zeropipe.families.diffusion.parts import part_problems
from zeropipe.families.diffusion.pipelines import preset_components
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.export.hf import ExportJob
from zeropipe.families.base import text_only_problems
from zeropipe.families.diffusion import draw as drawing
from zeropipe.families.diffusion.export import export_diffusion
from zeropipe.families.diffusion.prepare import prepare_diffusion_data
from zeropipe.families.diffusion.spec import diffusion_config_spec
from zeropipe.families.diffusion.task import DiffusionTask
from zeropipe.rundir import PreparedData, RunDir


def part_settings_problems(config: RunConfig, arch) -> list[tuple[str, str]]:
    """The settings against the architecture's parts: each part's own problems, and a part's setting (data.control_path) for an entry without that part."""
    return [] if arch is None else part_problems(config, arch)


class Diffusion:
    name = "diffusion"
    trains_tokenizer = False
    answers_prompts = False
    evaluates_loss = True  # the validation loss on held-out images at fixed timesteps and noise (validation.py)
    takes_images = False
    streams_answers = False
    sequence_parallel_refusal = None  # its task splits the latent tokens through diffusers' context-parallel plans (sequence_parallel.py)

    def sequence_parallel_problems(self, config: RunConfig, size: int) -> list[tuple[str, str, str]]:
        """What ``parallel.sequence_parallel_size: size`` needs of this entry: a verified plan, and heads that split into ``size``."""
        from zeropipe.families.diffusion import sequence_parallel as sp

        return sp.run_problems(self.architecture(config), config, size)

    def detect(self, section: ModelSection) -> bool:
        if section.path:
            return is_pipeline_folder(section.path)
        return "pipeline" in (section.config or {})

    def detect_dir(self, path: Path) -> bool:
        return is_pipeline_folder(path)

    def config_problems(self, config: RunConfig) -> list[tuple[str, str]]:
        problems = text_only_problems(config, self.name, bitsandbytes_base=True, held_out_data=True)
        if config.preference is not None:
            # Said before anything starts: the diffusion task would train it as supervised data, silently.
            problems.append(("preference", "preference tuning (DPO, ORPO, SimPO, KTO, reward models) is implemented for language and vision-language models, and this is a diffusion run: remove preference"))
        quant = config.model.quantization
        if quant is not None and not quant.is_fp8 and config.deepspeed.zero_stage not in (0, 1, 2):
            # models.bnb_base: measured, the layers run on CPU and GPU; ZeRO-3 cannot hold them.
            problems.append((
                "deepspeed.zero_stage",
                f"a {quant.storage} (bitsandbytes) base keeps its quantization state as attributes of each weight tensor, which ZeRO-3 neither "
                f"partitions nor gathers (you set {config.deepspeed.zero_stage}): set deepspeed.zero_stage: 2 (every rank holds the {quant.storage} base), "
                "or model.quantization: fp8 (partitioned under ZeRO-3)",
            ))
        # The objective raises these inside the ranks too; said here, nothing starts first.
        objective, prediction = self.objective(config), config.model.diffusion.prediction_type
        if objective == "flow" and prediction not in ("auto", "flow"):
            problems.append(("model.diffusion.prediction_type", f"this pipeline's transformer is trained with flow matching, not {prediction}: set auto or flow"))
        if objective == "ddpm" and prediction == "flow":
            problems.append(("model.diffusion.prediction_type", "flow does not apply to a UNet on a DDPM schedule: use auto, epsilon or v_prediction"))
        section = config.model.diffusion
        if section.min_t >= section.max_t:
            problems.append(("model.diffusion.min_t", f"{section.min_t} must be below max_t ({section.max_t}): the range of noise levels the run trains on would be empty"))
        elif objective == "ddpm" and section.expert:
            problems.append(("model.diffusion.expert", "applies to Wan 2.2 A14B's two flow-matching transformers, not to a UNet: remove it"))
        elif objective == "ddpm" and (section.min_t > 0 or section.max_t < 1):
            problems.append(("model.diffusion.min_t", "a timestep range (min_t/max_t) applies to flow-matching transformers (Wan, SD3, Flux), not to a UNet on a DDPM schedule: remove min_t and max_t"))
        arch = self.architecture(config)
        if arch is not None and task_problem(arch, arch.record.pipeline_class, section.task):
            problems.append(("model.diffusion.task", task_problem(arch, arch.record.pipeline_class, section.task)))
        if arch is not None and config.model.path and is_pipeline_folder(config.model.path):
            try:  # a checkpoint of the entry's pipeline class that the entry cannot train (Kandinsky 6's pi-Flow distilled heads)
                problems += arch.call.checkpoint_problems(read_pipeline_index(config.model.path))
            except ConfigError as err:  # a component config it reads is unreadable: named as the ranks would name it
                problems += list(err.problems)
        return problems + part_settings_problems(config, arch) + before_first_step_problems(config, arch)

    def architecture(self, config: RunConfig):
        """The configured architecture entry, or None when it cannot be told yet (a directory that does not say)."""
        section = config.model
        if section.config is not None and "pipeline" in section.config:
            try:
                return preset_components(section.config)[0]
            except ConfigError:
                return None
        if section.path:
            try:
                folder = read_pipeline_index(section.path)
            except ConfigError:
                return None
            return architecture_for_pipeline(folder.class_name, folder.index, section.diffusion.task)
        return None

    def objective(self, config: RunConfig) -> str | None:
        """The objective of the configured architecture (ddpm or flow), or None when it cannot be told yet."""
        arch = self.architecture(config)
        return arch.record.objective if arch else None

    def curriculum_problems(self, config: RunConfig) -> list[tuple[str, str]]:
        return [("stages", "curricula are implemented for language and vision-language models; train a diffusion model's stages as separate runs")]

    def hidden_size(self, config: RunConfig) -> int | None:
        return None  # DeepSpeed's bucket sizes keep their defaults

    def prepare_data(self, config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
        return prepare_diffusion_data(config, run, reuse)

    def rank_task(self, trainer) -> DiffusionTask:
        return DiffusionTask(trainer)

    def model_spec(self, config: RunConfig):
        return diffusion_config_spec(config)

    def export(self, job: ExportJob) -> Path:
        return export_diffusion(job)

    def load_for_generate(self, source, device, dtype):
        raise ZeroPipeError(
            f"{source.path} is a diffusion model: zeropipe generate writes text. A diffusion run draws its "
            "generate.prompts into RUN/samples/ during training (generate.sample_every)"
        )

    def generate(self, loaded, prompts, images, tokens, temperature, top_p, seed, raw, streamer=None):
        raise ZeroPipeError("zeropipe generate writes text; diffusion runs draw samples during training (generate.sample_every)")

    draws_images = True

    def evaluate_held_out(self, run: RunDir, info, dtype: str | None = None):
        """``zeropipe eval`` on a diffusion run: the validation loss of a checkpoint, in this process (evaluation.py)."""
        from zeropipe.families.diffusion.evaluation import evaluate_diffusion_checkpoint

        return evaluate_diffusion_checkpoint(run, info, dtype=dtype)

    def load_for_drawing(self, source, device, dtype):
        return drawing.load_for_drawing(source, device, dtype)

    def draw(self, loaded, out_dir, prompt, negative_prompt, width, height, steps, guidance, seed, frames, on_step=None):
        return drawing.draw(loaded, out_dir, prompt, negative_prompt, width, height, steps, guidance, seed, frames, on_step=on_step)


FAMILY = Diffusion()


def before_first_step_problems(config: RunConfig, arch) -> list[tuple[str, str]]:
    """What the ranks refuse before the first step that a part does not say (a single-file denoiser that is missing or unreadable), said by
    `zeropipe check` too, with the same key (issue 45: check refuses what train would; frame buckets: the video codec's problems)."""
    single_file = config.model.diffusion.denoiser_file
    if arch is None or not single_file:
        return []
    from zeropipe.families.diffusion.pipelines import single_file_renamer

    path = Path(single_file).expanduser()
    if not path.is_file():
        return [("model.diffusion.denoiser_file", f"{path} does not exist: point it at the .safetensors file of the transformer (or remove it to train model.path's own)")]
    try:
        single_file_renamer(arch.record.denoiser_class, path)  # reads the names only, as the ranks do before loading
    except ConfigError as err:
        return list(err.problems)
    return []
