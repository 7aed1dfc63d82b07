"""lm-evaluation-harness against `serve`: its `local-completions` model runs a loglikelihood task and
a perplexity task end to end (tasks and data written here; nothing is downloaded), and its
loglikelihoods equal HF transformers' on the tiny model within 1e-4, aggregated and disaggregated.

lm-eval sends `echo: true, logprobs: 1, max_tokens: 1` to /v1/completions and reads the prompt's
token logprobs back; it finds /tokenizer_info and /tokenize and tokenizes through them (its remote
tokenizer). The reference: the same token sequences, tokenized by that same lm-eval model object,
scored by HF transformers' model in float32.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import httpx
import pytest
import torch

from splitserve.models import resolve_model
from tests.integration.cluster import metric, own_cluster

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

QUESTIONS = [("def add(a, b):", [" return a + b", " pass", " import os"]),
             ("class Point:", [" pass", "\n    x = 0", " def"]),
             ("for i in range(10):", [" print(i)", " break", " yield"])]
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "import sys\n\ndef main(argv):\n    return len(argv)\n",
         "Lists, dictionaries and sets are the containers of Python."]
MAX_LENGTH = 512


def _write_tasks(root: Path) -> Path:
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "choice.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n"
                                               for q, c in QUESTIONS))
    (data / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "tiny_choice.yaml").write_text(f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / 'choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
""")
    (tasks / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / 'ppl.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""")
    return tasks


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()


def _hf_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(context)
    return sum(lp[n + i - 1, t].item() for i, t in enumerate(continuation))


def _evaluate(url: str, tmp_path: Path, monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=name, max_length=MAX_LENGTH,
                             num_concurrent=1, max_retries=1)
    assert lm.tokenizer_backend == "remote"          # found /tokenizer_info and /tokenize
    tm = TaskManager(include_path=str(_write_tasks(tmp_path)), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice", "tiny_ppl"], task_manager=tm, log_samples=True,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return lm, out


def _check_against_hf(lm, out, hf) -> None:
    choice_samples = out["samples"]["tiny_choice"]
    assert len(choice_samples) == len(QUESTIONS)
    for s in choice_samples:
        for args, resp in zip(s["arguments"], s["resps"]):
            ctx, cont = _pair(args)
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
            assert abs(resp[0][0] - _hf_logprob(hf, ctx_ids, cont_ids)) < 1e-4
    ppl_samples = out["samples"]["tiny_ppl"]
    assert len(ppl_samples) == len(TEXTS)
    for s in ppl_samples:
        text = _pair(s["arguments"][0])[0]
        tokens = lm.tok_encode(text)
        assert len(tokens) < MAX_LENGTH                     # one rolling window: [prefix] + tokens
        want = _hf_logprob(hf, [lm.prefix_token_id], tokens)
        assert abs(s["resps"][0][0] - want) < 1e-4, (s["resps"][0][0], want)
    ppl = out["results"]["tiny_ppl"]["word_perplexity,none"]
    assert math.isfinite(ppl) and ppl > 1


def _pair(args) -> tuple[str, ...]:
    """A logged request's arguments: a tuple, or lm-eval's {"gen_args_0": {"arg_0": ..}} form."""
    if isinstance(args, dict):
        args = next(iter(args.values())) if "arg_0" not in args else args
        return tuple(args[f"arg_{i}"] for i in range(len(args)))
    return tuple(args)


def test_lm_eval_aggregated_matches_hf(tmp_path, monkeypatch, hf_model):
    with own_cluster("--model", "tiny", "--prefill-workers", "0", "--max-num-batched-tokens", "64",
                     tmp_dir=tmp_path / "cluster") as c:
        lm, out = _evaluate(c.url, tmp_path, monkeypatch)
        _check_against_hf(lm, out, hf_model)


def test_lm_eval_disaggregated_matches_hf(tmp_path, monkeypatch, hf_model):
    with own_cluster("--model", "tiny", "--prefill-workers", "1", "--decode-workers", "1",
                     "--remote-prefill-min-tokens", "1", tmp_dir=tmp_path / "cluster") as c:
        lm, out = _evaluate(c.url, tmp_path, monkeypatch)
        assert metric(c.url, "splitserve_prefill_remote_total") > 0     # the prefill worker computed them
        _check_against_hf(lm, out, hf_model)
