"""Exporters: an nmt checkpoint as another engine's model directory.

- `ct2`: CTranslate2 (`nmt export ct2`, extra nmt[ct2]).
- `hf`: Hugging Face transformers, as a MarianMTModel (`nmt export hf`, extra nmt[hf]).
- `common`: reading the checkpoint, the atomic output directory, the model card's story.
"""
