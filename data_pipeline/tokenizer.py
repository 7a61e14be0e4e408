"""Any Hugging Face `tokenizer.json` as the tokenizer of the data pipeline and of megatron-core.

    tok = load_tokenizer("tokenizers/stdlib-32k/tokenizer.json")
    ids = tok.tokenize("def f(x):\n    return x\n")
    assert tok.detokenize(ids) == "def f(x):\n    return x\n"
    GPTDatasetConfig(..., tokenizer=tok)

`Tokenizer` carries what megatron-core 0.16.1's `GPTDataset` / `MockGPTDataset` read from
`config.tokenizer` (`vocab_size`, `eod`, `pad`, `unique_identifiers`, the last one hashed into
megatron's dataset cache names) plus batch encoding for the preprocessor. It duck-types
`megatron.core.tokenizers.MegatronTokenizerBase` instead of subclassing it so that tokenizer
worker processes never import torch.

The end-of-document token is, in this order: the name given (`--eod-token` of the preprocessor), the
`eos_token` of a `tokenizer_config.json` next to `tokenizer.json` (as `transformers` saves it: a string
or `{"content": ...}`), or the first of `EOD_CANDIDATES` the vocabulary has.

Encoding never adds special tokens, and a literal special-token string inside a document (say
the text "<|endoftext|>" in a file about tokenizers) is encoded as ordinary text: only the
preprocessor's `--append-eod` puts the end-of-document id into a dataset, so document boundaries
cannot be forged by the data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Iterable, Sequence

# GPT-2 / GLM / Qwen, Llama 2 / Mistral, Gemma, ours, Llama 3 base, DeepSeek (full-width bars, U+2581)
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
TOKENIZER_CONFIG = "tokenizer_config.json"
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message says which file and what to do."""


def file_sha256(path: str, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def config_eos_token(tokenizer_path: str) -> str | None:
    """`eos_token` of the `tokenizer_config.json` beside `tokenizer_path`, or None (no file, no entry)."""
    config_path = os.path.join(os.path.dirname(tokenizer_path), TOKENIZER_CONFIG)
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError) as exc:
        raise TokenizerError(f"cannot read {config_path}: {exc}") from None
    if isinstance(eos, dict):  # transformers' AddedToken form
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise TokenizerError(f"{config_path}: eos_token is a {type(eos).__name__}, expected a string or "
                             '{"content": "..."}')
    return eos or None


def resolve_tokenizer_path(path: str) -> str:
    """`path` itself, or `path/tokenizer.json` when `path` is a directory; absolute."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise TokenizerError(
            f"tokenizer file not found: {path}; pass a Hugging Face tokenizer.json "
            "(train one with `python -m data_pipeline.train_tokenizer`)"
        )
    return path


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the ids the pipeline and megatron-core need.

    vocab_size: one past the largest id, added tokens included (what the embedding must hold).
    eod: id of the end-of-document token. pad: id of the padding token, or None.
    """

    def __init__(self, hf_tokenizer, path: str, eod_token: str | None = None, pad_token: str | None = None,
                 sha256: str | None = None):
        self._tok = hf_tokenizer
        # Literal "<|endoftext|>" in a document stays text; see the module docstring.
        self._tok.encode_special_tokens = True
        self.path = path
        self.sha256 = sha256 or file_sha256(path)
        self._pad_token = pad_token
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"tokenizer {path} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        self.eod_token, self.eod = self._find_eod(eod_token)
        self.pad_token, self.pad = self._find_pad(pad_token)
        self._encode_batch = getattr(hf_tokenizer, "encode_batch_fast", hf_tokenizer.encode_batch)

    def _find_eod(self, name: str | None) -> tuple[str, int]:
        if name:
            where, names = "the name given", (name,)
        elif (eos := config_eos_token(self.path)) is not None:
            where, names = f"eos_token of {TOKENIZER_CONFIG}", (eos,)
        else:
            where, names = "the usual names", EOD_CANDIDATES
        for token in names:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token, token_id
        raise TokenizerError(
            f"tokenizer {self.path} has no end-of-document token (looked for {', '.join(names)}: {where}); "
            f"pass --eod-token <its name>, set eos_token in {TOKENIZER_CONFIG} next to it, or retrain with "
            "`--special-tokens '<|endoftext|>' ...`"
        )

    def _find_pad(self, name: str | None) -> tuple[str | None, int | None]:
        for token in (name,) if name else PAD_CANDIDATES:
            token_id = self._tok.token_to_id(token)
            if token_id is not None and token_id != self.eod:
                return token, token_id
        if name:
            raise TokenizerError(f"tokenizer {self.path} has no pad token {name!r} distinct from its eod token")
        return None, None

    # --- encoding -------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, special tokens not added; HF's batch encoder (no offsets)."""
        return [enc.ids for enc in self._encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    # --- what megatron-core reads -------------------------------------------------------

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Enters megatron's dataset cache hash: a different tokenizer file gives new caches."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_path", self.path),
                ("sha256", self.sha256),
                ("eod", self.eod),
                ("pad", self.pad),
            ]
        )

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def hf_tokenizer(self):
        """The underlying `tokenizers.Tokenizer` (special tokens in text encode as text)."""
        return self._tok

    def __getstate__(self) -> dict:
        # the resolved eod name: an unpickled copy needs no tokenizer_config.json
        names = {"eod_token": self.eod_token, "pad_token": self._pad_token}
        return {"json": self._tok.to_str(), "path": self.path, "sha256": self.sha256, **names}

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        hf_tokenizer = HFTokenizer.from_str(state.pop("json"))
        self.__init__(hf_tokenizer, **state)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


def load_tokenizer(path: str, eod_token: str | None = None, pad_token: str | None = None) -> Tokenizer:
    """Load a Hugging Face `tokenizer.json` (or a directory holding one)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = resolve_tokenizer_path(path)
    try:
        hf_tokenizer = HFTokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"cannot load tokenizer {path}: {exc}") from None
    return Tokenizer(hf_tokenizer, path, eod_token=eod_token, pad_token=pad_token)


def check_vocab_fits(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """Every token id must index the model's embedding."""
    if tokenizer_vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer_vocab_size} tokens but model.vocab_size is {model_vocab_size}; "
            f"set model.vocab_size >= {tokenizer_vocab_size}"
        )
