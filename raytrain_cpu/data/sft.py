"""Chat, instruction and preference rows: rows -> messages, and rendered text -> tokens with loss labels.

Every example becomes a list of messages (`{role, content}`): a chat row is one already; an
instruction row becomes [system?], user: prompt, assistant: response (Alpaca rows:
instruction + "\n\n" + input, and output); a preference row two conversations, one prompt
before the chosen and the rejected answer. raytrain_cpu.model.chat renders them to one string
with a chat template, with the assistant's character spans.

**Labels**: the rendered text is tokenized once, with character offsets; a token is trained
when it starts inside an assistant span, so the labels are exactly the response tokens however
the tokenizer merges across the template's seams. An example whose tokens don't end with EOS (a
template closing turns with its own end-of-turn token, a conversation ending with a user
turn) gets one appended, trained when the token before it is: packed examples are always
separated by EOS, and the model learns to emit it after an answer.
"""

from __future__ import annotations

import json
from typing import Any

from raytrain_cpu.config.data import DataConfig
from raytrain_cpu.model.chat import RowError

IGNORE = -100  # the label of a token without loss (PyTorch's cross-entropy ignore_index)
# ShareGPT rows (`conversations` of {from, value} turns, as many public SFT sets ship): their
# speakers as chat roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}


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
