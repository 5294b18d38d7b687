"""Writes the speculative-decoding workloads, ShareGPT layout (`kvserve bench serve
--dataset-name sharegpt --dataset-path ...`):

- editing.jsonl: rewrite-with-small-changes requests. Each gives a passage (prose or code)
  and one small edit; the gpt turn is the passage with the edit applied, so the answer's
  length sets max_tokens and most of the answer repeats the prompt: the workload where
  n-gram speculation pays.
- agent.jsonl: an agent loop. Each of two files (four of the code passages below joined,
  about 300 tokens) goes through three turns; turn t shows the file as turn t - 1 left it
  (its previous output) and asks for the whole file back with one more rename applied. The
  gpt turn is that file, so the reply copies the prompt (and the previous turn's reply)
  but for the renamed spots: the workload of suffix decoding.
- json.jsonl: requests for a JSON inventory, run under JSON_SCHEMA (run.py passes it as
  response_format): keys and structure repeat from item to item.
- chat.jsonl: plain chat questions (kvserve.benchmarks.datasets.CHAT_QUESTIONS, none of
  them in the draft heads' training prompts); run with --sharegpt-output-len.

Deterministic (no randomness):

    python bench/spec_decode/make_datasets.py
"""

from __future__ import annotations

import json
import os

from kvserve.benchmarks.datasets import CHAT_QUESTIONS

PASSAGES = [
    (
        "The library opens at nine in the morning and closes at six in the evening. "
        "Visitors may borrow up to five books at a time, and each loan lasts three weeks. "
        "Late returns cost ten cents per day, and lost books must be replaced.",
        [("five books", "eight books"), ("three weeks", "two weeks"), ("ten cents", "a quarter")],
    ),
    (
        "Our team meets every Monday at ten to review the week's goals. Each member shares "
        "what they finished, what they plan next, and what blocks them. The meeting should "
        "never last more than thirty minutes.",
        [("Monday", "Tuesday"), ("thirty minutes", "twenty minutes"), ("ten", "eleven")],
    ),
    (
        "To bake the bread, mix the flour, water, salt and yeast in a large bowl. Knead the "
        "dough for ten minutes, then let it rise for one hour in a warm place. Bake it at "
        "two hundred degrees for forty minutes.",
        [("one hour", "two hours"), ("forty minutes", "thirty-five minutes"), ("salt", "sugar")],
    ),
    (
        "The river flows north through the valley, past the old mill and the stone bridge. "
        "In spring the water rises and floods the low fields, and in summer children swim "
        "near the bridge where the current is slow.",
        [("north", "south"), ("old mill", "red barn"), ("children", "fishermen")],
    ),
    (
        "Please send the report to the finance team by Friday. Include the quarterly totals, "
        "the list of open invoices, and a short summary of the changes since last quarter. "
        "Contact Maria if any figures are missing.",
        [("Friday", "Thursday"), ("Maria", "David"), ("finance team", "board")],
    ),
    (
        "def total_price(items, tax_rate):\n"
        "    subtotal = 0\n"
        "    for item in items:\n"
        "        subtotal += item.price * item.quantity\n"
        "    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n",
        [("subtotal", "net"), ("tax_rate", "rate"), ("total_price", "order_total")],
    ),
    (
        "def count_words(text):\n"
        "    counts = {}\n"
        "    for word in text.split():\n"
        "        word = word.lower()\n"
        "        counts[word] = counts.get(word, 0) + 1\n"
        "    return counts\n",
        [("counts", "freq"), ("word", "token"), ("count_words", "word_histogram")],
    ),
    (
        "class Stack:\n"
        "    def __init__(self):\n"
        "        self.items = []\n"
        "\n"
        "    def push(self, item):\n"
        "        self.items.append(item)\n"
        "\n"
        "    def pop(self):\n"
        "        return self.items.pop()\n",
        [("items", "elements"), ("Stack", "LifoQueue"), ("item", "value")],
    ),
    (
        "for i in range(10):\n"
        "    if i % 2 == 0:\n"
        "        print(i, 'is even')\n"
        "    else:\n"
        "        print(i, 'is odd')\n",
        [("range(10)", "range(20)"), ("i", "n"), ("'is even'", "'even'")],
    ),
    (
        "SELECT name, email, created_at\n"
        "FROM users\n"
        "WHERE active = 1\n"
        "ORDER BY created_at DESC\n"
        "LIMIT 50;\n",
        [("users", "customers"), ("LIMIT 50", "LIMIT 100"), ("DESC", "ASC")],
    ),
]


# What the json workload's replies must match (run.py sends it as response_format).
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "unit": {"type": "string"},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["name", "quantity", "unit", "in_stock"],
            },
        }
    },
    "required": ["items"],
}
STORES = ["bakery", "hardware store", "pharmacy", "bookshop", "garden centre", "fish market"]


def agent_entries() -> list[dict]:
    """Two files, three turns each: every turn's file is the previous turn's reply."""
    code = [p for p in PASSAGES if p[0].startswith(("def ", "class ", "for ", "SELECT"))]
    entries = []
    for files in (code[:4], code[1:] + code[:1]):
        text = "\n".join(passage for passage, _ in files)
        for old, new in (files[0][1][0], files[1][1][0], files[2][1][1]):
            prompt = (
                "You are a coding agent. Here is the current file:\n\n"
                f"{text}\n\nApply this change: rename '{old}' to '{new}' everywhere. Output "
                "the whole updated file and nothing else."
            )
            text = text.replace(old, new)
            entries.append(_pair(prompt, text))
    return entries


def json_entries() -> list[dict]:
    placeholder = "An inventory of some length, long enough for the dataset's minimum. " * 2
    return [
        _pair(
            f"List eight products of a {store} as JSON: name, quantity, unit and whether it is "
            "in stock.",
            placeholder,
        )
        for store in STORES
    ]


def _pair(prompt: str, reply: str) -> dict:
    return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def main() -> None:
    _write("agent.jsonl", agent_entries())
    _write("json.jsonl", json_entries())
    entries = []
    for passage, edits in PASSAGES:
        for old, new in edits:
            prompt = (
                f"Rewrite the following text exactly, but replace every '{old}' with '{new}'. "
                f"Output only the rewritten text.\n\n{passage}"
            )
            entries.append(
                {
                    "conversations": [
                        {"from": "human", "value": prompt},
                        {"from": "gpt", "value": passage.replace(old, new)},
                    ]
                }
            )
    _write("editing.jsonl", entries)
    placeholder = "An answer of some length, long enough for the dataset's minimum. " * 2
    _write(
        "chat.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": q},
                    {"from": "gpt", "value": placeholder},
                ]
            }
            for q in CHAT_QUESTIONS
        ],
    )


def _write(name: str, entries: list[dict]) -> None:
    path = os.path.join(os.path.dirname(__file__), name)
    with open(path, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    print(f"wrote {len(entries)} requests to {path}")


if __name__ == "__main__":
    main()
