"""Chat templates: messages -> the text a model sees, with the assistant's spans (what trains).

**The plain template** (a tokenizer without a chat template, such as the bundled one):

    <|system|>
    {system content}
    <|user|>
    {user content}
    <|assistant|>
    {assistant content}<eos>

Role markers are plain text (no tokenizer change, any tokenizer works); turns are joined by
a newline; an assistant turn ends with the tokenizer's EOS, which is trained with the content
(the model learns to stop), so an example ending with its answer ends with EOS, as a packed
pretraining document does. A generation prompt is the conversation so far, a newline, and
"<|assistant|>\n". Known roles: system, user, assistant. `PLAIN_TEMPLATE` is the same
template in Jinja: export writes it into the exported tokenizer, so transformers'
`apply_chat_template` renders exactly the text training saw (a test checks it).

**A tokenizer's own template** (`tokenizer_config.json`'s `chat_template`, or
`data.chat_template` naming a .jinja file) is rendered by transformers' `apply_chat_template`,
as at inference; the assistant spans are found by rendering each prefix of the conversation: for assistant
message i, everything between render(messages[:i], add_generation_prompt=True) and
render(messages[:i+1]) is its turn (content and end-of-turn tokens). A role the template
rejects (raise_exception) or drops (its message's text is not in the rendering) is an error.

Rows become messages, and rendered text becomes labelled tokens, in raytrain_cpu.data.sft.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_cpu.config.data import DataConfig

PLAIN_ROLES = ("system", "user", "assistant")
# Newlines as {{ '\n' }}: transformers renders with trim_blocks, which eats a literal newline
# right after a {% ... %} tag.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ '\\n' }}{% endif %}<|assistant|>{{ '\\n' }}{% endif %}"
)
"""The plain template as Jinja (written into exported tokenizers; `render_plain` is its twin)."""


class RowError(ValueError):
    """A row or conversation that can't become an example (the template's errors too); the data layer adds
    the file and row to the message."""


# ----------------------------------------------------------------------------- messages -> text


def render_plain(messages: list[dict[str, str]], eos: str, add_generation_prompt: bool = False):
    """(text, trainable character spans) with the plain template."""
    parts, spans, pos = [], [], 0
    for i, m in enumerate(messages):
        if m["role"] not in PLAIN_ROLES:
            raise RowError(f"role {m['role']!r} is not one the plain template knows ({', '.join(PLAIN_ROLES)})")
        head = ("\n" if i else "") + f"<|{m['role']}|>\n"
        body = m["content"] + (eos if m["role"] == "assistant" else "")
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        parts += [head, body]
        pos += len(head) + len(body)
    if add_generation_prompt:
        parts.append(("\n" if messages else "") + "<|assistant|>\n")
    return "".join(parts), spans


@dataclass
class Template:
    """A chat template bound to a tokenizer; renders text and assistant spans.

    A Jinja template is rendered by transformers' own `apply_chat_template` (same sandbox,
    globals, special tokens and undefined-variable rules as at inference), on a tokenizer
    loaded from `tokenizer_dir` the first time one is needed (seconds of imports, once an actor).
    """

    source: str | None  # Jinja source, or None for the plain template
    eos: str
    tokenizer_dir: str | None = None
    hf: Any = None  # a transformers tokenizer, loaded lazily from tokenizer_dir

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False):
        if self.source is None:
            return render_plain(messages, self.eos, add_generation_prompt)
        text = self._jinja(messages, add_generation_prompt)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i == 0:  # transformers renders no empty conversation: the prompt before it is unknown
                raise RowError("the conversation opens with an assistant turn; give a user turn before it")
            before = self._jinja(messages[:i], True)
            upto = self._jinja(messages[: i + 1], False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise RowError("the chat template renders earlier turns differently as the conversation grows")
            spans.append((len(before), len(upto)))
        for i, m in enumerate(messages):
            if m["content"].strip() and m["content"].strip() not in text:
                raise RowError(f"message {i}'s role {m['role']!r} is not one the chat template renders (it drops it)")
        return text, spans

    def _jinja(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        if self.hf is None:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        try:
            return self.hf.apply_chat_template(
                messages, chat_template=self.source, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, ValueError) as e:  # e.g. raise_exception('Conversation roles must alternate ...')
            raise RowError(f"the chat template rejects this conversation: {e}") from None


def _special(config: dict[str, Any], name: str) -> str:
    v = config.get(name)
    return (v.get("content") if isinstance(v, dict) else v) or ""


def _own_template(conf: dict[str, Any], tdir: Path) -> str | None:
    t = conf.get("chat_template")
    if isinstance(t, list):  # named templates: [{name, template}, ...]; the default one renders chats
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if isinstance(t, str):
        return t
    return (tdir / "chat_template.jinja").read_text() if (tdir / "chat_template.jinja").is_file() else None


def template_for_dir(tokenizer_dir: str | Path, cfg: DataConfig) -> Template:
    """The template a run renders with: data.chat_template (a .jinja file), else the tokenizer's
    own chat_template, else the plain one; bound to the tokenizer's EOS/BOS strings."""
    tdir = Path(tokenizer_dir)
    conf = (
        json.loads((tdir / "tokenizer_config.json").read_text()) if (tdir / "tokenizer_config.json").is_file() else {}
    )
    source = Path(cfg.chat_template).expanduser().read_text() if cfg.chat_template else _own_template(conf, tdir)
    return Template(source, _special(conf, "eos_token"), str(tdir))


def template_fingerprint(tokenizer_path: str | Path, cfg: DataConfig) -> str:
    """What the cache key holds of the template: a hash of its source (or of 'plain'). A hub
    tokenizer not saved locally yet is keyed by its name (its own template, or the plain one)."""
    import hashlib

    if not Path(tokenizer_path).is_dir() and not cfg.chat_template:
        return f"own-or-plain:{tokenizer_path}"
    t = template_for_dir(tokenizer_path, cfg)
    return hashlib.sha256((t.source or "plain").encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- for generate and export


def _data_config(cfg: DataConfig | dict[str, Any]) -> DataConfig:
    return DataConfig(**cfg) if isinstance(cfg, dict) else cfg


def chat_template_for(tokenizer, cfg: DataConfig | dict[str, Any]) -> str:
    """The Jinja source a run rendered with (the plain template when the tokenizer had none)."""
    cfg = _data_config(cfg)
    if cfg.chat_template:
        return Path(cfg.chat_template).expanduser().read_text()
    return tokenizer.chat_template or PLAIN_TEMPLATE


def render_generation_prompt(
    tokenizer, cfg: DataConfig | dict[str, Any], *, prompt: str | None = None, messages: list[dict] | None = None
) -> list[int]:
    """Token ids of a prompt rendered as training rendered its examples, the assistant turn opened."""
    cfg = _data_config(cfg)
    if messages is None:
        messages = [{"role": "user", "content": prompt or ""}]
    source = chat_template_for(tokenizer, cfg)
    template = Template(None if source == PLAIN_TEMPLATE else source, tokenizer.eos_token or "", hf=tokenizer)
    try:
        text, _ = template.render(messages, add_generation_prompt=True)
    except RowError as e:
        raise ValueError(f"--chat: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
