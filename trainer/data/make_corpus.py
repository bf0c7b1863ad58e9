"""Regenerates corpus.txt: plain English prose from a small hand-written grammar.

The text is produced by this script alone (no third-party text), so it is free of any copyright.
Run `python trainer/data/make_corpus.py` to rebuild it byte for byte (seeded).
"""
from __future__ import annotations

import random
from pathlib import Path

PEOPLE = ["the miller", "the old fisherman", "a young shepherd", "the baker's daughter", "the ferryman",
          "a traveller from the north", "the schoolmistress", "the blacksmith", "a weaver", "the lamplighter",
          "the innkeeper", "a clockmaker", "the harbour master", "two sisters", "the gardener"]
NAMES = ["Anna", "Tomas", "Elin", "Marek", "Ruth", "Oskar", "Mira", "Jon", "Hedda", "Pavel", "Ilse", "Bram"]
PLACES = ["the village", "the harbour", "the mill by the river", "the high meadow", "the market square",
          "the lighthouse", "the old bridge", "the forest road", "the orchard", "the chapel on the hill",
          "the salt marsh", "the quiet lane"]
TIMES = ["At dawn", "In the evening", "Late that night", "On the first morning of spring", "Before the rain came",
         "When the bells rang noon", "In the middle of winter", "Long after supper", "At first light",
         "On market day", "When the tide turned", "Some years later"]
VERBS = ["walked to", "looked across", "came back from", "waited near", "sang softly in", "wandered through",
         "hurried toward", "rested beside", "swept the floor of", "told stories about"]
OBJECTS = ["a lantern", "a basket of apples", "a letter sealed with wax", "a small brass key", "a loaf of bread",
           "an old map", "a wooden flute", "a bundle of wool", "a cup of tea", "a pair of boots", "a blue scarf"]
FEELINGS = ["glad", "tired", "curious", "afraid", "calm", "restless", "hopeful", "sorry", "proud", "puzzled"]
WEATHER = ["The wind rose over the water.", "Snow fell without a sound.", "The sky was clear and cold.",
           "A warm rain drummed on the roofs.", "Fog lay thick along the shore.", "The sun burned through the mist.",
           "Thunder rolled far away in the hills.", "The stars came out one by one."]
SAYINGS = ["Nothing is lost that is written down twice.", "Every road comes home in the end.",
           "A patient hand mends the finest net.", "Save your work before the storm.",
           "The river remembers what the rain forgets.", "Count the steps and you will find the way back.",
           "Light the lamp before it is dark.", "Small stitches hold the longest seam."]


def sentence(r: random.Random) -> str:
    kind = r.randrange(7)
    if kind == 0:
        return f"{r.choice(TIMES)}, {r.choice(PEOPLE)} {r.choice(VERBS)} {r.choice(PLACES)}."
    if kind == 1:
        return r.choice(WEATHER)
    if kind == 2:
        n = r.choice(NAMES)
        return f"{n} carried {r.choice(OBJECTS)} to {r.choice(PLACES)} and felt {r.choice(FEELINGS)}."
    if kind == 3:
        a, b = r.sample(NAMES, 2)
        return f'"{r.choice(SAYINGS)}" said {a} to {b}.'
    if kind == 4:
        return (f"Nobody in {r.choice(PLACES)} knew why {r.choice(PEOPLE)} kept {r.choice(OBJECTS)} "
                f"on the windowsill.")
    if kind == 5:
        return f"{r.choice(NAMES)} counted {r.randint(2, 12)} boats and {r.randint(2, 30)} gulls before going home."
    return f"It was {r.choice(FEELINGS)} work, but {r.choice(PEOPLE)} did not stop until it was done."


def corpus(seed: int = 1234, size: int = 160_000) -> str:
    r = random.Random(seed)
    out, total, chapter = [], 0, 1
    while total < size:
        if r.random() < 0.08:
            para = f"\nCHAPTER {chapter}\n"
            chapter += 1
        else:
            para = " ".join(sentence(r) for _ in range(r.randint(2, 6))) + "\n"
        out.append(para)
        total += len(para)
    return "".join(out)


if __name__ == "__main__":
    Path(__file__).with_name("corpus.txt").write_text(corpus(), encoding="utf-8")
