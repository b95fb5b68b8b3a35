"""The code reward and its sandbox: adversarial programs score 0, limits hold, the caller survives."""

import os
import time
from pathlib import Path

import pytest

from rewards import Problem, TaskError, reward
from rewards.code import RESULT_MARKER, CodeReward, extract_code
from rewards.sandbox import TEMP_PREFIX, SandboxLimits, run_python

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=3.0)
OS_ONLY = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, guard=False)
IS_ROOT = os.geteuid() == 0


def sandbox_processes() -> list[int]:
    """Live processes still running a sandbox runner (their argv names the temp dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if TEMP_PREFIX.encode() in cmd and stat[stat.rfind(")") + 2] not in "ZX":
            found.append(int(pid))
    return found


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert sandbox_processes() == [], "a sandboxed process outlived the call"


def add_problem(**data) -> Problem:
    tests = [{"args": [1, 2], "expected": 3}, {"args": [5, 5], "expected": 10}]
    return Problem(
        id="c",
        task="code",
        prompt="def add",
        answer="",
        data={"entry_point": "add", "tests": tests, **data},
    )


def score(code: str, limits: SandboxLimits = FAST, problem: Problem | None = None) -> float:
    return CodeReward(limits)(code, problem or add_problem())


def test_correct_partial_and_fenced():
    assert reward("code", "def add(a, b):\n    return a + b\n", add_problem()) == 1.0
    assert score("def add(a, b):\n    return 3\n") == 0.5
    assert score("Here:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.") == 1.0
    assert score("def add(a, b):\n    raise ValueError\n") == 0.0
    assert score("") == 0.0
    assert score("def add(a, b) return") == 0.0  # syntax error
    assert extract_code("```py\nx = 1\n```\n```python\ny = 2\n```") == "y = 2\n"


def test_malformed_problem_raises():
    with pytest.raises(TaskError):
        score("def add(a,b): return a+b", problem=add_problem(entry_point="os.system"))


# -- reward hacks -------------------------------------------------------------------------


def test_always_equal_object_does_not_pass():
    code = "class A:\n    def __eq__(self, o): return True\n    __hash__ = None\ndef add(a, b): return A()\n"
    assert score(code) == 0.0


def test_int_subclass_with_lying_eq_is_compared_as_data():
    code = "class I(int):\n    def __eq__(self, o): return True\ndef add(a, b): return I(0)\n"
    assert score(code) == 0.0


def test_forged_result_line_without_the_answers_fails():
    forged = f"import sys, os\nsys.stdout.write({RESULT_MARKER!r} + '[[true, 0], [true, 0]]\\n')\nsys.stdout.flush()\nos._exit(0)\n"
    assert score(forged) == 0.0
    early_exit = "import os\nos._exit(0)\ndef add(a, b): return a + b\n"
    assert score(early_exit) == 0.0


def test_patching_the_harness_does_not_help():
    # The harness can be patched, but the expected values never leave the caller:
    # a forged "all passed" line must still carry the right values.
    code = "import json\njson.dumps = lambda *a, **k: '[[true, null], [true, true]]'\ndef add(a, b): return 0\n"
    assert score(code) == 0.0


def test_huge_output_is_capped_and_scores_zero():
    t0 = time.monotonic()
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\ndef add(a,b): return a+b\n"
    assert score(code) == 0.0
    assert time.monotonic() - t0 < 10
    assert score("x" * 40_000) == 0.0  # oversized completion is never run


# -- sandbox limits (each: 0 within the limit, no leftover child, caller alive) ------------


def test_infinite_loop_hits_cpu_limit():
    t0 = time.monotonic()
    assert score("def add(a, b):\n    while True: pass\n") == 0.0
    assert time.monotonic() - t0 < FAST.wall_seconds + 10


def test_sleep_hits_wall_clock():
    t0 = time.monotonic()
    assert score("import time\ndef add(a, b):\n    time.sleep(100)\n") == 0.0
    assert time.monotonic() - t0 < FAST.wall_seconds + 10


@pytest.mark.parametrize("limits", [FAST, OS_ONLY], ids=["guard", "os-only"])
def test_ten_gb_allocation_fails(limits):
    assert score("def add(a, b):\n    x = bytearray(10 * 2**30)\n    return a + b\n", limits) == 0.0
    assert score("x = bytearray(10 * 2**30)\ndef add(a, b): return a + b\n", limits) == 0.0


FORK_PROGRAM = """
import os, sys, time
started = 0
for attempt in range(5000):  # bounded in the program itself
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        if {escape}:
            os.setsid()  # try to leave the process group the caller kills
        time.sleep(60)
        os._exit(0)
    started += 1
print("started", started, flush=True)
{tail}
"""


@pytest.mark.parametrize("escape", [False, True], ids=["plain", "setsid"])
def test_fork_bomb_os_limit_holds_and_children_die(escape):
    result = run_python(FORK_PROGRAM.format(escape=escape, tail=""), OS_ONLY)
    assert result.returncode == 0
    started = int(result.stdout.split()[1])
    if IS_ROOT:
        assert started <= OS_ONLY.extra_processes  # RLIMIT_NPROC binds the unprivileged user
    else:
        assert started < 5000
    # no_leftovers checks that every forked child, setsid escapees too, is gone


def test_fork_bomb_scores_zero():
    code = "def add(a, b):\n    return a + b\n" + FORK_PROGRAM.format(
        escape=False, tail="time.sleep(60)"
    )
    assert score(code) == 0.0  # guard: the first fork ends the program
    assert score(code, OS_ONLY) == 0.0  # no guard: wall clock, then the group is killed


def test_writing_outside_its_temp_dir(tmp_path):
    target = tmp_path / "escaped.txt"
    tmp_target = Path("/tmp") / f"prooftrain-escape-{os.getpid()}"
    for path in (target, tmp_target):
        code = f"def add(a, b):\n    open({str(path)!r}, 'w').write('pwned')\n    return a + b\n"
        assert score(code) == 0.0
        assert not path.exists()
    # Its own temp dir is writable.
    assert score("def add(a, b):\n    open('scratch', 'w').write('ok')\n    return a + b\n") == 1.0


@pytest.mark.skipif(not IS_ROOT, reason="the OS layer drops privileges only when started as root")
def test_writing_to_the_callers_files_fails_without_the_guard(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"def add(a, b):\n    open({str(target)!r}, 'w').write('pwned')\n    return a + b\n"
    assert score(code, OS_ONLY) == 0.0
    assert not target.exists()


def test_reading_the_callers_environment(monkeypatch):
    secret = "s3cret-value"
    monkeypatch.setenv("PROOFTRAIN_TEST_SECRET", secret)
    problem = Problem(
        id="env",
        task="code",
        prompt="leak",
        answer="",
        data={"entry_point": "leak", "tests": [{"args": [], "expected": secret}]},
    )
    via_environ = (
        "import os\ndef leak():\n    return os.environ.get('PROOFTRAIN_TEST_SECRET', '')\n"
    )
    via_proc = (
        "import os\ndef leak():\n"
        "    raw = open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
        "    for kv in raw.split(b'\\0'):\n"
        "        if kv.startswith(b'PROOFTRAIN_TEST_SECRET='):\n"
        "            return kv.split(b'=', 1)[1].decode()\n"
        "    return ''\n"
    )
    assert score(via_environ, problem=problem) == 0.0
    assert score(via_proc, problem=problem) == 0.0
    assert score(via_environ, OS_ONLY, problem) == 0.0
    if IS_ROOT:
        assert score(via_proc, OS_ONLY, problem) == 0.0


SOCKET = """try:
        import socket
    except ImportError:  # a stdlib the sandbox user cannot read: the event socket() raises
        import sys
        sys.audit("socket.__new__", None, 2, 1, 0)
    else:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()"""


@pytest.mark.parametrize(
    ("body", "harmless"),
    [
        (SOCKET, True),
        ("import subprocess\n    subprocess.run(['true'])", False),
        ("import ctypes", False),
        ("import os\n    os.system('true')", True),
        ("import gc\n    gc.get_objects()", True),
        ("import os\n    os.kill(os.getppid(), 9)", False),
    ],
    ids=["socket", "subprocess", "ctypes", "system", "gc", "kill"],
)
def test_guard_blocks_escape_attempts(body, harmless):
    code = f"def add(a, b):\n    {body}\n    return a + b\n"
    assert score(code) == 0.0
    if harmless:  # without the guard the attempt succeeds: the guard is what scores it 0
        assert score(code, OS_ONLY) == 1.0


def test_sandbox_runs_unprivileged_with_an_empty_environment():
    result = run_python(
        "import os, json\nprint(json.dumps([os.getuid(), sorted(os.environ)]))", FAST
    )
    assert result.ok
    uid, env = eval(result.stdout)  # noqa: S307 - our own JSON list of an int and names
    assert uid == (65534 if IS_ROOT else os.geteuid())
    assert set(env) <= {"LC_CTYPE"}  # CPython's own C-locale coercion, nothing inherited


def test_well_behaved_programs_score_deterministically():
    programs = [
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    return a - b\n",
        "def add(a, b):\n    return sum(range(a + b + 1)) - sum(range(a + b))\n",
        "def add(a, b):\n    return [a, b]\n",
        "import math\ndef add(a, b):\n    return int(math.fsum([a, b]))\n",
    ]
    first = [score(p) for p in programs]
    assert first == [score(p) for p in programs] == [1.0, 0.0, 1.0, 0.0, 1.0]
