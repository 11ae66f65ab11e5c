"""The benchmark workloads: four seeded, procedural generators shipped with radixserve, and workload files.

Every generator is a pure function of its parameters: the same ``(name, seed, sizes)`` gives byte-identical
requests on any machine, with no downloads. Each one exercises one way requests share a prefix:

==========  ===========================================================================================
fewshot     one shared block of ``examples`` question/answer pairs (~1,000 tokens for 30) followed by
            ``questions`` distinct questions (~25 tokens each); ``/v1/completions``, greedy,
            ``max_tokens`` 16. Independent requests: all may be in flight at once.
multiturn   ``sessions`` chats of ``turns`` user turns (~50 tokens each) under one short system prompt;
            every turn re-sends the whole history including the model's earlier answers; greedy,
            ``max_tokens`` 32.
parallel    ``prompts`` story prompts (~110 tokens with the chat template), each sampled ``n`` times in one
            request (``n`` 8, temperature 0.8, top_p 1, seed 1000 + i), ``max_tokens`` 32.
agent       ``agents`` tool-using agents of ``steps`` steps sharing one ~660-token system prompt that
            describes the tools; each agent has its own task, and every step after the first appends
            the model's previous answer and a tool result (~50-140 tokens); greedy, ``max_tokens`` 32.
==========  ===========================================================================================

Sizes are measured in SmolLM2's tokenizer; tests/bench/test_workloads.py pins the structure.

A workload is a dict (what the client in ``client.py`` runs)::

    {"name": str, "kind": "independent" | "sessions", "description": str, "params": {...},
     "source": str,                      # where the requests came from (a generator or a file name)
     "requests": [Request, ...]}         # kind "independent"
     "sessions": [Session, ...]}         # kind "sessions": the steps of one session run in order

    Request = {"id": str, "endpoint": "completions" | "chat", "body": {...}}
        body: an OpenAI request body without model/stream: {"prompt": str, ...} for /v1/completions or
        {"messages": [...], ...} for /v1/chat/completions, with max_tokens, temperature and optionally
        n, seed, top_p (any other OpenAI field passes through).
    Session = {"id": str, "endpoint": "chat", "messages": [initial messages], "steps": [Step, ...]}
    Step    = {"append": [messages added before this request], "body": {max_tokens, temperature, ...}}
        The client sends history + append; once the answer arrives it appends
        {"role": "assistant", "content": answer} to the history and goes on with the next step.

Workload files (JSON / JSONL, ``--workload-file``) are read and written by ``workload_files.py``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

from runtime.bench import workload_words as vocab

SOURCE = "runtime/bench/workloads.py"

# --quick: small enough that the slowest system (transformers, sequential) finishes each in about a minute.
QUICK_PARAMS: dict[str, dict[str, Any]] = {
    "fewshot": {"questions": 8},
    "multiturn": {"sessions": 2},
    "parallel": {"prompts": 2},
    "agent": {"agents": 2},
}

# ---------------------------------------------------------------------------------------------- fewshot
FEWSHOT_HEADER = (
    "Each question below about an everyday situation is followed by a short, correct answer. "
    "Answer the last question in the same style.\n\n"
)


def _question(rng: random.Random) -> tuple[str, str]:
    """One question and its correct one-sentence answer (eight kinds of arithmetic and reading)."""
    kind = rng.randrange(8)
    p1, p2, p3 = rng.sample(vocab.PEOPLE, 3)
    town = rng.choice(vocab.TOWNS)
    if kind == 0:
        shop, goods = rng.choice(vocab.SHOPS), rng.choice(vocab.GOODS)
        a, b = rng.randint(5, 60), rng.randint(3, 40)
        return (f"The {shop} in {town} had {a} {goods} and received {b} more. How many does it have now?",
                f"It has {a + b}.")
    if kind == 1:
        return (f"{p1} finished ahead of {p2}, and {p2} ahead of {p3}. Who finished last?",
                f"{p3} finished last.")
    if kind == 2:
        goods, box = rng.choice(vocab.GOODS), rng.choice(vocab.CONTAINERS)
        a, b = rng.randint(3, 12), rng.randint(2, 9)
        return (f"A {box} holds {a} {goods}. How many {goods} are in {b} {box}s?",
                f"There are {a * b}.")
    if kind == 3:
        event, m, k = rng.choice(vocab.EVENTS), rng.randrange(12), rng.randint(1, 5)
        return (f"The {event} in {town} is in {vocab.MONTHS[m]}; the next one is {k} months later. "
                "Which month is that?",
                f"It is in {vocab.MONTHS[(m + k) % 12]}.")
    if kind == 4:
        things, room, x = rng.choice(vocab.THINGS), rng.choice(vocab.ROOMS), rng.randint(11, 99)
        return (f"{p1} counted {x} {things} in the {room}. Is {x} even or odd?",
                f"{x} is {'even' if x % 2 == 0 else 'odd'}.")
    if kind == 5:
        word, opposite = rng.choice(vocab.OPPOSITES)
        noun = rng.choice(vocab.OPPOSITE_NOUNS)
        return (f"In \"the {noun} was {word}\", what is the opposite of {word}?",
                f"The opposite of {word} is {opposite}.")
    if kind == 6:
        vehicle, h, d = rng.choice(vocab.VEHICLES), rng.randint(5, 15), rng.randint(2, 8)
        return (f"The {vehicle} leaves {town} at {h}:00 for a {d}-hour trip. When does it arrive?",
                f"It arrives at {h + d}:00.")
    a = rng.randint(20, 90)
    b = rng.randint(3, a - 5)
    item = rng.choice(["a train ticket", "a new lamp", "lunch", "a birthday present", "two books"])
    return (f"{p1} had {a} euros and spent {b} on {item}. How many euros are left?",
            f"{a - b} euros are left.")


def fewshot(seed: int = 0, questions: int = 64, examples: int = 30, max_tokens: int = 16) -> dict[str, Any]:
    rng = vocab.seeded_rng("fewshot", seed)
    shots = [f"Question: {q}\nAnswer: {a}\n\n" for q, a in (_question(rng) for _ in range(examples))]
    prefix = FEWSHOT_HEADER + "".join(shots)
    requests = []
    for i in range(questions):
        q, _ = _question(rng)
        requests.append({"id": f"fewshot-{i:03d}", "endpoint": "completions",
                         "body": {"prompt": f"{prefix}Question: {q}\nAnswer:", "max_tokens": max_tokens,
                                  "temperature": 0.0}})
    return {"name": "fewshot", "kind": "independent", "source": SOURCE,
            "description": f"{examples}-example shared few-shot block + {questions} questions, "
                           f"max_tokens {max_tokens}",
            "params": {"seed": seed, "questions": questions, "examples": examples, "max_tokens": max_tokens},
            "shared_prefix_chars": len(prefix), "requests": requests}


# ---------------------------------------------------------------------------------------------- multiturn
CHAT_SYSTEM = ("You are a patient and practical assistant. Reply in a few clear sentences with concrete steps, "
               "and ask one short question back when you need more detail.")
# (what the session is about, the aspects its later turns ask about)
CHAT_TOPICS = [
    ("repainting the walls of my small {room}", ["choosing a colour", "preparing the walls", "the ceiling",
                                                  "cleaning the brushes"]),
    ("learning to play the piano as an adult", ["finding a teacher", "practice routines", "reading music",
                                                "sore wrists"]),
    ("building a simple bookshelf from pine boards", ["the wood", "the screws", "sanding", "varnish"]),
    ("keeping chickens in a back garden in {town}", ["the coop", "feeding", "winter", "the neighbours"]),
    ("getting ready for an interview as a {job}", ["my CV", "difficult questions", "nerves",
                                                   "following up afterwards"]),
    ("cooking dinner for ten guests", ["the menu", "a vegetarian guest", "timing the dishes", "dessert"]),
    ("switching my phone plan to a cheaper one", ["my contract", "coverage in {town}", "keeping my number",
                                                  "data limits"]),
    ("planning a cycling holiday along the coast", ["the route", "luggage", "where to sleep",
                                                    "repairing a puncture"]),
    ("teaching my {k}-year-old nephew to swim", ["the first lesson", "fear of water", "floating",
                                                 "safety rules"]),
    ("organising my late grandmother's old letters", ["sorting them", "damaged paper", "scanning",
                                                      "sharing them with family"]),
]
CHAT_CONTEXT = [
    "My neighbour {person} tried this last {season} and gave up.",
    "I only have about {k} free evenings a week.",
    "Money is tight this month, so cheap options are best.",
    "It has been {weather} in {town} for weeks now.",
    "My brother, a {job}, says I am overthinking it.",
    "I have never done anything like this before.",
    "A video made it look quick, but I doubt that.",
    "I would rather not buy any special equipment.",
    "I hope to see some progress within {k} weeks.",
    "I give up easily when things get complicated.",
]
CHAT_FOLLOW_UPS = [
    "Thanks, that helps. What about {aspect}?",
    "I see. Could you say more about {aspect}?",
    "Sounds doable. I am unsure about {aspect}, though.",
    "Makes sense. How should I handle {aspect}?",
]


def _chat_turn(rng: random.Random, topic: str, aspect: str | None) -> str:
    context = " ".join(vocab.fill(rng, s) for s in rng.sample(CHAT_CONTEXT, 3))
    if aspect is None:
        return f"Hello! I would like some advice on {topic}. {context} What should I do first?"
    return f"{rng.choice(CHAT_FOLLOW_UPS).format(aspect=aspect)} {context}"


def multiturn(seed: int = 0, sessions: int = 8, turns: int = 4, max_tokens: int = 32) -> dict[str, Any]:
    rng = vocab.seeded_rng("multiturn", seed)
    out = []
    for s in range(sessions):
        topic_template, aspects = CHAT_TOPICS[(s + seed) % len(CHAT_TOPICS)]
        topic = vocab.fill(rng, topic_template)
        steps = []
        for t in range(turns):
            aspect = None if t == 0 else vocab.fill(rng, aspects[(t - 1) % len(aspects)])
            steps.append({"append": [{"role": "user", "content": _chat_turn(rng, topic, aspect)}],
                          "body": {"max_tokens": max_tokens, "temperature": 0.0}})
        out.append({"id": f"multiturn-{s:02d}", "endpoint": "chat",
                    "messages": [{"role": "system", "content": CHAT_SYSTEM}], "steps": steps})
    return {"name": "multiturn", "kind": "sessions", "source": SOURCE,
            "description": f"{sessions} sessions x {turns} turns, history re-sent every turn, max_tokens {max_tokens}",
            "params": {"seed": seed, "sessions": sessions, "turns": turns, "max_tokens": max_tokens},
            "sessions": out}


# ---------------------------------------------------------------------------------------------- parallel
STORY_SYSTEM = ("You write short fiction. Use concrete sensory detail, keep one steady voice, and output only "
                "the story text itself, with no title, notes or commentary.")
STORY_SITUATIONS = [
    "has just found a stranger's diary on the last {vehicle} home",
    "must deliver a sealed letter before midnight",
    "wakes up to find every clock in {town} has stopped",
    "is asked to keep a secret that could ruin a friend",
    "returns to {town} for the first time in twenty years",
    "accidentally wins a contest nobody remembers entering",
    "discovers a locked door in a house they have lived in for years",
    "has one day to find a missing {things_one}",
]
STORY_DETAILS = [
    "It is a {weather} {weekday} evening in {town}.",
    "{person} has not called in {k} months.",
    "The only light comes from the {shop} across the street.",
    "A radio nearby plays a song from long ago.",
    "Everyone in the {room} is watching in silence.",
    "The air smells of rain and something sweet.",
]


def parallel(seed: int = 0, prompts: int = 8, n: int = 8, max_tokens: int = 32,
             temperature: float = 0.8) -> dict[str, Any]:
    rng = vocab.seeded_rng("parallel", seed)
    requests = []
    for i in range(prompts):
        name, trait, job = rng.choice(vocab.PEOPLE), rng.choice(vocab.TRAITS), rng.choice(vocab.JOBS)
        situation = rng.choice(STORY_SITUATIONS).format(
            vehicle=rng.choice(vocab.VEHICLES), town=rng.choice(vocab.TOWNS), things_one=rng.choice(
                ["wedding ring", "violin", "cat", "passport", "prototype", "painting"]))
        details = " ".join(vocab.fill(rng, d) for d in rng.sample(STORY_DETAILS, 3))
        user = (f"Write the opening paragraph of a story about {name}, a {trait} {job} who {situation}. "
                f"{details} Start with dialogue.")
        requests.append({"id": f"parallel-{i:02d}", "endpoint": "chat",
                         "body": {"messages": [{"role": "system", "content": STORY_SYSTEM},
                                               {"role": "user", "content": user}],
                                  "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "n": n,
                                  "seed": 1000 + i}})
    return {"name": "parallel", "kind": "independent", "source": SOURCE,
            "description": f"{prompts} prompts x n={n} samples at T={temperature}, max_tokens {max_tokens}",
            "params": {"seed": seed, "prompts": prompts, "n": n, "max_tokens": max_tokens,
                       "temperature": temperature},
            "requests": requests}


# ---------------------------------------------------------------------------------------------- agent
# (name, what it does, [(argument, type, meaning)])
AGENT_TOOLS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("web_search", "Search the internet and return up to ten results with titles, addresses and summaries.",
     [("query", "string", "what to search for"),
      ("count", "integer", "the number of results wanted, between 1 and 10")]),
    ("open_page", "Download a web page and return its readable text without markup.",
     [("url", "string", "the full address of the page, starting with https://")]),
    ("list_files", "List the files and folders in a directory of the workspace with their sizes.",
     [("directory", "string", "a path relative to the workspace root")]),
    ("read_text", "Return the text content of a file in the workspace, or an error if it is not text.",
     [("path", "string", "a path relative to the workspace root")]),
    ("save_text", "Create or overwrite a file in the workspace with the given text.",
     [("path", "string", "a path relative to the workspace root"),
      ("text", "string", "the complete new content of the file")]),
    ("python", "Run a Python 3 program in a sandbox without network access and return its output or error.",
     [("source", "string", "the program to execute"),
      ("seconds", "integer", "the time limit, at most 60")]),
    ("sql", "Run a read-only query against the shop's orders database and return the matching rows.",
     [("query", "string", "one SELECT statement"),
      ("max_rows", "integer", "the most rows to return")]),
    ("forecast", "Return the weather now and for the next three days in a town.",
     [("town", "string", "the town name"),
      ("unit", "string", "celsius or fahrenheit")]),
    ("agenda", "Return the user's appointments between two dates, one per line.",
     [("from_date", "string", "the first date, written YYYY-MM-DD"),
      ("to_date", "string", "the last date, written YYYY-MM-DD")]),
    ("message", "Send a short message to one of the user's contacts.",
     [("contact", "string", "the contact's name"),
      ("text", "string", "the message itself")]),
]
AGENT_TASKS = [
    "Check whether it will be {weather} in {town} on {weekday} and message {person} a one-line summary.",
    "Count the lines that mention {goods} in notes/{job}.txt and save the count in count.txt.",
    "Find last month's three best-selling products in the orders database and compare them with May.",
    "Look through my agenda for next week and suggest a free morning to meet {person}.",
    "Search for a cheap {shop} near {town} station and save its address in places.txt.",
    "Work out the price of {k} boxes of {goods} at 7.40 each plus 21 percent tax.",
    "Open the {town} museum page and tell me its opening hours on {weekday}.",
    "Write and run a Python program that prints the average of the numbers in data/sizes.txt.",
]


def agent_system_prompt() -> str:
    lines = [
        "You are an assistant that completes the user's task step by step by using tools. In every turn you "
        "either call one tool or give the final answer, never both. A tool call is a single line:",
        'TOOL <name> {"argument": "value", ...}',
        "and nothing else. The next message then holds the "
        "output of the tool, introduced by the word OUTPUT. When the task is done, reply with a line that "
        "begins with DONE: and a short summary for the user. Choose the most useful tool for each step, "
        "never make up tool output, and only call the tools listed here.",
        "",
        "Tools:",
        "",
    ]
    for i, (name, what, args) in enumerate(AGENT_TOOLS, 1):
        lines.append(f"{i}. {name}: {what}")
        lines.extend(f"   - {arg} ({kind}): {meaning}" for arg, kind, meaning in args)
        lines.append("")
    lines += [
        "Guidelines:",
        "- Keep replies brief and do not explain your reasoning unless the user asks you to.",
        "- If a tool fails, retry once with corrected arguments; if it fails again, tell the user why.",
        "- Write dates as YYYY-MM-DD and times on the 24-hour clock.",
        "- Do not send messages or change files unless the task says so.",
    ]
    return "\n".join(lines)


def _tool_output(rng: random.Random, step: int) -> str:
    tool = rng.choice(AGENT_TOOLS)[0]
    kind = rng.randrange(4)
    if kind == 0:  # search results
        rows = []
        for j in range(rng.randint(2, 3)):
            w = vocab.words(rng)
            rows.append(f"{j + 1}. {w['town']} {w['shop']} guide - https://{w['town'].lower().replace(' ', '-')}"
                        f".example/{w['goods'].split()[-1]} - A {w['trait']} review by {w['person']}, a "
                        f"{w['job']}, about {w['goods']}.")
        body = "\n".join(rows)
    elif kind == 1:  # a directory listing
        body = "\n".join(f"{rng.choice(vocab.JOBS).replace(' ', '_')}_{j}.txt  {rng.randint(1, 80)} KB  "
                         f"modified 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                         for j in range(rng.randint(2, 5)))
    elif kind == 2:  # database rows
        rows = [f"({rng.randint(1000, 9999)}, '{rng.choice(vocab.GOODS)}', {rng.randint(1, 40)}, "
                f"{rng.randint(2, 300)}.{rng.randint(0, 99):02d})" for _ in range(rng.randint(2, 5))]
        body = "order_id, product, quantity, total\n" + "\n".join(rows)
    else:  # a forecast
        days = ", ".join(f"{d}: {rng.choice(vocab.WEATHER)}, {rng.randint(-4, 31)} C"
                         for d in rng.sample(vocab.WEEKDAYS, 3))
        now = f"{rng.choice(vocab.TOWNS)} now: {rng.choice(vocab.WEATHER)}, {rng.randint(-4, 31)} C."
        body = f"{now} Next days: {days}."
    return f"OUTPUT of {tool} (step {step}):\n{body}"


def agent(seed: int = 0, agents: int = 8, steps: int = 5, max_tokens: int = 32) -> dict[str, Any]:
    rng = vocab.seeded_rng("agent", seed)
    system = agent_system_prompt()
    sessions = []
    for a in range(agents):
        task = vocab.fill(rng, AGENT_TASKS[(a + seed) % len(AGENT_TASKS)])
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
        agent_steps: list[dict[str, Any]] = [{"append": [], "body": dict(body)}]
        agent_steps += [{"append": [{"role": "user", "content": _tool_output(rng, s)}], "body": dict(body)}
                        for s in range(1, steps)]
        sessions.append({"id": f"agent-{a:02d}", "endpoint": "chat",
                         "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
                         "steps": agent_steps})
    return {"name": "agent", "kind": "sessions", "source": SOURCE,
            "description": f"{agents} agents x {steps} steps, shared tool-description system prompt, "
                           f"max_tokens {max_tokens}",
            "params": {"seed": seed, "agents": agents, "steps": steps, "max_tokens": max_tokens},
            "shared_prefix_chars": len(system), "sessions": sessions}


WORKLOADS: dict[str, Callable[..., dict[str, Any]]] = {
    "fewshot": fewshot, "multiturn": multiturn, "parallel": parallel, "agent": agent,
}


def make(name: str, **params: Any) -> dict[str, Any]:
    """The generated workload ``name`` with ``params`` (unknown names raise ``ValueError``)."""
    return make_workload(name, overrides=params)


def make_workload(name: str, quick: bool = False, overrides: dict[str, Any] | None = None,
                  strict: bool = True) -> dict[str, Any]:
    """The generated workload ``name`` (``--quick`` sizes if asked) with ``overrides``; ``strict=False`` drops
    the overrides this workload has no parameter for (compare applies one set to every workload)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    gen = WORKLOADS[name]
    accepted = inspect.signature(gen).parameters
    params = dict(QUICK_PARAMS.get(name, {})) if quick else {}
    params.update({k: v for k, v in (overrides or {}).items() if strict or k in accepted})
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"workload {name} has no parameter(s) {unknown}; it takes {', '.join(accepted)}")
    return gen(**params)


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``["questions=16", "temperature=0.5"]`` -> ``{"questions": 16, "temperature": 0.5}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param {item!r}: expected NAME=VALUE")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out
