"""Tokenizers of tiny presets, built without a download: single characters plus each model's special tokens and chat template.

Shared by the entries' tiny presets (``PromptEncoding.tiny_tokenizer``) and their tests.
"""

from __future__ import annotations

import re
import string

# ------------------------------------------------------------------ tiny preset parts
TOKENIZER_CHARACTERS = sorted(set(string.ascii_lowercase + string.digits + ",.-'"))


def character_tokenizer(max_length: int = 77):
    """A CLIP tokenizer whose tokens are single characters: enough for captions of a tiny model, built without a download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for char in TOKENIZER_CHARACTERS:
            vocab[char + suffix] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = max_length
    return tokenizer


def character_t5_tokenizer(max_length: int = 64):
    """A T5 (sentencepiece unigram) tokenizer of single characters, the kind UMT5 and T5 encoders use, built without a download."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    word_start = "\u2581"  # sentencepiece's marker of a word's first piece
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (word_start, -1.0)]
    vocab += [(char, -2.0) for char in TOKENIZER_CHARACTERS] + [(word_start + char, -2.5) for char in TOKENIZER_CHARACTERS]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    cls = getattr(transformers, "T5TokenizerFast", None) or transformers.T5Tokenizer
    return cls(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0, model_max_length=max_length)


CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# The tiny tokenizer's characters: its ids are the chat tokens, <unk>, then these.
CHARACTERS = tuple(sorted(set(TOKENIZER_CHARACTERS) | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ:;!?,. \n")))


def character_qwen_tokenizer(max_length: int = 256, extra_tokens: tuple[str, ...] = (), extra_characters: str = ""):
    """A Qwen2 tokenizer whose tokens are single characters plus the chat template's special tokens, built without a download.

    ``extra_tokens`` (special) and ``extra_characters`` come after the others, so the ids of the text-to-image tokenizer stay as they were.
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate((*CHAT_TOKENS, "<unk>", *CHARACTERS, *extra_tokens, *extra_characters))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.add_special_tokens([*CHAT_TOKENS, *extra_tokens])
    return transformers.Qwen2TokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>", model_max_length=max_length
    )


# Qwen3's chat template as ZImagePipeline applies it (one user turn, generation prompt, thinking on: no think block).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Mistral's chat template as FLUX.2's prompts use it: a system turn and a user turn, each content a list of typed parts.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")


def character_mistral_tokenizer(max_length: int = 512):
    """A tokenizer of single characters with Mistral's special tokens and chat template, built without a download."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    characters = sorted(set(TOKENIZER_CHARACTERS) | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ:;!?,. \n"))
    vocab = {token: index for index, token in enumerate((*MISTRAL_SPECIAL_TOKENS, *characters))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.add_special_tokens(list(MISTRAL_SPECIAL_TOKENS))
    made = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", model_max_length=max_length
    )
    made.chat_template = MISTRAL_CHAT_TEMPLATE
    return made


# Qwen2.5-VL's vision tokens, after the chat tokens and the characters in the tiny tokenizer.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


# The edit template's system prompt has parentheses, which the text-to-image tokenizer lacks.
EXTRA_CHARACTERS = "()"


def tiny_edit_tokenizer(max_length: int = 1024):
    return character_qwen_tokenizer(max_length, extra_tokens=VISION_TOKENS, extra_characters=EXTRA_CHARACTERS)


# The tiny Gemma tokenizer's special tokens (ids 0..3) and characters: the system prompt's capitals and "<Prompt Start>" included.
GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>")


GEMMA_CHARACTERS = tuple(sorted(set(TOKENIZER_CHARACTERS) | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ:;!?,.<> ")))


def character_gemma_tokenizer(max_length: int = 256):
    """A Gemma tokenizer of single characters (``<bos>`` first, right padding with ``<pad>``), built without a download."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate((*GEMMA_SPECIAL, *GEMMA_CHARACTERS))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.add_special_tokens(list(GEMMA_SPECIAL))
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    return transformers.GemmaTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", model_max_length=max_length
    )


def template_tokenizer(max_length: int = 256):
    """A Llama-style tokenizer for tiny presets, built without a download: HunyuanVideo's prompt template's words are single tokens, the rest characters.

    HunyuanVideoPipeline cuts the first 95 tokens (its template's system prompt, as Llama 3
    tokenizes it) off the encoder's output. A tokenizer of single characters would make the
    template hundreds of tokens long and push the prompt itself past the 256 kept tokens; with
    the template's words as tokens it is 103 tokens long (95 with Llama 3's tokenizer), so the
    cut leaves the prompt whole, as with the real tokenizer.
    """
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    word_start = "\u2581"  # sentencepiece's marker of a word's first piece
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    template = DEFAULT_PROMPT_TEMPLATE["template"]
    for special in specials:
        template = template.replace(special, " ")
    words = sorted(set(re.findall(r"[A-Za-z]+", template)))
    vocab = [(token, 0.0) for token in specials] + [(word_start, -1.0)]
    characters = sorted(set(TOKENIZER_CHARACTERS) | set(template.replace("{}", "")) - {" "})
    vocab += [(char, -2.0) for char in characters] + [(word_start + char, -2.5) for char in characters]
    vocab += [(word_start + word, -1.5) for word in words if len(word) > 1]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials if token != "<unk>"])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|end_of_text|>", unk_token="<unk>",
        model_max_length=max_length + DEFAULT_PROMPT_TEMPLATE["crop_start"],
    )


def template_qwen_tokenizer(pipeline_class: str, max_length: int):
    """A Qwen-style tokenizer for tiny presets, built without a download: the pipeline's prompt template's words are single tokens, the rest characters.

    The video pipelines cut the first 128 tokens (their system prompt, as Qwen2.5's tokenizer
    tokenizes it) off the encoder's output. A tokenizer of single characters makes that system
    prompt hundreds of tokens long, and the prompt itself would reach the transformer behind most
    of the template; with the template's words as tokens (sentencepiece-style, a word with its
    leading space one token) the system prompt is 128 tokens here too, so the cut leaves
    ``<|im_start|>user`` and the prompt, as with the real tokenizer.
    """
    import re

    import diffusers
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # The pipeline's own template; its constructor takes every component as None.
    template = getattr(diffusers, pipeline_class)(*[None] * 7).prompt_template
    plain = template
    for token in CHAT_TOKENS:
        plain = plain.replace(token, " ")
    words = sorted({word for word in re.findall(r"[A-Za-z]+", plain) if len(word) > 1})
    characters = sorted(set(TOKENIZER_CHARACTERS) | set(plain.replace("{}", "")) - {" "})
    word_start = "\u2581"  # sentencepiece's marker of a word's first piece
    vocab = [(token, 0.0) for token in (*CHAT_TOKENS, "<unk>")] + [(word_start, -1.0)]
    vocab += [(char, -2.0) for char in characters] + [(word_start + char, -2.5) for char in characters]
    vocab += [(word_start + word, -1.5) for word in words] + [(word, -1.5) for word in words]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=len(CHAT_TOKENS)))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_TOKENS])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>", model_max_length=max_length,
    )
