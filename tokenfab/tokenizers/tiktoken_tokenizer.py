"""A tiktoken BPE tokenizer read from a ``tiktoken.model`` folder (Kimi-K2 / Kimi Linear checkpoints as published),
without running the checkpoint's own ``tokenization_kimi.py`` (which transformers would only load under
``trust_remote_code``).

Folder layout (Moonshot AI's Kimi releases):

* ``tiktoken.model``: one ``<base64 token bytes> <rank>`` line per mergeable token, ranks 0..N-1 (N base tokens);
* ``tokenizer_config.json``: ``added_tokens_decoder`` (``{"163584": {"content": "[BOS]", "special": true}, ...}``),
  ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token``, ``additional_special_tokens``, ``chat_template``
  (or a ``chat_template.jinja`` file next to it), ``auto_map`` (ignored here: no remote code runs).

Behaviour matches the published tokenizer:

* special tokens occupy ids N .. N+257 (256 reserved plus 2); a slot not named in ``added_tokens_decoder`` is
  ``<|reserved_token_{id}|>``;
* text is pre-split with Kimi's regex (:data:`KIMI_PAT_STR`: Han runs, case-aware words with English contractions,
  1-3 digit groups, punctuation runs, whitespace) and BPE-merged by ``tiktoken``;
* special-token strings inside text become their single ids (``split_special_tokens=True`` encodes them as plain
  text instead); no BOS/EOS is added unless the config sets ``add_bos_token`` / ``add_eos_token``;
* text is encoded in pieces of at most 400,000 characters, and runs of more than 25,000 consecutive whitespace or
  non-whitespace characters are cut every 25,000 characters (tiktoken's regex engine overflows on longer runs,
  openai/tiktoken#195), as the published tokenizer does.

The object offers the parts of the transformers tokenizer interface that tokenfab uses (``__call__``, ``encode``,
``decode``, ``batch_decode``, ``convert_ids_to_tokens``, ``apply_chat_template``, the special-token attributes,
``vocab_size``, ``get_vocab``); chat templates are rendered by transformers' own Jinja renderer.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import re
from typing import Any, Iterable, Iterator

TIKTOKEN_FILE = "tiktoken.model"
NUM_SPECIAL_SLOTS = 256 + 2  # ids N .. N+257 after N base tokens, as Kimi's tokenizer lays them out
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Kimi's pre-tokenizer (tokenization_kimi.py ``pat_str``), one alternative per line; ``&&`` is class intersection
# in tiktoken's regex engine (fancy-regex), so "letters except Han" is [\p{...}&&[^\p{Han}]].
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # upper/title/modifier/other letters and marks, not Han
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # lower/modifier/other letters and marks, not Han
_LEAD = r"[^\r\n\p{L}\p{N}]?"  # at most one leading non-letter, non-digit (e.g. the space before a word)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",  # runs of Chinese characters
    _LEAD + _UPPERISH + "*" + _LOWERISH + "+" + _CONTRACTION,  # "Hello", " world", "don't"
    _LEAD + _UPPERISH + "+" + _LOWERISH + "*" + _CONTRACTION,  # "NASA", " HTTPServer" head
    r"\p{N}{1,3}",  # digits in groups of at most three
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # punctuation / symbol runs with trailing newlines
    r"\s*[\r\n]+",  # whitespace ending in newlines
    r"\s+(?!\S)",  # whitespace not followed by text (keeps one space for the next word)
    r"\s+",
])

_RUNS = re.compile(r"\s+|\S+")
_SPACES = re.compile(r"\s+")
_CALL_IGNORED = frozenset({"return_token_type_ids", "verbose", "return_length"})


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (bytes that print as themselves keep their character,
    the other 68 map to U+0100 onwards); the token strings of byte-level BPE vocabularies use it."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_B2U = _byte_to_unicode()
_U2B = {c: b for b, c in _B2U.items()}


def is_tiktoken_folder(path: str) -> bool:
    """True when ``path`` holds a ``tiktoken.model`` and no ``tokenizer.json`` (with a ``tokenizer.json``, the
    Rust tokenizers file is what transformers loads, and that needs no remote code)."""
    return (os.path.isfile(os.path.join(path, TIKTOKEN_FILE))
            and not os.path.isfile(os.path.join(path, "tokenizer.json")))


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a tiktoken rank file: ``<base64 bytes> <rank>`` per line.

    Raises:
        ValueError: a malformed line (named by number), duplicate tokens, ranks that are not exactly 0..N-1, or a
        missing single-byte token (BPE could then not encode every byte string).
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected two fields")
                tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except ValueError as e:
                raise ValueError(f"{path}:{ln}: expected '<base64 token> <rank>', got {line[:60]!r} ({e}).") from None
            if tok in ranks:
                raise ValueError(f"{path}:{ln}: token {tok!r} appears twice (ranks {ranks[tok]} and {rank}).")
            ranks[tok] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} (one per line, no gaps or repeats).")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single-byte tokens are missing (first: byte {missing[0]}); a "
                         "byte-level BPE file needs all 256.")
    return ranks


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _deep_sort(obj: Any) -> Any:
    """Dicts with their keys sorted, recursively (Kimi's tokenizer sorts tool schemas before rendering them)."""
    if isinstance(obj, dict):
        return {k: _deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_deep_sort(x) for x in obj]
    return obj


def _as_id_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, int):
        return [token_ids]
    if hasattr(token_ids, "tolist"):  # torch / numpy
        token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            return [token_ids]
    return [int(t) for t in token_ids]


def _special_token_id(attr: str) -> property:
    """A read-only property: the id of the special token named by attribute ``attr`` (``bos_token`` ...), or None."""
    return property(lambda self: self._id(getattr(self, attr)),
                    doc=f"The id of ``{attr}``, or None when the tokenizer has none.")


class TiktokenTokenizer:
    """Byte-level BPE over ``tiktoken`` with Kimi's special-token layout and pre-tokenizer.

    Args:
        mergeable_ranks: token bytes -> rank, ranks 0..N-1 (:func:`load_tiktoken_ranks`).
        added_tokens: id -> (content, special) from ``added_tokens_decoder``; ids N..N+257 not named here become
            ``<|reserved_token_{id}|>``; ``special=False`` tokens still encode as one id but survive
            ``skip_special_tokens``.
        bos_token, eos_token, unk_token, pad_token: names of special tokens (or None).
        additional_special_tokens: more special token names (kept for ``special_tokens_map``).
        chat_template: a Jinja template, or a dict name -> template.
        pat_str: the pre-tokenizer regex (tiktoken / fancy-regex syntax).

    Raises:
        ValueError: an added token id that collides with a base token, two ids with the same content, or a named
        special token that is not a special token.
    """

    is_fast = False
    padding_side = "right"
    truncation_side = "right"
    clean_up_tokenization_spaces = False
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, mergeable_ranks: dict[bytes, int], *, added_tokens: dict[int, tuple[str, bool]] | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, unk_token: str | None = None,
                 pad_token: str | None = None, additional_special_tokens: Iterable[str] = (),
                 chat_template: str | dict | None = None, pat_str: str = KIMI_PAT_STR,
                 model_max_length: int = 1 << 62, add_bos_token: bool = False, add_eos_token: bool = False,
                 name_or_path: str = "", source: str = "tokenizer_config.json"):
        import tiktoken

        added_tokens = dict(added_tokens or {})
        n_base = len(mergeable_ranks)
        for i in added_tokens:
            if i < n_base:
                raise ValueError(f"{source}: added_tokens_decoder id {i} ('{added_tokens[i][0]}') collides with a "
                                 f"base token of {TIKTOKEN_FILE} (ids 0..{n_base - 1}); special ids start at {n_base}.")
        ids = sorted(set(range(n_base, n_base + NUM_SPECIAL_SLOTS)) | set(added_tokens))
        specials: dict[str, int] = {}
        for i in ids:
            content = added_tokens.get(i, (f"<|reserved_token_{i}|>", True))[0]
            if content in specials:
                raise ValueError(f"{source}: special token '{content}' has two ids ({specials[content]} and {i}).")
            specials[content] = i
        self._ranks = mergeable_ranks
        self._specials = specials
        self._special_text = {i: s for s, i in specials.items()}
        self._skip_ids = frozenset(i for i in ids if added_tokens.get(i, ("", True))[1])
        self._added_special = {i: added_tokens.get(i, ("", True))[1] for i in ids}
        self._enc = tiktoken.Encoding(name=os.path.basename(name_or_path) or "tiktoken", pat_str=pat_str,
                                      mergeable_ranks=mergeable_ranks, special_tokens=specials)
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
        self._vocab: dict[str, int] | None = None
        self.pat_str = pat_str
        self.n_base_tokens = n_base
        self.chat_template = chat_template
        self.model_max_length = int(model_max_length)
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self.name_or_path = name_or_path
        named = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        for field, tok in named.items():
            if tok is not None and tok not in specials:
                raise ValueError(f"{source}: {field} '{tok}' is not a special token of this tokenizer (name it in "
                                 f"added_tokens_decoder, ids {n_base}..{n_base + NUM_SPECIAL_SLOTS - 1}).")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.additional_special_tokens = [t for t in additional_special_tokens if t in specials]
        if self.add_bos_token and bos_token is None:
            raise ValueError(f"{source}: add_bos_token is true but there is no bos_token.")
        if self.add_eos_token and eos_token is None:
            raise ValueError(f"{source}: add_eos_token is true but there is no eos_token.")

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str) -> "TiktokenTokenizer":
        """Load ``path/tiktoken.model`` with ``tokenizer_config.json`` and the chat template (``chat_template.jinja``
        first, then ``chat_template.json``, then ``tokenizer_config.json``'s ``chat_template``, as transformers
        does). The config's ``auto_map`` / ``tokenizer_class`` are not used: no checkpoint code runs.

        Raises:
            FileNotFoundError: no ``tiktoken.model`` in ``path``.
            ValueError: a malformed rank file or tokenizer_config.json (the message names the file and field).
        """
        vocab_file = os.path.join(path, TIKTOKEN_FILE)
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"'{path}' has no {TIKTOKEN_FILE} (a tiktoken tokenizer folder needs one).")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg: dict = {}
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e}).") from None
        added: dict[int, tuple[str, bool]] = {}
        for key, v in (cfg.get("added_tokens_decoder") or {}).items():
            try:
                i = int(key)
            except ValueError:
                raise ValueError(f"{cfg_path}: added_tokens_decoder key '{key}' is not a token id.") from None
            content = _token_text(v)
            if not content:
                raise ValueError(f"{cfg_path}: added_tokens_decoder[{key}] has no 'content'.")
            added[i] = (content, bool(v.get("special", True)) if isinstance(v, dict) else True)
        names = {c for c, _ in added.values()}

        def named(field: str, default: str | None) -> str | None:
            if field in cfg:
                return _token_text(cfg[field])
            return default if default in names else None  # Kimi's defaults, when the folder names them

        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
        extra = [_token_text(t) for t in extra] if isinstance(extra, list) else []
        return cls(load_tiktoken_ranks(vocab_file), added_tokens=added, bos_token=named("bos_token", "[BOS]"),
                   eos_token=named("eos_token", "[EOS]"), unk_token=named("unk_token", None),
                   pad_token=named("pad_token", None), additional_special_tokens=extra,
                   chat_template=_read_chat_template(path, cfg),
                   model_max_length=int(min(float(cfg.get("model_max_length") or 1 << 62), float(1 << 62))),
                   add_bos_token=bool(cfg.get("add_bos_token", False)),
                   add_eos_token=bool(cfg.get("add_eos_token", False)), name_or_path=path, source=cfg_path)

    # ------------------------------------------------------------------------------------------------ encoding
    def _chunks(self, s: str) -> Iterator[str]:
        """``s`` in pieces of at most MAX_ENCODE_CHARS, each run of whitespace or non-whitespace longer than
        MAX_RUN_CHARS cut every MAX_RUN_CHARS characters from the run's start."""
        for i in range(0, len(s), MAX_ENCODE_CHARS):
            part = s[i:i + MAX_ENCODE_CHARS]
            if len(part) <= MAX_RUN_CHARS or (max(map(len, part.split()), default=0) <= MAX_RUN_CHARS
                                              and max(map(len, _SPACES.findall(part)), default=0) <= MAX_RUN_CHARS):
                yield part  # no run to cut (both checks run in C; the cutting loop below is Python)
                continue
            start = 0
            for m in _RUNS.finditer(part):
                for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                    yield part[start:cut]
                    start = cut
            yield part[start:]

    def _encode_plain(self, s: str, out: list[int]) -> None:
        for piece in self._chunks(s):
            if piece:
                out.extend(self._enc.encode_ordinary(piece))

    def encode(self, text: str, add_special_tokens: bool = True, *, split_special_tokens: bool = False,
               truncation: bool = False, max_length: int | None = None) -> list[int]:
        """Token ids of ``text``.

        ``add_special_tokens`` adds BOS / EOS only where tokenizer_config.json asks for them (``add_bos_token`` /
        ``add_eos_token``; Kimi's do not); ``split_special_tokens`` encodes special-token strings as plain text;
        ``truncation`` with ``max_length`` keeps the first ``max_length`` ids.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}.")
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token:
            ids.append(self._specials[self.bos_token])
        pos = 0
        if not split_special_tokens:
            for m in self._special_re.finditer(text):
                self._encode_plain(text[pos:m.start()], ids)
                ids.append(self._specials[m.group()])
                pos = m.end()
        self._encode_plain(text[pos:], ids)
        if add_special_tokens and self.add_eos_token:
            ids.append(self._specials[self.eos_token])
        if truncation and max_length is not None:
            ids = ids[:max_length]
        return ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, padding: bool | str = False,
                 truncation: bool = False, max_length: int | None = None, return_tensors: str | None = None,
                 return_attention_mask: bool | None = None, split_special_tokens: bool = False, **kwargs):
        """transformers-style call: a BatchEncoding with ``input_ids`` (and ``attention_mask``) for one text or a
        list of texts. ``padding`` (True / "longest") pads a batch on the right with ``pad_token``.

        Raises:
            TypeError: an unsupported keyword. ValueError: padding without a pad token.
        """
        from transformers import BatchEncoding

        bad = set(kwargs) - _CALL_IGNORED
        if bad:
            raise TypeError(f"TiktokenTokenizer() got unsupported keyword argument(s): {', '.join(sorted(bad))}.")
        kw = dict(add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens,
                  truncation=truncation, max_length=max_length)
        if isinstance(text, str):
            ids = self.encode(text, **kw)
            data = {"input_ids": ids}
            if return_attention_mask is not False:
                data["attention_mask"] = [1] * len(ids)
        else:
            rows = [self.encode(t, **kw) for t in text]
            masks = [[1] * len(r) for r in rows]
            if padding and padding != "do_not_pad":
                if self.pad_token is None:
                    raise ValueError("padding needs a pad_token; this tokenizer has none (tokenizer_config.json "
                                     "pad_token).")
                width = max(map(len, rows), default=0)
                if padding == "max_length" and max_length is not None:
                    width = max_length
                pad = self._specials[self.pad_token]
                rows = [r + [pad] * (width - len(r)) for r in rows]
                masks = [m + [0] * (width - len(m)) for m in masks]
            data = {"input_ids": rows}
            if return_attention_mask is not False:
                data["attention_mask"] = masks
        return BatchEncoding(data, tensor_type=return_tensors)

    # ------------------------------------------------------------------------------------------------ decoding
    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs) -> str:
        """Text of ``token_ids`` (an int, a list, or a tensor / array); bytes that do not form complete UTF-8
        characters decode to U+FFFD. ``skip_special_tokens`` drops every special token except added tokens marked
        ``"special": false``. No clean-up of spaces is ever done (Kimi's tokenizer does none).

        Raises:
            ValueError: an id outside 0..vocab_size-1.
        """
        ids = _as_id_list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip_ids]
        try:
            return self._enc.decode(ids, errors="replace")
        except (KeyError, OverflowError, ValueError):
            bad = next((i for i in ids if not 0 <= i < self._enc.n_vocab), ids)
            raise ValueError(f"token id {bad} is not in this tokenizer's vocabulary (0..{self._enc.n_vocab - 1})."
                             ) from None

    def batch_decode(self, sequences: Iterable[Any], skip_special_tokens: bool = False, **kwargs) -> list[str]:
        """:meth:`decode` of each sequence."""
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def _token_string(self, i: int) -> str:
        s = self._special_text.get(i)
        if s is not None:
            return s
        try:
            b = self._enc.decode_single_token_bytes(i)
        except (KeyError, OverflowError, ValueError):
            raise ValueError(f"token id {i} is not in this tokenizer's vocabulary (0..{self._enc.n_vocab - 1})."
                             ) from None
        return "".join(_B2U[x] for x in b)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        """Token strings: special tokens by name, the others as GPT-2 byte-level strings of their bytes (distinct
        for distinct tokens, even for byte pieces that decode to U+FFFD alone)."""
        if isinstance(ids, int):
            return self._token_string(ids)
        return [self._token_string(i) for i in _as_id_list(ids) if not (skip_special_tokens and i in self._skip_ids)]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Inverse of :meth:`convert_ids_to_tokens`; an unknown string gives ``unk_token_id`` (None without one)."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, tok: str) -> int | None:
        i = self._specials.get(tok)
        if i is not None:
            return i
        try:
            return self._ranks.get(bytes(_U2B[c] for c in tok), self.unk_token_id)
        except KeyError:
            return self.unk_token_id

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join token strings back into text (UTF-8, U+FFFD for incomplete characters)."""
        out = bytearray()
        for t in tokens:
            if t in self._specials:
                out += t.encode()
            else:
                out += bytes(_U2B[c] for c in t)
        return out.decode("utf-8", "replace")

    # ------------------------------------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids: base tokens plus special tokens (as the published tokenizer reports)."""
        return self._enc.n_vocab

    def __len__(self) -> int:
        return self._enc.n_vocab

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id for every id (built once, on first use)."""
        if self._vocab is None:
            v = {"".join(_B2U[x] for x in b): i for b, i in self._ranks.items()}
            v.update(self._specials)
            self._vocab = v
        return dict(self._vocab)

    def _id(self, tok: str | None) -> int | None:
        return None if tok is None else self._specials[tok]

    bos_token_id = _special_token_id("bos_token")
    eos_token_id = _special_token_id("eos_token")
    unk_token_id = _special_token_id("unk_token")
    pad_token_id = _special_token_id("pad_token")

    @property
    def special_tokens_map(self) -> dict[str, Any]:
        """The named special tokens (what chat templates see as ``bos_token``, ``eos_token`` ...)."""
        m: dict[str, Any] = {k: getattr(self, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                             if getattr(self, k) is not None}
        if self.additional_special_tokens:
            m["additional_special_tokens"] = list(self.additional_special_tokens)
        return m

    @property
    def all_special_ids(self) -> list[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        return sorted(self._skip_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._special_text[i] for i in self.all_special_ids]

    @property
    def added_tokens_decoder(self) -> dict:
        """id -> ``tokenizers.AddedToken`` for every special id (reserved slots included)."""
        from tokenizers import AddedToken
        return {i: AddedToken(s, special=self._added_special[i], normalized=False)
                for i, s in self._special_text.items()}

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return dict(self._specials)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        """Ids ``encode(..., add_special_tokens=True)`` adds to one text (BOS / EOS where configured)."""
        return (int(self.add_bos_token) + int(self.add_eos_token)) * (2 if pair else 1)

    # ------------------------------------------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: ``chat_template`` (a template, or the name of one of several), else the
        tokenizer's (``tool_use`` when tools are given and it exists, else ``default``).

        Raises:
            ValueError: no chat template, or an ambiguous set of named templates.
        """
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"this tokenizer has several chat templates ({', '.join(sorted(own))}) and none named "
                             "'default': pass chat_template=<name>.")
        if chat_template is not None:
            return chat_template
        if not own:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja): pass chat_template=...")
        return own

    def apply_chat_template(self, conversation: list, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, return_dict: bool = True,
                            return_tensors: str | None = None, tokenizer_kwargs: dict | None = None, **kwargs):
        """Render a conversation (list of ``{"role", "content"}`` dicts) or a list of conversations through the
        Jinja chat template, with transformers' renderer and the same arguments as transformers'
        ``apply_chat_template`` (template variables: ``messages``, ``tools``, ``add_generation_prompt``, the
        special tokens, and ``kwargs``). Tool schemas are key-sorted first, as Kimi's tokenizer does.

        Returns: the text (``tokenize=False``), else a BatchEncoding (``return_dict=True``) or the id list(s),
        tokenized without adding special tokens.

        Raises:
            ValueError: an empty conversation, no template, or ``continue_final_message`` with
            ``add_generation_prompt``.
        """
        from transformers.utils.chat_template_utils import render_jinja_template

        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation (give at least one message).")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set.")
        batched = isinstance(conversation[0], (list, tuple))
        convs = list(conversation) if batched else [conversation]
        template = self.get_chat_template(chat_template, tools)
        rendered, _ = render_jinja_template(
            conversations=convs, tools=_deep_sort(tools) if tools is not None else None, documents=documents,
            chat_template=template, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        out = rendered if batched else rendered[0]
        if not tokenize:
            return out
        enc = self(out, add_special_tokens=False, return_tensors=return_tensors, **(tokenizer_kwargs or {}))
        return enc if return_dict else enc["input_ids"]

    # ------------------------------------------------------------------------------------------------ misc
    def __deepcopy__(self, memo: dict) -> "TiktokenTokenizer":
        """A copy for another thread: the encoder and tables are immutable and shared (tiktoken's encoder is
        thread-safe); attributes such as ``chat_template`` are the copy's own."""
        return copy.copy(self)

    def __repr__(self) -> str:
        return (f"TiktokenTokenizer(name_or_path='{self.name_or_path}', vocab_size={self.vocab_size}, "
                f"base_tokens={self.n_base_tokens}, bos={self.bos_token!r}, eos={self.eos_token!r})")


def _read_chat_template(path: str, cfg: dict) -> str | dict | None:
    """chat_template.jinja, else chat_template.json's ``chat_template``, else tokenizer_config.json's; a list of
    ``{"name", "template"}`` becomes a dict."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tpl = cfg.get("chat_template")
    js = os.path.join(path, "chat_template.json")
    if os.path.isfile(js):
        with open(js, encoding="utf-8") as f:
            tpl = json.load(f).get("chat_template", tpl)
    if isinstance(tpl, list):
        return {d["name"]: d["template"] for d in tpl}
    return tpl
