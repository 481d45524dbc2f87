"""tokenfab eval tasks: lm-eval's GSM8K / MMLU-Pro answer rules on hand-worked completions, prompt layouts, the
HumanEval sandbox (canonical solutions of 3 package problems pass, wrong ones, loops, memory hogs and network use
fail), and the runner end to end against the offline engine and the server (same completions both ways)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tokenfab.eval.tasks import gsm8k, humaneval, mmlu_pro
from tokenfab.eval.tasks.fixtures import GSM8K_TEST, MMLU_PRO_TEST, write_fixtures
from tokenfab.eval.tasks.runner import parse_tasks, render_markdown, run_tasks, write_outputs
from tokenfab.eval.tasks.sandbox import run_program


class ScriptedClient:
    """Returns completions from ``answer(request)``; records the requests."""

    name, base_url = "scripted", None

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def generate(self, reqs, progress=None):
        self.requests += reqs
        if progress:
            progress(len(reqs))
        return [self.answer(r) for r in reqs]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fixtures(str(tmp_path_factory.mktemp("task_data")))


# ---- GSM8K -------------------------------------------------------------------------------------------------------
def test_gsm8k_extraction_hand_worked():
    s = gsm8k.score(" She has 3 + 4 = 7 apples.\n#### 7\n\n", "3 + 4 = <<3+4=7>>7\n#### 7")
    assert (s["strict"], s["flexible"], s["strict_match"], s["flexible_extract"]) == ("7", "7", True, True)
    s = gsm8k.score(" 3 + 4 = 7, so the answer is 7.", "#### 7")  # no ####: only the flexible rule finds it
    assert s["strict"] == "[invalid]" and not s["strict_match"] and s["flexible"] == "7." and s["flexible_extract"]
    s = gsm8k.score(" 1,000 eggs cost $2,000.\n#### 1,000", "... #### 1,000")  # commas and $ ignored
    assert s["strict_match"] and s["flexible"] == "1,000" and s["flexible_extract"]
    s = gsm8k.score(" The total is 12 then 13", "#### 12")  # flexible takes the LAST number
    assert s["flexible"] == "13" and not s["flexible_extract"]
    s = gsm8k.score("#### 8\nand later #### 9", "#### 8")  # strict takes the FIRST ####
    assert s["strict"] == "8" and s["strict_match"]
    assert gsm8k.score(" -5 degrees", "#### -5")["flexible_extract"]
    assert gsm8k.score(" no numbers here", "#### 5")["flexible"] == "[invalid]"


def test_gsm8k_prompt_layout():
    shots = [{"question": "Q1?", "answer": "A1\n#### 1"}, {"question": "Q2?", "answer": "A2\n#### 2"}]
    assert gsm8k.build_prompt(shots, "Q3?") == ("Question: Q1?\nAnswer: A1\n#### 1\n\nQuestion: Q2?\nAnswer: A2\n"
                                                "#### 2\n\nQuestion: Q3?\nAnswer:")


def test_gsm8k_runner_scores_and_records(data_dir):
    """The scripted model answers every even item right (with ####) and every odd one with the right number but no
    ####: strict-match = the even share, flexible-extract = 100%."""
    truth = {q: a.rsplit("#### ", 1)[1] for q, a in GSM8K_TEST}

    def answer(req):
        q = req["prompt"].rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
        i = [x for x, _ in GSM8K_TEST].index(q)
        return f" so it is {truth[q]}.\n#### {truth[q]}" if i % 2 == 0 else f" The answer is {truth[q]}"

    client = ScriptedClient(answer)
    res = run_tasks("gsm8k", data_dir=data_dir, client=client, progress=False)
    r = res["tasks"]["gsm8k"]
    n = len(GSM8K_TEST)
    assert r["n"] == n and r["settings"]["num_fewshot"] == 5
    assert r["metrics"]["strict_match"] == pytest.approx(sum(1 for i in range(n) if i % 2 == 0) / n)
    assert r["metrics"]["flexible_extract"] == 1.0
    assert client.requests[0]["prompt"].count("Question: ") == 6 and client.requests[0]["stop"] == gsm8k.STOP
    assert [x["target"] for x in r["records"]] == [a.rsplit("#### ", 1)[1].replace(",", "") for _, a in GSM8K_TEST]
    # --limit and --num-fewshot
    res = run_tasks("gsm8k", data_dir=data_dir, client=ScriptedClient(lambda r: ""), limit=2, num_fewshot=1,
                    progress=False)
    assert res["tasks"]["gsm8k"]["n"] == 2 and res["tasks"]["gsm8k"]["metrics"]["strict_match"] == 0.0
    assert res["tasks"]["gsm8k"]["settings"]["num_fewshot"] == 1


def test_chat_mode_sends_messages(data_dir):
    client = ScriptedClient(lambda r: "#### 7")
    run_tasks("gsm8k", data_dir=data_dir, client=client, mode="chat", limit=1, progress=False)
    req = client.requests[0]
    assert "prompt" not in req and req["messages"][0]["role"] == "user"
    assert req["messages"][0]["content"].endswith("Question: " + GSM8K_TEST[0][0] + "\nAnswer:")


# ---- MMLU-Pro ----------------------------------------------------------------------------------------------------
def test_mmlu_pro_extraction_and_prompt():
    assert mmlu_pro.extract(" 3 + 4 = 7. The answer is (G).", "cot") == "G"
    assert mmlu_pro.extract(" so the answer is B", "cot") == "B"
    assert mmlu_pro.extract(" I think G", "cot") == "[invalid]"  # lm-eval needs "answer is"
    assert mmlu_pro.extract("K) no", "direct") == "[invalid]" and mmlu_pro.extract("J).", "direct") == "J"
    row = {"question": "What is 1+1?", "options": ["1", "2"], "answer": "B", "category": "math"}
    shot = {"question": "What is 0+1?", "options": ["1", "2"], "answer": "A", "category": "math",
            "cot_content": "A: Let's think step by step. It is 1. The answer is (A)."}
    p = mmlu_pro.build_prompt(row, [shot], "cot")
    assert p.startswith("The following are multiple choice questions (with answers) about math. Think step by step")
    assert ("Question:\nWhat is 0+1?\nOptions:\nA. 1\nB. 2\nAnswer: Let's think step by step. It is 1. The answer "
            "is (A).\n\nQuestion:\nWhat is 1+1?\nOptions:\nA. 1\nB. 2\nAnswer: Let's think step by step.") in p
    assert mmlu_pro.build_prompt(row, [shot], "direct").endswith("B. 2\nAnswer: The answer is (")


def test_mmlu_pro_runner_per_category(data_dir):
    """Right on math, wrong on biology: exact_match = math share; shots come from the item's category."""
    def answer(req):
        q = req["prompt"].rsplit("Question:\n", 1)[1].split("\nOptions:")[0]
        row = next(r for r in MMLU_PRO_TEST if r["question"] == q)
        letter = row["answer"] if row["category"] == "math" else "A" if row["answer"] != "A" else "B"
        return f" ... the answer is ({letter})."

    client = ScriptedClient(answer)
    r = run_tasks("mmlu_pro", data_dir=data_dir, client=client, progress=False)["tasks"]["mmlu_pro"]
    n_math = sum(1 for x in MMLU_PRO_TEST if x["category"] == "math")
    assert r["metrics"]["exact_match"] == pytest.approx(n_math / len(MMLU_PRO_TEST))
    assert r["per_category"] == {"biology": 0.0, "math": 1.0}
    for req in client.requests:  # 2 shots per category in the fixture, all of the item's own category
        cat = req["prompt"].split("about ", 1)[1].split(".", 1)[0]
        assert req["prompt"].count("Let's think step by step.") == 3
        assert ("photosynthesis" in req["prompt"]) == (cat == "biology")


def test_bad_data_named(tmp_path, data_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "options": ["a", "b"], "answer": "C", "category": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"--mmlu-pro-file: row 0 .* answer 'C'"):
        run_tasks("mmlu_pro", mmlu_pro_file=str(bad), client=ScriptedClient(str), progress=False)
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"--gsm8k-file: row 0 .* lacks field\(s\) \['answer'\]"):
        run_tasks("gsm8k", gsm8k_file=str(bad), client=ScriptedClient(str), progress=False)
    with pytest.raises(ValueError, match="--gsm8k-file FILE"):
        run_tasks("gsm8k", client=ScriptedClient(str), progress=False)
    with pytest.raises(ValueError, match="--tasks: unknown"):
        parse_tasks("gsm8k,mmlu")


def test_cli_reports_bad_flag_in_one_line(tmp_path):
    code = "import sys; from tokenfab.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "eval", "tasks", "--tasks", "gsm8k", "--gsm8k-file",
                        str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--gsm8k-file: no file at" in p.stderr and "Traceback" not in p.stderr


def test_default_tasks_are_those_with_data_here(tmp_path):
    """No --tasks: humaneval (its problems ship with the package), plus gsm8k / mmlu_pro when their files are given
    or --data-dir holds their test splits."""
    from tokenfab.cli import build_parser
    from tokenfab.commands.eval import available_tasks
    parse = build_parser().parse_args
    assert parse(["eval", "tasks"]).tasks is None
    assert available_tasks(parse(["eval", "tasks"])) == "humaneval"
    assert available_tasks(parse(["eval", "tasks", "--gsm8k-file", "x.jsonl"])) == "gsm8k,humaneval"
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("{}\n")
    (tmp_path / "mmlu_pro_test.jsonl").write_text("{}\n")
    assert available_tasks(parse(["eval", "tasks", "--data-dir", str(tmp_path)])) == "gsm8k,humaneval,mmlu_pro"


# ---- HumanEval and the sandbox -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def problems():
    rows, path = humaneval.load(None)
    assert path.endswith("HumanEval.jsonl.gz") and len(rows) == 164
    return rows[:3]


def test_humaneval_canonical_solutions_pass_and_wrong_fail(problems):
    for p in problems:
        ok = run_program(humaneval.build_program(p, p["canonical_solution"], "completion"))
        assert ok["passed"], (p["task_id"], ok)
        bad = run_program(humaneval.build_program(p, "    return None\n", "completion"))
        assert not bad["passed"] and "AssertionError" in bad["result"]


def test_humaneval_runner_pass_at_1(problems):
    """Canonical solutions for problems 0 and 2, a wrong body for 1: pass@1 = 2/3; chat replies in a code fence."""
    def answer(req):
        i = next(k for k, p in enumerate(problems) if p["prompt"] == req.get("prompt"))
        return problems[i]["canonical_solution"] if i != 1 else "    return 0\n"

    r = run_tasks("humaneval", client=ScriptedClient(answer), limit=3, progress=False)["tasks"]["humaneval"]
    assert r["metrics"]["pass@1"] == pytest.approx(2 / 3)
    assert [x["passed"] for x in r["records"]] == [True, False, True]

    def chat_answer(req):
        text = req["messages"][0]["content"]
        p = next(p for p in problems if p["prompt"].strip() in text)
        return "Sure:\n```python\n" + p["prompt"] + p["canonical_solution"] + "```\nDone."

    r = run_tasks("humaneval", client=ScriptedClient(chat_answer), limit=3, mode="chat",
                  progress=False)["tasks"]["humaneval"]
    assert r["metrics"]["pass@1"] == 1.0


def test_sandbox_limits():
    assert run_program("while True:\n    pass\n", timeout_s=2)["result"] == "timed out"
    big = run_program("x = bytearray(4 << 30)\n", memory_mb=256)
    assert not big["passed"] and "MemoryError" in big["result"]
    assert run_program("import sys\nsys.exit(3)\n")["result"] == "failed: exit status 3"
    probe = run_program("import os\nassert os.listdir('.') == ['program.py'], os.listdir('.')\n")
    assert probe["passed"], probe  # a fresh folder of its own


def test_sandbox_network_blocked():
    """A listener on 127.0.0.1 in this process: the sandboxed program cannot reach it, neither through socket
    nor through the C module _socket (which only a network namespace stops)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
        assert not r["passed"] and "network access is disabled" in r["result"]
        r = run_program(f"import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n")
        if r["network"] == "namespace":
            assert not r["passed"], r
        else:
            pytest.skip("no network namespace here: only the Python-level barrier applies")
    finally:
        srv.close()


# ---- end to end on a tiny model ----------------------------------------------------------------------------------
def test_engine_and_server_give_the_same_completions(tiny_model, data_dir, tmp_path):
    """Greedy completions of every task through the in-process engine and through `tokenfab serve`'s HTTP API
    (lists of prompts per request) are the same text; the outputs are written."""
    from server_fixtures import start_test_server
    from tokenfab.entrypoints.llm import LLM
    from tokenfab.eval.tasks.client import EngineClient, HttpClient

    path = tiny_model("llama", max_position_embeddings=4096)
    kw = dict(tasks="gsm8k,humaneval,mmlu_pro", data_dir=data_dir, limit=3, max_tokens=6, progress=False)
    llm = LLM(path, progress=False, dtype="float32", device="cpu", max_model_len=4096)
    offline = run_tasks(client=EngineClient(llm=llm), **kw)
    h = start_test_server(path, max_model_len=4096)
    try:
        served = run_tasks(client=HttpClient(h.base_url, batch_size=2), **kw)
    finally:
        h.stop()
    for name in ("gsm8k", "humaneval", "mmlu_pro"):
        a = [x["completion"] for x in offline["tasks"][name]["records"]]
        b = [x["completion"] for x in served["tasks"][name]["records"]]
        assert len(a) == 3 and a == b, name
    paths = write_outputs(served, str(tmp_path / "out"))
    saved = json.load(open(paths["json"]))
    assert set(saved["tasks"]) == {"gsm8k", "humaneval", "mmlu_pro"} and len(saved["tasks"]["gsm8k"]["records"]) == 3
    assert "| gsm8k | strict_match |" in render_markdown(served)
