"""`splitserve bench goodput`: the rate search on its own (pure), the per-request target check, the
probe workloads, bad input, and the whole command against a small real OpenAI server on localhost
(the one `bench serve`'s tests use). Its closed-form goodput against a server that is not
Splitserve is tests/integration/test_goodput.py."""

import argparse
import json

import numpy as np
import pytest

from splitserve.bench import goodput as gp
from splitserve.bench import stats as st
from splitserve.bench import workloads as wl
from splitserve.bench.clients import RequestResult
from splitserve.bench.rate_search import RateSearch, SearchLimits, StopReason
from tests.unit.splitserve.test_bench_serve import FakeOpenAI

AZURE_ROWS = [("2023-11-16 18:15:46.6805900", 374, 44), ("2023-11-16 18:15:50.9951690", 396, 109),
              ("2023-11-16 18:15:51.2250000", 879, 55), ("2023-11-16 18:15:52.0000000", 91, 1),
              ("2023-11-16 18:15:53.5000000", 2048, 300)]


@pytest.fixture
def azure(tmp_path) -> str:
    """A few rows in the Azure LLM inference trace's format (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{i},{o}\n" for t, i, o in AZURE_ROWS))
    return str(path)


def run_search(limits: SearchLimits, passes) -> RateSearch:
    search = RateSearch(limits)
    while (rate := search.next_rate()) is not None:
        search.record(rate, passes(rate))
    return search


@pytest.mark.parametrize("true_goodput", [0.37, 3.0, 7.3, 55.0])
def test_search_brackets_then_bisects_to_the_goodput(true_goodput):
    limits = SearchLimits(start_rate=2.0, min_rate=0.01, max_rate=1000.0, precision=0.05, max_probes=40)
    search = run_search(limits, lambda r: r <= true_goodput)
    assert search.stop_reason is StopReason.CONVERGED
    assert true_goodput * (1 - 0.05) <= search.goodput <= true_goodput
    assert search.failed > true_goodput and search.failed - search.passed <= 0.05 * search.passed
    rates = [r for r, _ in search.tried]
    assert len(rates) == len(set(rates)) and len(rates) < 20        # no rate tried twice


def test_search_stops_at_its_limits_and_reports_why():
    limits = SearchLimits(start_rate=1.0, min_rate=0.1, max_rate=16.0, precision=0.1, max_probes=40)
    always = run_search(limits, lambda r: True)
    assert (always.stop_reason, always.goodput, [r for r, _ in always.tried]) == \
        (StopReason.MAX_RATE, 16.0, [1.0, 2.0, 4.0, 8.0, 16.0])
    never = run_search(limits, lambda r: False)
    assert (never.stop_reason, never.goodput, never.tried[-1]) == (StopReason.MIN_RATE, 0.0, (0.1, False))
    budget = run_search(SearchLimits(1.0, 0.1, 1000.0, 0.01, max_probes=3), lambda r: r < 3.3)
    assert (budget.stop_reason, len(budget.tried), budget.goodput) == (StopReason.MAX_PROBES, 3, 2.0)
    told = RateSearch(limits)
    told.stop(StopReason.UNATTAINABLE)
    assert told.next_rate() is None and told.goodput == 0.0


@pytest.mark.parametrize("bad", [dict(start_rate=0.0), dict(max_rate=float("nan")), dict(min_rate=5.0, max_rate=1.0),
                                 dict(precision=1.0), dict(max_probes=0)])
def test_search_limits_refuse_nonsense(bad):
    kw = dict(start_rate=1.0, min_rate=0.1, max_rate=10.0, precision=0.1, max_probes=5) | bad
    with pytest.raises(ValueError):
        SearchLimits(**kw)


def result(ttft_s, chunk_gaps, chunk_tokens, error=None) -> RequestResult:
    r = RequestResult(prompt_len=8, expected_tokens=sum(chunk_tokens), sent_at=10.0, error=error)
    t = 10.0 + ttft_s
    r.chunk_times, r.chunk_tokens = [t], [chunk_tokens[0]]
    for gap, k in zip(chunk_gaps, chunk_tokens[1:]):
        t += gap
        r.chunk_times.append(t)
        r.chunk_tokens.append(k)
    r.ended_at = t + 0.5          # the stream's tail after the last token: not part of the ITL
    return r


def test_a_request_meets_both_targets_by_its_mean_itl():
    targets = gp.Targets(ttft_s=0.2, itl_s=0.010)
    steady = result(0.1, [0.009] * 9, [1] * 10)
    assert gp.request_mean_itl_s(steady) == pytest.approx(0.009)
    assert targets.meets(steady) == (True, True)
    # one long stall, yet the mean stays under the target: it counts as met (DistServe's TPOT)
    stall = result(0.1, [0.005] * 8 + [0.040], [1] * 10)
    assert targets.meets(stall) == (True, True)
    assert targets.meets(result(0.1, [0.012] * 9, [1] * 10)) == (True, False)
    assert targets.meets(result(0.3, [0.001] * 9, [1] * 10)) == (False, True)
    assert targets.meets(result(0.1, [0.001] * 9, [1] * 10, error="timeout")) == (False, False)
    # a first chunk of several tokens: they have no gap; the mean is that of bench serve's samples
    chunked = result(0.1, [0.02, 0.004], [3, 2, 1])
    assert gp.request_mean_itl_s(chunked) == pytest.approx(
        float(np.mean(st.itl_samples(chunked.chunk_times, chunked.chunk_tokens))))
    assert gp.request_mean_itl_s(result(0.1, [], [4])) is None
    assert targets.meets(result(0.1, [], [4])) == (True, True)


def test_poisson_arrivals_have_the_rate_and_are_seeded():
    t = gp.poisson_arrivals(8.0, 4000, (0, 1))
    assert t[0] == 0.0 and np.all(np.diff(t) > 0)
    assert (len(t) - 1) / t[-1] == pytest.approx(8.0, rel=0.05)
    gaps = np.diff(t)
    assert np.std(gaps) == pytest.approx(np.mean(gaps), rel=0.1)       # exponential gaps
    assert np.array_equal(t, gp.poisson_arrivals(8.0, 4000, (0, 1)))
    assert not np.array_equal(t, gp.poisson_arrivals(8.0, 4000, (0, 2)))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gp.add_arguments(parser)
    return parser.parse_args(["--no-progress", "--api-key", "", *argv])


def test_probes_take_trace_lengths_with_their_own_prompts_and_poisson_times(azure):
    args = parse("--ttft-ms", "1000", "--itl-ms", "50", "--trace", azure)
    _, plan = gp.check_args(args)
    specs = gp.probe_specs(plan, args, rate=4.0, n=50, salt=3)
    rows = {(r.input_len, r.output_len) for r in plan.trace_rows}
    assert all((s.prompt_len, s.max_tokens) in rows for s in specs)
    prompts = [s.make_prompt() for s in specs[:5]]
    assert [len(p) for p in prompts] == [s.prompt_len for s in specs[:5]]
    assert len({tuple(p[:16]) for p in prompts}) == 5           # Azure requests share no prefix
    assert [(s.prompt_len, s.max_tokens) for s in specs[:10]] == [(s.prompt_len, s.max_tokens) for s in specs[5:15]]
    arrivals = [s.arrival_s for s in specs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    again = gp.probe_specs(plan, args, rate=4.0, n=50, salt=4)
    assert [s.make_prompt()[:8].tolist() for s in again[:5]] != [p[:8].tolist() for p in prompts[:5]]


def test_the_azure_trace_reads_as_rows_of_its_lengths(azure):
    rows, block = wl.load_trace(azure, scale=0.5, max_input_len=300, limit=4)
    assert block == 256 and len(rows) == 4
    assert [(r.input_len, r.output_len) for r in rows] == [(187, 22), (198, 54), (300, 28), (46, 1)]
    assert rows[0].timestamp_ms == 0.0 and rows[1].timestamp_ms == pytest.approx(4314.579, abs=0.01)
    assert all(len(r.hash_ids) == -(-r.input_len // block) for r in rows)


def test_the_default_warm_up_reaches_every_gpu_of_the_fleet():
    base = ("--ttft-ms", "1000", "--itl-ms", "50", "--isl", "8", "--osl", "4")
    for gpus, warmup in (("1", 2), ("4", 8)):
        args = parse(*base, "--gpus", gpus)
        gp.check_args(args)
        assert args.warmup == warmup
    args = parse(*base, "--gpus", "4", "--warmup", "0")
    gp.check_args(args)
    assert args.warmup == 0                         # an explicit count stands


@pytest.mark.parametrize("argv, message", [
    (["--ttft-ms", "0", "--itl-ms", "10", "--isl", "8", "--osl", "4"], "--ttft-ms"),
    (["--ttft-ms", "nan", "--itl-ms", "10", "--isl", "8", "--osl", "4"], "--ttft-ms"),
    (["--ttft-ms", "100", "--itl-ms", "10", "--isl", "8", "--osl", "4", "--attainment", "1.5"], "--attainment"),
    (["--ttft-ms", "100", "--itl-ms", "10", "--isl", "8", "--osl", "4", "--duration-s", "-1"], "--duration-s"),
    (["--ttft-ms", "100", "--itl-ms", "10", "--isl", "8", "--osl", "4", "--max-rate", "0"], "rates"),
    (["--ttft-ms", "100", "--itl-ms", "10", "--isl", "8", "--osl", "4", "--precision", "2"], "precision"),
    (["--ttft-ms", "100", "--itl-ms", "10"], "exactly one of"),
    (["--ttft-ms", "100", "--itl-ms", "10", "--trace", "/nonexistent.jsonl"], "cannot read trace"),
])
def test_bad_input_is_a_clear_error_with_status_2(argv, message, capsys):
    assert gp.main(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench goodput: ") and message in err and "Traceback" not in err


def lines(capsys) -> tuple[list[dict], str]:
    out = capsys.readouterr()
    return [json.loads(x) for x in out.out.splitlines() if x.strip()], out.err


def test_whole_command_against_a_real_openai_server(tmp_path, capsys):
    out, png = tmp_path / "g.jsonl", tmp_path / "g.png"
    with FakeOpenAI(delay_s=0.001, max_chunk=1) as server:
        rc = gp.main(parse("--url", server.url, "--ttft-ms", "2000", "--itl-ms", "500", "--isl", "16",
                           "--osl", "4", "--duration-s", "1", "--start-rate", "4", "--max-rate", "8",
                           "--min-requests", "6", "--gpus", "2", "--warmup", "1",
                           "--output", str(out), "--plot", str(png)))
    assert rc == 0
    got, err = lines(capsys)
    assert [g["bench"] for g in got] == ["goodput_alone", "goodput_probe", "goodput_probe", "goodput"]
    probes, summary = got[1:3], got[-1]
    assert [p["rate_req_s"] for p in probes] == [4.0, 8.0]
    assert all(p["passed"] and p["attainment"] == 1.0 and p["errors"] == 0 for p in probes)
    assert probes[1]["requests"] == 8 and probes[0]["requests"] == 6       # rate x duration, at least 6
    assert summary["goodput_req_s"] == 8.0 and summary["goodput_req_s_per_gpu"] == 4.0
    assert summary["stop_reason"] == "max_rate" and not summary["converged"]
    assert [c["rate_req_s"] for c in summary["attainment_curve"]] == [4.0, 8.0]
    assert summary["model"] == "fake-model" and summary["ttft_ms"] == 2000 and summary["itl_definition"]
    assert [json.loads(x) for x in out.read_text().splitlines()] == got
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "4 req/s: 6 of 6 met both targets" in err and "goodput 8 req/s, 4 per GPU (at least" in err
    assert len(server.prompts) == 1 + gp.ALONE_REQUESTS + 6 + 8


def test_targets_an_idle_server_misses_end_the_run_at_once(capsys):
    with FakeOpenAI(delay_s=0.02, max_chunk=1) as server:
        rc = gp.main(parse("--url", server.url, "--ttft-ms", "2000", "--itl-ms", "5", "--isl", "16",
                           "--osl", "4", "--warmup", "0"))
    assert rc == 0
    got, err = lines(capsys)
    assert [g["bench"] for g in got] == ["goodput_alone", "goodput"]
    assert got[-1]["goodput_req_s"] == 0.0 and got[-1]["stop_reason"] == "unattainable"
    assert got[0]["ttft_attainment"] == 1.0 and got[0]["itl_attainment"] == 0.0
    assert "the targets are never met" in err and "Goodput: 0" in err
    assert len(server.prompts) == gp.ALONE_REQUESTS


def test_a_time_budget_starts_no_probe_that_would_end_past_it(capsys):
    with FakeOpenAI(delay_s=0.001, max_chunk=1) as server:
        rc = gp.main(parse("--url", server.url, "--ttft-ms", "2000", "--itl-ms", "500", "--isl", "16", "--osl", "4",
                           "--duration-s", "1", "--start-rate", "4", "--min-requests", "12", "--warmup", "0",
                           "--time-budget-s", "4"))
    assert rc == 0
    got, err = lines(capsys)
    # 12 requests at 4/s take 3 s; the next probe (12 at 8/s) would need 1.5 s more
    assert [p["rate_req_s"] for p in got if p["bench"] == "goodput_probe"] == [4.0]
    assert got[-1]["stop_reason"] == "time_budget" and got[-1]["goodput_req_s"] == 4.0
    assert "the time budget ran out" in err
