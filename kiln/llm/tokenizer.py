"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer.

Kiln code talks to this class only, so the few transformers calls (and their
version quirks) live in one place.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import transformers
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kiln.errors import ConfigError, InvalidRequestError, ModelLoadError
from kiln.llm.models.gguf_loader import fast_gguf_reader, open_gguf

log = logging.getLogger(__name__)


def rust_decoder(hf: PreTrainedTokenizerBase) -> Any:
    """The `tokenizers` decode a fast tokenizer's `decode` ends in, where its
    class adds nothing around it (transformers' own fast class: with no space
    clean-up, `hf.decode(ids)` is exactly this call); else None. Called twice
    per generated token by the detokenizer, the Python layers cost ~3.5 us of
    its ~4.6 (SmolLM2's tokenizer, Zen 4)."""
    fast = getattr(transformers, "PreTrainedTokenizerFast", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if fast is None or backend is None or not isinstance(hf, fast):
        return None
    own = ("decode", "_decode")
    if any(getattr(type(hf), name) is not getattr(fast, name) for name in own):
        return None
    return backend.decode


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's piece alphabet (GPT-2's): a byte that is a printable,
    non-space Latin-1 character is itself; each other byte, in order, is the
    character 256 + its rank among them. Character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_kind(hf: PreTrainedTokenizerBase) -> str | None:
    """How a fast tokenizer's pieces spell bytes: "byte_level" (every byte is one
    alphabet character), "sentencepiece" (byte-fallback pieces <0xHH>, U+2581 for a
    space) or None (not known: its pieces are not read as bytes)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if '"ByteLevel"' in decoder:
        return "byte_level"
    if '"ByteFallback"' in decoder or '"Metaspace"' in decoder:
        return "sentencepiece"
    return None


def piece_bytes(piece: str, kind: str) -> bytes | None:
    """The bytes a piece spells under `kind` (None if it is not spelled so)."""
    if kind == "byte_level":
        if all(c in BYTE_LEVEL_ALPHABET for c in piece):
            return bytes(BYTE_LEVEL_ALPHABET[c] for c in piece)
        return None
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, source: str, chat_template: str | None = None):
        self.hf = hf
        self.source = source
        if chat_template is not None and not hf.chat_template:
            hf.chat_template = chat_template
        eos = hf.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)
        self.bos_token_id: int | None = hf.bos_token_id
        # len() counts added tokens too; `hf.vocab_size` does not.
        self.vocab_size: int = len(hf)
        self._rust_decode = rust_decoder(hf)
        self._pieces = piece_kind(hf)
        self._added = set(hf.added_tokens_decoder)

    @property
    def chat_template(self) -> str | None:
        template = self.hf.chat_template
        return template if isinstance(template, str) else None

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with `template` instead of the checkpoint's chat
        template (a copy: the cached tokenizer others share is left alone)."""
        hf = copy.copy(self.hf)
        hf.chat_template = template
        return Tokenizer(hf, self.source)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No space clean-up: it depends on neighbouring tokens, so it would
        # make incremental detokenization disagree with a whole decode.
        if self._rust_decode is not None:
            return self._rust_decode(list(ids), skip_special_tokens=skip_special_tokens)
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        if not isinstance(text, str):  # a batch decode's answer; one id list never gets one
            raise TypeError(f"tokenizer decode returned {type(text).__name__}, expected str")
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for, which may be part of a UTF-8
        character (its decode alone would then be U+FFFD): read from the piece,
        whose alphabet the decoder kind fixes. Added tokens, and pieces of a
        tokenizer of no known kind, fall back to their decoded text's bytes."""
        if self._pieces is not None and token_id not in self._added:
            piece = self.hf.convert_ids_to_tokens(int(token_id))
            if isinstance(piece, str):
                raw = piece_bytes(piece, self._pieces)
                if raw is not None:
                    return raw
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        """The prompt text the model's chat template makes of `messages` (and `tools`, if it renders them)."""
        if self.chat_template is None:
            raise InvalidRequestError(f"the model's tokenizer ({self.source}) has no chat template")
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except TemplateError as e:  # the template rejected the messages
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from e
        return str(text)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> list[int]:
        # The template writes any BOS itself, so no special tokens are added
        # (this is what transformers' own tokenize=True path does).
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> Tokenizer:
    """Load from a HF model directory or a .gguf file (tokenizer in its metadata);
    cached per (path, mtime), as a GGUF build is slow and a Tokenizer read-only.
    `chat_template` (a file or the template itself, `--chat-template`)
    replaces the checkpoint's."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"tokenizer path does not exist: {path}")
    tokenizer = _load_cached(path.resolve(), path.stat().st_mtime_ns)
    return tokenizer if chat_template is None else tokenizer.with_chat_template(load_chat_template(chat_template))


def is_inline_template(value: object) -> bool:
    """A chat_template value that is Jinja text itself, not the name of a file."""
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def load_chat_template(value: str) -> str:
    """The Jinja chat template `value` names: the text of a file, or `value`
    itself when it is a template (it contains `{{` or `{%`). ConfigError for a
    missing file or a template Jinja cannot parse."""
    if not is_inline_template(value):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"chat_template {value!r} is neither a file nor a Jinja template", param="chat_template"
            )
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read chat template {path}: {e}", param="chat_template") from e
    try:
        ImmutableSandboxedEnvironment().parse(value)
    except TemplateError as e:
        raise ConfigError(f"invalid chat template: {e}", param="chat_template") from e
    return value


# A model directory has at least one of these (a fast, SentencePiece, or BPE vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


@functools.lru_cache(maxsize=8)
def _load_cached(path: Path, mtime_ns: int) -> Tokenizer:
    try:
        if path.is_dir():
            if not any((path / name).is_file() for name in TOKENIZER_FILES):
                raise ModelLoadError(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)}")
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            return Tokenizer(hf, str(path))
        if path.suffix == ".gguf":
            return Tokenizer(gguf_tokenizer(path), str(path))
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds (its config validation's too)
        # One line: a missing metadata key names itself; transformers' messages can span several lines.
        detail = f"no {e} in its tokenizer metadata" if isinstance(e, KeyError) else " ".join(str(e).split())
        raise ModelLoadError(f"cannot load tokenizer from {path}: {detail}") from e
    raise ModelLoadError(f"cannot load tokenizer from {path}: expected a model directory or a .gguf file")


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer a GGUF file's metadata describes. Building it parses the
    whole header and converts the vocabulary (seconds), so the result is saved
    once per file (path, size, mtime) and transformers version in the user's
    cache (`tokenizer_cache_dir`) and read from there afterwards."""
    cache = tokenizer_cache_dir(path)
    if cache is not None and (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the cached tokenizer %s (%s); converting %s again", cache, e, path)
    with fast_gguf_reader():
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if not hf.chat_template:
        hf.chat_template = _gguf_chat_template(path)
    if cache is not None:
        _save_atomically(hf, cache)
    return hf


def tokenizer_cache_dir(path: Path) -> Path | None:
    """Where the tokenizer converted from GGUF file `path` is cached, or None
    (KILN_TOKENIZER_CACHE=0)."""
    if os.environ.get("KILN_TOKENIZER_CACHE", "1") == "0":
        return None
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kiln" / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _save_atomically(hf: PreTrainedTokenizerBase, cache: Path) -> None:
    """Save into a temporary sibling, then rename: a reader sees all of it or nothing.
    A cache that cannot be written is logged and skipped."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
            hf.save_pretrained(tmp)
            os.replace(tmp, cache)
            Path(tmp).mkdir()  # for TemporaryDirectory's clean-up
    except OSError as e:
        log.info("tokenizer not cached in %s: %s", cache, e)


def _gguf_chat_template(path: Path) -> str | None:
    """Fallback for transformers versions that drop `tokenizer.chat_template`."""
    field = open_gguf(path).get_field("tokenizer.chat_template")
    return None if field is None else str(field.contents())
