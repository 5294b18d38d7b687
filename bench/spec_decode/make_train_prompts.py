"""Write train_prompts.jsonl: ~200 varied chat, instruction and code prompts from templates.

The prompts `kvserve train-draft` distils the model on by default. Deterministic: the same
file comes out every run.

    .venv/bin/python bench/spec_decode/make_train_prompts.py
"""

from __future__ import annotations

import itertools
import json
import os
import random

_TOPICS = [
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "vaccines",
    "inflation",
    "machine learning",
    "the immune system",
    "plate tectonics",
    "the internet",
    "climate change",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "compound interest",
    "volcanoes",
    "DNA",
    "the stock market",
    "renewable energy",
    "the moon landing",
]
_EXPLAIN = [
    "Explain {t} to a ten-year-old.",
    "What is {t}? Answer in three sentences.",
    "Give me three surprising facts about {t}.",
    "Write a short paragraph about {t} for a school newsletter.",
    "What are the main pros and cons of {t}?",
    "Summarize the history of {t} in a few bullet points.",
]
_TASKS = [
    "reverse a string",
    "check whether a number is prime",
    "compute the factorial of n",
    "find the largest element of a list",
    "count the vowels in a sentence",
    "merge two sorted lists",
    "remove duplicates from a list",
    "compute Fibonacci numbers",
    "read a CSV file and print each row",
    "convert Celsius to Fahrenheit",
    "check whether a word is a palindrome",
    "sort a dictionary by value",
]
_LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java"]
_CODE = [
    "Write a {l} function to {k}.",
    "How do I {k} in {l}? Show a short example.",
    "Write {l} code to {k}, with a comment on each line.",
]
_WRITING = [
    "Write a haiku about {s}.",
    "Write a four-line poem about {s}.",
    "Write a short story opening about {s}.",
    "Describe {s} in one vivid paragraph.",
    "Write a friendly email inviting a colleague to {e}.",
    "Give me five tips for {a}.",
    "What should I pack for {e}?",
    "Make a simple plan for {a} over one week.",
]
_SUBJECTS = [
    "the ocean",
    "autumn leaves",
    "a lonely robot",
    "a busy city",
    "the first snow",
    "an old library",
    "a mountain sunrise",
    "a cat on a windowsill",
]
_EVENTS = [
    "a team lunch",
    "a weekend hiking trip",
    "a birthday party",
    "a product launch",
    "a book club meeting",
    "a beach holiday",
]
_ACTIVITIES = [
    "learning to cook",
    "saving money",
    "studying for exams",
    "running a 5k",
    "learning a new language",
    "staying focused at work",
    "sleeping better",
]
_MATH = [
    "What is {a} times {b}? Explain your steps.",
    "If a train travels {a} km in {b} hours, what is its average speed?",
    "A shop sells apples at {b} dollars each. How much do {a} apples cost?",
    "What is the sum of the numbers from 1 to {a}?",
]
_CHAT = [
    "Hi! How are you today?",
    "Can you recommend a good book for a long flight?",
    "What's a healthy breakfast I can make in five minutes?",
    "I feel stressed about work. Any advice?",
    "Tell me a joke about programmers.",
    "What's the difference between weather and climate?",
    "How do I politely decline an invitation?",
    "What are some fun things to do on a rainy day?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is the capital of Australia, and why isn't it Sydney?",
]


def build_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = [template.format(t=t) for t in _TOPICS for template in rng.sample(_EXPLAIN, 4)]
    code_pairs = list(itertools.product(_TASKS, _LANGUAGES))
    for task, language in rng.sample(code_pairs, 55):
        prompts.append(rng.choice(_CODE).format(l=language, k=task))
    for template in _WRITING:
        for _ in range(6):
            prompts.append(
                template.format(
                    s=rng.choice(_SUBJECTS), e=rng.choice(_EVENTS), a=rng.choice(_ACTIVITIES)
                )
            )
    for template in _MATH:
        for _ in range(4):
            prompts.append(template.format(a=rng.randint(3, 99), b=rng.randint(2, 12)))
    prompts += _CHAT
    unique = list(dict.fromkeys(prompts))
    rng.shuffle(unique)
    return unique


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_prompts.jsonl")
    prompts = build_prompts()
    with open(path, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    print(f"wrote {len(prompts)} prompts to {path}")


if __name__ == "__main__":
    main()
