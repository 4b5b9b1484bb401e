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

**Labels**: the rendered text is tokenized once, with character offsets; a token is trained
when it starts inside an assistant span. An example whose tokens don't end with EOS (a
template closing turns with its own end-of-turn token, a conversation ending with a user
turn) gets one appended, trained when the token before it is: packed examples are always
separated by EOS, and the model learns to emit it after an answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_cpu.config.data import DataConfig

IGNORE = -100  # the label of a token without loss (PyTorch's cross-entropy ignore_index)
PLAIN_ROLES = ("system", "user", "assistant")
# ShareGPT rows (`conversations` of {from, value} turns, as many public SFT sets ship): their
# speakers as chat roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}
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
    """A row that can't become an example; the data layer adds the file and row to the message."""


# ----------------------------------------------------------------------------- rows -> messages


def row_messages(row: dict[str, Any], cfg: DataConfig) -> list[dict[str, str]]:
    """The example's messages; RowError names what the row lacks."""
    if cfg.format == "chat":
        msgs = row.get(cfg.messages_column)
        if msgs is None and cfg.messages_column == "messages":  # ShareGPT, recognised as it is
            msgs = row.get("conversations")
        if msgs is None:
            raise RowError(
                f"no {cfg.messages_column!r} field (has {sorted(row)}); set data.messages_column "
                "(ShareGPT's 'conversations' is recognised as it is)"
            )
        if isinstance(msgs, str):  # a parquet column may hold the list as JSON text
            try:
                msgs = json.loads(msgs)
            except json.JSONDecodeError:
                raise RowError(
                    f"{cfg.messages_column!r} is a string, not a list of {{role, content}} (nor one as JSON text)"
                ) from None
        if not isinstance(msgs, list) or not msgs:
            raise RowError(f"{cfg.messages_column!r} must be a non-empty list of {{role, content}}")
        out = []
        for i, m in enumerate(msgs):
            if isinstance(m, dict) and "role" not in m and isinstance(m.get("from"), str):  # a ShareGPT turn
                m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError(f"message {i} is not a {{role, content}} object with text content")
            out.append({"role": m["role"], "content": m["content"]})
        answers = [m["content"] for m in out if m["role"] == "assistant"]
        if not answers:
            raise RowError("no assistant message: nothing to train on")
    else:
        prompt, response = _instruction_fields(row, cfg)
        system = row.get(cfg.system_column) if cfg.system_column else None
        msgs = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
        out = [*msgs, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        answers = [response]
    # An empty answer would train on the end of turn alone: the model learns to say nothing to
    # that prompt. Almost always a broken export or the wrong column; one empty turn among
    # others (a tool call's) still trains on the rest.
    if not any(a.strip() for a in answers):
        raise RowError("the assistant's answer is empty (blank text): it would train the model to answer nothing")
    return out


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


def row_pair(row: dict[str, Any], cfg: DataConfig) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A preference row's two conversations, (chosen, rejected), the same prompt before each answer.

    chosen and rejected are each the answer's text, or messages ending with it. Where they carry
    turns before the answer (TRL's conversational rows, UltraFeedback's), those are the prompt,
    the same in both; a prompt field beside them only repeats it and is not read. Else the prompt
    is data.prompt_column's text (the user's message) or messages."""
    sides = []
    for column in (cfg.chosen_column, cfg.rejected_column):
        value = row.get(column)
        if value is None:
            raise RowError(f"no {column!r} field (has {sorted(row)}); set data.chosen_column / data.rejected_column")
        if isinstance(value, str):
            value = [{"role": "assistant", "content": value}]
        sides.append(_messages(value, column))
    (chosen_prompt, chosen), (rejected_prompt, rejected) = [(m[:-1], m[-1]) for m in sides]
    for column, last in ((cfg.chosen_column, chosen), (cfg.rejected_column, rejected)):
        if last["role"] != "assistant":
            raise RowError(f"{column!r} must end with the assistant's answer, not a {last['role']!r} message")
    if not chosen["content"].strip():  # it would train the model to prefer saying nothing (an empty rejected
        raise RowError(f"the {cfg.chosen_column!r} answer is empty (blank text)")  # answer is a fair preference)
    if chosen_prompt != rejected_prompt:
        raise RowError(f"{cfg.chosen_column!r} and {cfg.rejected_column!r} differ before their answers")
    messages = chosen_prompt
    if not messages:
        prompt = row.get(cfg.prompt_column)
        if prompt is None:
            raise RowError(f"no {cfg.prompt_column!r} field (has {sorted(row)}); set data.prompt_column")
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, cfg.prompt_column)
        )
    system = row.get(cfg.system_column) if cfg.system_column else None
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return [*messages, chosen], [*messages, rejected]


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{column!r} must be text or a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"{column!r} message {i} is not a {{role, content}} object with text content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


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
    loaded from `tokenizer_dir` the first time one is needed (~2 s of imports, once an actor).
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


def example_tokens(
    encoding, spans: list[tuple[int, int]], train_on_prompt: bool, eos_id: int
) -> tuple[list[int], list[int], int | None]:
    """(ids, labels, prompt tokens) of one encoded example, ending with EOS.

    The prompt is what comes before the first response token (None: no response token at
    all); it is measured on the masked labels whatever train_on_prompt says, so an example
    whose prompt alone fills a block is caught either way.
    """
    ids, labels = labelled_ids(encoding, spans, False)
    prompt = next((k for k, lab in enumerate(labels) if lab != IGNORE), None)
    if train_on_prompt:
        labels = ids[:]
    if not ids or ids[-1] != eos_id:  # packed examples are always separated by EOS
        ids.append(eos_id)
        labels.append(eos_id if len(labels) and labels[-1] != IGNORE else IGNORE)
    return ids, labels, prompt


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
