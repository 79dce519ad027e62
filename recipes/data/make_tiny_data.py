"""Write the small, deterministic default data sets of the FPSA recipes (run from the repo root).

    python -m recipes.data.make_tiny_data

Each folder holds ``train.jsonl`` and ``validation.jsonl`` in the column layout of the Hub data set it stands in
for, so a recipe reads them exactly as it reads the real task: ``glue_sst2_tiny`` (``sentence``, ``label``, ``idx``
as in ``nyu-mll/glue`` sst2), ``glue_mrpc_tiny`` (``sentence1``, ``sentence2``, ``label``, ``idx``) and
``squad_v2_tiny`` (``id``, ``title``, ``context``, ``question``, ``answers`` = {``text``, ``answer_start``} as in
``rajpurkar/squad_v2``; a third of the questions are unanswerable). The sentences are templated, so the tasks are
learnable from a few dozen examples: they exist to run the recipes offline, not to measure a model.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = ["the movie", "this film", "the acting", "the story", "the soundtrack", "the ending", "the script",
            "the cast", "the director's work", "the plot"]
POSITIVE = ["wonderful", "moving", "brilliant", "delightful", "gripping", "charming", "superb", "funny"]
NEGATIVE = ["boring", "dreadful", "clumsy", "tedious", "awful", "lifeless", "confusing", "painful"]
NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Perth", "Dakar", "Bergen"]
JOBS = ["baker", "pilot", "teacher", "chemist", "carpenter", "nurse", "painter", "lawyer"]
THINGS = ["a bicycle", "a piano", "a lamp", "a boat", "a camera", "a tent"]


def sst2(rng, n):
    rows = []
    for i in range(n):
        label = i % 2
        adj = rng.choice(POSITIVE if label else NEGATIVE)
        rows.append({"sentence": f"{rng.choice(SUBJECTS)} is {adj} .", "label": label, "idx": i})
    return rows


def mrpc(rng, n):
    rows = []
    for i in range(n):
        a, b = rng.sample(NAMES, 2)
        thing, other = rng.sample(THINGS, 2)
        first = f"{a} bought {thing} from {b} on Monday."
        label = i % 2
        second = f"On Monday, {b} sold {thing} to {a}." if label else f"On Monday, {b} sold {other} to {a}."
        rows.append({"sentence1": first, "sentence2": second, "label": label, "idx": i})
    return rows


def squad_v2(rng, n, prefix):
    rows = []
    for i in range(n):
        name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
        year = rng.randint(1950, 2000)
        context = f"{name} was born in {city} in {year}. Later {name} worked as a {job} for many years."
        kind = i % 3
        if kind == 0:
            question, answer = f"Where was {name} born?", city
        elif kind == 1:
            question, answer = f"What did {name} work as?", job
        else:
            question, answer = f"Which {rng.choice(['car', 'dog', 'song'])} did {name} like?", None
        answers = {"text": [answer], "answer_start": [context.index(answer)]} if answer else \
            {"text": [], "answer_start": []}
        rows.append({"id": f"{prefix}{i}", "title": name, "context": context, "question": question,
                     "answers": answers})
    return rows


def write(folder, train, validation):
    (HERE / folder).mkdir(exist_ok=True)
    for split, rows in (("train", train), ("validation", validation)):
        with open(HERE / folder / f"{split}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


def main():
    rng = random.Random(0)
    write("glue_sst2_tiny", sst2(rng, 64), sst2(rng, 32))
    write("glue_mrpc_tiny", mrpc(rng, 64), mrpc(rng, 32))
    write("squad_v2_tiny", squad_v2(rng, 96, "train-"), squad_v2(rng, 30, "val-"))


if __name__ == "__main__":
    main()
