"""Builds the bundled chat and instruction examples from the bundled WikiText-2 text.

    python raytrain_cpu/assets/sft/make_examples.py

For each article: "What is the article <title> about?" -> its first sentences; for each
section: "What does the article <title> say about <section>?" -> the section's first
sentence. instruction_*.jsonl holds them as prompt/response rows; chat_*.jsonl as
conversations (a system message, the article question, then the first section question as
a follow-up; further sections as one-turn conversations); preference_*.jsonl as
prompt/chosen/rejected rows (rejected: another question's answer). Answers are cut at a word to stay
short (240 characters, 120 for sections): a conversation fits a 256-token block of the
bundled tokenizer. train = the test split, eval = the validation split. Deterministic.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).parent
WIKITEXT = HERE.parent / "wikitext-2"
SYSTEM = "You answer questions about Wikipedia articles in one or two sentences."
MAX_CHARS = 240
FOLLOW_UPS = 1  # section questions asked as follow-up turns of an article's conversation


def _clean(text: str) -> str:
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    text = re.sub(r" ([,.;:!?')])", r"\1", text)
    text = re.sub(r"([(]) ", r"\1", text)
    return text.replace(" 's", "'s").strip()


def _first_sentences(paragraph: str, limit: int = MAX_CHARS) -> str:
    sentences = re.split(r"(?<=[.!?]) (?=[A-Z])", _clean(paragraph))
    out = sentences[0]
    for s in sentences[1:]:
        if len(out) + 1 + len(s) > limit:
            break
        out += " " + s
    # A first sentence longer than the limit is cut at a word: examples stay short enough that
    # a conversation fits a 256-token block of the bundled tokenizer.
    return out if len(out) <= limit else out[:limit].rsplit(" ", 1)[0] + " ..."


def articles(path: Path) -> list[dict]:
    """[{title, lead, sections: [(name, first paragraph)]}] of a wikitext file."""
    out: list[dict] = []
    section = None
    for line in path.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s:
            continue
        if re.fullmatch(r"= [^=].*[^=] =", s):
            out.append({"title": _clean(s.strip("= ")), "lead": None, "sections": []})
            section = None
        elif re.fullmatch(r"= = [^=].*[^=] = =", s) and out:
            section = _clean(s.strip("= "))
            out[-1]["sections"].append([section, None])
        elif out and not s.startswith("="):
            if section is None and out[-1]["lead"] is None:
                out[-1]["lead"] = s
            elif section is not None and out[-1]["sections"][-1][1] is None:
                out[-1]["sections"][-1][1] = s
    return [a for a in out if a["lead"]]


def examples(path: Path) -> tuple[list[dict], list[dict]]:
    instruction, chat = [], []
    for a in articles(path):
        q = f"What is the article {a['title']} about?"
        lead = _first_sentences(a["lead"])
        instruction.append({"prompt": q, "response": lead})
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        turns.append({"role": "assistant", "content": lead})
        sections = [(n, p) for n, p in a["sections"] if p]
        for i, (name, para) in enumerate(sections):
            sq = f"What does the article {a['title']} say about {name}?"
            answer = _first_sentences(para, MAX_CHARS // 2)
            instruction.append({"prompt": sq, "response": answer})
            if i < FOLLOW_UPS:
                turns += [{"role": "user", "content": f"What does it say about {name}?"}]
                turns += [{"role": "assistant", "content": answer}]
            else:
                chat.append({"messages": [{"role": "user", "content": sq}, {"role": "assistant", "content": answer}]})
        chat.append({"messages": turns})
    return instruction, chat


def preference(instruction: list[dict]) -> list[dict]:
    """Each question with its own answer (chosen) and the answer to the question half the set away
    (rejected: another article's, so the preferred answer is the one about the asked title)."""
    n = len(instruction)
    return [
        {"prompt": r["prompt"], "chosen": r["response"], "rejected": instruction[(i + n // 2) % n]["response"]}
        for i, r in enumerate(instruction)
    ]


def main() -> None:
    for split, src in (("train", "test.txt"), ("eval", "valid.txt")):
        instruction, chat = examples(WIKITEXT / src)
        for name, rows in (("instruction", instruction), ("chat", chat), ("preference", preference(instruction))):
            with open(HERE / f"{name}_{split}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            print(f"{name}_{split}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
