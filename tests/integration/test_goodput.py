"""`splitserve bench goodput` end to end, as a user runs it (the real CLI in a subprocess):

- against a plain OpenAI-compatible server that is not Splitserve (tests/integration/
  fifo_openai_server.py: random routing to FIFO single-request servers, an M/D/1 queue each), whose
  goodput is known in closed form: the search must find it within a tolerance;
- against Splitserve (`serve --mock` on the tiny model): the same command, the same JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from runtime.redis_embedded import free_port
from tests.integration.cluster import ROOT, own_cluster, until
from tests.integration.fifo_openai_server import closed_form_goodput

pytestmark = pytest.mark.slow

# Each request holds its server 200 ms: long beside the stalls of a loaded 2-core machine, and 8
# servers make the goodput ~23 req/s, so that a 12 s probe sends ~280 requests there.
QUEUES, PREFILL_MS, TOKEN_MS, OSL = 8, 80.0, 20.0, 7
TTFT_MS, ITL_MS = PREFILL_MS + 400.0, 3 * TOKEN_MS         # a wait of up to 2 service times; ITL always met


def goodput(url: str, *argv: str, timeout_s: float = 400) -> tuple[list[dict], str]:
    r = subprocess.run([sys.executable, "-m", "splitserve", "bench", "goodput", "--url", url, "--no-progress",
                        *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, f"bench goodput exited with {r.returncode}:\n{r.stderr[-3000:]}"
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()], r.stderr


@pytest.fixture(scope="module")
def fifo_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.fifo_openai_server", "--port", str(port),
                             "--queues", str(QUEUES), "--prefill-ms", str(PREFILL_MS), "--token-ms", str(TOKEN_MS)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        until(up, 30, 0.1, "the FIFO server")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_search_finds_the_closed_form_goodput_of_a_plain_openai_server(fifo_server, tmp_path):
    out, png = tmp_path / "goodput.jsonl", tmp_path / "goodput.png"
    lines, err = goodput(fifo_server, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS), "--isl", "16",
                         "--osl", str(OSL), "--duration-s", "12", "--start-rate", "8", "--precision", "0.15",
                         "--output", str(out), "--plot", str(png))
    summary = lines[-1]
    held_s = httpx.get(f"{fifo_server}/stats").json()["mean_held_s"]
    # the closed form at the service time the server really kept and the client's own idle overhead
    overhead_s = summary["idle"]["ttft_p50_s"] - PREFILL_MS / 1000
    want = QUEUES * closed_form_goodput(held_s, (TTFT_MS - PREFILL_MS) / 1000 - overhead_s, 0.9)
    nominal_s = (PREFILL_MS + (OSL - 1) * TOKEN_MS) / 1000
    assert held_s >= nominal_s
    if held_s > 1.5 * nominal_s:        # its sleeps ran 50% late: an M/D/1 queue no longer
        pytest.skip(f"the machine is too loaded to keep the test server's timing ({held_s:.3f} s a request)")
    found = summary["goodput_req_s"]
    curve = [(c["rate_req_s"], c["attainment"]) for c in summary["attainment_curve"]]
    probes = [x for x in lines if x["bench"] == "goodput_probe"]
    assert 0.7 * want <= found <= 1.2 * want, (f"goodput {found} req/s, closed form {want:.2f}; curve {curve}; "
                                               f"client lag p99 {[p['client_lag_p99_s'] for p in probes]}")
    assert summary["stop_reason"] == "converged" and summary["converged"]
    lo, hi = summary["bracket_req_s"]
    assert lo == found and hi - lo <= 0.15 * lo
    assert all(a >= 0.9 for r, a in curve if r <= lo) and all(a < 0.9 for r, a in curve if r >= hi)
    # the ITL target is 3x the server's token gap: only the machine's own stalls miss it
    assert all(p["errors"] == 0 and p["itl_attainment"] >= 0.95 for p in probes), probes
    assert all(abs(p["requests"] - 12 * p["rate_req_s"]) <= 1 for p in probes)
    assert summary["goodput_req_s_per_gpu"] == found and summary["total_errors"] == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"goodput {found:g} req/s" in err


def test_targets_an_idle_server_misses_say_so_instead_of_searching(fifo_server):
    lines, err = goodput(fifo_server, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(TOKEN_MS / 2), "--isl", "16",
                         "--osl", str(OSL), "--warmup", "0", timeout_s=60)
    assert [x["bench"] for x in lines] == ["goodput_alone", "goodput"]
    assert lines[-1]["goodput_req_s"] == 0.0 and lines[-1]["stop_reason"] == "unattainable"
    assert "the targets are never met" in err and "mean ITL" in err


def test_goodput_of_splitserve(tmp_path):
    with own_cluster("--model", "tiny", "--mock", "--prefill-workers", "0", tmp_dir=tmp_path) as c:
        lines, err = goodput(c.url, "--ttft-ms", "2000", "--itl-ms", "200", "--isl", "64", "--osl", "8",
                             "--duration-s", "3", "--start-rate", "1", "--max-probes", "3", "--gpus", "1")
        c.wait_idle()
    summary = lines[-1]
    assert [x["bench"] for x in lines] == ["goodput_alone"] + ["goodput_probe"] * 3 + ["goodput"]
    assert summary["model"] == "tiny" and summary["total_errors"] == 0
    assert summary["goodput_req_s"] >= 1.0 and summary["stop_reason"] in ("max_probes", "converged")
    assert all(x["token_mismatches"] == 0 for x in lines[:-1])


def test_device_study_runs_its_smallest_configuration_on_the_cpu(tmp_path):
    """bench/device/goodput_study.py as the lead runs it on the GPUs, here with mock workers: it
    starts Redis, the worker and a frontend by hand, runs bench goodput within its budget, and
    writes every record to its output."""
    r = subprocess.run([sys.executable, "bench/device/goodput_study.py", "--mock", "--gpus", "1",
                        "--workloads", "64/8", "--targets", "loose", "--budget-s", "150", "--min-run-s", "20",
                        "--probe-duration-s", "2", "--max-probes", "2", "--start-in-flight", "2",
                        "--frontend-args=--itl-guard-mode budget", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "goodput_study.jsonl").read_text().splitlines()]
    kinds = [x["bench"] for x in lines]
    assert kinds[0] == "goodput_alone" and kinds[-2:] == ["goodput_study_run", "goodput_study_logs"]
    result = next(x for x in lines if x["bench"] == "goodput")
    assert result["goodput_req_s"] > 0 and result["total_errors"] == 0 and "agg1" in result["label"]
    run = lines[-2]
    assert (run["config"], run["workload"], run["target"], run["exit"]) == ("agg1", "64/8", "loose", 0)
    assert run["frontend_args"] == "--itl-guard-mode budget"
    assert run["counters"]["splitserve_prefill_remote_total"] == 0          # aggregated: nothing remote
    assert all(log["error_lines"] == 0 and log["tracebacks"] == 0 for log in lines[-1]["logs"].values())
    assert (tmp_path / "goodput_agg1_64x8_loose.png").is_file()


def test_probes_split_over_client_processes(fifo_server):
    """--processes 2: each probe's Poisson arrivals are sent by two client processes (every other
    request each, at its own arrival time) and merged into one probe of the full size."""
    lines, _ = goodput(fifo_server, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS), "--isl", "16",
                       "--osl", str(OSL), "--duration-s", "4", "--start-rate", "8", "--max-probes", "2",
                       "--processes", "2", timeout_s=120)
    probes = [x for x in lines if x["bench"] == "goodput_probe"]
    assert len(probes) == 2 and all(p["processes"] == 2 for p in probes)
    for p in probes:
        assert abs(p["requests"] - 4 * p["rate_req_s"]) <= 1 and p["errors"] == 0
        assert p["token_mismatches"] == 0
    assert probes[0]["attainment"] >= 0.9       # 8 req/s is a third of this server's goodput
    assert 3.0 <= probes[0]["duration_s"] <= 10.0     # one probe's span, not two run one after the other


def test_bad_process_count_is_refused(fifo_server):
    r = subprocess.run([sys.executable, "-m", "splitserve", "bench", "goodput", "--url", fifo_server, "--ttft-ms",
                        "500", "--itl-ms", "60", "--isl", "16", "--osl", "4", "--processes", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--processes must be >= 1" in r.stderr
