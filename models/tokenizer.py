"""Tokenizers by name or folder: our 8192-token byte-level BPE (the default) and GPT-2's, both in the repository.

Both are built offline by ``python -m trainers.corpus_build tokenizers`` and loaded with transformers'
``AutoTokenizer`` as fast (Rust) tokenizers. ``<|endoftext|>`` is the document separator and the start (BOS)
token in both: id 0 in ``bpe8192``, id 50256 in ``gpt2``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from models.errors import UserError, unknown_choice
from models.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizers"
DEFAULT_TOKENIZER = "bpe8192"
SEPARATOR = "<|endoftext|>"

TOKENIZERS: Registry[Path] = Registry("tokenizer")
TOKENIZERS.register(
    "bpe8192",
    TOKENIZER_DIR / "bpe8192",
    "byte-level BPE, 8192 tokens, trained on the embedded corpus's train split (default)",
)
TOKENIZERS.register(
    "gpt2",
    TOKENIZER_DIR / "gpt2",
    "GPT-2's byte-level BPE (tiktoken r50k_base), 50257 tokens",
    aliases=("r50k_base",),
)


def tokenizer_path(name_or_path: str | os.PathLike) -> Path:
    """The folder of a registered tokenizer, or ``name_or_path`` itself when it is an existing folder."""
    name = str(name_or_path)
    if name in TOKENIZERS:
        return TOKENIZERS.get(name)
    if Path(name).is_dir():
        return Path(name)
    choices = [*TOKENIZERS, *(alias for n in TOKENIZERS for alias in TOKENIZERS.aliases_of(n))]
    raise UserError(f"{unknown_choice('tokenizer', name, choices)}; or give a folder with tokenizer.json")


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_TOKENIZER) -> PreTrainedTokenizerFast:
    """A registered tokenizer (``bpe8192``, ``gpt2``) or a transformers tokenizer folder, as a fast tokenizer.

    Offline by construction (``local_files_only``): a name that is neither registered nor a folder is an error,
    never a hub lookup.
    """
    from transformers import AutoTokenizer

    path = tokenizer_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {str(path)!r}: {e}") from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise UserError(f"tokenizer in {str(path)!r} has no tokenizer.json (a fast tokenizer is required)")
    return tok


def tokenizer_fingerprint(tok: PreTrainedTokenizerFast) -> str:
    """sha256 of the canonical tokenizer.json (sorted keys, no whitespace), without padding/truncation state.

    Equal fingerprints mean equal token ids for every text, so it keys caches of tokenised corpora. Remembered
    per serialised state (canonicalising a 50k-entry vocabulary takes ~0.5 s; the grid asks once per cell).
    """
    raw = tok.backend_tokenizer.to_str()
    key = hashlib.sha256(raw.encode("utf-8")).hexdigest()
    if key not in _FINGERPRINTS:
        state = json.loads(raw)
        state.pop("padding", None)  # call-time settings that transformers toggles; they do not change the ids
        state.pop("truncation", None)
        canonical = json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        _FINGERPRINTS[key] = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    return _FINGERPRINTS[key]


_FINGERPRINTS: dict[str, str] = {}  # sha256 of tokenizer.json as serialised -> its canonical fingerprint


def separator_id(tok: PreTrainedTokenizerFast) -> int:
    """The id that starts every document: ``<|endoftext|>`` if the vocabulary has it, else BOS, else EOS."""
    for candidate in (tok.backend_tokenizer.token_to_id(SEPARATOR), tok.bos_token_id, tok.eos_token_id):
        if candidate is not None:
            return candidate
    raise UserError(
        f"tokenizer {tok.name_or_path!r} has no {SEPARATOR}, BOS or EOS token to separate documents"
    )
