"""`python -m raytrain_cpu.generate <checkpoint | export dir> --prompt "..."`: see what a run learned.

One process, no Ray, no process group: a checkpoint is first exported to a temporary
directory (ZeRO shards consolidated offline; a LoRA run's adapters merged in), an export
directory is loaded as it is (an ordinary model, or a LoRA adapter on the base model its
adapter_config.json names). The prompt is rendered with the run's tokenizer and template
exactly as training rendered its data (`raytrain.json` in the export, the manifest of a
checkpoint): for chat and instruction runs the assistant turn is opened after the prompt,
for plain-text runs the prompt is continued as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.layout import MANIFEST, CheckpointError
from raytrain_cpu.checkpoint.verify import BEST_HELP, best_of


def _export_dir(path: Path, stack: ExitStack, merge: bool = True) -> Path:
    """An export directory for `path`: itself, or a temporary export of a checkpoint (a run
    directory's latest); a LoRA checkpoint's merged model, or with merge=False its adapter."""
    from raytrain_cpu.model.export import MERGED, export_checkpoint, model_or_checkpoint

    path = model_or_checkpoint(path)
    if not (path / MANIFEST).is_file():
        return path

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raytrain-generate-"))) / "export"
    info = export_checkpoint(path, tmp, merge=merge)
    return tmp / MERGED if "merged" in info else tmp


def _run_info(export_dir: Path) -> dict[str, Any]:
    from raytrain_cpu.model.export import RUN_INFO

    f = export_dir / RUN_INFO
    return json.loads(f.read_text()) if f.is_file() else {}


def prompt_ids(tokenizer, run_info: dict[str, Any], prompt: str | None, messages: list[dict] | None) -> list[int]:
    """Token ids of the prompt as the run's data rendered it (the assistant turn opened)."""
    data = run_info.get("data") or {}
    fmt = data.get("format", "text")
    if fmt == "text" and messages is None:
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if fmt == "text":  # a model not fine-tuned on chat: its own template, if it has one
        if not tokenizer.chat_template:
            raise ValueError("--chat: this model was trained on plain text and its tokenizer has no chat template")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    from raytrain_cpu.config.data import DataConfig
    from raytrain_cpu.model.chat import render_generation_prompt

    return render_generation_prompt(tokenizer, DataConfig(**data), prompt=prompt, messages=messages)


def generate(
    path: str | Path,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> str:
    """The completion (new tokens only, decoded) of `prompt` or of a chat `messages` list."""
    import torch
    from transformers import AutoTokenizer

    from raytrain_cpu.model.export import load_exported

    if prompt == "":  # no token to continue from: the model's forward fails on an empty batch
        raise ValueError("--prompt is empty; give the text to complete (for chat and instruction runs: the message)")
    with ExitStack() as stack:
        export_dir = _export_dir(Path(path), stack)
        tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
        ids = prompt_ids(tokenizer, _run_info(export_dir), prompt, messages)
        model = load_exported(export_dir)
        _check_fits(model.config.to_dict(), len(ids), max_new_tokens)
        torch.manual_seed(seed)
        eos = tokenizer.eos_token_id
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def _check_fits(config: dict[str, Any], prompt_len: int, max_new_tokens: int) -> None:
    """Prompt and completion must fit the model's positions: past them a learned-position model
    (GPT-2) fails deep in its forward and a rotary one writes on positions it never saw."""
    from raytrain_cpu.model.loading import context_length

    found = context_length(config)
    if found is None or prompt_len + max_new_tokens <= found[1]:
        return
    key, limit = found
    room = limit - prompt_len
    raise ValueError(
        f"--max-new-tokens: the prompt's {prompt_len} tokens and {max_new_tokens} new ones exceed the model's "
        f"context ({key}={limit}); " + (f"use --max-new-tokens {room} or less." if room > 0 else "shorten the prompt.")
    )


def _read_messages(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ValueError(f"--chat: {path!r} {what}; give a JSON file with a list of {{role, content}}")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat: {path} is not JSON ({e.msg})") from None
    messages = obj.get("messages") if isinstance(obj, dict) else obj
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)
    ):
        raise ValueError(f"--chat: {path} must hold a list of {{role, content}} objects (or {{messages: [...]}})")
    return messages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.generate",
        description="Complete a prompt with a trained checkpoint or an export (one process, no Ray).",
    )
    ap.add_argument(
        "model", help="a checkpoint directory (manifest.json), a run directory (its latest checkpoint) or an export"
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt (for chat/instruction runs: the user's message)")
    src.add_argument("--chat", metavar="FILE", help="a JSON file with a list of {role, content} messages")
    ap.add_argument("--best", action="store_true", help=BEST_HELP)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        print(f"error: --max-new-tokens must be >= 1; got {args.max_new_tokens}", file=sys.stderr)
        return 2
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # nan passes any comparison's "not <"
        print(
            f"error: --temperature must be a finite number >= 0 (0 = greedy); got {args.temperature}", file=sys.stderr
        )
        return 2
    if not Path(args.model).is_dir():
        print(f"error: {args.model!r} is not a directory; give a checkpoint or an export directory", file=sys.stderr)
        return 2
    from raytrain_cpu.model.export import progress_to_stderr

    try:
        messages = _read_messages(args.chat) if args.chat else None
        with progress_to_stderr():
            model = best_of(args.model) if args.best else args.model
            text = generate(model, args.prompt, messages, args.max_new_tokens, args.temperature, args.seed)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
