"""The `code-edit` workload: chat prompts that ask the model to change a short piece of code and
give it back whole, so most of the answer repeats the prompt (where speculative decoding by
prompt lookup pays). Snippets x instructions, in a fixed order; ChatML turns, which SmolLM2,
Qwen and many other instruct models use."""

from __future__ import annotations

SNIPPETS = [
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        have = self.items.get(name, 0)
        if count > have:
            raise KeyError(f"only {have} of {name} left")
        self.items[name] = have - count

    def total(self):
        return sum(self.items.values())
''',
    '''def parse_config(lines):
    config = {}
    section = "default"
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        config.setdefault(section, {})[key.strip()] = value.strip()
    return config
''',
    '''def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
''',
    '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[:10]
''',
    '''def merge_intervals(intervals):
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
]

INSTRUCTIONS = [
    "Fix the bug in this code. Reply with the complete corrected code.",
    "Rewrite this code with descriptive variable names. Show the full code.",
    "Add a docstring to this function. Reply with the complete code.",
]

SYSTEM = "You are a careful programming assistant."


def chat(user: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def code_edit_texts(n: int) -> list[str]:
    """n prompts, cycling through snippets and instructions."""
    out = []
    for i in range(n):
        code = SNIPPETS[i % len(SNIPPETS)]
        task = INSTRUCTIONS[(i // len(SNIPPETS)) % len(INSTRUCTIONS)]
        out.append(chat(f"{task}\n\n```python\n{code}```"))
    return out
