"""Tests of `splitserve bench serve`: the pure parts, then the whole command against small real
servers on localhost (FastAPI + uvicorn for HTTP, grpc for gRPC) that follow the streaming contract
with deterministic tokens. Those servers stand in for Splitserve only to test the client."""

import argparse
import asyncio
import itertools
import json
import threading
import time
from concurrent import futures

import numpy as np
import pytest

from runtime.net import free_port
from splitserve.bench import clients as bc
from splitserve.bench import serve as bs
from splitserve.bench import stats as st
from splitserve.bench import workloads as wl
from splitserve.bench.plot import frontier_levels, pareto_frontier, plot_pareto

# ---------------------------------------------------------------------------------------------
# SSE parsing


def _sse_stream() -> tuple[bytes, list[bytes]]:
    events = [json.dumps({"choices": [{"text": "a b", "token_ids": [i, i + 1]}]}).encode()
              for i in range(5)]
    wire = b""
    for i, ev in enumerate(events):
        nl = b"\r\n" if i % 2 else b"\n"  # both line endings in one stream
        wire += b"data: " + ev + nl + nl
    wire += b": keep-alive comment\n\ndata: [DONE]\n\n"
    return wire, events + [b"[DONE]"]


def test_sse_parser_every_two_way_split_gives_the_same_events():
    wire, expected = _sse_stream()
    for cut in range(len(wire) + 1):
        parser = bc.SseParser()
        got = parser.feed(wire[:cut]) + parser.feed(wire[cut:]) + parser.close()
        assert got == expected, cut


def test_sse_parser_byte_at_a_time_and_random_splits():
    wire, expected = _sse_stream()
    parser = bc.SseParser()
    got = [ev for b in range(len(wire)) for ev in parser.feed(wire[b:b + 1])] + parser.close()
    assert got == expected
    rng = np.random.default_rng(0)
    for _ in range(50):
        cuts = sorted(rng.choice(len(wire), size=6, replace=False).tolist())
        parser = bc.SseParser()
        got = [ev for a, b in zip([0] + cuts, cuts + [len(wire)]) for ev in parser.feed(wire[a:b])]
        assert got + parser.close() == expected


def test_sse_parser_multiline_data_other_fields_and_unterminated_last_event():
    parser = bc.SseParser()
    got = parser.feed(b"event: x\nid: 3\ndata: {\"a\":\ndata:1}\n\ndata: [DONE]")
    assert got == [b'{"a":\n1}']
    assert parser.close() == [b"[DONE]"]


def test_tally_events_counts_token_ids_text_fallback_usage_done_and_errors():
    events = [json.dumps({"choices": [{"text": "xyz", "token_ids": [1, 2, 3]}]}).encode(),
              json.dumps({"choices": [{"text": "q"}]}).encode(),  # no token ids: counts as one
              json.dumps({"choices": [{"text": ""}]}).encode(),  # empty delta: no token
              json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}).encode(),
              b"[DONE]"]
    tally = bc.tally_events(events)
    assert (tally.tokens, tally.done, tally.usage_completion_tokens, tally.error) == (4, True, 4, None)
    assert bc.tally_events([b'{"error": {"message": "boom"}}']).error == "server_error"


# ---------------------------------------------------------------------------------------------
# Summary math


def _result(ttft, gaps, tokens, prompt_len=10, expected=None, usage=None, error=None, t0=100.0):
    times = list(np.cumsum([t0 + ttft] + list(gaps)))
    r = bc.RequestResult(prompt_len, expected if expected is not None else sum(tokens), sent_at=t0,
                         ended_at=times[-1], chunk_times=times, chunk_tokens=list(tokens),
                         usage_completion_tokens=usage, error=error)
    return r


def test_itl_splits_a_multi_token_chunk_gap_evenly_and_skips_first_chunk_extras():
    itl = st.itl_samples([0.0, 1.0, 1.6, 2.0], [3, 1, 3, 2])
    assert np.allclose(itl, [1.0, 0.2, 0.2, 0.2, 0.2, 0.2])
    assert len(st.itl_samples([5.0], [4])) == 0


def test_summarize_level_percentiles_throughput_per_user_and_per_gpu():
    ok = [_result(ttft=0.1 * (i + 1), gaps=[0.01] * 9, tokens=[1] * 10) for i in range(10)]
    failed = [bc.RequestResult(10, 10, error="http_500"), bc.RequestResult(10, 10, error="timeout"),
              bc.RequestResult(10, 10, error="http_500")]
    s = st.summarize_level(ok + failed, duration_s=2.0, gpus=4)
    assert (s["requests"], s["errors"]) == (13, 3)
    assert s["error_kinds"] == {"http_500": 2, "timeout": 1}
    assert s["ttft_p50_s"] == pytest.approx(np.percentile([0.1 * (i + 1) for i in range(10)], 50))
    assert s["ttft_p99_s"] == pytest.approx(np.percentile([0.1 * (i + 1) for i in range(10)], 99))
    assert s["itl_p50_s"] == pytest.approx(0.01) and s["itl_p99_s"] == pytest.approx(0.01)
    assert s["output_tokens"] == 100 and s["input_tokens"] == 100
    assert s["output_tok_s"] == pytest.approx(50.0)
    assert s["output_tok_s_per_gpu"] == pytest.approx(12.5)
    assert s["input_tok_s"] == pytest.approx(50.0)
    assert s["total_tok_s_per_gpu"] == pytest.approx(25.0)
    # per user: (10 - 1) tokens over the 0.09 s decode phase = 100 tok/s for every request
    assert s["output_tok_s_per_user"] == pytest.approx(100.0)
    assert s["token_mismatches"] == 0
    assert s["e2e_p50_s"] == pytest.approx(np.median([0.1 * (i + 1) + 0.09 for i in range(10)]))


def test_summarize_level_counts_token_mismatches_and_handles_all_failed():
    short = _result(0.1, [0.01], [1, 1], expected=5)  # ignore_eos, yet 2 of 5 tokens
    bad_usage = _result(0.1, [0.01], [1, 1], usage=3)  # server's count disagrees with the stream
    s = st.summarize_level([short, bad_usage, _result(0.1, [0.01], [1, 1])], 1.0)
    assert s["token_mismatches"] == 2
    # throughput counts the tokens received (2 + 2 + 2), the workload the tokens asked for (5 + 2 + 2)
    assert s["output_tokens"] == 6 and s["output_tok_s"] == 6.0 and s["mean_output_len"] == 3.0
    s = st.summarize_level([bc.RequestResult(1, 1, error="ConnectError")], 1.0)
    assert s["errors"] == 1 and s["ttft_p50_s"] is None and s["output_tok_s_per_user"] is None
    assert s["output_tok_s"] == 0


def test_finish_classifies_incomplete_and_empty_streams():
    assert bc.RequestResult(1, 1, chunk_times=[1.0], chunk_tokens=[1]).finish(False).error == \
        "incomplete_stream"
    assert bc.RequestResult(1, 1).finish(True).error == "no_tokens"
    assert bc.RequestResult(1, 1, chunk_times=[1.0], chunk_tokens=[1]).finish(True).error is None


# ---------------------------------------------------------------------------------------------
# Workloads


def test_scenarios_and_concurrency_parsing():
    assert wl.parse_scenario("1k1k") == (1024, 1024)
    assert wl.parse_scenario("1K8K") == (1024, 8192)
    assert wl.parse_scenario("8k1k") == (8192, 1024)
    assert wl.parse_scenario("2k1k") == (2048, 1024)
    for bad in ("1k", "fast", "k1k"):
        with pytest.raises(wl.BenchInputError):
            wl.parse_scenario(bad)
    assert wl.parse_concurrency("1,4, 16") == [1, 4, 16]
    for bad in ("", "0,1", "a"):
        with pytest.raises(wl.BenchInputError):
            wl.parse_concurrency(bad)
    assert [wl.default_num_requests(c) for c in (1, 4, 16, 256, 1024)] == [16, 16, 64, 1024, 1024]


def test_random_prompts_are_seeded_exact_length_and_below_vocab():
    specs = wl.synthetic_specs(isl=300, osl=7, num_requests=3, vocab_size=50, seed=(1, 0))
    prompts = [s.make_prompt() for s in specs]
    assert all(len(p) == 300 and p.min() >= 0 and p.max() < 50 for p in prompts)
    assert not np.array_equal(prompts[0], prompts[1])
    again = wl.synthetic_specs(300, 7, 3, 50, (1, 0))[2].make_prompt()
    assert np.array_equal(prompts[2], again)
    other_level = wl.synthetic_specs(300, 7, 3, 50, (1, 1))[2].make_prompt()
    assert not np.array_equal(prompts[2], other_level)
    assert all(s.max_tokens == 7 and s.prompt_len == 300 for s in specs)


def test_range_ratio_draws_lengths_uniformly_independently_and_reproducibly():
    def lengths(specs):
        return [(s.prompt_len, s.max_tokens) for s in specs]

    specs = wl.synthetic_specs(1024, 8192, 400, 50, (3, 0), range_ratio=0.8)
    ins, outs = np.array(lengths(specs)).T
    assert 819 <= ins.min() < 830 and 1010 < ins.max() <= 1024  # floor(0.8 * 1024) = 819
    assert 6553 <= outs.min() < 6650 and 8100 < outs.max() <= 8192  # floor(0.8 * 8192) = 6553
    assert abs(ins.mean() - (819 + 1024) / 2) < 15 and abs(outs.mean() - (6553 + 8192) / 2) < 100
    assert abs(np.corrcoef(ins, outs)[0, 1]) < 0.2  # drawn independently of each other
    assert len(specs[5].make_prompt()) == specs[5].prompt_len
    again = wl.synthetic_specs(1024, 8192, 400, 50, (3, 0), 0.8)
    assert lengths(again) == lengths(specs)
    assert np.array_equal(again[7].make_prompt(), specs[7].make_prompt())
    assert lengths(wl.synthetic_specs(1024, 8192, 10, 50, (3, 0), 0.8)) == lengths(specs)[:10]
    assert lengths(wl.synthetic_specs(1024, 8192, 400, 50, (3, 1), 0.8)) != lengths(specs)
    assert lengths(wl.synthetic_specs(1024, 8192, 400, 50, (4, 0), 0.8)) != lengths(specs)
    # ratio 1: exact lengths and the same prompts as before lengths could vary
    exact = wl.synthetic_specs(300, 7, 5, 50, (1, 0), range_ratio=1.0)
    assert lengths(exact) == [(300, 7)] * 5
    assert np.array_equal(exact[2].make_prompt(), wl.random_prompt((1, 0, 2), 300, 50))
    # a range that floors to 0 still sends at least one token each way
    tiny = wl.synthetic_specs(2, 1, 50, 50, (0, 0), range_ratio=0.1)
    assert {n for n, _ in lengths(tiny)} == {1, 2} and {m for _, m in lengths(tiny)} == {1}


def test_range_ratio_defaults_to_inferencemax_for_scenarios_only_and_rejects_bad_values(tmp_path, capsys):
    assert bs.make_plan(_args(scenario="1k8k")).range_ratio == 0.8
    assert bs.make_plan(_args(isl=100, osl=10)).range_ratio == 1.0
    assert bs.make_plan(_args(scenario="1k1k", random_range_ratio=1.0)).range_ratio == 1.0
    assert bs.make_plan(_args(isl=100, osl=10, random_range_ratio=0.5)).range_ratio == 0.5
    from splitserve.cli import build_parser
    cli = build_parser().parse_args(["bench", "serve", "--scenario", "8k1k", "--random-range-ratio", "0.9"])
    assert bs.make_plan(cli).range_ratio == 0.9
    for bad in (0.0, -0.5, 1.01, float("nan")):
        with pytest.raises(wl.BenchInputError, match="must be in"):
            bs.make_plan(_args(isl=100, osl=10, random_range_ratio=bad))
        assert bs.main(_args(scenario="1k1k", random_range_ratio=bad)) == 2
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n')
    assert bs.make_plan(_args(trace=str(trace))).trace_rows
    with pytest.raises(wl.BenchInputError, match="--trace"):
        bs.make_plan(_args(trace=str(trace), random_range_ratio=0.8))
    assert bs.main(_args(trace=str(trace), random_range_ratio=1.0)) == 2
    assert "--random-range-ratio" in capsys.readouterr().err


def test_trace_prompts_share_prefix_blocks_and_have_a_short_last_block():
    seed = (0, 0)
    a = wl.trace_prompt([1, 2, 3], 512 * 2 + 100, 512, 4000, seed)
    b = wl.trace_prompt([1, 2, 9, 10], 512 * 3 + 7, 512, 4000, seed)
    assert len(a) == 1124 and len(b) == 1543
    assert np.array_equal(a[:1024], b[:1024])  # blocks 1, 2 shared
    assert not np.array_equal(a[1024:1124], b[1024:1124])  # block 3 vs 9 differ
    # the short last block is a prefix of the same id's full block
    c = wl.trace_prompt([1, 2, 3, 4], 512 * 4, 512, 4000, seed)
    assert np.array_equal(a, c[:1124])
    assert a.max() < 4000 and a.min() >= 0
    # other seed (another level) -> other tokens for the same ids
    assert not np.array_equal(a, wl.trace_prompt([1, 2, 3], 1124, 512, 4000, (0, 1)))
    # lengths that disagree with the ids: drop blocks, or extend the last block
    assert len(wl.trace_prompt([1, 2, 3], 600, 512, 4000, seed)) == 600
    long = wl.trace_prompt([1], 700, 512, 4000, seed)
    assert len(long) == 700 and np.array_equal(long[:512], c[:512])


def test_load_trace_scales_lengths_and_block_size_together_and_caps(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1300, "output_length": 3, "hash_ids": [0, 1, 3]},
            {"timestamp": 1500, "input_length": 9000, "output_length": 1, "hash_ids": list(range(4, 22))}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got, block = wl.load_trace(str(path), scale=0.25, max_input_len=1000)
    assert block == 128
    assert [(r.input_len, r.output_len) for r in got] == [(275, 2), (325, 1), (1000, 1)]
    specs = wl.trace_specs(got, block, 4000, (0, 0), speedup=2.0)
    assert [s.arrival_s for s in specs] == [0.0, 0.25, 0.75]
    p0, p1 = specs[0].make_prompt(), specs[1].make_prompt()
    assert len(p0) == 275 and len(p1) == 325
    assert np.array_equal(p0[:256], p1[:256]) and not np.array_equal(p0[256:275], p1[256:275])
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(wl.BenchInputError):
        wl.load_trace(str(path))


def test_real_mooncake_trace_prompts_have_their_lengths():
    rows, block = wl.load_trace("/work/shared/data/traces/mooncake_synthetic_trace.jsonl",
                                scale=1 / 16, limit=50)
    for spec in wl.trace_specs(rows, block, 4000, (0, 0))[:20]:
        assert len(spec.make_prompt()) == spec.prompt_len


# ---------------------------------------------------------------------------------------------
# Pareto and plot


def test_pareto_frontier():
    pts = [(10, 100), (50, 80), (30, 60), (80, 20), (50, 70), (5, 100), (80, 20)]
    assert pareto_frontier(pts) == [0, 1, 3]
    assert pareto_frontier([]) == []
    assert pareto_frontier([(1, 1)]) == [0]
    levels = [{"concurrency": c, "output_tok_s_per_user": x, "output_tok_s_per_gpu": y}
              for c, (x, y) in zip([1, 4, 16, 64], [(100, 10), (90, 35), (40, 30), (20, 60)])]
    levels.append({"concurrency": 256, "output_tok_s_per_user": None, "output_tok_s_per_gpu": 0})
    assert [lv["concurrency"] for lv in frontier_levels(levels)] == [64, 4, 1]


def test_plot_writes_a_png(tmp_path):
    levels = [{"concurrency": c, "output_tok_s_per_user": 1000 / c, "output_tok_s_per_gpu": 50 * c ** 0.5}
              for c in (1, 4, 16, 64, 256)]
    out = tmp_path / "p.png"
    plot_pareto(levels, str(out), "tiny | 1k1k | cpu")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# The whole command against real local servers


class FakeOpenAI:
    """A FastAPI app that streams `max_tokens` deterministic tokens, 1-3 per chunk."""

    def __init__(self, fail_every=0, drop_every=0, api_key=None, delay_s=0.0005, max_chunk=3):
        self.fail_every, self.drop_every, self.api_key = fail_every, drop_every, api_key
        self.delay_s, self.max_chunk = delay_s, max_chunk
        self.counter = itertools.count()
        self.prompts: list[list[int]] = []
        self.port = free_port()

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "max_model_len": 4096}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            body = await request.json()
            if isinstance(body["prompt"], str):      # a text prompt: its "tokens" are its bytes here
                body["prompt"] = list(body["prompt"].encode())
            n = next(self.counter)
            self.prompts.append(body["prompt"])
            if self.fail_every and n % self.fail_every == self.fail_every - 1:
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
            drop = self.drop_every and n % self.drop_every == self.drop_every - 1
            return StreamingResponse(self._stream(body, n, drop), media_type="text/event-stream")

        return app

    async def _stream(self, body, n, drop):
        max_tokens, sent = body["max_tokens"], 0
        while sent < max_tokens:
            k = min(1 + (sent + n) % self.max_chunk, max_tokens - sent)
            ids = [(sum(body["prompt"][:4]) + sent + j) % 1000 for j in range(k)]
            sent += k
            chunk = {"id": f"c{n}", "choices": [{"index": 0, "text": " t" * k, "token_ids": ids}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(self.delay_s)
            if drop and sent >= max_tokens // 2:
                raise RuntimeError("connection dropped on purpose")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": sent}
        yield f"data: {json.dumps({'id': f'c{n}', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    def __enter__(self):
        import uvicorn

        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="critical",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bs.add_arguments(parser)
    args = parser.parse_args(["--no-progress", "--api-key", ""])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_http_sweep_at_concurrency_1_and_8(tmp_path, capsys):
    out, png = tmp_path / "r.jsonl", tmp_path / "p.png"
    with FakeOpenAI() as server:
        rc = bs.main(_args(url=server.url, isl=64, osl=20, concurrency="1,8", num_requests=24,
                           warmup=2, gpus=2, output=str(out), plot=str(png), label="test-cpu"))
    assert rc == 0
    lines = _lines(capsys)
    assert [ln["bench"] for ln in lines] == ["serve", "serve", "serve_summary"]
    for line, c in zip(lines, (1, 8)):
        assert line["concurrency"] == c and line["model"] == "fake-model" and line["api"] == "http"
        assert (line["requests"], line["errors"], line["token_mismatches"]) == (24, 0, 0)
        assert line["output_tokens"] == 24 * 20 and line["input_tokens"] == 24 * 64
        assert (line["isl"], line["osl"], line["scenario"], line["range_ratio"]) == (64, 20, None, 1.0)
        assert (line["mean_input_len"], line["mean_output_len"]) == (64, 20)
        assert 0 < line["ttft_p50_s"] <= line["ttft_p99_s"] < line["e2e_p99_s"]
        assert line["itl_p50_s"] > 0 and line["output_tok_s_per_user"] > 0
        assert line["output_tok_s_per_gpu"] == pytest.approx(line["output_tok_s"] / 2, rel=1e-3)
        assert line["git_sha"] and line["label"] == "test-cpu" and line["client_lag_p99_s"] >= 0
    assert len(server.prompts) == 2 + 48 and all(len(p) == 64 for p in server.prompts)
    assert len({tuple(p) for p in server.prompts}) == 50  # no prompt reused across levels
    summary = lines[-1]
    assert [lv["concurrency"] for lv in summary["levels"]] == [1, 8]
    assert summary["total_requests"] == 48 and summary["total_errors"] == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_scenario_sends_inferencemax_random_lengths_and_records_them(capsys):
    with FakeOpenAI(max_chunk=16) as server:
        rc = bs.main(_args(url=server.url, scenario="1k1k", concurrency="4", num_requests=12, warmup=0))
    assert rc == 0
    level, summary = _lines(capsys)
    sent = [len(p) for p in server.prompts]
    assert all(819 <= n <= 1024 for n in sent) and len(set(sent)) > 6
    planned = wl.synthetic_specs(1024, 1024, 12, 4000, (0, 0), 0.8)  # --seed 0, first level
    assert sorted(sent) == sorted(s.prompt_len for s in planned)
    assert (level["scenario"], level["isl"], level["osl"], level["range_ratio"]) == ("1k1k", 1024, 1024, 0.8)
    assert summary["range_ratio"] == 0.8
    assert level["input_tokens"] == sum(sent) and level["mean_input_len"] == round(sum(sent) / 12, 1)
    assert (level["errors"], level["token_mismatches"]) == (0, 0)  # each got its own max_tokens
    assert level["output_tokens"] == sum(s.max_tokens for s in planned) < 1024 * 12
    assert level["mean_output_len"] == round(sum(s.max_tokens for s in planned) / 12, 1)
    assert summary["levels"][0]["mean_output_len"] == level["mean_output_len"]


def test_text_corpus_windows_are_seeded_and_have_their_length(tmp_path):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (corpus_dir / "b.md").write_text("# Notes\n\nSome *markdown* text, with punctuation; and more.\n" * 30)
    (corpus_dir / "skip.bin").write_bytes(b"\xff\xfe")
    corpus = wl.TextCorpus(str(corpus_dir), "tiny")
    from tokenizers import Tokenizer
    from splitserve.models import resolve_model
    tok = Tokenizer.from_file(f"{resolve_model('tiny')}/tokenizer.json")
    a, b = corpus.prompt((0, 1), 50), corpus.prompt((0, 2), 50)
    assert isinstance(a, str) and a != b and corpus.prompt((0, 1), 50) == a
    assert abs(len(tok.encode(a, add_special_tokens=False).ids) - 50) <= 2   # edges may re-tokenize
    assert len(corpus.prompt((3,), 5000)) > 1000                # longer than the corpus: it wraps
    with pytest.raises(wl.BenchInputError):
        wl.TextCorpus(str(tmp_path / "none.txt"), "tiny")


def test_http_sweep_with_text_prompts(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def hello(name):\n    return f'hello {name}'\n" * 200)
    with FakeOpenAI() as server:
        rc = bs.main(_args(url=server.url, isl=32, osl=8, concurrency="2", num_requests=6, warmup=0,
                           corpus=str(corpus), tokenizer="tiny"))
    assert rc == 0
    level, summary = _lines(capsys)
    assert (level["errors"], level["token_mismatches"], level["prompts"]) == (0, 0, "text")
    # the server's count (here: the prompts' bytes) is what input_tokens adds up
    assert level["input_tokens"] == sum(len(p) for p in server.prompts) > 6 * 32
    with pytest.raises(wl.BenchInputError):
        bs.make_plan(_args(isl=8, osl=8, corpus=str(corpus), tokenizer=None))


def test_failed_requests_are_counted_and_the_run_completes(capsys):
    with FakeOpenAI(fail_every=4, drop_every=5) as server:
        rc = bs.main(_args(url=server.url, isl=16, osl=12, concurrency="8", num_requests=40, warmup=0))
    assert rc == 0
    level, summary = _lines(capsys)
    assert level["requests"] == 40
    kinds = level["error_kinds"]
    assert kinds.get("http_500") == 10 and sum(kinds.values()) == level["errors"]
    assert level["errors"] >= 16  # 10 500s + the dropped streams among the other 30
    assert level["output_tokens"] == (40 - level["errors"]) * 12 and level["token_mismatches"] == 0
    assert summary["total_errors"] == level["errors"]


def test_api_key_and_unreachable_server(capsys):
    with FakeOpenAI(api_key="sekrit") as server:
        assert bs.main(_args(url=server.url, model="fake-model", isl=8, osl=4, concurrency="2",
                             num_requests=4, warmup=0, api_key="wrong")) == 0
        assert bs.main(_args(url=server.url, isl=8, osl=4, concurrency="2", num_requests=4,
                             warmup=0, api_key="sekrit")) == 0
    wrong, _, right, _ = _lines(capsys)
    assert wrong["error_kinds"] == {"http_401": 4}
    assert right["errors"] == 0 and right["output_tokens"] == 16
    dead = f"http://127.0.0.1:{free_port()}"
    assert bs.main(_args(url=dead, model="m", isl=8, osl=4, concurrency="2", num_requests=3,
                         warmup=0, timeout_s=5.0)) == 0
    level, _ = _lines(capsys)
    assert level["errors"] == 3 and level["error_kinds"] == {"ConnectError": 3}
    assert bs.main(_args(url=dead, isl=8, osl=4)) == 2  # no --model and nothing to ask


def test_per_request_timeout(capsys):
    with FakeOpenAI(delay_s=0.05) as server:
        assert bs.main(_args(url=server.url, isl=8, osl=100, concurrency="2", num_requests=2,
                             warmup=0, timeout_s=0.3)) == 0
    level, _ = _lines(capsys)
    assert level["error_kinds"] == {"timeout": 2}


def test_bad_flags_exit_2(capsys):
    assert bs.main(_args(isl=8, osl=8, scenario="1k1k")) == 2
    assert bs.main(_args(isl=8)) == 2
    assert bs.main(_args(scenario="3x")) == 2
    assert bs.main(_args(scenario="1k1k", concurrency="0")) == 2
    assert "exactly one of" in capsys.readouterr().err


def test_trace_replay_sends_shared_prefixes_on_time(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 40, "hash_ids": [0, 1]},
            {"timestamp": 200, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 2]},
            {"timestamp": 400, "input_length": 600, "output_length": 40, "hash_ids": [7, 8]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with FakeOpenAI() as server:
        rc = bs.main(_args(url=server.url, trace=str(path), trace_scale=0.5, speedup=2.0, warmup=0))
    assert rc == 0
    level, summary = _lines(capsys)
    assert level["mode"] == "replay" and level["concurrency"] is None and level["trace"] == "t.jsonl"
    assert (level["requests"], level["errors"], level["token_mismatches"]) == (3, 0, 0)
    assert level["output_tokens"] == 60 and level["input_tokens"] == 500 + 750 + 300
    assert level["duration_s"] >= 0.2  # the last arrival is at 400 ms / 2
    a, b, c = server.prompts
    assert (len(a), len(b), len(c)) == (500, 750, 300)
    assert a[:500] == b[:500] and a[:256] != c[:256]


class FakeGeneration:
    """A grpc Generation server streaming deterministic tokens, 2 per message."""

    def __init__(self):
        import grpc

        from proto.splitserve.v1 import generation_pb2 as pb
        from proto.splitserve.v1 import generation_pb2_grpc as pb_grpc

        class Servicer(pb_grpc.GenerationServicer):
            def ListModels(self, request, context):
                return pb.ListModelsResponse(models=[pb.ModelInfo(id="grpc-model", max_model_len=2048)])

            def Generate(self, request, context):
                n, total = request.sampling.max_tokens, 0
                while total < n:
                    k = min(2, n - total)
                    total += k
                    last = total == n
                    time.sleep(0.0005)
                    yield pb.GenerateResponse(
                        token_ids=list(range(total - k, total)),
                        finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                        usage=pb.Usage(prompt_tokens=len(request.token_ids.ids),
                                       completion_tokens=total) if last else None)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_GenerationServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(grace=None)


def test_grpc_sweep(capsys):
    with FakeGeneration() as server:
        rc = bs.main(_args(url=f"grpc://127.0.0.1:{server.port}", isl=100, osl=33, concurrency="1,8",
                           num_requests=10, warmup=1, vocab_size=100))
    assert rc == 0
    lines = _lines(capsys)
    for line in lines[:2]:
        assert line["api"] == "grpc" and line["model"] == "grpc-model" and line["isl"] == 100
        assert (line["requests"], line["errors"], line["token_mismatches"]) == (10, 0, 0)
        assert line["output_tokens"] == 10 * 33 and line["input_tokens"] == 10 * 100
    assert lines[-1]["bench"] == "serve_summary"


def test_processes_split_the_concurrency_and_a_lagging_client_is_flagged(capsys):
    from splitserve.bench.procs import shares
    from splitserve.bench.serve import warn_client_lag

    assert shares(10, 4) == [3, 3, 2, 2] and sum(shares(512, 8)) == 512 and shares(1, 2) == [1, 0]
    calm = {"client_lag_p99_s": 0.0004, "itl_p50_s": 0.010, "concurrency": 8}
    warn_client_lag(calm)
    assert calm["client_lag_distorts_itl"] is False and capsys.readouterr().err == ""
    late = {"client_lag_p99_s": 0.030, "itl_p50_s": 0.010, "concurrency": 512, "processes": 1}
    warn_client_lag(late)
    assert late["client_lag_distorts_itl"] is True and "--processes" in capsys.readouterr().err
