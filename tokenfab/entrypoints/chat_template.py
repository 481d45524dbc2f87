"""Chat templates: a ``--chat-template`` / ``chat_template=`` value read as a file or an inline Jinja string, and a
conversation rendered to prompt text through transformers' ``apply_chat_template`` (the tokenizer's template
unless another is given)."""
from __future__ import annotations

import os

_JINJA_MARKS = ("{{", "{%", "{#", "\n")


def load_chat_template(value: str | None) -> str | None:
    """``value`` -> template text. A path to an existing file is read (UTF-8); a string holding Jinja marks
    (``{{``, ``{%``, ``{#``) or a newline is the template itself; None stays None.

    Raises:
        ValueError: ``value`` looks like a path (no Jinja marks) but no such file exists, or the file is empty.
    """
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise ValueError(f"chat_template: the file '{value}' is empty.")
        return text
    if any(m in value for m in _JINJA_MARKS):
        return value
    raise ValueError(f"chat_template: '{value}' is neither an existing file nor a Jinja template string (no "
                     "'{{', '{%' or newline); pass a template file path or the template text.")


def _message(m: dict, where: str) -> dict:
    """One chat message as the template sees it: OpenAI text content parts joined to one string."""
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"{where}: each message must be a dict with 'role' and 'content', got {m!r:.80}.")
    out = dict(m)
    c = m.get("content")
    if isinstance(c, list):
        bad = sorted({str(p.get("type")) for p in c if isinstance(p, dict) and p.get("type", "text") != "text"})
        if bad:
            raise ValueError(f"{where}: content parts of type {bad} are not supported (text only).")
        out["content"] = "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
    elif c is None:
        out["content"] = ""
    return out


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
    """Prompt text of one conversation: ``tokenizer.apply_chat_template(..., tokenize=False)`` with
    ``chat_template`` (template text, or None for the tokenizer's own).

    Raises:
        ValueError: no tokenizer or no template, add_generation_prompt together with continue_final_message,
            a malformed message, or the template itself failed (its error is quoted).
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer: this model folder has none (pass tokenizer=...).")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template (tokenizer_config.json chat_template / "
                         "chat_template.jinja); pass chat_template=... or use generate() with a plain prompt.")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt=True and continue_final_message=True do not go together: set "
                         "add_generation_prompt=False to continue the final message.")
    msgs = [_message(m, "messages") for m in conversation]
    if not msgs:
        raise ValueError("messages: a conversation needs at least one message.")
    kw = dict(chat_template_kwargs or {})
    if tools is not None:
        kw["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template=chat_template, **kw)
    except Exception as e:
        raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    return text
