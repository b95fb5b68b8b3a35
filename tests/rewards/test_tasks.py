import json

import pytest

from rewards import Problem, TaskError, reward
from rewards.tasks import (
    ProblemIndex,
    PromptMismatchError,
    PromptRef,
    generate,
    get_task,
    load_jsonl,
    ref,
    split_of,
)

TASKS = ("arithmetic", "addition", "countdown", "reverse_text")


@pytest.mark.parametrize("task", TASKS)
def test_seeded_and_deterministic(task):
    a = generate(task, "train", 50, seed=3)
    b = generate(task, "train", 50, seed=3)
    c = generate(task, "train", 50, seed=4)
    assert a == b and [p.problem_digest for p in a] == [p.problem_digest for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert len({p.prompt for p in a}) == 50 and len({p.id for p in a}) == 50


@pytest.mark.parametrize("task", TASKS)
def test_splits_never_overlap(task):
    held = {p.prompt for s in range(3) for p in generate(task, "heldout", 300, seed=s)}
    train = {p.prompt for s in range(3) for p in generate(task, "train", 1000, seed=s)}
    assert held and train and not held & train


@pytest.mark.parametrize("task", TASKS)
def test_reference_completions_score_one(task):
    gen = get_task(task)
    for p in generate(task, "heldout", 100, seed=0):
        assert reward(task, gen.reference_completion(p), p) == 1.0


def test_arithmetic_format():
    p = generate("arithmetic", "heldout", 1, seed=0)[0]
    a, op, b = p.prompt[:-1].partition("+") if "+" in p.prompt else p.prompt[:-1].partition("-")
    assert p.prompt.endswith("=")
    assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert p.answer not in p.prompt[:-1].split(op)  # the answer is not stated in the prompt


def test_addition_asks_a_question_and_reads_the_last_number():
    problems = generate("addition", "heldout", 300, seed=0)
    assert len(problems) == 300 and get_task("addition").space_size() == 90 * 90
    p = problems[0]
    a, b = (int(x) for x in p.prompt.removeprefix("What is ").split("?")[0].split(" + "))
    assert p.prompt == f"What is {a} + {b}? Reply with the number only." and int(p.answer) == a + b
    assert reward("addition", f"{a} + {b} = {a + b}", p) == 1.0  # the model's own format
    assert reward("addition", f"The answer is {a + b}.", p) == 1.0
    assert reward("addition", f"{a} + {b} = {a + b - 10}", p) == 0.0
    assert reward("addition", f"{a + b} or {b}", p) == 0.0  # only the last number is read
    assert reward("addition", f"To add {a} and {b}, we need", p) == 0.0  # an operand is no sum
    assert get_task("addition").default_max_tokens == 12


def test_split_is_content_only():
    # Golden values: a key's split never depends on the seed, the process or the draw order.
    assert [split_of(k) for k in ("0+0=", "0+3=", "1+2=", "0+1=", "0+2=", "5+5=")] == [
        "heldout",
        "heldout",
        "heldout",
        "train",
        "train",
        "train",
    ]
    for task in TASKS:  # what any seed draws for train is never what any seed holds out
        train = {p.prompt for seed in range(4) for p in generate(task, "train", 200, seed=seed)}
        heldout = {p.prompt for seed in range(4) for p in generate(task, "heldout", 50, seed=seed)}
        assert train and heldout and not train & heldout, task
    keys = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    held = sum(split_of(k) == "heldout" for k in keys) / len(keys)
    assert 0.08 < held < 0.12


def test_unknown_task_and_split():
    with pytest.raises(TaskError):
        generate("nope", "train", 1)
    with pytest.raises(TaskError):
        generate("arithmetic", "test", 1)


def test_prompt_refs_and_digests():
    problems = generate("arithmetic", "heldout", 10, seed=0)
    index = ProblemIndex(problems)
    assert index.resolve(ref(problems[3])) is problems[3]
    with pytest.raises(PromptMismatchError):
        index.resolve(PromptRef(problems[3].id, problems[4].prompt_digest))
    with pytest.raises(PromptMismatchError):
        index.resolve(PromptRef("arithmetic/heldout/0/999", problems[0].prompt_digest))
    with pytest.raises(TaskError):
        ProblemIndex(problems + problems[:1])
    # The public prompt digest does not depend on the (secret) answer; the problem digest does.
    p = problems[0]
    q = Problem(id=p.id, task=p.task, prompt=p.prompt, answer="0")
    assert p.prompt_digest == q.prompt_digest and p.problem_digest != q.problem_digest
    assert len(p.prompt_digest) == 64


def test_problem_validation():
    with pytest.raises(TaskError):
        Problem(id="", task="arithmetic", prompt="1+1=", answer="2")
    with pytest.raises(TaskError):
        Problem(id="x", task="arithmetic", prompt="1+1=", answer="2", data={"x": float("nan")})
    with pytest.raises(TaskError):
        reward("countdown", "2", Problem(id="x", task="arithmetic", prompt="1+1=", answer="2"))


def test_jsonl_loader(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    lines = [
        {
            "question": "Tom has 3 apples and buys 4. How many?",
            "answer": "3 + 4 = 7\n#### 7",
            "task": "gsm8k",
        },
        {"id": "q2", "prompt": "What is 6*7?", "answer": 42, "task": "gsm8k"},
        {
            "prompt": "Numbers: 3 4\nTarget: 7\n",
            "answer": "",
            "task": "countdown",
            "data": {"numbers": [3, 4], "target": 7},
        },
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    problems = load_jsonl(path)
    assert [p.id for p in problems] == ["gsm8k/1", "q2", "gsm8k/3"]
    assert problems[0].answer == "7" and problems[1].answer == "42"
    assert reward("gsm8k", "She has 7 apples. #### 7", problems[0]) == 1.0
    assert reward("countdown", "<answer>3+4</answer>", problems[2]) == 1.0
    assert len(load_jsonl(path, limit=2)) == 2
    with pytest.raises(TaskError, match="expected"):
        load_jsonl(path, task="gsm8k")


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": 1, "task": "gsm8k"}',
        "not json",
        '{"prompt": "x"}',
        "[1, 2]",
        '{"prompt": "x", "task": "t", "answer": true}',
    ],
)
def test_jsonl_bad_lines_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "task": "gsm8k", "answer": "1"}\n' + line + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:2"):
        load_jsonl(path)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(TaskError):
        load_jsonl(tmp_path / "absent.jsonl")


def test_asking_for_more_than_the_problem_space_fails_fast():
    with pytest.raises(TaskError, match="distinct problems"):
        generate("arithmetic", "train", 10**6)
