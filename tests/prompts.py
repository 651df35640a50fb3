"""Varied prompts for the real-model acceptance tests."""

from __future__ import annotations

from typing import Any

_FILLER = (
    "The committee met on Tuesday to review the quarterly budget, the staffing plan and the "
    "schedule for the new library wing. Each department presented its figures in turn. "
)


def varied_prompts(tokenizer: Any) -> dict[str, list[int]]:
    """Name -> prompt token ids: plain text, chat, code, Chinese, emoji, long, early-EOS."""

    def chat(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(
            tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )

    def text(t: str) -> list[int]:
        return list(tokenizer(t)["input_ids"])

    long_ids = text(_FILLER * 60)[:1500] + text(" In summary, the committee decided")
    return {
        "plain": text("The history of the Roman Empire"),
        "plain_short": text("Once upon a time"),
        "chat_capital": chat("What is the capital of France?"),
        "chat_recipe": chat("Give me a simple recipe for pancakes."),
        "chat_yes": chat("Reply with just the word yes."),
        "chat_hi": chat("Hi!"),
        "code_python": text('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        "code_sql": text("-- list customers with more than five orders\nSELECT"),
        "chinese": text("人工智能是计算机科学的一个分支，它"),
        "chinese_chat": chat("请用中文介绍一下北京。"),
        "emoji": text("My favourite emojis are 🎉🚀 and"),
        "numbers": text("1, 2, 3, 5, 8, 13,"),
        "long_1500": long_ids,
    }
