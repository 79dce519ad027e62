"""Generator of ``fp_arith_word.jsonl``: short arithmetic word problems with integer answers (offline, seeded).

    python eval/tasks/arith_word.py     # rewrites the packaged jsonl (deterministic)

Templates cover addition, subtraction, multiplication and two-step problems, so accuracy can grow with test-time
compute (loops) for a looped model.
"""

import json
import os
import random

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jana"]
THINGS = ["apples", "books", "coins", "marbles", "pens", "stamps", "shells", "cards"]
TEMPLATES = [
    ("{n} has {a} {t}. {n} finds {b} more. How many {t} does {n} have now?", lambda a, b, c: a + b),
    ("{n} has {a} {t} and gives away {b}. How many {t} are left?", lambda a, b, c: a - b),
    ("{n} buys {a} boxes with {c} {t} in each. How many {t} is that?", lambda a, b, c: a * c),
    ("{n} has {a} {t}, gets {b} more, then loses {c}. How many {t} does {n} have?", lambda a, b, c: a + b - c),
    ("{n} packs {a} {t} into bags of {c} and has {b} left over. How many {t} were there?",
     lambda a, b, c: a * c + b),
]


def arith_word_problems(n: int = 100, seed: int = 0) -> list:
    """``n`` problems as ``{"idx", "question", "answer"}`` (answer a non-negative integer as text)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text, solve = TEMPLATES[i % len(TEMPLATES)]
        a, b, c = rng.randint(10, 60), rng.randint(1, 9), rng.randint(2, 9)
        question = text.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b, c=c)
        rows.append({"idx": i, "question": question, "answer": str(solve(a, b, c))})
    return rows


def write(path: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp_arith_word.jsonl")) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for row in arith_word_problems():
            fh.write(json.dumps(row) + "\n")
    return path


if __name__ == "__main__":
    print(write())
