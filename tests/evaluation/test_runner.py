"""The runner: records, evidence metrics, caching and resume, failing judges and engines."""

from __future__ import annotations

import json
import threading
import types

import pytest
from llama_index.core.evaluation import BaseEvaluator
from llama_index.core.evaluation import EvaluationResult as Judged

from llama_index.packs.self_rag_rse.evaluation import JudgementError, Question, evaluate, runner
from llama_index.packs.self_rag_rse.evaluation.report import write_report
from llama_index.packs.self_rag_rse.evaluation.runner import ResultCache

DOC = "The while loop repeats a suite. The else clause runs when the loop ends normally."
DOCUMENTS = {"loops.txt": DOC}
QUESTIONS = [
    Question("When does else run?", "loops.txt", "The else clause runs when the loop ends"),
    Question("What does while do?", "loops.txt", "The while loop repeats a suite."),
]


@pytest.fixture(autouse=True)
def no_waits(monkeypatch):
    """Retries follow at once here (the backoff's schedule is tenacity's)."""
    from tenacity import wait_none

    monkeypatch.setattr(runner, "RETRY_WAIT", wait_none())


class Metric(BaseEvaluator):
    """A metric of a :func:`counting_judge`: records its calls, fails where ``judge`` says."""

    def __init__(self, name: str, judge: CountingJudge) -> None:
        self.name, self.judge = name, judge

    def _get_prompts(self):
        return {}

    def _update_prompts(self, prompts_dict) -> None:
        pass

    async def aevaluate(self, query=None, response=None, contexts=None, **kwargs) -> Judged:
        return Judged(score=await self.judge.ascore(self.name, query, response))


class CountingJudge(dict):
    """``length`` = answer length / 100, ``constant`` = 1; fails where ``failing`` says.

    A dict ``{metric: evaluator}`` (what ``evaluate`` takes) that also counts the calls.
    """

    def __init__(
        self,
        failing: set[tuple[str, str]] | None = None,
        name: str = "counter",
        error: type[Exception] = JudgementError,
    ) -> None:
        super().__init__(length=Metric("length", self), constant=Metric("constant", self))
        self.failing, self.error, self.name = failing or set(), error, name
        self.calls: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    async def ascore(self, metric: str, question: str, answer: str) -> float:
        with self._lock:
            self.calls.append((question, answer, metric))
        if (question, metric) in self.failing:
            raise self.error("scripted failure")
        return len(answer) / 100 if metric == "length" else 1.0


def run(engines, questions, judge=None, **options):
    """``evaluate`` without progress bars, the judge's name keying its judgements."""
    name = getattr(judge, "name", None)
    return evaluate(engines, questions, judge, judge_name=name, progress=False, **options)


@pytest.fixture
def engines(fixed_engine, scripted_llm):
    llm = scripted_llm(lambda prompt: "ok")
    answers = {q.question: f"Answer to {q.question}" for q in QUESTIONS}
    whole = fixed_engine(answers=answers, sources=[("loops.txt", 0, len(DOC), DOC)], llm=llm)
    first = fixed_engine(answers=answers, sources=[("loops.txt", 0, 31, DOC[:31])], llm=llm)
    return {"whole": whole, "first": first}, llm


def test_records_hold_answers_costs_and_evidence(engines, monkeypatch):
    built, llm = engines
    # A clock the answering LLM moves on by 1.5 s a query: latency is the query's time.
    clock = types.SimpleNamespace(now=100.0)
    clock.perf_counter = lambda: clock.now
    monkeypatch.setattr(runner, "time", clock)
    llm.reply = lambda prompt: setattr(clock, "now", clock.now + 1.5) or "ok"
    result = run(built, QUESTIONS, CountingJudge(), documents=DOCUMENTS)
    assert [(r.question, r.engine) for r in result.records] == [
        (q.question, e) for q in QUESTIONS for e in ("whole", "first")
    ]
    assert result.metrics == ["length", "constant", "evidence_recall", "evidence_precision"]
    assert result.judge == "counter"
    by_key = {(r.question, r.engine): r for r in result.records}
    whole = by_key[("When does else run?", "whole")]
    assert whole.answer == "Answer to When does else run?"
    assert whole.contexts == [DOC]
    assert [r.latency_s for r in result.records] == [1.5] * 4
    # One LLM request per query, counted by instrumentation (the judge is not the answerer).
    assert whole.model_calls == 1
    assert whole.model_calls_detail == {"llm_requests": 1, "critic_calls": 0}
    gold = len("The else clause runs when the loop ends")
    assert whole.metrics["evidence_recall"] == pytest.approx(1.0)
    assert whole.metrics["evidence_precision"] == pytest.approx(gold / len(DOC))
    first = by_key[("When does else run?", "first")]
    assert first.metrics["evidence_recall"] == 0.0
    assert first.metrics["evidence_precision"] == 0.0
    assert by_key[("What does while do?", "first")].metrics["evidence_recall"] == 1.0
    assert whole.metrics["length"] == pytest.approx(len(whole.answer) / 100)
    summary = result.summary()
    assert summary["first"]["evidence_recall"].mean == pytest.approx(0.5)
    assert summary["first"]["evidence_recall"].n == 2
    assert summary["whole"]["model_calls"].mean == 1.0
    assert len(llm.prompts) == 4  # each engine answered each question once


def test_failing_judge_is_recorded_and_a_rerun_asks_only_what_is_missing(engines, tmp_path):
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    broken = CountingJudge(failing={("When does else run?", "length")})
    first = run(built, QUESTIONS, broken, documents=DOCUMENTS, cache=cache, retries=1)
    failed = [r for r in first.records if r.errors]
    assert {(r.question, r.engine) for r in failed} == {
        ("When does else run?", "whole"),
        ("When does else run?", "first"),
    }
    for record in failed:
        assert record.metrics["length"] is None
        assert record.errors == {"length": "JudgementError: scripted failure"}
        assert record.metrics["constant"] == 1.0  # the other judgements went on
    # 8 judgements; an unreadable reply is not asked again within the run.
    assert len(broken.calls) == 8
    assert first.summary()["whole"]["length"].failed == 1
    assert len(first.failures) == 2

    fixed = CountingJudge()
    second = run(built, QUESTIONS, fixed, documents=DOCUMENTS, cache=cache)
    # Only the two failed judgements are asked again; no engine answers again.
    assert sorted(fixed.calls) == sorted(
        [
            ("When does else run?", "Answer to When does else run?", "length"),
            ("When does else run?", "Answer to When does else run?", "length"),
        ]
    )
    assert len(llm.prompts) == 4
    assert all(r.cached for r in second.records)
    assert not second.failures
    gold = {"When does else run?": len(QUESTIONS[0].evidence), "What does while do?": 31}
    for record in second.records:
        returned = len(DOC) if record.engine == "whole" else 31
        hit = (
            gold[record.question] if record.engine == "whole" or gold[record.question] == 31 else 0
        )
        assert record.metrics == {
            "evidence_recall": hit / gold[record.question],
            "evidence_precision": pytest.approx(hit / returned),
            "length": pytest.approx(len(record.answer) / 100),  # judged again: no longer None
            "constant": 1.0,
        }
    # Answers come back with their original latency and model calls.
    assert [r.model_calls for r in second.records] == [r.model_calls for r in first.records]

    # Another judge reuses the answers but judges everything itself.
    other = CountingJudge(name="another judge")
    run(built, QUESTIONS, other, documents=DOCUMENTS, cache=cache)
    assert len(other.calls) == 8


def test_transient_failures_are_retried_within_the_run(engines):
    built, _ = engines
    down = CountingJudge(failing={("When does else run?", "length")}, error=ConnectionError)
    result = run(built, QUESTIONS, down, retries=2)
    assert len(down.calls) == 6 + 2 * 3  # the two failing judgements tried three times
    assert {e for r in result.records for e in r.errors.values()} == {
        "ConnectionError: scripted failure"
    }


def test_a_run_cut_short_resumes_from_what_was_written(engines, tmp_path, caplog):
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    run(built, QUESTIONS, CountingJudge(), cache=cache)
    lines = cache.read_text().splitlines()
    # Keep the answers and half the judgements, and cut the last line in the middle.
    answers = [x for x in lines if json.loads(x)["kind"] == "answer"]
    judged = [x for x in lines if json.loads(x)["kind"] == "judgement"]
    cache.write_text("\n".join([*answers, *judged[:4], judged[4][:20]]) + "\n")
    judge = CountingJudge()
    result = run(built, QUESTIONS, judge, cache=cache)
    assert f"{cache}: skipped damaged line(s) 9;" in caplog.text  # the file and the line
    assert len(judge.calls) == 4
    assert not result.failures and len(llm.prompts) == 4
    assert len(ResultCache(cache)) == len(lines)


def test_settings_key_and_a_new_answer_invalidate_the_cache(engines, tmp_path):
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    run(built, QUESTIONS, CountingJudge(), cache=cache, settings_key="a")
    judge = CountingJudge()
    run(built, QUESTIONS, judge, cache=cache, settings_key="b")
    assert len(llm.prompts) == 8 and len(judge.calls) == 8


def test_failing_engine_is_recorded_and_not_judged(fixed_engine, tmp_path):
    engine = fixed_engine(answers={"ok?": "fine"}, fail_on={"boom?"})
    judge = CountingJudge()
    result = run({"e": engine}, ["ok?", "boom?"], judge)
    boom = result.records[1]
    assert boom.errors == {"answer": "RuntimeError: engine exploded"}
    assert boom.answer == "" and boom.metrics == {} and boom.latency_s is None
    assert {c[0] for c in judge.calls} == {"ok?"}
    assert result.failures == [("boom?", "e", "answer", "RuntimeError: engine exploded")]


def test_metric_selection_and_no_judge(engines):
    built, _ = engines
    result = run(
        built,
        QUESTIONS,
        CountingJudge(),
        documents=DOCUMENTS,
        metrics=["constant"],
    )
    assert result.metrics == ["constant"]
    with pytest.raises(ValueError, match="unknown metric"):
        run(built, QUESTIONS, CountingJudge(), metrics=["faithfulness"])
    bare = run(built, QUESTIONS, None, documents=DOCUMENTS)
    assert bare.judge is None
    assert bare.metrics == ["evidence_recall", "evidence_precision"]


def test_bad_arguments(engines):
    built, _ = engines
    with pytest.raises(ValueError, match="at least one engine"):
        run({}, QUESTIONS)
    with pytest.raises(ValueError, match="workers"):
        run(built, QUESTIONS, workers=0)
    with pytest.raises(ValueError, match="question"):
        run(built, [])


def test_judgements_run_concurrently_but_bounded(engines):
    import asyncio

    built, _ = engines
    state = {"now": 0, "peak": 0}

    class SlowJudge(CountingJudge):
        async def ascore(self, metric: str, question: str, answer: str) -> float:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            await asyncio.sleep(0.02)
            state["now"] -= 1
            return 0.5

    run(built, QUESTIONS, SlowJudge(), workers=3)
    assert state["peak"] == 3


def test_judge_timeouts_are_failures(engines):
    import asyncio

    built, _ = engines

    class HangingJudge(CountingJudge):
        async def ascore(self, metric: str, question: str, answer: str) -> float:
            await asyncio.sleep(10)
            return 1.0

    result = run(built, QUESTIONS[:1], HangingJudge(), timeout_s=0.05, retries=0)
    assert all("TimeoutError" in e for r in result.records for e in r.errors.values())
    assert len(result.failures) == 4


def test_ragas_path_through_the_runner(engines, scripted_llm, ragas_rules, word_embedding):
    pytest.importorskip("ragas")
    built, _ = engines
    judge_llm = scripted_llm(ragas_rules)
    questions = [
        Question(q.question, q.document, q.evidence, reference=q.evidence) for q in QUESTIONS
    ]
    result = run(built, questions, judge_llm, embed_model=word_embedding, documents=DOCUMENTS)
    assert not result.failures
    by_key = {(r.question, r.engine): r for r in result.records}
    # The answer "Answer to ..." is one statement, not in the context: faithfulness 0.
    whole = by_key[("When does else run?", "whole")]
    assert whole.metrics["faithfulness"] == 0.0
    # The reference (the evidence) is in the whole document, not in its first sentence.
    assert whole.metrics["context_recall"] == 1.0
    assert by_key[("When does else run?", "first")].metrics["context_recall"] == 0.0
    assert "context_utilization" not in whole.metrics  # a reference was given
    # An LLM as the judge: RAGAS's metrics, the LLM named in the identity and the report.
    assert result.judge.startswith("ragas ") and result.judge.endswith(
        "/ ScriptedLLM(scripted, 256 tokens)"
    )
    assert "answer_relevancy" in result.settings["judge"]["metrics"]  # the embedding was used


def test_a_nan_score_is_a_failed_judgement(engines):
    built, _ = engines

    class NanJudge(CountingJudge):
        async def ascore(self, metric: str, question: str, answer: str) -> float:
            self.calls.append((question, answer, metric))
            return float("nan")

    judge = NanJudge()
    result = run(built, QUESTIONS[:1], judge)
    assert len(judge.calls) == 4  # not asked again: the same question gets the same reply
    assert all(r.metrics == {"length": None, "constant": None} for r in result.records)
    assert {e for r in result.records for e in r.errors.values()} == {
        "JudgementError: the judge returned nan for length: its replies held nothing to score "
        "(e.g. no statements taken from the answer); a more capable judge model gives one",
        "JudgementError: the judge returned nan for constant: its replies held nothing to score "
        "(e.g. no statements taken from the answer); a more capable judge model gives one",
    }
    json.dumps(result.to_json(), allow_nan=False)  # records.json stays valid JSON


def test_a_line_cut_short_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "cache.jsonl"
    good = json.dumps({"kind": "judgement", "key": ["a"], "value": {"score": 0.5}})
    path.write_text(good + "\n" + '{"kind": "judgement", "key": ["b"], "val', encoding="utf-8")
    first = ResultCache(path)
    assert first.get("judgement", ("a",)) == {"score": 0.5} and len(first) == 1
    first.put("judgement", ("c",), {"score": 1.0})
    again = ResultCache(path)
    assert again.get("judgement", ("c",)) == {"score": 1.0}
    assert again.get("judgement", ("a",)) == {"score": 0.5} and len(again) == 2


def test_damaged_cache_lines_are_skipped_with_file_and_line_and_the_rest_resumes(
    engines, tmp_path, caplog
):
    """A run killed inside a multi-byte character, or a garbage line: only those are redone."""
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    questions = [Question("什么是循环？"), *QUESTIONS]  # CJK: three bytes a character
    run(built, questions, CountingJudge(), cache=cache)
    lines = cache.read_bytes().splitlines()
    cut = next(i for i, line in enumerate(lines) if "什么".encode() in line)
    damaged = lines[cut][: lines[cut].index("么".encode()) + 1]  # cut inside the character
    cache.write_bytes(b"\n".join([*lines[:cut], damaged, b"\x00garbage", *lines[cut + 1 :]]))
    judge = CountingJudge()
    result = run(built, questions, judge, cache=cache)
    assert f"{cache}: skipped damaged line(s) {cut + 1}, {cut + 2};" in caplog.text
    assert not result.failures and len(llm.prompts) == 6 + 1  # only the cut answer again
    assert judge.calls == []  # the same answer again: its judgements come from the cache


@pytest.mark.parametrize(
    "value",
    [
        {"answer": "no contexts", "latency_s": 1.0, "model_calls": 1},
        "a string",
        {"answer": "a", "contexts": [], "latency_s": "fast", "model_calls": 1},
        {"answer": "a", "contexts": [], "latency_s": 1.0, "model_calls": True},
    ],
)
def test_cached_values_of_another_shape_are_dropped_and_redone(engines, tmp_path, caplog, value):
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    run(built, QUESTIONS[:1], None, cache=cache)
    line = json.loads(cache.read_text().splitlines()[0])
    line["value"] = value
    good = cache.read_text().splitlines()[1]
    cache.write_text(json.dumps(line) + "\n" + good + "\n")
    result = run(built, QUESTIONS[:1], None, cache=cache)
    assert f"{cache}: skipped damaged line(s) 1;" in caplog.text
    assert [r.cached for r in result.records] == [False, True]  # the other answer is reused
    assert len(llm.prompts) == 3 and not result.failures
    bad_score = {"kind": "judgement", "key": ["k"], "value": {"score": "high"}}
    cache.write_text(json.dumps(bad_score) + "\n")
    assert ResultCache(cache).get("judgement", ("k",)) is None


def test_a_cache_that_is_a_folder_is_an_error_naming_it(tmp_path):
    (tmp_path / "cache.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"cache\.jsonl is a folder"):
        ResultCache(tmp_path / "cache.jsonl")


def test_one_question_asked_of_two_documents_is_scored_against_each(fixed_engine, tmp_path):
    # Cached under the question alone, the second took the first's evidence scores.
    documents = {"a.txt": "Alpha. The colour is red.", "b.txt": "Beta. The colour is blue."}
    questions = [
        Question("What is the colour?", "a.txt", "The colour is red."),
        Question("What is the colour?", "b.txt", "The colour is blue."),
    ]
    engine = fixed_engine(answers={}, sources=[("a.txt", 0, 25, documents["a.txt"])])
    for _ in range(2):  # and again from the cache
        result = run({"a": engine}, questions, documents=documents, cache=tmp_path / "c.jsonl")
        recall = [(r.document, r.metrics["evidence_recall"]) for r in result.records]
        assert recall == [("a.txt", 1.0), ("b.txt", 0.0)]
    assert "- Questions: 2" in write_report(result, tmp_path, plot=False)["report"].read_text()


def test_a_lone_surrogate_in_a_cache_key_is_kept_as_its_escape(tmp_path):
    path = tmp_path / "cache.jsonl"
    ResultCache(path).put("judgement", ("q \udc80",), {"score": 0.5})  # a strict write failed
    assert ResultCache(path).get("judgement", ("q \udc80",)) == {"score": 0.5}
