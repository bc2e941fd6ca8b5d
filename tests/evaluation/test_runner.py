"""The runner: records, evidence metrics, caching and resume, failing judges and engines."""

from __future__ import annotations

import json
import threading

import pytest

from llama_index.packs.self_rag_rse.evaluation import (
    Judge,
    JudgementError,
    Question,
    Sample,
    evaluate,
)
from llama_index.packs.self_rag_rse.evaluation.result import ResultCache

DOC = "The while loop repeats a suite. The else clause runs when the loop ends normally."
DOCUMENTS = {"loops.txt": DOC}
QUESTIONS = [
    Question("When does else run?", "loops.txt", "The else clause runs when the loop ends"),
    Question("What does while do?", "loops.txt", "The while loop repeats a suite."),
]


class CountingJudge(Judge):
    """``length`` = answer length / 100, ``constant`` = 1; fails where ``failing`` says."""

    backend = "counting"

    def __init__(
        self,
        failing: set[tuple[str, str]] | None = None,
        name: str = "counter",
        error: type[Exception] = JudgementError,
    ) -> None:
        self.failing = failing or set()
        self.error = error
        self.calls: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._name = name

    @property
    def identity(self) -> str:
        return self._name

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("length", "constant")

    def applicable(self, metric: str, sample: Sample) -> bool:
        return True

    async def ascore(self, metric: str, sample: Sample) -> float:
        with self._lock:
            self.calls.append((sample.question, sample.answer, metric))
        if (sample.question, metric) in self.failing:
            raise self.error("scripted failure")
        return len(sample.answer) / 100 if metric == "length" else 1.0


@pytest.fixture
def engines(fixed_engine, scripted_llm):
    llm = scripted_llm(lambda prompt: "ok")
    answers = {q.question: f"Answer to {q.question}" for q in QUESTIONS}
    whole = fixed_engine(answers=answers, sources=[("loops.txt", 0, len(DOC), DOC)], llm=llm)
    first = fixed_engine(answers=answers, sources=[("loops.txt", 0, 31, DOC[:31])], llm=llm)
    return {"whole": whole, "first": first}, llm


def test_records_hold_answers_costs_and_evidence(engines):
    built, llm = engines
    result = evaluate(built, QUESTIONS, CountingJudge(), documents=DOCUMENTS, progress=False)
    assert [(r.question, r.engine) for r in result.records] == [
        (q.question, e) for q in QUESTIONS for e in ("whole", "first")
    ]
    assert result.metrics == ["length", "constant", "evidence_recall", "evidence_precision"]
    assert result.judge == "counter"
    by_key = {(r.question, r.engine): r for r in result.records}
    whole = by_key[("When does else run?", "whole")]
    assert whole.answer == "Answer to When does else run?"
    assert whole.contexts == [DOC]
    assert whole.latency_s is not None and whole.latency_s >= 0
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
    first = evaluate(
        built, QUESTIONS, broken, documents=DOCUMENTS, cache=cache, retries=1, progress=False
    )
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
    second = evaluate(built, QUESTIONS, fixed, documents=DOCUMENTS, cache=cache, progress=False)
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
    assert [r.metrics for r in second.records] == [
        {**r.metrics, "length": r.metrics["length"]} for r in second.records
    ]
    assert all(r.metrics["length"] is not None for r in second.records)
    # Answers come back with their original latency and model calls.
    assert [r.model_calls for r in second.records] == [r.model_calls for r in first.records]

    # Another judge reuses the answers but judges everything itself.
    other = CountingJudge(name="another judge")
    evaluate(built, QUESTIONS, other, documents=DOCUMENTS, cache=cache, progress=False)
    assert len(other.calls) == 8


def test_transient_failures_are_retried_within_the_run(engines):
    built, _ = engines
    down = CountingJudge(failing={("When does else run?", "length")}, error=ConnectionError)
    result = evaluate(built, QUESTIONS, down, retries=2, progress=False)
    assert len(down.calls) == 6 + 2 * 3  # the two failing judgements tried three times
    assert {e for r in result.records for e in r.errors.values()} == {
        "ConnectionError: scripted failure"
    }


def test_a_run_cut_short_resumes_from_what_was_written(engines, tmp_path, caplog):
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    evaluate(built, QUESTIONS, CountingJudge(), cache=cache, progress=False)
    lines = cache.read_text().splitlines()
    # Keep the answers and half the judgements, and cut the last line in the middle.
    answers = [x for x in lines if json.loads(x)["kind"] == "answer"]
    judged = [x for x in lines if json.loads(x)["kind"] == "judgement"]
    cache.write_text("\n".join([*answers, *judged[:4], judged[4][:20]]) + "\n")
    judge = CountingJudge()
    result = evaluate(built, QUESTIONS, judge, cache=cache, progress=False)
    assert "skipped 1 unreadable line(s)" in caplog.text
    assert len(judge.calls) == 4
    assert not result.failures and len(llm.prompts) == 4
    assert len(ResultCache(cache)) == len(lines)


def test_settings_key_and_a_new_answer_invalidate_the_cache(engines, tmp_path):
    built, llm = engines
    cache = tmp_path / "cache.jsonl"
    evaluate(built, QUESTIONS, CountingJudge(), cache=cache, settings_key="a", progress=False)
    judge = CountingJudge()
    evaluate(built, QUESTIONS, judge, cache=cache, settings_key="b", progress=False)
    assert len(llm.prompts) == 8 and len(judge.calls) == 8


def test_failing_engine_is_recorded_and_not_judged(fixed_engine, tmp_path):
    engine = fixed_engine(answers={"ok?": "fine"}, fail_on={"boom?"})
    judge = CountingJudge()
    result = evaluate({"e": engine}, ["ok?", "boom?"], judge, progress=False)
    boom = result.records[1]
    assert boom.errors == {"answer": "RuntimeError: engine exploded"}
    assert boom.answer == "" and boom.metrics == {} and boom.latency_s is None
    assert {c[0] for c in judge.calls} == {"ok?"}
    assert result.failures == [("boom?", "e", "answer", "RuntimeError: engine exploded")]


def test_metric_selection_and_no_judge(engines):
    built, _ = engines
    result = evaluate(
        built, QUESTIONS, CountingJudge(), documents=DOCUMENTS, metrics=["constant"],
        progress=False,
    )  # fmt: skip
    assert result.metrics == ["constant"]
    with pytest.raises(ValueError, match="unknown metric"):
        evaluate(built, QUESTIONS, CountingJudge(), metrics=["faithfulness"], progress=False)
    bare = evaluate(built, QUESTIONS, None, documents=DOCUMENTS, progress=False)
    assert bare.judge is None
    assert bare.metrics == ["evidence_recall", "evidence_precision"]


def test_bad_arguments(engines):
    built, _ = engines
    with pytest.raises(ValueError, match="at least one engine"):
        evaluate({}, QUESTIONS)
    with pytest.raises(ValueError, match="workers"):
        evaluate(built, QUESTIONS, workers=0)
    with pytest.raises(ValueError, match="question"):
        evaluate(built, [])


def test_judgements_run_concurrently_but_bounded(engines):
    import asyncio

    built, _ = engines
    state = {"now": 0, "peak": 0}

    class SlowJudge(CountingJudge):
        async def ascore(self, metric: str, sample: Sample) -> float:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            await asyncio.sleep(0.02)
            state["now"] -= 1
            return 0.5

    evaluate(built, QUESTIONS, SlowJudge(), workers=3, progress=False)
    assert state["peak"] == 3


def test_judge_timeouts_are_failures(engines):
    import asyncio

    built, _ = engines

    class HangingJudge(CountingJudge):
        async def ascore(self, metric: str, sample: Sample) -> float:
            await asyncio.sleep(10)
            return 1.0

    result = evaluate(built, QUESTIONS[:1], HangingJudge(), timeout_s=0.05, retries=0,
                      progress=False)  # fmt: skip
    assert all("TimeoutError" in e for r in result.records for e in r.errors.values())
    assert len(result.failures) == 4


def test_ragas_path_through_the_runner(engines, scripted_llm, ragas_rules, word_embedding):
    pytest.importorskip("ragas")
    from llama_index.packs.self_rag_rse.evaluation import RagasJudge

    built, _ = engines
    judge = RagasJudge(scripted_llm(ragas_rules), word_embedding)
    questions = [
        Question(q.question, q.document, q.evidence, reference=q.evidence) for q in QUESTIONS
    ]
    result = evaluate(built, questions, judge, documents=DOCUMENTS, progress=False)
    assert not result.failures
    by_key = {(r.question, r.engine): r for r in result.records}
    # The answer "Answer to ..." is one statement, not in the context: faithfulness 0.
    whole = by_key[("When does else run?", "whole")]
    assert whole.metrics["faithfulness"] == 0.0
    # The reference (the evidence) is in the whole document, not in its first sentence.
    assert whole.metrics["context_recall"] == 1.0
    assert by_key[("When does else run?", "first")].metrics["context_recall"] == 0.0
    assert "context_utilization" not in whole.metrics  # a reference was given
    assert result.judge == judge.identity


def test_a_nan_score_is_a_failed_judgement(engines):
    built, _ = engines

    class NanJudge(CountingJudge):
        async def ascore(self, metric: str, sample: Sample) -> float:
            self.calls.append((sample.question, sample.answer, metric))
            return float("nan")

    judge = NanJudge()
    result = evaluate(built, QUESTIONS[:1], judge, progress=False)
    assert len(judge.calls) == 4  # not asked again: the same question gets the same reply
    assert all(r.metrics == {"length": None, "constant": None} for r in result.records)
    assert {e for r in result.records for e in r.errors.values()} == {
        "JudgementError: the judge returned nan"
    }
    json.dumps(result.to_json(), allow_nan=False)  # records.json stays valid JSON
