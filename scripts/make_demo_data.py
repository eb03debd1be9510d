"""Writes roundpipe/train/demo_data/chat.jsonl and chat_eval.jsonl (the demo's self-written
chat set) from question/answer templates, deterministically:

    python scripts/make_demo_data.py roundpipe/train/demo_data
"""

import json
import random
import sys
from pathlib import Path

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"),
    ("Peru", "Lima"),
    ("Russia", "Moscow"),
    ("Poland", "Warsaw"),
    ("Greece", "Athens"),
    ("Sweden", "Stockholm"),
    ("Norway", "Oslo"),
    ("Finland", "Helsinki"),
    ("Ireland", "Dublin"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Thailand", "Bangkok"),
    ("Cuba", "Havana"),
    ("Turkey", "Ankara"),
    ("Australia", "Canberra"),
]
CAPITAL_QUESTIONS = [
    "What is the capital of {x}?",
    "Which city is the capital of {x}?",
    "Name the capital of {x}.",
    "Tell me the capital of {x}.",
    "What's the capital city of {x}?",
]
CAPITAL_ANSWER = "The capital of {x} is {y}."

COLOURS = [
    ("the sky", "blue"),
    ("grass", "green"),
    ("snow", "white"),
    ("coal", "black"),
    ("a banana", "yellow"),
    ("a ripe tomato", "red"),
    ("a carrot", "orange"),
    ("a lemon", "yellow"),
    ("milk", "white"),
    ("a lime", "green"),
    ("a strawberry", "red"),
    ("a crow", "black"),
    ("chocolate", "brown"),
    ("a pumpkin", "orange"),
    ("a plum", "purple"),
    ("a flamingo", "pink"),
    ("a blueberry", "blue"),
    ("an eggplant", "purple"),
]
COLOUR_QUESTIONS = [
    "What colour is {x}?",
    "What color is {x}?",
    "Tell me the colour of {x}.",
    "Which colour is {x}?",
]
COLOUR_ANSWER = "{X} is {y}."

OPPOSITES = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("day", "night"),
    ("open", "closed"),
    ("wet", "dry"),
    ("full", "empty"),
    ("early", "late"),
    ("strong", "weak"),
    ("rich", "poor"),
    ("push", "pull"),
    ("clean", "dirty"),
    ("loud", "quiet"),
    ("near", "far"),
    ("win", "lose"),
    ("summer", "winter"),
]
OPPOSITE_QUESTIONS = [
    "What is the opposite of {x}?",
    "Give me the opposite of {x}.",
    "Tell me the opposite of the word {x}.",
]
OPPOSITE_ANSWER = "The opposite of {x} is {y}."

PLURALS = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("book", "books"),
    ("tree", "trees"),
    ("car", "cars"),
    ("bird", "birds"),
    ("apple", "apples"),
    ("house", "houses"),
    ("chair", "chairs"),
    ("flower", "flowers"),
    ("horse", "horses"),
    ("boat", "boats"),
    ("key", "keys"),
    ("box", "boxes"),
    ("bus", "buses"),
    ("fox", "foxes"),
    ("dish", "dishes"),
    ("baby", "babies"),
    ("city", "cities"),
    ("story", "stories"),
    ("mouse", "mice"),
    ("child", "children"),
    ("foot", "feet"),
    ("tooth", "teeth"),
    ("sheep", "sheep"),
    ("wolf", "wolves"),
]
PLURAL_QUESTIONS = [
    "What is the plural of {x}?",
    "Give me the plural of the word {x}.",
    "How do you say more than one {x}?",
]
PLURAL_ANSWER = "The plural of {x} is {y}."

SOUNDS = [
    ("a cow", "moo"),
    ("a dog", "woof"),
    ("a cat", "meow"),
    ("a duck", "quack"),
    ("a sheep", "baa"),
    ("a pig", "oink"),
    ("a horse", "neigh"),
    ("an owl", "hoot"),
    ("a lion", "roar"),
    ("a snake", "hiss"),
    ("a bee", "buzz"),
    ("a frog", "croak"),
]
SOUND_QUESTIONS = ["What sound does {x} make?", "What does {x} say?", "Which sound does {x} make?"]
SOUND_ANSWER = "{X} says {y}."

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
NEXT_QUESTIONS = [
    "What {unit} comes after {x}?",
    "Which {unit} follows {x}?",
    "What is the {unit} after {x}?",
]
NEXT_ANSWER = "The {unit} after {x} is {y}."

COUNT_QUESTIONS = ["Count from {a} to {b}.", "Please count from {a} to {b}."]

SMALL_TALK = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! How can I help you today?"),
    ("Good morning!", "Good morning! How can I help you today?"),
    ("Thank you!", "You're welcome!"),
    ("Thanks a lot.", "You're welcome!"),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("Bye.", "Goodbye! Have a nice day."),
    ("Who are you?", "I am a tiny demo model trained with RoundPipe."),
    ("What are you?", "I am a tiny demo model trained with RoundPipe."),
    ("How are you?", "I am fine, thank you. How can I help you?"),
    (
        "What can you do?",
        "I can answer simple questions about capitals, colours, opposites, "
        "plurals, animal sounds, days, months and counting.",
    ),
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer in one sentence.",
    "Answer briefly.",
]
NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Iris",
    "Jack",
    "Kate",
    "Leo",
    "Maya",
    "Noah",
    "Olivia",
    "Paul",
    "Rosa",
    "Sam",
    "Tara",
    "Victor",
]
TRAIN_NAMES = 16

# (question, answer) pairs kept out of training: the demo's sample prompts.
FORCED_EVAL = {
    "What is the capital of France?",
    "What is the opposite of hot?",
    "What colour is the sky?",
    "Count from 4 to 8.",
    "What is the plural of dog?",
    "What does a cow say?",
}
HOLD_OUT = 0.08


def _upper_first(text):
    return text[0].upper() + text[1:]


def _pairs(items, questions, answer):
    """(item, question, answer) for every item and question template."""
    out = []
    for x, y in items:
        for q in questions:
            out.append((x, q.format(x=x), answer.format(x=x, X=_upper_first(x), y=y)))
    return out


def question_answers():
    """Every templated (item, question, answer) triple."""
    out = []
    out += _pairs(CAPITALS, CAPITAL_QUESTIONS, CAPITAL_ANSWER)
    out += _pairs(COLOURS, COLOUR_QUESTIONS, COLOUR_ANSWER)
    out += _pairs(OPPOSITES + [(b, a) for a, b in OPPOSITES], OPPOSITE_QUESTIONS, OPPOSITE_ANSWER)
    out += _pairs(PLURALS, PLURAL_QUESTIONS, PLURAL_ANSWER)
    out += _pairs(SOUNDS, SOUND_QUESTIONS, SOUND_ANSWER)
    for unit, names in (("day", DAYS), ("month", MONTHS)):
        following = [(x, names[(i + 1) % len(names)]) for i, x in enumerate(names)]
        questions = [q.replace("{unit}", unit) for q in NEXT_QUESTIONS]
        out += _pairs(following, questions, NEXT_ANSWER.replace("{unit}", unit))
    for a in range(1, 13):
        for length in range(3, 7):
            b = a + length - 1
            answer = ", ".join(str(n) for n in range(a, b + 1)) + "."
            out += [(f"{a} to {b}", q.format(a=a, b=b), answer) for q in COUNT_QUESTIONS]
    return out


def _chat(rng, turns):
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def _name_chat(rng, name):
    opening = rng.choice(["My name is {n}.", "Hi, I am {n}.", "Call me {n}."]).format(n=name)
    question = rng.choice(["What is my name?", "Do you remember my name?"])
    return _chat(
        rng, [(opening, f"Nice to meet you, {name}!"), (question, f"Your name is {name}.")]
    )


def build(seed=0):
    rng = random.Random(seed)
    qa = question_answers()
    # At most one question per item is held out, so every fact is taught.
    held_items = {item for item, q, _ in qa if q in FORCED_EVAL}
    held = [(q, a) for item, q, a in qa if q in FORCED_EVAL]
    for item, q, a in qa:
        if item not in held_items and rng.random() < HOLD_OUT:
            held_items.add(item)
            held.append((q, a))
    held_questions = {q for q, _ in held}
    taught = [(q, a) for _, q, a in qa if q not in held_questions]
    train = [_chat(rng, [x]) for x in taught]
    train += [_chat(rng, [x]) for x in SMALL_TALK * 3]
    train += [_chat(rng, rng.sample(taught, 2)) for _ in range(30)]
    train += [_name_chat(rng, name) for name in NAMES[:TRAIN_NAMES] * 2]
    rng.shuffle(train)
    evaluation = [_chat(rng, [x]) for x in held]
    evaluation += [_name_chat(rng, name) for name in NAMES[TRAIN_NAMES:]]
    return train, evaluation


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    train, evaluation = build()
    for name, rows in (("chat.jsonl", train), ("chat_eval.jsonl", evaluation)):
        with open(out / name, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(name, len(rows), (out / name).stat().st_size)


if __name__ == "__main__":
    main()
