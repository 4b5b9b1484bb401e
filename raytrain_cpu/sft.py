"""Chat and instruction data: rows -> messages -> rendered text -> tokens with loss labels.

Every example becomes a list of messages (`{role, content}`): a chat row is one already; an
instruction row becomes [system?], user: prompt, assistant: response (Alpaca rows:
instruction + "\n\n" + input, and output). The messages are rendered to one string with a
chat template, and tokenized once, with character offsets: a token takes a loss label when
it starts inside an assistant span, so the labels are exactly the response tokens however
the tokenizer merges across the template's seams.

**The plain template** (a tokenizer without a chat template, such as the bundled one):

    <|system|>
    {system content}
    <|user|>
    {user content}
    <|assistant|>
    {assistant content}<eos>

Role markers are plain text (no tokenizer change, any tokenizer works); each turn is
followed by a newline; an assistant turn ends with the tokenizer's EOS, which is trained
with the content (the model learns to stop). A generation prompt ends with "<|assistant|>\n".
Known roles: system, user, assistant.

**A tokenizer's own template** (`tokenizer_config.json`'s `chat_template`, or
`data.chat_template` naming a .jinja file) is rendered with Jinja as transformers does; the
assistant spans are found by rendering each prefix of the conversation: for assistant
message i, everything between render(messages[:i], add_generation_prompt=True) and
render(messages[:i+1]) is its turn (content and end-of-turn tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_cpu.config import DataConfig

IGNORE = -100  # the label of a token without loss (PyTorch's cross-entropy ignore_index)
PLAIN_ROLES = ("system", "user", "assistant")
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The plain template as Jinja (written into exported tokenizers; `render_plain` is its twin)."""


class RowError(ValueError):
    """A row that can't become an example; the data layer adds the file and row to the message."""


# ----------------------------------------------------------------------------- rows -> messages


def row_messages(row: dict[str, Any], cfg: DataConfig) -> list[dict[str, str]]:
    """The example's messages; RowError names what the row lacks."""
    if cfg.format == "chat":
        msgs = row.get(cfg.messages_column)
        if msgs is None:
            raise RowError(f"no {cfg.messages_column!r} field (has {sorted(row)}); set data.messages_column")
        if isinstance(msgs, str):
            msgs = json.loads(msgs)
        if not isinstance(msgs, list) or not msgs:
            raise RowError(f"{cfg.messages_column!r} must be a non-empty list of {{role, content}}")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError(f"message {i} is not a {{role, content}} object with text content")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    prompt, response = _instruction_fields(row, cfg)
    system = row.get(cfg.system_column) if cfg.system_column else None
    msgs = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    return [*msgs, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def _instruction_fields(row: dict[str, Any], cfg: DataConfig) -> tuple[str, str]:
    if cfg.prompt_column in row:
        prompt, response = row.get(cfg.prompt_column), row.get(cfg.response_column)
        names = (cfg.prompt_column, cfg.response_column)
    elif "instruction" in row:  # Alpaca: instruction (+ input) -> output
        extra = row.get("input") or ""
        prompt = row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra else "")
        response, names = row.get("output"), ("instruction", "output")
    else:
        raise RowError(
            f"no {cfg.prompt_column!r} field (has {sorted(row)}); set data.prompt_column / data.response_column, "
            "or give Alpaca-style instruction/input/output fields"
        )
    for name, value in zip(names, (prompt, response)):
        if not isinstance(value, str):
            raise RowError(f"field {name!r} is {'missing' if value is None else type(value).__name__}, not text")
    return prompt, response


# ----------------------------------------------------------------------------- messages -> text


def render_plain(messages: list[dict[str, str]], eos: str, add_generation_prompt: bool = False):
    """(text, trainable character spans) with the plain template."""
    parts, spans, pos = [], [], 0
    for m in messages:
        if m["role"] not in PLAIN_ROLES:
            raise RowError(f"role {m['role']!r} is not one the plain template knows ({', '.join(PLAIN_ROLES)})")
        head = f"<|{m['role']}|>\n"
        body = m["content"] + (eos if m["role"] == "assistant" else "")
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        parts += [head, body, "\n"]
        pos += len(head) + len(body) + 1
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts), spans


@dataclass
class Template:
    """A chat template bound to a tokenizer's special tokens; renders text and assistant spans."""

    source: str | None  # Jinja source, or None for the plain template
    eos: str
    bos: str = ""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False):
        if self.source is None:
            return render_plain(messages, self.eos, add_generation_prompt)
        text = self._jinja(messages, add_generation_prompt)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._jinja(messages[:i], True)
            upto = self._jinja(messages[: i + 1], False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise RowError("the chat template renders earlier turns differently as the conversation grows")
            spans.append((len(before), len(upto)))
        return text, spans

    def _jinja(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, eos_token=self.eos, bos_token=self.bos
            )
        except TemplateError as e:  # e.g. raise_exception('Conversation roles must alternate ...')
            raise RowError(f"the chat template rejects this conversation: {e}") from None


_COMPILED: dict[str, Any] = {}


def _compiled(source: str):
    if source not in _COMPILED:
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            from jinja2 import TemplateError

            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
        env.globals["raise_exception"] = raise_exception
        _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]


def _special(config: dict[str, Any], name: str) -> str:
    v = config.get(name)
    return (v.get("content") if isinstance(v, dict) else v) or ""


def template_for_dir(tokenizer_dir: str | Path, cfg: DataConfig) -> Template:
    """The template a run renders with: data.chat_template (a .jinja file), else the tokenizer's
    own chat_template, else the plain one; bound to the tokenizer's EOS/BOS strings."""
    tdir = Path(tokenizer_dir)
    conf = (
        json.loads((tdir / "tokenizer_config.json").read_text()) if (tdir / "tokenizer_config.json").is_file() else {}
    )
    source = None
    if cfg.chat_template:
        source = Path(cfg.chat_template).expanduser().read_text()
    elif isinstance(conf.get("chat_template"), str):
        source = conf["chat_template"]
    elif (tdir / "chat_template.jinja").is_file():
        source = (tdir / "chat_template.jinja").read_text()
    return Template(source, _special(conf, "eos_token"), _special(conf, "bos_token"))


def template_fingerprint(tokenizer_dir: str | Path, cfg: DataConfig) -> str:
    """What the cache key holds of the template: its source (or 'plain')."""
    import hashlib

    t = template_for_dir(tokenizer_dir, cfg)
    return hashlib.sha256((t.source or "plain").encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- text -> tokens


def labelled_ids(encoding, spans: list[tuple[int, int]], train_on_prompt: bool) -> tuple[list[int], list[int]]:
    """(ids, labels) of one encoded example: a token is trained when it starts inside a span."""
    ids = list(encoding.ids)
    if train_on_prompt:
        return ids, ids[:]
    labels, k = [], 0
    for tid, (start, end) in zip(ids, encoding.offsets):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside = k < len(spans) and spans[k][0] <= start < spans[k][1] and end > start
        labels.append(tid if inside else IGNORE)
    return ids, labels


# ----------------------------------------------------------------------------- for generate and export


def _dir_of(tokenizer) -> str | None:
    return getattr(tokenizer, "name_or_path", None)


def chat_template_for(tokenizer, cfg: DataConfig) -> str:
    """The Jinja source a run rendered with (the plain template when the tokenizer had none)."""
    if cfg.chat_template:
        return Path(cfg.chat_template).expanduser().read_text()
    return tokenizer.chat_template or PLAIN_TEMPLATE


def render_generation_prompt(
    tokenizer, cfg: DataConfig, *, prompt: str | None = None, messages: list[dict] | None = None
) -> list[int]:
    """Token ids of a prompt rendered as training rendered its examples, the assistant turn opened."""
    if messages is None:
        messages = [{"role": "user", "content": prompt or ""}]
    source = chat_template_for(tokenizer, cfg)
    template = Template(
        None if source == PLAIN_TEMPLATE else source, tokenizer.eos_token or "", tokenizer.bos_token or ""
    )
    try:
        text, _ = template.render(messages, add_generation_prompt=True)
    except RowError as e:
        raise ValueError(f"--chat: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
