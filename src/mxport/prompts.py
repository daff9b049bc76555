"""The built-in prompt set of ``mxport verify``: short, varied chat prompts (facts, reasoning, arithmetic,
code, lists, translation, creative writing, instructions), one user turn each.

A ``--prompts FILE`` replaces them: a text file with one prompt per line (blank lines and lines starting with
``#`` skipped), or a JSON list of strings, or a JSON list of chat message lists (``[{"role", "content"},
...]``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BUILTIN_PROMPTS: tuple[str, ...] = (
    "What is the capital of France, and what river runs through it?",
    "Explain in two sentences why the sky looks blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "If I have 3 apples and buy 5 more, then eat 2, how many apples do I have?",
    "List three uses of a paperclip besides holding paper.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Write a haiku about the ocean at night.",
    "What is the difference between a virus and a bacterium?",
    "Give me a short recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What does the acronym CPU stand for, and what does a CPU do?",
    "Suggest a name for a friendly robot that helps in a library.",
    "How many minutes are there in a day? Show your calculation.",
    "Write a SQL query that counts the rows of a table named users.",
    "Give two tips for staying focused while studying.",
    "Why do leaves change color in autumn?",
    "Describe a cat to someone who has never seen one.",
    "What is 17 multiplied by 6?",
)


def load_prompts(path: str | os.PathLike | None = None) -> list[list[dict]]:
    """Chat conversations to generate from: the built-in set (``path`` None) or those in ``path``.

    Returns a list of message lists (``[{"role": "user", "content": ...}]``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file holds no prompt, or JSON of another shape.
    """
    if path is None:
        return [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts file {str(p)!r} does not exist")
    text = p.read_text(encoding="utf-8")
    convs: list[list[dict]] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompts file {str(p)!r} starts with '[' "
                             f"but is not valid JSON: {exc}") from None
        for item in data:
            if isinstance(item, str) and item.strip():
                convs.append([{"role": "user", "content": item}])
            elif isinstance(item, list) and item and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in item):
                convs.append([{"role": m["role"], "content": m["content"]} for m in item])
            else:
                raise ValueError(f"prompts file {str(p)!r}: each JSON item must be a string or a list of "
                                 f"{{'role', 'content'}} messages, got {item!r:.80}")
    else:
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                convs.append([{"role": "user", "content": line}])
    if not convs:
        raise ValueError(f"prompts file {str(p)!r} holds no prompt")
    return convs
