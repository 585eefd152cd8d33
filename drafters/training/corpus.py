"""Training prompts and text for the drafter, built only from what ships with Python.

Two sources, both offline and disjoint from the evaluation sets (MT-Bench, HumanEval are never read):
- `chat_prompts`: user turns from hand-written templates x topics (explain, list, write, compare, ...)
  and code tasks from the standard library's own functions (signature + docstring, "implement this").
- `source_documents`: standard-library source files and pydoc topic texts, used as assistant turns
  whose verifier-greedy spans are exact training targets (see drafters.training.batches).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

TOPICS = """
photosynthesis; the French Revolution; black holes; compound interest; machine learning; the immune system;
climate change; the Roman Empire; plate tectonics; inflation; sleep hygiene; electric cars; the stock market;
renewable energy; the printing press; vaccines; the water cycle; supply and demand; quantum computing;
the Silk Road; volcanoes; DNA replication; public speaking; time management; healthy eating; marathon training;
learning a new language; the Internet; encryption; recycling; coral reefs; the Renaissance; jazz music;
impressionist painting; the Moon landing; antibiotics; the human heart; earthquakes; remote work; social media;
budgeting; meditation; the Olympic Games; chess openings; gardening; beekeeping; coffee brewing; baking bread;
job interviews; starting a small business; negotiation; leadership; teamwork; customer service; project planning;
the scientific method; probability; prime numbers; the Pythagorean theorem; calculus; statistics; linear algebra;
game theory; operating systems; databases; computer networks; cloud computing; version control; unit testing;
recursion; sorting algorithms; hash tables; binary search trees; graphs; dynamic programming; regular expressions;
web development; cybersecurity; password managers; artificial intelligence ethics; self-driving cars; drones;
space exploration; Mars; the solar system; dinosaurs; evolution; genetics; nutrition; exercise; stress; friendship;
city planning; public transport; architecture; bridges; the Industrial Revolution; World War I; ancient Egypt;
the Great Wall of China; democracy; human rights; philosophy of mind; Stoicism; poetry; short stories; mythology;
film making; photography; podcasts; travel in Japan; travel in Italy; camping; hiking safety; ocean tides;
rainforests; deserts; migration of birds; honeybees; pets; dog training; cats; urban gardening; minimalism;
personal finance; retirement savings; credit scores; electric grids; batteries; solar panels; wind turbines;
3D printing; robotics; nanotechnology; the history of mathematics; Ada Lovelace; Marie Curie; Isaac Newton;
Albert Einstein; music theory; learning the piano; writing a novel; email etiquette; note taking; critical thinking
"""

CHAT_TEMPLATES = """
Explain {topic} in simple terms.
Write a short essay about {topic}.
Give me five practical tips about {topic}.
What are the main advantages and disadvantages of {topic}?
Summarize the key ideas behind {topic} in a few paragraphs.
Write a blog post introducing beginners to {topic}.
Describe the history of {topic}.
Write a short poem about {topic}.
Create a study plan for learning about {topic} in four weeks.
Write a friendly email inviting a colleague to a workshop on {topic}.
List common misconceptions about {topic} and correct them.
Compare {topic} with {other}: how are they similar and how do they differ?
Write a dialogue between a teacher and a student about {topic}.
Pretend you are an expert on {topic}. Answer: why does it matter today?
Write a persuasive paragraph arguing that everyone should learn about {topic}.
Give a step-by-step guide to getting started with {topic}.
Write three quiz questions about {topic}, with answers.
Tell a short story in which {topic} plays an important role.
What questions would you ask an expert on {topic}? Give ten.
Explain {topic} to a ten-year-old.
""".strip().splitlines()

CODE_TEMPLATES = """
Write a Python function that {task}
Implement a function in Python that {task} Include a docstring and an example.
Write Python code that {task} Explain how it works.
""".strip().splitlines()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(limit_bytes: int = 60_000) -> list[Path]:
    root = stdlib_dir()
    skip = ("test", "idlelib", "lib2to3", "site-packages", "tkinter", "ensurepip", "turtledemo")
    files = [p for p in sorted(root.rglob("*.py")) if not any(part in skip for part in p.relative_to(root).parts)]
    return [p for p in files if p.stat().st_size <= limit_bytes]


def stdlib_functions() -> list[tuple[str, str]]:
    """(signature + docstring stub, first docstring sentence) of documented top-level stdlib functions."""
    found = []
    for path in _python_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 800:
                continue
            args = ast.unparse(node.args)
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            stub = f'def {node.name}({args}):\n    """{body.lstrip()}\n    """\n'
            sentence = doc.split("\n\n")[0].replace("\n", " ").strip()
            found.append((stub, sentence))
    return found


def chat_prompts(seed: int = 0) -> list[str]:
    """Every training user turn: templated chat questions and stdlib-derived code tasks, interleaved."""
    topics = [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]
    rng = random.Random(seed)
    chat, code = [], []
    for i, topic in enumerate(topics):
        for template in CHAT_TEMPLATES:
            chat.append(template.format(topic=topic, other=topics[(i * 7 + 3) % len(topics)]))
    for stub, sentence in stdlib_functions():
        task = sentence[0].lower() + sentence[1:]
        if rng.random() < 0.5:
            code.append(rng.choice(CODE_TEMPLATES).format(task=task.rstrip(".") + "."))
        else:  # signature + docstring, "complete this" style
            code.append(stub)
    rng.shuffle(chat)
    rng.shuffle(code)
    # Alternate while both last, so any prefix of the list (a shorter generation run) is half code.
    mixed = [p for pair in zip(chat, code) for p in pair]
    n = len(mixed) // 2
    return mixed + chat[n:] + code[n:]


def prompt_file(path: Path) -> list[str]:
    """The user turns of a .jsonl file, one `{"prompt": ...}` object per line."""
    import json

    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f'{path}:{number}: each line must be a JSON object with a "prompt" string') from None
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def source_documents(max_chars: int = 6000) -> list[tuple[str, str]]:
    """(user turn, assistant text) pairs: stdlib source excerpts and pydoc topics, as an assistant would show them."""
    from pydoc_data.topics import topics

    docs = [(f"Explain the Python topic {name}.", text[:max_chars]) for name, text in sorted(topics.items())]
    for path in _python_files():
        text = path.read_text(encoding="utf-8", errors="ignore")
        name = path.relative_to(stdlib_dir()).with_suffix("").as_posix().replace("/", ".")
        docs.append((f"Show me the source of the Python module {name}.", f"```python\n{text[:max_chars]}\n```"))
    return docs
