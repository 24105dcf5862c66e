"""The tiny tokenizers the families' test folders share: CLIP's BPE (SD-1.5, SDXL, FLUX.1) and Qwen2's
byte-level BPE (Qwen-Image-Edit, FLUX.2 [klein]), with whole-word pieces for the synthetic prompts' words
(families/tiny/scenes.py's colours and shapes, then OTHER_WORDS), so that prompts stay short.

    python -m pytest tests/test_tiny_models.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

from families.tiny.scenes import COLOURS, SHAPES

TEXT_MAX_LENGTH = 32  # CLIP context length (and T5 model_max_length) of the tiny tokenizers

# Words of the synthetic prompts (the scenes' COLOURS and SHAPES, then these). Tokenizers get
# whole-word pieces for them so that prompts stay short (about 10 tokens); any other lowercase
# text still tokenizes character by character.
OTHER_WORDS = ("a", "an", "the", "on", "of", "in", "and", "with", "make", "it", "turn", "into",
               "change", "to", "background", "photo", "image", "shape")
WORDS = tuple(COLOURS) + SHAPES + OTHER_WORDS
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"


def write_clip_tokenizer(folder, max_length=TEXT_MAX_LENGTH):
    """Write a tiny CLIP BPE tokenizer (vocab.json, merges.txt + tokenizer.json) into `folder`.

    Vocab: every char of CHARS alone and with `</w>`, whole-word pieces for WORDS (see
    `_word_merges`), then `<|startoftext|>`, `<|endoftext|>` last, as in real CLIP. Returns
    the reloaded CLIPTokenizer.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c + suffix: 0 for suffix in ("", "</w>") for c in CHARS}
    merges = _word_merges(WORDS)
    vocab.update({a + b: 0 for a, b in merges})
    vocab = {piece: i for i, piece in enumerate(vocab)}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, indent=1))
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n")
    tokenizer = CLIPTokenizer.from_pretrained(folder, model_max_length=max_length)
    tokenizer.save_pretrained(folder)  # adds tokenizer.json / tokenizer_config.json
    return CLIPTokenizer.from_pretrained(folder)


def _bpe(word, ranks):
    """CLIP-style BPE of one word: merge the best-ranked adjacent pair until none is ranked."""
    pieces = list(word[:-1]) + [word[-1] + "</w>"]
    while len(pieces) > 1:
        pairs = zip(pieces, pieces[1:])
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(pairs))
        if rank == len(ranks):
            break
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _word_merges(words):
    """Merges (in rank order) under which BPE turns every word of `words` into one token.

    Naive per-word merge chains interfere (green's "g r" splits background's "back|g"), so add
    one merge at a time for the first word still in pieces and re-run BPE until none is.
    """
    merges = []
    while True:
        ranks = {pair: r for r, pair in enumerate(merges)}
        unfinished = next((p for p in (_bpe(w, ranks) for w in words) if len(p) > 1), None)
        if unfinished is None:
            return merges
        merges.append((unfinished[0], unfinished[1]))


# The system prompt of QwenImageEditPlusPipeline's prompt template (diffusers 0.42.1
# pipeline_qwenimage_edit_plus.py), without its special tokens: the Qwen tokenizer learns its words whole.
QWEN_EDIT_SYSTEM_PROMPT = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate.")
QWEN_EDIT_WORDS = ("colour", "picture")  # of the two-reference edit prompts (make_two_reference_edit_dataset)
# Qwen2.5-VL's added tokens in id order, as (token, special): ids 151643..151664 there, right after the
# BPE vocabulary; here right after the tiny one. The text encoder config points at these ids.
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False))


def write_qwen_tokenizer(folder, corpus=None, added=QWEN_ADDED_TOKENS, chat_template=None):
    """Write a tiny Qwen2 byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) into `folder`.

    Qwen2's normalizer, pre-tokenizer and decoder; merges trained here (the `tokenizers` library) on
    the pipeline's chat template, "Picture N: " and WORDS, so those words are one token each and the
    template's system part is 64 tokens as with the real tokenizer (the pipeline drops that many);
    any other text still encodes, byte by byte. Then QWEN_ADDED_TOKENS; eos <|im_end|>, pad
    <|endoftext|>, no bos / unk, as Qwen2.5-VL-Instruct's tokenizer_config.json. Returns the reloaded
    Qwen2Tokenizer. `corpus`, `added`, `chat_template`: another Qwen's (write_qwen3_tokenizer).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    qwen2 = Qwen2Tokenizer(unk_token=None, eos_token=None, pad_token=None).backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer, bpe.pre_tokenizer = qwen2.normalizer, qwen2.pre_tokenizer
    words = WORDS + QWEN_EDIT_WORDS
    corpus = corpus or [f"system\n{QWEN_EDIT_SYSTEM_PROMPT}\nuser\nassistant\n",
                        " ".join(f"Picture {i}:" for i in range(1, 4)), " ".join(words), "\n".join(words)]
    # every byte in the alphabet; a vocabulary larger than the corpus needs: each corpus word ends whole
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
                               eos_token=None, pad_token=None, model_max_length=131072, errors="replace")
    tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return Qwen2Tokenizer.from_pretrained(folder)
