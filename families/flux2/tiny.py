"""The FLUX.2 family's tiny test folders (its spec's `tiny`): FLUX.2 [klein]-base and [dev] layouts with random
weights, 64 px images, VAE 8x down to 4 latent channels patchified 2x2 into 16-channel tokens; [klein]'s
Qwen3 and [dev]'s Mistral-Small-3.1 text encoders 16 wide, each with its tokenizer (and [dev]'s Pixtral
processor) trained here. Their dataset: two-reference edits.

    python -m pytest tests/test_tiny_models.py tests/test_flux2.py -q
"""
from __future__ import annotations

from pathlib import Path

from families.tiny.data import make_two_reference_edit_dataset
from families.tiny.models import IMAGE_SIZE, seeded
from families.tiny.tokenizers import QWEN_ADDED_TOKENS, QWEN_EDIT_WORDS, WORDS, write_qwen_tokenizer

# Qwen3's added tokens (Qwen2.5's, then the tool-response and thinking markers), and its chat template's
# output for one user turn (FLUX.2 [klein] encodes its prompts so, enable_thinking=False): the real template
# is longer (tools, reasoning history); for this input it renders the same text.
QWEN3_ADDED_TOKENS = QWEN_ADDED_TOKENS + (("<tool_response>", False), ("</tool_response>", False),
                                          ("<think>", False), ("</think>", False))
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def write_qwen3_tokenizer(folder):
    """A tiny Qwen3 tokenizer (write_qwen_tokenizer's BPE, trained on the chat template and WORDS), with
    Qwen3's added tokens and chat template. Returns the reloaded Qwen2Tokenizer."""
    words = WORDS + QWEN_EDIT_WORDS
    corpus = ["user\nassistant\n\n\n", " ".join(words), "\n".join(words)]
    return write_qwen_tokenizer(folder, corpus, QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE)


def _qwen3_text_encoder(tokenizer, seed, hidden=16, layers=28, causal_lm=True):
    """A Qwen3ForCausalLM (`causal_lm=False`: a Qwen3Model, Z-Image's class) `hidden` wide with `layers` layers:
    FLUX.2 [klein] stacks the hidden states of layers 9, 18 and 27 (the pipeline's text_encoder_out_layers), so it
    needs at least 27 (Qwen3-4B has 36)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    with seeded(seed):
        return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config).eval()


def _flux2_parts(text_width, seed, guidance_embeds):
    """The tiny FLUX.2 transformer (its text input `text_width` wide), VAE and scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    latent_channels = 4
    with seeded(seed + 1):
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=text_width, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)
    with seeded(seed + 2):
        vae = AutoencoderKLFlux2(
            latent_channels=latent_channels, block_out_channels=(8, 16, 32, 32), layers_per_block=1,
            norm_num_groups=8, sample_size=IMAGE_SIZE)
    # scheduler_config.json of FLUX.2: shift 3 with dynamic shifting; the pipeline passes its own mu
    # (compute_empirical_mu of the token count and the step count)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    return transformer, vae, scheduler


def make_tiny_flux2_klein(folder, seed=0):
    """Write a FLUX.2-[klein]-base-layout diffusers folder (Flux2KleinPipeline: transformer, vae, text_encoder,
    tokenizer, scheduler; is_distilled false, so the pipeline samples with true CFG).

    64 px images, VAE 8x down to 4 latent channels, patchified 2x2 into 16-channel tokens (64 px -> 16 tokens);
    transformer hidden 32 (1 double + 2 single blocks, no guidance embedding, as klein); Qwen3 text encoder 16
    wide with 28 layers (embeddings 3 x 16 = 48 wide). Returns the folder.
    """
    from diffusers import Flux2KleinPipeline

    folder = Path(folder)
    tokenizer = write_qwen3_tokenizer(folder / "tokenizer")
    text_encoder = _qwen3_text_encoder(tokenizer, seed)
    transformer, vae, scheduler = _flux2_parts(3 * text_encoder.config.hidden_size, seed, guidance_embeds=False)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


# Mistral-Small-3.1's special tokens as its tokenizer numbers them (ids 0..19; its other 980 are <SPECIAL_n>
# placeholders, left out here)
MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")
# Mistral-Small-3.1's chat template for what FLUX.2 [dev] gives it (format_input, pipeline_flux2.py:65-120: a
# system message, then user turns of text and image blocks): the real template also has assistant turns, string
# contents and a dated default system message; for this input it renders the same text.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- else %}{{- '[IMG]' }}{%- endif %}{%- endfor %}{{- '[/INST]' }}{%- endif %}{%- endfor %}")
# Mistral-Small-3.1's Pixtral image processor: 14 px patches, at most 1540 px a side, CLIP mean and std
PIXTRAL_PREPROCESSOR = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 1540}, "resample": 3}


def write_pixtral_processor(folder):
    """Write FLUX.2 [dev]'s tokenizer/ folder, tiny: Mistral-Small-3.1's PixtralProcessor (tokenizer, image processor,
    chat template; patch 14, 2x2 merge). The tokenizer: MISTRAL_SPECIAL_TOKENS at ids 0..19, then a byte-level BPE
    (as Tekken) trained here on the pipeline's system message and WORDS, so the message's words are mostly one
    token; <s> prepended, <pad> on the left (the Llama tokenizers' side). Returns the reloaded processor."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PixtralImageProcessor, PixtralProcessor, TokenizersBackend

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    words = WORDS + QWEN_EDIT_WORDS
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=list(MISTRAL_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # each word alone and after a space: a prompt's first word follows [INST] directly
    bpe.train_from_iterator([SYSTEM_MESSAGE, " " + " ".join(words), "\n".join(words)], trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer = TokenizersBackend(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", padding_side="left", model_max_length=131072)
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(**PIXTRAL_PREPROCESSOR), tokenizer=tokenizer,
                                 patch_size=14, spatial_merge_size=2, chat_template=MISTRAL_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return PixtralProcessor.from_pretrained(folder)


def _mistral3_text_encoder(tokenizer, seed, hidden=16, layers=32):
    """A Mistral3ForConditionalGeneration: a Mistral text model `hidden` wide with `layers` layers (FLUX.2 [dev]
    stacks the hidden states of layers 10, 20 and 30; Mistral-Small-3.1 has 40) and a 1-block Pixtral vision tower
    of the real patch 14 and 2x2 merge; token ids from `tokenizer`."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden,
            intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
            head_dim=hidden // 2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1000000000.0,
            sliding_window=None, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"), pad_token_id=ids("<pad>")),
        vision_config=dict(
            model_type="pixtral", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
            num_attention_heads=2, head_dim=hidden // 2, patch_size=14, image_size=1540),
        image_token_index=ids("[IMG]"), spatial_merge_size=2, tie_word_embeddings=False)
    with seeded(seed):
        return Mistral3ForConditionalGeneration(config).eval()


def make_tiny_flux2_dev(folder, seed=0):
    """Write a FLUX.2-[dev]-layout diffusers folder (Flux2Pipeline: transformer, vae, text_encoder, tokenizer,
    scheduler): make_tiny_flux2_klein's sizes, VAE and scheduler, its transformer with the guidance embedding (as
    [dev]); a Mistral3ForConditionalGeneration text encoder 16 wide with 32 text layers (embeddings 3 x 16 = 48
    wide) and its PixtralProcessor as the tokenizer (write_pixtral_processor). Returns the folder."""
    from diffusers import Flux2Pipeline

    folder = Path(folder)
    processor = write_pixtral_processor(folder / "tokenizer")
    text_encoder = _mistral3_text_encoder(processor.tokenizer, seed)
    transformer, vae, scheduler = _flux2_parts(3 * text_encoder.config.text_config.hidden_size, seed,
                                               guidance_embeds=True)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor,
                         transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def _build_flux2_data(root):
    make_two_reference_edit_dataset(root / "data", 32, swatch=64)  # the pipelines refuse a side under 64 px


def build_flux2_klein(root):
    """tiny_flux2_klein: the FLUX.2 [klein]-base folder and two-reference edits."""
    make_tiny_flux2_klein(root / "model")
    _build_flux2_data(root)


def build_flux2_dev(root):
    """tiny_flux2_dev: the FLUX.2 [dev] folder and two-reference edits."""
    make_tiny_flux2_dev(root / "model")
    _build_flux2_data(root)
