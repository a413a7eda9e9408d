"""The input-grounded workload (issue 11): requests whose answer copies from their prompt.

Each request is a chat turn asking the model to repeat, correct or reformat a passage given
in the prompt (greedy, stopping at the model's EOS): the case n-gram speculation serves, as
in summaries, edits, refactors and RAG answers. Passages are seeded draws of sentences below.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from conveyor.sampling_params import SamplingParams

_SENTENCES = [
    "The lighthouse stands on a rock at the mouth of the bay.",
    "Every evening the keeper climbs ninety steps to light the lamp.",
    "Ships coming home from the north use its beam to find the channel.",
    "In winter the storms throw spray as high as the gallery.",
    "The old keeper kept a logbook of every ship that passed.",
    "Her daughter still reads it on quiet nights by the stove.",
    "The town below has a harbour, a market and a small school.",
    "Fishermen sell their catch on the quay before sunrise.",
    "A ferry crosses to the island twice a day in summer.",
    "The river that feeds the bay rises in the hills to the east.",
    "Its water is cold and clear, and salmon swim up it in autumn.",
    "The railway reached the town in the last years of the century.",
    "Since then visitors have come every summer for the beaches.",
    "The museum keeps the first lens of the lighthouse in a glass case.",
    "It weighs more than a ton and floated on a bath of mercury.",
    "Children from the school visit it once a year with their teacher.",
]

_TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Correct the spelling mistakes in the following passage and write it out in full:"
    "\n\n{passage}",
    "Rewrite the following passage as a bulleted list, one sentence per bullet, keeping "
    "the words:\n\n{passage}",
]


def _typos(text: str, rng: random.Random) -> str:
    """Swap two letters in about one word in six."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 4 and rng.random() < 1 / 6:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


@dataclass(frozen=True)
class GroundedWorkload:
    num_requests: int = 64
    sentences: tuple[int, int] = (3, 6)  # passage length, in sentences
    max_tokens: int = 256
    seed: int = 0

    def prompts(self, llm: Any) -> list[tuple[list[int], SamplingParams]]:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("the grounded workload needs a model with a tokenizer")
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_requests):
            passage = " ".join(rng.sample(_SENTENCES, rng.randint(*self.sentences)))
            task = _TASKS[i % len(_TASKS)]
            if "spelling" in task:
                passage = _typos(passage, rng)
            messages = [{"role": "user", "content": task.format(passage=passage)}]
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
            out.append((ids, SamplingParams(temperature=0, max_tokens=self.max_tokens)))
        return out
