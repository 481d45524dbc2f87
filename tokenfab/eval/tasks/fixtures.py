"""Hand-made items in the GSM8K and MMLU-Pro published layouts, for tests and for smoke runs where the real data
sets are not available (no hub is reachable here and no PyPI package ships them). They are NOT the benchmarks:
scores on them say that the pipeline works, not how good a model is. :func:`write_fixtures` writes them as
``gsm8k/{train,test}.jsonl`` and ``mmlu_pro/{validation,test}.jsonl`` under a folder usable as ``--data-dir``.
"""
from __future__ import annotations

import json
import os

GSM8K_TRAIN = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have now?",
     "Tom starts with 3 apples and buys 4 more, so he has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"),
    ("A box holds 6 pencils. How many pencils are in 5 boxes?",
     "Each box holds 6 pencils, so 5 boxes hold 5 * 6 = <<5*6=30>>30 pencils.\n#### 30"),
    ("Sara had 20 dollars and spent 8 dollars on lunch. How much money does she have left?",
     "Sara has 20 - 8 = <<20-8=12>>12 dollars left.\n#### 12"),
    ("There are 24 students split equally into 4 groups. How many students are in each group?",
     "Each group has 24 / 4 = <<24/4=6>>6 students.\n#### 6"),
    ("A shirt costs 15 dollars and a hat costs 9 dollars. How much do 2 shirts and 1 hat cost?",
     "Two shirts cost 2 * 15 = <<2*15=30>>30 dollars. With the hat the total is 30 + 9 = <<30+9=39>>39 dollars."
     "\n#### 39"),
]
GSM8K_TEST = [
    ("Anna has 5 books and gets 2 more. How many books does she have?",
     "Anna has 5 + 2 = <<5+2=7>>7 books.\n#### 7"),
    ("A bag has 10 candies. Ben eats 3 of them. How many candies are left?",
     "10 - 3 = <<10-3=7>>7 candies are left.\n#### 7"),
    ("Each car has 4 wheels. How many wheels do 3 cars have?",
     "3 cars have 3 * 4 = <<3*4=12>>12 wheels.\n#### 12"),
    ("A farmer has 1,200 eggs and sells 200 of them. How many eggs does he have left?",
     "He has 1200 - 200 = <<1200-200=1000>>1,000 eggs left.\n#### 1,000"),
    ("Lily reads 9 pages a day. How many pages does she read in 2 days?",
     "She reads 9 * 2 = <<9*2=18>>18 pages.\n#### 18"),
    ("A pizza has 8 slices. If 2 friends share it equally, how many slices does each get?",
     "Each friend gets 8 / 2 = <<8/2=4>>4 slices.\n#### 4"),
]
_OPTS_EVEN = ["2", "4", "6", "8", "10", "12", "14", "16", "18", "20"]
MMLU_PRO_VALIDATION = [
    {"question": "What is 2 + 3?", "options": ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10"], "answer": "E",
     "answer_index": 4, "category": "math",
     "cot_content": "A: Let's think step by step. 2 + 3 = 5, which is option E. The answer is (E)."},
    {"question": "What is 10 minus 4?", "options": ["3", "4", "5", "6", "7", "8", "9", "10", "11", "12"],
     "answer": "D", "answer_index": 3, "category": "math",
     "cot_content": "A: Let's think step by step. 10 - 4 = 6, which is option D. The answer is (D)."},
    {"question": "Which gas do plants take in for photosynthesis?",
     "options": ["oxygen", "nitrogen", "carbon dioxide", "helium", "argon", "neon", "hydrogen", "methane",
                 "ozone", "xenon"], "answer": "C", "answer_index": 2, "category": "biology",
     "cot_content": "A: Let's think step by step. Plants take in carbon dioxide and release oxygen. The answer is "
                    "(C)."},
    {"question": "Which organ pumps blood through the body?",
     "options": ["lung", "liver", "kidney", "stomach", "heart", "brain", "skin", "bone", "muscle", "eye"],
     "answer": "E", "answer_index": 4, "category": "biology",
     "cot_content": "A: Let's think step by step. The heart pumps blood. The answer is (E)."},
]
MMLU_PRO_TEST = [
    {"question": "What is 3 + 4?", "options": ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10"], "answer": "G",
     "answer_index": 6, "category": "math"},
    {"question": "What is 2 times 5?", "options": ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10"],
     "answer": "J", "answer_index": 9, "category": "math"},
    {"question": "What is 9 minus 7?", "options": _OPTS_EVEN, "answer": "A", "answer_index": 0, "category": "math"},
    {"question": "Which part of the plant absorbs water from the soil?",
     "options": ["leaf", "flower", "root", "seed", "fruit", "bark", "petal", "thorn", "pollen", "bud"],
     "answer": "C", "answer_index": 2, "category": "biology"},
    {"question": "What do bees collect from flowers to make honey?",
     "options": ["sand", "nectar", "water", "leaves", "stones", "seeds", "roots", "bark", "salt", "wax"],
     "answer": "B", "answer_index": 1, "category": "biology"},
    {"question": "How many legs does a spider have?", "options": _OPTS_EVEN, "answer": "D", "answer_index": 3,
     "category": "biology"},
]


def write_fixtures(root: str) -> str:
    """Write the hand-made items under ``root`` in the published layouts; returns ``root`` (a --data-dir)."""
    os.makedirs(os.path.join(root, "gsm8k"), exist_ok=True)
    os.makedirs(os.path.join(root, "mmlu_pro"), exist_ok=True)
    for name, items in (("train", GSM8K_TRAIN), ("test", GSM8K_TEST)):
        with open(os.path.join(root, "gsm8k", f"{name}.jsonl"), "w") as f:
            for q, a in items:
                f.write(json.dumps({"question": q, "answer": a}) + "\n")
    for name, items in (("validation", MMLU_PRO_VALIDATION), ("test", MMLU_PRO_TEST)):
        with open(os.path.join(root, "mmlu_pro", f"{name}.jsonl"), "w") as f:
            for i, r in enumerate(items):
                f.write(json.dumps({"question_id": i, **r, "cot_content": r.get("cot_content", ""),
                                    "src": "hand-made"}) + "\n")
    return root
