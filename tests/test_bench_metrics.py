"""Hand-checked serving metrics (tokenfab.bench.metrics) on hand-made timestamps.

Every expected number below is worked out by hand in the comments; definitions follow vLLM's `bench serve`.
"""
from __future__ import annotations

import math

import pytest

from tokenfab.bench.metrics import (
    compute_metrics,
    peak_concurrency,
    percentile_key,
    steady_state_throughputs,
    steady_state_window,
    summarize_ms,
)
from tokenfab.bench.request import RequestRecord


def _rec(send, chunks, output_tokens, prompt_len, end=None, text="", success=True, error=""):
    """A successful record from a send time and absolute chunk arrival times (s)."""
    if not success:
        return RequestRecord(success=False, prompt_len=prompt_len, error=error, send_time=send,
                             end_time=end if end is not None else send + 0.01)
    return RequestRecord(
        success=True, prompt_len=prompt_len, output_tokens=output_tokens,
        ttft=chunks[0] - send, itl=[b - a for a, b in zip(chunks, chunks[1:])], latency=chunks[-1] - send,
        generated_text=text, send_time=send, first_token_time=chunks[0], last_token_time=chunks[-1],
        end_time=end if end is not None else chunks[-1] + 0.01, chunk_times=[c - send for c in chunks],
    )


@pytest.fixture
def records():
    return [
        # A: ttft 0.10, e2el 0.30, itl [0.05, 0.10, 0.05], 4 tokens -> tpot (0.30-0.10)/3 = 0.0666...
        _rec(0.00, [0.10, 0.15, 0.25, 0.30], output_tokens=4, prompt_len=10),
        # B: 2 chunks carrying 5 tokens: ttft 0.20, e2el 0.40, itl [0.20], tpot (0.40-0.20)/4 = 0.05
        _rec(0.05, [0.25, 0.45], output_tokens=5, prompt_len=20),
        # C: a 1-token request: ttft 0.30 = e2el 0.30, no itl, excluded from TPOT
        _rec(0.10, [0.40], output_tokens=1, prompt_len=30),
        # D: failed: counts in `failed`, 0 output tokens, no latency values, input tokens not counted
        _rec(0.15, None, None, prompt_len=40, success=False, error="HTTP 500 Internal Server Error: boom"),
        # E: no usage chunk -> tokens counted from the text ("a b c" -> 3 with the whitespace counter):
        #    ttft 0.10, e2el 0.30, itl [0.05, 0.15], tpot (0.30-0.10)/2 = 0.10
        _rec(0.20, [0.30, 0.35, 0.50], output_tokens=None, prompt_len=50, text="a b c"),
    ]


def _count_words(text):
    return len(text.split())


def test_counts_and_throughputs(records):
    m = compute_metrics(records, duration_s=2.0, percentiles=[99], count_tokens=_count_words, num_devices=2)
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["total_input_tokens"] == 10 + 20 + 30 + 50          # failed D's 40 not counted
    assert m["total_output_tokens"] == 4 + 5 + 1 + 3              # = 13
    assert m["input_lens"] == [10, 20, 30, 40, 50]
    assert m["output_lens"] == [4, 5, 1, 0, 3]
    assert m["request_throughput"] == pytest.approx(4 / 2.0)      # 2.0 req/s
    assert m["output_throughput"] == pytest.approx(13 / 2.0)      # 6.5 tok/s
    assert m["total_token_throughput"] == pytest.approx(123 / 2.0)  # 61.5 tok/s
    assert m["num_devices"] == 2
    assert m["output_throughput_per_device"] == pytest.approx(3.25)
    assert m["total_token_throughput_per_device"] == pytest.approx(30.75)
    # Successful intervals [send, end): A [0, .31) B [.05, .46) C [.10, .41) E [.20, .51) all overlap at 0.2 s.
    assert m["max_concurrent_requests"] == 4
    # All 4 + 2 + 1 + 3 = 10 chunks land in the first 1-second bucket.
    assert m["max_output_tokens_per_s"] == 10


def test_ttft(records):
    m = compute_metrics(records, 2.0, [99], count_tokens=_count_words)
    # TTFTs [0.10, 0.20, 0.30, 0.10] s: mean 0.175; median of sorted [.1, .1, .2, .3] = 0.15;
    # population std: deviations -.075 -.075 .025 .125 -> squares sum 0.0275 / 4 = 0.006875 -> sqrt = 0.0829156;
    # p99: rank 0.99 * 3 = 2.97 -> 0.2 + 0.97 * 0.1 = 0.297.
    assert m["mean_ttft_ms"] == pytest.approx(175.0)
    assert m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(0.006875))
    assert m["p99_ttft_ms"] == pytest.approx(297.0)
    assert m["ttfts"] == pytest.approx([0.10, 0.20, 0.30, 0.0, 0.10])  # failed request reported as 0


def test_tpot_excludes_one_token_requests(records):
    m = compute_metrics(records, 2.0, [99], count_tokens=_count_words)
    # TPOTs: A 0.2/3, B 0.2/4 = 0.05, E 0.2/2 = 0.10 (C has 1 token, D failed).
    tpots = [0.2 / 3, 0.05, 0.10]
    assert m["tpots"] == pytest.approx(tpots)
    assert m["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / 3)  # 72.222 ms
    assert m["median_tpot_ms"] == pytest.approx(1000 * 0.2 / 3)      # 66.667 ms
    # p99: sorted [0.05, 0.0667, 0.10], rank 1.98 -> 0.0667 + 0.98 * (0.10 - 0.0667) = 0.099333
    assert m["p99_tpot_ms"] == pytest.approx(1000 * (0.2 / 3 + 0.98 * (0.10 - 0.2 / 3)))


def test_itl_pooled(records):
    m = compute_metrics(records, 2.0, [99], count_tokens=_count_words)
    # Pooled gaps: A .05 .10 .05, B .20, E .05 .15 -> sorted [.05 .05 .05 .10 .15 .20], sum 0.60
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["median_itl_ms"] == pytest.approx(75.0)  # (0.05 + 0.10) / 2
    # deviations -.05 -.05 -.05 0 .05 .10 -> squares 0.02 / 6 -> sqrt(0.0033333) = 0.057735
    assert m["std_itl_ms"] == pytest.approx(1000 * math.sqrt(0.02 / 6))
    assert m["p99_itl_ms"] == pytest.approx(197.5)    # rank 4.95 -> 0.15 + 0.95 * 0.05
    assert m["itls"][0] == pytest.approx([0.05, 0.10, 0.05])
    assert m["itls"][3] == []


def test_e2el(records):
    m = compute_metrics(records, 2.0, [50, 99], count_tokens=_count_words)
    # E2ELs [0.30, 0.40, 0.30, 0.30]: mean 0.325, median 0.30, p99 rank 2.97 -> 0.3 + 0.97 * 0.1 = 0.397
    assert m["mean_e2el_ms"] == pytest.approx(325.0)
    assert m["median_e2el_ms"] == pytest.approx(300.0)
    assert m["p99_e2el_ms"] == pytest.approx(397.0)
    assert m["p50_e2el_ms"] == pytest.approx(m["median_e2el_ms"])


def test_missing_usage_without_tokenizer_counts_one_token(records):
    m = compute_metrics(records, 2.0, [99])  # no count_tokens: E counts as 1 token (vLLM's fallback)
    assert m["output_lens"] == [4, 5, 1, 0, 1]
    assert len(m["tpots"]) == 2  # E now has 1 token and drops out of TPOT


def test_all_failed_gives_zeros():
    recs = [RequestRecord(success=False, prompt_len=5, error="x", send_time=0.0, end_time=0.1)]
    m = compute_metrics(recs, 1.0, [99])
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["output_throughput"] == 0.0


def test_summary_and_percentile_keys():
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9" and percentile_key(50.0) == "p50"
    s = summarize_ms([0.01, 0.02, 0.03, 0.04], [90, 99.9])
    # rank 0.9 * 3 = 2.7 -> 0.03 + 0.7 * 0.01 = 0.037; rank 0.999 * 3 = 2.997 -> 0.03997
    assert s["p90"] == pytest.approx(37.0) and s["p99.9"] == pytest.approx(39.97)
    assert s["mean"] == pytest.approx(25.0) and s["median"] == pytest.approx(25.0)
    assert summarize_ms([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_steady_state_window():
    # Concurrency 2, back-to-back refills: in flight >= 2 from t=0 until the drain starts at t=3.
    iv = [(0.0, 1.0), (0.0, 2.0), (1.0, 3.0), (2.0, 2.5), (2.5, 4.0)]
    assert peak_concurrency(iv) == 2
    assert steady_state_window(iv, 2) == (0.0, 3.0)
    assert steady_state_window(iv, None) == (0.0, 3.0)   # no cap: the peak level is the target
    assert steady_state_window(iv, 6) is None            # 5 requests can never reach 5 in flight here
    # Ramp-up: the 3rd request starts late, so the window starts when 3 are in flight and ends at the first finish.
    assert steady_state_window([(0.0, 5.0), (0.5, 6.0), (1.0, 4.0)], 3) == (1.0, 4.0)
    assert steady_state_window([], 2) is None


def test_steady_state_throughputs(records):
    m = compute_metrics(records, 2.0, [99], count_tokens=_count_words)
    w = steady_state_throughputs(records, m["output_lens"], (0.09, 0.28))
    # In [0.09, 0.28): A's chunks at .10 .15 .25 (1 token each) = 3; B's chunk at .25 carries 5/2 = 2.5 tokens;
    # C (.40) and E (.30 .35 .50) have none. Prompts whose first token is inside: A (10) + B (20) = 30.
    # No request's last token falls inside. Window length 0.19 s.
    assert w["steady_duration"] == pytest.approx(0.19)
    assert w["steady_output_throughput"] == pytest.approx(5.5 / 0.19)
    assert w["steady_total_token_throughput"] == pytest.approx(35.5 / 0.19)
    assert w["steady_request_throughput"] == 0.0
    # Whole span: every token and prompt of the 4 successful requests, 4 completions.
    w = steady_state_throughputs(records, m["output_lens"], (0.0, 1.0))
    assert w["steady_output_throughput"] == pytest.approx(13.0)
    assert w["steady_total_token_throughput"] == pytest.approx(123.0)
    assert w["steady_request_throughput"] == pytest.approx(4.0)


def test_goodput_hand_worked(records):
    # Per successful request (s): ttft / tpot / e2el
    #   A 0.10 / 0.0667 / 0.30    B 0.20 / 0.05 / 0.40    C 0.30 / 0 (one token) / 0.30    E 0.10 / 0.10 / 0.30
    # D failed: never good.
    m = compute_metrics(records, duration_s=2.0, count_tokens=_count_words, goodput_slos_ms={"ttft": 250})
    assert m["request_goodput"] == pytest.approx(3 / 2.0)        # A, B, E; C's 0.30 misses
    m = compute_metrics(records, duration_s=2.0, count_tokens=_count_words,
                        goodput_slos_ms={"ttft": 250, "tpot": 60})
    assert m["request_goodput"] == pytest.approx(1 / 2.0)        # only B: A's tpot 66.7 ms and E's 100 ms miss
    m = compute_metrics(records, duration_s=2.0, count_tokens=_count_words,
                        goodput_slos_ms={"ttft": 500, "tpot": 70, "e2el": 350})
    assert m["request_goodput"] == pytest.approx(2 / 2.0)        # A (tpot 66.7 <= 70), C (tpot 0); B e2el 400 misses
    m = compute_metrics(records, duration_s=4.0, count_tokens=_count_words, goodput_slos_ms={"tpot": 0})
    assert m["request_goodput"] == pytest.approx(1 / 4.0)        # only the one-token request C has tpot 0
    assert compute_metrics(records, duration_s=2.0, count_tokens=_count_words)["request_goodput"] is None
    with pytest.raises(ValueError, match="itl"):
        compute_metrics(records, duration_s=2.0, count_tokens=_count_words, goodput_slos_ms={"itl": 5})
    # The bound is inclusive (vLLM: SLO >= value); exact binary fractions: ttft 0.25, tpot 0.25, e2el 0.5.
    exact = [_rec(0.0, [0.25, 0.5], output_tokens=2, prompt_len=1)]
    assert compute_metrics(exact, 1.0, goodput_slos_ms={"ttft": 250, "tpot": 250, "e2el": 500}
                           )["request_goodput"] == 1.0
    assert compute_metrics(exact, 1.0, goodput_slos_ms={"ttft": 249.9})["request_goodput"] == 0.0


def test_parse_goodput_vllm_syntax():
    from tokenfab.bench import BenchError
    from tokenfab.bench.serve import parse_goodput, parse_metadata

    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 1000.0}
    for bad, msg in ((["ttft=500"], "KEY:VALUE"), (["itl:5"], "ttft, tpot, e2el"), (["ttft:-1"], ">= 0"),
                     (["ttft:abc"], "KEY:VALUE")):
        with pytest.raises(BenchError, match=msg):
            parse_goodput(bad)
    assert parse_metadata(["tp=1", "hw = cpu", "note=a=b"]) == {"tp": "1", "hw": "cpu", "note": "a=b"}
    with pytest.raises(BenchError, match="--metadata 'novalue' is not KEY=VALUE"):
        parse_metadata(["novalue"])
